"""Goodput: where a run's wall time went, over every session of it (restarts included).

RUN_DIR/goodput.json, written by rank 0 (atomically, at most every WRITE_S without a sync, and
synced at each session's start and end):

    {"sessions": [{"started", "beat", "end", "restart", "world", "from_step", "step",
                   "down_s", "seconds": {"productive": ..., "redone": ..., ...}}, ...],
     "incidents": [{"kind", "step", "resumed_step", "steps_lost", "down_s", "recover_s",
                    "ranks_to_blame", "ranks", ...}, ...]}     (kind: resilience/incidents.py)

Each second of a session is one of BUCKETS: `productive` (steps at a position the run had not
reached before), `redone` (steps trained again after a restart or a rollback threw them away),
`checkpoint` (saves), `evaluation`, `hang` (a lost session's wait on a hung or frozen rank, from
the stall's start to its end: Ledger.hung), `start_up` (process start to the first step: imports,
data, resume), `other` (logging, the orchestrator's reads, the report). A session that never said it
ended (killed, crashed, its node lost) was lost: the time from its last sign of life to the next
session's start is `down` (the restart). ETTR, the effective training time ratio of Llama 3's
and ByteRobust's reports, is productive / wall, wall being every session's time plus the downs.
A gap after a session that ended on purpose (a stop, a preemption that saved) is not the run's.

RUN_DIR/goodput.step holds the last step this session completed ("STARTED STEP TIME", padded
to MARK_BYTES), overwritten in place after every step with one pwrite of a few bytes and no
sync: it outlives a SIGKILL (the page cache keeps it), not a machine's crash. goodput.json and
the other files a lost session left are up to a second or train.log_every steps behind; this
mark makes a lost session's last completed step, and so its steps lost, exact.

Torch-free: `trimtab runs` and the report read it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from trimtab.rundir import GOODPUT_FILE, STEP_FILE, read_json, write_json

BUCKETS = ("productive", "redone", "checkpoint", "evaluation", "hang", "start_up", "other")
WRITE_S = 1.0  # the ledger's freshness: what a lost session's record can miss
MARK_BYTES = 64  # the mark's fixed size: each write covers the last whole, so no truncate is needed
log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / GOODPUT_FILE
        data = _read_ledger(self.path) or {}  # a damaged one: this session starts a new ledger
        if not all(_resumable(s) for s in data.get("sessions", [])):
            log.warning("%s: a session without its step, beat or world; this session starts a new ledger", self.path)
            data = {}
        self.sessions: list[dict[str, Any]] = data.get("sessions", [])
        self.incidents: list[dict[str, Any]] = data.get("incidents", [])
        self.high = max((s["step"] for s in self.sessions), default=0)  # the furthest any session trained
        self.session: dict[str, Any] = {}
        self._written = 0.0
        self._mark: int | None = None  # STEP_FILE's descriptor, opened at this session's first step

    def open(self, started: float, from_step: int, world: int, restart: int, last_life: float) -> dict | None:
        """Begin this session (process start `started`, resumed at `from_step`); the incident when
        the previous session was lost, its last sign of life the latest of its own beat and
        `last_life` (the run lock's heartbeat, the ranks' beats)."""
        previous = self.sessions[-1] if self.sessions else None
        incident, down = None, 0.0
        if previous is not None and previous.get("end") is None:
            # it lived on past its last write (up to WRITE_S; its ranks' beats, its step mark say how
            # long): that time is its own, in no bucket it wrote, else the run's wall time lacks it
            lived = max(0.0, last_life - previous["beat"])
            previous["beat"] += lived
            seconds = previous.setdefault("seconds", {})  # (a ledger an older trimtab wrote may lack it)
            seconds["other"] = seconds.get("other", 0.0) + lived
            down = max(0.0, started - previous["beat"])
            incident = {
                "kind": "restart",
                "session": len(self.sessions),
                "step": previous["step"],
                "resumed_step": from_step,
                "steps_lost": max(0, previous["step"] - from_step),
                "down_s": round(down, 3),
                "world_before": previous["world"],
                "world_after": world,
                "restart": restart,
            }
            self.incidents.append(incident)
        self.session = {
            "started": started,
            "beat": time.time(),
            "end": None,
            "restart": restart,
            "world": world,
            "from_step": from_step,
            "step": from_step,
            "down_s": round(down, 3),
            "seconds": dict.fromkeys(BUCKETS, 0.0),
        }
        self.sessions.append(self.session)
        self.write(force=True)
        return incident

    def hung(self, incident: dict[str, Any]) -> float:
        """The lost session of a `hang` incident (resilience/incidents.py localize) waited from `stalled_since`
        (the silent rank's last word, or the stalled section's start) to its last sign of life: that time moves
        from `other`, where its restart's open() put what no bucket took, to `hang` (a frozen peer's 5.0 s wait
        read as `other` before). Its seconds, also the incident's `hang_s`."""
        session = self.sessions[incident["session"] - 1]
        seconds = session["seconds"]
        waited = min(seconds.get("other", 0.0), max(0.0, session["beat"] - incident.get("stalled_since", math.inf)))
        seconds["other"] = seconds.get("other", 0.0) - waited
        seconds["hang"] = seconds.get("hang", 0.0) + waited
        incident["hang_s"] = round(waited, 3)
        return waited

    def step(self, step: int, seconds: float) -> None:
        """A step done: productive the first time the run reaches its position, redone after."""
        self.add("productive" if step > self.high else "redone", seconds)
        self.high = max(self.high, step)
        self.session["step"] = step
        self._write_mark(step)

    def _write_mark(self, step: int) -> None:
        """STEP_FILE: this step done. Opened at the first step, not at open(): until then it holds
        the lost session's mark, which the restart's evidence (resilience/incidents.py) reads."""
        with contextlib.suppress(OSError):  # a full disk must not end the run; goodput.json still bounds it
            if self._mark is None:
                self._mark = os.open(self.path.with_name(STEP_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            mark = f"{self.session['started']!r} {step} {time.time()!r}"
            os.pwrite(self._mark, mark.ljust(MARK_BYTES - 1).encode() + b"\n", 0)

    def add(self, bucket: str, seconds: float) -> None:
        self.session["seconds"][bucket] += max(0.0, seconds)

    def close(self, end: str) -> None:
        self.session["end"] = end
        self.write(force=True)
        if self._mark is not None:
            os.close(self._mark)
            self._mark = None

    def write(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._written < WRITE_S:
            return
        self.session["beat"], self._written = now, now
        seconds = self.session["seconds"]  # other: what no bucket took
        seconds["other"] = max(0.0, now - self.session["started"] - sum(v for b, v in seconds.items() if b != "other"))
        try:
            write_json(self.path, {"sessions": self.sessions, "incidents": self.incidents}, durable=force)
        except OSError:  # a full disk must not end the run; the next write tries again
            pass

    def summary(self) -> dict[str, Any]:
        return totals(self.sessions, self.incidents)


def totals(sessions: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's wall time by bucket, `down` between lost sessions and their restarts, and ETTR. A
    bucket a session lacks (a ledger an older trimtab wrote) counts 0: `trimtab runs` lists the run."""
    seconds = {b: round(sum(s.get("seconds", {}).get(b, 0.0) for s in sessions), 3) for b in BUCKETS}
    seconds["down"] = round(sum(s.get("down_s", 0.0) for s in sessions), 3)
    wall = sum(seconds.values())
    return {
        "ettr": round(seconds["productive"] / wall, 4) if wall > 0 else None,
        "wall_s": round(wall, 3),
        "seconds": seconds,
        "sessions": len(sessions),
        "incidents": len(incidents),
        "steps_lost": sum(i.get("steps_lost", 0) for i in incidents),
    }


def add_after_end(run_dir: str | Path, bucket: str, seconds: float) -> dict[str, Any] | None:
    """`seconds` of `bucket` added to the newest session of RUN_DIR/goodput.json once it has ended
    (Ledger.close): time the run's end spent after its ledger was closed (the wait for the last
    checkpoint upload, by a hook after the ledger's: training/services/storage.py). The run's
    totals; None when the newest session has not ended (no ledger, or another process's) or the
    ledger could not be written (a full disk must not end the run)."""
    path = Path(run_dir) / GOODPUT_FILE
    data = _read_ledger(path)
    sessions = data.get("sessions") if data else None
    if not sessions or sessions[-1].get("end") is None or not isinstance(sessions[-1].get("seconds"), dict):
        return None
    session = sessions[-1]
    session["seconds"][bucket] = session["seconds"].get(bucket, 0.0) + max(0.0, seconds)
    session["beat"] = max(session["beat"], time.time())
    try:
        write_json(path, data, durable=True)
    except OSError:
        return None
    return totals(sessions, data.get("incidents", []))


def read_goodput(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's totals from RUN_DIR/goodput.json, None when it has none (or a damaged one)."""
    data = _read_ledger(Path(run_dir) / GOODPUT_FILE)
    if not data or not data.get("sessions"):
        return None
    return totals(data["sessions"], data.get("incidents", []))


def _read_ledger(path: Path) -> dict[str, Any] | None:
    """goodput.json as totals() reads it; None, with a warning naming it, for one that parses but
    is not a ledger (a hand edit, another tool's file): one run's damaged ledger must not end
    `trimtab runs` over a whole tree, nor its report."""
    data = read_json(path)
    if data is None or _ledger_shaped(data):
        return data
    log.warning(
        "%s is not a goodput ledger (sessions with their seconds by bucket): its wall time is left out; "
        "remove it, or restore it from a copy",
        path,
    )
    return None


def _resumable(session: dict[str, Any]) -> bool:
    """A session the next one's Ledger.open reads (its step, last beat and world)."""
    return all(isinstance(session.get(k), (int, float)) for k in ("step", "beat", "world"))


def _ledger_shaped(data: Any) -> bool:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def session(s: Any) -> bool:
        seconds = s.get("seconds", {}) if isinstance(s, dict) else None
        return isinstance(seconds, dict) and all(map(number, seconds.values())) and number(s.get("down_s", 0.0))

    if not isinstance(data, dict):
        return False
    sessions, incidents = data.get("sessions", []), data.get("incidents", [])
    return (
        isinstance(sessions, list)
        and all(map(session, sessions))
        and isinstance(incidents, list)
        and all(isinstance(i, dict) and number(i.get("steps_lost", 0)) for i in incidents)
    )


def read_mark(run_dir: str | Path, started: float) -> tuple[int, float] | None:
    """(step, wall time) of the last step the session that started at `started` completed, from
    RUN_DIR/goodput.step; None when it holds another session's mark, or none."""
    try:
        fields = (Path(run_dir) / STEP_FILE).read_text().split()
        if len(fields) == 3 and float(fields[0]) == started:
            return int(fields[1]), float(fields[2])
    except (OSError, ValueError):  # missing, or not a mark
        pass
    return None
