"""The run lock: one `trimtab train` per run directory, with a heartbeat that says it is alive.

While a run trains, its process (rank 0 under torchrun) holds an exclusive flock on RUN_DIR/.lock,
a JSON file {pid, host, started}, and a daemon thread touches the file every BEAT_S seconds. A
second `trimtab train` on the directory fails at once instead of interleaving its checkpoints with
the first's, and `trimtab ctl` asks liveness() before dropping a command that would otherwise
wait, unnoticed, for the next resume. The kernel drops a flock with its process, so a crash or a
SIGKILL never leaves a stale lock; the file stays, and its mtime is the last heartbeat. On the
lock holder's host the flock decides; another node sharing the filesystem (where flock may be
local to each node) goes by the heartbeat: fresh within STALE_S means alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trimtab.errors import RunStateError

LOCK = ".lock"
BEAT_S = 15.0  # the heartbeat's period
STALE_S = 60.0  # no heartbeat for this long: not alive (four beats missed)
RETRIES = 10  # x 50 ms: a liveness() probe holds the lock for microseconds


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold run_dir's lock and beat its heartbeat for the block (on rank 0; other ranks pass)."""
    if os.environ.get("RANK", "0") != "0":  # torchrun's rank, set before the process group exists
        yield
        return
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, run_dir)
        _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        stop = threading.Event()
        beat = threading.Thread(target=_beat, args=(fd, stop), daemon=True, name="trimtab-heartbeat")
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()
            with contextlib.suppress(OSError):  # over: other nodes need not wait out the heartbeat
                _write(fd, {**_holder(run_dir), "ended": time.time()})
    finally:
        os.close(fd)  # releases the flock
        if created:
            _remove_if_empty(run_dir)


def liveness(run_dir: str | Path) -> tuple[bool, str]:
    """(whether a `trimtab train` is running run_dir now, the evidence in a few words)."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, "no heartbeat: never started"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: two probes never block each other
    except BlockingIOError:
        return True, f"locked by {_describe(_holder(run_dir))}"
    finally:
        os.close(fd)  # releases the probe's lock
    holder, age = _holder(run_dir), time.time() - path.stat().st_mtime
    if "ended" in holder:
        return False, f"ended {_ago(age)} ago"
    if holder.get("host") != socket.gethostname() and age < STALE_S:
        return True, f"heartbeat {_ago(age)} ago from {_describe(holder)}"
    return False, f"last heartbeat {_ago(age)} ago"


def _acquire(fd: int, run_dir: Path) -> None:
    for _ in range(RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
    raise RunStateError(
        f"'{run_dir}' is being trained by {_describe(_holder(run_dir))}; one `trimtab train` per run "
        f"directory: wait for it to end, or stop it with `trimtab ctl {run_dir} stop`"
    )


def _write(fd: int, record: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _beat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(BEAT_S):
        with contextlib.suppress(OSError):  # a full or vanished disk must not end the run
            os.utime(fd)


def _remove_if_empty(run_dir: Path) -> None:
    """A run that failed before writing anything (bad input) leaves no directory behind."""
    with contextlib.suppress(OSError):
        if [p.name for p in run_dir.iterdir()] == [LOCK]:
            (run_dir / LOCK).unlink()
            run_dir.rmdir()


def _holder(run_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((run_dir / LOCK).read_text())
    except (OSError, ValueError):  # not written yet (the holder started a moment ago)
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if "pid" not in holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder['pid']} on {holder.get('host', '?')} (since {since})"


def _ago(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
