"""The units a merge method sees: trimtab fuses tensors that Hugging Face files (and so mergekit)
keep apart, and methods that look at a whole tensor (slerp's angle, TIES's top-k, DARE's l1
rescale, Model Stock's cosine) must see the same pieces for a recipe to mean the same:

    blocks.{i}.attn.qkv.weight / .bias    q, k, v rows apart (H*E, K*E, K*E; model.layers.split_qkv)
    blocks.{i}.ffn.w1 / w3 / w2 (MoE)     one unit per expert ([E, D, H] -> E of [D, H])
    anything else                          the tensor whole
"""

from __future__ import annotations

import torch

from trimtab.config import ModelConfig
from trimtab.model.layers import group_qkv, split_qkv

QKV = ("attn.qkv.weight", "attn.qkv.bias")


def split(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    if name.endswith(QKV):
        return list(split_qkv(tensor, cfg.n_heads, cfg.n_kv_heads))
    if name.endswith((".ffn.w1", ".ffn.w2", ".ffn.w3")):  # MoE experts, stacked
        return list(tensor.unbind(0))
    return [tensor]


def join(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if name.endswith((".ffn.w1", ".ffn.w2", ".ffn.w3")):
        return torch.stack(parts)
    if name.endswith(QKV):
        return group_qkv(*parts, cfg.n_kv_heads)
    return parts[0]
