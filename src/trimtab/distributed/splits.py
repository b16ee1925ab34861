"""Which model settings split over tensor-parallel and expert-parallel ranks: checks of a resolved
config that need no process group and import nothing of torch.distributed, so the planner
(plan/layout.py) and a run's start ask them alike, and cheaply; and which weights split (the
planner's per-rank parameter count, held to the sharded model by tests/test_plan_layout.py)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from trimtab.errors import ConfigError

if TYPE_CHECKING:
    from trimtab.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """A ConfigError naming the setting of the (resolved) model config that does not split over
    `tp` ranks. The planner asks the same question (plan/layout.py)."""
    sizes = {"model.n_kv_heads": cfg.n_kv_heads, "model.ffn_hidden": cfg.ffn_hidden, "model.vocab_size": cfg.vocab_size}
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(f"distributed.tp={tp} must divide {key} ({size}); lower distributed.tp")
    check_moe_parallel(cfg, tp, 1)


def check_moe_parallel(cfg: ModelConfig, tp: int, ep: int) -> None:
    """A ConfigError naming the (resolved) model setting that does not split over tp / ep."""
    moe = cfg.moe
    has_moe = any("moe" in kind for kind in cfg.layers)
    if ep > 1 and not has_moe:
        raise ConfigError(f"distributed.ep={ep}: the model has no MoE layers to split; use distributed.ep=1")
    if not has_moe:
        return
    if moe.n_experts % ep:
        raise ConfigError(
            f"distributed.ep={ep} must divide model.moe.n_experts ({moe.n_experts}); lower distributed.ep"
        )
    sizes = {"model.moe.expert_hidden": moe.expert_hidden, "model.moe.shared_hidden": moe.shared_hidden}
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(f"distributed.tp={tp} must divide {key} ({size}); lower distributed.tp")
    if tp > 1 and moe.router_jitter > 0:
        raise ConfigError(
            f"distributed.tp={tp}: model.moe.router_jitter draws noise on each rank, so the tensor-parallel "
            "ranks would route differently; set it to 0"
        )


# The weights tensor parallelism leaves whole on every rank, by their names in the model:
# distributed/tensor.py's norms, qk_norm's gains and a Mixture-of-Depths block's router and
# predictor; distributed/expert.py's MoE router and shared gate. Every other weight is split over
# the tp ranks, and a MoE layer's routed experts (ffn.w1 / w3 / w2, parameters of the MoE itself)
# over the ep replicas as well.
_WHOLE_UNDER_TP = re.compile(
    r"(^|\.)(\w*norm\.weight|depth\.router\.weight|depth\.predictor\.[\w.]+|ffn\.router|ffn\.shared_gate\.weight)$"
)
_ROUTED_EXPERTS = re.compile(r"(^|\.)ffn\.w[123]$")


def whole_under_tp(name: str) -> bool:
    """Whether the model's parameter `name` is replicated, not split, over tensor-parallel ranks."""
    return bool(_WHOLE_UNDER_TP.search(name))


def routed_expert(name: str) -> bool:
    """Whether the model's parameter `name` is a MoE layer's routed experts' (split by ep too)."""
    return bool(_ROUTED_EXPERTS.search(name))


def rank_share(name: str, numel: int, tp: int, ep: int = 1) -> float:
    """Elements of the parameter `name` (of `numel`) one rank holds under tp x ep, before FSDP
    shards them over the replicas."""
    if whole_under_tp(name):
        return float(numel)
    return numel / (tp * ep) if routed_expert(name) else numel / tp
