"""Tensor names and layouts between trimtab and the transformers classes of hf/architectures.py,
one tensor at a time in both directions (a reader fetches each on demand, so neither direction
holds a second copy of the model).

trimtab                          transformers (layer i: model.layers.{i}.)
tok_emb.weight                   model.embed_tokens.weight
blocks.{i}.attn_norm.weight      input_layernorm.weight
blocks.{i}.ffn_norm.weight       post_attention_layernorm.weight
blocks.{i}.attn.qkv.weight       self_attn.q_proj / k_proj / v_proj .weight: rows H*E, K*E, K*E,
                                 grouped per kv head (model.layers.group_qkv); both rotate-half
                                 RoPE: no permutation within a head
blocks.{i}.attn.qkv.bias         self_attn.q_proj / k_proj / v_proj .bias (Qwen2)
blocks.{i}.attn.{q,k}_norm       self_attn.{q,k}_norm.weight (Qwen3)
blocks.{i}.attn.wo.weight        self_attn.o_proj.weight
blocks.{i}.ffn.w1 / w3 / w2      mlp.gate_proj / up_proj / down_proj .weight
MoE layer:
blocks.{i}.ffn.router [E, D]     MOE.gate.weight, divided by the live router temperature
blocks.{i}.ffn.w1[e] [D, H]      MOE.experts.{e}.GATE.weight = w1[e]^T [H, D] (w3: UP)
blocks.{i}.ffn.w2[e] [H, D]      MOE.experts.{e}.DOWN.weight = w2[e]^T [D, H]
blocks.{i}.ffn.shared.w*         mlp.shared_expert.*_proj.weight (Qwen2-MoE)
blocks.{i}.ffn.shared_gate       mlp.shared_expert_gate.weight
norm.weight, lm_head.weight      model.norm.weight, lm_head.weight (absent when tied)

MOE / GATE / UP / DOWN: Mixtral block_sparse_moe / w1 / w3 / w2; Qwen2-MoE mlp / gate_proj /
up_proj / down_proj. Export writes these per-expert names (so does transformers 5's
save_pretrained). Import also takes transformers 5's in-memory layout, the one mergekit 0.1.5
writes (transformers' conversion_mapping.py: Mixtral's block_sparse_moe renamed mlp, each
layer's experts fused by MergeModulelist(dim=0) + Concatenate(dim=1); Qwen2-MoE the same):
blocks.{i}.ffn.router            mlp.gate.weight [E, D]
blocks.{i}.ffn.w1 / w3           mlp.experts.gate_up_proj [E, 2H, D]; [e] = cat(GATE[e], UP[e]):
                                 rows :H = w1[e]^T, rows H: = w3[e]^T (MixtralExperts: gate, up
                                 = linear(x, gate_up_proj[e]).chunk(2, dim=-1))
blocks.{i}.ffn.w2                mlp.experts.down_proj [E, D, H]; [e] = DOWN[e] = w2[e]^T
Import takes any mix transformers reads: either module name, per-expert or fused experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import Tensor

from trimtab.config import ModelConfig
from trimtab.errors import CheckpointError
from trimtab.model.layers import group_qkv, split_qkv

Getter = Callable[[str], Tensor]
Box = tuple[slice, ...]  # a part of a tensor: one slice (with start and stop) per dimension


class Part:
    """A tensor of the file not read yet: `part[box]` reads only that box of it (safetensors'
    get_slice), so a sharded model's rank reads its own shard of each tensor, not the whole
    tensor (distributed/metainit.py keep_shard)."""

    def __init__(self, shape: torch.Size, read: Callable[[Box], Tensor]):
        self.shape, self._read = shape, read

    def __getitem__(self, box: Box) -> Tensor:
        return self._read(box)


Pairs = Iterator[tuple[str, "Tensor | Part"]]
EXPERTS = {  # class -> (MoE module, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
}
FUSED_MODULE = "mlp"  # transformers 5's name of every MoE module (Mixtral's block_sparse_moe renamed)
MLP = ("gate_proj", "up_proj", "down_proj")


def to_hf(get: Getter, cfg: ModelConfig, arch: str, moe_state: dict[str, dict[str, float]]) -> Pairs:
    """(transformers name, tensor) for each tensor of class `arch`, from trimtab's `get`."""
    yield "model.embed_tokens.weight", get("tok_emb.weight")
    for i, kind in enumerate(cfg.layers):
        t, h = f"blocks.{i}.", f"model.layers.{i}."
        yield h + "input_layernorm.weight", get(t + "attn_norm.weight")
        yield h + "post_attention_layernorm.weight", get(t + "ffn_norm.weight")
        yield from _attention_to_hf(get, cfg, t + "attn.", h + "self_attn.")
        if "moe" in kind:
            temperature = moe_state.get(str(i), {}).get("router_temperature", cfg.moe.router_temperature)
            yield from _moe_to_hf(get, cfg, arch, t + "ffn.", h, temperature)
        else:
            yield from _swiglu(get, t + "ffn.", h + "mlp.", MLP)
    yield "model.norm.weight", get("norm.weight")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", get("lm_head.weight")


