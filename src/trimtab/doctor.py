"""`trimtab doctor`: what this machine offers for training, and what the trainer will choose.

The choices come from the functions the trainer itself calls (hardware.py), so the report and a
run agree: device, precision and why, the peak FLOP/s behind MFU, attention kernel, fused AdamW,
data-parallel backends, and a micro-batch that should fit a preset in this device's memory (the
estimate `trimtab plan` prints, plan/memory.py).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

from trimtab.config import CHECKPOINTING
from trimtab.hardware import Precision, cpu_has_native_bf16, meminfo, pick_device
from trimtab.peaks import peak_flops
from trimtab.plan.memory import suggest_micro_batch

GiB = 2**30


def collect(
    preset: str = "small", device: str = "auto", nproc: int = 1, strategy: str = "ddp", sets: Sequence[str] = ()
) -> dict[str, Any]:
    """Every fact of the report as plain data (`trimtab doctor --json`); `sets`: --set items on the preset,
    as `trimtab train` takes them (e.g. train.precision=fp32, model.n_layers=48)."""
    from trimtab.config import load_config
    from trimtab.training.services.cpu_precision import run_precision

    dev = pick_device(device, key="--device")
    cfg = load_config(preset=preset, sets=list(sets))
    precision = run_precision(dev, cfg)
    memory = _memory(dev)
    micro = _micro_batch(cfg, preset, dev, precision, memory, nproc, strategy)
    peak, peak_source = peak_flops(precision)
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "platform": platform.platform(),
        },
        "device": _device(dev),
        "precision": {
            "choice": precision.name,
            "reason": precision.reason,
            "bf16": _bf16(dev),
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if dev.type == "cuda" else None,
            "peak_flops": peak,  # what a run's MFU divides by
            "peak_source": peak_source,
        },
        "attention": _attention(dev, cfg, precision.autocast_dtype or torch.float32),
        "fused_adamw": dev.type in ("cuda", "cpu"),  # optim.fused=auto takes it where it exists
        "memory": {k: None if v is None else round(v / GiB, 1) for k, v in memory.items()},
        "distributed": _distributed(dev),
        "micro_batch": micro,
        "layout": _layout(cfg, dev),
    }


def _micro_batch(
    cfg: Any, preset: str, dev: torch.device, precision: Precision, memory: dict, nproc: int, strategy: str
) -> dict[str, Any]:
    """The micro-batch suggested for each process's share of the memory, under each
    train.activation_checkpointing mode, and how many FSDP devices it needs when none fits."""
    per_process = memory["gpu_total"] if dev.type == "cuda" else (memory["ram_available"] or 0) // max(nproc, 1)
    modes = {
        mode: suggest_micro_batch(
            cfg,
            per_process,
            precision.name,
            world=nproc,
            sharded=strategy == "fsdp",
            checkpointing=mode,
            device=dev.type,
        )
        for mode in CHECKPOINTING
    }
    advice = modes[cfg.train.activation_checkpointing]
    micro = {
        "preset": preset,
        "tokens": advice.tokens,
        "fits": advice.fits,
        "configured": cfg.train.micro_batch_tokens,
        "per_process_memory_gb": round(per_process / GiB, 1),
        "state_gb": round(advice.state_bytes / GiB, 2),
        "activation_kb_per_token": round(advice.bytes_per_token / 1024, 1),
        "processes": nproc,
        "strategy": strategy,
        "checkpointing": cfg.train.activation_checkpointing,
        # the suggestion under each train.activation_checkpointing (0: not one row fits)
        "by_checkpointing": {mode: a.tokens if a.fits else 0 for mode, a in modes.items()},
    }
    if not advice.fits:
        micro["fsdp_devices_needed"] = _devices_needed(cfg, per_process, precision.name)
    return micro


def _layout(cfg: Any, dev: torch.device) -> dict[str, Any] | None:
    """`trimtab plan`'s parallel layout over this machine's GPUs (None without a GPU it knows)."""
    import dataclasses

    from trimtab.hardware import gpu_named
    from trimtab.plan.layout import plan_layout
    from trimtab.plan.layout_text import format_layout
    from trimtab.plan.memory import detect_hardware

    if dev.type != "cuda" or gpu_named(torch.cuda.get_device_name(dev)) is None:
        return None
    plan = plan_layout(cfg, detect_hardware(devices=torch.cuda.device_count()))
    return {**dataclasses.asdict(plan), "text": format_layout(plan, f"trimtab train --preset {cfg.preset}")}


def format_report(facts: dict[str, Any]) -> str:
    v, d, p, a, m, dist, mb = (
        facts[k] for k in ("versions", "device", "precision", "attention", "memory", "distributed", "micro_batch")
    )
    lines = [
        f"torch {v['torch']} (CUDA {v['cuda'] or 'none'}, cuDNN {v['cudnn'] or 'none'}), "
        f"Python {v['python']}, {v['platform']}",
        f"device: {d['name']} ({d['detail']})",
        f"precision: {p['choice']} - {p['reason']}",
        f"bf16: {'yes' if p['bf16']['supported'] else 'no'} ({p['bf16']['detail']})",
    ]
    if p["tf32"] is not None:
        lines.append(f"TF32 matmuls: {'on' if p['tf32'] else 'off'}")
    peak = f"{p['peak_flops'] / 1e12:.3g} TFLOP/s, " if p["peak_flops"] else ""
    lines.append(f"MFU reference: {peak}{p['peak_source']}")
    lines.append(
        f"attention: SDPA picks {a['backend']} for {a['shape']}; flash attention "
        f"{'available' if a['flash'] else 'not available'} ({a['detail']})"
    )
    lines.append(f"optimizer: AdamW {'fused (one kernel for all parameters)' if facts['fused_adamw'] else 'foreach'}")
    gpu = f", GPU {m['gpu_free']} GiB free of {m['gpu_total']}" if m["gpu_total"] else ""
    lines.append(f"memory: RAM {m['ram_available']} GiB available of {m['ram_total']}{gpu}")
    backends = ", ".join(k for k in ("nccl", "gloo", "mpi", "ucc") if dist[k]) or "none"
    lines.append(f"distributed: {backends} available; {dist['default']} would be used; launch with {dist['launch']}")
    lines.append(_micro_batch_line(mb))
    if facts["layout"]:
        lines += facts["layout"]["text"]
    else:
        lines.append(
            "parallel layout: needs a GPU of the datasheet table here; `trimtab plan --preset P --gpu H100 "
            "--gpus N` proposes one for any cluster"
        )
    return "\n".join(lines)


def _micro_batch_line(mb: dict[str, Any]) -> str:
    """The report's line on the micro-batch that fits (facts["micro_batch"]), or that one row does not."""
    sizes = (
        f"model state {mb['state_gb']} GiB per process, {mb['activation_kb_per_token']} KiB of "
        f"activations per token, {mb['per_process_memory_gb']} GiB per process"
    )
    modes = ", ".join(f"{m} {t:,}" if t else f"{m} none" for m, t in mb["by_checkpointing"].items())
    differ = len(set(mb["by_checkpointing"].values())) > 1  # the same: each capped at the step
    others = f"; by train.activation_checkpointing: {modes} tokens" if differ else ""
    if mb["fits"]:
        configured = f"{mb['configured']:,}" if mb["configured"] else "0 (auto: the whole step, halved on OOM)"
        return (
            f"micro-batch for preset '{mb['preset']}': ~{mb['tokens']:,} tokens ({sizes}, checkpointing "
            f"{mb['checkpointing']}; the preset sets {configured}) -> --set train.micro_batch_tokens={mb['tokens']}"
            + others
        )
    need = mb.get("fsdp_devices_needed")
    return (
        f"micro-batch for preset '{mb['preset']}': one row of {mb['tokens']:,} tokens does NOT fit "
        f"({sizes}, checkpointing {mb['checkpointing']})"
        + (f"; FSDP over {need} such devices would (distributed.strategy=fsdp)" if need else "")
        + others
    )


