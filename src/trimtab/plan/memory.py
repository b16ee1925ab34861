"""Memory per device and training time on the detected (or named) hardware, and the largest
micro-batch that fits a device (`trimtab doctor` suggests it): one estimate for both.

Model state, per parameter (trimtab keeps fp32 weights and lets autocast cast per op):
weights 4 bytes, gradients 4, AdamW's two fp32 moments 8: 16 bytes, the figure ZeRO
(Rajbhandari et al. 2020) gives for mixed-precision Adam. FSDP shards all three over the devices.
Under bf16 / fp16 autocast with whole fp32 weights (not FSDP, whose gathered weights are already
bf16), autocast keeps a low-precision copy of each matmul weight through the forward and its
backward keeps them: 2 bytes per non-embedding parameter.

Activations saved for backward, in bytes per token of a micro-batch. Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") count s*b*h*(34 + 5*a*s/h) for
GPT with dropout; this model has no dropout and SDPA / FlashAttention (Dao et al. 2022) keeps no
s x s scores, so what is left is counted tensor by tensor as autograd saves them here (measured
with saved_tensors_hooks: tests/test_plan.py holds the count to it):

    norm        4h + 4: its fp32 input and 1/rms (torch's fused RMSNorm, as on CUDA; on a CPU
                torch's composite keeps x/rms too, another 4h)
    attention   norm + p*(3h + 2*h_kv) + 4*H: the norm output cast for qkv; q and k rotated; v
                (copied out of the projection's output, which a view would keep whole); SDPA's
                output (the o input is a view of it); SDPA's fp32 log-sum-exp per head
    SwiGLU      norm + p*(h + 3f): the norm output, cast once for w1 and w3; w1's and w3's outputs
                (silu(w1 x) is computed again in the backward: model/layers.py's SiluMul), the
                product
    MoE ffn     norm + 4h + 4E + 12k (the router in fp32: its input, logits, top-k indices and
                weights) + k*(2p*h + 3p*f_e + 16) (per routed copy: its input, its SwiGLU, the
                copy the combine keeps, two indices: model/moe.py's Unpermute keeps no copy of the
                expert's output, which torch's index_copy would; a capacity factor drops
                copies, never adds any: the grouped layout keeps no padding) + p*(h + 3*f_s) for
                the shared experts (+ p*h + 6 under Qwen2-MoE's gate, which multiplies their
                output; computed in fp32 on the router's input, it keeps no other copy)
    MoD block   the attention and ffn terms times the layer's capacity (the tokens it processes),
                + 4h + 64 for every token: the router's input (cast once, the predictor reads the
                same copy), the gate and the scatter of the update (measured at h = 96-384; the
                chosen tokens are taken by indexing, which keeps the index where gather kept x)
    head        norm (the final one) + 4h (the gradient of its output, which the fused loss
                computes in the forward and keeps instead of any [N, V] logits) + 8 (the token id)

h = d_model, h_kv = kv heads x head dim, H heads, f = ffn_hidden, f_e = expert_hidden, f_s =
n_shared_experts x f_e, E experts, k = top_k; p = 2 bytes under bf16 / fp16 autocast, 4 in fp32.

train.activation_checkpointing (model/recompute.py) changes what a layer keeps:

    full        its input (4h, fp32), plus one block's activations above while it runs again
    selective   its input (4h) and its matmuls' and attention's outputs, but for the block's
                last projection, which only joins the residual stream (no backward reads it):
                attention  p*(h + 2*h_kv) (qkv) + p*h + 4*H (SDPA's output and log-sum-exp) + p*h (o)
                SwiGLU     p*2f: w1's and w3's outputs
                MoE ffn    4E (router logits) + 28k (top-k values and indices, the sort of the
                           assignments) + k*p*(2f_e + h) (the grouped matmuls) + p*2f_s for the
                           shared experts (+ p*h under Qwen2-MoE's shared gate, which reads it)
                MoD block  4h + capacity x (the rest, with the last projections: the router's gate
                           multiplies them) + 16 (the router's top-k)
                plus, while one block runs again, what it keeps under off less the above
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimtab.config import CHECKPOINTING, RunConfig
from trimtab.errors import ConfigError
from trimtab.hardware import GPUS, Precision, choose_precision, datasheet_source, pick_device, ram_bytes
from trimtab.model.catalog import family, human_count, meta_model
from trimtab.peaks import peak_flops

STATE_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}  # per parameter
# What a micro-batch suggestion may fill: the CUDA context, the allocator's fragmentation and the
# fused loss's chunk of logits are not counted above (docs/planner.md: keep 10-20% free).
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
    precision_source: str = ""  # why that precision: a CPU's may come from timing the model's step


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


def detect_hardware(
    requested_precision: str = "auto", devices: int = 1, precision: Precision | None = None
) -> Hardware:
    """This machine's device, the precision a run would pick and its peak FLOP/s, as the trainer
    would see them (hardware.py; a CPU's peak is a matmul rate measured once, then cached).
    `precision`: what a run of the config trains in, where the caller has asked (on a CPU with
    native bf16 the model's own step decides: training/services/cpu_precision.py, which plan does
    not import); else the hardware's choice alone."""
    device = pick_device("auto")
    precision = precision or choose_precision(device, requested_precision)
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
        precision_source=precision.reason,
    )


