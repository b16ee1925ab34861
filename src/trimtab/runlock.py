"""The run lock (RUN_DIR/.lock) of a run directory (rundir.py).

While a run trains, its process (rank 0 under torchrun) holds an exclusive flock on
RUN_DIR/.lock, a JSON file {pid, host, started}, and a daemon thread touches the file every BEAT_S
seconds. A second `trimtab train` on the directory fails at once instead of interleaving its
checkpoints with the first's, and `trimtab ctl` asks liveness() before dropping a command that
would otherwise wait, unnoticed, for the next resume. The kernel drops a flock with its process, so
a crash or a SIGKILL never leaves a stale lock; the file stays, and its mtime is the last
heartbeat. On the lock holder's host the flock decides; another node sharing the filesystem (where
flock may be local to each node) goes by the heartbeat: fresh within STALE_S means alive.
Under torchrun the record also names the job (its rendezvous), and every other rank waits until the
lock is its own job's, or refuses as rank 0 does once another holds it past rank 0's own tries:
a refused job's ranks all exit at once with the same message (they would otherwise wait for rank 0
in the process group until torchrun's agent killed them, 30 s on).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from trimtab.errors import ConfigError, RunStateError
from trimtab.rundir import LOCK, read_json

BEAT_S = 15.0  # the heartbeat's period
CHECK_S = 0.5  # how often the heartbeat looks that its lock file is still its own (_beat): two stats
STALE_S = 60.0  # no heartbeat for this long: not alive (four beats missed)
RETRIES = 10  # x 50 ms: a liveness() probe holds the lock for microseconds
RANK_WAIT_S = 120.0  # how long a rank other than 0 waits for its job's rank 0 to take the lock
REFUSED_S = 2 * RETRIES * 0.05  # another holder kept the lock this long: the other ranks refuse as rank 0 does
REFUSAL_GRACE_S = 2.0  # rank 0 refused under torchrun: how long before it ends (the others refuse meanwhile)
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # a read-only mount, a directory not this user's
LOST_EXIT = 4  # the storage code (docs/orchestrator.md: exit 4)
# each run directory's lock file (st_dev, st_ino) as this process holds it (rank 0) or saw its job's rank 0
# take it (another rank on rank 0's node): lock_lost compares the file at the path now with it
_HELD: dict[Path, tuple[int, int]] = {}


def _not_a_directory(run_dir: Path) -> str:
    """Why out cannot be the run's directory. A link made before its target (`ln -s /scratch/r1 runs/r1`)
    fails mkdir as a file there does: it was called a file, and the fix is to make the target."""
    if run_dir.is_symlink() and not run_dir.exists():
        return (
            f"out '{run_dir}' (--out) is a symbolic link to '{os.readlink(run_dir)}', which does not exist; "
            "make that directory (mkdir -p) or give a run directory's path"
        )
    return f"out '{run_dir}' (--out) is or lies under a file, not a directory; give a run directory's path"


def _not_writable(run_dir: Path, exc: OSError) -> str:
    """Why out cannot be trained in: a read-only filesystem or a directory this user may not write
    (a run writes checkpoints, metrics and the journal there; nothing in it is changed by refusing)."""
    trained = (
        f" (to train on from this run: --set train.init_from={run_dir})" if (run_dir / "config.yaml").is_file() else ""
    )
    return (
        f"out '{run_dir}' (--out) cannot be written ({exc.strerror}: {exc.filename}); a run writes its "
        "checkpoints and journal there: make it writable (remount it read-write, chmod u+w) and run the same "
        f"command again, or give another --out{trained}"
    )


def check_out(run_dir: Path) -> None:
    """Refuse an out the filesystem cannot name, naming the key, before anything reads it: a name in
    it over the filesystem's limit (255 bytes on most; a sweep's directory named after its every
    setting) fails the first stat with ENAMETOOLONG: a traceback, not the key, before this."""
    try:
        run_dir.exists()  # Path.exists passes over a missing or not-a-directory path: this raises the rest
    except OSError as exc:
        fix = "give a shorter --out" if exc.errno == errno.ENAMETOOLONG else "give another --out"
        raise ConfigError(f"out '{run_dir}' (--out) cannot be used ({exc.strerror}); {fix}") from None


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold run_dir's lock and beat its heartbeat for the block (on rank 0; other ranks pass).
    A run_dir that is a file, or under one, is refused naming the key (out) before anything."""
    if os.environ.get("RANK", "0") != "0":  # torchrun's rank, set before the process group exists
        if os.environ.get("GROUP_RANK", "0") == "0":  # rank 0's node: its filesystem (another's may be its own)
            _wait_for_rank0(run_dir)
        with _watching(run_dir):
            yield
        return
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # it, or a folder above it, is a file
        raise ConfigError(_not_a_directory(run_dir)) from None
    except OSError as exc:
        raise ConfigError(_not_writable(run_dir, exc)) if exc.errno in UNWRITABLE else exc from None
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(_not_writable(run_dir, exc)) if exc.errno in UNWRITABLE else exc from None
    try:
        _acquire(fd, run_dir)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "job": _job()}
        if os.fstat(fd).st_size:  # the last heartbeat of the session before (a restart reads it)
            record["previous_beat"] = os.fstat(fd).st_mtime
        _write_lock(fd, record)
        stop = threading.Event()
        beat = threading.Thread(target=_beat, args=(fd, stop, run_dir / LOCK), daemon=True, name="trimtab-heartbeat")
        beat.start()
        _HELD[run_dir] = _identity(os.fstat(fd))
        try:
            yield
        finally:
            _HELD.pop(run_dir, None)
            stop.set()
            beat.join()
            with contextlib.suppress(OSError):  # over: other nodes need not wait out the heartbeat
                _write_lock(fd, {**lock_holder(run_dir), "ended": time.time()})
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
        return True, f"locked by {_describe(lock_holder(run_dir))}"
    finally:
        os.close(fd)  # releases the probe's lock
    holder, age = lock_holder(run_dir), time.time() - path.stat().st_mtime
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
    _refuse(run_dir)


