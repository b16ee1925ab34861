"""The checkpoint interval: as often as Young's optimum when failures are expected more often
than checkpoint.every allows for (Young 1974: sqrt(2 x C x M) for a save that stalls training C
seconds and a mean time between failures M). C is measured at every save (the slowest rank's
stall, agreed with the step times in Orchestrator._read), M is `mtbf_hours` or the world size at
Llama 3's failure rate (trimtab/plan/resilience.py). The interval is never longer than the
configured one: at small scale (M in thousands of hours) nothing changes; on thousands of GPUs
the rule shortens it, and journals why.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Rolling
from trimtab.plan.resilience import FAILURES_PER_DEVICE_HOUR, RATE_SOURCE, young_interval


class CheckpointInterval:
    rule, family = "checkpoint_interval", "checkpoint"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.checkpoint_interval
        self.steps = Rolling(50)  # step seconds, the slowest rank's
        self.stalls = Rolling(5)  # save stalls, the slowest rank's
        self.due = False  # a save not judged yet

    def observe(
        self, step: int, seconds: list[float], stall_s: float, world: int, every: int, configured: int
    ) -> Finding | None:
        """Steps of `seconds` and, when one came, a save that stalled `stall_s`: the finding when
        Young's interval, in whole steps and at most `configured`, differs from the current
        `every` by more than the tolerance. Judged at each save (the first once 5 steps are timed)."""
        for s in seconds:
            self.steps.add(s)
        if stall_s > 0:
            self.stalls.add(stall_s)
            self.due = True
        if not self.due or configured <= 0 or len(self.steps) < 5:
            return None
        self.due = False
        mtbf_s = self.cfg.mtbf_hours * 3600 or 3600 / (world * FAILURES_PER_DEVICE_HOUR)
        stall, step_s = statistics.median(self.stalls.values), statistics.median(self.steps.values)
        optimum = young_interval(stall, mtbf_s)
        steps = max(1, min(configured, math.floor(optimum / max(step_s, 1e-9))))
        if abs(steps - every) <= self.cfg.tolerance * every:
            return None
        evidence: dict[str, Any] = {
            "save_stall_s": round(stall, 4),
            "mtbf_h": round(mtbf_s / 3600, 4),
            "mtbf_source": "orchestrator.checkpoint_interval.mtbf_hours" if self.cfg.mtbf_hours else RATE_SOURCE,
            "step_s": round(step_s, 4),
            "young_s": round(optimum, 2),
            "steps": steps,
            "was": every,
            "configured": configured,
        }
        summary = (
            f"Young's interval sqrt(2 x {stall:.3g} s save x {mtbf_s / 3600:.3g} h MTBF) = {optimum:.0f} s = "
            f"{steps} steps of {step_s:.3g} s (now every {every})"
        )
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)
