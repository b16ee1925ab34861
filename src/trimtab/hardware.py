"""What this machine offers for training: device and mixed-precision choice (with the reason
written down for the user), the GPU table, the machine's RAM, and the cache files of the CPU's
measurements (one process measuring at a time).

CUDA: bf16 autocast where the GPU supports it (Ampere+), else fp16 with a GradScaler.
MPS: fp16 autocast. CPU: fp32, unless the CPU has native bf16 (AVX512-BF16 / AMX) and a quick
matmul measurement (once, cached) shows bf16 is faster; on CPUs without it, bf16 is emulated and
slower. The trainer then times the model's own step before keeping bf16
(training/services/cpu_precision.py).

The trainer, `trimtab doctor` and `trimtab plan` all ask here, so they agree. One GPU table
serves MFU and the planner's memory check. The peak FLOP/s that MFU is measured against (a GPU's
datasheet; a CPU's matmul rate, measured once and cached) is peaks.py's, which sits above this
module and keeps its cache with this module's `measuring`, `read_cache` and `write_cache`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import importlib.util
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trimtab.errors import ConfigError
from trimtab.extras import missing
from trimtab.paths import cache_dir
from trimtab.rundir import write_atomic

log = logging.getLogger(__name__)
# fp8: the linear layers' matmuls in float8 (training/services/float8.py), the rest in bf16 autocast
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first with float8 tensor cores (torch._scaled_mm)
MATMUL_N = 1024  # the CPU's bf16 / fp32 comparison: 10-30 ms a matmul on one core


@dataclass
class Precision:
    device: torch.device
    name: str  # fp32 | bf16 | fp16 | fp8
    reason: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self, **scaling: float) -> torch.amp.GradScaler | None:
        """fp16's GradScaler with `scaling` (train.loss_scale's, as GradScaler's arguments)."""
        # bf16 has fp32's exponent range; only fp16 needs loss scaling.
        if self.name == "fp16":
            return torch.amp.GradScaler(self.device.type, **scaling)
        return None


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def pick_device(name: str, key: str = "train.device") -> torch.device:
    """The device `name` (auto, cpu, cuda, mps) names on this machine; one it lacks is a ConfigError
    naming `key` (the config key or flag it came from) rather than torch's error at the first tensor."""
    if name != "auto":
        if name == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"{key}=cuda but no CUDA device is visible; use auto or cpu (choices: auto, cpu, cuda, mps)"
            )
        if name == "mps" and not mps_available():
            raise ConfigError(
                f"{key}=mps but this machine has no MPS device (Apple silicon GPU); use auto or cpu "
                "(choices: auto, cpu, cuda, mps)"
            )
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    return (
        torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
        or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def fp8_unsupported(device: torch.device) -> str | None:
    """Why train.precision=fp8 cannot run on `device`, or None where it can: an NVIDIA GPU of
    compute capability 8.9 or newer, with torchao installed."""
    if device.type != "cuda":
        return f"float8 matmuls need an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper); this is {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        major, minor = capability
        return f"{name} is compute capability {major}.{minor}; float8 tensor cores need 8.9+ (Ada, Hopper)"
    if importlib.util.find_spec("torchao") is None:
        return missing("torchao", "float8 training")
    return None


def _tf32_on_ampere(device: torch.device) -> None:
    """Ampere+: the fp32 matmuls autocast leaves run on TF32 tensor cores (10-bit mantissa, fp32
    range), as nanoGPT / torchtitan do; PyTorch's default is exact fp32."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def choose_precision(device: torch.device, requested: str) -> Precision:
    if requested == "fp8":
        if reason := fp8_unsupported(device):
            raise ConfigError(f"train.precision=fp8: {reason}; use bf16 (or auto)")
        _tf32_on_ampere(device)
        return Precision(device, "fp8", "train.precision=fp8 (set in config): float8 linear layers, bf16 autocast")
    if requested != "auto":
        return Precision(device, requested, f"train.precision={requested} (set in config)")
    if device.type == "cuda":
        _tf32_on_ampere(device)
        if torch.cuda.is_bf16_supported():
            return Precision(device, "bf16", "CUDA device supports bf16 (Ampere+: TF32 for fp32 matmuls)")
        return Precision(device, "fp16", "CUDA device without bf16 (pre-Ampere): fp16 + GradScaler")
    if device.type == "mps":
        return Precision(device, "fp16", "Apple MPS: fp16 autocast")
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_has_native_bf16():
        return Precision(device, "fp32", f"CPU ({capability}) has no native bf16: fp32 is fastest")
    timed = cpu_matmul_timings()
    fp32, bf16, when = timed["fp32_s"], timed["bf16_s"], f"({timed['measured']}, cached)"
    if bf16 < fp32:
        # a run then keeps bf16 only if its model's step is faster too (training/services/cpu_precision.py)
        return Precision(device, "bf16", f"CPU ({capability}) bf16 matmul measured {fp32 / bf16:.1f}x faster {when}")
    return Precision(device, "fp32", f"CPU ({capability}) bf16 measured no faster than fp32 {when}")


def cpu_matmul_timings() -> dict[str, Any]:
    """Best seconds of an n x n matmul in fp32 and in bf16 on this CPU, torch and thread count:
    measured the first time, then read from cpu_precision_path() (every start measured them
    otherwise: 0.2-0.4 s of a 2-core machine's time)."""
    return cached_timings(
        f"{machine_key()} | matmul {MATMUL_N}",
        lambda: {
            "fp32_s": matmul_seconds(torch.float32, MATMUL_N),
            "bf16_s": matmul_seconds(torch.bfloat16, MATMUL_N),
            "measured": datetime.date.today().isoformat(),
        },
    )


def cached_timings(key: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The fp32 / bf16 timings cached in cpu_precision_path() under `key` (the matmul's here, a
    model step's in training/services/cpu_precision.py): `measure()`d when the cache has none
    usable, and recorded beside whatever the file holds then (another process may have written)."""
    path = cpu_precision_path()
    entry = read_cache(path).get(key)
    if not timings_valid(entry):
        with measuring(path):
            entry = read_cache(path).get(key)  # measured by another process while this one waited
            if not timings_valid(entry):
                entry = measure()
                write_cache(path, {**read_cache(path), key: entry})
    return entry


def timings_valid(entry: object) -> bool:
    """A cached fp32 / bf16 timing (the matmul's here, a model step's in cpu_precision.py) that
    can be compared: both positive and finite."""
    return isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) and 0 < entry[k] < math.inf for k in ("fp32_s", "bf16_s")
    )


def matmul_seconds(dtype: torch.dtype, n: int, reps: int = 3) -> float:
    """Best time of `reps` n x n matmuls: the best is the least disturbed by other load. Its own
    generator: drawn from the global one, a run's initial weights would depend on whether this
    was measured or read from the cache."""
    rng = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=rng).to(dtype)
    b = torch.randn(n, n, generator=rng).to(dtype)
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


def machine_key() -> str:
    """What a CPU measurement depends on: the CPU, the BLAS torch ships, its thread count."""
    return f"{cpu_model()} | torch {torch.__version__} | threads {torch.get_num_threads()}"


def cpu_model() -> str:
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    """The machine's memory figures from /proc/meminfo in bytes (MemTotal, MemAvailable, ...), as
    many as could be read; empty where there is none (not Linux). Read here only: the planner's
    memory check, `trimtab doctor` and the orchestrator's memory rule ask through this and ram_bytes."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info


@functools.cache
def ram_bytes() -> int | None:
    """The machine's RAM in bytes (MemTotal), read once; None where unknown."""
    return meminfo().get("MemTotal")


def cpu_precision_path() -> Path:
    """bf16 against fp32 on this CPU: the matmul's timings (cpu_matmul_timings) and each model
    step's (training/services/cpu_precision.py)."""
    return cache_dir() / "cpu_precision.json"


def read_cache(path: Path) -> dict[str, Any]:
    """A JSON object cached in `path`; a missing or corrupt file reads as empty (and is rewritten
    by the next measurement)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def measuring(path: Path, wait_s: float = 120.0) -> Iterator[None]:
    """One process at a time measures what `path` caches (the ranks of a job, or test workers,
    starting together on a cold cache): two at once would each time a machine the other keeps
    busy (a low peak, a wrong precision chosen) and spend the time twice. The next finds the
    first's entry once it has the lock. A holder stopped (SIGSTOP) past `wait_s` is not waited
    for; one that died has dropped its lock with its process (flock)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only cache: measured unlocked, as it is not written either
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s is locked past %.0f s by a process measuring: measuring alongside", path, wait_s)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the flock


def write_cache(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically (a reader sees the old file or the new one); a read-only cache
    costs a re-measurement next time, not the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1))
    except OSError as exc:
        log.warning("could not write the cache %s: %s", path, exc)


def is_oom(exc: BaseException) -> bool:
    """CUDA/MPS OutOfMemoryError, or an allocator failure reported as a RuntimeError (CPU)."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text
