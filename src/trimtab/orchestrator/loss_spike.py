"""The loss-spike rule (`spike`): a loss above the trend the run itself predicts, and over a phase's first steps
above its lowest loss (the early bar); its ceiling is also the update gate's (core.Orchestrator.update_gate).
Apart from monitors.py, whose kit it uses, so that each module stays one detector's or one kit's.
"""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics


class LossSpike(Monitor):
    """Loss above the trend the run itself predicts: a least-squares line through the last
    `window` healthy losses against log(step), extrapolated to the next step, plus
    max(sigma x the residuals' standard deviation, min_rise).

    Early in training the loss falls steeply, so a flat window's spread is mostly that trend and
    mean + k sigma sits far above the next healthy step: a stretch of bad data that lifted the
    loss from 4.90 to 6.49 passed under it. The residuals around the trend measure the
    step-to-step noise alone; on a plateau the line is flat and this is the flat window's rule.
    Loss curves are close to straight in log(step) over a window (a power law's local shape),
    so the line's extrapolation does not run below a curve that is flattening out.

    Once `min_samples` healthy steps follow the phase's LR warm-up (the steps its scheduled LR rose),
    the line is fitted from the warm-up's last step on: under a rising LR the loss is no power law,
    and its bend inflated the residuals (debug-moe, steps 1-24: std 0.154, bar 5.654, a wrecked
    update at step 25 from 4.79 to 5.44 passed and ended +3.3%; steps 10-24: std 0.048, bar 5.017).

    Over a phase's first `early_steps` steps the trend has too few samples, and the warm-up's
    steep fall inflates its residuals: weights wrecked at step 8 (loss 5.86 -> 6.18) passed far
    under it and trained on, 13% worse at the end. There a loss above the phase's lowest healthy
    one by max(early_sigma x the spread of the recent step-to-step changes, early_min_rise) is a
    spike too (`early` in its evidence): a falling loss rarely climbs back over its own minimum
    by more than its step-to-step noise. It only adds what the trend's bar misses; the update gate
    holds it too (`gate_ceiling`), and the policy answers it at once (ladder.py, _early_spike).

    A withheld update leaves the weights as they were, so the next step is judged from the withheld
    step's own loss: judged from the phase's lowest as before, a fault-free overshoot at the warm-up's
    peak LR (debug, 60 KB, step 9: 0.84 nats) froze the run there, every next loss over the same stale
    bar, each update withheld (steps 10-19), then rolled back three times and gave up at step 23. A next
    loss under that level is the weights' (a new batch scored as high): its update passes, and the step
    after is judged from the same level while the loss stays over the phase's bar; a loss rising further
    is a spike again. Such losses stay out of the window (not the phase's healthy curve), and the
    step-to-step changes are per step of the gaps they leave.

    The line's x is the update clock, not the step: a step less the phase's steps before it whose update
    was not applied (withheld by the update gate, a skip, every row gated by the row gate, an fp16
    overflow). The loss falls with updates, not steps: a frozen stretch leaves it where it was, and a line
    in log(step) extrapolated across it predicted a fall that could not happen (debug, 200 steps,
    `bad_batch@25:25`, every row of steps 25-49 gated: the first clean steps 50-55 read 4.95-5.03 over a
    trend of 4.62-4.57, bar 4.87, the LR cut x0.5 and a rollback to step 23, 55 steps re-done; on this
    clock the trend reads 4.96 there, bar 5.21). A withheld step's loss under the bar (the weights' own)
    stands at the clock of the next applied step: the same weights."""

    rule, family = "spike", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.spike
        self.window = Rolling(self.cfg.window)  # healthy losses
        self.steps = Rolling(self.cfg.window)  # their steps
        self.clock = Rolling(self.cfg.window)  # their update clocks: the trend's x (step less `held` then)
        self.held = 0  # the phase's steps so far whose update was not applied
        self.next_step = 1
        self.first_step = -1  # the phase's first step seen: its early steps count from it
        self.trained = False  # the phase starts from trained weights (finetune, train.init_from): armed early
        self.withheld = [-1, 0.0]  # [step, loss]: an early spike's update withheld; the next step is judged from it
        self.lr_seen = -1.0  # the schedule's LR at the last step whose update went in (-1: none yet)
        self.warm_end = 0  # the last step of the phase's LR warm-up (0: none seen)
        self.warming = True  # the schedule's LR has risen at every step of the phase so far
        self.capacity: list[float] | None = None  # each MoD layer's capacity at the last step (None: no MoD layer)
        self._fit: tuple[Any, tuple[float, float]] | None = None  # trend() of the current window

    def trend(self) -> tuple[float, float]:
        """(the loss predicted at the next step, the residuals' standard deviation). One pass of
        running sums: the gate and the monitor ask every step (0.14 ms with one pass per term)."""
        start = self.fit_from()
        now = self.next_step - self.held  # the next step's update clock
        key = (now, len(self.window), self.window.values[-1] if len(self.window) else None, start)
        if self._fit is not None and self._fit[0] == key:
            return self._fit[1]
        n = sum(1 for step in self.steps.values if step >= start)
        sx = sy = sxx = sxy = syy = 0.0
        for step, clock, y in zip(self.steps.values, self.clock.values, self.window.values):
            if step < start:
                continue
            x = math.log(max(clock, 1))
            sx, sy, sxx, sxy, syy = sx + x, sy + y, sxx + x * x, sxy + x * y, syy + y * y
        x_mean, y_mean = sx / n, sy / n
        cxx, cxy, cyy = sxx - n * x_mean * x_mean, sxy - n * x_mean * y_mean, syy - n * y_mean * y_mean
        slope = cxy / cxx if cxx > 1e-12 else 0.0
        std = math.sqrt(max(cyy - slope * cxy, 0.0) / max(n - 2, 1))  # residual sum of squares
        fit = (y_mean + slope * (math.log(max(now, 1)) - x_mean), std)
        self._fit = (key, fit)
        return fit

    def fit_from(self) -> int:
        """The first step the trend is fitted from: the warm-up's last once min_samples healthy steps
        are at or after it, the window's first (0) before that and in a phase without a warm-up."""
        if self.warming or self.warm_end == 0:
            return 0
        after = sum(1 for step in self.steps.values if step >= self.warm_end)
        return self.warm_end if after >= self.cfg.min_samples else 0

    def _follow_warm_up(self, m: StepMetrics) -> None:
        """The phase's warm-up: its first steps whose scheduled LR rises. A withheld update holds the
        warm-up back a step (optim.lr_at's `behind`: the next step meets the same LR), so a step is
        compared with the last step whose update went in."""
        if self.warming and self.lr_seen >= 0:
            if m.scheduled_lr > self.lr_seen:
                self.warm_end = m.step
            else:
                self.warming = False
        if not (m.skipped or m.overflow):
            self.lr_seen = m.scheduled_lr

    def _follow_capacity(self, m: StepMetrics) -> None:
        """Another model (jumped): the losses before it predict nothing of it, so the window starts again."""
        if m.mod_layers is None:
            return
        capacities = [capacity for _, capacity in m.mod_layers]
        if self.jumped(capacities):
            self.window, self.steps, self.clock = (Rolling(self.cfg.window) for _ in range(3))
            self.withheld, self._fit = [-1, 0.0], None
        self.capacity = capacities

    def jumped(self, capacities: list[float] | None) -> bool:
        """A MoD layer's capacity (in layer order) moved by more than capacity_jump since the last step
        (config.loss_rules.SpikeRule; per layer: one layer of four cut moves their mean a quarter as far)."""
        if capacities is None or self.capacity is None:
            return False
        if len(capacities) != len(self.capacity):
            return True
        return max(abs(a - b) for a, b in zip(capacities, self.capacity)) > self.cfg.capacity_jump

    def ceiling(self) -> float:
        if len(self.window) < self.cfg.min_samples:
            return math.inf
        predicted, std = self.trend()
        return predicted + max(self.cfg.sigma * std, self.cfg.min_rise)

    def gate_ceiling(self) -> float:
        """The update gate's bar: the trend's, or the early one under it. Found after the update, an
        early spike's garbage was trained on (debug, bad_batch@10, early_steps 25: found at step 10,
        its rows left out, yet the run stalled 0.3 nats above the fault-free curve until above_start
        rolled back 48 steps); withheld, the run stayed on the fault-free curve (5.14 at step 20)."""
        return min(self.ceiling(), self.early_ceiling()[0])

    def early_ceiling(self) -> tuple[float, float, float]:
        """(the early bar, the phase's lowest healthy loss, the step-to-step spread) over the
        phase's first early_steps steps; an infinite bar after them or before 3 healthy steps."""
        cfg, steps = self.cfg, self.early_steps()
        if steps == 0 or len(self.window) < 3 or self.next_step - self.first_step >= steps:
            return math.inf, math.nan, math.nan
        lowest, spread = self._early_terms()
        if self.withheld[0] == self.next_step - 1:  # the same weights as the withheld step: from its level
            lowest = max(lowest, self.withheld[1])
        return lowest + max(cfg.early_sigma * spread, cfg.early_min_rise), lowest, spread

    def early_steps(self) -> int:
        """The phase's early steps: trained_early_steps from trained weights, whose loss starts steady
        (no fresh model's warm-up overshoot, the reason early_steps is off by default)."""
        return self.cfg.early_steps or (self.cfg.trained_early_steps if self.trained else 0)

    def _early_terms(self) -> tuple[float, float]:
        """(the lowest healthy loss, the spread of the last early_window step-to-step changes): a change
        across steps left out of the window is per step, or the fall after an overshoot was noise."""
        steps, values = list(self.steps.values), list(self.window.values)
        changes = [(b - a) / max(t - s, 1) for s, t, a, b in zip(steps, steps[1:], values, values[1:])]
        changes = changes[-self.cfg.early_window :]
        return min(values), Rolling(len(changes), changes).std()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "clock" not in state:  # older checkpoints: the window's steps, as their trend read them
            self.clock = Rolling(self.cfg.window, self.steps.values)

    def observe(self, m: StepMetrics) -> Finding | None:
        found = self._judge(m)
        self.held += int(m.skipped or m.overflow)  # no update applied: the next step meets the same weights
        return found

    def _judge(self, m: StepMetrics) -> Finding | None:
        self.next_step = m.step
        if self.first_step < 0:  # a checkpoint from before early_steps: its window's first step
            self.first_step = int(self.steps.values[0]) if len(self.steps) else m.step
        self.trained = self.trained or m.phase > 0
        self._follow_warm_up(m)
        self._follow_capacity(m)
        if not math.isfinite(m.loss):
            return None
        ceiling = self.ceiling()
        early = self.early_ceiling() if m.loss <= ceiling else (math.inf, math.nan, math.nan)
        if m.loss <= min(ceiling, early[0]):
            if self.withheld[0] == m.step - 1 and math.isfinite(early[0]) and m.loss > self._unraised(early[2]):
                self.withheld[0] = m.step  # at the withheld step's level, over the phase's bar: the weights'
                self.next_step = m.step + 1
                return None
            self.window.add(m.loss)
            self.steps.add(m.step)
            self.clock.add(m.step - self.held)
            self.next_step = m.step + 1
            return None
        if m.loss <= ceiling:  # under the trend's bar, over the early one
            self.next_step = m.step + 1
            found = self._early(m, *early)
            if m.skipped:
                self.withheld = [m.step, m.loss]
            return found
        predicted, std = self.trend()
        self.next_step = m.step + 1
        evidence = {
            "loss": m.loss,
            "predicted": predicted,
            "residual_std": std,
            "ceiling": ceiling,
            "window": len(self.window),
            "fit_from": self.fit_from(),  # the trend's first step (after the LR warm-up; 0: the window's)
        }
        summary = f"loss {m.loss:.3f} > trend {predicted:.3f} + {self.cfg.sigma:g} sigma ({std:.3f})"
        return self.finding(m, evidence, summary, 0.6 + 0.4 * (m.loss - ceiling) / max(ceiling - predicted, 1e-6))

    def _unraised(self, spread: float) -> float:
        """The early bar from the phase's lowest alone, as if no update had been withheld."""
        return self._early_terms()[0] + max(self.cfg.early_sigma * spread, self.cfg.early_min_rise)

    def _early(self, m: StepMetrics, ceiling: float, lowest: float, spread: float) -> Finding:
        cfg = self.cfg
        evidence = {
            "loss": m.loss,
            "early": True,
            "lowest": lowest,
            "step_spread": spread,
            "ceiling": ceiling,
            "window": len(self.window),
            "phase_step": m.step - self.first_step + 1,
        }
        level = "the withheld step's loss" if self.withheld == [m.step - 1, lowest] else "the phase's lowest"
        summary = (
            f"loss {m.loss:.3f} > {level} {lowest:.3f} + max({cfg.early_sigma:g} x step-to-step "
            f"spread {spread:.3f}, {cfg.early_min_rise:g}) in its first {self.early_steps()} steps"
        )
        return self.finding(m, evidence, summary, 0.6 + 0.4 * (m.loss - ceiling) / max(ceiling - lowest, 1e-6))
