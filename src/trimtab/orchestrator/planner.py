"""The live Chinchilla planner: a trainer hook that fits the logged loss curve every
`plan.status_every` steps, prints a status block, appends it to RUN_DIR/plan_status.jsonl and,
with `plan.adjust`, has the orchestrator shorten or extend the run (a journaled decision applied
through Control.set_total_steps). The arithmetic is trimtab.plan.curve; docs/planner.md.

It reads only the log lines' mean losses (already on the host), so it adds no device sync. Only
the pretraining phase is tracked: a finetuning phase has other data and another schedule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.config.plan import PlanConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Plan
from trimtab.plan.curve import RunView, Status, format_status, live_status
from trimtab.training.hooks import Hook
from trimtab.training.optim import lr_at

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

MAX_POINTS = 1024  # beyond this, every other point is dropped (the fit needs the shape, not every log line)


class LivePlanner(Hook):
    def __init__(self, cfg: PlanConfig, run_dir: Path):
        self.cfg = cfg
        self.path = Path(run_dir) / "plan_status.jsonl"
        self.points: list[list[float]] = []  # [step, tokens, mean loss of the log window]
        self.last_status = 0  # step of the last status block
        self.last_proposed = 0  # run length of the last decision, so advice is not journaled again
        self.orchestrator: Orchestrator | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.orchestrator = next((h for h in trainer.hooks if isinstance(h, Orchestrator)), None)
        if _is_main(trainer) and self.path.exists():
            # Lines past the resumed step were written after the checkpoint and will be redone.
            lines = self.path.read_text().splitlines()
            kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= trainer.state.step]
            self.path.write_text("".join(ln + "\n" for ln in kept))

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.state.phase != 0 or not self.cfg.status_every:
            return
        if math.isfinite(metrics["loss"]):
            self.points.append([metrics["step"], metrics["tokens"], metrics["loss"]])
            if len(self.points) > MAX_POINTS:
                self.points = self.points[::2]
        every = self.cfg.status_every
        if metrics["step"] // every > self.last_status // every:
            self.last_status = metrics["step"]
            self.report(trainer)

    def report(self, trainer: Trainer) -> Status:
        """Compute, print and record the status; maybe propose a new run length."""
        status = live_status(self.points, self._view(trainer), self.cfg, lambda steps: self._lr_ok(trainer, steps))
        if _is_main(trainer):
            with open(self.path, "a") as fh:
                fh.write(json.dumps(status.as_dict()) + "\n")
            trainer.say(format_status(status, self.cfg.adjust))
        if self._may_decide(trainer, status):
            self._decide(trainer, status)
        return status

    def _view(self, trainer: Trainer) -> RunView:
        phase = trainer.phases[0]
        return RunView(
            trainer.state.step,
            trainer.state.tokens,
            phase.steps,
            trainer.cfg.train.max_steps,
            phase.optim.warmup_steps,
            phase.train_rows.n_tokens,
        )

    def _lr_ok(self, trainer: Trainer, steps: int) -> bool:
        """Whether the schedule may switch to `steps` now: the next step's LR moves by at most
        plan.max_lr_jump (kept below the orchestrator's LR-jump rule, which would undo it)."""
        optim, step = trainer.phases[0].optim, trainer.state.step
        now, then = lr_at(step, trainer.phases[0].steps, optim), lr_at(step, steps, optim)
        jump = min(self.cfg.max_lr_jump, 0.9 * trainer.cfg.orchestrator.lr.factor)
        return now > 0 and then > 0 and 1 / jump <= then / now <= jump

    def _may_decide(self, trainer: Trainer, status: Status) -> bool:
        orch = self.orchestrator
        return (
            self.cfg.adjust
            and orch is not None
            and orch.mode != "off"
            and status.recommendation != "continue"
            and status.recommended_steps != self.last_proposed
            and status.step >= self.cfg.min_progress * status.total_steps
        )

    def _decide(self, trainer: Trainer, status: Status) -> None:
        self.last_proposed = status.recommended_steps
        new_total = trainer.total_steps + status.recommended_steps - status.total_steps
        evidence = {
            "fit": status.fit,
            "convergence": status.convergence,
            "token_progress": status.token_progress,
            "total_steps": status.total_steps,
            "recommended_steps": status.recommended_steps,
            "loss_now": status.loss_now,
            "loss_end": status.loss_end,
            "loss_recommended": status.loss_recommended,
            "loss_best": status.loss_best,
        }
        gain = status.loss_end - status.loss_recommended
        summary = (
            f"loss fit predicts {status.loss_end:.3f} at step {status.total_steps}, "
            f"{status.loss_recommended:.3f} at step {status.recommended_steps} (R^2 {status.fit['r2']:.2f})"
        )
        if status.recommendation == "shorten":
            reasoning = (
                f"the fitted loss curve L(D) = E + B / D^beta (Hoffmann et al. 2022's data term) predicts "
                f"that the last {status.total_steps - status.recommended_steps} planned steps lower the "
                f"loss by only {-gain:.3g}, within plan.tolerance={self.cfg.tolerance:g} of the best "
                "allowed run: ending earlier saves the compute (the LR schedule compresses to the new end)"
            )
        else:
            reasoning = (
                f"the fitted loss curve is still falling: {status.recommended_steps - status.total_steps} "
                f"more steps are predicted to lower the loss by {gain:.3g}, more than plan.tolerance="
                f"{self.cfg.tolerance:g}; bounded by plan.max_extend={self.cfg.max_extend:g}"
            )
        finding = Finding("convergence", "length", status.step, evidence, summary, status.fit["r2"])
        self.orchestrator.decide(trainer, finding, Plan("set_total_steps", {"steps": new_total}, reasoning))

    def state_dict(self) -> dict[str, Any]:
        return {"points": self.points, "last_status": self.last_status, "last_proposed": self.last_proposed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.points = [list(p) for p in state["points"]]
            self.last_status, self.last_proposed = state["last_status"], state["last_proposed"]

    def on_rollback(self, trainer: Trainer, saved_state: dict[str, Any]) -> None:
        """The curve goes back with the weights; the run length (a Control knob) stays."""
        last_proposed = self.last_proposed
        self.load_state_dict(saved_state)
        self.last_proposed = last_proposed


def _is_main(trainer: Trainer) -> bool:
    """Rank 0 alone prints and writes (every rank computes the same status: the losses are reduced)."""
    dist = getattr(trainer, "dist", None)
    return dist is None or dist.is_main
