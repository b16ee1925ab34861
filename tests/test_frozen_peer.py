"""A peer frozen under torchrun (SIGSTOP: no socket closes, no collective fails): the survivor's watchdog finds it
(its heartbeat, or the section's timeout), kills it (same host), and leaves its loop, whose collective then fails,
to save the last completed step alone before the process ends as a hang (exit 5): before, it ended at once and the
restart trained the steps since the last checkpoint again. The restart books the wait as goodput's `hang`, not
`other`, and its journal line says how long. Torch-free: a stopped process, a bare watchdog, a ledger. The run
under torchrun: tests/test_resilience.py (a process frozen from outside)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from trimtab.orchestrator import restarts
from trimtab.resilience import watchdog
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.goodput import Ledger, read_goodput
from trimtab.resilience.watchdog import HUNG, Watchdog
from trimtab.rundir import read_json, write_json


@pytest.fixture
def frozen(tmp_path, monkeypatch):
    """Rank 1 of this host, stopped (SIGSTOP) in forward_backward of step 16; rank 0's watchdog, whose os._exit
    raises SystemExit, in the same section, its timeout just passed."""
    monkeypatch.setenv(SESSION_ENV, "s1")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    (tmp_path / "ranks").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGSTOP)
    beat = {"rank": 1, "host": socket.gethostname(), "node": 0, "pid": proc.pid, "step": 16, "session": "s1"}
    write_json(tmp_path / "ranks" / "rank1.json", {**beat, "section": "forward_backward", "time": time.time()})
    dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=10.0, beat_s=60.0)
    dog.beat("forward_backward", 16)
    yield dog, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_survivor_that_killed_a_frozen_peer_lets_its_loop_save_then_ends_as_a_hang(frozen, tmp_path, capfd):
    """Rank 1 frozen: rank 0's watchdog kills it, and its loop (here a thread), whose collective failed for it,
    sets loss_known and beats its emergency save's section: the watchdog returns instead of ending the process
    (before: os._exit(5) at once, no save). The loop's error then ends it through stop(): exit 5, a hang's, and the
    exit record the hang's, the loop's error after it."""
    dog, proc = frozen
    dog.rescue_s = 5.0

    def loop_saves() -> None:
        while proc.poll() is None:  # its collective fails as rank 1's sockets close
            time.sleep(0.01)
        dog.loss_known = True
        dog.beat("checkpoint", 15)

    saver = threading.Thread(target=loop_saves)
    saver.start()
    began = time.monotonic()
    dog._end(raised=True, section="forward_backward", elapsed=11.0, limit=10.0)  # returns: no SystemExit
    saver.join()
    assert proc.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - began < 3.0
    said = capfd.readouterr().err
    assert "rank 1 stopped in forward_backward at step 16 and did not answer the alarm" in said, said
    assert "killed rank 1 (SIGKILL: frozen on this host)" in said and "(an emergency save)" in said, said
    with pytest.raises(SystemExit) as ended:
        dog.stop("RuntimeError: Connection closed by peer")
    assert ended.value.code == HUNG
    exit_record = read_json(tmp_path / "ranks" / "rank0.json")["exit"]
    assert exit_record == "hung in forward_backward (RuntimeError: Connection closed by peer)", exit_record


def test_without_the_loops_save_the_survivor_ends_as_a_hang_within_its_bound(frozen):
    """The loop never saves (in no collective, or one that does not fail): the process ends, exit 5, rescue_s
    after the kill; a bare watchdog (rescue_s 0: no loop that saves, tests' and one process's) at once."""
    dog, proc = frozen
    dog.rescue_s = 0.5
    began = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        dog._end(raised=True, section="forward_backward", elapsed=11.0, limit=10.0)
    assert ended.value.code == HUNG and 0.5 <= time.monotonic() - began < 3.0
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_a_hang_s_wait_is_booked_as_hang_and_said_in_the_restarts_line(tmp_path, monkeypatch):
    """A session lost to a frozen rank 1: its ledger last written at w, rank 1's last word w + 0.5, rank 0's
    alarm w + 5.5 and its exit w + 6. The restart moves the 5.5 s from rank 1's last word to the session's end
    from `other` (all 6 s of it before) to `hang`; the journal's evidence has hang_s, its line says it; the
    run's wall time and ETTR are unchanged."""
    ledger = Ledger(tmp_path)
    ledger.open(time.time() - 30.0, 0, 2, 0, 0.0)
    ledger.step(6, 1.0)
    ledger.write(force=True)
    w, before = ledger.session["beat"], ledger.summary()
    other_before = ledger.session["seconds"]["other"]
    host, pid = socket.gethostname(), os.getpid()
    (tmp_path / "ranks").mkdir()
    (tmp_path / "hangs").mkdir()
    rank: dict[str, Any] = {"host": host, "node": 0, "pid": pid, "step": 7, "section": "forward_backward"}
    write_json(tmp_path / "ranks" / "rank0.json", {**rank, "rank": 0, "time": w + 6.0, "session": "s1", "exit": "hung"})
    write_json(tmp_path / "ranks" / "rank1.json", {**rank, "rank": 1, "time": w + 0.5, "session": "s1"})
    alarm = {**rank, "rank": 0, "seconds": 5.2, "timeout_s": 60.0, "raised": True, "time": w + 5.5, "heard": {}}
    write_json(tmp_path / "hangs" / "rank0.json", alarm)
    monkeypatch.setenv(SESSION_ENV, "s2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(restarts, "process_started", lambda: w + 8.0)
    proposed: list[Any] = []
    run = SimpleNamespace(is_main=True, step=6, world=2, say=print, propose=proposed.append, data_position="")
    restarts.Resilience(tmp_path).on_train_start(run)
    (finding,) = proposed
    evidence = finding.evidence
    assert evidence["kind"] == "hang" and evidence["silent"] == [1] and evidence["steps_lost"] == 0
    assert abs(evidence["hang_s"] - 5.5) < 0.01 and "5.5 s waiting on the hang" in finding.summary, finding.summary
    totals = read_goodput(tmp_path)
    assert abs(totals["seconds"]["hang"] - 5.5) < 0.01
    assert abs(totals["seconds"]["other"] - (other_before + 0.5)) < 0.01  # the 6 s it lived on, less the hang's
    assert abs(totals["wall_s"] - before["wall_s"] - 6.0 - 2.0) < 0.05  # 6 s lived on, 2 s down: as before
