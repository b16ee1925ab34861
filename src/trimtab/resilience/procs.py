"""What /proc says of a rank's process: when it started, whether it is stopped or has ended (the watchdog's
reads of this host's ranks, resilience/watchdog.py). Torch-free."""

from __future__ import annotations

import os
import time
from typing import Any


def process_start(pid: int) -> float | None:
    """When process `pid` started (wall time, to ~10 ms): /proc/PID/stat's start in clock ticks
    after boot, the boot from /proc/uptime; None where there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def alive_since(pid: int, when: float) -> bool:
    """Process `pid` runs and ran at `when` already (not a later process given the same number)."""
    start = process_start(pid)
    return start is not None and start <= when + 1.0


def state(pid: Any) -> str:
    """Process `pid`'s state letter in /proc (R, S, T: stopped, Z...); "" where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def gone(pid: Any, when: float) -> bool:
    """Whether the process `pid` that beat at `when` has ended: no such process, a later one given its number,
    or a zombie its parent (torchrun's agent) has not reaped yet."""
    if not isinstance(pid, int):
        return False  # no pid recorded: nothing known
    return state(pid) in ("Z", "X") or not alive_since(pid, when)
