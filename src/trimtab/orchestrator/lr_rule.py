"""The LR rule: a learning rate the optimizer applies that the config's schedule and the journal's
multiplier decisions do not explain (UnexplainedLR)."""

from __future__ import annotations

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics


class UnexplainedLR(Monitor):
    """The LR the optimizer applies is more than `factor` above what the config's schedule and the
    journal explain (the schedule's LR for that step x the multiplier decisions set). A schedule the
    config asks for (cyclic restarts included) and a run length a person or the planner changes are
    explained by construction; a stray writer of the optimizer's LR or a schedule bug is not. After
    a finding the new level counts as explained (the remedy compensates for it), so one departure
    is answered once, and a second one on top of it again.

    `explained` accounts for the multiplier's compensation, a knob a rollback keeps: so a rollback
    keeps it too (`KEPT_ON_ROLLBACK`), or the replay would take the compensated LR for a new
    departure and cut it again. A replay from before the stray writer's first step (or a writer
    that stops) leaves the compensation without its cause, the effective LR `factor` below the
    schedule: that is a finding too, and the multiplier goes back (the writer's return is answered
    again, as the first time)."""

    rule, family = "lr", "lr"
    KEPT_ON_ROLLBACK = ("explained",)  # Orchestrator.on_rollback keeps these over the checkpoint's

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
        # far below the explained level: a finding only while there is a compensation of the rule's to withdraw
        withdrawn = self.explained > 1 and ratio * self.cfg.factor < self.explained
        if ratio <= self.ceiling() and not withdrawn:
            return None
        explained, self.explained = self.explained, ratio
        evidence = {
            "lr": m.lr,
            "scheduled_lr": m.scheduled_lr,
            "lr_scale": m.lr_scale,
            "ratio": ratio,
            "explained": explained,
        }
        if withdrawn:
            summary = (
                f"the optimizer applies lr {m.lr:.3g}, x{ratio / explained:.3g} the level the multiplier "
                f"({m.lr_scale:.3g}) compensated for: what raised the LR no longer does"
            )
        else:
            summary = (
                f"the optimizer applies lr {m.lr:.3g}, x{ratio / explained:.3g} what the schedule "
                f"({m.scheduled_lr:.3g}) and the multiplier ({m.lr_scale:.3g}) explain"
            )
        return self.finding(m, evidence, summary, 1.0)
