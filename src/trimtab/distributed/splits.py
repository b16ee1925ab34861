"""Which model settings split over tensor-parallel and expert-parallel ranks: checks of a resolved
config that need no process group and import nothing of torch.distributed, so the planner
(plan/layout.py) and a run's start ask them alike, and cheaply."""

from __future__ import annotations

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
