"""What this machine offers for training: device and mixed-precision choice (with the reason
written down for the user), and the peak FLOP/s that MFU is measured against.

CUDA: bf16 autocast where the GPU supports it (Ampere+), else fp16 with a GradScaler.
MPS: fp16 autocast. CPU: fp32, unless the CPU has native bf16 (AVX512-BF16 / AMX) and a quick
matmul measurement shows bf16 is faster; on CPUs without it, bf16 is emulated and slower. The
trainer then times the model's own step before keeping bf16 (training/cpu_precision.py).

The trainer, `trimtab doctor` and `trimtab plan` all ask here, so they agree. One GPU table
serves MFU and the planner's memory check. A CPU has no datasheet here: its peak is a matmul rate
measured once (best of several) and cached in $TRIMTAB_CACHE/cpu_peak.json.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trimtab.errors import ConfigError
from trimtab.paths import cache_dir

log = logging.getLogger(__name__)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    device: torch.device
    name: str  # fp32 | bf16 | fp16
    reason: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        # bf16 has fp32's exponent range; only fp16 needs loss scaling.
        if self.name == "fp16":
            return torch.amp.GradScaler(self.device.type)
        return None


def pick_device(name: str) -> torch.device:
    if name != "auto":
        if name == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use auto or cpu")
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    return (
        torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
        or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def choose_precision(device: torch.device, requested: str) -> Precision:
    if requested != "auto":
        return Precision(device, requested, f"train.precision={requested} (set in config)")
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            # Ampere+: the fp32 matmuls autocast leaves run on TF32 tensor cores (10-bit mantissa,
            # fp32 range), as nanoGPT / torchtitan do; PyTorch's default is exact fp32.
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if torch.cuda.is_bf16_supported():
            return Precision(device, "bf16", "CUDA device supports bf16 (Ampere+: TF32 for fp32 matmuls)")
        return Precision(device, "fp16", "CUDA device without bf16 (pre-Ampere): fp16 + GradScaler")
    if device.type == "mps":
        return Precision(device, "fp16", "Apple MPS: fp16 autocast")
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_has_native_bf16():
        return Precision(device, "fp32", f"CPU ({capability}) has no native bf16: fp32 is fastest")
    fp32, bf16 = _matmul_seconds(torch.float32), _matmul_seconds(torch.bfloat16)
    if bf16 < fp32:
        # a run then keeps bf16 only if its model's step is faster too (training/cpu_precision.py)
        return Precision(device, "bf16", f"CPU ({capability}) bf16 matmul measured {fp32 / bf16:.1f}x faster")
    return Precision(device, "fp32", f"CPU ({capability}) bf16 measured no faster than fp32")


def _matmul_seconds(dtype: torch.dtype, n: int = 1024, reps: int = 3) -> float:
    """Best time of `reps` n x n matmuls: the best is the least disturbed by other load."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Gpu:
    peak_flops: float  # dense tensor-core FLOP/s (no sparsity), per GPU
    memory_gb: int  # the largest memory variant, GB (10^9 bytes)
    link: float  # GPU-to-GPU bandwidth inside a node, bytes/s each way (NVLink, else PCIe)
    dtype: str = "bf16"  # what peak_flops is for: pre-Ampere GPUs have no bf16, their fp16 figure


# Vendor datasheets: NVIDIA H200, H100, A100, L40S, A10, L4, V100 and T4 product sheets (SXM
# figures where there are several); the Ada (RTX 4090) and Ampere GA102 (RTX 3090) whitepapers,
# bf16 with fp32 accumulate. Device names are matched by substring in this order, so a longer key
# comes before its prefix (A100 before A10, L40S before L4).
# Links: NVLink 4 (H100, H200 SXM) 900 GB/s both ways, NVLink 3 (A100 SXM) 600, NVLink 2
# (V100 SXM2) 300; the others talk over PCIe 4.0 x16 (32 GB/s each way; T4: PCIe 3.0, 16).
GPUS = {
    "H200": Gpu(989e12, 141, 450e9),
    "H100": Gpu(989e12, 80, 450e9),
    "A100": Gpu(312e12, 80, 300e9),
    "L40S": Gpu(362e12, 48, 32e9),
    "A10": Gpu(125e12, 24, 32e9),
    "L4": Gpu(121e12, 24, 32e9),
    "4090": Gpu(165e12, 24, 32e9),
    "3090": Gpu(71e12, 24, 32e9),
    "V100": Gpu(125e12, 32, 150e9, "fp16"),
    "T4": Gpu(65e12, 16, 16e9, "fp16"),
}