def _job() -> str | None:
    """This torchrun job's identity, the same on all its ranks (None outside torchrun)."""
    if run_id := os.environ.get("TORCHELASTIC_RUN_ID"):
        return run_id
    master = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return ":".join(master) if all(master) else None


def _wait_for_rank0(run_dir: Path) -> None:
    """A rank other than 0: back once its job's rank 0 holds the lock (or after RANK_WAIT_S, when
    rank 0 is slow to get there: the process group then decides); rank 0's refusal raised here
    too, once another holder has kept the lock longer than rank 0 tries for it (so that the moment
    between rank 0 taking the lock and writing its record is never mistaken for another's)."""
    job, start = _job(), time.monotonic()
    other: tuple[Any, Any] | None = None  # another holder seen, and since when
    while job is not None and time.monotonic() - start < RANK_WAIT_S:
        alive, _ = liveness(run_dir) if (run_dir / LOCK).is_file() else (False, "")
        holder = lock_holder(run_dir) if alive else {}
        if alive and holder.get("job") == job:
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to watch (rank 0's heartbeat ends it)
                _HELD[run_dir] = _identity(os.stat(run_dir / LOCK))
            return
        seen = (holder.get("pid"), holder.get("started")) if alive else None
        if seen is None or other is None or other[0] != seen:
            other = (seen, time.monotonic()) if seen is not None else None
        elif time.monotonic() - other[1] > REFUSED_S:
            _refuse(run_dir)
        time.sleep(0.05)


def _refuse(run_dir: Path) -> None:
    """Raise the lock's refusal. Under torchrun, REFUSAL_GRACE_S later: the agent stops every rank
    once one ends (SIGTERM, which would read "stopped during start-up"), so a rank refused waits for
    the others to be refused too, and a SIGTERM meanwhile ends it with the refusal all the same."""
    holder = lock_holder(run_dir)
    error = RunStateError(
        f"'{run_dir}' is being trained by {_describe(holder)}; one `trimtab train` per run "
        f"directory: {_frozen(holder)}wait for it to end, or stop it with `trimtab ctl {run_dir} stop`"
    )
    torchrun = _job() is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not torchrun or threading.current_thread() is not threading.main_thread():
        raise error

    def refused(signum: int, frame: Any) -> None:
        raise error

    previous = signal.signal(signal.SIGTERM, refused)
    try:
        time.sleep(REFUSAL_GRACE_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise error


def _frozen(holder: dict[str, Any]) -> str:
    """The first words of what to do about a holder on this host that is stopped (SIGSTOP, Ctrl-Z, a
    suspended job): waiting for it never ends and `trimtab ctl stop` is not read until it goes on.
    "" when it is not stopped (or its state cannot be read: another host, no /proc)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return ""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    if state not in ("T", "t"):
        return ""
    return (
        "it is stopped (SIGSTOP, Ctrl-Z, a suspended job: it neither trains nor answers `trimtab ctl`); "
        f"continue it with `kill -CONT {pid}` (or `fg` in its shell), then "
    )


def _write_lock(fd: int, record: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _beat(fd: int, stop: threading.Event, path: Path) -> None:
    """Touch the lock every BEAT_S; end the process as soon as its lock file is gone from `path`,
    or another is there (looked at every CHECK_S): the run directory was deleted or moved while it
    trained (a soak: `rm -rf RUN`, then the same command again, started at once beside the old
    process, which kept its flock on a file no longer there, and both wrote checkpoints, metrics
    and the journal into one directory). Ended at once, like a kill (every write is atomic), not
    by a stop that saves: a save would write into whatever is at the path now."""
    beaten = time.monotonic()
    while not stop.wait(min(CHECK_S, BEAT_S)):
        if time.monotonic() - beaten >= BEAT_S:
            beaten = time.monotonic()
            with contextlib.suppress(OSError):  # a full or vanished disk must not end the run
                os.utime(fd)
        if _not_ours(fd, path) and not stop.is_set():
            exit_lost(path)


@contextlib.contextmanager
def _watching(run_dir: Path) -> Iterator[None]:
    """A rank other than 0 that saw its job's rank 0 take the lock ends as rank 0 does once the file is
    gone or replaced (rank 0 then stops at once, _beat): it kept training, and, SIGTERMed by torchrun's
    agent, wrote an emergency save into the directory the lock was taken from, 6-9 s after rank 0 ended."""
    if run_dir not in _HELD:  # another node, or rank 0 never seen: nothing to compare with
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(CHECK_S):
            if lock_lost(run_dir) and not stop.is_set():
                exit_lost(run_dir / LOCK)

    thread = threading.Thread(target=watch, daemon=True, name="trimtab-lock-watch")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        _HELD.pop(run_dir, None)


def lock_lost(run_dir: Path | None) -> bool:
    """Whether run_dir's lock file, as this process holds it or saw its job's rank 0 take it, is gone or
    replaced now (its run directory deleted, moved or replaced while it trained). False where none was
    held or seen, or the file cannot be read for another reason (a network filesystem's hiccup)."""
    held = _HELD.get(run_dir) if run_dir is not None else None
    if held is None:
        return False
    try:
        return _identity(os.stat(run_dir / LOCK)) != held
    except FileNotFoundError:
        return True
    except OSError:
        return False


def exit_lost(path: Path) -> NoReturn:
    """End this process at once, like a kill (every write is atomic), not by a stop that saves: a save
    would write into whatever is at the path now. Rank 0 says why (it speaks for the job)."""
    if os.environ.get("RANK", "0") == "0":
        _say_lost(path)
    os._exit(LOST_EXIT)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _not_ours(fd: int, path: Path) -> bool:
    """Whether the file at `path` is not the one `fd` holds: gone, or another in its place. An
    error other than its absence (a network filesystem's hiccup) is not taken as proof."""
    try:
        held, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino)


def _say_lost(path: Path) -> None:
    message = (
        f"trimtab: error: {path} was removed or replaced while this run trained (its run directory deleted, "
        "moved or replaced): this process stops at once, writing nothing more there, so that it never mixes its "
        "files with what is there now (exit 4). A directory moved keeps its checkpoints: resume it with --out "
        "at its new path\n"
    )
    with contextlib.suppress(OSError, ValueError):  # no usable stderr: the exit status says it
        os.write(2, message.encode())


def _remove_if_empty(run_dir: Path) -> None:
    """A run that failed before writing anything (bad input) leaves no directory behind."""
    with contextlib.suppress(OSError):
        if [p.name for p in run_dir.iterdir()] == [LOCK]:
            (run_dir / LOCK).unlink()
            run_dir.rmdir()


def lock_holder(run_dir: str | Path) -> dict[str, Any]:
    """The record of the process holding (or that last held) run_dir's lock: host, pid, started;
    {} when none is written."""
    record = read_json(Path(run_dir) / LOCK)  # None: not written yet (the holder started a moment ago)
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