def _attention_to_hf(get: Getter, cfg: ModelConfig, t: str, h: str) -> Pairs:
    for suffix in ("weight", "bias") if cfg.attn_bias else ("weight",):
        parts = split_qkv(get(t + "qkv." + suffix), cfg.n_heads, cfg.n_kv_heads)
        for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
            yield f"{h}{name}.{suffix}", part
    if cfg.qk_norm:
        yield h + "q_norm.weight", get(t + "q_norm.weight")
        yield h + "k_norm.weight", get(t + "k_norm.weight")
    yield h + "o_proj.weight", get(t + "wo.weight")


def _swiglu(get: Getter, t: str, h: str, names: tuple[str, str, str]) -> Pairs:
    for ours, theirs in zip(("w1", "w3", "w2"), names):
        yield f"{h}{theirs}.weight", get(f"{t}{ours}.weight")


def _moe_to_hf(get: Getter, cfg: ModelConfig, arch: str, t: str, h: str, temperature: float) -> Pairs:
    module, *names = EXPERTS[arch]
    m = f"{h}{module}."
    yield m + "gate.weight", get(t + "router") / temperature  # logits / T == (W / T) x
    w1, w3, w2 = get(t + "w1"), get(t + "w3"), get(t + "w2")
    for e in range(w1.shape[0]):
        for name, w in zip(names, (w1[e], w3[e], w2[e])):
            yield f"{m}experts.{e}.{name}.weight", w.T.contiguous()
    if arch == "Qwen2MoeForCausalLM":
        yield from _shared_to_qwen2_moe(get, cfg, t, m)


def _shared_to_qwen2_moe(get: Getter, cfg: ModelConfig, t: str, m: str) -> Pairs:
    """Qwen2-MoE's shared expert is always there and always gated: trimtab's gated one maps
    straight; an ungated one goes behind a zero gate (sigmoid(0) = 1/2) with down_proj doubled;
    none becomes a zero-width one, which adds exactly 0."""
    D, gated = cfg.d_model, cfg.moe.shared_gate
    if cfg.moe.n_shared_experts == 0:
        zero = get(t + "router").new_zeros
        yield from zip((f"{m}shared_expert.{n}.weight" for n in MLP), (zero(0, D), zero(0, D), zero(D, 0)))
        yield m + "shared_expert_gate.weight", zero(1, D)
        return
    for ours, theirs in zip(("w1", "w3", "w2"), MLP):
        w = get(f"{t}shared.{ours}.weight")
        yield f"{m}shared_expert.{theirs}.weight", w if gated or ours != "w2" else 2 * w
    gate = get(t + "shared_gate.weight") if gated else get(t + "router").new_zeros(1, D)
    yield m + "shared_expert_gate.weight", gate


# ---- import ----------------------------------------------------------------------------------


