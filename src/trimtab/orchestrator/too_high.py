"""The instability ladder's answer to an LR found far too high (rule above_start:
orchestrator/trends.py), a part of InstabilityLadder (ladder.py): cut it decisively, rolling back
to the phase's first checkpoint when every step since trained at it; or, when only the first
steps whose loss jumped back up delivered too little, blame those steps' rows, not the LR."""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy, lr_cut

# The cut for an LR found within a few times of a sound one after a decade's cut (a gain that rose off its
# floor, or a replay short of a sound LR's gain, trends.py SOUND_GAIN): debug-mod at 20x, cut to 2x (gain
# 0.67), then half a decade to 0.63x ended 4.12 (clean 3.98, 150 steps), halved to 1x as clean
NEAR_SOUND = 0.5
# A run of at most this many steps has no rest to train slowly in with the weights its first steps inflated,
# and a rollback replays most of it: a 10-step `trimtab tune` trial at 7x debug's LR, its loss falling, was
# rolled back to step 0 at step 10 and cut x0.1, the trial's best at 5.377 off ending 5.546 (trained again x0.316
# at 2.2x: 7.78 against 5.70 off). Updates that overshoot while the loss falls are cut there without a rollback.
SHORT_RUN = 20
# How its cuts are owed (ladder.py quiet, _owe): a cut that overshot a sound LR, or whose cause went with the young
# weights, comes back part way; one the LR's trouble follows stays
OWED = (
    "given back x2 at a time after a quiet window (orchestrator.lr_restore_after), never past the midpoint of "
    "the two LRs, tried once more if instability follows a give-back and kept after a second (give_back.py)"
)


