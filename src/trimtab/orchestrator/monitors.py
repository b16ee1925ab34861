"""Monitors: small stateful detectors over per-step metrics, each returning a Finding or None.

A monitor sees one StepMetrics at a time (host floats, read from the device in batches), keeps a
rolling window, and never acts: the policy turns findings into decisions. Values a monitor flags
are kept out of its own window, so one spike does not raise the bar for the next. Every monitor's
state is a plain dict, saved in checkpoints (exact resume) and restored on rollback.

Adding a monitor: subclass Monitor, set `rule` and `family`, implement observe(), and list it in
build_monitors(); the policy handles its findings through its family.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig


@dataclass(kw_only=True)
class StepMetrics:
    """One step as the monitors see it."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool = False  # the update gate withheld the update
    overflow: bool = False  # fp16 GradScaler found inf/NaN
    tokens_per_s: float = 0.0
    lr: float = 1e-3  # what the optimizer applied
    scheduled_lr: float = 1e-3  # what the config's schedule gives for this step
    lr_scale: float = 1.0  # the orchestrator's / a person's multiplier (journaled)
    progress: float = 0.0  # step / total steps
    memory_frac: float | None = None  # device (or machine) memory in use, 0..1, where known
    micro_batch_tokens: int = 0
    changes: int = 0  # actions applied to the run so far (the orchestrator's and a person's)
    phase: int = 0  # pretraining 0, finetuning 1: new data and a new schedule
    rows: list[int] = field(default_factory=list)
    row_losses: dict[int, tuple[float, int]] | None = None  # per row, training forward: mean loss, targets
    moe: list[tuple[int, list[float], float, int]] | None = None  # (layer, load shares, dropped, top_k)
    mod_capacity: float | None = None  # mean capacity of the Mixture-of-Depths layers


@dataclass(kw_only=True)
class Finding:
    rule: str
    family: str  # findings of one family share an escalation ladder
    step: int
    evidence: dict[str, Any]  # the numbers that triggered it
    summary: str  # e.g. "loss 7.9 > mean 4.6 + 5 sigma (0.12)"
    strength: float  # 0..1: how clearly the evidence passes the threshold
    rows: list[int] = field(default_factory=list)


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

    def full(self) -> bool:
        return len(self.values) == self.values.maxlen


class Monitor:
    rule = ""
    family = ""

    def observe(self, m: StepMetrics) -> Finding | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the config and caches (a leading underscore)."""
        return {
            k: list(v.values) if isinstance(v, Rolling) else v
            for k, v in vars(self).items()
            if k != "cfg" and not k.startswith("_")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
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
    so the line's extrapolation does not run below a curve that is flattening out."""

    rule, family = "spike", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.spike
        self.window = Rolling(self.cfg.window)  # healthy losses
        self.steps = Rolling(self.cfg.window)  # their steps
        self.next_step = 1
        self._fit: tuple[Any, tuple[float, float]] | None = None  # trend() of the current window

    def trend(self) -> tuple[float, float]:
        """(the loss predicted at the next step, the residuals' standard deviation). One pass of
        running sums: the gate and the monitor ask every step (0.14 ms with one pass per term)."""
        key = (self.next_step, len(self.window), self.window.values[-1] if len(self.window) else None)
        if self._fit is not None and self._fit[0] == key:
            return self._fit[1]
        n = len(self.window)
        sx = sy = sxx = sxy = syy = 0.0
        for step, y in zip(self.steps.values, self.window.values):
            x = math.log(max(step, 1))
            sx, sy, sxx, sxy, syy = sx + x, sy + y, sxx + x * x, sxy + x * y, syy + y * y
        x_mean, y_mean = sx / n, sy / n
        cxx, cxy, cyy = sxx - n * x_mean * x_mean, sxy - n * x_mean * y_mean, syy - n * y_mean * y_mean
        slope = cxy / cxx if cxx > 1e-12 else 0.0
        std = math.sqrt(max(cyy - slope * cxy, 0.0) / max(n - 2, 1))  # residual sum of squares
        fit = (y_mean + slope * (math.log(max(self.next_step, 1)) - x_mean), std)
        self._fit = (key, fit)
        return fit

    def ceiling(self) -> float:
        if len(self.window) < self.cfg.min_samples:
            return math.inf
        predicted, std = self.trend()
        return predicted + max(self.cfg.sigma * std, self.cfg.min_rise)

    def observe(self, m: StepMetrics) -> Finding | None:
        self.next_step = m.step
        if not math.isfinite(m.loss):
            return None
        ceiling = self.ceiling()
        if m.loss <= ceiling:
            self.window.add(m.loss)
            self.steps.add(m.step)
            self.next_step = m.step + 1
            return None
        predicted, std = self.trend()
        self.next_step = m.step + 1
        evidence = {
            "loss": m.loss,
            "predicted": predicted,
            "residual_std": std,
            "ceiling": ceiling,
            "window": len(self.window),
        }
        summary = f"loss {m.loss:.3f} > trend {predicted:.3f} + {self.cfg.sigma:g} sigma ({std:.3f})"
        return self.finding(m, evidence, summary, 0.6 + 0.4 * (m.loss - ceiling) / max(ceiling - predicted, 1e-6))


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


