"""The Trainer's answer to running out of memory: the same work tried again, lighter, for as
long as a hook (the orchestrator's oom rule) makes it lighter: a step's micro-batches smaller or
their activations recomputed (train_step on the same rows), an RL phase's rollouts generated in
smaller passes (the loader's next batch); else the run stops (exit code 3) saying what to lower.
A mixin of Trainer (training/trainer.py), whose state it reads and sets; apart from the loop so
the loop reads as the step it runs.
"""

from __future__ import annotations

import time

import torch

from trimtab.data import StepBatch
from trimtab.hardware import is_oom
from trimtab.rl.batches import RolloutLoader
from trimtab.training.state import StepOutput


class OomRecovery:
    """A step, or an RL step's rollouts, retried after an out-of-memory error."""

    def _next_batch(self) -> StepBatch | None:
        """The loader's next step; an RL phase's rollouts generated again in smaller passes
        while a hook (the orchestrator) halves them after an out-of-memory error; None if it gave up."""
        while True:
            try:
                return self.loader.next_batch()
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not (is_oom(exc) and isinstance(self.loader, RolloutLoader)):
                    raise
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                rows = self.view.rl_generation_rows
                handled = any(self._hook(h, "on_rollout_oom", exc) for h in self.hooks)
                self.control.apply(mid_step=True)  # inside the step: training/emergency.py applying
                if not self.stop_reason and (not handled or self.view.rl_generation_rows >= rows):
                    self._oom_stop(exc, f"generating {rows} rollouts at a time", "rl.prompts_per_step", handled)
                if self.stop_reason:
                    return None

    def _step_with_oom_retry(self, batch: StepBatch, t0: float) -> StepOutput | None:
        """train_step, retried on the same rows while a hook (the orchestrator) lightens it after
        an out-of-memory error: smaller micro-batches, or at one row more activation
        checkpointing; None if it gave up."""
        while True:
            try:
                out = self.train_step(batch)
                out.seconds = time.perf_counter() - t0
                return out
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_oom(exc):
                    raise
                self.dist.announce_oom(exc)  # the other ranks shrink with this one
                self._discard_gradients()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                before = (self.loader.micro_batch_tokens, self.model.checkpointing)
                handled = any(self._hook(h, "on_oom", exc, batch) for h in self.hooks)
                self.control.apply(mid_step=True)  # inside the step: training/emergency.py applying
                budget, recompute = before
                lighter = self.loader.micro_batch_tokens < budget or self.model.checkpointing != recompute
                if not self.stop_reason and (not handled or not lighter):  # a retry would fail the same way
                    self._oom_stop(exc, f"in micro-batches of {budget:,} tokens", "train.micro_batch_tokens", handled)
                if self.stop_reason:
                    return None
            self.dist.step_retried()  # the straggler rule's measure: the retry's own work counts too
            batch = self.loader.regroup(batch)
            self._call("on_step_start", batch)

    def _oom_stop(self, exc: BaseException, what: str, key: str, handled: bool) -> None:
        """Out of memory and nothing made the work lighter (the orchestrator off, advising only or
        with its rule paused; or nothing left to shrink): stop with exit code 3 and save the last
        step's state, where a traceback would end the run without a word of what to change."""
        why = (
            "nothing was left to make it lighter"
            if handled
            else "no hook made it lighter: the orchestrator is off, advises only or has paused its oom rule"
        )
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        self.request_stop(
            f"out of memory at step {self.state.step + 1} {what} ({first}); {why}. Lower {key} (--set {key}=...) "
            "or let the orchestrator heal it (--orchestrator auto), then re-run the same command to resume",
            exit_code=3,
        )
