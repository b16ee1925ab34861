"""SIGTERM and SIGINT during a `train` call, from its start to its end.

Before training starts (start-up: importing torch, reading and tokenizing the data, building the
model, reading the checkpoint) a signal raises StartUpInterrupted, which ends the call with a
message, exit status 143 in the CLI (SIGTERM; SIGINT: 0, stop_exit): nothing was trained, and start-up
only writes files by atomic replacement, so nothing is left half-written. Rank 0 writes summary.json saying so (status
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

from trimtab.rundir import LOCK, newest_step, read_json, read_summary, write_summary
from trimtab.runlock import exit_lost, lock_lost

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

SIGNALS = (signal.SIGTERM, signal.SIGINT)
START_UP = "during start-up"  # a stopped status's words when the session stopped before its first step
# A SIGTERM's stop (a scheduler's: Slurm's time limit, a preemption, torchrun's agent) saves and ends with the
# status a process SIGTERM ended has, 128 + 15, as a shell, Slurm, torchelastic and Kubernetes read it: not
# done, run it again (a wrapper relaunching until exit 0 took the stop for the end). A person's stop (Ctrl-C's
# first, `trimtab ctl stop`) is what they asked for: 0.
PREEMPTED_EXIT = 128 + signal.SIGTERM


def stop_exit(signame: str | None) -> int:
    """The exit status of a run a signal named `signame` stopped (PREEMPTED_EXIT or 0)."""
    return PREEMPTED_EXIT if signame == signal.SIGTERM.name else 0


class StartUpInterrupted(BaseException):
    """A signal before the first step. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way (a rank forwarding its errors to the others) swallows it."""

    def __init__(self, signame: str, run_dir: Path | None, lengths: list[int] | None = None) -> None:
        self.signame, self.run_dir, self.lengths = signame, run_dir, lengths  # each phase's, as the config asks
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
        return {
            "status": status,
            "exit_code": stop_exit(self.signame),
            "run_dir": run_dir,
            "step": self.step,
            "steps_this_session": 0,
            "resumable": True,
        }

    def record(self, locked: bool = False) -> None:
        """summary.json of this session on rank 0, where the run directory exists (not one start-up
        would have made, and removes again) and no other session trains in it now (its summary is its
        own), unless the run has finished at its length under the config's phase `lengths`: its summary "completed"
        stays, where the Slurm script (plan/launch.py) queued the finished job once more and the run's
        record said "stopped". A run relaunched to train longer (or of a length known only once its
        data is read: train.epochs, max_steps auto) is queued again, as it should be. `locked`: this
        process holds the run lock (blocking's helper thread), so the lock says nothing of another session."""
        if self.run_dir is None or os.environ.get("RANK", "0") != "0" or not Path(self.run_dir).is_dir():
            return
        from trimtab.runlock import liveness

        if (not locked and liveness(self.run_dir)[0]) or _finished(self.run_dir, self.lengths):  # locked: by us
            return
        with suppress(OSError):  # a full or read-only disk: the message still says what happened
            write_summary(self.run_dir, self.summary)


def _finished(run_dir: Path, lengths: list[int] | None) -> bool:
    """Whether summary.json says the run completed at its length under the config's phase `lengths`
    (None: unknown, not finished): theirs plus the change the live planner (or orchestrator.make_up,
    `trimtab ctl total-steps`) made to pretraining, from the newest checkpoint's state.json (JSON: no
    torch in start-up). By the config's lengths alone a run the planner shortened counted as unfinished."""
    summary = read_summary(run_dir)
    if lengths is None or summary is None or summary.get("status") != "completed":
        return False
    state = read_json(Path(run_dir) / "checkpoints" / f"step_{newest_step(run_dir):06d}" / "state.json")
    train = state.get("train") if isinstance(state, dict) else None
    length = run_length(train, lengths) if isinstance(train, dict) else sum(lengths)
    return isinstance(summary.get("step"), int) and summary["step"] >= length


def run_length(train: dict[str, Any], lengths: list[int]) -> int:
    """The run's length under the config's phase `lengths`, given a checkpoint's train state:
    set_total_steps' change to pretraining (length_delta) counts while the config keeps pretraining's
    length; another train.max_steps is the length itself, plus orchestrator.make_up's part of the
    change (made_up: steps for withheld updates; schedule.reconcile)."""
    kept = not train.get("phase_steps") or train["phase_steps"][0] == lengths[0]
    return sum(lengths) + (train.get("length_delta", 0) if kept else train.get("made_up", 0))


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


def say_stopping(name: str) -> None:
    """The line for a stop signal `name` that the run takes: it stops after this step, saving."""
    _say(f"{name}: {STOPPING}{AGAIN if name == signal.SIGINT.name else ''}")


class SignalHandler:
    """Raises StartUpInterrupted until a trainer is attached; then asks it to stop after the step."""

    def __init__(self, trainer: Trainer | None = None, run_dir: Path | None = None) -> None:
        self.trainer, self.run_dir = trainer, run_dir
        self.lengths: list[int] | None = None  # each phase's length as the config asks (StartUpInterrupted.record)
        self.fired = False
        self.received: str | None = None  # the first signal's name: a caller learns of one the trainer took

    def __call__(self, signum: int, _frame: Any) -> None:
        if lock_lost(self.run_dir):  # torchrun's agent ending the job as rank 0 ended for it: no stop that saves
            exit_lost(self.run_dir / LOCK)
        name = signal.Signals(signum).name
        self.received = self.received or name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts (the CLI says so)
        if self.trainer is not None:
            lost, reason = self._peer_loss(), self.trainer.dist.on_signal(name)
            if lost is not None:  # torchrun's agent ending the survivors: not a stop after the step
                _say(f"{name}: torchrun's agent ends the survivors of a lost peer ({lost})")
            elif reason and not self.trainer.stop_reason:  # the first: a stop can take a step and a save, say so
                say_stopping(name)
            # under torchrun (reason ""), the ranks agree on the stop first (Trainer._agree says the line then): a
            # peer lost meanwhile fails that collective, and the survivor's line says what follows instead
            # (training/emergency.py), where this one said a stop after the step that never came (Trainer._agree)
            self.trainer.request_stop(reason)
        elif not self.fired:  # a second SIGTERM must not break into the first one's unwinding
            self.fired = True
            raise StartUpInterrupted(name, self.run_dir, self.lengths)

    def _peer_loss(self) -> str | None:
        """A lost peer's failure in a few words, if known (training/emergency.py EmergencySave.peer_loss), given
        the exception in flight where this handler runs: a survivor takes torchrun's SIGTERM as gloo's error
        unwinds, before the trainer catches it."""
        known = getattr(self.trainer, "peer_loss", None)  # a stand-in trainer (tests, `trimtab tune`) may lack it
        return known(sys.exc_info()[1]) if known is not None else None


@contextmanager
def handle_signals(
    trainer: Trainer | None = None, run_dir: Path | None = None, lengths: list[int] | None = None
) -> Iterator[SignalHandler]:
    """A SignalHandler for SIGTERM and SIGINT during the block, the outer block's if there is one
    (then `trainer`, `run_dir` and `lengths`, when given, are attached to it). Only the main thread can
    install handlers; elsewhere the block runs with the handlers it has."""
    outer = signal.getsignal(signal.SIGTERM)
    if isinstance(outer, SignalHandler):
        if trainer is not None:
            outer.trainer = trainer
        if run_dir is not None:
            outer.run_dir = run_dir
        if lengths is not None:
            outer.lengths = lengths
        yield outer
        return
    handler = SignalHandler(trainer, run_dir)
    handler.lengths = lengths
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


TAKE_OVER_S = 1.0  # a signal the main thread has not taken in this long: it is blocked in C++


@contextmanager
def blocking(what: str) -> Iterator[None]:
    """A start-up call into C++ that may wait long: init_process_group waiting for a peer that has
    already left. Python runs a handler only once the main thread is back in bytecode, so a SIGTERM
    there went unanswered until torchrun's agent killed the rank, and no summary said the job was
    stopped (the Slurm script of plan/launch.py did not queue it again). Here a helper thread hears
    the signal (signal.set_wakeup_fd: the C-level handler writes its number) and, when the main thread
    has not taken it within TAKE_OVER_S, does what it would: records the start-up stop, says so, and
    ends the process with the CLI's status for it (stop_exit)."""
    handler = signal.getsignal(signal.SIGTERM)
    if not isinstance(handler, SignalHandler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)  # set_wakeup_fd's requirement: a full pipe must not block the handler
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    returned = threading.Event()
    helper = threading.Thread(target=_hear, args=(read, returned, handler, what), daemon=True, name="trimtab-signals")
    helper.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        returned.set()
        os.write(write, b"\0")  # not a signal's number: the call returned, the helper ends
        helper.join()
        os.close(read)
        os.close(write)


def _hear(read: int, returned: threading.Event, handler: SignalHandler, what: str) -> None:
    """blocking's helper: each byte is a signal's number until the 0 that ends the call."""
    while (byte := os.read(read, 1)) and byte[0]:
        if byte[0] not in SIGNALS:
            continue
        if returned.wait(TAKE_OVER_S):  # the call returned: the main thread's handler takes the signal
            return
        if handler.received is None:
            stopped = StartUpInterrupted(signal.Signals(byte[0]).name, handler.run_dir, handler.lengths)
            _say(f"{stopped} (it came while {what})")
            stopped.record(locked=True)  # this process holds the run lock: the summary is its own
            os._exit(stop_exit(stopped.signame))
