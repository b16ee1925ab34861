"""After a restart, a section's first run is timed by the session before's longest run of it (the
ranks' beat files keep it): a rank frozen in the first step after a restart is found in about the
usual timeout, not after first_timeout_s (30 minutes) or the process group's timeout. Torch-free
processes, one thread of work each."""

import os
import signal
import subprocess
import sys
import time

from helpers import SRC
from trimtab.resilience import watchdog
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.watchdog import Watchdog
from trimtab.rundir import read_json

FIRST_S = 600.0  # first_timeout_s of the restarted session: what a first run waited before
TIMES = {"timeout_factor": 5.0, "min_timeout_s": 1.0, "beat_s": 60.0}

# argv: run dir, rank. The restarted session: rank 1 enters `data` of step 5 (then is frozen from
# outside); rank 0 enters `forward_backward` of step 5, its first in this process, and waits there (in
# a collective, for rank 1).
RANK = f"""
import sys
from trimtab.resilience import watchdog
watchdog.GRACE_S = 1.0  # the frozen rank never answers: no need to wait 5 s for its stack
run_dir, rank = sys.argv[1], int(sys.argv[2])
dog = watchdog.Watchdog(run_dir, rank, 2, first_timeout_s={FIRST_S}, **{TIMES})
dog.start()
dog.beat("data", 5)
if rank == 0:
    dog.beat("forward_backward")
print("ready", flush=True)
sys.stdin.readline()
"""


def session_before(run_dir, monkeypatch) -> None:
    """The lost session: two ranks that ran a few short steps, their beat files left behind."""
    monkeypatch.setenv(SESSION_ENV, "before")
    dogs = [Watchdog(run_dir, rank, 2, first_timeout_s=FIRST_S, **TIMES).start() for rank in (0, 1)]
    for step in (1, 2):
        for section in ("data", "forward_backward", "sync", "optimizer", "hooks"):
            for dog in dogs:
                dog.beat(section, step)
            time.sleep(0.02)
    for dog in dogs:
        dog.stop("killed")
    monkeypatch.setenv(SESSION_ENV, "after")


def start(run_dir, rank: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(run_dir), str(rank)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", SESSION_ENV: "after"},
    )


def test_a_rank_frozen_in_the_first_step_after_a_restart_is_found_in_the_usual_timeout(tmp_path, monkeypatch):
    session_before(tmp_path, monkeypatch)
    frozen = start(tmp_path, 1)
    waiting = None
    try:
        assert frozen.stdout.readline() == "ready\n"
        os.kill(frozen.pid, signal.SIGSTOP)
        began = time.monotonic()
        waiting = start(tmp_path, 0)
        assert waiting.stdout.readline() == "ready\n"
        assert waiting.wait(timeout=15) == watchdog.HUNG
        assert frozen.wait(timeout=10) == -signal.SIGKILL  # killed by rank 0: it could not take a SIGTERM
        took = time.monotonic() - began
    finally:
        for proc in (frozen, waiting):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    hang = read_json(tmp_path / "hangs" / "rank0.json")
    assert (hang["section"], hang["step"], hang["timeout_s"]) == ("forward_backward", 5, 1.0)  # min_timeout_s
    assert took < 10.0, took
    said = waiting.stderr.read()
    assert "rank 1 stopped in data at step 5 and did not answer the alarm" in said, said
    # the session before's longest forward_backward, kept aside by rank 0's first beat of this one;
    # on one rank of the two the same step is twice the work; a rank not in the session before has none
    longest = read_json(tmp_path / "ranks" / "rank0.lost.json")["longest"]["forward_backward"]
    half = Watchdog(tmp_path, 0, 1, first_timeout_s=FIRST_S, **TIMES)
    assert 0.0 < longest < 0.2 and half.before["forward_backward"] == 2 * longest and "start-up" not in half.before
    assert Watchdog(tmp_path, 3, 4, first_timeout_s=FIRST_S, **TIMES).before == {}
