"""Monitors: small stateful detectors over per-step metrics, each returning a Finding or None.

A monitor sees one StepMetrics at a time (host floats, read from the device in batches), keeps a
rolling window, and never acts: the policy turns findings into decisions. Values a monitor flags
are kept out of its own window, so one spike does not raise the bar for the next. Every monitor's
state is a plain dict, saved in checkpoints (exact resume) and restored on rollback.

This module holds the kit (StepMetrics, Finding, Rolling, Monitor) and the detectors of one bad
step (NonFinite, GradExplosion; the loss's spike: loss_spike.py); trends.py, plateau.py and divergence.py those of a
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

    def ceiling(self) -> float:
        if len(self.window) < self.cfg.min_samples:
            return self.cfg.max_norm
        return min(self.cfg.max_norm, self.cfg.factor * self.window.mean())

    def observe(self, m: StepMetrics) -> Finding | None:
        # 0.0: no row trained (the row gate left out all: no gradient), nothing of the norm's level; in the
        # window, 20 of them made the ceiling 0 (debug, bad_batch@15:106: ZeroDivisionError at step 97)
        if not math.isfinite(m.grad_norm) or m.grad_norm == 0.0:
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
