"""The LR an orchestrator cut, given back once the run is quiet, a part of InstabilityLadder (ladder.py): the
ladder's cuts, the withheld guard's (withheld.py) and above_start's (too_high.py) enter a stack of debts, the newest
repaid first, x2 at a time after a quiet window, each never past the ceiling its own cut set (one least ceiling over
all cuts let a late cut's cap an earlier one's: debug at 10x its LR, seed 2, stayed at x0.22 to the end).
Instability after a give-back says the cut was needed: the debt is tried once more after twice the wait (a stretch
of bad data may have come with the first try), and kept for the rest of the run after a second failure."""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.remedies import Remedy

TRIES = 2  # give-backs followed by instability before the cut is kept for good


class GiveBack:
    """InstabilityLadder's LR debt (it holds the state named here)."""

    cfg: OrchestratorConfig
    ladder: Any  # ladder.py Ladder: last_step, the newest instability finding
    last_lr_change: int
    lr_debt: float  # product of the LR cuts not yet given back
    lr_ceiling: float  # the multiplier before the newest (or lower, its cut's ceiling): its give-backs never pass it
    lr_below: list[list[float]]  # the older cuts under it, [debt, ceiling] each, oldest first
    last_restore: int  # step of a give-back still on probation (-1: none)
    restore_failed: int  # give-backs instability followed (older checkpoints: a bool, True one)

    def _give_back(self, step: int, view: Any) -> Remedy | None:
        """After `wait` quiet steps (doubled after a failed give-back) a cut LR is given back x2, never past
        the ceiling, unless TRIES give-backs were followed by instability (the cut was needed)."""
        self._judge_give_back()
        if (self.lr_debt >= 1 and not self.lr_below) or self.restore_failed >= TRIES:
            return None
        if step >= view.total_steps:  # the run's last step: nothing trains at it (debug-moe 30x: x1.12 at 100 of 100)
            return None
        # a short run's wait is an eighth of it, yet no cut is given back before its outcome is judged
        wait = min(self.cfg.lr_restore_after, max(self.cfg.outcome_after, view.total_steps // 8))
        wait <<= int(self.restore_failed)
        calm = step - max(self.ladder.last_step, self.last_lr_change)
        if not wait or calm < wait:
            return None
        factor = min(2.0, 1 / self._newest(), self.lr_ceiling / view.lr_scale)
        if factor <= 1 + 1e-9:  # back where the newest cut began (or a person set it): it owes nothing more
            self._repaid()
            return None

        def commit() -> None:
            done = self._newest() * factor >= 1 - 1e-9 or self.lr_ceiling / view.lr_scale <= factor + 1e-9
            self.lr_debt = min(1.0, self.lr_debt * factor)
            self.last_lr_change = self.last_restore = step
            if done:
                self._repaid()

        again = " once more, after a give-back instability followed, at twice the wait" if self.restore_failed else ""
        return Remedy(
            action="scale_lr",
            params={"factor": factor},
            reasoning=f"{calm} steps without instability since the LR was last cut or given back (orchestrator."
            f"lr_restore_after={self.cfg.lr_restore_after}, at most an eighth of the run's {view.total_steps} "
            f"steps, at least outcome_after={self.cfg.outcome_after}): give part of it back{again} (if instability "
            "returns, " + ("the cut stays for the rest of the run)" if again else "it is tried once more later)"),
            # lr_debt is every cut's together; the give-back repays the newest (its own debt, bounded by its
            # own ceiling); the older ones wait under it, each with its ceiling
            evidence={
                "quiet_steps": calm,
                "wait": wait,
                "lr_debt": self.lr_debt,
                "newest_debt": self._newest(),
                "lr_ceiling": self.lr_ceiling,
                "older_debts": [{"debt": debt, "ceiling": ceiling} for debt, ceiling in self.lr_below],
            },
            commit=commit,
        )

    def _judge_give_back(self) -> None:
        """A give-back on probation that instability followed failed. Judged every quiet step, and by
        Policy.shift before a rollback moves the steps back: the rollback a finding called is applied before
        the next quiet step, and one over more steps than the give-back's own step number moved that below 0,
        read as none on probation (debug 3x: given back at 20, rolled back from 73 to 0, given back again at
        20 of the replay where a failure waits 40)."""
        if self.last_restore >= 0 and self.ladder.last_step > self.last_restore:
            self.restore_failed, self.last_restore = int(self.restore_failed) + 1, -1

    def _owe(self, factor: float, lr_scale: float, ceiling: float = math.inf) -> None:
        """An applied LR cut that quiet may give back: the multiplier it was cut from bounds that (and
        `ceiling`: the withheld guard's cut takes back a raise above the schedule for good; above_start's,
        the LR found too high)."""
        if self.lr_debt < 1:  # a debt of its own on top: the older one keeps its own ceiling
            self.lr_below = [*self.lr_below, [self._newest(), self.lr_ceiling]]
        self.lr_ceiling, self.lr_debt = min(lr_scale, ceiling), min(1.0, self.lr_debt) * factor

    def _newest(self) -> float:
        """What the newest cut still owes: the debt less the older cuts'."""
        return self.lr_debt / math.prod(debt for debt, _ in self.lr_below)

    def _repaid(self) -> None:
        """The newest cut is given back up to its ceiling (the rest of it is kept): the one under it is next."""
        self.lr_debt = math.prod(debt for debt, _ in self.lr_below) if self.lr_below else 1.0
        self.lr_ceiling = self.lr_below[-1][1] if self.lr_below else 1.0
        self.lr_below = self.lr_below[:-1]
