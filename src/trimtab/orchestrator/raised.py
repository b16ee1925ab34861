"""A person's LR raise, a part of InstabilityLadder (ladder.py): a config edit of optim.lr found on resume (or
an earlier session's `--set optim.lr` not repeated: the default comes back) or `trimtab ctl scale-lr` above 1.
Instability that follows it within escalation_window steps, no LR decision between, is its doing until shown
otherwise: a rollback that kept it would replay the same rows with the same weights at the same LR, and meet
the same trouble (a soak: trained at optim.lr 1e-3, resumed without the --set, x3 at once; debug trained at
1e-3 to step 40, resumed at 3e-2: skip, skip, a rollback to last_good replayed steps 41-45 bit for bit, its
outcome's identical_steps all of them; only the second rollback cut the LR). The first rollback after it undoes
it instead, owed as the ladder's cuts are (give_back.py)."""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.remedies import lr_cut
from trimtab.words import counted


class PersonRaise:
    """InstabilityLadder's memory of a person's LR raise (it holds the state named here)."""

    cfg: OrchestratorConfig
    last_lr_change: int  # step of the last LR decision applied: one after the raise answered it
    raised: list[Any]  # [step, factor, what] of a person's last LR raise ([]: none)

    def person_raised(self, step: int, factor: float, what: str) -> None:
        """A person's LR change of `factor` at `step` (`what`: theirs, in words); a lowering forgets a raise."""
        self.raised = [step, factor, what] if factor > 1 + 1e-9 else []

    def _undo_raise(self, view: Any, step: int) -> tuple[float, str] | None:
        """The LR factor that undoes a person's raise the instability at `step` followed, and the words of it;
        None when there is none to undo (none, an LR decision since, too long ago, or the LR at its floor)."""
        if not self.raised:
            return None
        at, factor, what = self.raised
        if self.last_lr_change >= at or step - at >= self.cfg.escalation_window:
            return None
        # no deeper than the cut a rollback for an LR too high makes (above_start.lr_factor): debug resumed at
        # x30, undone in full, ended at val loss 4.20 against 3.96 cut x0.1 (the give-backs climb x2 at a time)
        most = self.cfg.above_start.lr_factor
        cut = lr_cut(max(1 / factor, most), view, self.cfg)
        if cut is None:
            return None
        undo = (
            "undo the raise" if 1 / factor >= most else f"cut it as an LR too high is (above_start.lr_factor={most:g})"
        )
        return cut, (
            f"; the LR was raised x{factor:.3g} at step {at} ({what}), {counted(step - at, 'step')} before the "
            f"trouble: a replay at that LR would meet the same rows with the same weights and LR, so {undo}, "
            f"x{cut:.3g} with the rollback (given back only after orchestrator.lr_restore_after quiet steps)"
        )

    def _shift_raise(self, steps: int) -> None:
        """A rollback moved the step counter back by `steps` (policy.py shift)."""
        if self.raised:
            self.raised = [self.raised[0] - steps, *self.raised[1:]]
