"""Monitors: small stateful detectors over per-step metrics, each returning a Finding or None.

A monitor sees one StepMetrics at a time (host floats, read from the device in batches), keeps a
rolling window, and never acts: the policy turns findings into decisions. Values a monitor flags
are kept out of its own window, so one spike does not raise the bar for the next. Every monitor's
state is a plain dict, saved in checkpoints (exact resume) and restored on rollback.

This module holds the kit (StepMetrics, Finding, Rolling, Monitor) and the detectors of one bad
step (NonFinite, LossSpike, GradExplosion); trends.py, plateau.py and divergence.py those of a
run's course, resources.py those of the machine; rules.py lists them all. Adding a monitor:
subclass Monitor, set `rule` and `family`, implement observe(), and list it in rules.MONITORS;
the policy handles its findings through its family.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig


@dataclass(kw_only=True)
class StepMetrics:
    """One step as the monitors see it."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool = False  # the update gate withheld the update
    skip_by: str = ""  # a skip_step asked for it ("person", "hook": StepOutput.skip_by); "": the gate's alone
    overflow: bool = False  # fp16 GradScaler found inf/NaN
    tokens_per_s: float = 0.0
    lr: float = 1e-3  # what the optimizer applied
    scheduled_lr: float = 1e-3  # what the config's schedule gives for this step
    lr_scale: float = 1.0  # the orchestrator's / a person's multiplier (journaled)
    progress: float = 0.0  # step / total steps
    memory_frac: float | None = None  # device (or machine) memory in use, 0..1, where known
    micro_batch_tokens: int = 0
    checkpointing: str = "off"  # train.activation_checkpointing in use (an OOM may have raised it)
    changes: int = 0  # actions applied to the run so far (the orchestrator's and a person's)
    world: int = 1  # processes in the job (a resume may run on another number)
    phase: int = 0  # pretraining 0, finetuning 1: new data and a new schedule
    rows: list[int] = field(default_factory=list)
    row_losses: dict[int, tuple[float, int]] | None = None  # per row, training forward: mean loss, targets
    gated_rows: list[int] = field(default_factory=list)  # left out of this step's update by the row gate
    row_parts: dict[int, str] | None = None  # each row's mixture source (data.mix name); None: one source
    moe: list[tuple[int, list[float], float, int]] | None = None  # (layer, load shares, dropped, top_k)
    mod_capacity: float | None = None  # mean capacity of the Mixture-of-Depths layers
    mod_layers: list[tuple[int, float]] | None = None  # (layer, capacity) of each Mixture-of-Depths layer
    update_gain: float | None = None  # share of the predicted decrease the update delivered (training/gain.py)
    # RL: the step's figures (rl/step.py RolloutBatch.health): flat_groups (the share of its
    # groups with equal rewards), solved_groups (of them, those all at rl.full_reward),
    # verifications (scored, failed, timed out), verifier_error (the step's last verifier error,
    # this rank's, when one raised), reward, entropy, truncated, response_tokens
    rl: dict[str, Any] | None = None
    unsettled: bool = False  # instability lately (Policy.unsettled): a high loss is the model's, not a row's

    def trained_loss(self) -> float | None:
        """The loss of the rows the update trained on: the step's less the rows the row gate left out
        (their scores stand in the reported loss, training/row_gate.py; readings.step_metrics puts this
        in `loss`), their targets' mean from row_losses; None where every row was gated (or, unlikely,
        gated rows come without row losses): nothing trained."""
        if not self.gated_rows:
            return self.loss
        gated = set(self.gated_rows)
        kept = [(loss, n) for row, (loss, n) in (self.row_losses or {}).items() if row not in gated]
        targets = sum(n for _, n in kept)
        return sum(loss * n for loss, n in kept) / targets if targets else None


@dataclass(kw_only=True)
class Finding:
    rule: str
    family: str  # findings of one family share an escalation ladder
    step: int
    evidence: dict[str, Any]  # the numbers that triggered it
    summary: str  # e.g. "loss 7.9 > mean 4.6 + 5 sigma (0.12)"
    strength: float  # 0..1: how clearly the evidence passes the threshold
    rows: list[int] = field(default_factory=list)
    # what the monitor remembers once the finding's remedy is applied (the policy's Remedy.commit passes it on)
    commit: Callable[[], None] | None = field(default=None, repr=False, compare=False)


