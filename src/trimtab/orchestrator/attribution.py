"""Data attribution: which rows of a bad stretch are bad.

When the policy's held-out probe says a stretch of bad steps is the data's (the model still scores
held-out rows as it did at the last good checkpoint), the rows of every step since the stretch
began (flagged or not: a bad step whose loss stayed under the spike ceiling counts too) are scored
one by one on the current weights, against held-out rows scored the same way: a row is bad when
its loss is above the held-out median by max(sigma x the MAD-based spread, min_gap)
(orchestrator.data; sigma widened for a reference of few rows, small_sample_sigma). Scoring both
with the same weights makes the test relative, so a model that is merely worse than usual shifts both
alike.

In a mixture (data.mix) each row is judged against its own source's held-out rows (RunView.row_parts,
as the rows rule judges it among its source's rows, outliers.py): held-out rows mixed across sources
hold a memorised source's beside a rare fresh one's, and a median under the fresh rows left them out
as garbage. A source whose eval split holds under MIN_OWN rows is judged among its own scored rows,
and with under MIN_OWN of those against every source's held-out rows (the mixed reference again).
So is one source's: a median and spread of a few held-out rows of one file are no bar (_bars).

Steps whose losses were NaN or inf (and no finite spike among them) blame no row for a finite
score: a NaN that does not come back when a row is scored on its own was not that row's (a fault
in the forward, a numerically unstable step; debug, nan_loss for 3 steps: a clean stdlib file, 1
of the 96 rows scored, stood above the threshold and was left out for good). Only a row whose own
loss is not finite is evidence, and only among rows that score finite (every row not finite alike
is the forward's, not the rows').

A stretch of bad data rarely ends where it was caught: for `watch_steps` steps after rows were
left out, each new step's rows are scored too, and the watch extends while it keeps finding bad
ones. (Those steps were trained on; their bad rows are left out of every later epoch.) It does not
feed itself: a step met with the very weights of its last finding (no update applied since: the
step's update withheld) is not scored. The same weights give the same bar and the same scores to
the same kinds of rows, so what it finds there is that evidence again, not new evidence, and the
clean tail above the bar is left out again and again: debug-moe, a person's `ctl scale-lr 30` at
step 13, every next update withheld for the loss the raised LR had caused; the watch found 1-9
rows over its fixed 7.726 bar at 81 of the next 85 steps, extended itself each time, and left out
325 clean rows with the weights frozen (val_loss 6.17 at steps 50 and 100). Its spike then goes to
the instability ladder, and the withheld-updates guard (withheld.py) backs that. A watched
step is blamed as a lone spike's is (spikes.py): only when one of its rows stands above the rows
rule's bar (orchestrator.rows.min_gap), then its rows are judged by the usual one. The watch
judges some 320 rows (10 steps of 32) that carry no evidence of their own, and clean rows' losses
have a heavy right tail that a bar of 4 MAD-based spreads does not cover: debug, bad_batch@20,
seed 1, a test_quopri.py row of quoted-printable text scored 1.25 nats above 64 held-out rows
(8.5 spreads, where a normal tail over 320 rows reaches about sqrt(2 ln 320) = 3.4) and was left
out for good, on debug and debug-moe. Testing the step first and its rows only once it is blamed
is hierarchical testing (families first, then the hypotheses of the families selected: Benjamini &
Bogomolov 2014, JRSS-B 76(1)): the strict bar holds the false alarms over the watch's steps, the
usual one finds a blamed step's other bad rows.

A row that is a handful of tokens repeated (RunView.row_repeats: its 4 commonest tokens half its targets or
more) is kept whatever it scores, and named in the evidence (kept_repeats): a long run of one character, a
table of zeros, base64 padding score high until the model has learnt the run, and no spread-based bar tells
them from poison. Debug, bad_rows@20, seed 1: a clean test_quopri.py row (37 of its 64 targets one "zzzz"
token, 0.64 in its 4 commonest) scored 0.94 nats over the held-out median in a blamed step (0.74 was the bar;
debug-moe: 1.51, over the 1.5-nat bar that blames a step on its own) and was left out for good beside the
garbage (1.8-2.7 nats out), whose random tokens put ~0.1 of a row in its 4 commonest.
"""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.row_rules import MIN_OWN
from trimtab.orchestrator.monitors import Finding, StepMetrics, outlier_threshold


