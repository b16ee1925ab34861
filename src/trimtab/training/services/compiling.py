"""train.compile: whether torch.compile runs this training, and what its cold start cost.

`auto` compiles when the run is long enough to repay the compile: the seconds the run is
expected to take (its steps' training FLOPs over the device's peak at a typical MFU) times the
share torch.compile measured it saves on that kind of device must exceed twice the first step's
compile time (evaluation's no-grad graph and any new micro-batch shape compile again). Short
runs, tests and CPU-sized presets stay eager; a long run on a GPU compiles. The
choice and its arithmetic are logged, and the summary reports the cold start actually paid
(the first step's time less the median of the next ten; a later recompile, for evaluation's
no-grad graph or a micro-batch shrunk after an OOM, is not in it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Measured step speed-up of train.compile=true over eager, by device type: cuda, dense-1b in
# bf16, 1.115x on an H100 and 1.139x on an H200 (BENCHMARKS.md, "GPU training step"); cpu,
# `small` on 2 cores, 1.057x in fp32 and 1.095x in bf16 autocast (BENCHMARKS.md, "Training
# throughput ... --compile"): the lesser of each, so a run compiles only where it pays in either.
SPEEDUP = {"cuda": 1.115, "cpu": 1.057}
# Seconds the first compiled step costs beyond an eager one, from empty inductor caches. cpu:
# `small`, 18.9 s in fp32 and 23.9 s in bf16 (the same runs, the whole stack compiled; block by
# block 15.0 s in bf16); cuda, each block compiled on its own (blocks of a kind share their code,
# so depth costs little): dense-1b 7.7 s and a 2-layer moe-7b-shaped model 16.4 s on an H200 with
# torch 2.11, the larger (BENCHMARKS.md, 2026-12-04; the whole stack took 34-36 s on dense-1b).
COLD_START_S = {"cuda": 16.4, "cpu": 24.0}
# MFU assumed for the estimate of the run's length: dense-1b reached 45% eager on an H100 and
# 47.5% on an H200, moe-7b-shaped layers 24% on the H200;
# `small` in bf16 on the 2-core CPU, 61% of its measured matmul peak.
TYPICAL_MFU = {"cuda": 0.40, "cpu": 0.60}
MARGIN = 2.0  # the saving must cover the first compile this many times: the later graphs compile too


@dataclass(frozen=True)
class CompileChoice:
    enabled: bool
    reason: str


def choose_compile(
    requested: str, device: torch.device, steps: int, step_flops: float, peak: float | None
) -> CompileChoice:
    """train.compile true / false as asked; auto: compile when the run's expected time saved
    (steps x step_flops over peak x TYPICAL_MFU, less that over SPEEDUP) exceeds MARGIN cold starts."""
    if requested != "auto":
        return CompileChoice(requested == "true", f"train.compile={requested}")
    kind = device.type
    if kind not in SPEEDUP:
        return CompileChoice(False, f"auto: torch.compile is not measured on {kind}; eager")
    if not peak:
        return CompileChoice(False, f"auto: the {kind}'s peak FLOP/s is unknown, so is the run's length; eager")
    missing = missing_toolchain(kind)
    if missing:
        return CompileChoice(False, f"auto: {missing}; eager")
    run_s = steps * step_flops / (peak * TYPICAL_MFU[kind])
    saved = run_s * (1 - 1 / SPEEDUP[kind])
    enabled = saved > MARGIN * COLD_START_S[kind]
    return CompileChoice(
        enabled,
        f"auto: {steps} steps, about {run_s:,.0f} s at {TYPICAL_MFU[kind]:.0%} MFU; compiling would save "
        f"about {saved:,.0f} s ({SPEEDUP[kind]:.3g}x), {'more' if enabled else 'less'} than {MARGIN:g} x its "
        f"about {COLD_START_S[kind]:.0f} s cold start: " + ("compiled" if enabled else "eager"),
    )


def missing_toolchain(kind: str) -> str:
    """What inductor needs on this device type and cannot find ('' when nothing): a C++
    compiler for its CPU kernels; on CUDA, Triton and the C compiler Triton builds its launchers
    with; on both, Python's headers (a python3-dev package), which those builds include."""
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "no Python.h (install the python3-dev package), which inductor's builds include"
    if kind == "cpu":
        if not any(shutil.which(n) for n in (os.environ.get("CXX"), "c++", "g++", "clang++") if n):
            return "no C++ compiler on PATH (CXX, c++, g++ or clang++), which inductor needs on CPU"
        return ""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed, which inductor needs on CUDA"
    if not any(shutil.which(n) for n in (os.environ.get("CC"), "cc", "gcc", "clang") if n):
        return "no C compiler on PATH (CC, cc, gcc or clang), which Triton needs"
    return ""


class StepTimes:
    """The first steps' wall times of this session, for the cold start the summary reports."""

    WINDOW = 10  # steps after the first whose median is the steady step time

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self.seconds) <= self.WINDOW:
            self.seconds.append(seconds)

    def summary(self, choice: CompileChoice) -> dict[str, Any]:
        first, rest = (self.seconds[0], self.seconds[1:]) if self.seconds else (None, [])
        steady = statistics.median(rest) if rest else None
        return {
            "enabled": choice.enabled,
            "reason": choice.reason,
            "first_step_s": first,
            "steady_step_s": steady,
            "cold_start_s": _cold_start(first, steady) if choice.enabled else None,
        }


def _cold_start(first: float | None, steady: float | None) -> float | None:
    """What compiling added to the first step. An eager run has none: its first step less the
    median of the next was the noise between two like numbers, negative half the time (issue #30).
    A compiled first step can still come out under the median when steps in the window recompile
    (a new shape); the cold start is then nothing measurable, not negative."""
    if first is None or steady is None:
        return None
    return max(0.0, first - steady)
