"""The row gate: a garbage row left out of the update of the step that first meets it.

Bad data spread thinly (healing benchmark, thin_bad_data: a quarter of one step's rows turned to
random tokens every 8 steps on debug, 120 steps) cost +4.7% of final loss whether the orchestrator
ran or not. The rows rule (orchestrator/outliers.py) names a row only when it stays an outlier,
and at 1.4 epochs most garbage is never met again: its harm is done the first time it is trained.
So the gate acts inside that step, before the backward: a row is left out of the step's objective
(its targets ignored: no gradient, to the head or the trunk) when both

- its target tokens are mostly distinct (`min_distinct` of them; read on the host from the
  micro-batch's targets, which the loader builds there: no device read). Random tokens over a
  vocabulary of V are nearly all distinct in a row of T << V; text repeats its words. Measured on
  debug (512 tokens, rows of 64 targets): garbage 0.86-1.0, clean rows 0.16-0.88; and
- its mean loss in the step's forward stands above the median of the last `window` rows by
  max(`sigma` x their spread, `min_gap`) (the rows rule's bar, a rolling window kept on the
  device; the spread the MAD of successive rows' differences: a young run's falling loss is no
  noise). Only the few rows of the first kind are scored, without gradient, from the forward's
  hidden states before the loss that trains, with up to CONTROL_ROWS ordinary rows of the
  micro-batch beside them: a head pass over those rows alone. Beside ordinary rows the model
  has learnt, a row that scores as random tokens would under the model's own predictions
  (null_scores: z > -UNIFORM_Z) is gated at `sigma` x the spread above max(the reference's median,
  theirs), without the `min_gap` floor (random tokens over a 300-token vocabulary stand under a
  nat above an imported model's text); and the gate stands down where the ordinary rows stand
  out as well (a whole step unusual: a spike, damaged weights) or score as random tokens
  themselves (a model that has not learnt this text). RowGate.gated.

Measured (2026-11-30, 120 steps, rows of 64 targets): of the clean rows of 9 fault-free runs
(debug, debug-moe, debug-mod, debug-hybrid, seeds 1 and 2; debug seed 1234) 60-69 a run had a
distinct share >= 0.8, none within 0.75 nats of the bar of the spread about the median (none gated);
with the spread between neighbours (2026-12-02, 100 steps: debug, debug-moe, debug-hybrid seeds 0-3, and
debug on English text, the licences at a 1,024-token BPE) clean rows come within 0.21-0.65 nats of the
bar at the reference's first steps (5-7: rows 0.04 apart, the bar 0.16 over the median), 1.5 or more
from step 25 on (real text 0.36: its loss lingers near the unigram level); none gated, kept by z
(-4.1 or less on real text, -5.2 on the presets: tests/test_row_gate_margin.py); on thin_bad_data 92 of the
104 garbage rows were gated, 86 at their first sighting (19 of the 23 met ungated came at steps 8
and 16, while the model still scores text near the garbage's loss), no clean row, and the run
ended at 4.260 against 4.171 clean (+2.1%; +4.7% without the gate; docs/orchestrator.md).

A gated row's loss (scored as above) and target count stand in the step's row losses
(training.runtime.RowLosses), marked gated in their third column: the orchestrator reads them with
the rest of the step and journals the step's gated rows as one decision (rule row_gate, skip_data:
left out for the rest of the run too; orchestrator/outliers.py gate_finding). They stand in the step's
reported loss too (the log's): without them a step all of garbage reported the 0 of its empty
objective (bad_batch: 4 steps at loss 0, then a divergence finding from the trend they bent); such a
step is withheld, and judged on what it scored. A step the gate left some rows of is judged on
those it trained: the update gate's ceilings and the monitors read their loss (RowLosses.trained,
orchestrator/readings.py step_metrics; with its garbage scored in, debug at 10x the LR,
bad_rows@10:4, read 6.17 at step 10 against 5.43 trained), and the update's gain is scored on them
(training/gain.py). The objective's divisor stays the step's target count: the gated rows' targets
are known on the device only, and a later micro-batch's not at an earlier one's backward; the
step's gradient shrinks by their share (a quarter of a step in thin_bad_data).

Both features are read against random tokens over the model's vocabulary V, so that a user's
own corpus, on its tokenizer's vocabulary rather than the debug presets' 512, keeps its
legitimate rows. A row's distinct share must also reach what T targets drawn uniformly over V
reach but for `UNIFORM_MISS` of rows (0.83 at V 512 and T 64, about min_distinct; 0.94 at V
4,096), and its loss must reach ln V less `UNIFORM_SLACK`: uniform targets score at least ln V
in expectation under any prediction (Gibbs' inequality), so a row the model predicts better than
that is not random tokens, however far above the median it stands (a kind it is learning).
Measured (2026-12-01): an English corpus (vim's help) with 5% of Japanese text, prepared with
`trimtab data prepare`'s default 4,096-token BPE, debug, 120 steps: 24 of the 55 Japanese rows
scored were gated by the share bar 0.8 alone (31% of the Japanese rows reach it, 9% of the
English ones), the same passages again as the run went on (a gated row trains nothing, so its
kind is never learnt), and the run ended at 5.736 against 5.701 with the gate off; with these
bars none was, 5.701. Code, hex, UUIDs, base64 and minified JSON at 4,096 tokens reach at most
0.91; at 512 the share bar is min_distinct's, as before.

In the LR warm-up the loss cannot tell: the model scores text near ln V too (debug-hybrid,
bad_batch@5: trained on, +0.28 val), and the reference holds under min_reference rows; nor can it
at the first steps after, while random tokens, at ln V, stand under its bar (debug, bad_rows@5:4:
none of 40 garbage rows gated, 40 now; debug-moe alike). So a
candidate is also gated, model-free, when its tokens score as uniform draws over the vocabulary
under the unigram frequencies of the rows trained on (unigram_z > -UNIFORM_Z: text is Zipfian,
its frequent tokens carry a row; training/unigram.py UnigramTables, host counts per micro-batch, a tensor
in the checkpoint's optim.pt, each starting from a prior of its source's own rows: source_sample), once the
frequencies hold UNIGRAM_MIN_TOKENS (from the first micro-batch, with the prior),
unless the model predicts it far better than random tokens (z <= -UNIFORM_Z: a kind the
frequencies have not seen, an imported model's). Measured (2026-12-01, the loader's rows in
order, 200 steps; an upper bound, the model's veto aside): no clean row named on debug,
debug-moe, debug-mod, debug-hybrid at seeds 1-3, small, a prose+code mixture (50/50 and 90/10;
the nearest clean row z = -5.5); of random rows at steps 2, 5 and 10, all named.

In a mixture (data.mix) each source's rows are judged under their own source's frequencies, and a row
those frequencies call text is not gated by the loss's test either (training/unigram.py).

What it cannot see: garbage that repeats tokens (a run of one character, padding) has a low
distinct share, and scores low once seen; nor garbage drawn from a few tokens of the vocabulary
(random bytes, base64: as distinct as a minority script's text). Those are the data screen's
(data/quality.py). Nor, model-free, text shuffled within its row (its unigram frequencies are text's).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trimtab.config.row_rules import RowGateRule
from trimtab.data.batches import collate
from trimtab.training.loss import CHUNK_TOKENS, IGNORE_INDEX
from trimtab.training.unigram import PRIOR_TOKENS, UNIFORM_MISS, UnigramTables

MAD_TO_SIGMA = 1.4826  # a normal distribution's std per median absolute deviation
# nats under ln V: a row mean of uniform tokens stands at ln V + KL(uniform || prediction); its
# spread over 32-64 targets is ~0.3-0.5 nats on the debug presets
UNIFORM_SLACK = 1.0
# the one-sided normal quantile at UNIFORM_MISS: a row whose loss stands this many of its own
# standard errors under what random tokens would score on the model's predictions is not random
UNIFORM_Z = 3.09
# ordinary rows (not candidates) scored beside the candidates: the step's own median and whether
# the model tells its text from random tokens (a head pass over at most this many rows more)
CONTROL_ROWS = 8


def distinct_shares(targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of targets [B, T] (IGNORE_INDEX ignored): the share of its targets that are
    distinct tokens, and its target count."""
    valid = targets != IGNORE_INDEX
    ordered = np.sort(np.where(valid, targets, -1), axis=1)
    new = (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    counts = valid.sum(1)
    distinct = new.sum(1) + (ordered[:, 0] >= 0)
    return distinct / np.maximum(counts, 1), counts


def uniform_shares(vocab: int, counts: np.ndarray) -> np.ndarray:
    """Per row of `counts` targets: the distinct share that random tokens drawn uniformly over
    `vocab` reach but for UNIFORM_MISS of rows; 0 where the vocabulary is unknown (vocab < 2)."""
    if vocab < 2:
        return np.zeros(len(counts))
    return np.array([least_distinct(vocab, int(t)) / max(int(t), 1) for t in counts])


@functools.lru_cache(maxsize=256)
def least_distinct(vocab: int, t: int) -> int:
    """The fewest distinct tokens among t drawn uniformly over `vocab`, but for UNIFORM_MISS of
    draws: t less the repeats' UNIFORM_MISS upper quantile, the repeats counted as Poisson with
    the occupancy problem's mean (t - vocab * (1 - (1 - 1/vocab)^t), ~t^2 / 2 vocab); in log
    space, as a long row's mean (hundreds) underflows exp(-mean)."""
    mean = t + vocab * math.expm1(t * math.log1p(-1 / vocab))
    if mean <= 0:
        return t
    below = 0.0
    for repeats in range(t + 1):
        below += math.exp(repeats * math.log(mean) - mean - math.lgamma(repeats + 1))
        if below >= 1 - UNIFORM_MISS:
            return t - repeats
    return 0


def null_scores(
    hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of hidden states [k, T, D] scored without gradient: each target's loss (flat [k * T],
    0 where ignored), and per row the z-score of its mean loss against random tokens drawn
    uniformly under the model's own predictions: at each position a uniform token scores
    lse - mean(logits) in expectation with variance var(logits) (the log-softmax of a uniform
    draw), so a row of n such tokens has mean sum(lse - mean) / n and standard error
    sqrt(sum var) / n (a sum of independent draws: normal by the central limit theorem). Text the
    model has learned stands far under it (z <= -8.6 for every clean row scored on debug and
    debug-moe, 300 steps); random tokens at z ~ 0. Also each row's mean loss."""
    h, t = hidden.flatten(0, 1), targets.flatten()
    losses = torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
    expected, variance = torch.zeros_like(losses), torch.zeros_like(losses)
    for s in range(0, h.shape[0], CHUNK_TOKENS):
        logits = F.linear(h[s : s + CHUNK_TOKENS], head).float()
        lse = torch.logsumexp(logits, dim=-1)
        tc = t[s : s + CHUNK_TOKENS]
        valid = tc != IGNORE_INDEX
        picked = logits.gather(1, tc.clamp(min=0).unsqueeze(1)).squeeze(1)
        losses[s : s + CHUNK_TOKENS] = (lse - picked) * valid
        expected[s : s + CHUNK_TOKENS] = (lse - logits.mean(-1)) * valid
        variance[s : s + CHUNK_TOKENS] = logits.var(-1, unbiased=False) * valid
    n = (targets != IGNORE_INDEX).sum(1).clamp(min=1)
    means = losses.view(targets.shape).sum(1) / n
    error = variance.view(targets.shape).sum(1).sqrt() / n
    z = (means - expected.view(targets.shape).sum(1) / n) / error.clamp(min=1e-6)
    return losses, means, z


class RowGate:
    """One rank's gate over its own rows; its reference is the rows its training forward scored.
    Per micro-batch: candidates (host, before the tokens go to the device), then mask (before the
    loss that trains), then after it record (the gated rows' losses into the row losses) and
    observe (the reference)."""

    def __init__(self, cfg: RowGateRule, device: torch.device, vocab: int = 0) -> None:
        self.cfg = cfg
        self.vocab = vocab  # the model's: random tokens' distinct share and loss (0: the head's rows, no share bar)
        self.recent = torch.full((cfg.window,), float("nan"), device=device)  # rows' mean losses, a ring
        self.written = 0  # rows offered to the ring (host count: its next place)
        self.judged = 0  # rows of min_targets or more seen: the reference is ready at min_reference
        self.counts = np.zeros(0)  # the micro-batch's target count per row (host)
        self.controls: list[int] = []  # ordinary rows scored beside the candidates (CONTROL_ROWS)
        self.scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # index, losses, gated
        self.unigram = UnigramTables(vocab)  # the model-free test's token frequencies, a table per source
        self.uniform: list[int] = []  # the candidates whose tokens score as uniform draws under their source's
        self.text: list[int] = []  # the candidates their source's frequencies call text (unigram_text)

    def candidates(
        self, targets: torch.Tensor, mix: tuple[np.ndarray, list[str]] | None = None, loader: Any = None
    ) -> list[int]:
        """The rows of a micro-batch's targets (on the host) that may be garbage: mostly distinct
        tokens, enough targets. `mix`: each row's data.mix source (an index into the loader's source
        names, and those names: mix_parts; None: one unnamed source); `loader`: theirs, whose rows give a
        new source's table its prior (source_sample). Read with numpy: no device op."""
        self.scored = None
        if targets.device.type != "cpu":  # a loader that built them on the device: no host copy to read
            self.counts = np.zeros(0)
            return []
        host = targets.numpy()
        index, names = mix if mix is not None else (np.zeros(len(host), dtype=np.int64), [""])
        sample = functools.partial(source_sample, loader) if mix is not None and loader is not None else None
        parts = self.unigram.parts(names, sample)[np.asarray(index, dtype=np.int64)]  # each row's table
        shares, self.counts = distinct_shares(host)
        bar = np.maximum(self.cfg.min_distinct, uniform_shares(self.vocab, self.counts))
        long = self.counts >= self.cfg.min_targets
        picked = (shares >= bar) & long
        z, text = np.full(len(host), np.nan), np.zeros(len(host), dtype=bool)
        if picked.any():  # scored under the frequencies only where a row is a candidate (O(vocab) each)
            z[picked], text[picked] = self.unigram.verdicts(host[picked], parts[picked])
        uniform = z > -UNIFORM_Z
        self.uniform = [int(i) for i in np.flatnonzero(uniform)]
        self.text = [int(i) for i in np.flatnonzero(text)]
        self.unigram.count(host[~uniform], parts[~uniform])
        if self.judged < self.cfg.min_reference:  # the loss's reference not ready: the model-free test alone
            picked = uniform
        others = np.flatnonzero(long & ~picked)  # evenly spread over the micro-batch
        spaced = np.linspace(0, len(others) - 1, min(len(others), CONTROL_ROWS)).astype(int)
        self.controls = [int(i) for i in others[spaced]]
        return [int(i) for i in np.flatnonzero(picked)]

    def threshold(self) -> torch.Tensor:
        """The bar (0-d, on device): the window's median + max(sigma x spread, min_gap)."""
        return self._bar(*self._reference())

    def _reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recent rows' median and their spread (0-d, on device): the MAD of successive rows'
        differences / sqrt 2 (von Neumann's successive differences; rows written one after another,
        one difference across the ring's seam). About the median the spread counted a falling loss's
        trend as noise: debug, bad_rows@10:4 (seed 1234), step 10: 0.27 about the median, 0.064 between
        neighbours, the bar 7.03 over garbage at 6.31-6.58; a trained run's rows 0.30 either way."""
        middle = self.recent.nanmedian()
        steps = self.recent[1:] - self.recent[:-1]
        return middle, steps.abs().nanmedian() * (MAD_TO_SIGMA / math.sqrt(2))

    def _bar(self, middle: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        return middle + (spread * self.cfg.sigma).clamp(min=self.cfg.min_gap)

    def mask(self, hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, picked: list[int]) -> torch.Tensor:
        """The targets with the picked rows that gated() gates ignored (scored without gradient from
        the forward's hidden states, with the control rows; the targets themselves when none is picked)."""
        if not picked:
            return targets
        index = torch.tensor(picked + self.controls, device=targets.device)
        chosen = targets[index]
        with torch.no_grad():
            losses, means, z = null_scores(hidden[index].detach(), head, chosen)
        k = len(picked)
        uniform_loss = math.log(self.vocab or head.shape[0])  # what random tokens score at least (Gibbs)
        floor = uniform_loss - UNIFORM_SLACK  # under it: predicted better than random
        # model-free, but not where the model predicts the row far better than random tokens (z): text of a
        # kind the frequencies have not seen yet (an imported model's data), not random tokens whatever it holds
        uniform = torch.tensor([i in self.uniform for i in picked], device=targets.device) & (z[:k] > -UNIFORM_Z)
        # and only while the loss cannot tell: once the step's ordinary rows score as learnt text (their median
        # z <= -UNIFORM_Z) and random tokens, at ln V or more, clear the loss's bar, the loss's test decides.
        # Frequencies built from one kind of text score a minority kind (a 5% Japanese source beside English: 7
        # of its rows gated in 80 debug steps) as uniform draws. Ordinary rows score as learnt text from the first
        # steps (z -11 at step 5 on debug) while the bar still stands over ln V: debug, bad_rows@5:4, garbage at
        # z -3 to 1 scored 6.2-6.3 against a bar of 6.34-6.40 (ln 512 = 6.24), none gated, val +5.3% over clean
        if k < len(index):
            blind = self._step_bar(means[k:]) >= uniform_loss
            uniform &= (z[k:].median() > -UNIFORM_Z) | blind
        # the loss's test, but not where the row's own source's frequencies call it text: a 5% Japanese source
        # at 16,384-token steps had 28 clean rows gated by the loss alone (distinct shares 0.83-0.88)
        text = torch.tensor([i in self.text for i in picked], device=targets.device)
        loss = self.gated(means[:k], z[:k], means[k:], z[k:]) & ~text
        gated = (loss | uniform) & (means[:k] > floor)  # [k] bool, on device
        self.scored = (index[:k], losses.view(chosen.shape)[:k], gated)
        masked = targets.clone()
        masked[index[:k]] = torch.where(gated.unsqueeze(1), torch.full_like(chosen[:k], IGNORE_INDEX), chosen[:k])
        return masked

    def gated(
        self, means: torch.Tensor, z: torch.Tensor, ordinary: torch.Tensor, ordinary_z: torch.Tensor
    ) -> torch.Tensor:
        """Which candidates (mean losses `means`, z-scores against random tokens `z`) are gated,
        given the micro-batch's ordinary rows scored beside them (on device, no read back): a row
        scoring as random tokens would (z > -UNIFORM_Z) and above the reference. With ordinary rows
        the bar is max(the reference's median, theirs) + sigma x the reference's MAD-based spread,
        and the gate stands down when they say the loss cannot tell garbage here: their median above
        the reference's bar (threshold: a whole step unusual, a spike, damaged weights: its
        ordinary rows stand out as one; a base64-heavy stretch's spike gated an ordinary row), or
        scored as random tokens (z > -UNIFORM_Z: a model that has not learnt this text, or lost it).
        Measured (debug, thin_bad_data's faults, 120 steps): every one of 125 random-token rows
        scored had z > -3.09, every clean row z <= -8.6; the min_gap floor (1 nat) is then not
        needed to keep clean rows: an imported model at 5.0 nats over 300 tokens scores random
        tokens at ln 300 = 5.7 or more, under 1 nat above its text, and they were missed. Without
        ordinary rows (a micro-batch all candidates: bad_batch; one row) the bar is threshold()."""
        random = z > -UNIFORM_Z
        if not len(ordinary):
            return random & (means > self.threshold())
        middle, spread = self._reference()
        step = ordinary.median()
        learnt = (step <= self._bar(middle, spread)) & (ordinary_z.median() <= -UNIFORM_Z)
        return random & learnt & (means > self._step_bar(ordinary))

    def _step_bar(self, ordinary: torch.Tensor) -> torch.Tensor:
        """The bar a candidate scored beside `ordinary` rows stands over (0-d, on device): max(the reference's
        median, theirs) + sigma x the reference's spread."""
        middle, spread = self._reference()
        return torch.maximum(middle, ordinary.median()) + self.cfg.sigma * spread

    def after(self, token_losses: torch.Tensor, targets: torch.Tensor, trained: torch.Tensor) -> torch.Tensor | float:
        """After the micro-batch's loss that trains on `trained`: record, then observe; returns
        the gated rows' summed loss (0-d, on device), for the step's reported loss."""
        gated = self.record(token_losses, targets)
        self.observe(token_losses, trained)
        return gated

    def record(self, token_losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | float:
        """After the loss that trains: the gated rows' scored losses into the per-token losses
        (flat [B * T], 0 at their ignored targets), so the step's row losses show them as scored;
        returns their sum (0. when nothing was scored)."""
        if self.scored is None:
            return 0.0
        index, losses, gated = self.scored
        kept = losses * gated.unsqueeze(1)
        token_losses.view(targets.shape).index_add_(0, index, kept)
        return kept.sum()

    def flags(self, n: int) -> torch.Tensor | None:
        """The micro-batch's rows the gate left out, 0/1 at their positions ([n], on device; None
        when none was scored): for the row losses' gated column, which the orchestrator journals."""
        if self.scored is None:
            return None
        index, _, gated = self.scored
        return torch.zeros(n, device=index.device).index_add_(0, index, gated.float())

    def observe(self, token_losses: torch.Tensor, trained: torch.Tensor) -> None:
        """A micro-batch's rows into the reference: each row of min_targets or more trained targets
        at its mean, unless above the bar (an outlier stays out, as in the rows rule); a gated row
        (its targets ignored in `trained`) never."""
        n = (trained != IGNORE_INDEX).sum(1)
        means = token_losses.view(trained.shape).sum(1) / n.clamp(min=1)
        keep = n >= self.cfg.min_targets
        if self.judged >= self.cfg.min_reference:
            keep &= means <= self.threshold()
        place = torch.arange(self.written, self.written + len(means), device=means.device) % self.cfg.window
        self.recent[place] = torch.where(keep, means, self.recent[place])
        self.written += len(means)
        self.judged += int((self.counts >= self.cfg.min_targets).sum())

    def state_dict(self) -> dict[str, Any]:
        """The reference, for the checkpoint (a resume or a rollback began it empty: no row gated
        for min_reference rows, and a resumed run parted from the one never stopped). Under data
        parallelism every rank's window is its own rows': the checkpoint keeps each rank's and
        gives each its own back (distributed/checkpoint.py with_gates, own_gate). The frequencies'
        tables are tables(), a tensor for optim.pt: as JSON lists they were ~0.8 MB of state.json at
        128K tokens and two sources."""
        values = self.recent.tolist()
        return {
            "recent": [None if v != v else v for v in values],
            "written": self.written,
            "judged": self.judged,
            "sources": self.unigram.sources,  # each table's source, by name (the rows of tables())
        }

    def tables(self) -> torch.Tensor:
        """The frequencies [S, V] (rows: state_dict's sources), for optim.pt (training/checkpointing.py): a
        copy, as a background save writes it while training counts on."""
        return torch.from_numpy(self.unigram.frequencies.copy())

    def load_state_dict(self, state: dict[str, Any], tables: torch.Tensor | None = None) -> None:
        """The saved ring laid out oldest first, its newest `window` kept (the window's size may
        have changed), and the next row written over the oldest, as the saved ring would. The
        frequencies from `tables` (optim.pt's), else from state's JSON lists (an older checkpoint's)."""
        values = [math.nan if v is None else float(v) for v in state["recent"]]
        at = int(state["written"]) % len(values) if values else 0
        ordered = values[at:] + values[:at]
        kept = ([math.nan] * self.cfg.window + ordered)[-self.cfg.window :]
        self.recent.copy_(torch.tensor(kept, dtype=self.recent.dtype))
        self.written, self.judged = 0, int(state["judged"])
        listed = state.get("frequencies") or []  # none: an older checkpoint's
        saved = tables.numpy().astype(np.int64) if tables is not None else np.asarray(listed, dtype=np.int64)
        saved = saved.reshape(-1, saved.shape[-1]) if saved.size else saved  # [V]: an older one's single table
        self.unigram.load(saved, state.get("sources"))  # no "sources": by position, an older checkpoint's

    def snapshot(self) -> tuple[Any, ...]:
        """The gate as a step began (the reference on the device, no host read), for restore: the tables are
        not copied (S x V counts, twice a step), their counts from here on are logged (since) instead."""
        return self.recent.clone(), self.written, self.judged, self.unigram.mark()

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Back to the latest snapshot (an emergency save of the step before, training/emergency.py): the
        counts made since it taken back out of the tables."""
        self.recent.copy_(snapshot[0])
        self.written, self.judged = snapshot[1], snapshot[2]
        self.unigram.restore(snapshot[3])


def mix_parts(loader: Any, rows: list[int]) -> tuple[np.ndarray, list[str]] | None:
    """Each row's data source, as an index into the loader's source names (data.mix's, or data.source's
    alone: the loader numbers a mixture's rows source after source, BatchLoader.base), and those names: the
    gate keys its tables by name, so a later phase's mixture keeps a source's own. None: a loader without."""
    base, names = getattr(loader, "base", None), getattr(loader, "names", None)
    if base is None or not names:
        return None
    return np.searchsorted(base, rows, side="right") - 1, list(names)


def source_sample(loader: Any, name: str) -> np.ndarray | None:
    """The target tokens [R, T] of rows spread evenly over the loader's source `name`, about PRIOR_TOKENS of
    them (its table's prior, training/unigram.py); None: no such source, or rows of another kind."""
    if name not in loader.names or not hasattr(loader.rows, "get"):
        return None
    part = loader.names.index(name)
    first, end = int(loader.base[part]), int(loader.base[part + 1])
    count = min(end - first, max(1, PRIOR_TOKENS // max(loader.rows.length(first), 1)))
    picked = np.linspace(first, end - 1, count).astype(np.int64)
    return collate(loader.rows, [int(i) for i in picked], 0).targets.numpy()


def row_gate(cfg, device: torch.device) -> RowGate | None:
    """The run's gate, or None: orchestrator.row_gate off, or the orchestrator not in auto mode
    (advise journals what it would do; the gate acts inside the step, before anyone could say)."""
    if cfg.orchestrator.mode != "auto" or not cfg.orchestrator.row_gate.enabled:
        return None
    return RowGate(cfg.orchestrator.row_gate, device, vocab=cfg.model.vocab_size)  # set by setup: the tokenizer's