def small_sample_sigma(sigma: float, rows: int) -> float:
    """`sigma` spreads of a reference of `rows` rows, widened as a t quantile is for a spread estimated
    from few rows: a normal quantile z becomes z + (z^3 + z) / (4 nu) at nu = rows - 1 degrees of
    freedom (Cornish-Fisher, Abramowitz & Stegun 26.7.5, first term). A small held-out split (debug,
    train.seed=3: one document of 9 rows) gives a MAD-based spread whose standard error is ~40%
    (1.17 / sqrt(n) for a normal sample), so 4 of them are a bar too tight or too loose by chance;
    a tight one leaves clean rows out for good, while garbage (~ln V) stands over either. 4
    spreads become 6.1 at 9 rows, 4.5 at 36, 4.3 at 64. A lower bound: the MAD is as noisy as a
    standard deviation from ~0.37 n rows (its efficiency), and one document's rows are not
    independent. It stops growing under MIN_OWN rows (6.4 spreads): a garbage row early in training
    stands only ~2 nats over text (debug, step 20: 7.07 against 5.2), which a wider bar would miss."""
    return sigma + (sigma**3 + sigma) / (4 * max(rows - 1, MIN_OWN - 1))


def _finite(losses: list[float]) -> list[float]:
    """A non-finite reference would make the threshold NaN, and every comparison with it false."""
    return [x for x in losses if math.isfinite(x)]


def _repeats(view: Any, rows: list[int]) -> dict[int, float]:
    """Those of `rows` that are a handful of tokens repeated, with their share (RunView.row_repeats; a view
    without it, a test's, has none)."""
    read = getattr(view, "row_repeats", None)
    return read(rows) if read is not None and rows else {}


