"""Which model settings split over tensor-parallel and expert-parallel ranks: checks of a resolved
config that need no process group and import nothing of torch.distributed, so the planner
(plan/layout.py) and a run's start ask them alike, and cheaply; and which weights split (the
planner's per-rank parameter count, held to the sharded model by tests/test_plan_layout.py)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from trimtab.config.distributed import check_dense_split, check_moe_split

if TYPE_CHECKING:
    from trimtab.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """A ConfigError naming the setting of the (resolved) model config that does not split over
    `tp` ranks: the rules the config checks as it loads (config/distributed.py), asked again with
    the tokenizer's vocabulary. The planner asks the same question (plan/layout.py)."""
    check_dense_split(cfg, tp)
    check_moe_split(cfg, tp, 1)


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