class TooHighLR:
    """InstabilityLadder's answer to above_start (it holds the state and the methods named here)."""

    cfg: OrchestratorConfig
    rollbacks: int
    last_lr_change: int
    lr_too_high_at: int
    unstable_at: int
    phase_start: int
    too_high_gain: list[float] | None  # [phase_start, update gain] of the last gain-based cut (None: none yet)
    raised: list[Any]  # [step, factor, what] of a person's last LR raise ([]: none; raised.py)

    def _lr_too_high(self, f: Finding, view: Any) -> Remedy:
        """Training makes the model worse than where the phase started: the LR is too high. Cut
        it decisively (x above_start.lr_factor, again while the loss does not fall), down to the
        floor (past it for a gain that rose with the last cut: _responds); the cut is owed back part
        way (OWED). At the floor, the ladder's last rungs: a rollback, then a stop."""
        self.ladder.last_step = f.step
        if (undone := self._raise_undone(f, view)) is not None:
            return undone
        if "jumped_steps" in f.evidence:
            return self._warm_up_rows(f, view)
        before = self.too_high_gain[1] if self.too_high_gain and self.too_high_gain[0] == self.phase_start else None
        factor = _too_high_factor(f, self.cfg.above_start.lr_factor, before)
        measured = _responds(f.evidence, before) or _stalls_after_gain(f.evidence, before)
        past_floor = measured and lr_cut(factor, view, self.cfg) != factor
        factor = factor if past_floor else lr_cut(factor, view, self.cfg)
        if factor is None:
            return self._at_floor(f, view)
        why = _too_high_why(f, factor, before) + (_past_floor_why(f, before, self.cfg) if past_floor else "")
        if (sound := f.evidence.get("sound_at")) is not None and factor < sound / view.lr_scale:
            # a collapse after a give-back: back to the LR the replay's gain measured sound, not below it
            factor = sound / view.lr_scale
            why += f"; not below the x{sound:.3g} multiplier whose replay delivered a sound LR's gain: x{factor:.3g}"
        # the earlier cut's gain, when it made this one a halving or passes the floor: what a fresh run lacks
        evidence = {"gain_before": before} if _rose(f.evidence, before) or past_floor else {}
        cut = self._cut_commit(f, factor, view.lr_scale)
        if (short := _short_run(f, view, why, factor, cut)) is not None:
            return short
        return self._cut_remedy(f, view, factor, why, evidence, cut)

    def _at_floor(self, f: Finding, view: Any) -> Remedy:
        """The LR is at orchestrator.min_lr_scale: a finding that replays the same steps is only noted,
        any other rolls back (the ladder's last rungs)."""
        # at the floor a replay at the same LR repeats itself step for step: debug at 1000x, cut to the
        # floor (10x the preset's LR), was rolled back to step 0 uncut, met the same gain at the same
        # step, and stopped (exit 3) at step 12 "unstable", where training on at 10x ends at 4.81
        if "warm_grad_norm" in f.evidence or "unigram" in f.evidence or "gain" in f.evidence:
            seen = _overshoot_why(f) if "gain" in f.evidence else _stalled_why(f)
            return Remedy(
                action="none",
                reasoning=seen + ": the LR is still too high, but it is at its floor "
                f"(orchestrator.min_lr_scale={self.cfg.min_lr_scale:g}) and a replay at it would repeat these "
                "steps; training goes on: lower optim.lr",
            )
        return self._rollback(view)

    def _raise_undone(self, f: Finding, view: Any) -> Remedy | None:
        """A person raised the LR in this phase (raised.py: `ctl set-lr`/`scale-lr` above it, a resumed phase's
        LR edited up), no LR decision since, and the LR reads too high after it: the raise is the suspect, not
        the rows its steps trained. Undone as the ladder undoes one (raised.py _undo_raise: back to the LR before
        it, no deeper than above_start.lr_factor) with the rollback a cut makes; None without such a raise."""
        if not self.raised or self.raised[0] < self.phase_start or f.step <= self.raised[0]:
            return None
        # debug finetuned at x100 from step 41 (`ctl scale-lr 100`): above_start at 45 cut x0.1 from the raised
        # level with the journal silent on the raise, and jumped steps' rows were blamed where a raise preceded them
        undone = self._undo_raise(view, f.step)
        if undone is None:
            return None
        factor, words = undone
        at, raise_, what = self.raised
        why = f"{f.summary}: the LR is too high{words}; the raise is the suspect, not the rows its steps trained"
        evidence = {"person_raise": {"step": at, "factor": raise_, "by": what}}
        return self._cut_remedy(f, view, factor, why, evidence, self._cut_commit(f, factor, view.lr_scale))

    def _cut_commit(self, f: Finding, factor: float, lr_scale: float) -> Any:
        """What applying the cut records: the LR change, its debt (OWED), the gain it answered."""

        def cut(rolled_back_to: int | None = None) -> None:
            self.last_lr_change = self.lr_too_high_at = self.unstable_at = f.step
            # owed as the ladder's cuts are (ladder.py quiet), never back past the geometric midpoint of the LR
            # found too high and the cut one: a cut that overshot or whose cause has gone comes back part way
            self._owe(factor, lr_scale, ceiling=lr_scale * math.sqrt(factor))
            if "gain" in f.evidence:  # the next cut's reference, in this phase (another's data and LR differ)
                self.too_high_gain = [self.phase_start, f.evidence["gain"]]
            if rolled_back_to is not None:
                self._rolled_back(f.step, rolled_back_to, broken=False)

        return cut

    def _cut_remedy(self, f: Finding, view: Any, factor: float, why: str, evidence: dict[str, Any], cut: Any) -> Remedy:
        """The cut, with the rollback to the checkpoint whose weights the LR found too high has not trained."""
        # a dying gradient or overshooting updates: every step since the phase (or its replay) began
        # trained at that LR (the weights stalled, or inflated), so its first checkpoint is the one to restore
        if "warm_grad_norm" in f.evidence or "unigram" in f.evidence or "gain" in f.evidence:
            start = f.evidence["since"] - 1
            done = "overshot and inflated the weights" if "gain" in f.evidence else "left the model stalled"
            if self.rollbacks < self.cfg.max_rollbacks and view.has_checkpoint(start):
                return Remedy(
                    action="rollback",
                    params={"to": start, "skip_rows": [], "lr_factor": factor},
                    reasoning=why + f"; the steps since step {start} trained at that LR and {done} (at the lower "
                    "LR they stay so): restore that checkpoint and train them again (the data was not at fault)",
                    evidence=evidence,
                    commit=lambda: cut(start),
                )
            return Remedy(action="scale_lr", params={"factor": factor}, reasoning=why, evidence=evidence, commit=cut)
        sound = 0 <= view.last_good < f.evidence["since"]  # saved before the loss left its start
        if sound and self.rollbacks < self.cfg.max_rollbacks:
            last_good = view.last_good
            return Remedy(
                action="rollback",
                params={"to": "last_good", "skip_rows": [], "lr_factor": factor},
                reasoning=why + f"; the steps since step {last_good} (the last good checkpoint, saved before "
                "the loss rose) trained at that LR and left the weights worse than they started: restore it and "
                "train them again at the lower LR (the data was not at fault)",
                evidence=evidence,
                commit=lambda: cut(last_good),
            )
        return Remedy(action="scale_lr", params={"factor": factor}, reasoning=why, evidence=evidence, commit=cut)

    def _warm_up_rows(self, f: Finding, view: Any) -> Remedy:
        """The first steps' updates overshot only on steps whose loss jumped back up (or such steps
        delivered less than the rest): those steps' rows, not the LR (blamed once a phase; the LR
        if it comes back). The model is too young to score rows one by one (every row scores near
        the start), so the jump is the evidence: restore the phase's first checkpoint and train
        again without them, the LR as it was; with no rollback left, leave them out of the rest."""
        rows, start = f.evidence["rows"], f.evidence["since"] - 1
        steps = ", ".join(map(str, f.evidence["jumped_steps"]))
        if "gain_rest" in f.evidence:
            seen = (
                f"over the phase's first steps the updates delivered {f.evidence['gain']:.2f} of the loss decrease "
                f"their gradient promised, but only the steps whose loss jumped back up ({steps}) fell short: the "
                f"others delivered {f.evidence['gain_rest']:.2f}, as a sound LR does; an LR too high shows on "
                "every step"
            )
        else:
            seen = (
                f"over the phase's first steps the loss jumped back up at steps {steps}, and their updates delivered "
                "less of the loss decrease their gradient promised than the phase's median "
                f"({f.evidence['median_gain']:.2f}): an LR too high shows on every step, and a jump it causes "
                "delivers more as the loss falls back"
            )
        if "unigram" in f.evidence:  # found at a stall (AboveStart._stall_jumps), not by the gain
            seen = (
                f"the loss stalls at {f.evidence['level']:.3f}, near the {f.evidence['unigram']:.3f} of a model blind "
                f"to context, and {seen}"
            )
        why = f"{seen}; the {len(rows)} rows of those steps are to blame (garbage makes a young model's loss jump back)"
        evidence = {"rows_outliers": len(rows), "jumped_steps": f.evidence["jumped_steps"]}
        if self.rollbacks < self.cfg.max_rollbacks and view.has_checkpoint(start):
            return Remedy(
                action="rollback",
                params={"to": start, "skip_rows": rows},
                reasoning=why + f"; they trained the weights since step {start}: restore it and train again without "
                "them, the LR as it was",
                evidence=evidence,
                commit=lambda: self._rolled_back(f.step, start, broken=False),
            )
        return self._leave_out(rows, why + ": leave them out of the rest of the run", evidence)


