"""What this machine offers for training: device and mixed-precision choice (with the reason
written down for the user), and the peak FLOP/s that MFU is measured against.

CUDA: bf16 autocast where the GPU supports it (Ampere+), else fp16 with a GradScaler.
MPS: fp16 autocast. CPU: fp32, unless the CPU has native bf16 (AVX512-BF16 / AMX) and a quick
matmul measurement shows bf16 is faster; on CPUs without it, bf16 is emulated and slower.

The trainer, `trimtab doctor` and `trimtab plan` all ask here, so they agree. One GPU table
serves MFU and the planner's memory check.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from trimtab.errors import ConfigError

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
    dtype: str = "bf16"  # what peak_flops is for: pre-Ampere GPUs have no bf16, their fp16 figure


# Vendor datasheets: NVIDIA H200, H100, A100, L40S, A10, L4, V100 and T4 product sheets (SXM
# figures where there are several); the Ada (RTX 4090) and Ampere GA102 (RTX 3090) whitepapers,
# bf16 with fp32 accumulate. Device names are matched by substring in this order, so a longer key
# comes before its prefix (A100 before A10, L40S before L4).
GPUS = {
    "H200": Gpu(989e12, 141),
    "H100": Gpu(989e12, 80),
    "A100": Gpu(312e12, 80),
    "L40S": Gpu(362e12, 48),
    "A10": Gpu(125e12, 24),
    "L4": Gpu(121e12, 24),
    "4090": Gpu(165e12, 24),
    "3090": Gpu(71e12, 24),
    "V100": Gpu(125e12, 32, "fp16"),
    "T4": Gpu(65e12, 16, "fp16"),
}


def gpu_named(device_name: str) -> tuple[str, Gpu] | None:
    """The table's entry for a CUDA device name such as "NVIDIA H100 80GB HBM3"."""
    return next(((key, gpu) for key, gpu in GPUS.items() if key in device_name), None)


def datasheet_source(key: str) -> str:
    return f"{key} datasheet (dense {GPUS[key].dtype})"


def peak_flops(precision: Precision) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU and where the number comes from (datasheet or measured)."""
    if precision.device.type == "cuda":
        name = torch.cuda.get_device_name(precision.device)
        found = gpu_named(name)
        if found is None:
            return None, f"{name}: not in hardware.GPUS, peak unknown"
        return found[1].peak_flops, datasheet_source(found[0])
    if precision.device.type == "cpu":
        dtype = precision.autocast_dtype or torch.float32
        if dtype == torch.float16:  # emulated on CPUs: no meaningful peak, and slow to measure
            return None, "CPU fp16 is emulated: no peak"
        n = 2048  # large enough for the BLAS to reach its steady rate
        return 2 * n**3 / _matmul_seconds(dtype, n, reps=3), "measured CPU matmul peak"
    return None, "unknown peak"