class Rolling:
    """The last `size` values with their mean and standard deviation."""

    def __init__(self, size: int, values: list[float] = ()):
        self.values: deque[float] = deque(values, maxlen=size)

    def add(self, value: float) -> None:
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def std(self) -> float:
        mean = self.mean()
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / max(len(self.values) - 1, 1))

    def median(self) -> float:
        ordered = sorted(self.values)
        return ordered[len(ordered) // 2]

    def slope(self) -> float:
        """Least-squares slope per step."""
        n = len(self.values)
        x_mean, y_mean = (n - 1) / 2, self.mean()
        cov = sum((i - x_mean) * (v - y_mean) for i, v in enumerate(self.values))
        return cov / sum((i - x_mean) ** 2 for i in range(n))

    def rise_error(self) -> float:
        """Standard error of the least-squares line's rise over the window ((n - 1) x its slope's):
        the residuals' spread about the line over the spread of the steps."""
        n = len(self.values)
        if n < 3:
            return math.inf
        slope, x_mean, y_mean = self.slope(), (n - 1) / 2, self.mean()
        residual = sum((v - y_mean - slope * (i - x_mean)) ** 2 for i, v in enumerate(self.values))
        sxx = sum((i - x_mean) ** 2 for i in range(n))
        return (n - 1) * math.sqrt(residual / (n - 2) / sxx)

    def full(self) -> bool:
        return len(self.values) == self.values.maxlen


def outlier_threshold(reference: list[float], sigma: float, min_gap: float) -> tuple[float, float, float]:
    """(median, MAD-based spread, threshold) of `reference`: a row's loss above the median by
    max(sigma x the spread, min_gap) is an outlier (rules rows and data). Empty: nothing is."""
    if not reference:
        return math.inf, 0.0, math.inf
    middle = median(reference)
    spread = 1.4826 * median([abs(x - middle) for x in reference])
    return middle, spread, middle + max(sigma * spread, min_gap)


class Monitor:
    rule = ""
    family = ""
    # Attributes copied from the config, not learned: left out of the checkpoint (and out of an older one's
    # load), so a person's edit between sessions takes effect as the journal says it does
    SETTINGS: tuple[str, ...] = ()

    def observe(self, m: StepMetrics) -> Finding | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the config, its SETTINGS and caches (a leading underscore)."""
        return {
            k: list(v.values) if isinstance(v, Rolling) else v
            for k, v in vars(self).items()
            if k != "cfg" and k not in self.SETTINGS and not k.startswith("_")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in ((k, v) for k, v in state.items() if k not in self.SETTINGS):
            current = getattr(self, key, None)
            setattr(self, key, Rolling(current.values.maxlen, value) if isinstance(current, Rolling) else value)
        for key in [k for k in vars(self) if k.startswith("_")]:
            setattr(self, key, None)  # caches of the windows just replaced

    def finding(self, m: StepMetrics, evidence: dict[str, Any], summary: str, strength: float) -> Finding:
        return Finding(
            rule=self.rule,
            family=self.family,
            step=m.step,
            evidence=evidence,
            summary=summary,
            strength=max(0.0, min(1.0, strength)),
            rows=list(m.rows),
        )


class NonFinite(Monitor):
    """NaN or Inf in the loss or the gradient norm."""

    rule, family = "nonfinite", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        pass

    def observe(self, m: StepMetrics) -> Finding | None:
        if math.isfinite(m.loss) and (math.isfinite(m.grad_norm) or m.overflow):
            return None  # fp16: an overflowing gradient is the GradScaler's to handle (Fp16Overflow)
        return self.finding(
            m, {"loss": m.loss, "grad_norm": m.grad_norm}, f"loss {m.loss:.4g}, grad norm {m.grad_norm:.4g}", 1.0
        )


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
    step-to-step changes are per step of the gaps they leave."""

    rule, family = "spike", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.spike
        self.window = Rolling(self.cfg.window)  # healthy losses
        self.steps = Rolling(self.cfg.window)  # their steps
        self.next_step = 1
        self.first_step = -1  # the phase's first step seen: its early steps count from it
        self.trained = False  # the phase starts from trained weights (finetune, train.init_from): armed early
        self.withheld = [-1, 0.0]  # [step, loss]: an early spike's update withheld; the next step is judged from it
        self.lr_seen = -1.0  # the schedule's LR at the last step whose update went in (-1: none yet)
        self.warm_end = 0  # the last step of the phase's LR warm-up (0: none seen)
        self.warming = True  # the schedule's LR has risen at every step of the phase so far
        self.capacity: float | None = None  # the MoD capacity at the last step (None: no MoD layer)
        self._fit: tuple[Any, tuple[float, float]] | None = None  # trend() of the current window

    def trend(self) -> tuple[float, float]:
        """(the loss predicted at the next step, the residuals' standard deviation). One pass of
        running sums: the gate and the monitor ask every step (0.14 ms with one pass per term)."""
        start = self.fit_from()
        key = (self.next_step, len(self.window), self.window.values[-1] if len(self.window) else None, start)
        if self._fit is not None and self._fit[0] == key:
            return self._fit[1]
        n = sum(1 for step in self.steps.values if step >= start)
        sx = sy = sxx = sxy = syy = 0.0
        for step, y in zip(self.steps.values, self.window.values):
            if step < start:
                continue
            x = math.log(max(step, 1))
            sx, sy, sxx, sxy, syy = sx + x, sy + y, sxx + x * x, sxy + x * y, syy + y * y
        x_mean, y_mean = sx / n, sy / n
        cxx, cxy, cyy = sxx - n * x_mean * x_mean, sxy - n * x_mean * y_mean, syy - n * y_mean * y_mean
        slope = cxy / cxx if cxx > 1e-12 else 0.0
        std = math.sqrt(max(cyy - slope * cxy, 0.0) / max(n - 2, 1))  # residual sum of squares
        fit = (y_mean + slope * (math.log(max(self.next_step, 1)) - x_mean), std)
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
        """A MoD capacity that jumped (config.loss_rules.SpikeRule.capacity_jump) makes another model:
        the losses before it predict nothing of it, so the window starts again from this step."""
        if m.mod_capacity is None:
            return
        if self.jumped(m.mod_capacity):
            self.window, self.steps = Rolling(self.cfg.window), Rolling(self.cfg.window)
            self.withheld, self._fit = [-1, 0.0], None
        self.capacity = m.mod_capacity

    def jumped(self, capacity: float | None) -> bool:
        """`capacity` (the MoD layers' mean) is another model's than the last step's."""
        return None not in (capacity, self.capacity) and abs(capacity - self.capacity) > self.cfg.capacity_jump

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

    def observe(self, m: StepMetrics) -> Finding | None:
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


class GradExplosion(Monitor):
    """Pre-clip gradient norm above max_norm, or above factor x its rolling mean.

    The window holds healthy norms only, so on its own it could never follow a legitimate change
    of level (a new source in a mixture, the end of warm-up): every later step would be flagged
    and its update withheld, and withholding holds the model where its gradient is large, the
    remedy causing the symptom (seen on the README's mixture run: 0.35 -> 12 from step 22, 22
    steps withheld, a flat loss until they stopped). So `rebase_after` steps in a row over the
    ceiling, at one level (within `rebase_spread`), under max_norm, with the loss not rising
    (within rebase_loss_rise of the healthy steps before) are a new level of the weights, not an
    explosion of a batch: different batches give the same norm although no update was applied,
    so withholding cannot help. The window restarts from them and a `grad_level` finding says
    so; their updates pass from then on, clipped as ever."""

    rule, family = "grad", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.grad
        self.window = Rolling(self.cfg.window)
        self.losses = Rolling(10)  # the healthy steps' losses: what "not rising" compares with
        self.over: list[list[float]] = []  # [grad norm, loss] of the flagged steps in a row

    def _follow_capacity(self, m: StepMetrics) -> None:
        """A MoD capacity that jumped (config.loss_rules.SpikeRule.capacity_jump) makes another model:
        the losses before it predict nothing of it, so the window starts again from this step."""
        if m.mod_capacity is None:
            return
        if self.jumped(m.mod_capacity):
            self.window, self.steps = Rolling(self.cfg.window), Rolling(self.cfg.window)
            self.withheld, self._fit = [-1, 0.0], None
        self.capacity = m.mod_capacity

    def jumped(self, capacity: float | None) -> bool:
        """`capacity` (the MoD layers' mean) is another model's than the last step's."""
        return None not in (capacity, self.capacity) and abs(capacity - self.capacity) > self.cfg.capacity_jump

    def ceiling(self) -> float:
        if len(self.window) < self.cfg.min_samples:
            return self.cfg.max_norm
        return min(self.cfg.max_norm, self.cfg.factor * self.window.mean())

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.grad_norm):
            return None
        ceiling = self.ceiling()
        if m.grad_norm <= ceiling:
            self.window.add(m.grad_norm)
            if math.isfinite(m.loss):
                self.losses.add(m.loss)
            self.over = []
            return None
        self.over.append([m.grad_norm, m.loss])
        if self._new_level():
            return self._rebase(m, ceiling)
        mean = self.window.mean() if len(self.window) else float("nan")
        return self.finding(
            m,
            {"grad_norm": m.grad_norm, "ceiling": ceiling, "mean": mean},
            f"grad norm {m.grad_norm:.3g} > ceiling {ceiling:.3g} (rolling mean {mean:.3g})",
            0.6 + 0.4 * math.log10(m.grad_norm / ceiling),
        )

    def _new_level(self) -> bool:
        norms, losses = [g for g, _ in self.over], [v for _, v in self.over]
        return (
            self.cfg.rebase_after > 0
            and len(self.over) >= self.cfg.rebase_after
            and len(self.losses) > 0
            and max(norms) < self.cfg.max_norm
            and max(norms) <= self.cfg.rebase_spread * min(norms)
            and all(math.isfinite(v) and v <= self.losses.mean() + self.cfg.rebase_loss_rise for v in losses)
        )

    def _rebase(self, m: StepMetrics, ceiling: float) -> Finding:
        norms = [g for g, _ in self.over]
        before = self.window.mean() if len(self.window) else float("nan")
        self.window = Rolling(self.cfg.window, norms)
        self.over = []
        f = self.finding(
            m,
            {
                "norms": norms,
                "old_mean": before,
                "old_ceiling": ceiling,
                "new_ceiling": self.ceiling(),
                "loss_before": self.losses.mean(),
            },
            f"grad norm at a new level: {len(norms)} steps in a row at {min(norms):.3g}-{max(norms):.3g} "
            f"(was {before:.3g}) with the loss not rising",
            0.8,
        )
        f.rule, f.family = "grad_level", "baseline"
        return f
