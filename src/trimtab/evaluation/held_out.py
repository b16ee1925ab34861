"""`trimtab eval RUN --held-out` and `trimtab eval RUN --data PREPARED_DIR`: a run's loss on held-out
rows as training scores them (its val_loss, and val_loss/NAME for each source of a mixture).

--held-out       the run's own held-out rows of the phase its checkpoint is in, built from its
                 config as training builds them (data/held_out.py phase_held_out): the rows val_loss
                 scores, flagged documents' rows left out where the checkpoint's journal left their
                 training rows out, so the figures are the run's val_loss/NAME at that checkpoint
PREPARED_DIR     a directory `trimtab data prepare` wrote, cut into rows of the run's data.seq_len:
                 its held-out split (the run's data.eval_fraction, as a run on it holds out) or, with
                 --split all, every row; flagged documents' rows left out as in the run
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trimtab.checkpoint import latest_valid
from trimtab.config import RunConfig
from trimtab.data import TextTokenizer
from trimtab.data.batches import IGNORE_INDEX, HeldOut
from trimtab.data.held_out import flagged_rows, mean_losses, phase_held_out, screened_out
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
    return {"split": split, "flagged_rows_left_out": len(skip), **_scored(model, held, len(indices))}


@torch.no_grad()
def _scored(model: Transformer, held: HeldOut, n_rows: int) -> dict[str, Any]:
    """val_loss over the micro-batches, val_loss/NAME per source of a mixture (training's mean_losses):
    each micro-batch's summed next-token loss over its targets, as the trainer's evaluation adds it."""
    model.eval()
    device, sums = next(model.parameters()).device, []
    for micro in held.micro:
        logits = model(micro.inputs.to(device)).float()  # [B, T, V]
        loss = F.cross_entropy(
            logits.flatten(0, 1), micro.targets.to(device).flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        sums.append([float(loss), micro.n_targets])
    return {"rows": n_rows, "targets": sum(int(n) for _, n in sums), **mean_losses(sums, held.sources)}
