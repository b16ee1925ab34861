"""What the trainer carries between steps and checkpoints (TrainState), and what one step hands
to the hooks (StepOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trimtab.data import StepBatch

# Exit codes of a run that gave up (0: completed or stopped on request; 2: bad input)
GAVE_UP = 3  # training could not be healed (every rung tried, out of memory at one row, broken weights)
NO_CHECKPOINT = 4  # no checkpoint can be written: the work since the newest on disk is at risk


@dataclass(kw_only=True)
class TrainState:
    step: int = 0  # optimizer steps taken (or skipped by the update gate), over all phases
    tokens: int = 0  # input tokens trained on
    phase: int = 0
    train_seconds: float = 0.0
    # Knobs that interventions set through Control (None: the phase's config value).
    lr_scale: float = 1.0  # multiplies the schedule
    grad_clip: float | None = None
    weight_decay: float | None = None
    micro_batch_tokens: int | None = None
    activation_checkpointing: str | None = None  # off | selective | full (None: train.activation_checkpointing)
    checkpoint_every: int | None = None  # steps between checkpoints (None: checkpoint.every)
    rl_temperature: float | None = None  # RL's sampling temperature (None: rl.temperature)
    rl_verifier_timeout: float | None = None  # seconds a verification may take (None: rl.verifier_timeout_s)
    rl_dynamic_sampling: bool | None = None  # RL drops flat groups and draws more (None: rl.dynamic_sampling)
    rl_entropy_coef: float | None = None  # RL's entropy bonus (None: rl.entropy_coef)
    rl_overlong_filter: bool | None = None  # RL leaves responses cut at the budget out (None: rl.overlong_filter)
    rl_overlong_buffer: int | None = None  # RL's soft overlong penalty, in tokens (None: rl.overlong_buffer)
    rl_max_staleness: int | None = None  # RL's rollouts' staleness bound (None: rl.max_staleness)
    rl_generation_rows: int | None = None  # RL's rows generated at a time after an OOM (None: a whole step's)
    rl_difficulty: int | None = None  # the built-in RL task's digits a raise set (None: the loader's own)
    rl_top_difficulty: int | None = None  # its digits a raise past which did not fit (None: no such raise tried)
    rollbacks: int = 0
    length_delta: int = 0  # steps added to (< 0: taken from) pretraining by set_total_steps
    # of length_delta, orchestrator.make_up's (steps for withheld updates): kept on top of a resume's new
    # train.max_steps, which replaces the rest (training/schedule.py)
    made_up: int = 0
    # The schedule's definition (training/schedule.py): each phase's configured length when last
    # saved, and the re-warm segments of phases extended after they ended.
    phase_steps: list[int] = field(default_factory=list)
    restarts: list[list[Any]] = field(default_factory=list)
    # [a schedule segment's start, the updates withheld during its warm-up]: they hold it back (schedule.py)
    warm_behind: list[int] = field(default_factory=list)


@dataclass
class Rewound:
    """What this session's rollbacks threw away (steps, tokens, training seconds trained and then
    restored over), which the TrainState no longer counts but the session did work for; and each
    rollback's (from, to) steps, to count the steps trained again."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rollbacks: list[tuple[int, int]] = field(default_factory=list)

    def add(self, before: TrainState, after: TrainState) -> None:
        self.steps += before.step - after.step
        self.tokens += before.tokens - after.tokens
        self.seconds += before.train_seconds - after.train_seconds
        self.rollbacks.append((before.step, after.step))

    def replayed(self, step: int) -> int:
        """Steps trained again at a position this session had reached before a rollback, the
        session now at `step` (as the goodput ledger's `redone`, within this session)."""
        done, high = 0, 0
        ends = [b for b, _ in self.rollbacks[1:]] + [step]
        for (start, to), end in zip(self.rollbacks, ends):
            high = max(high, start)
            done += max(0, min(end, high) - to)
        return done


# What a rollback keeps from the present: the knobs (they are the correction) and the schedule.
KEPT_ON_ROLLBACK = (
    "lr_scale",
    "grad_clip",
    "weight_decay",
    "micro_batch_tokens",
    "activation_checkpointing",
    "checkpoint_every",
    "rl_temperature",
    "rl_verifier_timeout",
    "rl_dynamic_sampling",
    "rl_entropy_coef",
    "rl_overlong_filter",
    "rl_overlong_buffer",
    "rl_generation_rows",
    "rl_max_staleness",
    "rl_difficulty",
    "rl_top_difficulty",
    "rollbacks",
    "length_delta",
    "made_up",
    "phase_steps",
    "restarts",
)


@dataclass(kw_only=True)
class StepOutput:
    step: int  # the step just taken (1-based count of steps done)
    loss: torch.Tensor  # 0-d, on device: token-normalised loss of the whole step
    grad_norm: torch.Tensor  # 0-d, on device: pre-clip global norm
    lr: float  # the LR the update applied (read from the optimizer)
    scheduled_lr: float  # the configured schedule's LR for this step, before the multiplier
    lr_scale: float
    batch: StepBatch
    micro_batch_tokens: int  # the budget the step's micro-batches were cut to
    changes: int = 0  # Control's count of applied actions when the step ran
    phase: int = 0  # the phase the step belongs to (pretraining, finetuning)
    seconds: float = 0.0  # wall time of the step, data loading included
    skipped: torch.Tensor | None = None  # 0-d bool, on device: the update gate withheld the update
    skip_by: str = ""  # who asked for it through Control's skip_step ("person", "hook"); "": nobody asked
    overflow: torch.Tensor | None = None  # 0-d bool, on device: fp16 GradScaler found inf/NaN
    withheld: bool | None = None  # skipped as read on the host already (the re-run's read); None: not read
    aux_loss: torch.Tensor | None = None  # 0-d, on device: the MoE auxiliary losses in the objective
    moe: dict[str, Any] | None = None  # MoEStepStats.as_dict(): router telemetry per MoE layer
    mod: dict[str, Any] | None = None  # RouterStats.mod_dict(): per Mixture-of-Depths layer
    # [R, 2] on device: RowLosses.values (summed loss, targets) per row; [R, 3] with the row gate's flag
    row_losses: torch.Tensor | None = None
    rerun: dict[str, Any] | None = None  # a flagged step computed twice: the verdict (training/rerun.py)
    update_gain: torch.Tensor | None = None  # 0-d, on device: measured share of the predicted decrease (gain.py)
