"""Device and mixed-precision choice, with the reason written down for the user.

CUDA: bf16 autocast where the GPU supports it (Ampere+), else fp16 with a GradScaler.
MPS: fp16 autocast. CPU: fp32, unless the CPU has native bf16 (AVX512-BF16 / AMX) and a quick
matmul measurement shows bf16 is faster; on CPUs without it, bf16 is emulated and slower.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

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
            from trimtab.errors import ConfigError

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


# Dense bf16 peak FLOP/s of common accelerators, for MFU (vendor datasheets, no sparsity).
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "L4": 121e12,
    "4090": 165e12,
    "3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops(precision: Precision) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU and where the number comes from (datasheet or measured)."""
    if precision.device.type == "cuda":
        name = torch.cuda.get_device_name(precision.device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops, f"{name} datasheet"
        return None, f"{name}: unknown peak"
    if precision.device.type == "cpu":
        dtype = precision.autocast_dtype or torch.float32
        if dtype == torch.float16:  # emulated on CPUs: no meaningful peak, and slow to measure
            return None, "CPU fp16 is emulated: no peak"
        n = 2048  # large enough for the BLAS to reach its steady rate
        return 2 * n**3 / _matmul_seconds(dtype, n, reps=3), "measured CPU matmul peak"
    return None, "unknown peak"
