"""The hook protocol and the built-in loggers (console progress, metrics.jsonl, TensorBoard).

Hooks only observe: they see the run through a read-only RunView (figures, copies, reads of the
model that write nothing, training/view.py) after each step, each log interval and each
evaluation; they never reach into the step itself, and change the run only by requests through
run.control, which the loop applies at its points (training/control.py). A hook's skip_step is its
own, as a person's `trimtab ctl skip-step` is theirs: the step it withholds says who asked
(StepOutput.skip_by), and orchestrator.make_up, which makes up the updates the gate withheld from
bad steps, leaves it. A hook that makes faults on purpose is a test instrument with its own handle
(training/instrument.py). A hook with state returns it from state_dict() and it is checkpointed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trimtab.errors import TrimtabError
from trimtab.rundir import (
    ABANDONED,
    METRICS_FILE,
    append_lines,
    has_step,
    is_eval,
    json_text,
    read_metrics,
    rewrite_jsonl,
)

if TYPE_CHECKING:
    from trimtab.data import StepBatch
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView

log = logging.getLogger(__name__)


class HookWroteError(TrimtabError):
    """A hook changed a tensor of the step it was shown (a batch, a StepOutput) in place."""


SCALARS = (int, float, bool, str, type(None))


def tensors_of(value: Any, where: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor inside an event's argument (a StepBatch, a StepOutput: dataclasses, dicts,
    lists), with where it is (a path, put in words only for an error), for the seal around a hook
    call. A list or tuple whose first item is a plain value is taken to hold no tensor: an RL
    step's rollouts hold thousands of token ids and log-probabilities, whose walk cost ~30 ms a
    step (debug, CPU) before."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors_of(v, (*where, f"[{k!r}]"))
    elif isinstance(value, (list, tuple)):
        if value and not isinstance(value[0], SCALARS):
            for i, v in enumerate(value):
                yield from tensors_of(v, (*where, f"[{i}]"))
    elif hasattr(value, "__dataclass_fields__"):
        for f, spec in value.__dataclass_fields__.items():
            if spec.metadata.get("sealed", True):  # a field that holds no tensor says so (RL's rollouts)
                yield from tensors_of(getattr(value, f), (*where, f".{f}"))


def call_sealed(hook: Hook, event: str, view: RunView, *args: Any) -> Any:
    """hook.event(view, *args), checking that it wrote into none of the tensors it was shown:
    each tensor's version counter (torch bumps it on every in-place write) is read before and
    after, a few integer reads a step. A test instrument writes through its own handle
    (training/instrument.py) and is called as it is."""
    seal = [(i, where, t, t._version) for i, a in enumerate(args) for where, t in tensors_of(a)]
    result = getattr(hook, event)(view, *args)
    for i, where, tensor, version in seal:
        if tensor._version != version:
            raise HookWroteError(
                f"{type(hook).__name__}.{event} wrote into arg{i}{''.join(where)} in place: hooks only observe "
                "(docs/architecture.md); copy it first (tensor.clone()), or change the run with "
                "run.control.request(...)"
            )
    return result


def keyed(hooks: list[Hook]) -> list[tuple[str, Hook]]:
    """Each hook with its checkpoint key: the class name, numbered only when a class appears twice,
    so turning TensorBoard on or off between sessions does not orphan another hook's state."""
    names = [type(h).__name__ for h in hooks]
    return [
        (n if names.count(n) == 1 else f"{n}#{names[:i].count(n)}", h) for i, (n, h) in enumerate(zip(names, hooks))
    ]


