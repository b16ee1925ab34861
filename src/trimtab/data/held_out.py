"""Which held-out rows a run scores, and their mean loss: one place for the trainer's evaluation
(training/setup.py, training/evaluation.py) and `trimtab eval --held-out` (evaluation/held_out.py).

The rows of documents the data screen flagged and kept (data.garbage_filter=warn) are left out of
the held-out split's scoring where the orchestrator leaves their training rows out (auto mode, or
as a checkpoint's journal decided: orchestrator/screened.py), so val_loss measures the text trained
on, not base64 and noise; where they are trained on (advise, off) they stay scored.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.data.batches import HeldOut, eval_rows
from trimtab.data.dataset import PhaseData, build_phase_data, open_eval_source, open_sources

if TYPE_CHECKING:
    from trimtab.config import DataConfig, RunConfig
    from trimtab.data.packing import ConcatRows, Rows
    from trimtab.data.prepared import ShardedRows
    from trimtab.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def held_out(
    built: PhaseData, micro_budget: int, eval_tokens: int, pad_id: int, seed: int, screened: bool = False
) -> HeldOut:
    """The rows evaluated, train.eval_tokens shared among a mixture's held-out sets by weight,
    split at the starting budget; `seed` (train.seed) draws the orchestrator's reference sample.
    `screened`: the flagged documents' training rows are left out (screened_out), so their
    held-out rows are not scored either."""
    several = len(built.evals) > 1
    weights, names = (built.weights, built.names) if several else ([1.0], [""])
    skips = [flagged_rows(rows) if screened else frozenset() for rows in built.evals]
    sets = [
        (rows, eval_rows(rows, max(1, int(eval_tokens * weight)), skip) if len(rows) - len(skip) else [], name)
        for rows, weight, name, skip in zip(built.evals, weights, names, skips)
    ]
    if left := sum(len(skip) for skip in skips):
        log.info(
            "held-out: %d rows of flagged documents not scored: the orchestrator leaves their training rows out "
            "(data.garbage_filter=warn; orchestrator.mode=advise or off trains and scores them)",
            left,
        )
    return HeldOut(sets, micro_budget, pad_id, seed, skips)


def flagged_rows(rows: Rows | ConcatRows | ShardedRows) -> frozenset[int]:
    """The held-out rows at least half made of documents the screen flagged and kept (data/quality.py
    Flagged): the rule the orchestrator leaves their training rows out by (orchestrator/screened.py)."""
    return frozenset(int(r) for found in rows.flagged_rows() for r in found.rows)


def screened_out(data: DataConfig, cfg: RunConfig) -> bool:
    """Whether the flagged documents' training rows are left out: data.garbage_filter=warn with the
    orchestrator acting (auto); advise and off train on them, so their held-out rows stay scored too."""
    return data.garbage_filter == "warn" and cfg.orchestrator.mode == "auto"


def screened_decisions(state: dict[str, Any] | None) -> dict[int, bool]:
    """{phase: its flagged rows were left out} from a checkpoint's journaled `garbage` decisions
    (orchestrator/screened.py): a resume keeps the held-out split the checkpoint was evaluated on,
    as its loader keeps the skipped rows, even under another orchestrator.mode now."""
    journal = ((state or {}).get("hooks") or {}).get("Orchestrator", {}).get("journal") or []
    found = [d for d in journal if d.get("rule") == "garbage"]
    return {int(d["evidence"]["phase"]): bool(d.get("applied")) for d in found}


def phase_held_out(
    cfg: RunConfig, tok: TextTokenizer, phase: int, state: dict[str, Any] | None, cache: Path | None
) -> HeldOut:
    """A run's held-out rows of phase `phase` (0: data, 1: finetune.data) as its trainer built them
    for the checkpoint `state` (training/setup.py build_phases): for `trimtab eval --held-out`."""
    data, key = (cfg.finetune.data, "finetune.data") if phase else (cfg.data, "data")
    chat = tok.chat
    built = build_phase_data(
        data, open_sources(data, key, chat), tok, cfg.train.seed, cache, open_eval_source(data, key, chat)
    )
    screened = screened_decisions(state).get(phase, screened_out(data, cfg))
    return held_out(built, cfg.train.micro_budget, cfg.train.eval_tokens, tok.pad_id, cfg.train.seed, screened)


def mean_losses(sums: list[list[float]], sources: list[str]) -> dict[str, float]:
    """val_loss over all micro-batches ([summed loss, targets] each), and val_loss/NAME over each
    source's when there are several (a mixture's held-out sets). Added in micro-batch order: the
    same for any world size."""
    groups: dict[str, list[float]] = {"val_loss": [0.0, 0.0]}
    for (loss, count), name in zip(sums, sources if len(set(sources)) > 1 else [""] * len(sums)):
        for key in ["val_loss"] + ([f"val_loss/{name}"] if name else []):
            total = groups.setdefault(key, [0.0, 0.0])
            total[0], total[1] = total[0] + loss, total[1] + count
    return {key: loss / max(count, 1) for key, (loss, count) in groups.items()}
