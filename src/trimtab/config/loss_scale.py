"""`train.loss_scale`: fp16's dynamic loss scaling (torch.amp.GradScaler; docs/precision.md). A
step whose scaled gradients overflow is skipped and the scale multiplied by `backoff_factor`;
after `growth_interval` steps without an overflow it is multiplied by `growth_factor`; it never
falls below `floor` (a scale that small means fp16 cannot hold these gradients: the
orchestrator's fp16 rule then lowers the LR). bf16 and fp32 need none of it."""

from __future__ import annotations

from dataclasses import dataclass

from trimtab.config.checks import Section, _check


@dataclass
class LossScaleConfig(Section):
    init: float = 2.0**16  # the first scale (torch's default)
    growth_interval: int = 2000  # steps without an overflow before the scale grows (the window)
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    floor: float = 1.0  # the scale never goes below this

    def scaler_args(self) -> dict[str, float | int]:
        """As torch.amp.GradScaler's arguments (the floor is the trainer's: Trainer._update)."""
        return {
            "init_scale": self.init,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def validate(self) -> None:
        _check(self.init > 0 and self.floor > 0, "train.loss_scale", "init and floor must be > 0")
        _check(self.floor <= self.init, "train.loss_scale.floor", f"must be <= train.loss_scale.init ({self.init:g})")
        _check(self.growth_interval >= 1, "train.loss_scale.growth_interval", "must be >= 1 step")
        _check(self.growth_factor > 1, "train.loss_scale.growth_factor", "must be > 1 (it grows the scale)")
        _check(0 < self.backoff_factor < 1, "train.loss_scale.backoff_factor", "must be in (0, 1) (it shrinks it)")
