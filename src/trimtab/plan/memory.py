"""Memory per device and training time on the detected (or named) hardware, and the largest
micro-batch that fits a device (`trimtab doctor` suggests it): one estimate for both.

Model state, per parameter (trimtab keeps fp32 weights and lets autocast cast per op):
weights 4 bytes, gradients 4, AdamW's two fp32 moments 8: 16 bytes, the figure ZeRO
(Rajbhandari et al. 2020) gives for mixed-precision Adam. FSDP shards all three over the devices.

Activations saved for backward, per token of a micro-batch (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", count s*b*h*(34 + 5*a*s/h) bytes per layer
for GPT with dropout; adapted here to this model: no dropout, SDPA / FlashAttention (Dao et al.
2022), which keeps no s x s score matrix, so the 5as/h term is gone, SwiGLU and GQA):

    per layer   2h (the two RMSNorm inputs: the fp32 residual stream, 4 bytes each)
              + 3h + 2*h_kv (attention: norm output, q, k, v, SDPA output) at the activation width p
              + h + 3f (SwiGLU: norm output, w1 and w3 outputs, their gated product) at p
    MoE ffn     h + E + c*k*(h + 3*f_e) + 3*f_s (router logits, per routed copy its input and
                SwiGLU, c = max(1, capacity_factor) for the padded expert buffers, shared experts)
    MoD block   the attention and ffn terms times the layer's capacity (the tokens it processes)
    head        h (fp32, the final norm's input) + h (fp32, the gradient of its output, which the
                fused loss computes in the forward and keeps instead of any [N, V] logits)

p = 2 bytes under bf16 / fp16 autocast, 4 in fp32. With activation checkpointing only each
block's input (h, fp32) is kept, plus one block's activations while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimtab.config import RunConfig
from trimtab.errors import ConfigError
from trimtab.hardware import GPUS, choose_precision, datasheet_source, peak_flops, pick_device, ram_bytes
from trimtab.model.catalog import meta_model

STATE_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}  # per parameter
# What a micro-batch suggestion may fill: the CUDA context, the allocator's fragmentation and
# autocast's low-precision weight copies are not counted above (docs/planner.md: keep 10-20% free).
USABLE_FRACTION = 0.85


@dataclass(kw_only=True)
class Hardware:
    name: str
    kind: str  # cuda | cpu | mps
    precision: str  # fp32 | bf16 | fp16: the activation width the run would use
    peak_flops: float | None  # per device
    peak_source: str
    memory_bytes: int | None  # per device
    devices: int = 1


def named_gpu(name: str, devices: int = 1) -> Hardware:
    """A GPU from the datasheet table (e.g. "H100"), for planning on hardware not present."""
    key = next((k for k in GPUS if k.lower() == name.lower()), None)
    if key is None:
        raise ConfigError(f"unknown GPU '{name}'; one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    return Hardware(
        name=key,
        kind="cuda",
        precision=gpu.dtype,
        peak_flops=gpu.peak_flops,
        peak_source=datasheet_source(key),
        memory_bytes=gpu.memory_gb * 10**9,
        devices=devices,
    )


def detect_hardware(requested_precision: str = "auto", devices: int = 1) -> Hardware:
    """This machine's device, the precision a run would pick and its peak FLOP/s, as the trainer
    would see them (hardware.py; a CPU's peak is a matmul rate measured once, then cached)."""
    device = pick_device("auto")
    precision = choose_precision(device, requested_precision)
    peak, source = peak_flops(precision)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        name, memory = device.type.upper(), ram_bytes()
    return Hardware(
        name=name,
        kind=device.type,
        precision=precision.name,
        peak_flops=peak,
        peak_source=source,
        memory_bytes=memory,
        devices=devices,
    )


@dataclass(kw_only=True)
class MemoryPlan:
    weights: int  # bytes per device
    gradients: int
    optimizer: int
    activations: int  # one micro-batch of train.micro_batch_tokens
    total: int
    micro_batch_tokens: int
    activation_bytes: int  # p
    checkpointing: bool
    shards: int  # devices the model state is split over (FSDP), else 1
    device_memory: int | None
    fits: bool | None  # None: device memory unknown


def activation_elements(cfg: RunConfig) -> tuple[list[tuple[float, float]], float]:
    """Per token: each layer's (fp32 elements, activation-width elements), and the head's (all fp32)."""
    m = cfg.model
    h, kv = m.d_model, m.n_kv_heads * m.head_dim
    capacities = iter(m.mod_capacities)
    layers = []
    for kind in m.layers:
        attention = 3 * h + 2 * kv
        if "moe" in kind:
            moe, fe = m.moe, m.moe.expert_hidden
            slack = max(1.0, moe.capacity_factor)
            ffn = h + moe.n_experts + slack * moe.top_k * (h + 3 * fe) + 3 * moe.n_shared_experts * fe
        else:
            ffn = h + 3 * m.ffn_hidden
        share = next(capacities) if "mod" in kind else 1.0
        layers.append((2.0 * h, share * (attention + ffn)))
    return layers, 2.0 * h


def activation_width(precision: str) -> int:
    """p: bytes of an activation autocast leaves in low precision (bf16 / fp16: 2, fp32: 4)."""
    return 4 if precision == "fp32" else 2


def state_bytes(params: int, shards: int = 1) -> dict[str, int]:
    """Weights, gradients and AdamW moments per device, FSDP-sharded `shards` ways."""
    return {k: params * b // shards for k, b in STATE_BYTES.items()}


def activation_bytes_per_token(cfg: RunConfig, p: int, checkpointing: bool) -> float:
    """Bytes kept for backward per token of a micro-batch (the table in the module docstring)."""
    layers, head = activation_elements(cfg)
    per_layer = [4 * f32 + p * low for f32, low in layers]
    if checkpointing:
        kept = 4 * cfg.model.d_model * len(layers) + max(per_layer)
    else:
        kept = sum(per_layer)
    return kept + 4 * head


def memory_plan(cfg: RunConfig, params: int, hw: Hardware) -> MemoryPlan:
    precision = cfg.train.precision if cfg.train.precision != "auto" else hw.precision
    p = activation_width(precision)
    # FSDP shards the model state over the devices; DDP (and older configs without the section) replicates it.
    shards = hw.devices if getattr(getattr(cfg, "distributed", None), "data_parallel", "ddp") == "fsdp" else 1
    state = state_bytes(params, shards)
    tokens = cfg.train.micro_budget
    activations = round(tokens * activation_bytes_per_token(cfg, p, cfg.train.activation_checkpointing))
    total = sum(state.values()) + activations
    fits = None if hw.memory_bytes is None else total <= hw.memory_bytes
    return MemoryPlan(
        weights=state["weights"],
        gradients=state["gradients"],
        optimizer=state["optimizer"],
        activations=activations,
        total=total,
        micro_batch_tokens=tokens,
        activation_bytes=p,
        checkpointing=cfg.train.activation_checkpointing,
        shards=shards,
        device_memory=hw.memory_bytes,
        fits=fits,
    )


@dataclass
class MicroBatchAdvice:
    tokens: int  # the suggested train.micro_batch_tokens (a multiple of data.seq_len)
    fits: bool  # whether one row fits at all
    state_bytes: int  # weights, gradients and AdamW moments on this device
    bytes_per_token: float  # activations kept for backward, per token of a micro-batch
    memory_bytes: int  # the memory the estimate was given


def suggest_micro_batch(
    cfg: RunConfig,
    memory_bytes: int,
    precision: str,
    world: int = 1,
    sharded: bool = False,
    checkpointing: bool | None = None,
) -> MicroBatchAdvice:
    """The most whole rows whose memory_plan total fits in USABLE_FRACTION of `memory_bytes` per
    device (`trimtab doctor`'s suggestion; the OOM rule corrects it while training), capped at
    train.batch_tokens. `sharded`: FSDP over `world` devices."""
    ckpt = cfg.train.activation_checkpointing if checkpointing is None else checkpointing
    state = sum(state_bytes(meta_model(cfg).num_params(), world if sharded else 1).values())
    per_token = activation_bytes_per_token(cfg, activation_width(precision), ckpt)
    seq = cfg.data.seq_len
    usable = int(memory_bytes * USABLE_FRACTION) - state
    rows = int(usable // (per_token * seq)) if usable > 0 else 0
    tokens = max(min(rows * seq, cfg.train.batch_tokens // seq * seq), seq)
    return MicroBatchAdvice(tokens, rows >= 1, state, per_token, memory_bytes)


def hours(flops: float, hw: Hardware, mfu: float) -> float | None:
    """Wall-clock hours for `flops` at `mfu` of the devices' peak; None without a known peak."""
    if not hw.peak_flops:
        return None
    return flops / (hw.peak_flops * mfu * hw.devices) / 3600
