"""Checkpoints written before the fused attention projection was grouped per kv head (trimtab
before 2026-11-24) hold `blocks.{i}.attn.wqkv` with its rows q, k, v apart (H*E, K*E, K*E).
Every reader takes them: weights under the new name and layout (layers.group_qkv), and a
one-process checkpoint's AdamW moments with them, so an older run resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trimtab.config import ModelConfig
from trimtab.model.layers import group_qkv

OLD, NEW = ".attn.wqkv.", ".attn.qkv."


def is_legacy(names: Iterable[str]) -> bool:
    return any(OLD in name for name in names)


def regroup(tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Rows q, k, v apart (the old layout; any trailing dims) -> grouped."""
    E = cfg.head_dim or cfg.d_model // cfg.n_heads
    q, k, v = tensor.split([n * E for n in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)])
    return group_qkv(q, k, v, cfg.n_kv_heads)


def upgrade_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`weights` with any old fused projection renamed and regrouped (the same dict if none)."""
    if not is_legacy(weights):
        return weights
    return {name.replace(OLD, NEW): regroup(t, cfg) if OLD in name else t for name, t in weights.items()}


class UpgradedReader:
    """A lazy tensor reader (names, call by name) over an old checkpoint, seen in the new layout."""

    def __init__(self, get: Callable[[str], torch.Tensor], names: Iterable[str], cfg: ModelConfig):
        self.get, self.cfg = get, cfg
        self.old = {name.replace(OLD, NEW): name for name in names}

    @property
    def names(self) -> set[str]:
        return set(self.old)

    def __call__(self, name: str) -> torch.Tensor:
        old = self.old[name]
        return regroup(self.get(old), self.cfg) if old != name else self.get(name)


def upgrade_optimizer(native: dict[str, Any], param_names: list[str], cfg: ModelConfig) -> dict[str, Any]:
    """An optimizer.state_dict() (parameters numbered in group order, `param_names` in that
    order) whose fused-projection moments are regrouped like their weights."""
    for index, state in native["state"].items():
        if NEW in param_names[index]:
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = regroup(value, cfg)
    return native