class DataAttribution:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.data
        self.keep = cfg.escalation_window  # steps whose rows are remembered
        self.rows: dict[str, list[int]] = {}  # step (a string: JSON keys) -> its rows
        self.watch_until = -1  # score each step's rows up to this step
        self.found_on = -1  # the last applied update's step when the watch last found rows (docstring)
        self.blame = cfg.rows.min_gap  # a watched step's rows are judged once one stands this far out (docstring)

    def record(self, step: int, rows: list[int]) -> None:
        self.rows[str(step)] = list(rows)
        for old in [s for s in self.rows if int(s) <= step - self.keep]:
            del self.rows[old]

    def since(self, first: int) -> list[int]:
        """The rows of every remembered step from `first` on."""
        return sorted({r for s, rows in self.rows.items() if int(s) >= first for r in rows})

    def score(
        self, view: Any, rows: list[int], nonfinite: bool = False, gate: float | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """The bad ones among `rows`, and the evidence for the journal (nothing changes: leaving
        them out is a decision, which may be advice; watch_more follows an applied one).
        `nonfinite`: the steps to explain had NaN / inf losses, which a finite score does not.
        `gate`: none is bad unless one stands that far above the held-out median (one spike's
        rows, spikes.py: a higher bar than orchestrator.data.min_gap to blame the data at all;
        once it is blamed, its rows are judged by the usual one)."""
        scores = view.row_losses(rows) if rows else {}
        finite = {r: loss for r, loss in scores.items() if math.isfinite(loss)}
        parts = view.row_parts(list(scores)) or dict.fromkeys(scores, "")  # None: one source, ""
        bars = self._bars(view, parts, finite, gate)
        broken = [r for r in scores if r not in finite] if finite else []  # all of them: the forward's
        high = [] if nonfinite else [r for r, loss in finite.items() if loss > bars[parts[r]]["threshold"]]
        repeats = _repeats(view, high)
        high = [r for r in high if r not in repeats]  # a handful of tokens repeated: clean text's runs (docstring)
        blamed = any(finite[r] > bars[parts[r]].get("gate", bars[parts[r]]["threshold"]) for r in high)
        bad = sorted(broken + high) if broken or blamed else []
        shown = bars[parts[bad[0]]] if bad else next(iter(bars.values()))  # the first bad row's source's
        evidence = {
            "rows_scored": len(scores),
            "rows_outliers": len(bad),  # asked to leave out; Control says how many were not out already
            "rows_nonfinite": len(scores) - len(finite),
            "nonfinite_losses": nonfinite,
            "threshold": shown["threshold"],
            **({"gate": shown["gate"]} if gate is not None else {}),
            "reference_median": shown["median"],
            "reference_spread": shown["spread"],
            "reference_rows": shown["rows"],
            "sources": dict(list(view.row_sources(bad).items())[:10]) if bad else {},
        }
        if repeats:  # above the bar, kept: a person reads which and why
            evidence["kept_repeats"] = {str(r): {"loss": finite[r], "repeat_share": s} for r, s in repeats.items()}
        if set(parts.values()) != {""}:  # a mixture: each row was judged against its own source's reference
            evidence["parts"] = {str(r): parts[r] for r in bad[:10]}
            evidence["references"] = {p: b for p, b in bars.items() if p in {parts[r] for r in bad} or not bad}
        return bad, evidence

    def _bars(
        self, view: Any, parts: dict[int, str], finite: dict[int, float], gate: float | None
    ) -> dict[str, dict[str, Any]]:
        """Each mixture source's reference ("": the one source) and its bars: the source's own
        held-out rows (a memorised source's rows score far under a rarer one's fresh rows, whose
        rows a mixed median leaves out: outliers.py); with under MIN_OWN of them (a small source's
        eval split) its scored rows, with under MIN_OWN of those every source's held-out rows;
        without held-out data, the scored rows. One source is its own part: a held-out split of under
        MIN_OWN rows gives way to the scored rows too. Debug, seed 0, bad_rows@20: 3 held-out rows of
        one file spread 0.013 nats, so the bar was the 0.5-nat floor over their median, and a clean
        row 0.5 over it was left out beside the garbage. The scored rows' median and MAD break down only
        past half of them garbage (bad_rows: a quarter), which widens their spread: the bar is then
        sounder but less keen (the row gate and the rows rule still judge every row: outliers.py)."""
        n, bars = self.cfg.reference_rows, {}
        pooled: list[float] | None = None
        for part in list(dict.fromkeys(parts.values())) or [""]:
            if part:
                reference, kind = _finite(view.held_out_row_losses(n, part=part)), "own held-out"
            else:
                pooled = _finite(view.held_out_row_losses(n))
                reference, kind = pooled, "held-out"
            own = [x for r, x in finite.items() if parts[r] == part]
            if len(reference) < MIN_OWN and len(own) >= MIN_OWN:
                reference, kind = own, "own scored rows" if part else "scored rows"
            if len(reference) < MIN_OWN and part:
                pooled = _finite(view.held_out_row_losses(n)) if pooled is None else pooled
                reference, kind = pooled, "all sources' held-out"
            if not reference:
                reference, kind = list(finite.values()), "scored rows"
            bars[part] = {**self._bar(reference, gate), "reference": kind}
        return bars

    def _bar(self, reference: list[float], gate: float | None) -> dict[str, Any]:
        cfg = self.cfg
        sigma = small_sample_sigma(cfg.sigma, len(reference))
        middle, spread, threshold = outlier_threshold(reference, sigma, cfg.min_gap)
        bar = {"median": middle, "spread": spread, "threshold": threshold, "rows": len(reference)}
        if gate is not None:
            bar["gate"] = outlier_threshold(reference, sigma, max(cfg.min_gap, gate))[2]
        return bar

    def watch_more(self) -> None:
        """Rows were left out (or found during a watch): score each next step's rows for
        watch_steps more steps."""
        newest = max((int(s) for s in self.rows), default=self.watch_until)
        self.watch_until = max(self.watch_until, newest + self.cfg.watch_steps)

    def watch(self, view: Any, m: StepMetrics, updated_at: int) -> Finding | None:
        """During a watch, this step's bad rows as a finding (None when it has none, or when the
        weights are the last finding's: `updated_at`, the last applied update's step, unchanged)."""
        if m.step > self.watch_until or not m.rows or updated_at == self.found_on:
            return None
        bad, evidence = self.score(view, m.rows, gate=self.blame)
        if not bad:
            return None
        self.found_on = updated_at
        self.watch_more()  # the watch extends while it keeps finding bad rows
        of = f" (source {evidence['parts'][str(bad[0])]}'s bar)" if "parts" in evidence else ""
        summary = f"{len(bad)} of the step's {len(m.rows)} rows score above {evidence['threshold']:.3f}{of}"
        return Finding(
            rule="data", family="data", step=m.step, evidence={"rows": bad, **evidence}, summary=summary, strength=1.0
        )

    def shift(self) -> None:
        """A rollback: the steps counted from here are new ones."""
        self.rows, self.watch_until, self.found_on = {}, -1, -1

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "watch_until": self.watch_until, "found_on": self.found_on}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.watch_until = dict(state.get("rows", {})), state.get("watch_until", -1)
        self.found_on = state.get("found_on", -1)