def _short_run(f: Finding, view: Any, why: str, factor: float, cut: Any) -> Remedy | None:
    """A run of SHORT_RUN steps or fewer whose updates overshoot while its loss falls below its start: the LR
    is cut for the steps left, not rolled back (at the run's last step, not cut: it would act on no step)."""
    ev = f.evidence
    if "gain" not in ev or view.total_steps > SHORT_RUN or ev["loss"] >= ev["start"]:
        return None
    falls = f"; the loss falls ({ev['loss']:.3f}, from {ev['start']:.3f}) and the run has {view.total_steps} steps"
    if f.step >= view.total_steps:
        return Remedy(
            action="none",
            reasoning=_overshoot_why(f) + falls + ": at its last step a cut would change no step of it, and "
            "a rollback would train it again from its start: the weights stay as trained",
        )
    return Remedy(
        action="scale_lr",
        params={"factor": factor},
        reasoning=why + falls + ", too few to train again the steps at that LR (SHORT_RUN): no rollback",
        commit=cut,
    )


def _too_high_factor(f: Finding, lr_factor: float, before: float | None = None) -> float:
    """The cut for an LR found far too high: lr_factor, or its square root (half a decade) for
    updates that overshoot only a little (a gain over 3/4 of min_gain) and for a gradient that
    dies away after a cut (the cut LR is within a decade of a sound one). On the debug presets the
    first steps' gain is 0.75-0.9 at the preset's LR, 0.38-0.6 at 3-10x, 0.12-0.22 at 30x: 30x is
    cut x0.1 to 3x, which then shows a gain just under 0.4 or a dying gradient and is cut x0.32
    to about the preset's, not x0.1 to a third of it (debug, 100 steps: 4.28 against 4.68).
    Halved (NEAR_SOUND) when an earlier cut's gain (`before`) rose since and now stands over half
    min_gain: the last decade lifted the LR off the gain's floor (0.1-0.2 however far too high), so
    the LR is within a decade of a sound one, 2x on debug-moe and debug-hybrid at 20x (0.22 -> 0.30,
    0.22 -> 0.33): a second x0.1 left moe at a fifth of the preset's (80 steps: val 5.05 against
    4.31 clean), x0.32 at 0.63x (150 steps: moe 4.005, hybrid 4.164 against 4.024 clean), x0.5 at
    the preset's (3.906, 4.024). Should that be short, the replay's gain under SOUND_GAIN halves again."""
    ev = f.evidence
    if "sound_gain" in ev or "steady_gain" in ev:  # over min_gain, short of a sound LR's: within a few times of it
        return NEAR_SOUND
    if _rose(ev, before):
        return NEAR_SOUND
    if "warm_grad_norm" in ev or "unigram" in ev or ("gain" in ev and ev["gain"] > 0.75 * ev["min_gain"]):
        return math.sqrt(lr_factor)
    return lr_factor


