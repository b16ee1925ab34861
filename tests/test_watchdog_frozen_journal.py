"""A frozen rank is named where it froze: its beat file is written as the loop enters a section
(at most once a second), so a rank stopped with its watchdog thread (SIGSTOP, a deadlock holding
the GIL) leaves the step and section it froze in, not what its timer last wrote; and the rank that
raised the alarm (it only waited in a collective) names the frozen one on the console. Torch-free
processes, one thread of work each."""

import os
import signal
import socket
import subprocess
import sys

from helpers import SRC
from trimtab.resilience import watchdog
from trimtab.resilience.beats import stopped
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.incidents import localize
from trimtab.resilience.watchdog import SECTION_BEAT_S, Watchdog
from trimtab.rundir import read_json, write_json

# argv: run dir, rank, first_timeout_s. Rank 1 runs a long `sync` of step 6 (its timer writes once,
# 0.5 s in, beat_s being long), enters `data` of step 7 and waits there; rank 0 enters
# `forward_backward` of step 7 and waits (in a collective, for rank 1).
RANK = """
import sys, time
from trimtab.resilience import watchdog
from trimtab.resilience.elastic import SESSION_ENV
watchdog.GRACE_S = 1.0  # the frozen rank never answers: no need to wait 5 s for its stack
run_dir, rank, first = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
dog = watchdog.Watchdog(run_dir, rank, 2, first_timeout_s=first, timeout_factor=5.0, min_timeout_s=first, beat_s=60.0)
dog.start()
if rank == 1:
    dog.beat("sync", 6)
    time.sleep(1.3)
    dog.beat("data", 7)
else:
    dog.beat("data", 7)
    dog.beat("forward_backward")
print("ready", flush=True)
sys.stdin.readline()
"""


def start(run_dir, rank: int, first_timeout_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(run_dir), str(rank), str(first_timeout_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"},
    )


def test_a_frozen_rank_is_named_in_the_section_and_step_it_froze_in(tmp_path, monkeypatch):
    """Rank 1 freezes (SIGSTOP) in `data` of step 7; rank 0's watchdog ends its wait in
    `forward_backward`, raises the alarm, kills the silent rank 1. The lost session's evidence
    blames rank 1 in `data` at step 7 (its timer's only write said `sync` of step 6), and rank 0's
    console line says rank 1 stopped there, not that rank 0 hung."""
    monkeypatch.delenv(SESSION_ENV, raising=False)  # the lost session's and the reader's (another test's) differ
    frozen = start(tmp_path, 1, 600.0)
    waiting = None
    try:
        assert frozen.stdout.readline() == "ready\n"
        os.kill(frozen.pid, signal.SIGSTOP)
        waiting = start(tmp_path, 0, 1.5)
        assert waiting.stdout.readline() == "ready\n"
        assert waiting.wait(timeout=30) == watchdog.HUNG
        assert frozen.wait(timeout=10) == -signal.SIGKILL  # killed by rank 0: it could not take a SIGTERM
    finally:
        for proc in (frozen, waiting):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    said = waiting.stderr.read()
    assert "trimtab: rank 0 waited" in said and "in forward_backward at step 7" in said, said
    assert "rank 1 stopped in data at step 7 and did not answer the alarm" in said, said
    evidence = localize(tmp_path, 0.0, "session1")
    assert evidence["kind"] == "hang" and evidence["ranks_to_blame"] == [1] and evidence["silent"] == [1]
    assert evidence["section"] == "data" and evidence["ranks"]["1"]["step"] == 7
    assert evidence["ranks"]["0"]["section"] == "forward_backward"
    assert 0.0 <= evidence["beat_age_s"] < 10.0


def test_the_loop_writes_its_beat_on_a_section_change_at_most_once_a_second(tmp_path, monkeypatch):
    """The loop's own writes: the first section at once, then none for the many sections of fast
    steps within SECTION_BEAT_S (not a write per section per step), and the next section once a
    second has passed since the last write (after a long section)."""
    writes: list[dict] = []
    real = watchdog.write_json
    monkeypatch.setattr(watchdog, "write_json", lambda path, data, **kw: (writes.append(data), real(path, data, **kw)))
    (tmp_path / "ranks").mkdir()
    dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=60.0, beat_s=1e12)
    dog.beat("data", 7)
    for step in range(8, 58):  # 50 fast steps
        for section in ("data", "forward_backward", "sync", "optimizer", "hooks"):
            dog.beat(section, step if section == "data" else None)
    assert len(writes) <= 2 and writes[0]["section"] == "data" and writes[0]["step"] == 7
    dog._last_beat_file -= SECTION_BEAT_S  # a second since the last write: a long section
    dog.beat("checkpoint")
    assert read_json(tmp_path / "ranks" / "rank0.json")["section"] == "checkpoint"
    assert read_json(tmp_path / "ranks" / "rank0.json")["step"] == 57


def test_when_every_rank_answered_the_one_furthest_behind_is_blamed():
    """Every rank wrote its stack: the rank still in an earlier step is the one the others wait
    for, even when its section comes later in a step than theirs (a save of step 7 against the
    data of step 8)."""
    hangs = [
        {"rank": 0, "step": 8, "section": "data"},
        {"rank": 1, "step": 7, "section": "checkpoint"},
        {"rank": 2, "step": 8, "section": "forward_backward"},
    ]
    blame = stopped(hangs, {0: {}, 1: {}, 2: {}})
    assert (blame["ranks"], blame["silent"], blame["section"], blame["step"]) == ([1], [], "checkpoint", 7)
    assert stopped(hangs[:1] + hangs[2:], {0: {}, 2: {}})["ranks"] == [0]
    mute = stopped(hangs[:1], {0: {}, 1: {"section": "optimizer", "step": 8}})
    assert (mute["ranks"], mute["silent"], mute["section"], mute["step"]) == ([1], [1], "optimizer", 8)


def test_a_silent_rank_on_another_host_is_named_with_its_host(tmp_path, monkeypatch):
    """torchrun --nnodes 2: rank 1, on node 1's host, froze in `sync`; rank 0's line named the rank alone, and
    its SIGKILL of silent ranks reaches this host's only: the line names the host and who ends the rank."""
    monkeypatch.setenv(SESSION_ENV, "s1")
    (tmp_path / "ranks").mkdir()
    beat = {"rank": 1, "host": "gpu-node-7", "node": 1, "pid": 1, "step": 25, "section": "sync", "session": "s1"}
    write_json(tmp_path / "ranks" / "rank1.json", beat)
    dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=10.0, beat_s=60.0)
    said = dog._hung_words("forward_backward", 11.0, 10.0, tmp_path / "hangs")
    assert "rank 1 stopped in sync at step 25 and did not answer the alarm" in said, said
    assert said.endswith(
        "; on host gpu-node-7 (node 1): another host, ended by its torchrun agent (SIGKILL 30 s after its SIGTERM, "
        "if frozen)"
    ), said
    write_json(tmp_path / "ranks" / "rank1.json", {**beat, "host": socket.gethostname()})  # this host: killed here
    said = dog._hung_words("forward_backward", 11.0, 10.0, tmp_path / "hangs")
    assert said.endswith(f"; on host {socket.gethostname()} (node 1)"), said
