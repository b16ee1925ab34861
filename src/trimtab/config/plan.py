"""The `plan:` section: the live Chinchilla planner that reports convergence during training and,
when `adjust` is on, lets the orchestrator shorten or extend the run (docs/planner.md).

Defaults change nothing about a run: the status block is printed and written to
plan_status.jsonl, and the run length is only changed with `adjust: true`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trimtab.config.checks import Section, _check


@dataclass
class PlanConfig(Section):
    status_every: int = 100  # steps between status blocks (at the next log line); 0: no live planner
    adjust: bool = False  # let the orchestrator change the run length (journaled decisions)
    # The run is set to the shortest length whose predicted final loss is within `tolerance`
    # (a fraction of the loss) of the longest allowed run's.
    tolerance: float = 0.01
    max_extend: float = 0.5  # the run never grows past (1 + max_extend) x train.max_steps
    max_shorten: float = 0.5  # ... nor shrinks below (1 - max_shorten) x train.max_steps
    min_change: float = 0.05  # a change smaller than this fraction of the run is not made
    min_progress: float = 0.3  # no change before this fraction of the run (early fits extrapolate badly)
    min_points: int = 8  # logged losses after warm-up needed before a fit is trusted
    max_lr_jump: float = 2.0  # a new length may move the scheduled LR by at most this factor at once
    tokens_per_param: float = 20.0  # compute-optimal tokens per parameter (Hoffmann et al. 2022)
    # model FLOPs utilisation time estimates assume (`trimtab plan`); 0: the run directory's summary.json,
    # else the trainer's as measured on GPUs and CPUs for this kind of model (plan/memory.py: assumed_mfu),
    # 0.4 on other hardware
    mfu: float = 0.0

    def validate(self) -> None:
        _check(
            self.status_every >= 0,
            "plan.status_every",
            f"must be >= 0 (0 turns the live planner off), got {self.status_every}",
        )
        _check(0 < self.tolerance < 1, "plan.tolerance", f"must be in (0, 1), got {self.tolerance}")
        _check(0 <= self.max_extend <= 10, "plan.max_extend", f"must be in [0, 10], got {self.max_extend}")
        _check(0 <= self.max_shorten < 1, "plan.max_shorten", f"must be in [0, 1), got {self.max_shorten}")
        _check(0 <= self.min_change < 1, "plan.min_change", f"must be in [0, 1), got {self.min_change}")
        _check(0 <= self.min_progress < 1, "plan.min_progress", f"must be in [0, 1), got {self.min_progress}")
        _check(self.min_points >= 3, "plan.min_points", f"must be >= 3 (a fit has 3 parameters), got {self.min_points}")
        _check(self.max_lr_jump > 1, "plan.max_lr_jump", f"must be > 1, got {self.max_lr_jump}")
        _check(  # an infinite one overflowed the planner's token count (OverflowError)
            0 < self.tokens_per_param < math.inf,
            "plan.tokens_per_param",
            f"must be a finite number > 0 (Hoffmann et al. 2022: ~20), got {self.tokens_per_param}",
        )
        _check(0 <= self.mfu <= 1, "plan.mfu", f"must be in [0, 1] (0: as measured), got {self.mfu}")
