"""`trimtab eval RUN --held-out` and `trimtab eval RUN --data PREPARED_DIR`: a run's loss on held-out
rows as training scores them (its val_loss, and val_loss/NAME for each source of a mixture).

--held-out       the run's own held-out rows of the phase its checkpoint is in, built from its
                 config as training builds them (data/held_out.py phase_held_out): the rows val_loss
                 scores, flagged documents' rows left out where the checkpoint's journal left their
                 training rows out, so the figures are the run's val_loss/NAME at that checkpoint
PREPARED_DIR     a directory `trimtab data prepare` wrote, cut into rows of the run's data.seq_len:
                 its held-out split (the run's data.eval_fraction, as a run on it holds out) or, with
                 --split all, every row; flagged documents' rows left out as in the run. val_loss
                 over it all, and val_loss/NAME for each of the sources it was prepared from (each
                 of its files when from one), named as a mixture's sources are (config.data.source_name)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trimtab.checkpoint import latest_valid
from trimtab.config import RunConfig
from trimtab.config.data import source_name
from trimtab.data import TextTokenizer
from trimtab.data.batches import IGNORE_INDEX, MicroBatch
from trimtab.data.held_out import HeldOut, flagged_rows, mean_losses, phase_held_out, screened_out
from trimtab.data.prepared import PreparedData, ShardedRows
from trimtab.errors import DataError
from trimtab.model import Transformer
from trimtab.paths import cache_dir

MANIFEST = "trimtab-data.json"  # what makes a directory a prepared one (data/prepare.py)


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def run_held_out(run_dir: Path, cfg: RunConfig, model: Transformer, tok: TextTokenizer) -> dict[str, Any]:
    """The run's own held-out figures at its newest valid checkpoint (module docstring)."""
    found = latest_valid(run_dir)
    state = found[1] if found else None
    phase = int((state or {}).get("train", {}).get("phase", 0))
    held = phase_held_out(cfg, tok, phase, state, cache_dir())
    name = "finetune" if phase else "pretrain"
    if not held.micro:
        raise DataError(
            f"{run_dir}: phase '{name}' has no held-out rows (data.eval_fraction=0 or too small a split); "
            "score a file with --data FILE or a prepared directory with --data DIR --split all"
        )
    return {"held_out": name, **_scored(model, held, sum(len(i) for _, i, _ in held.sets))}


def prepared_figures(
    path: str | Path, cfg: RunConfig, model: Transformer, tok: TextTokenizer, split: str
) -> dict[str, Any]:
    """A prepared directory's loss in rows of the run's data.seq_len (module docstring)."""
    data = PreparedData(path, key="--data")
    if not tok.made(data.tokenizer_sha):
        raise DataError(
            f"--data '{path}' was prepared with another tokenizer than the model's; prepare its sources again "
            "with --tokenizer set to the run's tokenizer.json (trimtab data prepare ... --tokenizer RUN/tokenizer.json)"
        )
    d = cfg.data
    fraction = d.eval_fraction if split == "held-out" else 0.0
    screened = screened_out(d, cfg)
    rows = ShardedRows(data, d.seq_len, d.pack, "eval" if split == "held-out" else "train", fraction, screened)
    skip = flagged_rows(rows) if screened else frozenset()
    indices = [i for i in range(len(rows)) if i not in skip]
    if not indices:
        raise DataError(
            f"--data '{path}': its {split} split holds no row of data.seq_len+1={d.seq_len + 1} tokens to score"
            + (f" (data.eval_fraction={d.eval_fraction:g}); pass --split all" if split == "held-out" else "")
        )
    held = HeldOut([(rows, indices, "")], cfg.train.micro_budget, tok.pad_id)
    parts = _parts(data, rows)
    return {"split": split, "flagged_rows_left_out": len(skip), **_scored(model, held, len(indices), parts)}


@dataclass
class _Parts:
    """A prepared directory's target losses summed by part (a source it was prepared from, or a file):
    each target counts toward the part its token's document came from, so a row packed across two
    files counts toward both, and the parts' losses weighted by their targets make val_loss."""

    rows: ShardedRows
    owner: np.ndarray  # int64 [D]: each document's part
    names: list[str]
    sums: np.ndarray  # float64 [parts, 2]: summed loss, targets

    def add(self, micro: MicroBatch, losses: torch.Tensor) -> None:
        """Add a micro-batch's per-target losses ([B, T], 0 where no target) to their parts."""
        owner = np.full(tuple(micro.targets.shape), -1, dtype=np.int64)
        for b, row in enumerate(micro.rows):
            docs = self.rows.target_docs(row)
            owner[b, : len(docs)] = self.owner[docs]
        kept = (micro.targets.numpy() != IGNORE_INDEX) & (owner >= 0)
        np.add.at(self.sums[:, 0], owner[kept], losses.double().cpu().numpy()[kept])
        np.add.at(self.sums[:, 1], owner[kept], 1.0)

    def figures(self) -> dict[str, float]:
        """val_loss/NAME and targets/NAME (its share of the targets) of each part scored."""
        kept = [(name, s, n) for name, (s, n) in zip(self.names, self.sums) if n]
        return {**{f"val_loss/{m}": float(s / n) for m, s, n in kept}, **{f"targets/{m}": int(n) for m, _, n in kept}}


def _parts(data: PreparedData, rows: ShardedRows) -> _Parts | None:
    """The sources `trimtab data prepare` was given, when several; else its files, when several; else None."""
    files, sources = data.manifest["files"], data.manifest.get("sources") or []
    if len(sources) > 1:
        part_of_file = [int(f.get("source", 0)) for f in files]
        names = part_names([str(s.get("source", "")) for s in sources])
    elif len(files) > 1:
        part_of_file, names = list(range(len(files))), part_names([str(f["path"]) for f in files])
    else:
        return None
    owner = np.asarray(part_of_file, dtype=np.int64)[data.doc_files()]
    return _Parts(rows, owner, names, np.zeros((len(names), 2)))


def part_names(paths: list[str]) -> list[str]:
    """Each path's source_name (web for corpus/web.jsonl); where two share one, as many of their
    last path components as tell them apart."""
    names = [source_name(p) for p in paths]
    parts = [Path(p).parts for p in paths]
    for depth in range(1, max(map(len, parts), default=0) + 1):
        if len(set(names)) == len(names):
            break
        names = ["/".join(p[-depth:]) for p in parts]
    return names if len(set(names)) == len(names) else paths


@torch.no_grad()
def _scored(model: Transformer, held: HeldOut, n_rows: int, parts: _Parts | None = None) -> dict[str, Any]:
    """val_loss over the micro-batches, val_loss/NAME per source of a mixture (training's mean_losses)
    or per part of a prepared directory (`parts`): each micro-batch's summed next-token loss over its
    targets, as the trainer's evaluation adds it."""
    model.eval()
    device, sums = next(model.parameters()).device, []
    for micro in held.micro:
        logits = model(micro.inputs.to(device)).float()  # [B, T, V]
        targets = micro.targets.to(device)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        sums.append([float(loss), micro.n_targets])
        if parts is not None:
            each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
            parts.add(micro, each.view_as(targets))
    found = {"rows": n_rows, "targets": sum(int(n) for _, n in sums), **mean_losses(sums, held.sources)}
    return {**found, **(parts.figures() if parts is not None else {})}
