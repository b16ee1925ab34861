"""The peak FLOP/s that MFU is measured against: a GPU's datasheet (hardware.GPUS), or on a CPU a
matmul rate measured once (best of several) and cached in $TRIMTAB_CACHE/cpu_peak.json, checked
against what the CPU's cores, clock and vector units could do at most (its ceiling), and raised
when a run goes faster (beaten_peak). The trainer, `trimtab doctor` and `trimtab plan` all ask
here, so they agree. Apart from hardware.py (device and precision, the GPU table, the caches'
lock and files, which this module uses): it sits above it, and hardware.py imports nothing of it.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from trimtab.hardware import (
    DTYPES,
    Precision,
    cpu_has_native_bf16,
    datasheet_source,
    gpu_named,
    machine_key,
    matmul_seconds,
    measuring,
    read_cache,
    read_cpuinfo,
    write_cache,
)
from trimtab.paths import cache_dir

log = logging.getLogger(__name__)


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
    entry = _plausible_cached_peak(precision)
    if entry is None:
        with measuring(cpu_peak_path()):
            entry = _plausible_cached_peak(precision) or measure_cpu_peak(precision)
    return entry["flops"], describe_peak(entry)


def describe_peak(entry: dict[str, Any]) -> str:
    threads = f"{entry['threads']} thread{'s' if entry['threads'] != 1 else ''} {entry['precision']}"
    if entry.get("source") == "run":
        return f"CPU peak raised to a run's own rate {entry['measured']} (cached, {threads})"
    return f"CPU matmul peak measured {entry['measured']} (cached, {threads}, best of {entry['reps']})"


def _plausible_cached_peak(precision: str) -> dict[str, Any] | None:
    """The cached entry, unless the CPU's own counts say it cannot be right: above the ceiling (a
    bad timer), or so far below it that the machine was busy when it was measured (measured again,
    once: a CPU that really is that slow keeps its entry)."""
    entry = _read_peaks().get(cpu_peak_key(precision))
    ceiling = cpu_ceiling_flops(precision)
    if entry is None or ceiling is None:
        return entry
    if entry["flops"] > ceiling:
        log.warning("cached CPU peak %.3g FLOP/s is over this CPU's ceiling %.3g: remeasuring", entry["flops"], ceiling)
        return None
    if entry["flops"] < ceiling * CPU_PEAK_FLOOR and not entry.get("rechecked"):
        log.warning(
            "cached CPU peak %.3g FLOP/s is under %.0f%% of this CPU's ceiling %.3g (measured on a busy machine?): "
            "measuring again",
            entry["flops"],
            CPU_PEAK_FLOOR * 100,
            ceiling,
        )
        return measure_cpu_peak(precision, rechecked=True)
    return entry


def measure_cpu_peak(precision: str, rechecked: bool = False) -> dict[str, Any]:
    """Time the matmul now and record it. Returns the cache's entry, which keeps the highest
    rate ever measured for the key (another process may have recorded a higher one meanwhile)."""
    log.info("measuring the CPU matmul peak for MFU (once; cached in %s)", cpu_peak_path())
    seconds = matmul_seconds(DTYPES[precision] or torch.float32, CPU_PEAK_N, CPU_PEAK_REPS)
    flops, ceiling = 2 * CPU_PEAK_N**3 / seconds, cpu_ceiling_flops(precision)
    if ceiling is not None and flops > ceiling:
        log.warning("measured CPU peak %.3g FLOP/s is above this CPU's ceiling %.3g: using the ceiling", flops, ceiling)
        flops = ceiling
    entry = {
        "flops": flops,
        "measured": datetime.date.today().isoformat(),
        "reps": CPU_PEAK_REPS,
        "threads": torch.get_num_threads(),
        "precision": precision,
    }
    if rechecked:
        entry["rechecked"] = True
    return _keep_max(cpu_peak_key(precision), entry, ceiling)


def beaten_peak(precision: Precision, achieved: float, peak: float, source: str) -> tuple[float, str]:
    """MFU's reference after a run's own rate `achieved` FLOP/s beat `peak`: the peak was wrong.
    A CPU's cached peak was measured low (a busy moment): the run's rate becomes the cached peak,
    if the CPU could do it at all. A datasheet peak stays: the model's FLOP count is off, and the
    caller caps MFU at 1."""
    if precision.device.type == "cpu" and precision.name in ("fp32", "bf16"):
        ceiling = cpu_ceiling_flops(precision.name)
        if ceiling is None or achieved <= ceiling:
            entry = {
                "flops": achieved,
                "measured": datetime.date.today().isoformat(),
                "reps": 0,
                "threads": torch.get_num_threads(),
                "precision": precision.name,
                "source": "run",
            }
            entry = _keep_max(cpu_peak_key(precision.name), entry, ceiling)
            log.info("a run beat the cached CPU peak: raised to %.3g FLOP/s", entry["flops"])
            return entry["flops"], describe_peak(entry)
    if source not in _WARNED:
        _WARNED.add(source)
        log.warning("measured %.3g FLOP/s beats the peak %.3g (%s): MFU capped at 100%%", achieved, peak, source)
    return peak, source


_WARNED: set[str] = set()


def cpu_peak_key(precision: str) -> str:
    """What the peak depends on: machine_key's and the dtype."""
    return f"{machine_key()} | {precision}"


