"""The run lock and its heartbeat: who may train a run directory, and whether it is alive."""

import fcntl
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from trimtab import runlock
from trimtab.cli import main
from trimtab.errors import RunStateError
from trimtab.rundir import LOCK
from trimtab.runlock import liveness, run_lock


def test_one_holder_at_a_time_and_released_at_the_end(tmp_path):
    assert liveness(tmp_path) == (False, "no heartbeat: never started")
    with run_lock(tmp_path):
        record = json.loads((tmp_path / LOCK).read_text())
        assert record["pid"] == os.getpid() and "ended" not in record
        alive, evidence = liveness(tmp_path)
        assert alive and evidence.startswith(f"locked by pid {os.getpid()} on ")
        with pytest.raises(RunStateError, match=f"being trained by pid {os.getpid()} on .*ctl .* stop"):
            with run_lock(tmp_path):
                pass
    alive, evidence = liveness(tmp_path)
    assert not alive and evidence == "ended 0 s ago"
    with run_lock(tmp_path):  # free again
        assert liveness(tmp_path)[0]


def test_the_heartbeat_beats_while_the_run_lives(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "BEAT_S", 0.05)
    with run_lock(tmp_path):
        os.utime(tmp_path / LOCK, (0, 0))
        time.sleep(0.5)
        assert time.time() - (tmp_path / LOCK).stat().st_mtime < 5


def test_another_node_goes_by_the_heartbeat(tmp_path):
    """A holder on another host whose flock this node cannot see: alive while its heartbeat is fresh."""
    lock = tmp_path / LOCK
    lock.write_text(json.dumps({"pid": 7, "host": "elsewhere", "started": time.time()}))
    alive, evidence = liveness(tmp_path)
    assert alive and evidence.startswith("heartbeat 0 s ago from pid 7 on elsewhere")
    os.utime(lock, (time.time() - 180, time.time() - 180))
    assert liveness(tmp_path) == (False, "last heartbeat 3 min ago")


def test_a_crashed_run_on_this_host_is_not_running_despite_a_fresh_heartbeat(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 7, "host": socket.gethostname(), "started": time.time()}))
    assert liveness(tmp_path) == (False, "last heartbeat 0 s ago")


def test_a_run_that_fails_before_writing_leaves_no_directory(tmp_path):
    run = tmp_path / "new" / "r"
    with pytest.raises(ValueError), run_lock(run):
        raise ValueError("bad input")
    assert not run.exists()


