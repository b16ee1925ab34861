"""Steps and micro-batches from token rows: the training loader (one source or a weighted
mixture, resumable, skipping rows a rollback left out) and each data-parallel rank's share of a
step. The held-out rows scored and their micro-batches: data/held_out.py.

Shapes: B rows in a micro-batch, T = its longest row. A row of n input positions stores n+1
tokens: inputs are tokens[:-1], targets tokens[1:].
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np
import torch

from trimtab.data.packing import ConcatRows, Rows
from trimtab.errors import DataError

IGNORE_INDEX = -100  # cross_entropy's default ignore_index
# the way forward from a run that cannot resume on the data given: its weights, not its data order
NEW_RUN = "start a new run from its weights: a new --out with --set train.init_from=RUN (this run's directory)"


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # int64 [B, T], right-padded with pad_id
    targets: torch.Tensor  # int64 [B, T] next tokens; IGNORE_INDEX where masked or padding
    n_targets: int  # number of targets != IGNORE_INDEX
    rows: list[int]  # dataset row of each of the B rows


@dataclass
class StepBatch:
    micro: list[MicroBatch]
    n_targets: int  # sum over micro-batches: the loss is normalized by this
    n_tokens: int  # input positions in the step, padding excluded
    rows: list[int]  # dataset row indices in the step (all ranks' rows under data parallelism)
    shares: list[list[int]] | None = None  # each rank's rows under data parallelism (shard_rows); None: one


def group_rows(rows: Rows, indices: list[int], micro_batch_tokens: int) -> list[list[int]]:
    """Longest first (stable), filled greedily while n_rows * max_len <= micro_batch_tokens;
    sorting by length keeps padding low."""
    groups: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -rows.length(i)):
        # the first row of a group is its longest, so it sets the padded width
        if groups and (len(groups[-1]) + 1) * rows.length(groups[-1][0]) <= micro_batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def micro_batches(rows: Rows, indices: list[int], micro_batch_tokens: int, pad_id: int) -> list[MicroBatch]:
    """`indices` of `rows` grouped (group_rows) and collated into micro-batches of the budget."""
    return [collate(rows, group, pad_id) for group in group_rows(rows, indices, micro_batch_tokens)]


def collate(rows: Rows, indices: list[int], pad_id: int) -> MicroBatch:
    width = max(rows.length(i) for i in indices)
    inputs = np.full((len(indices), width), pad_id, dtype=np.int64)
    targets = np.full((len(indices), width), IGNORE_INDEX, dtype=np.int64)
    for b, i in enumerate(indices):
        tokens, mask = rows.get(i)
        n = len(tokens) - 1
        inputs[b, :n] = tokens[:-1]
        targets[b, :n] = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
    return MicroBatch(
        torch.from_numpy(inputs), torch.from_numpy(targets), int((targets != IGNORE_INDEX).sum()), list(indices)
    )


class BatchLoader:
    """Steps of ~batch_tokens input positions, each source in a reproducible per-epoch shuffled
    order; with several sources (a ConcatRows and their weights), every row goes to the source
    furthest below its share of the tokens drawn since the weights last changed, so each step holds
    the stated proportions to within a row, deterministically (smooth weighted round robin, by tokens)."""

    def __init__(
        self,
        rows: Rows | ConcatRows,
        batch_tokens: int,
        micro_batch_tokens: int,
        seed: int,
        pad_id: int,
        rank: int = 0,
        world: int = 1,
        weights: list[float] | None = None,
        names: list[str] | None = None,
        section: str = "data",
        tokenizer: tuple[str, str] = ("", ""),
    ) -> None:
        if not len(rows):
            raise ValueError("BatchLoader needs at least one row")
        # Every rank draws the same global step and keeps its own share of the rows (see shard_step),
        # so the global batch, the order and the resumable state do not depend on the world size.
        self.rank, self.world = rank, world
        self.rows = rows
        parts = rows.parts if isinstance(rows, ConcatRows) else [rows]
        self.sizes = [len(p) for p in parts]
        self.base = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        weights = weights or [1.0] * len(parts)
        self.weights = [w / sum(weights) for w in weights]
        self.names = names or [f"source{i}" for i in range(len(parts))]
        self.section = section  # the config section of its data (data, finetune.data): for messages
        # the rows' tokenizer: its fingerprint, in the checkpoint, and where it comes from, for the message
        # when a resume's rows differ (another tokenizer of the same size gives as many rows, other tokens)
        self.tokenizer = tokenizer
        self.part_tokens = [p.n_tokens for p in parts]
        self.batch_tokens = batch_tokens
        self.micro_batch_tokens = micro_batch_tokens  # an OOM handler may lower it between steps
        # The budget a resumed checkpoint's steps were cut to, until this session draws a step: what
        # a change of the budget before then replaces (this one starts at the session's config value).
        self.budget_before: int | None = None
        self.seed = seed
        self.pad_id = pad_id
        self._epochs, self._cursors = [0] * len(parts), [0] * len(parts)
        self._orders = [self._permutation(p, 0) for p in range(len(parts))]
        self.drawn = [0] * len(parts)  # tokens served from each source
        # `drawn` when the weights last changed (a resume with another data.mix): the shares are
        # held from there, so new weights apply from the change, not over the tokens drawn before it
        self.since = [0] * len(parts)
        self.skipped = frozenset()  # rows a rollback took out of training (bad data)
        # what each source's rows hold: a resume over other data with as many rows is refused (the
        # order and the rows a rollback left out would then be other rows)
        self.digests = [p.fingerprint() for p in parts]
        self.trained_by = Owners()  # which rank trained each recent row: the one that scores it

    @property
    def epoch(self) -> int:
        """Completed passes: over the one source, or over all a mixture's tokens trained on. Rows left out
        (skip_rows: flagged documents' from the start, a rollback's, the data watch's) are never drawn:
        counted, a mixture 9% garbage had drawn 1.1 passes of its trained tokens at epoch 0."""
        if len(self.sizes) == 1:
            return self._epochs[0]
        if self._left_tokens is None:
            self._left_tokens = sum(self.rows.length(r) for r in self._skipped)
        return int(sum(self.drawn) // max(sum(self.part_tokens) - self._left_tokens, 1))

    def _permutation(self, part: int, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] if part == 0 else [self.seed, part, epoch]  # part 0: the single-source order
        return np.random.default_rng(key).permutation(self.sizes[part])

    def _next_row(self) -> int:
        drawn = [d - s for d, s in zip(self.drawn, self.since)]
        total = sum(drawn)
        part = max(range(len(self.sizes)), key=lambda p: self.weights[p] * total - drawn[p])
        while True:
            if self._cursors[part] == self.sizes[part]:
                self._epochs[part], self._cursors[part] = self._epochs[part] + 1, 0
                self._orders[part] = self._permutation(part, self._epochs[part])
            self._cursors[part] += 1
            row = int(self.base[part] + self._orders[part][self._cursors[part] - 1])
            if row not in self.skipped and self.rows.has_target(row):
                self.drawn[part] += self.rows.length(row)
                return row

    def metrics(self) -> dict[str, float]:
        """Each source's share of the tokens served since the weights last changed (the mix in
        effect; the whole run's when they never did) and its passes over its own data."""
        if len(self.sizes) == 1:
            return {}
        total = max(sum(self.drawn) - sum(self.since), 1)
        out = {}
        for part, (name, drawn, since) in enumerate(zip(self.names, self.drawn, self.since)):
            out[f"data/{name}/share"] = (drawn - since) / total
            # how far through its own shuffled orders, not its tokens drawn over all its tokens: rows left out
            # (garbage, a rollback's window) are passed over, never drawn, so that ratio fell short of the passes
            out[f"data/{name}/epochs"] = self._epochs[part] + self._cursors[part] / self.sizes[part]
        return out

    def skip_rows(self, rows: list[int]) -> int:
        """Never serve these rows again (the data window behind a rollback); each source keeps a row."""
        keep = set(self.skipped)
        keep.update(int(r) for r in rows)
        for part, size in enumerate(self.sizes):
            if sum(1 for r in keep if self.base[part] <= r < self.base[part + 1]) >= size:
                raise DataError(
                    f"skipping these rows would leave no training data in {self.names[part]}; the data itself is bad"
                )
        added = len(keep) - len(self.skipped)
        self.skipped = keep
        return added

    def regroup(self, batch: StepBatch) -> StepBatch:
        """The same rows split into micro-batches of the current budget (after an OOM)."""
        return self._step(batch.rows, batch.n_tokens)

    def next_batch(self) -> StepBatch:
        self.budget_before = None
        indices: list[int] = []
        n_tokens = 0
        while not indices or n_tokens < self.batch_tokens:
            indices.append(self._next_row())
            n_tokens += self.rows.length(indices[-1])
        return self._step(indices, n_tokens)

    def _step(self, indices: list[int], n_tokens: int) -> StepBatch:
        if self.world > 1:
            mbt = self.micro_batch_tokens
            batch = shard_step(self.rows, indices, n_tokens, mbt, self.pad_id, self.rank, self.world)
            self.trained_by.saw(batch.shares or [])
            return batch
        micro = micro_batches(self.rows, indices, self.micro_batch_tokens, self.pad_id)
        return StepBatch(micro, sum(m.n_targets for m in micro), n_tokens, indices)

    @property
    def skipped(self) -> frozenset[int]:
        """Rows never served again (skip_rows). Immutable, so state_dict's sorted copy cannot go stale: a
        change is an assignment (skip_rows, load_state_dict, a rollback's `loader.skipped |= rows` in
        training/checkpointing.py, which makes a new frozenset), and every assignment drops that copy."""
        return self._skipped

    @skipped.setter
    def skipped(self, rows: AbstractSet[int]) -> None:
        self._skipped, self._skipped_sorted = frozenset(rows), None  # frozenset(a frozenset) is that one, no copy
        self._left_tokens: int | None = None  # their tokens, counted again on the next read of epoch

    def _sorted_skipped(self) -> list[int]:
        """state_dict's sorted copy of `skipped`, sorted again only once it changed: an emergency save takes
        the state every step of a data-parallel run (training/emergency.py), and sorting 10,000 skipped rows
        took 7-10 ms a step. A copy: a caller's list never changes the cached one."""
        if self._skipped_sorted is None:
            self._skipped_sorted = sorted(self._skipped)
        return list(self._skipped_sorted)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epochs[0],  # the first source's position at the top level, as before mixtures
            "cursor": self._cursors[0],
            "seed": self.seed,
            "n_rows": self.sizes[0],
            "skipped": self._sorted_skipped(),
            "parts": [self._part_state(p) for p in range(len(self.sizes))],
            "micro_batch_tokens": self.micro_batch_tokens,
            "tokenizer": self.tokenizer[0],
        }

    def _part_state(self, p: int) -> dict:
        return {
            "name": self.names[p],
            "epoch": self._epochs[p],
            "cursor": self._cursors[p],
            "n_rows": self.sizes[p],
            "drawn": self.drawn[p],
            "digest": self.digests[p],
            "weight": self.weights[p],  # a resume under other weights holds them from there (_since)
            "since": self.since[p],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken (its seed wins over the constructor's)."""
        parts = state.get("parts") or [{**state, "drawn": 0}]  # before mixtures: one source, no name
        if len(parts) != len(self.sizes):
            then = [p.get("name") or f"its {self.section}.source" for p in parts]
            # a source the data screen now leaves out, every document junk (data/dataset.py), was trained then
            junk = f" ({self.section}.garbage_filter=off keeps a source of junk)" if set(self.names) < set(then) else ""
            raise DataError(
                f"the checkpoint's data had {len(parts)} sources but the data now has {len(self.sizes)} "
                f"({', '.join(then)} then, {', '.join(self.names)} now); resume with the same "
                f"{self.section}.mix{junk}, or {NEW_RUN}"
            )
        for part, saved in enumerate(parts):  # all checked before any is taken: a refusal changes nothing
            self._check_same_rows(part, saved, state)
        for part, saved in enumerate(parts):
            self._epochs[part], self._cursors[part] = int(saved["epoch"]), int(saved["cursor"])
            self.drawn[part] = int(saved["drawn"])
        self.since = self._since(parts)
        self.budget_before = state.get("micro_batch_tokens")
        self.seed = int(state["seed"])
        self._orders = [self._permutation(p, e) for p, e in enumerate(self._epochs)]
        self.skipped = set(state.get("skipped", []))

    def _since(self, parts: list[dict]) -> list[int]:
        """Where the shares are counted from: the checkpoint's own point under the weights it was
        drawn with, this point under new ones. A checkpoint from before weights were saved counts
        from the start, as it was drawn."""
        saved = [p.get("weight") for p in parts]
        if None in saved:
            return [0] * len(parts)
        if all(math.isclose(float(w), ours, rel_tol=1e-9) for w, ours in zip(saved, self.weights)):
            return [int(p.get("since", 0)) for p in parts]
        return list(self.drawn)

    def _check_same_rows(self, part: int, saved: dict, state: dict) -> None:
        """Refuse to continue a source's order over rows other than those the checkpoint read: its
        positions and the rows a rollback left out would then point at other rows."""
        size, theirs = self.sizes[part], saved.get("name") or f"its {self.section}.source"
        ours = "" if theirs == self.names[part] else f" (from {self.names[part]})"
        if saved["n_rows"] != size:
            raise DataError(
                f"the checkpoint's data loader had {saved['n_rows']} rows in {theirs} but the data now gives "
                f"{size}{ours}; {self._changed(state)}"
            )
        if saved.get("digest", self.digests[part]) != self.digests[part]:  # older checkpoints: none
            raise DataError(
                f"the checkpoint's data loader read other data in {theirs} than the data now gives{ours}: as many "
                f"rows ({size}), other tokens; {self._changed(state)}"
            )

    def _changed(self, state: dict) -> str:
        """What can change the rows between sessions, and the way forward. train.seed is among
        them: it decides which documents are held out for evaluation (packing._hold_out); so is the
        tokenizer, named when its fingerprint differs from the checkpoint's (older ones have none)."""
        saved_seed, fingerprint = int(state["seed"]), state.get("tokenizer") or ""
        if fingerprint and self.tokenizer[0] and fingerprint != self.tokenizer[0]:
            return (
                f"the tokenizer changed: {self.tokenizer[1]} is not the one the checkpoint's rows were tokenized "
                f"with (fingerprint {fingerprint[:12]} then, {self.tokenizer[0][:12]} now); put the run's own "
                f"tokenizer back (data.tokenizer as it was, or the run directory's tokenizer.json), or {NEW_RUN}"
            )
        data = f"the corpus or a {self.section}.* setting"
        if saved_seed == self.seed:
            cause = f"{data} changed, or train.seed (it decides which documents are held out for evaluation)"
            again = f"the {self.section}.* settings, train.seed and corpus it was trained with"
        else:
            cause = (
                f"train.seed changed ({saved_seed} then, {self.seed} now; it decides which documents are held out "
                f"for evaluation), or {data} did"
            )
            again = f"--set train.seed={saved_seed} and the {self.section}.* settings and corpus it was trained with"
        return f"{cause}; resume with {again}, or {NEW_RUN}"


# ------------------------------------------------------------------------------ data parallelism


def shard_rows(rows: Rows, indices: list[int], world: int) -> list[list[int]]:
    """Split a step's rows into `world` disjoint shares of about equal tokens: the rows in the
    order one process groups them (longest first, stable), cut into contiguous runs at equal
    token counts (a row goes to the share holding its middle token). With micro_batch_tokens =
    batch_tokens / world each rank's micro-batch then holds exactly the rows of one of a single
    process's micro-batches, so even batch-dependent routing (MoE capacity and balance loss)
    matches one process. Deterministic: every rank computes every share without communicating."""
    order = sorted(indices, key=lambda i: -rows.length(i))
    total = max(sum(rows.length(i) for i in order), 1)
    shares: list[list[int]] = [[] for _ in range(world)]
    seen = 0
    for i in order:
        n = rows.length(i)
        shares[min(world - 1, int(world * (seen + n / 2) / total))].append(i)
        seen += n
    return shares


class Owners:
    """Which share of its step (shard_rows: the data-parallel rank, or with replica groups the
    group's rank) each recent row was trained in: RunView.row_losses has that rank score it, on its
    own copy of the row, the one it trained on, so one node's copy read corrupt is found; and each
    rank scores its share alone, where every rank scored every row (W times the work). Every rank
    sees the same global steps, so every rank holds the same map. Not checkpointed: rows trained
    before a resume, or more than `limit` rows ago, are cut among the ranks by tokens instead. A
    row corrupt only in a rank's copy that did not train it is not blamed: nothing trained on it
    corrupt yet, and when that rank does, its step is scored then (docs/distributed.md)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self.of: OrderedDict[int, int] = OrderedDict()  # row -> share, the newest last

    def saw(self, shares: list[list[int]]) -> None:
        for k, share in enumerate(shares):
            for row in share:
                self.of[row] = k
                self.of.move_to_end(row)
        while len(self.of) > self.limit:
            self.of.popitem(last=False)

    def split(self, rows: Rows, indices: list[int], first: int, world: int) -> list[list[int]]:
        """Each of `world` ranks' share of `indices` (no row twice): rank i holds the rows trained
        in share first + i; the rest (trained before a resume or by another replica group) cut by tokens."""
        shares: list[list[int]] = [[] for _ in range(world)]
        unknown = []
        for row in dict.fromkeys(indices):
            owner = self.of.get(row, -1) - first
            (shares[owner] if 0 <= owner < world else unknown).append(row)
        for share, extra in zip(shares, shard_rows(rows, unknown, world)):
            share.extend(extra)
        return shares


def shard_step(
    rows: Rows, indices: list[int], n_tokens: int, micro_batch_tokens: int, pad_id: int, rank: int, world: int
) -> StepBatch:
    """This rank's share of a global step, in as many micro-batches as every other rank's.

    n_targets stays the global count, so each rank's summed loss over it adds up (all-reduce sum)
    to the single-process loss and gradient. The micro-batch counts are equal because FSDP gathers
    weights in every forward: a rank with fewer forwards would leave the others waiting."""
    shares = shard_rows(rows, indices, world)
    counts = [len(group_rows(rows, share, micro_batch_tokens)) if share else 0 for share in shares]
    groups = group_rows(rows, shares[rank], micro_batch_tokens) if shares[rank] else []
    while len(groups) < max(counts):
        widest = max(range(len(groups)), key=lambda g: len(groups[g]), default=None)
        if widest is None or len(groups[widest]) == 1:
            break
        group = groups.pop(widest)  # smaller micro-batches cost speed, never the result
        groups[widest:widest] = [group[: len(group) // 2], group[len(group) // 2 :]]
    micro = [collate(rows, group, pad_id) for group in groups]
    while len(micro) < max(counts):  # fewer rows than the others have micro-batches
        micro.append(padding(rows, indices[0], pad_id))
    n_targets = sum(int(rows.get(i)[1][1:].sum()) for i in indices)
    return StepBatch(micro, n_targets, n_tokens, list(indices), shares)


def padding(rows: Rows, row: int, pad_id: int) -> MicroBatch:
    """A micro-batch that trains nothing (every target ignored) and whose score is dropped: it only
    keeps the forward count equal across ranks (FSDP gathers weights in every forward)."""
    micro = collate(rows, [row], pad_id)
    micro.targets.fill_(IGNORE_INDEX)
    return MicroBatch(micro.inputs, micro.targets, 0, [])
