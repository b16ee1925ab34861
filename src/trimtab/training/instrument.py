"""Test instruments: hooks that break a running job on purpose, and the handle they break it with.

Fault injection (orchestrator/faults.py) must write where nothing else may: weights, an expert's
selection bias, the training rows, the optimizer's LR, a batch about to run. An ordinary hook
cannot (its RunView is read only, training/view.py); an `Instrument` is handed a `FaultHandle` by
the Trainer before training starts, and writes through it alone. Only the fault injector is an
instrument, and the run has one only when the config asks for faults (`faults:`, `--inject`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trimtab.training.hooks import Hook

if TYPE_CHECKING:
    from trimtab.data import Rows, StepBatch
    from trimtab.training.trainer import Trainer


class FaultHandle:
    """Write access to a running job, for fault injection and nothing else (a test instrument)."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer

    @property
    def model(self) -> torch.nn.Module:
        """The live model: its modules take the instrument's forward and gradient hooks, its
        weights and buffers the faults' writes."""
        return self._trainer.model

    @property
    def train_rows(self) -> Rows:
        """The current phase's training rows, to make data go bad on purpose (Rows.replace)."""
        t = self._trainer
        return t.phases[t.state.phase].train_rows

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The live optimizer (an instrument that checks whether an update was applied reads its
        state)."""
        return self._trainer.optimizer

    def scale_optimizer_lr(self, factor: float) -> None:
        """Multiply the LR the optimizer holds now (after the trainer set this step's): a stray
        writer, an LR nothing in the config explains."""
        for group in self._trainer.optimizer.param_groups:
            group["lr"] *= factor

    def gate_rollouts(self, gate: Callable[[int, int, bool], None]) -> None:
        """Call gate(rows, version, evaluating) before each pass of RL generation, in the thread
        that generates (asynchronous RL's rollout thread too, on the policy's copies; `version`
        the step of the weights generating, `evaluating` an evaluation's pass): it may raise, as a
        generation that does not fit would (rollout_oom)."""
        self._trainer.rollout_gate = gate

    def before_commit(self, fn: Callable[[], None]) -> None:
        """Run `fn` in the checkpoint writer once this rank's files of the save now starting are
        written, before the commit (kill_in_save: a process killed mid-write)."""
        self._trainer.dist.written = fn

    def reload_rows(self, batch: StepBatch, rows: set[int]) -> None:
        """Read these rows of the batch about to run again from the training rows: its
        micro-batches were cut before the rows were changed."""
        data = self.train_rows
        for micro in batch.micro:
            for b, row in enumerate(micro.rows):
                if row in rows:
                    tokens, mask = (torch.from_numpy(a) for a in data.get(row))
                    n = len(tokens) - 1
                    micro.inputs[b, :n] = tokens[:-1]
                    micro.targets[b, :n] = torch.where(mask[1:], tokens[1:], micro.targets[b, :n].new_tensor(-100))


class Instrument(Hook):
    """A hook that is a test instrument: the Trainer hands it a FaultHandle (attach) before
    on_train_start; it sees the run through its RunView like any hook and writes through the
    handle only."""

    handle: FaultHandle | None = None

    def attach(self, handle: FaultHandle) -> None:
        self.handle = handle