class Divergence(Monitor):
    """The loss trends up: the least-squares line through the window rises by min_rise of its mean.
    Steps whose update was withheld are left out (their loss is a spike's or bad data's, not the
    trajectory's); the finding carries the window's rows, so the policy can tell bad data from a
    bad LR and attribute it to rows."""

    rule, family = "divergence", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.divergence
        self.window = Rolling(self.cfg.window)
        self.rows: list[list[int]] = []  # each window step's rows

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.loss) or m.skipped:
            return None
        self.window.add(m.loss)
        self.rows = (self.rows + [list(m.rows)])[-self.cfg.window :]
        if not self.window.full():
            return None
        mean, rise = self.window.mean(), self.window.slope() * (len(self.window) - 1)
        if rise <= self.cfg.min_rise * mean:
            return None
        rows = sorted({r for step in self.rows for r in step})
        self.window, self.rows = Rolling(self.cfg.window), []  # a fresh window before it can fire again
        f = self.finding(
            m,
            {"rise": rise, "mean": mean, "window": self.cfg.window},
            f"loss rose {rise:.3f} ({rise / mean:.1%}) over {self.cfg.window} steps",
            0.5 + 0.5 * rise / (2 * self.cfg.min_rise * mean),
        )
        f.rows = rows
        return f


class AboveStart(Monitor):
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
    the rule never fired on is never judged on its gradient norm."""

    rule, family = "above_start", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.above_start
        self.start: float | None = None
        self.over: list[float] = []  # losses of the steps above the line, in a row
        self.reported: float | None = None  # the level of the last finding
        self.since = 0  # the first step of the current stretch above the line
        self.first_step: int | None = None  # the phase's first step (after a rollback: the replay's)
        self.grads: list[float] = []  # gradient norms since the phase started or the last finding
        self.fired = False  # a finding in this phase: the LR was far too high (kept across rollbacks)

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.loss):
            return None
        if self.start is None:
            self.start, self.first_step = m.loss, m.step
            return None
        line = self.start + max(self.cfg.margin, self.cfg.rel_margin * self.start)
        if m.skipped:
            return None
        if self.fired and (f := self._collapsed(m, line)) is not None:
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
        if self.reported is not None and level < 0.98 * self.reported:
            return None
        self.over, self.reported, self.fired, self.grads = [], level, True, []
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
        fired = self.fired  # a rollback restores the weights, not the LR the finding cut: still suspect
        super().load_state_dict(state)
        self.fired = fired or bool(state.get("fired"))

    def _collapsed(self, m: StepMetrics, line: float) -> Finding | None:
        """After a finding: the gradient norm's last `window` steps against its first `window`."""
        if not math.isfinite(m.grad_norm):
            return None
        window = self.cfg.window
        grads = self.grads + [m.grad_norm]
        self.grads = grads[:window] + grads[window:][-window:]  # the first window and the last
        if len(self.grads) < 2 * window:
            return None
        warm = sorted(self.grads[:window])[window // 2]
        now = sorted(self.grads[window:])[window // 2]
        if now >= self.cfg.collapse * warm:
            return None
        self.grads, self.over = [], []
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
                "since": self.first_step if self.first_step is not None else m.step,
            },
            f"gradient norm {now:.3f} (median of {window} steps) under {self.cfg.collapse:g}x the {warm:.3f} "
            "of the steps after the LR was cut for being far too high",
            0.75,
        )


