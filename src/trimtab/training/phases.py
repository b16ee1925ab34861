"""The Trainer's phases and held-out evaluations (a mixin of training/trainer.py): a phase's
optimizer, loader and schedule entered at its first step (a resume, a rollback), and the
evaluations at train.eval_every and at a phase's end, the run's last one tried again on failure."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from trimtab.distributed.group import all_max, gather_objects, side_sum
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairLoader
from trimtab.training.evaluation import held_out_figures, policy_figures
from trimtab.training.optim import build_optimizer
from trimtab.training.policy import SCORING_ANSWERS
from trimtab.training.resume import logged_eval
from trimtab.training.schedule import phase_lr, set_lr_level
from trimtab.training.services.signals import say_stopping

FINAL_EVAL_TRIES = 3  # the run's last evaluation: a failure may be transient (an I/O error, a slow node)


class Phases:
    """Entering phases and evaluating (the Trainer's state: phases, state, loader, control)."""

    @torch.no_grad()
    def evaluate(self, tries: int = 1) -> dict[str, Any]:
        """The held-out figures, hooks told (on_eval): the loss, each rank scoring its share of
        the eval micro-batches, or an RL phase's held-out rewards. An error or a run past
        train.eval_timeout abandons it: hooks hear of it (the orchestrator journals it) and
        training goes on; up to `tries` times in all (every rank alike: the error is agreed)."""
        policy = isinstance(self.loader, (RolloutLoader, PairLoader))  # RL, DPO: held-out prompts, pairs scored
        for _ in range(tries):
            figures, error = policy_figures(self) if policy else held_out_figures(self)
            if not error:
                break
            stop = self._stop_agreed()
            self._call("on_eval_error", self.state.step, error)
            if stop:  # left off for a stop's save (evaluation.py): not tried again
                break
        if not figures:
            return {}
        self.last_eval = {"step": self.state.step, "phase": self.phases[self.state.phase].name, **figures}
        score = next((figures[k] for k in ("rl/held_out_reward", "dpo/held_out_accuracy") if k in figures), None)
        score = -figures.get("val_loss", math.inf) if score is None else score
        if self.best_eval is None or score > self.best_eval[1]:
            self.best_eval, self.best_checkpoint = (self.state.step, score), -1  # found at the next save
        self._call("on_eval", self.last_eval)
        return self.last_eval

    def _baseline_owed(self) -> bool:
        """Whether the starting policy's held-out evaluation (RL's and DPO's yardstick) is to be taken now: at step
        0 of a policy phase, unless metrics.jsonl holds it (a resume at step 0 after it was taken; any rank's
        reading is every rank's). One left off at a stop's signal was lost: step 0's save predates it, and a resume
        at step 0 took none (debug RL, SIGTERM in it, resumed: held-out figures at step 2 alone; now 0 and 2)."""
        if self.state.step != 0 or not isinstance(self.loader, (RolloutLoader, PairLoader)):
            return False
        if self.resumed_from is None:
            return True
        (kept,) = all_max([float(bool(logged_eval(self.cfg.run_dir, 0)))])
        return not kept

    def _stop_agreed(self) -> str:
        """After an evaluation that failed, on every rank at once (its error is agreed): a stop signal any rank
        received is taken now, on all of them, so the hooks read the run as stopping (no eval_error journaled,
        no "training goes on") and every rank saves at this step. Under torchrun the stop waited for the next
        step's agree(): an RL run's held-out generation left off at SIGTERM, the orchestrator journaled an
        eval_error, and step 3 trained before the save (debug, 2 ranks)."""
        reason = self.dist.agree_signal()
        if reason and not self.stop_reason:  # one process: the handler took it and said so already
            say_stopping(reason)
        if reason:
            self.request_stop(reason)
        return reason

    def _phase_ends(self) -> bool:
        phase = self.phases[self.state.phase]
        return self.state.step == phase.start + phase.steps

    def _maybe_eval(self) -> None:
        every = self.cfg.train.eval_every
        if (every and self.state.step % every == 0) or self._phase_ends():
            # the run's last evaluation is the one summary.json reports: a transient failure is tried again
            self.evaluate(FINAL_EVAL_TRIES if self.state.step >= self.total_steps else 1)
            self.control.apply()  # what hooks decided on it (early stopping) holds before the next step

    def _date_evaluation(self, summary: dict[str, Any]) -> None:
        """The step the summary's evaluation figures are from, and whether they judge the weights
        the run ended with: after a final evaluation that failed every try (or a stop between
        evaluations) they are an older step's, and the summary says so rather than pass them off
        as final."""
        summary["eval_step"] = self.last_eval.get("step")
        summary["eval_final"] = summary["eval_step"] == self.state.step

    def _enter_phase(self, index: int) -> None:
        phase = self.phases[index]
        self.state.phase = index
        self.optimizer = build_optimizer(self.model, phase.optim, self.device)
        if isinstance(getattr(self, "loader", None), RolloutLoader):
            self.loader.close()  # its rollout thread and verifier processes (a rollback, a resume)
        self.loader = phase.loader(self.cfg, self.tok.pad_id, *self.data_shard)
        if isinstance(self.loader, RolloutLoader):  # an RL phase generates with the model it trains
            self.loader.policy, self.loader.snapshot = self._rollouts, self._policy_snapshot
            self.loader.interrupt = partial(self._left_off, SCORING_ANSWERS)  # the verifier's held-out scoring
            self.loader.all_sum = self._all_sum
            if self.dist.world > 1:  # the rollout thread's sums apart (a bound `ctl max-staleness` raises too)
                self.loader.side_sum, self.loader.gather = side_sum(), gather_objects
        if isinstance(self.loader, PairLoader):  # DPO scores held-out pairs, answers held-out problems
            self.loader.scorer, self.loader.policy = self._pair_logprobs, self._rollouts
            self.loader.all_sum = self._all_sum
        self.control.apply_knobs()

    def _maybe_next_phase(self) -> None:
        index = max(i for i, p in enumerate(self.phases) if p.start <= self.state.step)
        if index != self.state.phase:
            self._enter_phase(index)
            phase = self.phases[index]
            self.say(f"step {self.state.step}: {phase.name} phase begins ({phase.steps} steps, {phase.data.source})")

    def scheduled_lr(self) -> float:
        """The configured schedule's LR for the step about to run (or running), before the multiplier."""
        state = self.state
        return phase_lr(self.phases[state.phase], state.phase, state.step, state.restarts, state.warm_behind)

    def set_lr_level(self) -> float:
        """The configured LR a person's `ctl set-lr` sets the multiplier from (schedule.set_lr_level)."""
        state = self.state
        return set_lr_level(self.phases[state.phase], state.phase, state.step, state.restarts, state.warm_behind)