@dataclass(kw_only=True)
class MemoryPlan:
    weights: int  # bytes per device
    gradients: int
    optimizer: int
    activations: int  # one micro-batch of train.micro_batch_tokens
    casts: int  # autocast's low-precision copies of the weights (module docstring)
    total: int
    micro_batch_tokens: int
    activation_bytes: int  # p
    checkpointing: str  # off | selective | full
    shards: int  # devices the model state is split over (FSDP), else 1
    device_memory: int | None
    fits: bool | None  # None: device memory unknown


def activation_bytes(cfg: RunConfig, p: int, fused_norm: bool = True) -> tuple[list[float], float]:
    """Bytes saved for backward per token: each layer's, and the head's (the module docstring's
    table). `fused_norm`: torch's RMSNorm kernel (CUDA), else its composite (a CPU: x/rms kept)."""
    m = cfg.model
    h, kv, heads = m.d_model, m.n_kv_heads * m.head_dim, m.n_heads
    norm = (4 if fused_norm else 8) * h + 4

    def swiglu(f: float) -> float:
        return p * (h + 3 * f)

    capacities = iter(m.mod_capacities)
    layers = []
    for kind in m.layers:
        attention = norm + p * (3 * h + 2 * kv) + 4 * heads
        if "moe" in kind:
            moe, fe = m.moe, m.moe.expert_hidden
            routed = moe.top_k * (2 * p * h + 3 * p * fe + 16)
            ffn = norm + 4 * h + 4 * moe.n_experts + 12 * moe.top_k + routed
            ffn += swiglu(moe.n_shared_experts * fe) if moe.n_shared_experts else 0
            ffn += p * h + 6 if moe.shared_gate else 0  # the shared output and the gate, which multiply
        else:
            ffn = norm + swiglu(m.ffn_hidden)
        if "mod" in kind:
            layers.append(next(capacities) * (attention + ffn) + 4 * h + 64)
        else:
            layers.append(attention + ffn)
    return layers, norm + 4 * h + 8


def activation_width(precision: str) -> int:
    """p: bytes of an activation autocast leaves in low precision (bf16 / fp16: 2, fp32: 4)."""
    return 4 if precision == "fp32" else 2


