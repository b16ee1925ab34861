"""What ended a lost session, read from the files its ranks left (rank 0 of the next session
reads them): RUN_DIR/ranks/rankR.json (each rank's beats and exit record, resilience/watchdog.py),
RUN_DIR/hangs/ (the watchdog's stacks and alarm), the run lock's heartbeat, metrics.jsonl and
RUN_DIR/goodput.step (rank 0's last completed step, written after every step: resilience/goodput.py).

    hang       a rank's watchdog ended a section that ran past its timeout; the rank that
               stopped is one that wrote no stack (frozen, its watchdog with it, or gone: where its
               last beat says, written as it entered the section), else the one furthest behind
               (the step, then the section: the others wait for it in a collective)
    lost_rank  a rank left no exit record while the others left theirs (the error from the
               collective it left): killed (SIGKILL, the OOM killer), its process gone
    lost_node  as lost_rank, and the silent ranks are every rank of one or more nodes (torchrun's
               node rank in their beats) while other nodes spoke: a node gone, or its agent
    lost_job   every rank of a job left no exit record: none failed in a collective (it would have
               left the error), so none is to blame: the job ended whole (its nodes or network, the
               run directory's storage, which no rank could write to, or a kill from outside: the
               scheduler, a person, the OOM killer of the job's cgroup)
    lost_process  a session of one process left no exit record: killed (SIGKILL, the OOM killer, a
               preemption without notice) or its machine gone; no other rank to fail with it
    lost_unknown  a session of several ranks left no rank record at all (resilience.watchdog off:
               no beats, no exit records): a rank lost, a rank failed or the whole job, none can be told
    lost_elsewhere  no rank record here, and this run directory was restored from checkpoint.dir after
               the session began (a fresh machine): its records stayed in the run directory it ran in
               (the store holds the checkpoints and the run's record, not ranks/ or hangs/), so what
               ended it is not known here; said so, not "resilience.watchdog off"
    crash      every rank left an exit record: the first error is the cause
    excluded   a rank's exit record says the orchestrator excluded its node (a straggler's or a
               suspect device's: orchestrator.straggler.exclude, orchestrator.rerun.exclude): not a
               failure, a decision

Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trimtab.resilience.beats import LOST, RANKS, SECTIONS, stopped
from trimtab.resilience.elastic import session
from trimtab.resilience.goodput import read_mark
from trimtab.resilience.watchdog import ALARM, HANGS
from trimtab.rundir import LOCK, METRICS_FILE, read_json, write_json

TAIL_BYTES = 1 << 16
# ranks/restored.json: when and from where this run directory's record (goodput.json, its lost session) was
# restored from checkpoint.dir (training/services/storage.py restore_from); not a rank's record (rank*.json)
RESTORED = "restored.json"


def mark_restored(run_dir: Path, url: str) -> None:
    """This run directory's record was restored from `url` now: the sessions before ran elsewhere, and their
    ranks' records (ranks/, hangs/) are not here (localize: lost_elsewhere)."""
    (run_dir / RANKS).mkdir(parents=True, exist_ok=True)
    write_json(run_dir / RANKS / RESTORED, {"from": url, "time": time.time()})


def restored_since(run_dir: Path, since: float) -> str:
    """checkpoint.dir's URL when this run directory was restored from it after `since` (a session's start);
    empty: not restored since."""
    mark = read_json(run_dir / RANKS / RESTORED)
    return str(mark.get("from", "")) if isinstance(mark, dict) and mark.get("time", 0.0) >= since else ""


def last_life(run_dir: Path, since: float) -> tuple[float, int]:
    """The lost session's last sign of life (wall time) and the newest step its ranks completed: the
    run lock's heartbeat (rank 0; as it was before this session took the lock), the ranks' beats,
    rank 0's step mark."""
    times, steps = [0.0], [0]
    mark = read_mark(run_dir, since)
    if mark is not None:
        steps.append(mark[0])
        times.append(mark[1])
    lock = read_json(run_dir / LOCK)
    if isinstance(lock, dict) and lock.get("pid") == os.getpid():  # this session holds it now
        times.append(lock.get("previous_beat", 0.0))
    else:
        with contextlib.suppress(OSError):
            times.append((run_dir / LOCK).stat().st_mtime)
    for record in _records(run_dir / RANKS, since):
        times.append(record["time"])
        steps.append(done_step(record))
    return max(times), max(steps)


