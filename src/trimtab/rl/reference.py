"""The frozen reference policy of DPO (rl/dpo.py) and of RL's KL term (`rl.kl_coef` > 0; off by
default, as in DAPO and Dr. GRPO, which found it holds the policy back on verifiable rewards):
the policy's starting weights, read from the run's own step-0 checkpoint. That checkpoint is kept
from pruning while either is on, so a resumed run compares with the same reference wherever
train.init_from has gone since. RL's objective adds kl_coef x GRPO's per-token estimator of
KL(pi || pi_ref) (Shao et al. 2024, eq. 4: pi_ref / pi - log(pi_ref / pi) - 1, unbiased and never
negative; rl/loss.py), evaluated at the rollouts' temperature as the policy is; DPO compares
the policy's log-probabilities of responses with the reference's (rl/dpo.py).

Shape legend: B rows, T positions, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trimtab.checkpoint import load_model
from trimtab.config import ModelConfig
from trimtab.errors import ConfigError
from trimtab.model import Transformer, build_model
from trimtab.rl.loss import target_logprobs


def load_reference(cfg: ModelConfig, run_dir: Path, device: torch.device, key: str = "rl.kl_coef") -> Transformer:
    """The run's starting policy, frozen, on `device`; `key`: what needs it (rl.kl_coef, dpo)."""
    path = Path(run_dir) / "checkpoints" / "step_000000"
    if not path.is_dir():
        fix = "start a new run with rl.kl_coef set, or set rl.kl_coef=0" if key == "rl.kl_coef" else "start a new run"
        raise ConfigError(
            f"{key}: the reference policy is the run's step-0 checkpoint, and {path} is not there (pruned "
            f"or deleted); {fix}"
        )
    reference = build_model(cfg)
    load_model(reference, path)
    return reference.to(device).eval().requires_grad_(False)


@torch.no_grad()
def reference_logprobs(
    reference: Transformer, inputs: torch.Tensor, targets: torch.Tensor, temperature: float, at: torch.Tensor
) -> torch.Tensor:
    """The reference's log-probability of each target [B, T] (inputs, targets [B, T]; `at` the
    responses' flat positions, rl/loss.py response_positions: 0 elsewhere, never read)."""
    return target_logprobs(reference.hidden(inputs), reference.lm_head.weight, targets, at, temperature)