def state_bytes(params: int, shards: int = 1) -> dict[str, int]:
    """Weights, gradients and AdamW moments per device, FSDP-sharded `shards` ways."""
    return {k: params * b // shards for k, b in STATE_BYTES.items()}


def selective_bytes(cfg: RunConfig, p: int) -> list[float]:
    """Bytes per token each layer keeps under selective checkpointing (model/recompute.py; the
    module docstring's second table)."""
    m = cfg.model
    h, kv, heads = m.d_model, m.n_kv_heads * m.head_dim, m.n_heads
    attention = 4 * h + p * (h + 2 * kv) + p * h + 4 * heads + p * h
    capacities = iter(m.mod_capacities)
    layers = []
    for kind in m.layers:
        last = p * h  # the ffn's last projection (combine, shared experts' w2): kept inside MoD only
        if "moe" in kind:
            moe, fe, fs = m.moe, m.moe.expert_hidden, m.moe.n_shared_experts * m.moe.expert_hidden
            ffn = 4 * moe.n_experts + 28 * moe.top_k + moe.top_k * p * (2 * fe + h)
            ffn += p * (2 * fs + (h if moe.shared_gate else 0)) if fs else 0
            last += p * h if fs and not moe.shared_gate else 0
        else:
            ffn = p * 2 * m.ffn_hidden
        if "mod" in kind:
            layers.append(4 * h + next(capacities) * (attention - 4 * h + ffn + last) + 16)
        else:
            layers.append(attention + ffn)
    return layers


def activation_bytes_per_token(cfg: RunConfig, p: int, checkpointing: str, fused_norm: bool = True) -> float:
    """Bytes kept for backward per token of a micro-batch at the activations' peak (the tables in
    the module docstring), under train.activation_checkpointing's `checkpointing`."""
    return sum(kept_bytes_per_token(cfg, p, checkpointing, fused_norm))


def kept_bytes_per_token(cfg: RunConfig, p: int, checkpointing: str, fused_norm: bool = True) -> tuple[float, float]:
    """(bytes per token the forward leaves for the backward, what one block computes again in it
    on top): off keeps everything and recomputes nothing; full keeps each block's input and runs
    a block's forward again; selective keeps its outputs of model/recompute.py and recomputes the
    rest of a block."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    layers, head = activation_bytes(cfg, p, fused_norm)
    if checkpointing == "full":
        return 4 * cfg.model.d_model * len(layers) + head, max(layers)
    if checkpointing == "selective":
        kept = selective_bytes(cfg, p)
        return sum(kept) + head, max(max(a - k, 0) for a, k in zip(layers, kept, strict=True))
    return sum(layers) + head, 0.0


def whole_bytes(cfg: RunConfig, p: int, checkpointing: str, fused_norm: bool = True) -> tuple[float, float]:
    """Of kept_bytes_per_token's two parts, the bytes per token every tensor-parallel rank keeps
    whole (not divided by tp). torch's sequence parallelism gathers a block's normed input over
    the sequence and the matmuls keep the gathered copy (autocast's cast of it), where Megatron-LM
    keeps the shard and gathers again in the backward (Korthikanti et al. 2022, eq. 5); a
    row-parallel matmul's output, which selective checkpointing keeps, is the whole sequence's
    partial sum; the loss's gradient of its input is whole; MoE layers route every token on
    every rank. Mixture-of-Depths blocks run on the whole sequence (distributed/tensor.py): their
    norms, router and the matmuls' inputs are whole, their heads and hidden units split as any
    block's. Checkpointed, the block inputs are sharded, and a block that runs again holds its
    share under off meanwhile."""
    off = _whole_layers(cfg, p, "off", fused_norm)
    head = 4 * cfg.model.d_model + 8
    if checkpointing == "off":
        return sum(off) + head, 0.0
    if checkpointing == "full":
        return head, max(off)
    kept = _whole_layers(cfg, p, "selective", fused_norm)
    return sum(kept) + head, max(o - k for o, k in zip(off, kept, strict=True))


def _whole_layers(cfg: RunConfig, p: int, mode: str, fused_norm: bool = True) -> list[float]:
    """Each layer's whole bytes per token (whole_bytes) under off or selective."""
    m, moe = cfg.model, cfg.model.moe
    h, k = m.d_model, moe.top_k
    norm = (4 if fused_norm else 8) * h + 4
    shared = p * h if moe.n_shared_experts else 0  # off: its input's cast; the w2 output its gate reads
    shared += p * h if moe.shared_gate else 0
    # a MoE ffn's whole part: off, the router's input, the routed copies' and the combine's;
    # selective, the router's and the grouped w2's (the shared w2's under its gate)
    moe_off = 4 * h + 4 * moe.n_experts + 12 * k + k * (2 * p * h + 16) + shared
    moe_kept = 4 * moe.n_experts + 28 * k + k * p * h + (p * h if moe.shared_gate else 0)
    capacities = iter(m.mod_capacities)
    whole = []
    for kind in m.layers:
        ffn_off, ffn_kept = (moe_off, moe_kept) if "moe" in kind else (p * h, 0)
        if "mod" in kind and mode == "off":  # both norms and the casts of their outputs; the router's 4h + 64
            whole.append(next(capacities) * (2 * norm + p * h + ffn_off) + 4 * h + 64)
        elif "mod" in kind:  # wo's and the ffn's last outputs, all-reduced; the router's input and top-k
            last = p * h + (p * h if "moe" in kind and moe.n_shared_experts and not moe.shared_gate else 0)
            whole.append(4 * h + 16 + next(capacities) * (p * h + ffn_kept + last))
        elif mode == "off":  # qkv's input cast, and the ffn's (dense: once for w1 and w3)
            whole.append(p * h + ffn_off)
        else:  # wo's output, and the MoE's
            whole.append(p * h + ffn_kept)
    return whole


def kept_bytes_per_rank(
    cfg: RunConfig, p: int, checkpointing: str, tp: int, fused_norm: bool = True
) -> tuple[float, float]:
    """kept_bytes_per_token on one of tp tensor-parallel ranks: what sequence parallelism
    splits, / tp, and what every rank keeps whole (whole_bytes) as it is."""
    parts = kept_bytes_per_token(cfg, p, checkpointing, fused_norm)
    if tp == 1:
        return parts
    whole = whole_bytes(cfg, p, checkpointing, fused_norm)
    kept, again = ((all_ - w) / tp + w for all_, w in zip(parts, whole, strict=True))
    return kept, again


def weight_casts(matmul_params: int, p: int, shards: int) -> int:
    """Autocast's copies of whole fp32 weights in low precision (module docstring); none in fp32
    or under FSDP."""
    return 2 * matmul_params if p == 2 and shards == 1 else 0


def memory_plan(cfg: RunConfig, params: int, hw: Hardware, matmul_params: int) -> MemoryPlan:
    """Per device; `matmul_params`: the non-embedding parameters autocast casts (as
    suggest_micro_batch counts them: one estimate for both)."""
    precision = cfg.train.precision if cfg.train.precision != "auto" else hw.precision
    p = activation_width(precision)
    # FSDP shards the model state over the devices; DDP (and older configs without the section) replicates it.
    shards = hw.devices if getattr(getattr(cfg, "distributed", None), "data_parallel", "ddp") == "fsdp" else 1
    state = state_bytes(params, shards)
    casts = weight_casts(matmul_params, p, shards)
    tokens = cfg.train.micro_budget
    per_token = activation_bytes_per_token(cfg, p, cfg.train.activation_checkpointing, fused_norm=hw.kind != "cpu")
    activations = round(tokens * per_token)
    total = sum(state.values()) + casts + activations
    fits = None if hw.memory_bytes is None else total <= hw.memory_bytes
    return MemoryPlan(
        weights=state["weights"],
        gradients=state["gradients"],
        optimizer=state["optimizer"],
        activations=activations,
        casts=casts,
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


_COUNTS: dict[str, tuple[int, int]] = {}


def _param_counts(cfg: RunConfig) -> tuple[int, int]:
    """(all, non-embedding) parameters of cfg's model, counted once per model: `trimtab doctor`
    asks for a dozen suggestions of one model (each checkpointing mode, each FSDP width) and a
    meta build of the 2.4T preset takes ~0.5 s."""
    key = repr((cfg.model, cfg.data.bpe_vocab_size))
    if key not in _COUNTS:
        model = meta_model(cfg)
        _COUNTS[key] = model.num_params(), model.num_params(exclude_embeddings=True)
    return _COUNTS[key]


def suggest_micro_batch(
    cfg: RunConfig,
    memory_bytes: int,
    precision: str,
    world: int = 1,
    sharded: bool = False,
    checkpointing: str | None = None,
    device: str = "cuda",
) -> MicroBatchAdvice:
    """The most whole rows whose memory_plan total fits in USABLE_FRACTION of `memory_bytes` per
    device (`trimtab doctor`'s suggestion; the OOM rule corrects it while training), capped at
    train.batch_tokens. `sharded`: FSDP over `world` devices; `device`: its type."""
    ckpt = cfg.train.activation_checkpointing if checkpointing is None else checkpointing
    (params, non_embedding), p, shards = _param_counts(cfg), activation_width(precision), world if sharded else 1
    state = sum(state_bytes(params, shards).values()) + weight_casts(non_embedding, p, shards)
    per_token = activation_bytes_per_token(cfg, p, ckpt, fused_norm=device != "cpu")
    seq = cfg.data.seq_len
    usable = int(memory_bytes * USABLE_FRACTION) - state
    rows = int(usable // (per_token * seq)) if usable > 0 else 0
    tokens = max(min(rows * seq, cfg.train.batch_tokens // seq * seq), seq)
    return MicroBatchAdvice(tokens, rows >= 1, state, per_token, memory_bytes)


# The trainer's MFU in bf16 (BENCHMARKS.md, bench/gpu.py; the H100 SXM and the H200 share a 989
# TFLOP/s dense peak): dense-1b 45.8% eager on an H100 (2026-11-26) and 55.2% compiled block by block
# on an H200 (2026-12-04); two moe-7b layers without recompute on the H200 (2026-12-04) 30.8% eager
# and 34.0% compiled (RECOMPUTE counts activation checkpointing apart: plan/layout.py).
MEASURED_MFU = {("dense", False): 0.46, ("dense", True): 0.55, ("moe", False): 0.31, ("moe", True): 0.34}
MEASURED_CARD = {("dense", False): "an H100"}  # the others: an H200
DEFAULT_MFU = 0.4  # hardware trimtab was not measured on: PaLM's 46% less a margin (Chowdhery et al. 2022)
# The trainer's eager fp32 MFU on one thread of a Xeon CPU, 100 steps of the debug presets (2026-12-02):
# debug 7.4%, debug-moe 5.2% of the cached matmul peak. Small matmuls, the optimizer and the data loader
# weigh far more against a CPU's peak than a GPU's: at DEFAULT_MFU a plan said 8 min for a 46 min run.
CPU_MFU = {"dense": 0.07, "moe": 0.05}


# The measured kind a model family borrows, and the model it was measured on (on a GPU; on a CPU
# the debug presets): a MoD block is a dense block on fewer tokens and a hybrid's MoE layers carry
# its dispatch overhead. Neither is measured itself.
MEASURED_AS = {"dense": "dense", "moe": "moe", "mod": "dense", "hybrid": "moe"}
MEASURED_ON = {"cuda": {"dense": "dense-1b", "moe": "moe-7b"}, "cpu": {"dense": "debug", "moe": "debug-moe"}}


def assumed_mfu(cfg: RunConfig, hw: Hardware) -> tuple[float, str]:
    """The MFU time estimates assume, and whence: plan.mfu when set; on a GPU the trainer's own,
    measured for a dense or a MoE model, eager or compiled (train.compile true); on a CPU its own
    on one (CPU_MFU), said as the rough guess it is; else DEFAULT_MFU, said as assumed. The source
    names the preset measured and this model's own size and family, which may differ far."""
    if cfg.plan.mfu:
        return cfg.plan.mfu, "plan.mfu"
    fam = family(cfg.model)
    kind = MEASURED_AS[fam]
    this = f"taken for this {human_count(_param_counts(cfg)[0])}-parameter {fam} model"
    if hw.kind == "cpu":
        return CPU_MFU[kind], (
            f"ASSUMED, the trainer's on a 1-thread Xeon for the {MEASURED_ON['cpu'][kind]} preset, {this}; "
            "a CPU's varies several-fold with its cores, load and model: set plan.mfu, "
            "or plan again after a run of this config (its summary.json's)"
        )
    if hw.kind != "cuda":
        return DEFAULT_MFU, "ASSUMED (not measured on this device): set plan.mfu"
    compiled = cfg.train.compile == "true"
    mode = "compiled" if compiled else "eager"
    return MEASURED_MFU[kind, compiled], (
        f"the trainer's, {mode} {kind}, on {MEASURED_CARD.get((kind, compiled), 'an H200')} "
        f"({MEASURED_ON['cuda'][kind]}), {this}"
    )


def run_mfu(cfg: RunConfig, hw: Hardware, params: int) -> tuple[float, str] | None:
    """The MFU a run of this config measured (RUN_DIR/summary.json's, the config's run directory) on
    this kind of device, in this precision, of a model of `params` parameters; None when there is
    none. plan.mfu, when set, wins. The run's MFU counts activation checkpointing's recompute already."""
    from trimtab.rundir import read_summary

    summary = read_summary(cfg.run_dir)
    if cfg.plan.mfu or summary is None:
        return None
    mfu = summary.get("mfu")
    same = (summary.get("device"), summary.get("precision"), summary.get("params")) == (hw.kind, hw.precision, params)
    if not same or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        return None
    return float(mfu), f"measured by the run in {cfg.run_dir} (summary.json, step {summary.get('step')})"


def hours(flops: float, hw: Hardware, mfu: float) -> float | None:
    """Wall-clock hours for `flops` at `mfu` of the devices' peak; None without a known peak."""
    if not hw.peak_flops:
        return None
    return flops / (hw.peak_flops * mfu * hw.devices) / 3600
