"""Outlier rows: bad data spread thinly, which never spikes a step's loss.

A few garbage documents shuffled through a corpus cost a few percent of final loss without any
step standing out: attribution after a spike (orchestrator/attribution.py) never starts. So every
row of every step is watched, at no extra cost: the training forward reports each row's mean loss
(training.runtime.RowLosses), and a row is an outlier when its loss is above the median of the
last `window` rows by max(sigma x their spread, min_gap), the spread being the median absolute
deviation x 1.4826. This is perplexity filtering (CCNet, Wenzek et al. 2020, arXiv 1911.00359)
done with the model being trained, against its own current distribution rather than a fixed
reference model.

With one source, each row is measured from its step's level (the median of the step's rows, scored
by the same weights in the same forward) and the reference holds such measures: the relative test
attribution.py makes with held-out rows, at no extra cost. Early in training the loss falls ~0.08
nats a step (debug, steps 4-20: 5.7 to 5.0) while a step's rows lie ~0.12 around their median; the
last 16 steps' rows, as they were, stood 0.4 over the step's and spread 0.5 by the fall alone, a
bar ~2.4 nats over the step's median (debug, bad_rows@20, seeds 2-3, the first 40 steps: the
row gate took 11 of the 64 garbage rows, 1.3-2.9 nats over it; no other was even a suspect).
Several outliers at one step (`step_outliers`) are named at once and the next steps' rows watched
(attribution.py), as a spike's are: a hard row is an outlier by chance with some rate p (4 MAD
spreads and `min_gap`: 1 of 2,240 clean rows, debug, seeds 2-3, steps 5-40), k of a step's 32 at
once ~C(32, k) p^k (3: ~5e-6 a step at p = 1/1,000), while a stretch of garbage puts several in
every step (closed testing, the step a family first: Benjamini & Bogomolov 2014, JRSS-B 76(1)).
Once the model has trained on a step of garbage, its like met later scores nearer text: 1.2-1.6 nats
over the step's median (debug, bad_rows@20, seed 3, steps 22-23), under `min_gap`, and 18 of 26
poisoned rows went unseen. So a step's rows between `blame_gap` (1.0 when on) and the bar are a second family,
tested alike: `step_outliers` + 1 of them at once blame the step and are named. Clean rows stand there
at p ~0.6% (debug, seeds 0-3 without faults, steps 5-100: 67 of 11,520 rows, at most 2 at one step:
hard documents, such as quoted-printable test data), so 4 of 32 at once ~C(32, 4) p^4 = 4e-5 a step
(3: 1e-3, some 30 clean rows left out over 10,000 steps). A hard row there beside fresh garbage over
the bar is no family of its own and stays in (seed 3, step 20: a quoted-printable row 1.34 out beside
three garbage rows 1.7-2.1 out). The independence this rests on fails for the rows of one hard document:
a clean 2-rank DDP run (debug, 150 KB of data) had 4 such rows 1.1-1.35 nats out at step 9, and they
were named; so the family is off by default (`blame_gap` 0) and a person who would rather lose a few
clean rows than train on thin garbage turns it on (1.0).
In a mixture each source has its level: the median of its rows in the step where it has LEVEL_ROWS
of them, else its last level moved by the step's trend (the median change of the other sources'
levels; the local level of a trend model, Harvey 1989, "Forecasting, Structural Time Series
Models and the Kalman Filter", ch. 2): a step's mix of sources moves its median, one source's
median does not. Judged by their sources' raw recent losses, a mixture's garbage went unseen (debug,
email beside json, bad_rows@20, 40 steps, garbage rows left out: at 0.5 seeds 1-3 0/31, 0/29, 11/37
before, 7/31, 9/29, 19/37 after; at 0.8 seeds 2-3 7/22, 42/42 before, 12/22, 42/42 after; clean rows
left out unchanged: none, but one by the data watch at 0.8 seed 3). Most garbage missed after step 20 scores
1.1-1.3 nats over its source's level, under `min_gap`, once the model has trained on the first.

Each source of a mixture (data.mix) is its own reference (StepMetrics.row_parts; CCNet too keeps
a perplexity threshold per language): a small source repeated until memorised drags the mixture's
median far under what the other sources' fresh rows score. Soak (debug, three stdlib files at
weight 0.1 beside 6 KB of abc.py at 0.9, 3 epochs: abc.py seen ~45 times, its rows at ~1.1 nats):
judged against the mixture's rows, 8 fresh stdlib rows (~5.4 nats, held-out 4.8) were left out
as 4 nats above the median; judged against their own source's, none. A source's rows are judged
once `min_reference` of its own were seen; the rows it showed before are held and, once it has,
scored again on the then weights (confirm) and judged like any first sighting: an outlier becomes a
suspect, one `certain_gap` out is named. Without it a rare source's first rows (at debug size,
weight 0.08: its first 50 steps) became suspects only at their next epoch.

A hard row is not a bad one: a rarer domain of a mixture or an unusual file scores high the first
time and lower once the model has seen it. So a row is named only when it *stays* an outlier:
`confirm_after` steps after its first sighting it is scored again on the then weights
(RunView.row_losses: a scoring forward, no training), or on its second sighting (the next epoch),
and must be one again; or on its first already by `certain_gap` nats, which text does not reach.
The second sighting is no independent test: a hard clean row stays about as far out an epoch later
(debug, 60 KB, 80 steps, seeds 1-2, 616 rows seen twice ~9 steps apart, each from its step's
median: 11 of the 13 over 0.6 nats at the first were over it again, 7% of all rows; the top ones
0.9-1.1 times as far), so a hard row's chance to be named is about p, not p^2: the bar itself
(min_gap, which no clean row came within 0.6 nats of) is what keeps clean rows in.
Rows seen once are remembered as suspects (up to `max_suspects`, the oldest forgotten first).
Rows with fewer than `min_targets` targets are not judged: a mean over a few tokens (a document's
first line, without context) is noise.

The early look matters when a run sees its data little more than once: at 1.4 epochs most rows
are never sighted again (healing benchmark, thin_bad_data: 2-4 of 104 garbage rows named; the row
gate, training/row_gate.py, leaves random-token rows out of the step that first meets them). Scored
again, a suspect is judged against the same reference (the recent rows' training-forward losses,
each taken before the model trained on its row) while it was trained on once itself, which only
biases it towards not being named. The due suspects of a step are scored in one batch, at most
`confirm_rows`; on a clean run suspects are rare, so the scoring is too.

Nor is any row while the model is unstable: after instability within the escalation window
(StepMetrics.unsettled), or at a step whose rows' median stands min_gap above the reference
(each row measured from its source's median; the loss far above its trend on most rows, which no
bad row explains). An LR far too high scores
legitimate rows 4-5 nats above the others (debug at lr 0.5, step 5: the step's median 8.3 against
6.4 before, its worst row 11.3): named there, clean stdlib files were left out for good. Those
steps' rows stay out of the reference too; a garbage row is met again in a later epoch.
Nor at a step after an update that raised the loss of its own batch (its gain under 0, training/gain.py:
it overshot): the weights that score the step are the update's doing, and a few rows of each step take
it (debug-mod at 10x its LR, step 5's update at gain -3.9: at step 6, 8 clean rows 1.6-3.1 nats over
the step's median 5.6 were named at once as a blamed step, and left out for good).

What it cannot see: garbage the tokenizer splits into many short tokens (random characters,
base64, hex) once the model has learned that mode: each token is then about as predictable as
text's (per token, the healing benchmark's garbage corpus scores at the text's median on the
debug presets' 512-token vocabulary). Per byte it stands out, but so does legitimate text the
small tokenizer splits as finely; a data filter before training (tokenizer fertility, a reference
model) is the tool for it.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.row_rules import RowGateRule
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics, outlier_threshold

# steps whose levels (their rows' median) a step's is compared with: the reference's 512 rows at 32 a step
LEVEL_STEPS = 16
# a mixture source's rows at one step whose median is its level there; fewer: its last level moved by the step's trend
LEVEL_ROWS = 8


class OutlierRows(Monitor):
    rule, family = "rows", "data"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rows
        # healthy rows' losses, the reference, per mixture source ("": the one source): a memorised
        # source's median is no bar for a rarer one's fresh rows (see the module's docstring)
        self.references: dict[str, deque[float]] = {}
        self.suspects: dict[str, float] = {}  # row (a string: JSON keys) -> its gap at its first sighting
        self.due: dict[str, int] = {}  # suspect -> the step it is scored again at (confirm_after)
        self.part_of: dict[str, str] = {}  # suspect -> its mixture source (absent: "")
        self.held: dict[str, str] = {}  # row seen before its source's reference filled -> the source
        self.levels: deque[float] = deque(maxlen=LEVEL_STEPS)  # the last steps' common levels (_level)
        self.part_levels: dict[str, float] = {}  # each source's level at the last step (_level)
        self.last_gain: float | None = None  # the last update's gain (training/gain.py): under 0, it overshot

    def reference(self, part: str = "") -> deque[float]:
        """The recent healthy rows of this mixture source ("": the one source)."""
        return self.references.setdefault(part, deque(maxlen=self.cfg.window))

    def observe(self, m: StepMetrics) -> Finding | None:
        """This step's rows that stay far above the recent rows of their source (None when none does)."""
        cfg = self.cfg
        gated = set(m.gated_rows)  # the row gate's decision names them (gate_finding): a row is left out once
        for key in map(str, gated):
            self._forget(key)
        rows = (m.row_losses or {}).items()
        losses = {r: loss for r, (loss, targets) in rows if targets >= cfg.min_targets and r not in gated}
        parts = {r: (m.row_parts or {}).get(r, "") for r in losses}
        overshot, self.last_gain = self.last_gain is not None and self.last_gain < 0, m.update_gain
        if m.unsettled or overshot:  # the model's trouble: its rows stay out of the reference too
            return None
        # One row not finite among finite ones is that row's (named below); two or more are a broken
        # computation, not two rows of data gone at once: a whole forward, or under data
        # parallelism one rank's share of the rows (its weights gone bad: rule nonfinite's). So is
        # a step's only row not finite: nothing tells the row from the forward (rule nonfinite's)
        finite = {r: x for r, x in losses.items() if math.isfinite(x)}
        if not finite:
            return None
        level, rise = self._level(finite, parts)
        judged = {r: x for r, x in losses.items() if len(self.reference(parts[r])) >= cfg.min_reference}
        if len(losses) - len(finite) >= 2 or not judged:
            for r, x in finite.items():
                self._fill(r, x - level[parts[r]], parts[r])
            return None
        for r in set(finite) - set(judged):  # a source seen too little yet: its rows fill its reference
            self._fill(r, finite[r] - level[parts[r]], parts[r])
        middles = {p: median(self.reference(p)) + level[p] for p in {parts[r] for r in judged}}
        excess = [x - middles[parts[r]] for r, x in judged.items() if math.isfinite(x)]
        if excess and median(excess) + rise > cfg.min_gap:  # most rows far above their sources': the model's doing
            return None
        bars = self._bars(judged, parts, level)
        out = {r: x for r, x in judged.items() if not (math.isfinite(x) and x <= bars[parts[r]][2])}
        # several at once: no hard rows' chance (docstring); the rows between blame_gap and the bar a second
        # family, one row more: clean rows stand there ~5x as often as over the bar (docstring)
        near = {r: x for r, x in self._near(judged, bars, parts).items() if r not in out} if cfg.blame_gap else {}
        out |= near if len(near) > cfg.step_outliers else {}
        blamed = len(out) >= cfg.step_outliers
        for row in sorted(judged.keys() - out.keys()):
            self.reference(parts[row]).append(judged[row] - level[parts[row]])
        named = self._judge(m.step, out, bars, parts, blamed)
        while len(self.suspects) > cfg.max_suspects:
            self._forget(next(iter(self.suspects)))
        if not named:
            return None
        finding = self._finding(m, judged, named, bars, parts)
        finding.evidence["blamed"] = blamed  # the step's next rows are watched (policy.py)
        if blamed:
            finding.summary += f"; {len(out)} of its rows outliers at once blame the step, each of them named"
        return finding

    def _near(self, judged: dict[int, float], bars: dict, parts: dict[int, str]) -> dict[int, float]:
        """The step's finite rows over their source's median by max(sigma x its spread, blame_gap): those under
        the bar are outliers when `step_outliers` of them stand there at once (the step blamed), else hard rows."""
        cfg = self.cfg
        gap = {p: max(cfg.sigma * spread, cfg.blame_gap) for p, (_, spread, _, _) in bars.items()}
        return {r: x for r, x in judged.items() if math.isfinite(x) and x - bars[parts[r]][0] > gap[parts[r]]}

    def _level(self, finite: dict[int, float], parts: dict[int, str]) -> tuple[dict[str, float], float]:
        """Each source's level at this step, which its rows are measured from, and how far the step's common
        level stands above the last steps'. A source with LEVEL_ROWS rows here (or the step's only one): its
        rows' median; a thinner one: its last level moved by the step's trend (the median change of the
        former's levels), first the step's median. A step's mix moves its median; one source's does not."""
        rows: dict[str, list[float]] = {}
        for r, x in finite.items():
            rows.setdefault(parts[r], []).append(x)
        own = {p: median(xs) for p, xs in rows.items() if len(xs) >= min(LEVEL_ROWS, len(finite))}
        changes = [x - self.part_levels[p] for p, x in own.items() if p in self.part_levels]
        trend, start = (median(changes) if changes else 0.0), median(finite.values())
        for p in self.part_levels.keys() | set(parts.values()):
            carried = self.part_levels[p] + trend if p in self.part_levels else start
            self.part_levels[p] = own.get(p, carried)
        common = self.levels[-1] + trend if self.levels else start  # one source: its step's median
        rise = common - median(self.levels) if self.levels else 0.0
        self.levels.append(common)
        return {p: self.part_levels[p] for p in set(parts.values())}, rise

    def _judge(self, step: int, out: dict[int, float], bars: dict, parts: dict, blamed: bool) -> dict:
        """The outliers named (row -> its gap when first seen, None: named at once) and the rest made
        suspects: every outlier of a blamed step, a suspect seen again, and one certain_gap out are named."""
        named: dict[int, float | None] = {}
        for row, loss in sorted(out.items()):
            middle, key = bars[parts[row]][0], str(row)
            if blamed or key in self.suspects or not math.isfinite(loss) or loss - middle >= self.cfg.certain_gap:
                named[row] = self.suspects.get(key)
                self._forget(key)
            else:
                self.suspects[key], self.part_of[key] = loss - middle, parts[row]
                if self.cfg.confirm_after:
                    self.due[key] = step + self.cfg.confirm_after
        return named

    def _fill(self, row: int, loss: float, part: str) -> None:
        """`row` into its source's reference, held to be judged later (confirm) while that is short: in
        a mixture ("": one source, whose reference fills in a run's first steps)."""
        reference = self.reference(part)
        if part and len(reference) < self.cfg.min_reference and len(self.held) < self.cfg.max_suspects:
            self.held[str(row)] = part
        reference.append(loss)

    def _bars(
        self, losses: dict[int, float], parts: dict[int, str], level: dict[str, float]
    ) -> dict[str, tuple[float, float, float, int]]:
        """Each source's (median, spread, threshold, rows in its reference): its recent rows and this step's."""
        step: dict[str, list[float]] = {parts[r]: [] for r in losses}
        for r, x in losses.items():
            if math.isfinite(x):
                step[parts[r]].append(x)
        return {p: self._bar(list(self.reference(p)) + [x - level[p] for x in xs], level[p]) for p, xs in step.items()}

    def _bar(self, reference: list[float], level: float = 0.0) -> tuple[float, float, float, int]:
        """(median, spread, threshold, rows) of a reference measured from its steps' levels, at `level`."""
        middle, spread, threshold = outlier_threshold(reference, self.cfg.sigma, self.cfg.min_gap)
        return middle + level, spread, threshold + level, len(reference)

    def _forget(self, key: str) -> None:
        self.suspects.pop(key, None)
        self.due.pop(key, None)
        self.part_of.pop(key, None)
        self.held.pop(key, None)

    def confirm(self, view: Any, m: StepMetrics) -> Finding | None:
        """The suspects due at this step that, scored again on the current weights
        (view.row_losses), are still outliers against the recent rows of their source (None when
        none is), and in the same forward the rows held until their source's reference filled
        (_judge_held). Every data-parallel rank holds the same suspects and weights, so all score the
        same rows alike."""
        cfg = self.cfg
        ready = [k for k, step in self.due.items() if step <= m.step][: cfg.confirm_rows]
        parts = {int(k): self.part_of.get(k, "") for k in ready}
        # an unstable model scores every row high (observe's reason): the due wait for a settled step
        if m.unsettled or any(len(self.reference(p)) < cfg.min_reference for p in parts.values()):
            return None
        filled = [k for k, p in self.held.items() if len(self.reference(p)) >= cfg.min_reference]
        held = {int(k): self.held.pop(k) for k in filled[: cfg.confirm_rows - len(ready)]}
        if not ready and not held:
            return None
        for key in ready:
            del self.due[key]
        scores = view.row_losses(list(parts) + list(held))  # {} in an RL or DPO phase: no row losses
        parts |= held
        # each source's level at the last step: the nearest to the current weights
        bars = {p: self._bar(list(self.reference(p)), self.part_levels.get(p, 0.0)) for p in set(parts.values())}
        # not finite alone, on weights that score the rest finite, is no evidence: the forward's
        due = {r: x for r, x in sorted(scores.items()) if r not in held}
        named = {r: self.suspects[str(r)] for r, x in due.items() if bars[parts[r]][2] < x < math.inf}
        named |= self._judge_held(scores, held, bars, m.step)
        for row in named:
            self._forget(str(row))
        if not named:
            return None
        return self._finding(m, scores, named, bars, parts, rescored=len(scores))

    def _judge_held(self, scores: dict[int, float], held: dict[int, str], bars: dict, step: int) -> dict:
        """The held rows as observe judges a first sighting: certain_gap out named (None: no earlier
        gap), an outlier a suspect (due again after confirm_after)."""
        named: dict[int, float | None] = {}
        for row, x in ((r, x) for r, x in scores.items() if r in held):
            middle, _, threshold, _ = bars[held[row]]
            if x - middle >= self.cfg.certain_gap and math.isfinite(x):
                named[row] = None
            elif threshold < x < math.inf:
                self.suspects[str(row)], self.part_of[str(row)] = x - middle, held[row]
                if self.cfg.confirm_after:
                    self.due[str(row)] = step + self.cfg.confirm_after
        return named

    def _finding(self, m, losses, named, bars, parts, rescored: int = 0) -> Finding:
        bad = sorted(named)
        again = sum(g is not None for g in named.values())
        middle, spread, threshold, n_reference = bars[parts[bad[0]]]  # the first named row's source's
        evidence = {
            "rows": bad,
            "threshold": threshold,
            "median": middle,
            "spread": spread,
            "rows_reference": n_reference,
            "losses": {str(r): losses[r] for r in bad[:10]},
            "first_gaps": {str(r): g for r, g in list(named.items())[:10] if g is not None},
            "suspects": len(self.suspects),
            "rescored": rescored,  # suspects scored again on the current weights (confirm)
        }
        if m.row_parts:  # a mixture: each named row was judged against its own source's rows
            evidence["sources"] = {str(r): parts[r] for r in bad[:10]}
            evidence["references"] = {
                p: {"median": b[0], "spread": b[1], "threshold": b[2], "rows": b[3]}
                for p, b in bars.items()
                if p in {parts[r] for r in bad}
            }
        of = f" of source {parts[bad[0]]}" if m.row_parts else ""
        if rescored:
            summary = (
                f"{len(bad)} of {rescored} suspects scored again on the current weights, "
                f"{self.cfg.confirm_after} steps after they first stood out, still score above {threshold:.3f} "
                f"(the last {n_reference} rows{of}: median {middle:.3f})"
            )
        else:
            # a blamed step's rows are named neither for a sighting before nor for their gap: the caller says so
            gaps = {r: losses[r] - bars[parts[r]][0] for r, g in named.items() if g is None}
            certain = sum(not gap < self.cfg.certain_gap for gap in gaps.values())  # NaN: not finite, named at once
            summary = (
                f"{len(bad)} of the step's {len(losses)} rows score above {threshold:.3f} (the last {n_reference} "
                f"rows{of}: median {middle:.3f}): {again} an outlier when last seen too, {certain} by "
                f"{self.cfg.certain_gap:g} nats or more"
            )
        return Finding(rule="rows", family="data", step=m.step, evidence=evidence, summary=summary, strength=1.0)

    def state_dict(self) -> dict[str, Any]:
        recent = {p: list(r) for p, r in self.references.items()}
        return {
            "recent": recent,
            "suspects": self.suspects,
            "due": self.due,
            "part_of": self.part_of,
            "held": self.held,
            "levels": list(self.levels),
            "part_levels": self.part_levels,
            "last_gain": self.last_gain,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        recent = state.get("recent", [])
        recent = recent if isinstance(recent, dict) else {"": recent}  # a checkpoint from before sources
        if "levels" not in state and "" in recent:  # one source's losses from before levels: refilled, measured
            del recent[""]
        if "part_levels" not in state:  # a mixture's sources' raw losses from before their levels: refilled
            recent = {p: r for p, r in recent.items() if not p}
        self.levels = deque(state.get("levels", []), maxlen=LEVEL_STEPS)
        default = {"": self.levels[-1]} if self.levels and "" in recent else {}
        self.part_levels = dict(state.get("part_levels", default))
        self.references = {p: deque(r, maxlen=self.cfg.window) for p, r in recent.items()}
        self.suspects = dict(state.get("suspects", {}))
        self.due = dict(state.get("due", {}))  # a checkpoint from before confirm: its suspects wait for an epoch
        self.part_of = dict(state.get("part_of", {}))
        self.held = dict(state.get("held", {}))
        self.last_gain = state.get("last_gain")


MERGED = {"rows": "rows_rule", "row_gate": "row_gate"}  # rule -> its key in the watch's evidence


def merged_into(watched: Finding, findings: list[Finding]) -> list[Finding]:
    """The findings of a step whose rows the data watch (attribution.py) scored too: the rows rule's
    and the row gate's are merged into the watch's, so one decision leaves the step's bad rows out.
    Both named the same rows at the same step (debug-hybrid, bad_rows@48:6 then bad_batch@140:3, 200
    steps: 14 steps journaled two skip_data decisions each for the same rows, 53 decisions where 39
    said it all)."""
    named = [f for f in findings if f.rule in MERGED]
    for rule in dict.fromkeys(f.rule for f in named):
        rows = sorted({r for f in named if f.rule == rule for r in f.evidence["rows"]})
        known = list(watched.evidence["rows"])
        watched.evidence["rows"] = known + [r for r in rows if r not in known]
        summary = next(f.summary for f in named if f.rule == rule)
        watched.evidence[MERGED[rule]] = {"rows": rows, "summary": summary}
    return [f for f in findings if f.rule not in MERGED]


def gate_finding(m: StepMetrics, cfg: RowGateRule) -> Finding | None:
    """The rows the row gate left out of this step's update (training/row_gate.py; m.gated_rows,
    read with the step's row losses), as one finding of rule row_gate for the step (policy.py plans
    it into skip_data); None when it gated none."""
    if not m.gated_rows:
        return None
    losses = m.row_losses or {}
    gated = {r: losses[r][0] for r in m.gated_rows if r in losses}
    others = [loss for r, (loss, _) in losses.items() if r not in gated and math.isfinite(loss)]
    middle = median(others) if others else None
    bar = f"the last {cfg.window} training rows' median + max({cfg.sigma:g} x their spread, {cfg.min_gap:g} nats)"
    evidence = {
        "rows": list(m.gated_rows),
        "gated": True,  # left out of this step's update already, before its backward
        "losses": {str(r): loss for r, loss in list(gated.items())[:10]},
        "step_median": middle,  # the step's other rows'
        "bar": bar,
        "min_distinct": cfg.min_distinct,
        # or, model-free (training/unigram.py unigram_z): the rows' tokens score as uniform draws under
        # the unigram frequencies of the rows trained on
        "unigram": "tokens as uniform draws under the trained rows' token frequencies (z > -3.09)",
    }
    shown = ", ".join(f"{r} ({loss:.2f})" for r, loss in list(gated.items())[:5]) + (", ..." if len(gated) > 5 else "")
    against = f" against the step's median {middle:.2f}" if middle is not None else ""
    noun = "row" if len(m.gated_rows) == 1 else "rows"
    summary = f"{len(m.gated_rows)} {noun} gated before the update: {shown}{against}"
    return Finding(rule="row_gate", family="data", step=m.step, evidence=evidence, summary=summary, strength=1.0)


def all_gated(gated: Finding, m: StepMetrics, findings: list[Finding]) -> list[Finding]:
    """The step's findings less a loss spike when the row gate left out every row of the step: the
    step's loss is the gated rows' own (its update had none to train on and took none), so the gate's
    decision says what happened, the spike noted in it. Planned as a spike, the ladder scored the
    gated rows again and journaled them as its skip_data (debug, seed 1, bad_batch@20: 32 of 32 rows
    gated, journaled as rule spike) and started the data watch over the next steps' clean rows."""
    if not m.rows or set(m.rows) - set(gated.evidence["rows"]):
        return findings
    if spikes := [f for f in findings if f.rule == "spike"]:
        gated.evidence["spike"] = {"summary": spikes[0].summary, "loss": spikes[0].evidence.get("loss")}
    return [f for f in findings if f.rule != "spike"]


def left_out_once(gated: Finding, journal: Any) -> Finding | None:
    """The row gate's finding less the rows another applied decision of its step leaves out already
    (a loss spike's, ladder.py: its update withheld, its outlier rows left out; a rollback's skip_rows,
    which the gate's rows go with: deciding.py _gated_rows), noted in that decision's evidence, so
    that no row is left out twice; None when none is left."""
    rows, named = gated.evidence["rows"], {}
    for d in reversed(journal.decisions):
        if d.step < gated.step:
            break
        key = {"skip_data": "rows", "rollback": "skip_rows"}.get(d.action)
        taken = sorted(set(d.params.get(key) or ()) & set(rows)) if key else []
        if d.step == gated.step and d.mode == "auto" and taken:
            d.evidence["row_gate"] = {"rows": taken, "summary": gated.summary}
            named.update(dict.fromkeys(taken, d.id))
    if not named:
        return gated
    journal.write()
    if len(named) == len(rows):
        return None
    gated.evidence["rows"] = [r for r in rows if r not in named]
    ids = ", ".join(f"#{i}" for i in sorted(set(named.values())))
    gated.summary += f"; {len(named)} of them left out already by decision {ids}"
    return gated
