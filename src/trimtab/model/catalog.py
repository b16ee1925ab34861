"""The preset catalogue: each preset's family and size, computed on the meta device.

`trimtab presets`, the README table and the tests read sizes from here rather than from
hand-written numbers in the preset files, so a shape edit can never leave a stale count behind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from trimtab.config import PRESET_DIR, ModelConfig, RunConfig, available_presets, load_config, read_yaml
from trimtab.model.transformer import Transformer


@dataclass(frozen=True)
class PresetInfo:
    name: str
    family: str  # dense | moe | mod | hybrid (see `family`)
    total: int  # parameters, tied weights once
    active: int  # parameters one token goes through (top_k of the routed experts)
    flops_per_token: int  # training FLOPs per token at the preset's data.seq_len
    description: str


@dataclass(kw_only=True)
class ModelSize:
    total: int  # every parameter, tied weights once
    active: int  # what one token uses (top_k of each MoE layer's routed experts)
    non_embedding: int
    active_non_embedding: int
    flops_per_token: int  # training (forward + backward) FLOPs at seq_len, Transformer.flops_per_token
    seq_len: int
    family: str  # dense | moe | mod | hybrid
    compute_params: int = 0  # the N of the 20x rule: active for MoE, total otherwise
    compute_params_kind: str = "total"


def family(cfg: ModelConfig) -> str:
    """dense: every layer dense; moe: some MoE layers (dense ones may be interleaved, as Switch
    and DeepSeek do), no Mixture-of-Depths; mod: some MoD layers, no MoE; hybrid: both."""
    moe = any("moe" in kind for kind in cfg.layers)
    mod = any("mod" in kind for kind in cfg.layers)
    return "hybrid" if moe and mod else "moe" if moe else "mod" if mod else "dense"


class _Sizing(TorchFunctionMode):
    """Cheap shortcuts for building a model on the meta device only to count it. Meta tensors
    hold no values, yet torch runs some meta ops through Python reference decompositions: each
    initialiser call costs ~1 ms (hundreds in a 70B model), and the first one imports
    torch._dynamo (seconds). So initialisers become no-ops and arange runs on the CPU, taking
    the rotary tables (max_seq_len x head_dim / 2 values) with it; parameters stay on meta."""

    INIT = {"normal_", "uniform_", "fill_", "zero_", "ones_", "zeros_", "kaiming_uniform_", "trunc_normal_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.INIT:
            return args[0] if args else kwargs["tensor"]
        if name == "arange":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def meta_model(cfg: RunConfig, vocab_size: int | None = None) -> Transformer:
    """The model cfg describes, on the meta device (no memory, ~0.1 s for a 300B model). Vocab:
    the model config's, else `vocab_size` (a tokenizer's), else data.bpe_vocab_size (the size of the
    BPE the run would train)."""
    vocab = cfg.model.vocab_size or vocab_size or cfg.data.bpe_vocab_size
    with _Sizing(), torch.device("meta"):
        return Transformer(dataclasses.replace(cfg.model, vocab_size=vocab))


def uninitialised(cfg: ModelConfig) -> Transformer:
    """A CPU model whose weights are about to be overwritten (by a Hugging Face file): memory
    allocated, no initial weights drawn (seconds saved on a 1B model); buffers computed as usual."""
    with _Sizing():
        return Transformer(cfg.resolved())


def model_size(cfg: RunConfig, vocab_size: int | None = None) -> ModelSize:
    """The size of the model cfg describes (vocab as meta_model), counted on the meta device."""
    model = meta_model(cfg, vocab_size)
    size = ModelSize(
        total=model.num_params(),
        active=model.num_params(active=True),
        non_embedding=model.num_params(exclude_embeddings=True),
        active_non_embedding=model.num_params(exclude_embeddings=True, active=True),
        flops_per_token=model.flops_per_token(cfg.data.seq_len),
        seq_len=cfg.data.seq_len,
        family=family(cfg.model),
    )
    size.compute_params, size.compute_params_kind = (
        (size.active, "active") if size.active != size.total else (size.total, "total")
    )
    return size


def preset_size(name: str) -> ModelSize:
    """model_size of a preset."""
    return model_size(load_config(preset=name))


def preset_info(name: str) -> PresetInfo:
    cfg = load_config(preset=name)
    size = model_size(cfg)
    description = read_yaml(PRESET_DIR / f"{name}.yaml").get("description", "")
    return PresetInfo(
        name=name,
        family=size.family,
        total=size.total,
        active=size.active,
        flops_per_token=size.flops_per_token,
        description=description,
    )


def preset_catalog() -> list[PresetInfo]:
    """Every preset, smallest total first (name breaks ties)."""
    return sorted(map(preset_info, available_presets()), key=lambda p: (p.total, p.name))


def human_count(n: float) -> str:
    """1_100_048_384 -> '1.10B', 557_088 -> '557K': three significant digits."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{unit}"
    return str(int(n))


def format_catalog(rows: list[PresetInfo]) -> str:
    """The `trimtab presets` table: one line per preset, description last (it is the long one)."""
    width = max(len("preset"), *(len(r.name) for r in rows))
    lines = [f"{'preset':{width}s}  {'family':6s}  {'params':>6s}  {'active':>6s}  {'GFLOP/tok':>9s}  description"]
    for r in rows:
        gflop = r.flops_per_token / 1e9
        size = f"{human_count(r.total):>6s}  {human_count(r.active):>6s}"
        lines.append(f"{r.name:{width}s}  {r.family:6s}  {size}  {gflop:9.{3 if gflop < 10 else 1}f}  {r.description}")
    return "\n".join(lines)
