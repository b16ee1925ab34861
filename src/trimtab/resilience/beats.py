"""What the ranks' beat records say (resilience/watchdog.py writes them: RUN_DIR/ranks/rankR.json,
and each answer to a hang's alarm in RUN_DIR/hangs): which ranks stopped a hung job and where
(stopped, on_hosts: the watchdog's console line, resilience/incidents.py), and how long each section
ran in the session before a restart (timed_before: its first runs' timeouts). Torch-free, as the
watchdog is."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from trimtab.resilience.elastic import session
from trimtab.rundir import read_json

RANKS = "ranks"
LOST = ".lost.json"  # ranks/rankR.lost.json: the session before's last beat, moved aside by this session's first
# a step's sections in the order the loop enters them: where a hang stopped (incidents.py, the console)
SECTIONS = (
    "start-up",
    "data",
    "forward_backward",
    "sync",
    "optimizer",
    "hooks",
    "rollback",
    "evaluation",
    "checkpoint",
)


def stopped(hangs: list[dict[str, Any]], beats: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Which ranks stopped a hung job and where, from the hang records of the ranks that answered
    the alarm (`hangs`) and every rank's last beat (`beats`: rank -> record). A rank that wrote no
    stack did not answer: frozen (its watchdog with it) or gone, and its last beat says where it
    was (written as it entered the section: SECTION_BEAT_S). Else the ranks furthest behind (the
    step, then the section): the others wait for them in a collective."""
    mute = sorted(set(beats) - {h["rank"] for h in hangs})
    if mute:
        beat = beats[mute[0]]
        return {"ranks": mute, "silent": mute, "section": beat.get("section"), "step": beat.get("step")}
    first = min(map(_position, hangs))
    behind = [h for h in hangs if _position(h) == first]
    return {
        "ranks": sorted(h["rank"] for h in behind),
        "silent": [],
        "section": behind[0]["section"],
        "step": behind[0].get("step"),
    }


def on_hosts(ranks: list[int], beats: dict[int, dict[str, Any]], silent: bool) -> str:
    """Where the ranks to blame run, from their beats: "; on host H (node N)", and, `silent` ones on a host not
    this one, that this rank cannot end them (_end_mute_peers kills this host's only): their agent ends them as
    the job restarts, by SIGTERM, which a frozen process cannot take, then SIGKILL 30 s later (torchrun's
    shutdown grace): the restart comes that much later. "" where no beat says."""
    places = sorted({(str(b["host"]), int(b.get("node") or 0)) for r in ranks if (b := beats.get(r, {})).get("host")})
    if not places:
        return ""
    where = ", ".join(f"host {host} (node {node})" for host, node in places)
    away = any(host != socket.gethostname() for host, _ in places)
    later = ": another host, ended by its torchrun agent (SIGKILL 30 s after its SIGTERM, if frozen)"
    return f"; on {where}" + (later if away and silent else "")


def timed_before(run_dir: Path, rank: int, world: int) -> dict[str, float]:
    """Each section's longest run in the session before this one ({} on a fresh run): this rank's
    last beat of it, where rank 0's says the same session (a rank that was not in it may hold an
    older one's), scaled up when the world shrank (each rank a larger share of a step). Start-up is
    left out: a resume reads a checkpoint the session before may not have. Two reads a rank, once."""
    lead = _last_before(Path(run_dir) / RANKS, 0)
    own = lead if rank == 0 else _last_before(Path(run_dir) / RANKS, rank)
    if not lead or not own or own.get("session") != lead.get("session") or not isinstance(own.get("longest"), dict):
        return {}
    scale = max(1.0, int(own.get("world") or world) / max(1, world))
    return {k: float(v) * scale for k, v in own["longest"].items() if k != "start-up"}


def _last_before(folder: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s last beat of an earlier session: its beat file, or the one this session's
    first write moved aside (LOST); {} where there is none."""
    for path in (folder / f"rank{rank}.json", folder / f"rank{rank}{LOST}"):
        record = read_json(path)
        if isinstance(record, dict) and record.get("session") != session():
            return record
    return {}


def _position(record: dict[str, Any]) -> tuple[int, int]:
    """How far a rank's record got: its step, then its section's place in the step."""
    section = record.get("section")
    return int(record.get("step") or 0), SECTIONS.index(section) if section in SECTIONS else 0
