"""The units a merge method sees: trimtab lays tensors out in ways that Hugging Face models (and so
mergekit) do not, and methods that look at a whole tensor (slerp's angle, TIES's top-k, DARE's l1
rescale, Model Stock's cosine, filter_wise's rows) must see the same pieces, in the same layout,
for a recipe to mean the same. A unit is the tensor transformers 5 holds, as mergekit 0.1.5 loads
it (it converts per-expert checkpoint files to transformers 5's fused layout before merging):

    blocks.{i}.attn.qkv.weight / .bias    q, k, v apart (H*E, K*E, K*E rows; model.layers.split_qkv)
    blocks.{i}.ffn.w1 + w3 (MoE)          one unit: mlp.experts.gate_up_proj [E, 2H, D], every
                                          expert's gate and up rows together (w1[e]^T, w3[e]^T)
    blocks.{i}.ffn.w2 (MoE)               one unit: mlp.experts.down_proj [E, D, H] (w2[e]^T)
    anything else                          the tensor whole

per_expert (a recipe parameter) merges each expert's gate, up and down matrices on its own instead:
the units of a per-expert checkpoint (transformers 4's experts.{e}.w1 / w3 / w2 .weight) as mergekit
merged them before transformers 5.
"""

from __future__ import annotations

import torch

from trimtab.config import ModelConfig
from trimtab.model.layers import group_qkv, split_qkv

QKV = ("attn.qkv.weight", "attn.qkv.bias")
GATE, UP, DOWN = ".ffn.w1", ".ffn.w3", ".ffn.w2"  # MoE experts, stacked [E, ...] (dense: .ffn.w1.weight)


def groups(names: list[str]) -> list[tuple[str, ...]]:
    """The tensors merged together, in `names`' order: each MoE layer's w1 and w3 (one fused
    gate_up_proj), every other tensor alone."""
    present = set(names)
    out = []
    for name in names:
        if name.endswith(UP) and name.removesuffix(UP) + GATE in present:
            continue  # joins its w1
        if name.endswith(GATE) and name.removesuffix(GATE) + UP in present:
            out.append((name, name.removesuffix(GATE) + UP))
        else:
            out.append((name,))
    return out


def split(names: tuple[str, ...], tensors: dict[str, torch.Tensor], cfg: ModelConfig, per_expert: bool) -> list:
    """The units of the group `names` (see groups), as transformers lays them out."""
    if len(names) == 2:  # an MoE layer's w1, w3 [E, D, H] -> [E, H, D] each
        gate, up = (tensors[n].transpose(1, 2) for n in names)
        return [*gate.unbind(0), *up.unbind(0)] if per_expert else [torch.cat([gate, up], 1)]
    (name,) = names
    tensor = tensors[name]
    if name.endswith(DOWN):  # [E, H, D] -> down_proj [E, D, H]
        down = tensor.transpose(1, 2)
        return list(down.unbind(0)) if per_expert else [down]
    if name.endswith(QKV):
        return list(split_qkv(tensor, cfg.n_heads, cfg.n_kv_heads))
    return [tensor]


def join(names: tuple[str, ...], parts: list[torch.Tensor], cfg: ModelConfig, per_expert: bool) -> dict:
    """The trimtab tensors of the group `names` from its merged units (split's inverse)."""
    if len(names) == 2:
        if per_expert:
            n = len(parts) // 2
            gate, up = torch.stack(parts[:n]), torch.stack(parts[n:])
        else:
            h = parts[0].shape[1] // 2
            gate, up = parts[0][:, :h], parts[0][:, h:]
        return {names[0]: gate.transpose(1, 2).contiguous(), names[1]: up.transpose(1, 2).contiguous()}
    (name,) = names
    if name.endswith(DOWN):
        down = torch.stack(parts) if per_expert else parts[0]
        return {name: down.transpose(1, 2).contiguous()}
    if name.endswith(QKV):
        return {name: group_qkv(*parts, cfg.n_kv_heads)}
    return {name: parts[0]}