def _device(dev: torch.device) -> dict[str, Any]:
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return {
            "name": "cuda",
            "count": torch.cuda.device_count(),
            "detail": f"{torch.cuda.device_count()} x {props.name}, compute capability {props.major}.{props.minor}",
        }
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if dev.type == "mps":
        return {"name": "mps", "count": 1, "detail": f"Apple GPU, {cores} CPU cores"}
    return {
        "name": "cpu",
        "count": 1,
        "detail": f"{torch.backends.cpu.get_cpu_capability()}, {cores} cores, {torch.get_num_threads()} torch threads",
    }


def _bf16(dev: torch.device) -> dict[str, Any]:
    if dev.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return {"supported": ok, "detail": "native (Ampere+)" if ok else "pre-Ampere GPU: fp16 + GradScaler instead"}
    if dev.type == "mps":
        return {"supported": False, "detail": "MPS trains in fp16 autocast"}
    native = cpu_has_native_bf16()
    return {
        "supported": native,
        "detail": "native CPU instructions (AVX512-BF16 / AMX)" if native else "emulated on this CPU, slower than fp32",
    }


def _attention(dev: torch.device, cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The SDPA kernel PyTorch picks for the preset's causal attention, asked with small tensors."""
    from torch.nn.attention import SDPBackend

    heads, head_dim = cfg.model.n_heads, cfg.model.head_dim
    shape = f"{heads} heads x {head_dim} dims, {str(dtype).removeprefix('torch.')}, causal"
    q = torch.zeros(1, heads, 128, head_dim, device=dev, dtype=dtype)
    try:
        backend = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name.lower()
    except (RuntimeError, ValueError):  # e.g. MPS: not exposed
        backend = "unknown"
    if dev.type == "cuda":
        flash = torch.backends.cuda.is_flash_attention_available() and torch.backends.cuda.flash_sdp_enabled()
        detail = "CUDA kernels: flash, memory-efficient, cuDNN, math"
    else:
        flash = backend == "flash_attention"
        detail = "CPU: a fused flash-attention kernel for fp32/bf16" if dev.type == "cpu" else "MPS kernels"
    return {"backend": backend, "flash": flash, "shape": shape, "detail": detail}


def _memory(dev: torch.device) -> dict[str, int | None]:
    info = meminfo()
    total = info.get("MemTotal") or (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    )
    out = {"ram_total": total, "ram_available": info.get("MemAvailable", total), "gpu_total": None, "gpu_free": None}
    if dev.type == "cuda":
        out["gpu_free"], out["gpu_total"] = torch.cuda.mem_get_info(dev)
    return out


def _distributed(dev: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    ok = dist.is_available()
    found = {
        "nccl": ok and dist.is_nccl_available(),
        "gloo": ok and dist.is_gloo_available(),
        "mpi": ok and dist.is_mpi_available(),
        "ucc": ok and getattr(dist, "is_ucc_available", lambda: False)(),
    }
    n = torch.cuda.device_count() if dev.type == "cuda" else 2
    return {
        **found,
        "default": "nccl" if dev.type == "cuda" else "gloo",
        "launch": f"torchrun --nproc_per_node {n} -m trimtab train ... (docs/distributed.md)",
    }


def _devices_needed(cfg: Any, memory: int, precision: str) -> int | None:
    """The fewest devices (a power of two, up to 1024) over which FSDP fits one row per device."""
    for world in (2**i for i in range(1, 11)):
        if suggest_micro_batch(cfg, memory, precision, world=world, sharded=True).fits:
            return world
    return None


def main(preset: str, device: str, nproc: int, strategy: str, as_json: bool, sets: Sequence[str] = ()) -> int:
    import json

    facts = collect(preset, device, nproc, strategy, sets)
    print(json.dumps(facts, indent=1) if as_json else format_report(facts), file=sys.stdout)
    return 0