def from_hf(get: Getter, cfg: ModelConfig, arch: str) -> Pairs:
    """(trimtab name, tensor) for each tensor of a trimtab model computing `cfg`, from the
    transformers names of class `arch`."""
    part = get.part if isinstance(get, Recorder) else get  # a tensor copied as is: read only where needed
    yield "tok_emb.weight", part("model.embed_tokens.weight")
    for i, kind in enumerate(cfg.layers):
        t, h = f"blocks.{i}.", f"model.layers.{i}."
        yield t + "attn_norm.weight", part(h + "input_layernorm.weight")
        yield t + "ffn_norm.weight", part(h + "post_attention_layernorm.weight")
        yield from _attention_from_hf(get, cfg, t + "attn.", h + "self_attn.")
        if "moe" in kind:
            yield from _moe_from_hf(get, cfg, arch, t + "ffn.", h)
        else:
            for ours, theirs in zip(("w1", "w3", "w2"), MLP):
                yield f"{t}ffn.{ours}.weight", part(f"{h}mlp.{theirs}.weight")
    yield "norm.weight", part("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", part("lm_head.weight")


def _attention_from_hf(get: Getter, cfg: ModelConfig, t: str, h: str) -> Pairs:
    part = get.part if isinstance(get, Recorder) else get
    for suffix in ("weight", "bias") if cfg.attn_bias else ("weight",):
        q, k, v = (part(f"{h}{n}.{suffix}") for n in ("q_proj", "k_proj", "v_proj"))
        grouped = _grouped_part(q, k, v, cfg.n_kv_heads) if isinstance(q, Part) else group_qkv(q, k, v, cfg.n_kv_heads)
        yield f"{t}qkv.{suffix}", grouped
    if cfg.qk_norm:
        yield t + "q_norm.weight", part(h + "q_norm.weight")
        yield t + "k_norm.weight", part(h + "k_norm.weight")
    yield t + "wo.weight", part(h + "o_proj.weight")


def _grouped_part(q: Part, k: Part, v: Part, n_kv_heads: int) -> Part:
    """group_qkv(q, k, v) not read yet: a box of its rows reads only the kv groups those rows
    fall in (each group's query rows are contiguous in q, its key and value rows in k and v)."""
    shape = torch.Size((q.shape[0] + k.shape[0] + v.shape[0], *q.shape[1:]))
    return Part(shape, partial(_read_grouped, q, k, v, n_kv_heads))


def _read_grouped(q: Part, k: Part, v: Part, n_kv_heads: int, box: Box) -> Tensor:
    rows, rest = box[0], box[1:]
    if rows.stop <= rows.start:  # an empty shard (FSDP2's uneven split)
        return q[(slice(0, 0), *rest)]
    sizes = (q.shape[0] // n_kv_heads, k.shape[0] // n_kv_heads, v.shape[0] // n_kv_heads)
    R = sum(sizes)  # rows of one kv group in the grouped layout
    first, last = rows.start // R, -(-rows.stop // R)
    q, k, v = (t[(slice(first * n, last * n), *rest)] for t, n in zip((q, k, v), sizes))
    return group_qkv(q, k, v, last - first)[rows.start - first * R : rows.stop - first * R]


def _moe_from_hf(get: Getter, cfg: ModelConfig, arch: str, t: str, h: str) -> Pairs:
    part = get.part if isinstance(get, Recorder) else get  # all copied as is but the experts (Parts too)
    module, gate, up, down = EXPERTS[arch]
    modules = [f"{h}{m}." for m in dict.fromkeys((module, FUSED_MODULE))]  # the class's name first
    yield t + "router", _first(part, [m + "gate.weight" for m in modules])[1]
    yield from _experts_from_hf(get, cfg, t, [m + "experts." for m in modules], (gate, up, down))
    m = modules[0]
    if cfg.moe.n_shared_experts:
        for ours, theirs in zip(("w1", "w3", "w2"), MLP):
            yield f"{t}shared.{ours}.weight", part(f"{m}shared_expert.{theirs}.weight")
        yield t + "shared_gate.weight", part(m + "shared_expert_gate.weight")
    elif arch == "Qwen2MoeForCausalLM":  # zero-width shared expert: adds 0, nothing to keep
        for name in (*(f"shared_expert.{n}.weight" for n in MLP), "shared_expert_gate.weight"):
            part(m + name)


def _first(get: Getter, names: list[str]) -> tuple[int, Tensor | Part]:
    """The index and tensor of the first of `names` the file holds; KeyError naming the first if
    none."""
    for i, name in enumerate(names):
        try:
            return i, get(name)
        except KeyError:
            pass
    raise KeyError(names[0])


def _experts_from_hf(get: Getter, cfg: ModelConfig, t: str, xs: list[str], names: tuple[str, str, str]) -> Pairs:
    """w1 / w3 [E, D, H] and w2 [E, H, D] from per-expert matrices, or from the fused layout
    (gate_up_proj [E, 2H, D]: gate rows first; down_proj [E, D, H]). `xs`: the experts' prefixes
    to look under, in order. Parts for a sharded model: an expert-parallel rank reads its own
    experts only, a pipeline stage none of another stage's; else whole tensors."""
    lazy = isinstance(get, Recorder) and get.lazy
    part = get.part if isinstance(get, Recorder) else get
    try:
        i, gate_up = _first(part, [x + "gate_up_proj" for x in xs])
    except KeyError:
        for ours, name in zip(("w1", "w3", "w2"), names):
            experts = [_first(part, [f"{x}{e}.{name}.weight" for x in xs])[1] for e in range(cfg.moe.n_experts)]
            yield t + ours, _whole_unless(lazy, _stacked(experts))
        return
    down = _first(part, [x + "down_proj" for x in xs[i:] + xs[:i]])[1]  # gate_up_proj's module first
    H = gate_up.shape[1] // 2
    yield t + "w1", _whole_unless(lazy, _swapped(gate_up, 0, H))
    yield t + "w3", _whole_unless(lazy, _swapped(gate_up, H, H))
    yield t + "w2", _whole_unless(lazy, _swapped(down, 0, down.shape[1]))


def _whole_unless(lazy: bool, part: Part) -> Tensor | Part:
    return part if lazy else part[tuple(slice(0, n) for n in part.shape)]


def _stacked(experts: list[Tensor | Part]) -> Part:
    """stack([x.T for x in experts]) not read yet: a box of it reads its experts' boxes only."""
    rows, cols = experts[0].shape
    return Part(torch.Size((len(experts), cols, rows)), partial(_read_stacked, experts))


def _read_stacked(experts: list[Tensor | Part], box: Box) -> Tensor:
    chosen, a, b = box  # never empty over the experts: FSDP2 splits them by experts only when they divide evenly
    return torch.stack([experts[e][(b, a)].T for e in range(chosen.start, chosen.stop)])


def _swapped(fused: Tensor | Part, start: int, rows: int) -> Part:
    """fused[:, start : start + rows].transpose(1, 2) not read yet: a box of it reads that box of
    `fused` only."""
    shape = torch.Size((fused.shape[0], fused.shape[2], rows))
    return Part(shape, partial(_read_swapped, fused, start))


def _read_swapped(fused: Tensor | Part, start: int, box: Box) -> Tensor:
    chosen, a, b = box
    return fused[(chosen, slice(start + b.start, start + b.stop), a)].transpose(1, 2)


class Recorder:
    """A Getter over named tensors that remembers which it handed out, so an import can refuse a
    file holding tensors the class does not explain."""

    def __init__(self, get: Getter, names: set[str], lazy: bool = False):
        self._get, self.names, self.used = get, names, set()
        self.lazy = lazy and hasattr(get, "part")  # parts for a sharded model, where the reader can read one

    def __call__(self, name: str) -> Tensor:
        if name not in self.names:
            raise KeyError(name)
        self.used.add(name)
        return self._get(name)

    def part(self, name: str) -> Tensor | Part:
        """Tensor `name` to be copied as is: a Part when lazy (only a rank's box of it is read),
        else the tensor."""
        if not self.lazy:
            return self(name)
        if name not in self.names:
            raise KeyError(name)
        self.used.add(name)
        return Part(self._get.shape(name), partial(self._get.part, name))

    def check_all_used(self, where: str, tied: bool) -> None:
        left = sorted(self.names - self.used - ({"lm_head.weight"} if tied else set()))
        if left:
            raise CheckpointError(
                f"{where}: tensor '{left[0]}' (and {len(left) - 1} more) is not part of the model its "
                "config.json describes; the file and the config disagree"
            )
