"""The `dpo:` section: direct preference optimization on offline preference pairs (rl/dpo.py,
rl/pairs.py; docs/rl.md, DPO).

`trimtab dpo` trains with this section on (`enabled`), from train.init_from's weights: each step
reads `pairs_per_step` pairs of a prompt with a chosen and a rejected response, and takes one
optimizer step on the DPO loss against the frozen starting policy (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from trimtab.config.checks import Section, _check, _finite
from trimtab.config.loss_rules import GradRule

LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # losses of the policy's likelihoods alone: no reference model


@dataclass
class DPOConfig(Section):
    enabled: bool = False  # on under `trimtab dpo`
    # a JSONL file of {"prompt", "chosen", "rejected"}, or the built-in arithmetic task's pairs
    # (chosen: the right answer, rejected: a wrong one); builtin:arithmetic[:DIGITS]
    pairs: str = "builtin:arithmetic"
    pairs_per_step: int = 16  # preference pairs per optimizer step
    beta: float = 0.1  # the implicit reward's scale: beta x log(pi / pi_ref); lower drifts further
    # against the reference: sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023) | hinge
    # (SLiC); without one: simpo (Meng et al. 2024; its paper's beta: 2-2.5) | orpo (Hong et al. 2024)
    loss: str = "sigmoid"
    label_smoothing: float = 0.0  # cDPO: the share of pairs assumed mislabelled (sigmoid only)
    # RPO: + sft_coef x the chosen response's negative log-likelihood per token, which keeps DPO
    # from lowering the chosen response with the rejected one (0: plain DPO)
    sft_coef: float = 0.0
    held_out: int = 64  # held-out pairs scored (preference accuracy, margin) at each evaluation
    simpo_gamma: float = 0.5  # SimPO's target reward margin (dpo.loss=simpo)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares the policy with the frozen starting one (step 0's weights)."""
        return self.loss not in REFERENCE_FREE

    def validate(self) -> None:
        _check(self.pairs_per_step >= 1, "dpo.pairs_per_step", "must be >= 1")
        _check(self.beta > 0, "dpo.beta", "must be > 0 (e.g. 0.1)")
        _finite(self, "dpo", "beta")
        _check(self.loss in LOSSES, "dpo.loss", f"must be one of {', '.join(LOSSES)}")
        _check(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", "must be in [0, 0.5) (0: plain DPO)")
        _check(
            self.label_smoothing == 0 or self.loss == "sigmoid",
            "dpo.label_smoothing",
            "applies to dpo.loss=sigmoid only (cDPO); set it to 0",
        )
        _check(self.sft_coef >= 0, "dpo.sft_coef", "must be >= 0 (0: plain DPO)")
        _check(self.sft_coef == 0 or self.loss != "orpo", "dpo.sft_coef", "must be 0 with dpo.loss=orpo (its own)")
        _check(self.simpo_gamma >= 0, "dpo.simpo_gamma", "must be >= 0 (SimPO's margin; e.g. 0.5)")
        _check(self.held_out >= 0, "dpo.held_out", "must be >= 0")


def grad_ceiling(dpo: DPOConfig, max_norm: float) -> float:
    """The grad rule's absolute ceiling for this objective: under `ipo` the default (a likelihood's
    100) 1 / beta times higher. IPO's loss, (h - 1 / (2 beta))^2, weighs the log-ratio's gradient by
    2 (h - 1 / (2 beta)), -1 / beta at the reference, where sigmoid weighs it by beta / 2 and hinge
    by beta: its pre-clip norm is ~1 / beta times another loss's by design (140-350 from the
    README's warm start at beta 0.1), and a ceiling of 100 withheld every update from step 1, rolled
    back three times and stopped the run (exit 3). The relative ceiling (factor x the rolling mean)
    is untouched; a max_norm other than the default is the user's and kept (resolved once: the
    raised one is no longer the default)."""
    if dpo.enabled and dpo.loss == "ipo" and max_norm == GradRule.max_norm:
        return max_norm / dpo.beta
    return max_norm
