"""Model sub-sections for sparse layers: Mixture-of-Experts and Mixture-of-Depths.

Which layers use them is data, `model.layer_pattern` (e.g. [dense, moe] alternates), not a class
per combination; these sections hold the shared settings of every such layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check, _positive

LAYER_KINDS = ("dense", "moe", "mod", "moe+mod")


@dataclass
class MoEConfig(Section):
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0  # always-on experts added to the routed output (DeepSeekMoE)
    shared_hidden: int = 0  # width of the shared experts together; 0: n_shared_experts * expert_hidden
    shared_gate: bool = False  # scale the shared output by sigmoid(x . g) (Qwen2-MoE); False: ungated
    # Gates of the chosen experts divided by their sum: auto when top_k > 1 (top-1 keeps the raw
    # probability, Switch), true always (Mixtral: a top-1 gate is then 1), false never (Qwen1.5-MoE).
    norm_topk_prob: str = "auto"
    expert_hidden: int = 0  # 0: the dense ffn width / top_k, so active FLOPs match the dense FFN
    capacity_factor: float = 1.25  # tokens per expert = capacity_factor * T * top_k / E; 0: dropless
    router_temperature: float = 1.0  # softmax temperature of the router logits
    router_jitter: float = 0.0  # multiplicative noise on router inputs while training (Switch)
    balance_coef: float = 0.01  # weight of the load-balancing loss (Switch / GShard)
    z_loss_coef: float = 1e-3  # router z-loss (ST-MoE, Zoph et al. 2022)
    bias_update_rate: float = 0.0  # aux-loss-free balancing bias step (DeepSeek-V3: 1e-3); 0: off

    @property
    def renormalize(self) -> bool:
        """Whether the chosen experts' gates are divided by their sum (norm_topk_prob resolved)."""
        return self.norm_topk_prob == "true" or (self.norm_topk_prob == "auto" and self.top_k > 1)

    def validate(self) -> None:
        _positive(self, "model.moe", "n_experts", "top_k", "router_temperature")
        _check(self.top_k <= self.n_experts, "model.moe.top_k", "must be <= model.moe.n_experts")
        _check(
            self.n_shared_experts >= 0 and self.expert_hidden >= 0 and self.shared_hidden >= 0,
            "model.moe",
            "n_shared_experts, expert_hidden and shared_hidden must be >= 0",
        )
        _check(
            self.norm_topk_prob in ("auto", "true", "false"), "model.moe.norm_topk_prob", "must be auto, true or false"
        )
        _check(
            self.capacity_factor == 0 or self.capacity_factor >= 1.0,
            "model.moe.capacity_factor",
            "must be 0 (dropless) or >= 1.0",
        )
        _check(
            not self.shared_gate or self.n_shared_experts > 0,
            "model.moe.shared_gate",
            "needs model.moe.n_shared_experts > 0 (a gate without a shared expert gates nothing)",
        )
        _check(0 <= self.router_jitter < 1, "model.moe.router_jitter", "must be in [0, 1)")
        _check(
            self.balance_coef >= 0 and self.z_loss_coef >= 0 and self.bias_update_rate >= 0,
            "model.moe",
            "balance_coef, z_loss_coef and bias_update_rate must be >= 0",
        )


@dataclass
class MoDConfig(Section):
    capacity: float = 0.5  # fraction of tokens each MoD block processes (Raposo et al. 2024: 0.125)
    # One capacity per MoD layer, in layer order (overrides `capacity`); empty: all `capacity`.
    layer_capacity: list[float] = field(default_factory=list)
    warmup_steps: int = 0  # capacity goes linearly from 1.0 to `capacity` over these steps
    predictor_loss_coef: float = 0.01  # BCE of the causal predictor that decides at inference

    def validate(self, n_mod_layers: int) -> None:
        _check(0 < self.capacity <= 1, "model.mod.capacity", "must be in (0, 1]")
        for i, c in enumerate(self.layer_capacity):
            _check(0 < c <= 1, f"model.mod.layer_capacity[{i}]", f"is {c}; must be in (0, 1]")
        _check(
            not self.layer_capacity or len(self.layer_capacity) == n_mod_layers,
            "model.mod.layer_capacity",
            f"has {len(self.layer_capacity)} entries; give one per "
            f"Mixture-of-Depths layer ({n_mod_layers} in model.layer_pattern x n_layers) or none",
        )
        _check(
            self.warmup_steps >= 0 and self.predictor_loss_coef >= 0,
            "model.mod",
            "warmup_steps and predictor_loss_coef must be >= 0",
        )
