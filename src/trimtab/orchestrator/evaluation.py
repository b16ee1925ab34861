"""What the orchestrator reads from evaluations: early stopping on the validation loss (a note
where it is off), and evaluations that failed (journaled; training goes on)."""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.remedies import Remedy


class EarlyStop(Monitor):
    """The validation loss has not beaten its best by min_delta for `patience` evaluations in a
    row (Prechelt 1998, "Early Stopping - But When?": the simplest of his criteria, GL with a
    patience). It counts per phase: a finetuning phase starts with no best."""

    rule, family = "early_stop", "convergence"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg  # read live: a resumed run may change patience and min_delta
        self.phase = 0
        self.best: float | None = None
        self.best_step = 0
        self.since = 0  # evaluations since the best
        self.recent: list[list[float]] = []  # (step, val_loss) since the best

    def observe(self, m: StepMetrics) -> Finding | None:
        return None  # it watches evaluations (observe_eval), not steps

    def observe_eval(self, step: int, phase: int, val_loss: float) -> Finding | None:
        rule = self.cfg.early_stop
        if phase != self.phase:
            self.phase, self.best, self.since, self.recent = phase, None, 0, []
        if self.best is None or val_loss < self.best - rule.min_delta:
            self.best, self.best_step, self.since, self.recent = val_loss, step, 0, []
            return None
        self.since += 1
        self.recent.append([step, val_loss])
        if self.since < rule.patience:
            return None
        evidence: dict[str, Any] = {
            "val_loss": val_loss,
            "best_val_loss": self.best,
            "best_step": self.best_step,
            "evaluations_without_improvement": self.since,
            "patience": rule.patience,
            "min_delta": rule.min_delta,
            "since_best": self.recent,
        }
        summary = (
            f"val_loss {val_loss:.4f} has not beaten the best {self.best:.4f} (step {self.best_step}) by "
            f"{rule.min_delta:g} for {self.since} evaluations"
        )
        if not rule.enabled:  # a note, not a stop: said again after another `patience` evaluations, not at each
            self.since, self.recent = 0, []
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)


def early_stop(f: Finding, enabled: bool) -> Remedy:
    """Stop (orchestrator.early_stop.enabled); off, the default (a run's length is its user's), a
    note: a held-out loss that stopped falling while the run trains on is worth a person's look (a
    fault-free debug-moe run of 500 steps, 5.7 epochs of the built-in data: 3.685 at step 350, 3.749
    at 500, and nothing said)."""
    if not enabled:
        return Remedy(
            action="none",
            reasoning="more steps of this phase are not lowering the held-out loss: past an epoch or two of the "
            "same data the model learns its training rows rather than the language (more data, fewer steps, or "
            "more regularisation); the checkpoint of the best evaluation is kept while checkpoint.keep allows "
            "(trimtab export --step); orchestrator.early_stop.enabled=true stops a run here",
        )
    return Remedy(
        action="stop",
        params={"reason": f"early stopping: {f.summary}"},
        reasoning=f"orchestrator.early_stop: no improvement for {f.evidence['patience']} evaluations; more steps "
        "of this phase are unlikely to lower the held-out loss (the checkpoint of the best step is kept "
        "while checkpoint.keep allows)",
    )


def eval_failure(step: int, error: str) -> Finding:
    """A failed evaluation as a finding (family evaluation): the policy answers it (failed_evaluation)."""
    return Finding(
        rule="eval_error",
        family="evaluation",
        step=step,
        evidence={"error": error},
        summary=f"the evaluation at step {step} failed: {error}",
        strength=1.0,
    )


def failed_evaluation(f: Finding, total_steps: int) -> Remedy:
    """Nothing to change: a measurement failed. The run's last evaluation is what its summary reports,
    so the trainer tries that one again (Trainer.evaluate's tries); any other is dropped."""
    if f.step >= total_steps:
        why = (
            "this is the run's final evaluation, the one summary.json reports, and a failure may be transient: "
            "the trainer tries it again; if every try fails, summary.json gives the newest "
            "evaluation that worked with its step (eval_step, eval_final false), never as the final one"
        )
    else:
        why = "its result is dropped and training goes on; the next evaluation runs as scheduled"
    return Remedy(action="none", reasoning=f"an evaluation is a measurement, not training: {why}")
