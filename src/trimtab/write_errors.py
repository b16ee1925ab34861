"""A failed write read as an OSError, whoever raised it (Python, safetensors, torch.save), so that every
way a checkpoint, snapshot or tokenizer write can fail reaches the same handling (the orchestrator's
`disk` rule, exit code 4). Torch-free: the CLI reads an error with it without importing torch."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_OS_ERROR = re.compile(r"os error (\d+)")
NEARLY_FULL = 16 << 20  # bytes free below which a writer's errno-less failure is taken as ENOSPC


def os_error(exc: BaseException, where: Path | str = "") -> OSError | None:
    """The OSError a writer raised, or named in its message (safetensors' "... (os error 28)");
    None when it says no errno."""
    if isinstance(exc, OSError):
        return exc
    found = _OS_ERROR.search(str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(where))


def write_error(exc: BaseException, where: Path) -> OSError | None:
    """The OSError behind a failed checkpoint write, whoever raised it; None: not a write failure.
    A full disk reaches the writers in three forms: Python's own OSError (ENOSPC), safetensors'
    SafetensorError ("I/O error: No space left on device (os error 28)") and torch.save's
    RuntimeError ("unexpected pos 576 vs 534", no errno at all). For the last, the file system's
    free space says which it was: nearly nothing left is ENOSPC, anything else EIO."""
    error = os_error(exc, where)
    if error is not None:
        return error
    if type(exc).__name__ == "SafetensorError" or isinstance(exc, RuntimeError):
        code = errno.ENOSPC if _free_bytes(where) < NEARLY_FULL else errno.EIO
        return OSError(code, os.strerror(code), str(where))
    return None


def _free_bytes(where: Path) -> int:
    for folder in (where, *where.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


@contextmanager
def writing(where: Path) -> Iterator[None]:
    """Any failure of the writes inside as an OSError (write_error), so every way a checkpoint
    write can fail reaches the same handling (the orchestrator's `disk` rule, exit code 4)."""
    try:
        yield
    except Exception as exc:
        error = write_error(exc, where)
        if error is None or error is exc:
            raise
        raise error from exc


def out_error(error: OSError, out: str | Path | None) -> str | None:
    """What a command says when its --out cannot be made or written: an error on `out` itself, a folder
    above it or a file beside it (export's temp directory), naming the path and why; None for any
    other error (one on a file inside out is the command's own to handle). mkdir under /proc or /sys
    fails ENOENT although the parent exists: a filesystem that makes no directories, said so."""
    if out is None or error.filename is None:
        return None
    out, where = Path(out).absolute(), Path(os.fsdecode(error.filename)).absolute()
    if where != out and where not in out.parents and where.parent != out.parent:
        return None
    why = f"{error.strerror}: {where}"
    if error.errno == errno.ENOENT and out.parent.is_dir():
        why = f"'{out.parent}' lets no directory be made in it: a virtual filesystem such as /proc"
    return f"--out '{out}' cannot be made or written ({why}); give a directory this user can create and write"


class _Unbroken:
    """A console stream whose reader may go away (`trimtab train 2>&1 | head -5`): a write into the closed pipe
    points the stream's descriptor at /dev/null and carries on. Python raised BrokenPipeError from the next
    progress line, and the run ended mid-way (no summary, exit 0); the console is the person's view of a run,
    never a reason to stop it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, self._stream.fileno())  # what the buffer still holds goes there too
        os.close(nowhere)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_readers() -> None:
    """sys.stdout and sys.stderr as _Unbroken streams (before logging takes its handler's stream)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbroken) and hasattr(stream, "fileno"):
            setattr(sys, name, _Unbroken(stream))