class Hook:
    """Base class: override what you need. All methods are optional."""

    def on_train_start(self, run: RunView) -> None: ...

    def on_step_start(self, run: RunView, batch: StepBatch) -> None:
        """Before the step (again before each retry of it after an OOM)."""

    def update_gate(self, run: RunView, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """A 0-d bool tensor, true to withhold this step's update; computed on device (no sync)."""
        return None

    def gates_rows(self, run: RunView) -> bool:
        """Whether the row gate (training/row_gate.py) may leave rows out of this step's update: a
        hook that oversees it (the orchestrator: its mode, its paused rules) says no while a person
        has it off."""
        return True

    def on_oom(self, run: RunView, exc: BaseException, batch: StepBatch) -> bool:
        """Out of memory inside the step: return True after requesting a smaller micro-batch
        (through run.control; the loop applies it at once) to retry the same rows; False lets the
        error propagate."""
        return False

    def on_rollout_oom(self, run: RunView, exc: BaseException) -> bool:
        """Out of memory generating an RL step's rollouts: return True after requesting fewer
        rows generated at a time (run.control; applied at once) to generate them again."""
        return False

    def measure_gain(self, run: RunView) -> bool:
        """Whether the coming step's update gain is to be measured (training/gain.py: the step's
        batch scored again after the update, a forward more). False: not asked for."""
        return False

    def on_step_end(self, run: RunView, out: StepOutput) -> None: ...

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None: ...

    def on_applied(self, run: RunView) -> None:
        """After each step, once the loop applied what its hooks requested (Control; on_step_end, on_log and
        on_finding come before): the run as the next step trains it, e.g. its length after a decision of this step."""

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None: ...

    def on_eval_error(self, run: RunView, step: int, error: str) -> None:
        """An evaluation was abandoned (an error, train.eval_timeout); training goes on."""

    def on_decision(self, run: RunView, decision: dict[str, Any]) -> None:
        """The orchestrator journaled a new decision (its decisions.jsonl record, outcome not yet
        measured): trackers follow the journal through this, never by reading the file."""

    def on_finding(self, run: RunView, finding: Any) -> None:
        """Another hook's finding for the orchestrator (RunView.propose: the live planner's run
        length, an orchestrator.monitors.Finding), delivered by the loop after the step's hooks,
        before it applies Control."""

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None: ...

    def on_save_prepare(self, run: RunView, good: bool) -> None:
        """A checkpoint of this step is about to be written (`good`: a rollback target, as every
        hook's healthy() said): what a hook sets now goes into its state in that checkpoint."""

    def on_save_stall(self, run: RunView) -> None:
        """Inside a save's timed stall (save_seconds: the goodput ledger's checkpoint bucket, the
        checkpoint interval's cost): before a synchronous save writes, or while a background
        write is collected. A hook finishes here what the next checkpoint must not overlap (an
        upload in flight: training/services/storage.py), so the wait is counted as the save's."""

    def on_save_start(self, run: RunView) -> None: ...

    def room_for_save(self, run: RunView) -> int | None:
        """Before a save writes: how many of the newest checkpoints may stay for it to fit (a disk incident's,
        orchestrator/saves.py); the trainer deletes the others but the essential ones, then says so in
        on_room_made. None: all stay."""
        return None

    def on_room_made(self, run: RunView, freed: int, line: str) -> None:
        """The room a hook's room_for_save asked for was made: `freed` checkpoints deleted, `line` says what."""

    def on_save_error(self, run: RunView, exc: OSError) -> bool:
        """Saving failed (disk full, ...): True if handled and training may go on. What a hook
        requested about it (run.control) is applied at once, before the save returns; a failure
        of that retry does not come back here."""
        return False

    def on_checkpoint(self, run: RunView, path: Path) -> None: ...

    def on_phase_end(self, run: RunView) -> None:
        """After a phase's last step (the run's last, for its final phase), before its evaluation
        and checkpoint: a hook that finds the state broken requests a rollback through Control,
        and the loop trains the rolled-back steps again, or a stop."""

    def healthy(self, run: RunView) -> bool:
        """Whether the checkpoint about to be written is a good rollback target."""
        return True

    def kept_checkpoints(self, run: RunView) -> tuple[int, ...]:
        """Steps whose checkpoints the pruning must keep for now (beyond checkpoint.keep's newest):
        ones this hook may still want to roll back to."""
        return ()

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        """After a rollback; saved_state is this hook's state_dict() from that checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JsonlLogger(Hook):
    """metrics.jsonl (the format: trimtab/rundir.py): one line per log interval and per evaluation."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.unwritten: list[str] = []  # lines a full disk refused: written with the next ones

    def on_train_start(self, run: RunView) -> None:
        # Unmarked lines past the resumed step were written after the checkpoint and will be
        # redone; abandoned ones belong to no step that will run again, so they stay.
        self._rewrite(lambda m: m if m.get(ABANDONED) or _step(m) <= run.step else None)

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        # The steps after the restored one will be trained again: their lines stay, marked.
        self._rewrite(lambda m: {**m, ABANDONED: True} if _step(m) > run.step else m)

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._write(metrics)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._write(metrics)

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        """summary.json's skipped_steps: the updates withheld over the run's kept steps, every session's
        (a line's counts its log window alone: the last line's 0 read as a run that skipped none)."""
        summary["skipped_steps"] = sum(m.get("skipped_steps", 0) for m in read_metrics(self.run_dir))

    def _write(self, metrics: dict[str, Any]) -> None:
        """Append a line. A full disk must not end the run (its checkpoints matter more, and the
        orchestrator frees space for them): the line waits and goes out with the next write."""
        self.unwritten.append(json_text(metrics) + "\n")
        try:
            append_lines(self.path, "".join(self.unwritten))  # what part of them reached the file is cut back
        except OSError as exc:
            if len(self.unwritten) == 1:
                log.warning("metrics.jsonl: %s; its lines are kept in memory until a write succeeds", exc)
            return
        self.unwritten = []

    def _rewrite(self, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        """Each line through `change` (None drops it), atomically: a reader sees the old file or
        the new one, never a mix."""
        rewrite_jsonl(self.path, change)


def _step(record: dict[str, Any]) -> float:
    """A metrics line's step; -inf for a line without a whole-number one (a hand edit, another
    tool's note, a damaged line that still parses), which is kept as it is rather than crash the
    resume with a TypeError or KeyError (readers leave it out: rundir.read_metrics)."""
    return record["step"] if has_step(record) else float("-inf")


class TensorBoardLogger(Hook):
    """TensorBoard's curves (rank 0). A full disk must not end the run here either (JsonlLogger):
    TensorBoard's writer thread dies on the first failed write and raises it at every later call,
    so a failed writer is dropped, said once, and a new one (another events file in the same
    directory, which TensorBoard reads as one run) is tried at a log at most once a minute; the
    curves miss the steps between, metrics.jsonl keeps them."""

    RETRY_S = 60.0  # an events file each try: a long outage makes no more than one a minute

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer = None
        self.failed = False  # a write failed and no writer has succeeded since
        self.retry_at = 0.0  # time.monotonic() from which a new writer may be tried

    def on_train_start(self, run: RunView) -> None:
        fresh = not any(self.log_dir.glob("events.out.tfevents.*"))
        self._open(run.step + 1)  # drops what a killed run wrote past its last checkpoint
        if fresh and run.step > 0:
            self._backfill(run.run_dir, run.step)

    def _backfill(self, run_dir: Path, step: int) -> None:
        """A run resumed with no TensorBoard files (restored from checkpoint.dir on a fresh machine,
        whose store holds metrics.jsonl, not tb/; or TensorBoard turned on at this resume): its
        curves up to `step` written from metrics.jsonl's kept lines, so TensorBoard shows the whole
        run, not the sessions since."""
        for line in read_metrics(run_dir):
            if line["step"] <= step:
                self._scalars("eval" if is_eval(line) else "train", line)

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        self._close()
        self._open(run.step + 1)  # drops the abandoned steps

    def _open(self, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard's mechanism for restarts: it discards the events written earlier at steps
        # >= purge_step, so it shows the trajectory that was kept.
        try:
            self.writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        except OSError as exc:
            self._fail(exc)

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._scalars("train", metrics)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._scalars("eval", metrics)

    def _scalars(self, prefix: str, metrics: dict[str, Any]) -> None:
        if self.writer is None and time.monotonic() >= self.retry_at:
            self._open()
        if self.writer is None:
            return
        try:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{prefix}/{key}", value, metrics["step"])
        except OSError as exc:
            self._fail(exc)
            return
        self.failed = False

    def _fail(self, exc: OSError) -> None:
        if not self.failed:
            log.warning("tensorboard (%s): %s; its curves miss the steps until a write succeeds", self.log_dir, exc)
        self.failed, self.retry_at = True, time.monotonic() + self.RETRY_S
        self._close()

    def _close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()  # flushes: raises what the writer thread met
            except OSError:
                pass  # said by _fail, or a close at the end: the curves lose their last events

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self._close()


class ConsoleLogger(Hook):
    """Progress bar (tqdm) with loss, LR, tokens/s and ETA; plain lines when not a terminal."""

    def __init__(self, progress: bool = True):
        self.progress = progress
        self.bar = None
        self.last_step = 0
        self.replayed_until = 0  # steps up to this one run a second time, after a rollback
        # a step's line, written once the loop applied the step's requests (on_applied): "step N/TOTAL" read
        # at on_log showed the length before a decision of that step (orchestrator.make_up's) once
        self.pending: tuple[int, str] | None = None

    def on_train_start(self, run: RunView) -> None:
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=run.total_steps,
                initial=run.step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                disable=None,
            )

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        self.last_step = out.step
        if self.bar is not None:
            self.bar.update(1)

    def on_applied(self, run: RunView) -> None:
        if self.bar is not None and self.bar.total != run.total_steps:  # the live planner or make-up changed it
            self.bar.total = run.total_steps
            self.bar.refresh()
        self._flush(run)

    def _flush(self, run: RunView) -> None:
        """The waiting step line (on_log), with the run's length as it is now."""
        if self.pending is not None:
            (step, text), self.pending = self.pending, None
            print(f"step {step}/{run.total_steps} {text}", file=sys.stderr, flush=True)

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        self._flush(run)  # the rolled-back step's line before the line saying so
        self.replayed_until = max(self.replayed_until, self.last_step)
        if self.bar is not None:
            self.bar.n = run.step
            self.bar.refresh()
        self.write(
            f"rolled back from step {self.last_step} to step {run.step}: steps {run.step + 1}-{self.last_step} "
            "are trained again (their abandoned lines stay in metrics.jsonl, marked)"
        )

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        text = f"loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} tok/s {metrics['tokens_per_s']:,.0f}"
        if nonfinite := metrics.get("nonfinite_steps"):  # left out of the loss above
            text += f" ({nonfinite} non-finite step{'s' if nonfinite > 1 else ''} apart)"
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(text, refresh=False)
        else:
            self._flush(run)
            self.pending = (metrics["step"], text)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        again = " (trained again after a rollback)" if 0 < metrics["step"] <= self.replayed_until else ""
        if "val_loss" in metrics:
            figures = f"val_loss {metrics['val_loss']:.4f} val_ppl {metrics['val_ppl']:.2f}"
        else:  # an RL run's held-out rewards (rl/batches.py), a DPO run's pairs (rl/preference.py)
            held = [(k.split("/", 1)[1], v) for k, v in metrics.items() if k.startswith(("rl/", "dpo/"))]
            figures = " ".join(f"{k} {v:.4f}" for k, v in held)
        self.write(f"eval step {metrics['step']}{again}: {figures}")

    def on_eval_error(self, run: RunView, step: int, error: str) -> None:
        self.write(f"eval step {step} abandoned ({error}){'' if run.stopping else '; training goes on'}")

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self._flush(run)
        if self.bar is not None:
            self.bar.close()

    def write(self, line: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)


class ReportWriter(Hook):
    """RUN_DIR/report.html at the end of the run (log.report; trimtab.report, docs/report.md).

    summary.json is written after the hooks' on_train_end, so the summary is handed to the report
    directly. A report that cannot be written warns and never fails the run: the run's files are
    all there and `trimtab report RUN_DIR` writes it later."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            from trimtab.report import write_report

            path = write_report([self.run_dir], summary=summary)
        except Exception as exc:  # noqa: BLE001 -- anything (a full disk, a bug in a plot) must spare the run
            log.warning(
                "report.html not written (%s: %s); the run is unaffected: `trimtab report %s` writes it",
                type(exc).__name__,
                exc,
                self.run_dir,
            )
            return
        run.say(f"report: {path} ({time.perf_counter() - start:.1f}s)")
