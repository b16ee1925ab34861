"""Detectors of a run's course (monitors.py has the kit; a loss that climbs for good, Divergence,
is divergence.py's; one that stopped falling, Plateau, plateau.py's): a loss above where the run started
(AboveStart: an LR far too high from the first steps); a learning rate the schedule does not explain
is lr_rule.py's."""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.first_gains import MIN_REST, SOUND_GAIN, STEADY_GAIN, FirstGains, _mid
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics

HALTED = 0.2  # a descent under this share of the phase's fastest has halted, not slowed down
HORIZON = 4  # windows after the warm-up (and the first gain_steps) over which a stall at the unigram level is judged
# A loss under this share of a finding's level has fallen since: a new finding on the same ground needs it
FELL = 0.98


class AboveStart(FirstGains, Monitor):
    """The loss above where the phase started, `patience` steps in a row (skipped steps left out).

    The other rules compare a step with the run's recent past, so they need a window first (10
    to 50 steps) and follow a run that is bad from its first step: with 100x the preset's LR the
    loss climbed 6.2 -> 11.5 by step 15 and no rule fired. The first step's loss is the untouched
    weights' score; a model that scores worse for several steps in a row has been made worse by
    its training, whatever the windows say. Once it fired it fires again only while the loss does
    not fall (each time below 98% of the level it reported): a cut is given steps to work.

    A cut LR can still be far too high without the loss going above its start: on `debug` 2-10x
    the preset's LR holds the loss near 5.0 (the clean run passes 4.2) and the gradient norm falls
    to under half its warm-up level, where a sound LR keeps it at 0.6-1.4x. So once the rule has
    fired (`fired` survives a rollback, which restores the rest of its state), it also compares the
    median gradient norm of the last `window` steps with that of the first `window` (re-measured
    after each finding): below `collapse` x it, the LR is still too high and it fires again. A run
    the rule never fired on is never judged on its gradient norm.

    An LR too high by less keeps the loss below its start and still wrecks the run: at 30x the
    preset's LR the debug presets' loss fell from its start and ended 17-25% above a sound run's
    (debug 5.01 vs 4.17), with no rule firing. The damage is done in the first steps (the weights'
    norm grew 35 -> 210 by step 15, where the sound run's reached 37), and the update's gain shows
    it there (training/gain.py: the share of the first-order decrease the update delivered on its
    own batch). So for the phase's first `gain_steps` steps the rule has the gain measured, and the
    median of the last `gain_window` below `min_gain` is a finding too: 0.6-1.0 at the presets'
    LR over those steps (dense, MoE, MoD, hybrid; later, MoD's routing capacity warm-up pulls it
    to 0.3 with a sound LR), 0.1-0.25 at 30x.

    Garbage rows among those first steps pull the gain down too (and leave a young model slow for
    the rest of the run): an LR too high shows on every step, garbage only on its own, whose loss
    jumps back up. Such steps' rows are blamed instead, once a phase (`_low`, `_jumps_found`)."""

    rule, family = "above_start", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.above_start
        self.start: float | None = None
        self.over: list[float] = []  # losses of the steps above the line, in a row
        self.reported: float | None = None  # the level of the last finding
        self.since = 0  # the first step of the current stretch above the line
        self.first_step: int | None = None  # the phase's first step (after a rollback: the replay's)
        self.grads: list[float] = []  # gradient norms since the phase started or the last finding
        self.losses: list[float] = []  # the last 2 x window losses (the collapse's stall)
        self.fired = False  # a finding in this phase: the LR was far too high (kept across rollbacks)
        self.gains: list[float] = []  # update gains of the phase's first gain_steps steps
        # ... and for each, the step and rows where its loss jumped (None: it did not)
        self.jumped: list[dict[str, Any] | None] = []
        self.lowest: float | None = None  # the phase's lowest loss so far
        self.early_jumps: list[dict[str, Any]] = []  # every jumped step of the phase's first gain_steps
        self.data_read = False  # a finding blamed those steps' rows in this phase (kept across rollbacks)
        self.unigram: float | None = None  # the phase's training targets' unigram entropy (set by the orchestrator)
        self.rising_at = 0  # the last step the schedule raised the LR (its warm-up)
        self.last_lr = 0.0  # the schedule's LR of the last step seen
        self.fastest = 0.0  # the loss's largest fall from one window's median to the next's in the phase
        self.held = 0  # steps in a row the loss has stalled at the unigram level
        self.first_gains: list[float] = []  # every update gain measured in the phase (its first gain_steps)
        self.first_scales: list[float | None] = []  # ... and the LR multiplier of each (None: a checkpoint before it)
        self.cut_level: float | None = None  # the loss where the LR was last found too high (kept across rollbacks)
        # the LR multiplier a replay after a cut measured sound (its first gains' median at SOUND_GAIN or more)
        self.sound_at: float | None = None

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.loss):
            return None
        if self.start is None:
            self.start, self.first_step = m.loss, m.step
            return None if m.skipped else self._overshoot(m)  # the first update's gain counts
        line = self.start + max(self.cfg.margin, self.cfg.rel_margin * self.start)
        if m.skipped:
            return None
        if self.fired and (f := self._collapsed(m, line)) is not None:
            return f
        if not self.fired and (f := self._blind(m)) is not None:
            return f
        if (f := self._overshoot(m)) is not None:
            return f
        if m.loss <= line:
            self.over = []
            return None
        if not self.over:
            self.since = m.step  # the stretch's first step above the line: the weights before it were sound
        self.over.append(m.loss)
        if len(self.over) < self.cfg.patience:
            return None
        level = sum(self.over[-self.cfg.patience :]) / self.cfg.patience
        if self.reported is not None and level < FELL * self.reported:
            return None
        self.over, self.reported, self.fired, self.grads, self.cut_level = [], level, True, [], level
        return self.finding(
            m,
            {
                "loss": m.loss,
                "level": level,
                "start": self.start,
                "line": line,
                "patience": self.cfg.patience,
                "since": self.since,
            },
            f"loss {level:.3f} over {self.cfg.patience} steps, above the {self.start:.3f} the phase started at",
            0.7 + 0.3 * min(1.0, (level - line) / max(line - self.start, 1e-6)),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fired, data_read = self.fired, self.data_read  # a rollback restores the weights, not the LR the finding cut
        cut_level = self.cut_level
        super().load_state_dict(state)
        self.fired = fired or bool(state.get("fired"))
        self.cut_level = cut_level if cut_level is not None else state.get("cut_level")
        self.sound_at = state.get("sound_at")  # measured on the replay since the checkpoint, or to be measured again
        self.data_read = data_read or bool(state.get("data_read"))
        if len(self.jumped) != len(self.gains):  # a checkpoint from before the jumps were kept
            self.jumped = [None] * len(self.gains)
        if len(self.first_scales) != len(self.first_gains):  # ... or before their multipliers were
            self.first_scales = [None] * len(self.first_gains)

    def wants_gain(self, step: int) -> bool:
        """Whether step `step` of this phase is among its first gain_steps (None: none seen yet)."""
        return self.cfg.gain_steps > 0 and (self.first_step is None or step - self.first_step < self.cfg.gain_steps)

    def keeps_start(self, step: int) -> bool:
        """Whether the phase's first checkpoint is still wanted at `step`: its findings of a stall
        restore it, and come within HORIZON windows of the LR's warm-up (or of the first gain_steps);
        past them a finding after a cut (the gradient dying away) cuts without a rollback where it
        was pruned."""
        if self.first_step is None:
            return False
        warm = max(self.rising_at, self.first_step + self.cfg.gain_steps)
        return step <= warm + HORIZON * self.cfg.window

    def _overshoot(self, m: StepMetrics) -> Finding | None:
        """The update gain's median over the last gain_window measured steps under min_gain. Where
        the low gains are those of steps whose loss jumped (and the other steps' median, over
        MIN_REST or more, is sound), the jumped steps' rows are to blame, once a phase (`data_read`)."""
        jump = self._jump(m)
        if jump is not None and self.wants_gain(m.step):
            self.early_jumps.append(jump)
        # a step with rows gated is measured on the rows it trained (training/gain.py): its gain is the LR's
        if m.update_gain is None or not math.isfinite(m.update_gain):
            return None
        window = self.cfg.gain_window
        self.gains = (self.gains + [m.update_gain])[-window:]
        self.jumped = (self.jumped + [jump])[-window:]
        self.first_gains.append(m.update_gain)
        self.first_scales.append(m.lr_scale)
        last = not self.wants_gain(m.step + 1)  # the phase's last measured step: its jumps are judged
        gain = _mid(self.gains) if len(self.gains) == window else None
        # min_gain and SOUND_GAIN are a young model's (random weights): from trained weights (train.init_from)
        # Adam's fresh state overshoots at a sane LR: debug finetuned from a 60-step run at its preset's LR
        # read medians 0.43 and 0.40 over steps 1-7 (seeds 1, 2; seed 2 was cut x0.316) and 0.64 over 1-15 (at
        # 10x, cut x0.1 as its loss rose above its start by step 4, the replay was halved to 0.5x for it)
        if gain is None or gain >= self.cfg.min_gain or not self._young():
            if not last:
                return None
            return self._short_of_sound(m) if self.fired else self._jumps_found(m) or self._uneven(m)
        rest = [g for g, j in zip(self.gains, self.jumped) if j is None]
        jumped = self._low([j for j in self.jumped if j is not None])
        data = self._blamable(jumped, m) and len(rest) >= MIN_REST and _mid(rest) >= self.cfg.min_gain
        evidence = {
            "loss": m.loss,
            "start": self.start,
            "gain": gain,
            "min_gain": self.cfg.min_gain,
            "gain_window": window,
            "since": self._since(m),
        }
        self.gains, self.jumped, self.over, self.grads = [], [], [], []
        if data:
            steps = self._blame_jumps(evidence, jumped)
            evidence["gain_rest"] = _mid(rest)
            return self.finding(
                m,
                evidence,
                f"the updates delivered {gain:.2f} of the loss decrease their gradient promised (median of {window} "
                f"steps), but the low ones are steps {steps[0]}-{steps[-1]}, whose loss jumped back up; the "
                f"others delivered {evidence['gain_rest']:.2f}: those steps' rows, not the LR",
                0.6,
            )
        self.fired, self.cut_level = True, m.loss
        return self.finding(
            m,
            evidence,
            f"the updates delivered {gain:.2f} of the loss decrease their gradient promised (median of {window} "
            f"steps, under {self.cfg.min_gain:g}): they overshoot",
            0.7 + 0.3 * min(1.0, (self.cfg.min_gain - gain) / self.cfg.min_gain),
        )

    def _medians(self) -> tuple[float, float] | None:
        """The loss's median over the window before the last `window` steps, and over those."""
        window = self.cfg.window
        if len(self.losses) < 2 * window:
            return None
        return _mid(self.losses[:window]), _mid(self.losses[window:])

    def _stalled(self) -> bool:
        """The loss's median over the last `window` steps fell by less than `stall` of the window's
        before: the model stalls (debug at 3x: 5.14 -> 5.11, 0.6%), where a gradient norm falling
        with a sound LR comes with a loss still falling (small's first 50 steps: 2.0 -> 0.8)."""
        medians = self._medians()
        return medians is not None and medians[1] > (1 - self.cfg.stall) * medians[0]

    def _blind(self, m: StepMetrics) -> Finding | None:
        """The loss stalls at the data's unigram entropy (within `unigram_margin` of it) once the LR
        is warmed up: the model predicts tokens as if blind to their context, where an LR too high
        by a few times holds it (debug, 3x the preset's LR: 5.10 over steps 20-60 against 5.26 from
        no context, loss 5.06 at step 120; MoE and hybrid alike). A sound LR passes that level within
        a few steps of the warm-up (4.6-4.9 by step 30 on the four debug presets; without a warm-up it
        lingers there for about 15 steps on its way down), and an LR too low reaches it late and
        slowly (0.1x: at step 60, its descent slowing gradually). So the stall must hold for a whole
        window, judged only over the HORIZON windows after the first gain_steps + window steps and
        the LR's warm-up (while the phase's first checkpoint is kept for it, keeps_start), and only
        as a halt: the last window's fall under HALTED of the phase's fastest from one to the next."""
        if m.scheduled_lr > self.last_lr:
            self.rising_at = m.step
        self.last_lr = m.scheduled_lr
        if self.unigram is None or self.cfg.unigram_margin <= 0:
            return None
        window = self.cfg.window
        self.losses = (self.losses + [m.loss])[-2 * window :]
        if (medians := self._medians()) is not None:
            self.fastest = max(self.fastest, medians[0] - medians[1])
        past = self.first_step is None or m.step - self.first_step >= self.cfg.gain_steps + window
        # an LR already cut (a person's `ctl emergency-lr`, the ladder's) stalls a model by being too low:
        # debug cut x0.1 at step 17 halted at 5.05, read as too high, rolled back to step 0 and cut x0.316 more
        # (val 5.92 against 5.18 left alone). This rule's own cut ends the check already (`fired`).
        cut = m.lr_scale < 1 - 1e-6
        held = past and not cut and m.step - self.rising_at >= window and self._stalled()
        if held:
            before, level = medians
            near = abs(level - self.unigram) <= self.cfg.unigram_margin * self.unigram
            held = near and before - level <= HALTED * self.fastest
        self.held = self.held + 1 if held else 0
        if self.held < window or not self.keeps_start(m.step):  # held a whole window: no passing pause
            return None
        if (f := self._stall_jumps(m, level)) is not None:
            return f
        if self._sound_stall(m):
            return None
        self.losses, self.gains, self.jumped, self.over, self.fired, self.grads = [], [], [], [], True, []
        self.cut_level = level
        return self.finding(
            m,
            {
                "loss": m.loss,
                "start": self.start,
                "level": level,
                "unigram": self.unigram,
                "unigram_margin": self.cfg.unigram_margin,
                "window": window,
                "first_gain": _mid(self.first_gains),
                "since": self._since(m),
            },
            f"loss {level:.3f} (median of {window} steps) stalls at the {self.unigram:.3f} of predicting each token "
            "from no context (the data's unigram entropy)",
            0.7,
        )

    def _sound_stall(self, m: StepMetrics) -> bool:
        """A stall after first steps whose updates all but a few delivered a sound LR's gain is the data's or
        the model's, not the LR's: their lower quartile at STEADY_GAIN or more, or for an MoE model their
        median at SOUND_GAIN or more. Real text with a 1024-token BPE lingers at the unigram level for 20 steps
        or more at debug's sound LR (licences and docs: 6.03-6.05 over steps 25-45; found, rolled back to step 0
        four times, 164 steps replayed, 6.32 against 6.07 off); a forming MoE router piles tokens on a few
        experts and the loss waits for them to spread (clean debug-moe seed 4: 5.08-5.13 over steps 20-35, gain
        0.77, 4.95 by 40; cut: 5.03 at 40). No gains measured (gain_steps 0): the stall alone is judged."""
        gains = sorted(self.first_gains)
        if len(gains) < self.cfg.gain_window:
            return False
        return gains[len(gains) // 4] >= STEADY_GAIN or (bool(m.moe) and gains[len(gains) // 2] >= SOUND_GAIN)

    def _stall_jumps(self, m: StepMetrics, level: float) -> Finding | None:
        """A stall at the unigram level after a step of the phase's first ones whose loss jumped back
        up and whose update delivered under the phase's median gain, the other steps' updates sound:
        that step's rows first (once a phase, _blamable), not the LR, even one step (_jumps_found
        asks MIN_JUMPS without a stall). debug with bad_batch every 10 steps: step 10's garbage,
        applied at the warm-up's peak LR (the spike rule judges from step 20), held the loss 0.3-0.4
        over a fault-free run's by steps 31-46 (5.03 against 4.65), and the LR cut x0.316 for a stall
        ended 4.54 against 4.17 clean. Should the stall come back after the replay, the LR is cut."""
        jumps = self._low(self.early_jumps)
        if not self._rest_sound(jumps, m):
            return None
        self.losses, self.held = [], 0
        evidence = {"loss": m.loss, "start": self.start, "level": level, "unigram": self.unigram}
        evidence |= {"median_gain": _mid(self.first_gains), "window": self.cfg.window, "since": self._since(m)}
        steps = self._blame_jumps(evidence, jumps)
        return self.finding(
            m,
            evidence,
            f"loss {level:.3f} (median of {self.cfg.window} steps) stalls at the {self.unigram:.3f} of predicting "
            f"each token from no context, after the loss jumped back up at steps {', '.join(map(str, steps))}, "
            "whose updates delivered less than the phase's median gain: those steps' rows first",
            0.6,
        )

    def _cut_helped(self) -> bool:
        """Whether the loss (the last window's median) fell under FELL of where the LR was last found too
        high: a cut that did not bring it lower shows the LR was not what held it, and another cut will not
        either (real text at a sound LR, its stall read as too high: the replay at the cut LR stalled at the
        same level, its gradient norm down as a sound run's, and was rolled back to step 0 three times more)."""
        level = self._medians()
        return self.cut_level is None or level is None or level[1] < FELL * self.cut_level

    def _measured_sound(self, m: StepMetrics) -> bool:
        """Whether the replay after the last cut measured this LR sound (_short_of_sound: its first gains' median
        at SOUND_GAIN or more) and it was not raised since (a give-back): a gradient that dies away at it is the
        data's or the model's, and the LR answered the gain as a sound one does (a sound LR's gradient norm dips
        after the first steps too: debug 0.97 over steps 1-10, 0.51 over 11-20)."""
        return self.sound_at is not None and m.lr_scale <= self.sound_at * (1 + 1e-6)

    def _collapsed(self, m: StepMetrics, line: float) -> Finding | None:
        """After a finding: the gradient norm's last `window` steps against its first `window`,
        the last judged only once they all follow the phase's first gain_steps (the gain judges
        those): a sound run's gradient norm dips for a while after the first steps too (debug:
        0.97 over steps 1-10, 0.51 over 11-20, 1.1 over 21-30), where 3x the LR's stays down (0.9,
        0.61, 0.45, 0.42)."""
        if not math.isfinite(m.grad_norm):
            return None
        window = self.cfg.window
        self.losses = (self.losses + [m.loss])[-2 * window :]
        grads = self.grads + [m.grad_norm]
        self.grads = grads[:window] + grads[window:][-window:]  # the first window and the last
        judged = self.first_step is None or m.step - self.first_step >= self.cfg.gain_steps + window
        if len(self.grads) < 2 * window or not judged or self._measured_sound(m):
            return None
        warm, now = _mid(self.grads[:window]), _mid(self.grads[window:])
        if now >= self.cfg.collapse * warm or not self._stalled() or not self._cut_helped():
            return None
        self.cut_level = self._medians()[1]
        self.grads, self.over, self.losses = [], [], []
        return self.finding(
            m,
            {
                "loss": m.loss,
                "start": self.start,
                "line": line,
                "grad_norm": now,
                "warm_grad_norm": warm,
                "collapse": self.cfg.collapse,
                "window": window,
                "since": self._since(m),
            }
            | ({} if self.sound_at is None else {"sound_at": self.sound_at}),
            f"gradient norm {now:.3f} (median of {window} steps) under {self.cfg.collapse:g}x the {warm:.3f} "
            "of the steps after the LR was cut for being far too high",
            0.75,
        )
