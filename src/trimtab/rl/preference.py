"""The DPO step's batch: preference pairs drawn in a seeded order, cut into micro-batches of whole
pairs the trainer's loop trains like any other step (training/trainer.py: the loss is
rl/dpo.py's where a micro-batch carries pairs).

`PairLoader` is the loop's loader for a DPO phase: the same protocol as data/batches.py's
BatchLoader (next_batch, regroup after an OOM, skip_rows after a rollback, metrics,
state_dict), so the orchestrator heals DPO steps as it heals pretraining ones. Its state is the
order's position: a resumed run trains exactly the pairs the uninterrupted one did.

Shape legend: N pairs in a micro-batch, B = 2N rows (the chosen responses, then the rejected
ones, pair i's at rows i and N + i), T the longest prompt + response - 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trimtab.config.dpo import DPOConfig
from trimtab.data.arithmetic import SOURCE
from trimtab.data.batches import IGNORE_INDEX, MicroBatch, StepBatch
from trimtab.data.tokenizer import TextTokenizer
from trimtab.rl.batches import Policy, Sum
from trimtab.rl.dpo import DPOTerms, dpo_terms, sequence_logprobs
from trimtab.rl.order import EpochOrder, Ordered, fingerprint
from trimtab.rl.pairs import Tokens
from trimtab.rl.rewards import verifier

# inputs, targets [B, T] -> the policy's and the reference's log-probability at each target [B, T]
Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PairMicroBatch(MicroBatch):
    """Whole pairs (see the shape legend); n_targets: its pairs (its part of the step's count)."""


@dataclass
class PairBatch(StepBatch):
    terms: list[DPOTerms] = field(default_factory=list)  # each micro-batch's sums, filled by the trainer


def collate(pairs: list[Tokens], pad_id: int, rows: list[int]) -> PairMicroBatch:
    """Pairs as one micro-batch: the chosen rows, then the rejected ones; targets only on the
    responses (the prompt is given, not learnt)."""
    width = max(p.width for p in pairs)
    seqs = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    inputs = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for b, (prompt, response) in enumerate(seqs):
        seq, start = prompt + response, len(prompt) - 1  # the first response token's input position
        inputs[b, : len(seq) - 1] = torch.tensor(seq[:-1])
        targets[b, start : start + len(response)] = torch.tensor(response)
    return PairMicroBatch(inputs, targets, len(pairs), rows + rows)


def group_pairs(widths: dict[int, int], budget: int) -> list[list[int]]:
    """The keys of `widths` (a step's pairs, by position) in micro-batches: longest first, filled
    while 2 x pairs x the first (longest) one's width fit `budget` tokens; a pair over it alone."""
    groups: list[list[int]] = []
    for i in sorted(widths, key=lambda i: -widths[i]):
        if groups and 2 * (len(groups[-1]) + 1) * widths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class PairLoader(Ordered):
    """A DPO phase's steps (see the module docstring); `scorer` and `policy` are set by the
    trainer (its model's and the reference's log-probabilities; greedy answers)."""

    def __init__(
        self,
        pairs: list[Tokens],
        held_out: list[Tokens],
        cfg: DPOConfig,
        micro_batch_tokens: int,
        seed: int,
        pad_id: int,
        problems: list[tuple[list[int], str]] | None = None,
        tok: TextTokenizer | None = None,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.pairs, self.held_out, self.cfg, self.pad_id = pairs, held_out, cfg, pad_id
        # data parallelism: every rank draws the step's pairs alike (the order's state is every
        # rank's) and trains every world-th; the pair count that normalises the loss is the step's
        self.rank, self.world = rank, world
        self.all_sum: Sum = lambda values: values  # over the ranks (the trainer's)
        self.problems, self.tok = problems or [], tok  # held-out prompts and answers answered greedily
        # a step's size in tokens, as the OOM handler bounds a micro-batch by
        self.batch_tokens = cfg.pairs_per_step * 2 * max(p.width for p in pairs)
        # train.micro_batch_tokens, 0 (auto) the whole step; an OOM handler may lower it between steps
        self.micro_batch_tokens = micro_batch_tokens or self.batch_tokens
        self.scorer: Scorer | None = None
        self.policy: Policy | None = None
        items = fingerprint((p.prompt, p.chosen, p.rejected) for p in pairs)  # as tokenized
        builtin = cfg.pairs.startswith(SOURCE)  # its pairs are drawn from train.seed
        split = "" if builtin else "dpo.held_out"  # a file's held-out pairs are split off it (rl/dpo_phase.py)
        self.order = EpochOrder(len(pairs), seed, "pairs", "dpo.pairs", items, seeded=builtin, split=split)
        self._window: list[PairBatch] = []  # the steps since metrics() was read
        self._carried: list[float] | None = None  # a resumed checkpoint's window, summed (SUMMED + pairs)

    def next_batch(self) -> PairBatch:
        drawn = [self.order.next() for _ in range(self.cfg.pairs_per_step)]
        rows = drawn[self.rank :: self.world]  # this rank's
        n_tokens = sum(self.pairs[i].positions for i in rows)
        batch = PairBatch([], len(drawn), n_tokens, rows)
        self._window.append(batch)
        return self.regroup(batch)

    def regroup(self, batch: PairBatch) -> PairBatch:
        """The step's pairs cut into micro-batches of the current budget (whole pairs: the loss
        compares a pair's two responses); the step's pair count normalises them all."""
        widths = {k: self.pairs[i].width for k, i in enumerate(batch.rows)}  # by position: a pair drawn twice
        rows = [[batch.rows[k] for k in group] for group in group_pairs(widths, self.micro_batch_tokens)]
        batch.micro = [collate([self.pairs[i] for i in r], self.pad_id, r) for r in rows]
        return batch

    def metrics(self) -> dict[str, float]:
        """The DPO figures over the steps since the last read, per pair (one host read)."""
        window, self._window = self._window, []
        carried, self._carried = self._carried, None
        terms = [t for b in window for t in b.terms]
        if not terms and carried is None:
            return {}
        return summarise(terms, "dpo/", self.all_sum, carried)

    def evaluate(self) -> dict[str, float]:
        """The held-out pairs scored by the policy against the reference: the share the policy
        prefers rightly, the mean margin and loss; with the built-in task, also its held-out
        problems answered greedily (pass@1: the share answered right); {} with neither."""
        figures: dict[str, float] = {}
        if self.held_out:
            terms = []
            for group in group_pairs({i: p.width for i, p in enumerate(self.held_out)}, self.micro_batch_tokens):
                micro = collate([self.held_out[i] for i in group], self.pad_id, group)
                policy, reference = self.scorer(micro.inputs, micro.targets)
                targets = micro.targets.to(policy.device)
                seq = [None if x is None else sequence_logprobs(x, targets) for x in (policy, reference)]
                terms.append(dpo_terms(*seq, (targets != IGNORE_INDEX).sum(-1), self.cfg))
            figures = summarise(terms, "dpo/held_out_")
        if self.problems:
            rollouts = self.policy([p for p, _ in self.problems], None)
            exact, eos = verifier("exact"), self.tok.eos_id
            right = [
                exact(self.tok.decode([t for t in r.tokens if t != eos]), a)
                for r, (_, a) in zip(rollouts, self.problems)
            ]
            figures["dpo/held_out_pass@1"] = sum(right) / len(right)
        return figures

    def state_dict(self) -> dict[str, Any]:
        """The order's position, and the steps not logged yet as their sums over the ranks (every
        rank saves, so each calls the collective)."""
        local = sums_of([t for b in self._window for t in b.terms])
        return {**self.order.state_dict(), "log_window": self.all_sum(local)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken: the next log line averages the steps since
        the last one, as without the stop (the window's sums carried by rank 0 alone, so that the
        sum over the ranks counts them once)."""
        self.order.load_state_dict(state, "DPO")
        window = state.get("log_window") or [0.0]
        self._window, self._carried = [], None
        if window[-1]:  # pairs in it
            self._carried = window if self.rank == 0 else [0.0] * len(window)


SUMMED = ("objective", "correct", "margin", "chosen_reward", "rejected_reward")  # DPOTerms' sums


def sums_of(terms: list[DPOTerms], start: list[float] | None = None) -> list[float]:
    """`start` (zeros by default) plus the micro-batches' sums of SUMMED, then their pair count,
    added one term after another in float64 (one host read): a window resumed from its start's
    sums adds up to what the window uninterrupted did, to the bit."""
    total = list(start) if start is not None else [0.0] * (len(SUMMED) + 1)
    if terms:
        rows = torch.stack([torch.stack([getattr(t, k).detach().double() for k in SUMMED]) for t in terms]).tolist()
        for row, t in zip(rows, terms):
            total = [a + b for a, b in zip(total, [*row, float(t.pairs)], strict=True)]
    return total


def summarise(
    terms: list[DPOTerms], prefix: str, over_ranks: Sum | None = None, carried: list[float] | None = None
) -> dict[str, float]:
    """Per-pair means of micro-batches' sums (`carried`: sums_of earlier ones added; `over_ranks`:
    summed over the data-parallel ranks first): the loss, the preference accuracy (the share of
    pairs whose implicit reward prefers the chosen response), the margin and each reward."""
    *summed, n = (over_ranks or (lambda values: values))(sums_of(terms, carried))
    figures = dict(zip(("loss", "accuracy", "margin", "chosen_reward", "rejected_reward"), (x / n for x in summed)))
    return {prefix + k: v for k, v in figures.items()}