class Plateau(Monitor):
    """Loss variance below a threshold for `window` steps while far from the planned end."""

    rule, family = "plateau", "plateau"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.plateau
        self.window = Rolling(self.cfg.window)

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.loss) or m.skipped:  # a withheld update's loss says nothing of progress
            return None
        self.window.add(m.loss)
        if not self.window.full() or m.progress >= self.cfg.max_progress:
            return None
        variance = self.window.std() ** 2
        if variance >= self.cfg.variance:
            return None
        self.window = Rolling(self.cfg.window)
        return self.finding(
            m,
            {"variance": variance, "window": self.cfg.window, "progress": m.progress},
            f"loss variance {variance:.1e} < {self.cfg.variance:.0e} for {self.cfg.window} steps",
            0.5 + 0.5 * (1 - variance / self.cfg.variance),
        )


class Throughput(Monitor):
    """Tokens/s below factor x its rolling median for `patience` consecutive steps. An action
    applied to the run (a smaller micro-batch, a new expert, a rollback: the orchestrator's own or
    a person's) starts a fresh baseline, so the rule reports a slower machine, not those changes."""

    rule, family = "throughput", "throughput"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.throughput
        self.window = Rolling(self.cfg.window)
        self.slow = 0
        self.changes = 0
        self.reported: list[float] = []  # [step, tokens/s] of the last finding

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.changes != self.changes:
            self.changes, self.window, self.slow = m.changes, Rolling(self.cfg.window), 0
        if len(self.window) < self.cfg.min_samples or m.tokens_per_s >= self.cfg.factor * self.window.median():
            self.window.add(m.tokens_per_s)
            self.slow = 0
            return None
        self.slow += 1
        if self.slow < self.cfg.patience:
            return None
        self.slow = 0
        # Logged, never acted on: one line per slow stretch, another only after the cooldown or
        # when the rate halves again (a loaded machine filled the journal with dozens a run)
        quiet = m.step - self.reported[0] < self.cfg.cooldown if self.reported else False
        if quiet and m.tokens_per_s >= 0.5 * self.reported[1]:
            return None
        self.reported = [m.step, m.tokens_per_s]
        median = self.window.median()
        return self.finding(
            m,
            {"tokens_per_s": m.tokens_per_s, "median": median, "patience": self.cfg.patience},
            f"{m.tokens_per_s:,.0f} tokens/s < {self.cfg.factor:g} x median {median:,.0f} "
            f"for {self.cfg.patience} steps",
            1 - m.tokens_per_s / median,
        )


class MemoryPressure(Monitor):
    """Memory in use above the threshold for `patience` consecutive readings."""

    rule, family = "memory", "memory"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.memory
        self.high = 0

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.memory_frac is None or m.memory_frac <= self.cfg.threshold:
            self.high = 0
            return None
        self.high += 1
        if self.high < self.cfg.patience:
            return None
        self.high = 0
        return self.finding(
            m,
            {"memory_frac": m.memory_frac, "threshold": self.cfg.threshold},
            f"memory {m.memory_frac:.0%} in use > {self.cfg.threshold:.0%}",
            0.6 + 0.4 * (m.memory_frac - self.cfg.threshold) / (1 - self.cfg.threshold + 1e-9),
        )


class Fp16Overflow(Monitor):
    """An overflow storm: the GradScaler skipped at least max_overflows of the last `window` steps."""

    rule, family = "fp16", "fp16"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.fp16
        self.window = Rolling(self.cfg.window)

    def observe(self, m: StepMetrics) -> Finding | None:
        self.window.add(float(m.overflow))
        count = int(sum(self.window.values))
        if count < self.cfg.max_overflows:
            return None
        self.window = Rolling(self.cfg.window)
        return self.finding(
            m,
            {"overflows": count, "window": self.cfg.window},
            f"{count} fp16 overflows in {self.cfg.window} steps",
            count / self.cfg.window + 0.5,
        )


