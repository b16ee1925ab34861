"""The live planner's arithmetic: fit the measured loss curve, say how far training has come and
which run length the fit recommends. Pure functions of logged numbers (no torch, no trainer).

The fit is the data term of Hoffmann et al. 2022's parametric loss, L(N, D) = E + A/N^alpha +
B/D^beta, at the run's fixed N: L(D) = E + B * D^-beta over tokens seen D. Extrapolating a
learning curve with such a power law is the classic approach of Domhan et al. 2015 ("Speeding up
Automatic Hyperparameter Optimization of Deep Neural Networks by Extrapolation of Learning
Curves"). beta is searched on a log grid and, for each beta, E and B are linear least squares
(variable projection): no optimiser, no starting point, the same answer on every rank.
Caveat: a decaying LR lowers the loss late in a run beyond what a power law in D predicts
(Tissue et al. 2024, "Scaling Law with Learning Rate Annealing"), so the fit is conservative
about the gains left: it tends to recommend extending rather than shortening.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from trimtab.config.plan import PlanConfig

BETAS = np.geomspace(0.01, 3.0, 160)
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(kw_only=True)
class LossFit:
    E: float  # the loss this run would approach with unlimited tokens
    B: float  # scale of the reducible part at d_ref tokens
    beta: float
    d_ref: float  # tokens the fit is normalised at (its last point): keeps B in a sane range
    r2: float  # share of the loss variance the fit explains
    points: int

    def predict(self, tokens: float) -> float:
        return self.E + self.B * (max(tokens, 1.0) / self.d_ref) ** -self.beta

    def describe(self) -> str:
        return f"L(D) = {self.E:.3f} + {self.B:.3f} * (D / {self.d_ref:.3g})^-{self.beta:.3f}"


def fit_loss_curve(tokens: Sequence[float], losses: Sequence[float]) -> LossFit:
    """Least-squares L(D) = E + B * (D / d_ref)^-beta with B >= 0 and E >= 0: beta on a log grid,
    then refined by golden-section search between the best point's neighbours. A curve that does
    not fall (every beta gives B <= 0) is fitted as flat: B = 0, E = its mean, r2 = 0."""
    d, y = np.asarray(tokens, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    d_ref = float(d.max())
    x = d / d_ref
    sst = float(((y - y.mean()) ** 2).sum())
    valid = [(sol, i) for i, beta in enumerate(BETAS) if (sol := _solve(x, y, float(beta))) is not None]
    if not valid or sst == 0:
        return LossFit(E=float(y.mean()), B=0.0, beta=0.0, d_ref=d_ref, r2=0.0, points=len(y))
    best, i = min(valid, key=lambda v: v[0][0])
    beta = _refine(x, y, float(BETAS[max(i - 1, 0)]), float(BETAS[min(i + 1, len(BETAS) - 1)]))
    refined = _solve(x, y, beta)
    if refined is None or refined[0] > best[0]:
        beta, refined = float(BETAS[i]), best
    sse, e, b = refined
    return LossFit(E=e, B=b, beta=beta, d_ref=d_ref, r2=max(0.0, 1 - sse / sst), points=len(y))


def _refine(x: np.ndarray, y: np.ndarray, lo: float, hi: float) -> float:
    """Golden-section search for the beta of least SSE in [lo, hi] (between the best grid
    point's neighbours the SSE is smooth and has one minimum)."""
    for _ in range(40):
        a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
        sa, sb = _solve(x, y, a), _solve(x, y, b)
        if sb is None or (sa is not None and sa[0] < sb[0]):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def _solve(x: np.ndarray, y: np.ndarray, beta: float) -> tuple[float, float, float] | None:
    """(sse, E, B) of the best fit at this beta, or None when the loss does not fall (B <= 0)."""
    z = x**-beta
    e, b = _line(z, y)
    if b <= 0:
        return None
    if e < 0:  # the asymptote cannot be below zero: fit through the origin instead
        e, b = 0.0, float((z * y).sum() / (z * z).sum())
    return float(((y - e - b * z) ** 2).sum()), e, b


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line y = e + b x."""
    xm, ym = x.mean(), y.mean()
    var = ((x - xm) ** 2).sum()
    if var == 0:
        return float(ym), 0.0
    b = float(((x - xm) * (y - ym)).sum() / var)
    return float(ym - b * xm), b


@dataclass(kw_only=True)
class RunProgress:
    """What the planner knows about the run at a status: the trainer's numbers."""

    step: int
    tokens: int
    total_steps: int  # the pretraining phase's current length
    original_steps: int  # train.max_steps
    warmup_steps: int
    dataset_tokens: int


@dataclass(kw_only=True)
class Status:
    step: int
    tokens: int
    total_steps: int
    original_steps: int
    epochs_seen: float  # passes over the training split so far
    planned_epochs: float  # at the end of the run as now planned
    original_epochs: float  # at the end of the configured run (train.max_steps)
    token_progress: float
    convergence: float | None  # share of the loss drop reachable within the longest allowed run
    confidence: str  # none | low | medium | high: how well the fit explains the curve
    phase: str  # warmup | rapid | steady | convergence | flat
    recommendation: str  # continue | shorten | extend
    recommended_steps: int
    loss_now: float | None = None  # the fit at the current tokens
    loss_end: float | None = None  # predicted at the planned end
    loss_recommended: float | None = None  # predicted at the recommended end
    loss_best: float | None = None  # predicted at the longest allowed run
    fit: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def confidence_of(fit: LossFit | None, cfg: PlanConfig) -> str:
    if fit is None:
        return "none"
    if fit.r2 >= 0.95 and fit.points >= 2 * cfg.min_points:
        return "high"
    return "medium" if fit.r2 >= 0.8 else "low"


def phase_of(fit: LossFit | None, convergence: float | None) -> str:
    if fit is None:
        return "warmup"
    if fit.B == 0 or convergence is None:
        return "flat"
    return "rapid" if convergence < 0.5 else "steady" if convergence < 0.85 else "convergence"


def live_status(
    points: Sequence[Sequence[float]],
    run: RunProgress,
    cfg: PlanConfig,
    lr_ok: Callable[[int], bool] = lambda steps: True,
) -> Status:
    """Status from the logged (step, tokens, loss) points; `lr_ok(steps)` says whether the
    schedule may move to a new length now (the LR would not jump too far in one step)."""
    per_step = run.tokens / max(run.step, 1)
    dataset = max(run.dataset_tokens, 1)
    progress = run.tokens / max(per_step * run.total_steps, 1)
    used = [(t, loss) for s, t, loss in points if s > run.warmup_steps and math.isfinite(loss)]
    status = Status(
        step=run.step,
        tokens=run.tokens,
        total_steps=run.total_steps,
        original_steps=run.original_steps,
        epochs_seen=run.tokens / dataset,
        planned_epochs=per_step * run.total_steps / dataset,
        original_epochs=per_step * run.original_steps / dataset,
        token_progress=progress,
        convergence=None,
        confidence="none",
        phase="warmup",
        recommendation="continue",
        recommended_steps=run.total_steps,
    )
    if len(used) < cfg.min_points:
        return status
    fit = fit_loss_curve([t for t, _ in used], [loss for _, loss in used])
    hi = max(math.floor(run.original_steps * (1 + cfg.max_extend)), run.total_steps)
    first, now, best = fit.predict(used[0][0]), fit.predict(run.tokens), fit.predict(hi * per_step)
    status.convergence = 1.0 if first - best <= 0 else min(1.0, max(0.0, (first - now) / (first - best)))
    status.confidence, status.phase = confidence_of(fit, cfg), phase_of(fit, status.convergence)
    target = recommend_steps(fit, run, per_step, cfg, lr_ok)
    status.recommended_steps = target
    status.recommendation = (
        "continue" if target == run.total_steps else "shorten" if target < run.total_steps else "extend"
    )
    status.loss_now, status.loss_best = now, best
    status.loss_end, status.loss_recommended = fit.predict(run.total_steps * per_step), fit.predict(target * per_step)
    status.fit = asdict(fit)
    return status


def recommend_steps(
    fit: LossFit, run: RunProgress, per_step: float, cfg: PlanConfig, lr_ok: Callable[[int], bool]
) -> int:
    """The shortest length whose predicted final loss is within cfg.tolerance of the longest
    allowed run's, inside [(1 - max_shorten), (1 + max_extend)] x train.max_steps and after the
    current step; moved back toward the current length until lr_ok accepts it; the current
    length when the change would be under cfg.min_change of the run."""
    t0, total = run.original_steps, run.total_steps
    lo = max(math.ceil(t0 * (1 - cfg.max_shorten)), run.step + 1)
    hi = max(math.floor(t0 * (1 + cfg.max_extend)), total)
    if lo >= hi:
        return total
    longest = fit.predict(hi * per_step)
    limit = longest + cfg.tolerance * abs(longest)  # a loss fitted below 0 (an RL objective) too
    candidates = sorted({int(round(c)) for c in np.linspace(lo, hi, 257)} | {total})
    target = next((c for c in candidates if fit.predict(c * per_step) <= limit), hi)
    toward = [c for c in candidates if min(target, total) <= c <= max(target, total)]
    for c in toward if target < total else reversed(toward):
        if c == total or lr_ok(c):
            target = c
            break
    return total if abs(target - total) < cfg.min_change * t0 else target


def format_status(s: Status, adjust: bool) -> str:
    """The console block, e.g.
    [step 5000] CHINCHILLA STATUS
    Epochs: 3.34 of 4.00 planned (adjusted from 5.00)   Token progress: 83.4%
    Convergence: 87% (high)   Phase: convergence   Recommendation: continue
    """
    epochs = f"Epochs: {_epochs(s.epochs_seen)} of {_epochs(s.planned_epochs)} planned"
    if s.total_steps != s.original_steps:
        epochs += f" (adjusted from {_epochs(s.original_epochs)})"
    conv = "n/a" if s.convergence is None else f"{s.convergence:.0%}"
    advice = s.recommendation
    if s.recommendation != "continue":
        advice += f" to {s.recommended_steps} steps"
    if s.recommendation != "continue" and not adjust:
        advice += " (advice: plan.adjust is off)"
    lines = [
        f"[step {s.step}] CHINCHILLA STATUS",
        f"{epochs}   Token progress: {s.token_progress:.1%}",
        f"Convergence: {conv} ({s.confidence})   Phase: {s.phase}   Recommendation: {advice}",
    ]
    if s.fit:
        fit = LossFit(**s.fit)
        lines.append(
            f"Fit: {fit.describe()} (R^2 {fit.r2:.2f}, {fit.points} points); predicted loss "
            f"{s.loss_end:.3f} at step {s.total_steps}, {s.loss_best:.3f} at the longest allowed run"
        )
    return "\n".join(lines)


def _epochs(n: float) -> str:
    return f"{n:.2f}" if n < 10 else f"{n:.1f}"