def done_step(record: dict[str, Any]) -> int:
    """The newest step a rank's record shows complete: the step it was in, once its update is
    applied (its hooks, a rollback, an evaluation or a save after it); before that, the one before."""
    step, section = record.get("step", 0), record.get("section")
    after_update = section in SECTIONS and SECTIONS.index(section) >= SECTIONS.index("hooks")
    return step if after_update else step - 1


def last_logged_step(run_dir: Path) -> int:
    """The newest step metrics.jsonl logged (its last lines; 0 without one). Read before a resumed
    run's logger drops the lines of the steps a lost session trained past its checkpoint."""
    steps = [0]
    with contextlib.suppress(OSError), open(run_dir / METRICS_FILE, "rb") as fh:
        start = max(0, os.fstat(fh.fileno()).st_size - TAIL_BYTES)
        fh.seek(start)
        for line in fh.read().decode(errors="replace").splitlines()[1 if start else 0 :]:  # a cut first line
            if line.startswith('{"step": '):
                with contextlib.suppress(ValueError):
                    steps.append(int(line[9 : line.index(",")]))
    return max(steps)


def localize(run_dir: Path, since: float, archive_as: str, world: int = 0) -> dict[str, Any]:
    """The evidence of how the session that started at `since` (of `world` processes; 0: unknown)
    ended: kind, the ranks to blame, every rank's last record. Its hang stacks move to
    RUN_DIR/hangs/<archive_as>/."""
    ranks = {r["rank"]: r for r in _records(run_dir / RANKS, since)}
    hangs = [r for r in _records(run_dir / HANGS, since) if "section" in r]
    for hang in hangs:  # a peer's position as the heartbeat heard it (written at each section): the newer word
        for rank, heard in (hang.get("heard") or {}).items():
            if heard["time"] > ranks.get(int(rank), {}).get("time", 0.0):
                ranks[int(rank)] = {**ranks.get(int(rank), {"rank": int(rank)}), **heard}
    marked = read_mark(run_dir, since) is not None
    evidence: dict[str, Any] = {
        "ranks": {
            str(k): {key: r.get(key) for key in ("host", "node", "step", "section", "exit")}
            for k, r in sorted(ranks.items())
        },
        # the step a rank ended in (an exit record, a hang's stack) or rank 0's last completed one
        "step_exact": bool(hangs) or any(r.get("exit") for r in ranks.values()) or marked,
    }
    if hangs:
        blame = stopped(hangs, ranks)
        evidence.update(
            kind="hang",
            ranks_to_blame=blame["ranks"],
            silent=blame["silent"],
            section=blame["section"],
            stalled_s=max(h["seconds"] for h in hangs),
            timeout_s=min((h["timeout_s"] for h in hangs if h.get("raised")), default=None),
            stacks=_archive(run_dir, archive_as),
        )
        # when the job began to wait (goodput's `hang`, Ledger.hung): the silent rank's last word, else the section
        # that timed out began (the rank that raised the alarm)
        raised = [h for h in hangs if h.get("raised")] or hangs
        evidence["stalled_since"] = min(h.get("time", 0.0) - h["seconds"] for h in raised)
        if blame["silent"]:  # how old the silent rank's word is when the alarm was raised
            beat = ranks[blame["silent"][0]]
            evidence["beat_age_s"] = round(min(h.get("time", 0.0) for h in hangs) - beat.get("time", 0.0), 3)
            evidence["stalled_since"] = beat.get("time") or evidence["stalled_since"]
        return evidence
    excluded = sorted(k for k, r in ranks.items() if str(r.get("exit") or "").startswith("excluded"))
    if excluded:
        nodes = sorted({int(ranks[r].get("node") or 0) for r in excluded})
        evidence.update(kind="excluded", ranks_to_blame=excluded, nodes_to_blame=nodes)
        return evidence
    silent = sorted(k for k, r in ranks.items() if not r.get("exit"))
    restored = "" if ranks else restored_since(run_dir, since)
    if restored:  # a fresh machine: the records stayed in the run directory the session ran in
        evidence.update(kind="lost_elsewhere", ranks_to_blame=[], restored_from=restored)
    elif world == 1 and (silent or not ranks):  # one process: no rank was lost from a job that went on
        evidence.update(kind="lost_process", ranks_to_blame=[])
    elif silent and len(silent) == len(ranks):
        evidence.update(_lost_job(ranks))
    elif silent:
        evidence.update(kind="lost_rank", ranks_to_blame=silent)
        evidence.update(_lost_nodes(ranks, silent))
    elif ranks:  # one process alone too: its exit record is its error's (watchdogs.NoWatchdog)
        first = min(ranks.values(), key=lambda r: r["time"])
        evidence.update(kind="crash", ranks_to_blame=[first["rank"]] if world != 1 else [], error=first.get("exit"))
    else:  # no watchdog ran (resilience.watchdog off): nothing tells a lost rank from the whole job lost
        evidence.update(kind="lost_unknown", ranks_to_blame=[])
    return evidence


