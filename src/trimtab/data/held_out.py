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

import numpy as np

from trimtab.data.batches import MicroBatch, group_rows, micro_batches
from trimtab.data.dataset import PhaseData, build_phase_data, open_eval_source, open_sources

if TYPE_CHECKING:
    from trimtab.config import DataConfig, RunConfig
    from trimtab.data.packing import ConcatRows, Rows
    from trimtab.data.prepared import ShardedRows
    from trimtab.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def eval_rows(rows: Rows, max_tokens: int, skip: frozenset[int] = frozenset()) -> list[int]:
    """Rows in order while their input positions fit in max_tokens (at least one row), those in
    `skip` passed over (flagged documents' rows the orchestrator leaves out: training/setup.py held_out)."""
    indices: list[int] = []
    n_tokens = 0
    for i in range(len(rows)):
        if i in skip:
            continue
        if indices and n_tokens + rows.length(i) > max_tokens:
            break
        indices.append(i)
        n_tokens += rows.length(i)
    return indices


def eval_batches(rows: Rows, micro_batch_tokens: int, max_tokens: int, pad_id: int) -> list[MicroBatch]:
    """eval_rows of `rows` in micro-batches of the budget."""
    return micro_batches(rows, eval_rows(rows, max_tokens), micro_batch_tokens, pad_id)


class HeldOut:
    """A phase's held-out rows, and their micro-batches at the budget training runs at now.

    Which rows are scored is chosen once (each held-out set's first rows within its share of
    train.eval_tokens); only their grouping follows the training micro-batch budget, which an
    out-of-memory heal lowers (and a resume restores): the evaluation, the orchestrator's probe
    and its reference rows run no larger micro-batches than the training step that just ran out
    of memory, over the same targets, so val_loss stays the same quantity across a re-split. The
    probe is the rows of the first micro-batch at the starting budget, split alike: the baseline
    it is compared with (a good checkpoint's) stays comparable too. The orchestrator's row
    reference is a sample of its own (reference): spread over each whole held-out set, not its
    first rows, which val_loss scores and which can be a single document. `skips`: each set's rows
    its scored indices pass over already (flagged documents': data/held_out.py), which the
    reference passes over too; none by default."""

    def __init__(
        self,
        sets: list[tuple[Rows, list[int], str]],
        budget: int,
        pad_id: int,
        seed: int = 0,
        skips: list[frozenset[int]] | None = None,
    ) -> None:
        kept = [i for i, s in enumerate(sets) if s[1]]
        self.sets = [sets[i] for i in kept]  # (rows, the indices scored, the set's name: "" alone)
        self.skips = [skips[i] if skips else frozenset() for i in kept]  # rows the reference passes over
        self.pad_id = pad_id
        self.seed = seed  # train.seed: which rows the reference sample takes
        self._references: dict[tuple[int, str | None], list[MicroBatch]] = {}  # at this budget
        self.probe_rows = group_rows(self.sets[0][0], self.sets[0][1], budget)[0] if self.sets else []
        self.budget = 0
        self.micro: list[MicroBatch] = []
        self.sources: list[str] = []  # each micro-batch's set
        self.probe: list[MicroBatch] = []
        self.at(budget)

    def at(self, budget: int) -> HeldOut:
        """Split at `budget` (a no-op while the budget stays)."""
        if budget == self.budget:
            return self
        self.micro, self.sources = [], []
        for rows, indices, name in self.sets:
            micro = micro_batches(rows, indices, budget, self.pad_id)
            self.micro += micro
            self.sources += [name] * len(micro)
        self.probe = micro_batches(self.sets[0][0], self.probe_rows, budget, self.pad_id) if self.sets else []
        self.budget, self._references = budget, {}
        return self

    def reference(self, limit: int, part: str | None = None) -> list[MicroBatch]:
        """Up to `limit` held-out rows (`part`: that set's alone; None: all sets' together, each in
        proportion to its rows) in micro-batches of the current budget: the orchestrator's row
        reference (training/view.py held_out_row_losses). A systematic sample of the whole held-out
        split, every len/limit-th row from an offset the seed draws (Cochran, Sampling Techniques,
        1977, ch. 8), so it covers the split's documents in proportion to their size, where the first
        rows val_loss scores are often one document; the same rows at every read. Built once per
        budget. A set's `skips` are not sampled: flagged documents' rows, whose training rows the
        orchestrator leaves out, are no reference for the text trained on (as val_loss scores none)."""
        key = (limit, part)
        if key not in self._references:
            chosen = [(rows, skip) for (rows, _, name), skip in zip(self.sets, self.skips) if part in (None, name)]
            pools = [np.setdiff1d(np.arange(len(rows)), np.fromiter(skip, np.int64)) for rows, skip in chosen]
            picks = spread(sum(len(pool) for pool in pools), limit, self.seed)
            micro, base = [], 0
            for (rows, _), pool in zip(chosen, pools):
                mine = [int(pool[p - base]) for p in picks if base <= p < base + len(pool)]
                micro += micro_batches(rows, mine, self.budget, self.pad_id) if mine else []
                base += len(pool)
            self._references[key] = micro
        return self._references[key]


def spread(n: int, k: int, seed: int) -> np.ndarray:
    """int64 [min(n, k)]: k of range(n) at even spacing n/k from a seeded offset; all n when k >= n."""
    if k >= n:
        return np.arange(n, dtype=np.int64)
    offset = np.random.default_rng([seed, 0x48454C44]).random()  # its own stream: not the loader's orders
    return np.floor((np.arange(k) + offset) * (n / k)).astype(np.int64)


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
