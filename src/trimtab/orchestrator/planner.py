"""The live Chinchilla planner: a trainer hook that fits the logged loss curve every
`plan.status_every` steps, prints a status block, appends it to RUN_DIR/plan_status.jsonl and,
with `plan.adjust`, proposes a run-length finding (RunView.propose: the loop delivers it to the
orchestrator's on_finding), which its policy turns into a journaled set_total_steps decision
(orchestrator/remedies.py). The arithmetic is trimtab.plan.curve;
docs/planner.md.

It reads only the log lines' mean losses (already on the host), so it adds no device sync. Only
the pretraining phase is tracked: a finetuning phase has other data and another schedule.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.config.plan import PlanConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.plan.curve import RunProgress, Status, format_status, live_status
from trimtab.rundir import PLAN_STATUS_FILE, append_lines, json_text, rewrite_jsonl
from trimtab.training.hooks import Hook

if TYPE_CHECKING:
    from trimtab.training.view import RunView

MAX_POINTS = 1024  # beyond this, every other point is dropped (the fit needs the shape, not every log line)


class LivePlanner(Hook):
    def __init__(self, cfg: PlanConfig, run_dir: Path, propose: bool = False):
        self.cfg = cfg
        self.path = Path(run_dir) / PLAN_STATUS_FILE
        self.propose = propose  # findings go to the orchestrator (one runs and is not off)
        self.points: list[list[float]] = []  # [step, tokens, mean loss of the log window]
        self.last_status = 0  # step of the last status block
        self.last_proposed = 0  # run length of the last decision, so advice is not journaled again

    def on_train_start(self, run: RunView) -> None:
        if run.is_main and self.path.exists():
            # Lines past the resumed step were written after the checkpoint and will be redone.
            rewrite_jsonl(self.path, lambda s: s if s["step"] <= run.step else None)

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        if run.phase != 0 or not self.cfg.status_every:
            return
        if math.isfinite(metrics["loss"]):
            self.points.append([metrics["step"], metrics["tokens"], metrics["loss"]])
            if len(self.points) > MAX_POINTS:
                self.points = self.points[::2]
        every = self.cfg.status_every
        if metrics["step"] // every > self.last_status // every:
            self.last_status = metrics["step"]
            self.report(run)

    def report(self, run: RunView) -> Status:
        """Compute, print and record the status; maybe propose a new run length."""
        pre = run.pretrain
        progress = RunProgress(
            step=run.step,
            tokens=run.tokens,
            total_steps=pre["steps"],
            original_steps=pre["configured_steps"],
            warmup_steps=pre["warmup_steps"],
            dataset_tokens=pre["dataset_tokens"],
        )
        status = live_status(self.points, progress, self.cfg, lambda steps: self._lr_ok(run, steps))
        if run.is_main:
            append_lines(self.path, json_text(status.as_dict()) + "\n")
            run.say(format_status(status, self.cfg.adjust))
        if self._may_decide(status):
            self._propose(run, status)
        return status

    def _lr_ok(self, run: RunView, steps: int) -> bool:
        """Whether the schedule may switch to `steps` now: the next step's LR moves by at most
        plan.max_lr_jump (a smooth change, not a shock to the optimizer)."""
        now, then = run.pretrain_lr_if(run.pretrain["steps"]), run.pretrain_lr_if(steps)
        jump = self.cfg.max_lr_jump
        return now > 0 and then > 0 and 1 / jump <= then / now <= jump

    def _may_decide(self, status: Status) -> bool:
        return (
            self.cfg.adjust
            and self.propose
            and status.recommendation != "continue"
            and status.recommended_steps != self.last_proposed
            and status.step >= self.cfg.min_progress * status.total_steps
        )

    def _propose(self, run: RunView, status: Status) -> None:
        self.last_proposed = status.recommended_steps
        evidence = {
            "fit": status.fit,
            "convergence": status.convergence,
            "token_progress": status.token_progress,
            "total_steps": status.total_steps,
            "recommended_steps": status.recommended_steps,
            "recommendation": status.recommendation,
            "new_total": run.total_steps + status.recommended_steps - status.total_steps,
            "loss_now": status.loss_now,
            "loss_end": status.loss_end,
            "loss_recommended": status.loss_recommended,
            "loss_best": status.loss_best,
            "tolerance": self.cfg.tolerance,
            "max_extend": self.cfg.max_extend,
        }
        summary = (
            f"loss fit predicts {status.loss_end:.3f} at step {status.total_steps}, "
            f"{status.loss_recommended:.3f} at step {status.recommended_steps} (R^2 {status.fit['r2']:.2f})"
        )
        finding = Finding(
            rule="convergence",
            family="length",
            step=status.step,
            evidence=evidence,
            summary=summary,
            strength=status.fit["r2"],
        )
        run.propose(finding)

    def state_dict(self) -> dict[str, Any]:
        return {"points": self.points, "last_status": self.last_status, "last_proposed": self.last_proposed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.points = [list(p) for p in state["points"]]
            self.last_status, self.last_proposed = state["last_status"], state["last_proposed"]

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        """The curve goes back with the weights; the run length (a Control knob) stays."""
        last_proposed = self.last_proposed
        self.load_state_dict(saved_state)
        self.last_proposed = last_proposed