def cpu_peak_path() -> Path:
    return cache_dir() / "cpu_peak.json"


# ------------------------------------------------------------ the most the CPU could do, its ceiling

# FLOPs per cycle per core for the widest unit the flags name: two FMA ports (the most an x86 core
# has), an FMA counting 2 FLOPs per lane; AMX's tile unit does 1024 bf16 FMAs a cycle. First match wins.
FLOPS_PER_CYCLE = {
    "fp32": [("avx512f", 64), ("fma", 32), ("avx", 16), ("sse2", 8)],
    "bf16": [("amx_bf16", 2048), ("avx512_bf16", 128)],
}
# /proc/cpuinfo's MHz is the current clock, or in a VM the base one: turbo reaches ~1.9x the base
# (Xeon 4th gen: 2.0 -> 3.8 GHz). Without a max clock from cpufreq the ceiling allows that.
TURBO_MARGIN = 2.0
CPUFREQ_MAX = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
# A peak under this share of the ceiling was measured while other work held the cores: a matmul
# reaches 50-90% of it on an idle machine.
CPU_PEAK_FLOOR = 1 / 16


def cpu_ceiling_flops(precision: str) -> float | None:
    """Cores x clock x FLOPs/cycle: what this CPU could do at most at `precision` with torch's
    thread count; None where /proc/cpuinfo does not tell (not x86, no clock)."""
    info = read_cpuinfo()
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    per_cycle = next((n for flag, n in FLOPS_PER_CYCLE.get(precision, []) if flag in flags), None)
    clock = _max_clock_hz(info)
    if per_cycle is None or clock is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(torch.get_num_threads(), cores) * clock * per_cycle


def _max_clock_hz(cpuinfo: str) -> float | None:
    try:  # kHz, the turbo clock, where the kernel exposes cpufreq (not in most VMs)
        return int(CPUFREQ_MAX.read_text()) * 1e3
    except (OSError, ValueError):
        pass
    mhz = [float(ln.split(":", 1)[1]) for ln in cpuinfo.splitlines() if ln.startswith("cpu MHz")]
    return max(mhz) * 1e6 * TURBO_MARGIN if mhz else None


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


def _keep_max(key: str, entry: dict[str, Any], ceiling: float | None = None) -> dict[str, Any]:
    """Record `entry` unless the cache holds a higher plausible rate for `key`; returns the kept one."""
    peaks = _read_peaks()  # read again: a concurrent process (another rank) may have written
    old = peaks.get(key)
    if old is not None and old["flops"] >= entry["flops"] and (ceiling is None or old["flops"] <= ceiling):
        if entry.get("rechecked") and not old.get("rechecked"):
            old["rechecked"] = True  # measured again and no higher: the low rate is this CPU's
            write_cache(cpu_peak_path(), peaks)
        return old
    peaks[key] = entry
    write_cache(cpu_peak_path(), peaks)
    return entry