def _rose(ev: dict[str, Any], before: float | None) -> bool:
    """Whether the first steps' gain rose since the phase's last gain-based cut (`before`, the gain it
    answered) to over half min_gain: off the floor an LR far too high holds it at, whatever its
    size. Two LRs' gains say more than one: a fresh run at the cut LR reading the same gain has no
    earlier one to compare with, and is cut as one far too high (x0.316 or x0.1)."""
    return "gain" in ev and before is not None and ev["gain"] > max(before, 0.5 * ev["min_gain"])


def _responds(ev: dict[str, Any], before: float | None) -> bool:
    """Whether the first steps' gain rose since the phase's last gain-based cut (`before`): the LR answers
    the cuts as one too high does, so the next may pass orchestrator.min_lr_scale. The gain climbs to 1 as
    the LR falls (the first-order prediction grows exact; a sound LR reads 0.6-1, never under min_gain or
    SOUND_GAIN), so cuts it orders stop by themselves; the floor bounds those a loss or a gradient orders.
    debug-mod at 333x: cut x0.1 twice to the floor (3.3x the preset's), the gain 0.10 -> 0.39, then
    noted, not cut: 4.59 against 3.99 clean (100 steps)."""
    return "gain" in ev and before is not None and ev["gain"] > before


def _stalls_after_gain(ev: dict[str, Any], before: float | None) -> bool:
    """Whether the gradient died away (the collapse) after a gain-based cut in this phase (`before`): the
    gain found the LR overshooting, so the floor, a multiple of optim.lr, says nothing of a sound LR, and
    the same evidence at the same LR is cut above it. debug-moe at 30x and 300x (seed 1) both stood at 1.5x
    the preset's after their cuts (gains 0.18 -> 0.60) with the same dying gradient at step 35 (0.41 under
    0.6 x 0.88): 30x was cut x0.316 and ended 4.563, 300x was noted at its floor and ended 4.961 (clean
    4.416, 80 steps). Bounded as the collapse is: it is measured again after each cut."""
    return "warm_grad_norm" in ev and before is not None


def _past_floor_why(f: Finding, before: float | None, cfg: OrchestratorConfig) -> str:
    """The reasoning's note on a cut past orchestrator.min_lr_scale (_responds, _stalls_after_gain)."""
    if "gain" not in f.evidence:
        return (
            f"; past the floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g}): an earlier cut in this phase "
            f"answered updates that overshot (gain {before:.2f}), so the LR is measured too high, not merely "
            "far below optim.lr"
        )
    return (
        f"; past the floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g}): the gain rose from {before:.2f} with "
        f"the last cut to {f.evidence['gain']:.2f}, the LR answers the cuts as one too high does, and a sound LR's "
        "gain (0.6-1) ends them"
    )