def test_an_out_whose_name_is_too_long_is_refused_naming_the_key(tmp_path, capsys):
    # soak: a sweep's run directory named after its every setting; the first stat of it raised
    # ENAMETOOLONG, a traceback, before the lock that names --out for the other errors
    out = tmp_path / ("lr1e-3_" * 40)
    assert main(["train", "--preset", "debug", "--out", str(out), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"out '{out}' (--out)" in err and "File name too long" in err and "shorter" in err
    assert "Traceback" not in err


def as_rank(monkeypatch, rank: int, job: str = "job-a") -> None:
    """This process as torchrun's rank `rank` of a two-rank job (its rendezvous `job`)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)


def test_other_ranks_refuse_with_rank_0_when_another_job_holds_the_run(tmp_path, monkeypatch):
    """Rank 1 does not go on to wait for a refused rank 0 in the process group (until torchrun's
    agent killed it, 30 s on): it refuses itself, in the same words, within seconds."""
    monkeypatch.setattr(runlock, "REFUSAL_GRACE_S", 0.1)
    with run_lock(tmp_path):  # another `trimtab train`: outside torchrun
        as_rank(monkeypatch, 1)
        start = time.monotonic()
        with pytest.raises(RunStateError, match=f"being trained by pid {os.getpid()} on .*ctl .* stop"):
            with run_lock(tmp_path):
                pass
        assert time.monotonic() - start < 5


def test_other_ranks_go_on_once_their_own_rank_0_holds_the_run(tmp_path, monkeypatch):
    as_rank(monkeypatch, 0)
    with run_lock(tmp_path):  # rank 0 of this job
        assert json.loads((tmp_path / LOCK).read_text())["job"] == "job-a"
        as_rank(monkeypatch, 1)
        start = time.monotonic()
        with run_lock(tmp_path):
            assert time.monotonic() - start < 1


def test_a_sigterm_while_refused_ends_with_the_refusal(tmp_path, monkeypatch):
    """torchrun's agent stops every rank once one ends: a rank already refused says why, not
    "stopped during start-up"."""
    monkeypatch.setattr(runlock, "REFUSAL_GRACE_S", 30.0)
    with run_lock(tmp_path):
        as_rank(monkeypatch, 0, job="job-b")
        stop = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        stop.start()
        start = time.monotonic()
        try:
            with pytest.raises(RunStateError, match="being trained by"):
                with run_lock(tmp_path):
                    pass
        finally:
            stop.cancel()
        assert 1.0 <= time.monotonic() - start < 5  # in the grace, ended by the SIGTERM


@pytest.mark.distributed
def test_a_torchrun_job_refused_ends_on_every_rank_at_once(tmp_path):
    """`trimtab train` under torchrun on a run another process trains: both ranks say why and
    end, rather than rank 1 waiting in the process group until the agent's SIGKILL (30 s)."""
    from helpers import FAST, SRC, TORCHRUN, TRIMTAB_MAIN

    run = tmp_path / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}
    launch = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor-interval=0.1", TRIMTAB_MAIN]
    with run_lock(run):
        done = subprocess.run(
            [*launch, "train", "--preset", "debug", "--out", str(run), *FAST],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert done.stderr.count(f"trimtab: error: '{run}' is being trained by pid {os.getpid()}") == 2, done.stderr
    assert "via SIGKILL" not in done.stderr and "during start-up" not in done.stderr


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_run_whose_directory_is_deleted_or_replaced_ends_at_once(tmp_path, monkeypatch, capfd, how):
    """rm -rf RUN while it trained, then the same command again: the new run took a new lock at
    once, and the old process, its flock on a file no longer there, wrote beside it into one
    directory. The heartbeat sees the lock file gone (or another in its place) and ends the
    process at once, saying why (exit 4): a stop that saves would write there."""
    monkeypatch.setattr(runlock, "CHECK_S", 0.02)
    exits = []
    monkeypatch.setattr(runlock.os, "_exit", exits.append)
    run_dir = tmp_path / "r"
    with run_lock(run_dir):
        time.sleep(0.1)
        assert exits == []  # its own lock there: beats on
        (run_dir / LOCK).unlink()
        if how == "replaced":  # a new run's lock in its place
            (run_dir / LOCK).write_text("{}")
        deadline = time.time() + 5
        while not exits and time.time() < deadline:
            time.sleep(0.02)
    assert exits[:1] == [4]
    err = capfd.readouterr().err
    assert f"{run_dir / LOCK} was removed or replaced while this run trained" in err and "--out" in err


def _rank_0_holds(run_dir, job: str = "job-a") -> int:
    """Rank 0 of `job` holding run_dir's lock, as run_lock writes it (here, another open file of this process)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 1.0, "job": job}).encode())
    return fd


def test_the_other_ranks_end_at_once_with_rank_0_when_the_lock_is_removed(tmp_path, monkeypatch):
    """rm RUN/.lock under torchrun: rank 0 ended at once (exit 4), rank 1 trained on and, SIGTERMed by the
    agent, wrote an emergency save there (rm -> exit 9 s, step_N written). Rank 1 now watches the lock it
    saw its rank 0 take and ends too (exit 4); a lock there all along, it goes on."""
    monkeypatch.setattr(runlock, "CHECK_S", 0.02)
    exits = []
    monkeypatch.setattr(runlock.os, "_exit", exits.append)
    fd = _rank_0_holds(tmp_path)
    as_rank(monkeypatch, 1)
    try:
        with run_lock(tmp_path):
            time.sleep(0.1)
            assert exits == []  # its job's lock there: trains on
            (tmp_path / LOCK).unlink()
            deadline = time.time() + 5
            while not exits and time.time() < deadline:
                time.sleep(0.02)
            assert exits[:1] == [4]
    finally:
        os.close(fd)


def test_a_sigterm_after_the_lock_was_removed_ends_a_rank_at_once_writing_nothing(tmp_path, monkeypatch):
    """torchrun's SIGTERM reaches rank 1 as rank 0 ends for its lost lock: no stop that saves, no summary."""
    from trimtab.training.services.signals import StartUpInterrupted, handle_signals

    monkeypatch.setattr(runlock, "CHECK_S", 60.0)  # the watch is not what ends it here
    exits = []
    monkeypatch.setattr(runlock.os, "_exit", exits.append)
    fd = _rank_0_holds(tmp_path)
    as_rank(monkeypatch, 1)
    try:
        with handle_signals(run_dir=tmp_path) as handler, run_lock(tmp_path):
            (tmp_path / LOCK).unlink()
            with pytest.raises(StartUpInterrupted):  # what follows an os._exit that returned (patched here)
                handler(signal.SIGTERM, None)
            assert exits == [4]
    finally:
        os.close(fd)
