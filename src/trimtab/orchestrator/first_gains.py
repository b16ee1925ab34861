"""The first updates' gain, judged (a part of AboveStart: trends.py holds the state, this the readings): the
share of the first-order loss decrease each of the phase's first gain_steps updates delivered on its own batch
(training/gain.py). An LR too high overshoots on every step; garbage rows only on their own steps, whose loss
jumps back up; after a cut, a replay short of a sound LR's gain is still too high."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from trimtab.config.loss_rules import AboveStartRule
from trimtab.orchestrator.monitors import Finding, StepMetrics

# A gain-window step whose loss went back up by more than half the phase's fall so far (and JUMP nats)
# trained on rows unlike the ones before: its low gain is its data's, not the LR's. Garbage tokens at
# steps 5-8 of debug's warm-up: 6.04 -> 6.26 (the start 6.25), gains 0.30-0.36 against 0.68-0.97 before.
JUMP = 0.05
MIN_REST = 3  # gain-window steps without a jump that must vouch for the LR before their data is blamed
MIN_JUMPS = 2  # jumped steps the phase's first steps must hold to blame their rows without a low median gain
# After a cut for an LR far too high, the median gain of the replay's first gain_steps steps a sound LR
# reaches. Fresh runs of debug, debug-moe, debug-mod, debug-hybrid (seeds 1-5, steps 1-15; a replay from step 0
# reads the same): 0.76-0.86 at the preset's LR but for debug seed 2's 0.667; 0.55-0.69 at 2x but for
# debug-mod seed 4's 0.730. The tails overlap, so no bar separates them (nor a mean, trimmed mean or later
# steps' median); this one, midway in the gap between the bulks, halves one 1x in 20 and spares one 2x in 20
SOUND_GAIN = 0.72
# The lower quartile of the phase's first gains a sound LR keeps, where an LR a few times too high overshoots
# on some steps even where its median looks sound (debug at 3x, steps 1-15, seeds 0, 1, 1234: medians 0.53-0.74,
# lower quartiles 0.35-0.51, gains down to -1.35; at its LR 0.64-0.83; real text at its LR 0.71-0.83)
STEADY_GAIN = 0.6


def _mid(values: list[float]) -> float | None:
    """The upper median of `values` (the rule's medians of an even count take the higher middle); None if empty."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


class FirstGains:
    """AboveStart's judgement of its phase's first gains (AboveStart holds the state named here)."""

    cfg: AboveStartRule
    start: float | None
    first_step: int | None
    unigram: float | None
    fired: bool
    data_read: bool
    gains: list[float]
    jumped: list[dict[str, Any] | None]
    first_gains: list[float]
    first_scales: list[float | None]
    early_jumps: list[dict[str, Any]]
    lowest: float | None
    over: list[float]
    grads: list[float]
    cut_level: float | None
    sound_at: float | None
    finding: Callable[..., Finding]  # Monitor's

    def _short_of_sound(self, m: StepMetrics) -> Finding | None:
        """At the last measured step of a phase whose LR was cut for being far too high (`fired`): its
        measured steps' gains short of a sound LR's, their median under SOUND_GAIN or their lower quartile
        under STEADY_GAIN. A decade's cut off the gain's floor (0.1-0.2 however far too high) can land 1.3-3x
        over a sound LR, where the 7-step medians stay over min_gain and the gradient norm does not die away:
        debug-mod at 20x, cut to 2x, gains 0.67 (sound: 0.75-0.8), ended 4.22 against 3.98 clean (150 steps).
        A halving (_uneven) of 3x can leave 1.5x with a sound median and a quarter of its updates overshooting:
        debug, debug-hybrid, debug-mod at 3x (seeds 1, 1, 0) replayed at 1.5x read medians 0.73-0.79 with lower
        quartiles 0.48-0.58 and ended 5.0%, 7.4% and 15.4% over a sound run, where the replays halved again
        ended -2.8% to -7.5% (given back part way). Halved (too_high.py NEAR_SOUND).

        Only the gains measured at the multiplier judged count: a ladder's cut in the phase (a spike's
        rollback to a checkpoint inside it) leaves the steps before it measured at the LR before the cut.
        Debug at 10x, seed 2: 8 steps at x0.316 (0.45-0.73) and 7 at the spike's x0.0316 (median 0.80)
        read 0.66 together, cut x0.0316 to x0.0158 and capped its give-back there: 4.667 against 4.17."""
        at = self._at_lr(m)
        if len(at) < self.cfg.gain_window or not self._young():
            return None
        gain, low = _mid(at), self._quartile(at)
        if gain >= SOUND_GAIN and low >= STEADY_GAIN:  # the cut LR measured sound: the collapse leaves it be
            self.sound_at = m.lr_scale
            return None
        n = len(at)
        evidence = {"loss": m.loss, "start": self.start, "gain": gain, "gain_q1": low, "min_gain": self.cfg.min_gain}
        evidence |= {"sound_gain": SOUND_GAIN, "gain_window": n, "since": self._since(m)}
        self.gains, self.jumped, self.over, self.grads, self.cut_level = [], [], [], [], m.loss
        short = (
            f"a quarter of them {low:.2f} or less (under the {STEADY_GAIN:g} of a sound LR)"
            if gain >= SOUND_GAIN
            else f"under the {SOUND_GAIN:g} of a sound LR"
        )
        return self.finding(
            m,
            evidence,
            f"after a cut of an LR far too high, the updates delivered {gain:.2f} of the loss decrease their "
            f"gradient promised (median of the phase's {n} steps measured at this LR; {short})",
            0.7,
        )

    def _at_lr(self, m: StepMetrics) -> list[float]:
        """The phase's first gains measured at this step's LR multiplier (None: a checkpoint from before they were
        kept with theirs)."""
        return [g for g, s in zip(self.first_gains, self.first_scales) if s is None or math.isclose(s, m.lr_scale)]

    def _quartile(self, at: list[float]) -> float:
        """The lower quartile of the gains `at`, less those of steps whose loss jumped back up: garbage rows
        pull their own steps' gains down, an LR too high every step's (debug-hybrid's replay after a cut, garbage
        at steps 5-8: quartile 0.47 with them, 0.74 without, median 0.80)."""
        rest = list(at)
        for j in self.early_jumps:
            if j.get("gain") in rest:
                rest.remove(j["gain"])
        rest = rest or at
        return sorted(rest)[len(rest) // 4]

    def _uneven(self, m: StepMetrics) -> Finding | None:
        """At the last measured step of a phase never found too high: its first updates short of a sound LR's
        gain both ways, their median under SOUND_GAIN and their lower quartile under STEADY_GAIN. An LR 2-3x too
        high overshoots on a few steps in four and delivers less on the rest, while no 7-step median falls under
        min_gain and the loss falls from its start: debug at 3x, seeds 2 and 3, drew no rule and ended 14% and 19%
        over a sound run (4.371, 4.762 against 3.843, 4.013; 120 steps). Over the four debug presets (seeds 0-5)
        every 3x run read both (medians 0.49-0.69, quartiles 0.09-0.53), 22 of 24 at 2x, and none at the
        preset's LR (medians 0.67-0.86, quartiles 0.58-0.75, never both short: debug seed 2's median 0.67 came
        with a quartile of 0.64). Halved (too_high.py NEAR_SOUND): within a few times of a sound LR."""
        at = self._at_lr(m)
        if len(at) < self.cfg.gain_window or not self._young():
            return None
        gain, low = _mid(at), self._quartile(at)
        if gain >= SOUND_GAIN or low >= STEADY_GAIN:
            return None
        evidence = {"loss": m.loss, "start": self.start, "gain": gain, "gain_q1": low, "min_gain": self.cfg.min_gain}
        evidence |= {"steady_gain": STEADY_GAIN, "gain_window": len(at), "since": self._since(m)}
        self.fired, self.cut_level = True, m.loss
        self.gains, self.jumped, self.over, self.grads = [], [], [], []
        return self.finding(
            m,
            evidence,
            f"over the phase's first {len(at)} steps the updates delivered {gain:.2f} of the loss decrease their "
            f"gradient promised (median, under the {SOUND_GAIN:g} of a sound LR) and a quarter of them {low:.2f} or "
            f"less (under {STEADY_GAIN:g}): they overshoot on every few steps",
            0.65,
        )

    def _jumps_found(self, m: StepMetrics) -> Finding | None:
        """At the phase's last measured step, MIN_JUMPS or more steps whose loss jumped back up and
        whose updates delivered less than the phase's median gain, not blamed yet: garbage whose
        gains did not pull the median under min_gain (debug-hybrid, bad_batch@5:4: 0.28-0.63, the
        model then slow for the rest of the run, 4.77 against 4.13 clean), blamed once a phase."""
        jumps = self._low(self.early_jumps)
        if len(jumps) < MIN_JUMPS or not self._rest_sound(jumps, m):
            return None  # the other steps' updates overshoot too: the LR's
        evidence = {"loss": m.loss, "start": self.start, "median_gain": _mid(self.first_gains), "since": self._since(m)}
        steps = self._blame_jumps(evidence, jumps)
        return self.finding(
            m,
            evidence,
            f"over the phase's first {self.cfg.gain_steps} steps the loss jumped back up at steps "
            f"{', '.join(map(str, steps))}, whose updates delivered less than the phase's median gain: those "
            "steps' rows",
            0.6,
        )

    def _rest_sound(self, jumps: list[dict[str, Any]], m: StepMetrics) -> bool:
        """Whether `jumps` may be blamed (_blamable) and the phase's other measured updates vouch
        for the LR: their median gain at min_gain or more."""
        rest = list(self.first_gains)
        for j in self.early_jumps:
            if j["gain"] in rest:
                rest.remove(j["gain"])
        sound = _mid(rest)
        return self._blamable(jumps, m) and sound is not None and sound >= self.cfg.min_gain

    def _blamable(self, jumps: list[dict[str, Any]], m: StepMetrics) -> bool:
        """Whether jumped steps may be blamed: some, none blamed yet this phase, the LR neither
        found too high in it nor cut (its jumps are the LR's: debug at 100x jumped at steps 11-12 of
        the replay at 10x; a finetuning phase at 30x, cut twice, in its second replay), and the model
        young (_young)."""
        return bool(jumps) and not self.data_read and not self.fired and m.lr_scale >= 1 - 1e-6 and self._young()

    def _low(self, jumps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The jumped steps whose update delivered less than the phase's median gain: garbage's. A
        jump an LR too high caused (its step before overshot: debug-moe at 3x, gain -0.66 at step 8,
        the loss up 0.47 at 9) delivers more than most as the loss falls back (1.21)."""
        median = _mid(self.first_gains)
        return [j for j in jumps if median is not None and j.get("gain") is not None and j["gain"] < median]

    def _jump(self, m: StepMetrics) -> dict[str, Any] | None:
        """This step's rows when its loss rose over the phase's lowest before it by more than half
        the phase's fall to that lowest (and JUMP nats); None otherwise. Keeps the lowest. Judged on the
        rows trained (StepMetrics.trained_loss): the gated are out already (debug at 10x, bad_rows@10:4: step
        10 read 6.17 with 10 gated, 5.43 without; its rows left out by a rollback, the LR cut anyway)."""
        loss = m.trained_loss()
        if loss is None:  # every row gated: the update trained nothing
            return None
        lowest = self.start if self.lowest is None else self.lowest
        self.lowest = min(lowest, loss)
        if self.start is None or loss <= lowest + max(JUMP, 0.5 * (self.start - lowest)):
            return None
        gated = set(m.gated_rows)
        return {"step": m.step, "rows": [r for r in m.rows if r not in gated], "gain": m.update_gain}

    def _blame_jumps(self, evidence: dict[str, Any], jumped: list[dict[str, Any]]) -> list[int]:
        """The jumped steps and their rows into a finding's evidence, once a phase; their steps."""
        self.data_read = True
        steps = [j["step"] for j in jumped]
        evidence |= {"jumped_steps": steps, "rows": sorted({r for j in jumped for r in j["rows"]})}
        return steps

    def _young(self) -> bool:
        """Whether the phase started from a model that does not use context yet: its first loss above
        the data's unigram entropy (random weights start near ln(vocab)). Jumps blame rows unscored
        only there, where garbage scores close to text. Weights trained before (train.init_from, a
        finetuning phase) start below it, and their loss jumps with each batch's difficulty: debug
        finetuned from a 60-step run jumped at 4 of its first 15 steps, and 128 clean rows were left
        out with a rollback to step 0. A trained model scores garbage far above text, so the rules
        that score rows (spike, rows) find it there. Unknown (no unigram entropy): young."""
        return self.unigram is None or self.start is None or self.start > self.unigram

    def _since(self, m: StepMetrics) -> int:
        """The step a finding's evidence counts from: the phase's first step, or this one before any."""
        return self.first_step if self.first_step is not None else m.step