def gpu_named(device_name: str) -> tuple[str, Gpu] | None:
    """The table's entry for a CUDA device name such as "NVIDIA H100 80GB HBM3"."""
    return next(((key, gpu) for key, gpu in GPUS.items() if key in device_name), None)


def datasheet_source(key: str) -> str:
    return f"{key} datasheet (dense {GPUS[key].dtype})"


def peak_flops(precision: Precision) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU and where the number comes from: a GPU's datasheet, or the CPU's
    cached matmul peak (cpu_peak_flops)."""
    if precision.device.type == "cuda":
        name = torch.cuda.get_device_name(precision.device)
        found = gpu_named(name)
        if found is None:
            return None, f"{name}: not in hardware.GPUS, peak unknown"
        return found[1].peak_flops, datasheet_source(found[0])
    if precision.device.type == "cpu":
        return cpu_peak_flops(precision.name)
    return None, f"{precision.device.type}: peak unknown"


# ------------------------------------------------------------------------- the CPU's peak, cached

CPU_PEAK_N = 2048  # large enough for the BLAS to reach its steady rate
# A peak is a maximum: other load (a busy second core) only slows a matmul down, so the best of
# many is the nearest to it. Measured once per key, a few seconds, not at every start: a peak
# re-measured on a loaded machine came out low and a run reported 400% MFU.
CPU_PEAK_REPS = 10


def cpu_peak_flops(precision: str) -> tuple[float | None, str]:
    """The CPU's matmul FLOP/s at `precision` (fp32 | bf16) and this torch thread count: measured
    the first time it is asked for, then read from cpu_peak_path()."""
    if precision == "fp16":
        return None, "CPU fp16 is emulated: no peak"
    if precision == "bf16" and not cpu_has_native_bf16():
        # emulated: ~0.2 GFLOP/s measured on an AVX2 EPYC, a minute per 2048^3 matmul
        return None, "CPU bf16 is emulated on this CPU: no peak"
    entry = _read_peaks().get(cpu_peak_key(precision)) or measure_cpu_peak(precision)
    return entry["flops"], (
        f"CPU matmul peak measured {entry['measured']} (cached, {entry['threads']} thread"
        f"{'s' if entry['threads'] != 1 else ''} {entry['precision']}, best of {entry['reps']})"
    )


def measure_cpu_peak(precision: str) -> dict[str, Any]:
    """Time the matmul now and record it. Returns the cache's entry, which keeps the highest
    rate ever measured for the key (another process may have recorded a higher one meanwhile)."""
    log.info("measuring the CPU matmul peak for MFU (once; cached in %s)", cpu_peak_path())
    seconds = _matmul_seconds(DTYPES[precision] or torch.float32, CPU_PEAK_N, CPU_PEAK_REPS)
    entry = {
        "flops": 2 * CPU_PEAK_N**3 / seconds,
        "measured": datetime.date.today().isoformat(),
        "reps": CPU_PEAK_REPS,
        "threads": torch.get_num_threads(),
        "precision": precision,
    }
    return _keep_max(cpu_peak_key(precision), entry)


def cpu_peak_key(precision: str) -> str:
    """What the peak depends on: the CPU, the BLAS torch ships, its thread count, the dtype."""
    return f"{cpu_model()} | torch {torch.__version__} | threads {torch.get_num_threads()} | {precision}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_peak_path() -> Path:
    return cache_dir() / "cpu_peak.json"


def read_cache(path: Path) -> dict[str, Any]:
    """A JSON object cached in `path`; a missing or corrupt file reads as empty (and is rewritten
    by the next measurement)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically (a reader sees the old file or the new one); a read-only cache
    costs a re-measurement next time, not the run."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write the cache %s: %s", path, exc)


def _read_peaks() -> dict[str, dict[str, Any]]:
    """The peak cache's well-formed entries."""
    return {k: v for k, v in read_cache(cpu_peak_path()).items() if _valid(v)}


def _valid(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("flops"), (int, float))
        and 0 < entry["flops"] < math.inf
        and {"measured", "reps", "threads", "precision"} <= entry.keys()
    )


def _keep_max(key: str, entry: dict[str, Any]) -> dict[str, Any]:
    peaks = _read_peaks()  # read again: a concurrent process (another rank) may have written
    if key in peaks and peaks[key]["flops"] >= entry["flops"]:
        return peaks[key]
    peaks[key] = entry
    write_cache(cpu_peak_path(), peaks)
    return entry
