"""How often to checkpoint and what share of the wall time trains, at a given scale (docs/resilience.md).

    MTBF        the job's mean time between failures: 1 / (devices x failures per device-hour);
                the rate from Llama 3's pretraining (Dubey et al. 2024, section 3.3.4: 419
                unexpected interruptions in 54 days on 16,384 H100s), overridable
    interval    Young's optimum (Young 1974; Daly 2006's first-order form): sqrt(2 x C x MTBF) for
                a checkpoint that stalls training C seconds
    ETTR        1 - C / interval - (R + interval / 2) / MTBF: the saves' stall, and per failure the
                restart and recovery R plus on average half an interval trained again

A synchronous save stalls for the whole write (every device at WRITE_BYTES_PER_S, at most
FS_BYTES_PER_S together); an asynchronous one (DCP's async_save) only for the copy of its share to
host memory, the write proceeding beside training. The bandwidths and the recovery time are
assumptions, named as such in the output: a run measures its own (goodput.json).

Per-step fault tolerance (torchft replica groups, resilience.ft) changes what a failure costs: no
restart and no work trained again; the groups that keep going lose the step the failed group was
in (withheld) and the quorum's change, FT_STALL_S, and the failed group's share of the devices
(ft_group: a node, GROUP_DEVICES, or half the devices on fewer) is missing for its
replacement's recovery R. Checkpoints stay asynchronous at Young's interval, for failures of the
whole job:

    ETTR_ft     1 - C / interval - (FT_STALL_S + R x group / devices) / MTBF
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Llama 3 405B pretraining: 419 unexpected interruptions in 54 days on 16,384 GPUs
FAILURES_PER_DEVICE_HOUR = 419 / (54 * 24 * 16_384)
RATE_SOURCE = "Llama 3 pretraining (419 interruptions in 54 days on 16,384 GPUs)"
WRITE_BYTES_PER_S = 1e9  # per device to a shared filesystem (assumed: a parallel FS at ~8 GB/s a node of 8)
FS_BYTES_PER_S = 1e12  # the filesystem's aggregate write bandwidth, all devices together (assumed)
STAGE_BYTES_PER_S = 25e9  # per device, device to pinned host memory (PCIe 4/5 x16, measured ~25 GB/s)
RECOVERY_S = 300.0  # restart, rendezvous, checkpoint load and warm-up (assumed; measure yours: goodput.json)
GROUP_DEVICES = 8  # a torchft replica group: one node of 8 GPUs (assumed; fewer where there are fewer: ft_group)
FT_STALL_S = 10.0  # per failure, for the groups that go on: a withheld step and a new quorum (assumed)


@dataclass(kw_only=True)
class Strategy:
    name: str
    stall_s: float  # seconds training waits per checkpoint
    interval_s: float  # Young's optimum
    ettr: float


@dataclass(kw_only=True)
class ResiliencePlan:
    devices: int
    mtbf_h: float
    rate_source: str
    state_bytes: int  # one copy of the weights and optimizer state: what a checkpoint writes
    recovery_s: float
    step_s: float | None  # one optimizer step (the plan's time / steps): an interval is whole steps
    strategies: list[Strategy]


def ft_group(devices: int) -> int:
    """Devices a torchft replica group holds in the plan: a node of GROUP_DEVICES, or half of
    `devices` where they are fewer than two nodes (per-step fault tolerance needs two groups at
    least: with one, a failure stops the job as without it)."""
    return max(1, min(GROUP_DEVICES, devices // 2))


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 C M)."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def expected_ettr(stall_s: float, interval_s: float, recovery_s: float, mtbf_s: float) -> float:
    """First-order share of the wall time that trains (module docstring), clipped to [0, 1]."""
    waste = stall_s / interval_s + (recovery_s + interval_s / 2.0) / mtbf_s
    return min(1.0, max(0.0, 1.0 - waste))


def resilience_plan(
    devices: int,
    state_bytes: int,
    step_s: float | None = None,
    *,
    failures_per_device_hour: float = FAILURES_PER_DEVICE_HOUR,
    recovery_s: float = RECOVERY_S,
    rate_source: str = RATE_SOURCE,
    ft_stall_s: float = FT_STALL_S,
) -> ResiliencePlan:
    """Checkpoint intervals and expected ETTR for `devices` writing `state_bytes` together (DCP
    spreads one copy over every rank): synchronous saves, asynchronous saves, and asynchronous
    saves with per-step fault tolerance across replica groups."""
    mtbf_s = 3600.0 / (devices * failures_per_device_hour)
    write = state_bytes / min(devices * WRITE_BYTES_PER_S, FS_BYTES_PER_S)
    stage = state_bytes / devices / STAGE_BYTES_PER_S
    strategies = []
    for name, stall in (("synchronous save", write), ("asynchronous save", stage)):
        interval = young_interval(stall, mtbf_s)
        if step_s:  # a checkpoint falls between steps
            interval = max(1, round(interval / step_s)) * step_s
        ettr = expected_ettr(stall, interval, recovery_s, mtbf_s)
        strategies.append(Strategy(name=name, stall_s=stall, interval_s=interval, ettr=ettr))
    async_ = strategies[-1]
    lost = ft_stall_s + recovery_s * ft_group(devices) / devices  # per failure (module docstring)
    ettr = min(1.0, max(0.0, 1.0 - async_.stall_s / async_.interval_s - lost / mtbf_s))
    strategies.append(Strategy(name="per-step FT", stall_s=async_.stall_s, interval_s=async_.interval_s, ettr=ettr))
    return ResiliencePlan(
        devices=devices,
        mtbf_h=mtbf_s / 3600.0,
        rate_source=rate_source,
        state_bytes=state_bytes,
        recovery_s=recovery_s,
        step_s=step_s,
        strategies=strategies,
    )


def format_resilience(plan: ResiliencePlan) -> list[str]:
    lines = [
        f"Resilience on {plan.devices:,} devices (docs/resilience.md)",
        f"  MTBF            {plan.mtbf_h:.2f} h ({plan.rate_source})",
        f"  checkpoint      {plan.state_bytes / 2**30:,.1f} GiB (weights and AdamW state), written by every rank; "
        f"recovery {plan.recovery_s:.0f} s a failure (assumed; measured: goodput.json)",
    ]
    for s in plan.strategies:
        steps = f"{s.interval_s / plan.step_s:,.0f} steps, " if plan.step_s else ""
        lines.append(
            f"  {s.name:<17} stall {s.stall_s:.3g} s -> every {steps}{s.interval_s / 60:.1f} min (Young): "
            f"expected ETTR {s.ettr:.1%}"
        )
    lines.append(
        f"  per-step FT: torchft replica groups (resilience.ft) of {ft_group(plan.devices)} devices; a failure costs "
        f"the others a withheld step and a new quorum ({FT_STALL_S:.0f} s assumed) and its own group its recovery, "
        "no work redone"
    )
    return lines
