"""SIGTERM and SIGINT during a `train` call, from its start to its end.

Before training starts (start-up: importing torch, reading and tokenizing the data, building the
model, reading the checkpoint) a signal raises StartUpInterrupted, which ends the call with a
message, exit status 0 in the CLI: nothing was trained, and start-up only writes files by atomic
replacement, so nothing is left half-written. Rank 0 writes summary.json saying so (status
"stopped (SIGTERM during start-up)", resumable) into a run directory that exists: a scheduler's
wrapper reads it (the Slurm script of `trimtab plan --emit slurm` queues the job again), where
without it a preemption in start-up looked like a job that ended without a word. Once
Trainer.fit attaches itself, a signal finishes the current step, saves a checkpoint and returns
normally (under torchrun, at the step where the ranks next agree: Parallel.on_signal), and says so
in one console line. Python's own SIGINT handler is back from the first signal on, so a second
Ctrl-C raises KeyboardInterrupt at once: the CLI ends with one line and exit status 130
(cli_train.py), the run resumes from its last checkpoint.

One handler serves the whole call: a nested handle_signals (the CLI's, then api.train's, then
fit's) reuses the outer one, so there is never a moment between them when Python's default
handler (SIGTERM: exit 143) is back. Torch-free, so the CLI installs it before importing torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.rundir import newest_step, write_summary

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

SIGNALS = (signal.SIGTERM, signal.SIGINT)
START_UP = "during start-up"  # a stopped status's words when the session stopped before its first step


class StartUpInterrupted(BaseException):
    """A signal before the first step. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way (a rank forwarding its errors to the others) swallows it."""

    def __init__(self, signame: str, run_dir: Path | None) -> None:
        self.signame, self.run_dir = signame, run_dir
        self.step = newest_step(run_dir) if run_dir is not None else None
        at = f" at step {self.step}" if self.step is not None else ""
        super().__init__(
            f"stopped by {signame} during start-up{at}; nothing new was trained; re-run the same command to resume"
        )

    @property
    def summary(self) -> dict[str, Any]:
        """What train() returns for it: nothing of this call to report but where the run stands."""
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        status = f"stopped ({self.signame} {START_UP})"
        return {"status": status, "run_dir": run_dir, "step": self.step, "steps_this_session": 0, "resumable": True}

    def record(self) -> None:
        """summary.json of this session on rank 0, where the run directory exists (not one start-up
        would have made, and removes again) and no other session trains in it now (its summary is its
        own). A summary of the run's end it replaces is written again by the next session, which finds
        the run at its end without one (training/resume.py: its figures from the checkpoint and the
        logged evaluation); a run relaunched to train longer is queued again, as it should be."""
        if self.run_dir is None or os.environ.get("RANK", "0") != "0" or not Path(self.run_dir).is_dir():
            return
        from trimtab.runlock import liveness

        if liveness(self.run_dir)[0]:
            return
        with suppress(OSError):  # a full or read-only disk: the message still says what happened
            write_summary(self.run_dir, self.summary)


def stopped_in_start_up(summary: dict[str, Any]) -> bool:
    """Whether a summary is a session's that stopped before its first step (StartUpInterrupted.record)."""
    return str(summary.get("status", "")).endswith(f"{START_UP})")


STOPPING = "stopping after this step and saving"
AGAIN = " (Ctrl-C again stops at once, losing the steps since the last checkpoint)"


def _say(text: str) -> None:
    """One console line from a signal handler: os.write, since the handler may have interrupted the
    main thread inside a print to the same stream (a reentrant write raises). Rank 0 alone speaks."""
    if os.environ.get("RANK", "0") == "0":
        with suppress(OSError, ValueError):  # no usable stderr (closed, or not a file): stay quiet
            os.write(sys.stderr.fileno(), f"trimtab: {text}\n".encode())


class SignalHandler:
    """Raises StartUpInterrupted until a trainer is attached; then asks it to stop after the step."""

    def __init__(self, trainer: Trainer | None = None, run_dir: Path | None = None) -> None:
        self.trainer, self.run_dir = trainer, run_dir
        self.fired = False
        self.received: str | None = None  # the first signal's name: a caller learns of one the trainer took

    def __call__(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        self.received = self.received or name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts (the CLI says so)
        if self.trainer is not None:
            if not self.trainer.stop_reason:  # the first: a stop can take a step and a save, say it is coming
                _say(f"{name}: {STOPPING}{AGAIN if signum == signal.SIGINT else ''}")
            self.trainer.request_stop(self.trainer.dist.on_signal(name))
        elif not self.fired:  # a second SIGTERM must not break into the first one's unwinding
            self.fired = True
            raise StartUpInterrupted(name, self.run_dir)


@contextmanager
def handle_signals(trainer: Trainer | None = None, run_dir: Path | None = None) -> Iterator[SignalHandler]:
    """A SignalHandler for SIGTERM and SIGINT during the block, the outer block's if there is one
    (then `trainer` and `run_dir`, when given, are attached to it). Only the main thread can
    install handlers; elsewhere the block runs with the handlers it has."""
    outer = signal.getsignal(signal.SIGTERM)
    if isinstance(outer, SignalHandler):
        if trainer is not None:
            outer.trainer = trainer
        if run_dir is not None:
            outer.run_dir = run_dir
        yield outer
        return
    handler = SignalHandler(trainer, run_dir)
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield handler
    except StartUpInterrupted as stopped:  # the outermost block: the run lock, if it was taken, is let go
        stopped.record()
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