def reach_words(incident: dict[str, Any]) -> tuple[str, str]:
    """How far the lost session got and what it cost, in words: ("at step 26", "6 steps") when a
    rank recorded the step it ended in (an exit record, a hang's stack) or rank 0 its last
    completed step (goodput.step: `step_exact`); else the newest step any file recorded (the
    ranks' beats every resilience.beat_s, goodput.json every second, metrics.jsonl every
    train.log_every) is only a lower bound: the session may have trained on after it (a session
    from before goodput.step, or one whose rank 0 could not write it)."""
    step, lost = incident["step"], incident["steps_lost"]
    steps = f"{lost} step" if lost == 1 else f"{lost} steps"
    if incident.get("step_exact", True):  # a journal from before the key: as it was said then
        return f"at step {step}", steps
    return f"after step {step} (the newest its files recorded)", f"at least {steps}"


def _lost_job(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """lost_job evidence: every rank silent. None failed in a collective (it would have left that
    error), so no rank is to blame: the job ended whole, by its nodes and hosts (all of them) and how
    far apart their last beats are (within resilience.beat_s: at once)."""
    times = [float(r.get("time", 0.0)) for r in ranks.values()]
    return {
        "kind": "lost_job",
        "ranks_to_blame": [],
        "nodes": sorted({int(r.get("node") or 0) for r in ranks.values()}),
        "hosts": sorted({str(r.get("host")) for r in ranks.values()}),
        "beats_within_s": round(max(times) - min(times), 3),
    }


def _lost_nodes(ranks: dict[int, dict[str, Any]], silent: list[int]) -> dict[str, Any]:
    """lost_node evidence when the silent ranks are whole nodes and some node spoke; else nothing."""
    nodes: dict[int, set[int]] = {}
    for rank, record in ranks.items():
        nodes.setdefault(int(record.get("node") or 0), set()).add(rank)
    gone = sorted(n for n, members in nodes.items() if members <= set(silent))
    if not gone or len(gone) == len(nodes) or {r for n in gone for r in nodes[n]} != set(silent):
        return {}
    hosts = sorted({ranks[r].get("host") for n in gone for r in nodes[n]})
    return {"kind": "lost_node", "nodes_to_blame": gone, "hosts_to_blame": hosts}


def _records(folder: Path, since: float) -> list[dict[str, Any]]:
    """The JSON records in `folder` written by the session that started at `since`. This
    session's ranks may beat before rank 0 reads: each moves the lost session's beat aside first
    (rankR.lost.json, then its own rankR.json), so a record of this session is passed over for
    the one moved aside."""
    now, ranks = session(), set()
    for path in folder.glob("rank*.json") if folder.is_dir() else []:
        ranks.add(path.name.split(".")[0])
    records = []
    for name in sorted(ranks):
        for path in (folder / f"{name}.json", folder / f"{name}{LOST}"):  # written last, moved first
            record = read_json(path)
            if not isinstance(record, dict) or "rank" not in record or (now and record.get("session") == now):
                continue
            if record.get("time", 0) >= since:
                records.append(record)
            break
    return records


def _archive(run_dir: Path, name: str) -> str:
    """hangs/'s files of the lost session into hangs/<name>/ (a later hang writes afresh)."""
    folder, target = run_dir / HANGS, run_dir / HANGS / name
    target.mkdir(parents=True, exist_ok=True)
    for path in list(folder.glob("rank*.*")) + [folder / ALARM]:
        if path.is_file():
            shutil.move(str(path), target / path.name)
    return str(target.relative_to(run_dir))
