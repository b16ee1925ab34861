"""The run lock and its heartbeat: who may train a run directory, and whether it is alive."""

import json
import os
import socket
import time

import pytest

from trimtab import rundir
from trimtab.errors import RunStateError
from trimtab.rundir import LOCK, liveness, run_lock


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
    monkeypatch.setattr(rundir, "BEAT_S", 0.05)
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
