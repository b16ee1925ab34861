"""Each rank's heartbeat through the job's c10d store: a host lost without a word is named in seconds.

A host lost without closing its sockets (its power, its network; a worker stopped with its agent) fails no
collective: its peers wait in the next one until the watchdog's section timeout (resilience.min_timeout_s,
60 s by default) ends them. Here a thread of each rank adds 1 to its counter in the store torchrun's ranks
share (MASTER_ADDR:MASTER_PORT: the agent's rendezvous store, or rank 0's) every PERIOD_S, and reads the
counters of up to WATCHED ranks after it (a ring: every rank is watched, and the store's load grows with the
world, not with its square). A watched counter that did not move over `silent_s` of this rank's own rounds
names a lost rank (a rank that was stopped itself counts no rounds: no false alarm after its SIGCONT); a
rank whose exit marked the store (it ended) is not one. A store that stops answering (its host lost or
frozen: a call on it blocks, measured 600 s and more) is found by the watchdog thread's own polls while a
call is under way. The loop's section changes wake the thread, which writes the rank's position (step,
section) then: a frozen rank is named where it froze, not where its beat file said up to a second before.
Torch-free: the store's client comes from `connect` (distributed/group.py heartbeat_store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("trimtab")

PERIOD_S = 1.0  # each rank's counter moves this often
WATCHED = 8  # the ranks after this one (mod the world) whose counters it reads each round
# at most one position write this often: a fast step's many sections cost the loop's thread no GIL time for
# a write each, and the position written is at most this old
POSITION_S = 0.01


class Heartbeat:
    """A rank's counter in the store and its watch over its ring successors (resilience/watchdog.py polls it)."""

    def __init__(self, rank: int, world: int, silent_s: float, connect: Callable[[], Any], prefix: str) -> None:
        self.rank, self.silent_s, self.prefix = rank, silent_s, prefix
        self.peers = [(rank + k) % world for k in range(1, min(world - 1, WATCHED) + 1)]
        self._connect, self._store = connect, None
        self.position: tuple[int, str] = (0, "start-up")  # the loop's (watchdog.beat)
        self.positions: dict[int, dict[str, Any]] = {}  # a peer whose counter stood still -> where it last was
        self._seen: dict[int, tuple[int, int]] = {}  # peer -> (its counter, this rank's rounds since it moved)
        self._ended: set[int] = set()  # peers whose exit marked the store
        self._busy_since = 0.0  # monotonic start of the store call under way (0: none)
        self._stuck = (0.0, 0)  # the call the watchdog's last poll found under way, and its polls that found it
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}{rank}"

    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, daemon=True, name="trimtab-heartbeat")
        self._thread.start()
        return self

    def poke(self, step: int, section: str) -> None:
        """The loop entered `section` of step `step`: the thread writes it now (one Event, never a store call)."""
        self.position = (step, section)
        self._wake.set()

    def stop(self) -> None:
        """This rank ends: the thread marks it ended in the store (its peers do not take it for lost)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * PERIOD_S)  # a store that no longer answers must not hold up the exit

    # ------------------------------------------------------------------ the watchdog's questions

    def lost(self, poll_s: float) -> dict[str, Any] | None:
        """What is lost, once per watchdog poll (`poll_s` apart): {"ranks": [...], "seconds": s} for watched
        ranks silent for `silent_s`, {"store": address, "seconds": s} for a store call blocked that long."""
        busy = self._busy_since
        # the same call under way poll after poll (many short calls under way at a few polls are no stall)
        self._stuck = (busy, self._stuck[1] + 1 if busy and busy == self._stuck[0] else int(bool(busy)))
        if busy and self._stuck[1] * poll_s >= self.silent_s:
            return {"store": store_address(), "seconds": round(time.monotonic() - busy, 1)}
        rounds = {p: n for p, (count, n) in self._seen.items() if count > 0 and p not in self._ended}
        silent = sorted(p for p, n in rounds.items() if n * PERIOD_S >= self.silent_s)
        return {"ranks": silent, "seconds": max(self._silent_for(p, rounds[p]) for p in silent)} if silent else None

    def _silent_for(self, peer: int, rounds: int) -> float:
        """Seconds since `peer` was last heard of: its last position's time (written as it entered each section,
        and each round just before its beat), within what the `rounds` its counter stood still allow ((rounds - 1)
        to (rounds + 1) periods: a clock off this host's). rounds * PERIOD_S alone said up to a period more than
        a rank stopped mid-section had been (its last beat came up to a period before it stopped)."""
        heard = self.positions.get(peer, {}).get("time")
        if heard is None:
            return rounds * PERIOD_S
        return round(min(max(time.time() - heard, (rounds - 1) * PERIOD_S), (rounds + 1) * PERIOD_S), 1)

    def quiet(self) -> list[int]:
        """Watched ranks whose counter stood still in this rank's last two rounds: frozen or gone, so they will
        not answer a hang alarm (the watchdog does not wait its grace for their stacks)."""
        return sorted(p for p, (count, n) in self._seen.items() if count > 0 and n >= 2 and p not in self._ended)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._store = self._call(self._connect)
        except Exception as exc:  # no heartbeat: the watchdog's timeouts still end a hang
            self._busy_since = 0.0
            log.warning(
                "trimtab: no heartbeat through the store at %s (%s): a lost host is found by the "
                "resilience.min_timeout_s timeout",
                store_address(),
                exc,
            )
            return
        last = -PERIOD_S
        while not self._stop.is_set():
            self._wake.wait(max(0.0, last + PERIOD_S - time.monotonic()))
            self._wake.clear()
            with contextlib.suppress(Exception):  # a failed call stays failed: the next round's tries again
                self._call(self._write_position)
                if time.monotonic() - last >= PERIOD_S:
                    last = time.monotonic()
                    self._call(self._round)
            self._stop.wait(POSITION_S)
        with contextlib.suppress(Exception):
            self._call(lambda: self._store.set(self._key("end", self.rank), "1"))

    def _call(self, call: Callable[[], Any]) -> Any:
        """A store call, timed for lost(): a call on a frozen store's host blocks (TCPStore's timeout does not
        bound add), and one on a dead one raises: both leave it counted under way until a call succeeds."""
        self._busy_since = self._busy_since or time.monotonic()
        result = call()
        self._busy_since = 0.0
        return result

    def _write_position(self) -> None:
        step, section = self.position
        self._store.set(self._key("pos", self.rank), f"{step} {section} {time.time():.3f}")

    def _round(self) -> None:
        """Beat once, and read each watched rank's counter; one that stood still: its position and whether it
        ended (two reads, only then)."""
        self._store.add(self._key("beat", self.rank), 1)
        for peer in self.peers:
            count = self._store.add(self._key("beat", peer), 0)  # add 0: a read that never waits for the key
            before, rounds = self._seen.get(peer, (0, 0))
            self._seen[peer] = (count, rounds + 1 if count == before else 0)
            if count == before and count > 0:
                self._look_at(peer)

    def _look_at(self, peer: int) -> None:
        if self._store.check([self._key("end", peer)]):
            self._ended.add(peer)
        elif self._store.check([self._key("pos", peer)]):
            step, section, when = self._store.get(self._key("pos", peer)).decode().split()
            self.positions[peer] = {"step": int(step), "section": section, "time": float(when)}


def store_address() -> str:
    """The store torchrun's ranks share, as its environment names it."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