class UnexplainedLR(Monitor):
    """The LR the optimizer applies is more than `factor` above what the config's schedule and the
    journal explain (the schedule's LR for that step x the multiplier decisions set). A schedule the
    config asks for (cyclic restarts included) and a run length a person or the planner changes are
    explained by construction; a stray writer of the optimizer's LR or a schedule bug is not. After
    a finding the new level counts as explained (the remedy compensates for it), so one departure
    is answered once, and a second one on top of it again."""

    rule, family = "lr", "lr"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.lr
        self.explained = 1.0  # applied / (schedule x multiplier) accounted for by earlier findings

    def ceiling(self) -> float:
        """The update gate's bound on that ratio."""
        return self.cfg.factor * self.explained

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.scheduled_lr <= 0 or m.lr_scale <= 0:
            return None
        ratio = m.lr / (m.scheduled_lr * m.lr_scale)
        if ratio <= self.ceiling():
            return None
        explained, self.explained = self.explained, ratio
        evidence = {
            "lr": m.lr,
            "scheduled_lr": m.scheduled_lr,
            "lr_scale": m.lr_scale,
            "ratio": ratio,
            "explained": explained,
        }
        summary = (
            f"the optimizer applies lr {m.lr:.3g}, x{ratio / explained:.3g} what the schedule "
            f"({m.scheduled_lr:.3g}) and the multiplier ({m.lr_scale:.3g}) explain"
        )
        return self.finding(m, evidence, summary, 1.0)


RESUME_PROBE = 10  # steps after a resume before a shrunk micro-batch is probed at twice the size


class OutOfMemory(Monitor):
    """Out-of-memory errors, reported by the trainer's retry path (error()), counted per step; and,
    after `probe_after` clean steps on a micro-batch below the configured one, a probe: try twice
    the size again, waiting twice as long before the next probe (back-off)."""

    rule, family = "oom", "memory"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.oom
        self.configured = 0  # the micro-batch the run started with (set by the orchestrator)
        self.last = -1  # step of the last out-of-memory error
        self.retries = 0  # errors in that step
        self.clean = 0  # steps since, below the configured micro-batch
        self.probe_after = cfg.oom.probe_after

    def error(self, step: int, micro_batch_tokens: int, message: str, rows: list[int]) -> Finding:
        self.retries = self.retries + 1 if step == self.last else 1
        self.last, self.clean = step, 0
        return Finding(
            rule=self.rule,
            family=self.family,
            step=step,
            evidence={"kind": "oom", "micro_batch_tokens": micro_batch_tokens, "retry": self.retries, "error": message},
            summary=f"out of memory at a micro-batch of {micro_batch_tokens} tokens",
            strength=1.0,
            rows=list(rows),
        )

    def resumed(self) -> None:
        """A resumed run is a new process: the fragmentation and the other tenants that made the
        larger micro-batch fail may be gone, so probe it after RESUME_PROBE steps, with the back-off
        reset (a run resumed after shrinking otherwise kept its smallest micro-batch to the end)."""
        if self.cfg.probe_after:
            self.probe_after = self.cfg.probe_after
            self.clean = max(self.clean, self.probe_after - RESUME_PROBE)

    def observe(self, m: StepMetrics) -> Finding | None:
        if not self.probe_after or not self.configured or m.micro_batch_tokens >= self.configured:
            return None
        self.clean += 1
        if self.clean < self.probe_after:
            return None
        clean, self.clean, self.probe_after = self.clean, 0, self.probe_after * 2  # back off if it fails again
        target = min(m.micro_batch_tokens * 2, self.configured)
        evidence = {"kind": "probe", "micro_batch_tokens": m.micro_batch_tokens, "clean_steps": clean, "target": target}
        return Finding(
            rule=self.rule,
            family=self.family,
            step=m.step,
            evidence=evidence,
            summary=f"{clean} steps without running out of memory",
            strength=0.6,
        )


MONITORS = {
    "nonfinite": NonFinite,
    "spike": LossSpike,
    "grad": GradExplosion,
    "divergence": Divergence,
    "above_start": AboveStart,
    "plateau": Plateau,
    "throughput": Throughput,
    "memory": MemoryPressure,
    "fp16": Fp16Overflow,
    "lr": UnexplainedLR,
    "oom": OutOfMemory,
}


def build_monitors(cfg: OrchestratorConfig) -> dict[str, Monitor]:
    """Every enabled rule's monitor; non-finite values are always watched."""
    return {name: cls(cfg) for name, cls in MONITORS.items() if name == "nonfinite" or getattr(cfg, name).enabled}