def _stalled_why(f: Finding) -> str:
    """What holds the model stalled: (after a cut) a gradient dying away, or a loss at the unigram level."""
    ev = f.evidence
    if "unigram" in ev:
        return (
            f"the loss stalls at {ev['level']:.3f} (median of {ev['window']} steps after the LR warm-up), within "
            f"{ev['unigram_margin']:.0%} of the {ev['unigram']:.3f} a model scores that predicts each token from no "
            "context (the training data's unigram entropy): the model stays blind to context, where an LR a few "
            "times too high holds it and a sound one passes that level within a few steps"
        )
    return (
        f"the LR was cut for being far too high, and since then the gradient norm fell to {ev['grad_norm']:.3f}, "
        f"under {ev['collapse']:g}x the {ev['warm_grad_norm']:.3f} of the first steps: the model is held where an "
        "LR still too high leaves it (the loss stalls, the gradient dies away)"
    )


def _overshoot_why(f: Finding) -> str:
    """What the first steps' update gain says (above_start's gain evidence; after a cut, against a sound LR's)."""
    ev = f.evidence
    if "sound_gain" in ev:
        short = (
            f"under the {ev['sound_gain']:g} a sound LR reaches, where twice it reads 0.67"
            if ev["gain"] < ev["sound_gain"]
            else f"a sound LR's, but a quarter of them delivered {ev['gain_q1']:.2f} or less, where a sound LR's stay "
            "over 0.6"
        )
        return (
            f"the LR was cut for being far too high, and over the first {ev['gain_window']} steps since, the updates "
            f"delivered {ev['gain']:.2f} of the loss decrease their gradient promised on their own batch (median; "
            f"{short}): it is still too high"
        )
    if "steady_gain" in ev:
        return (
            f"over this phase's first {ev['gain_window']} steps the updates delivered {ev['gain']:.2f} of the loss "
            f"decrease their gradient promised on their own batch (median; a sound LR reads 0.72 or more) and a "
            f"quarter of them {ev['gain_q1']:.2f} or less (a sound LR's stay over {ev['steady_gain']:g}): they "
            "overshoot on every few steps, as an LR 2-3x too high makes them, and the model trains slowly after"
        )
    return (
        f"over this phase's first steps the updates delivered {ev['gain']:.2f} of the loss decrease their "
        f"gradient promised on their own batch (median of {ev['gain_window']} steps; under {ev['min_gain']:g}, "
        "where a sound LR keeps 0.6-1): they overshoot"
    )


def _too_high_why(f: Finding, factor: float, before: float | None = None) -> str:
    """above_start's reasoning: the loss above its start, updates that overshoot (after a cut that
    lifted their gain, `before`, off its floor: halved), or a model stalled (at the unigram level,
    or after a cut with a gradient dying away)."""
    if "warm_grad_norm" in f.evidence or "unigram" in f.evidence:
        again = "again " if "warm_grad_norm" in f.evidence else ""
        return _stalled_why(f) + f"; cut it {again}x{factor:.3g}, {OWED}"
    if "sound_gain" in f.evidence:  # the replay after a cut still short of a sound LR's gain
        return _overshoot_why(f) + f"; cut it again x{factor:.3g}, {OWED}"
    if "steady_gain" in f.evidence:  # short of a sound LR's gain without a cut: within a few times of it
        return _overshoot_why(f) + f"; halve it (x{factor:.3g}), {OWED}"
    if before is not None and _rose(f.evidence, before):  # the replay after a gain-based cut: its gain rose
        return (
            _overshoot_why(f) + f"; the last cut in this phase answered a gain of {before:.2f}, and the replay at "
            f"the lower LR rose to {f.evidence['gain']:.2f}, off the 0.1-0.2 an LR far too high holds it at: this "
            f"one is within a decade of a sound LR (the rise, not this gain alone, says so); cut it x{factor:.3g}, "
            + OWED
        )
    if "gain" in f.evidence:  # the first steps' updates overshoot
        return (
            _overshoot_why(f) + ", as an LR far too high makes them, and the weights they inflate train slowly for "
            f"the rest of the run; cut it x{factor:.3g}, {OWED}"
        )
    return (
        f"the loss has been above the {f.evidence['start']:.3f} this phase started at for "
        f"{f.evidence['patience']} steps: training makes the model worse than its untouched weights, which "
        f"is what an LR far too high does; cut it x{factor:.3g} (again while the loss does not fall), {OWED}"
    )
