"""Which watchdog a rank runs (`resilience.watchdog`; docs/resilience.md): the hang watchdog (watchdog.py) under
torchrun, and in one process none but its exit record when it fails."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trimtab.resilience.beats import RANKS
from trimtab.resilience.elastic import session
from trimtab.resilience.heartbeat import Heartbeat
from trimtab.resilience.watchdog import RESCUE_S, Watchdog


class NoWatchdog(Watchdog):
    """The watchdog switched off: beats cost one call; no thread, no beat files. A process alone (`run_dir`
    given) that fails writes its exit record (its error, the step), what the next session reads (incidents.py):
    a session of one process that died of a Python error read "the process ended without a word (SIGKILL, the
    OOM killer, its machine)" (debug-hybrid RL, a ValueError at its first rollouts)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.current, self.step, self.longest, self.before = ("start-up", time.monotonic()), 0, {}, {}
        self.run_dir, self.rank, self.world, self.started = run_dir, 0, 1, time.time()
        self._kept_lost, self._beat_lock = False, threading.Lock()

    def beat(self, section: str, step: int | None = None) -> None:
        self.current = (section, 0.0)  # where a failure's record says it ended (incidents.py: done_step)
        if step is not None:
            self.step = step

    def start(self) -> Watchdog:
        return self

    def stop(self, exit_record: str | None = None) -> None:
        if self.run_dir is not None and exit_record is not None:  # a failure: said for the next session
            with contextlib.suppress(OSError):
                (self.run_dir / RANKS).mkdir(parents=True, exist_ok=True)
            self._write_beat(exit=exit_record)

    def gone_peers(self) -> list[int]:
        return []  # no beats to read


def make_watchdog(cfg: Any, run_dir: Path, rank: int, world: int, connect: Callable[[], Any] | None = None) -> Watchdog:
    """The `resilience:` section's watchdog for this rank (auto: on under torchrun); `connect`: a client of
    torchrun's store for the ranks' heartbeats (none: no heartbeat)."""
    if cfg.watchdog == "off" or (cfg.watchdog == "auto" and world == 1):
        return NoWatchdog(run_dir if world == 1 else None)
    dog = Watchdog(
        run_dir,
        rank,
        world,
        first_timeout_s=cfg.first_timeout_s,
        timeout_factor=cfg.timeout_factor,
        min_timeout_s=cfg.min_timeout_s,
        beat_s=cfg.beat_s,
    )
    dog.rescue_s = RESCUE_S if world > 1 else 0.0  # a peer to kill, and a loop that saves for it
    if world > 1 and cfg.heartbeat_s > 0 and connect is not None:
        dog.heartbeat = Heartbeat(rank, world, cfg.heartbeat_s, connect, f"trimtab/heartbeat/{session()}")
    return dog
