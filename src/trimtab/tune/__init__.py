"""Hyperparameter search over trimtab runs with Optuna: `trimtab tune SPACE.yaml` (docs/tune.md).

Every trial is an ordinary run directory under STUDY_DIR/trials; the study lives in an Optuna
storage (SQLite in STUDY_DIR by default) that workers on this machine and others share.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import optuna

from trimtab.errors import ConfigError
from trimtab.extras import install_command, installed
from trimtab.tune.outputs import best_trials, write_outputs
from trimtab.tune.space import SearchParam, Space, load_space
from trimtab.tune.study import fail_gone, finished, open_study, storage_url, study_dir, work

__all__ = ["SearchParam", "Space", "StudyResult", "load_space", "tune"]
INTERRUPTED, CRASHED = 1, 3  # a worker's exit codes (1: a signal stopped it, as the command's own)
# a worker killed by a signal no handler runs for (exit code -N) and its usual cause
KILLED_BY = {
    "SIGKILL": ": most often the kernel's out-of-memory killer (`dmesg | grep -i 'killed process'` says; "
    "fewer --workers use less memory), else a kill -9",
    "SIGSEGV": ": a crash in native code (torch, a driver), not a Python error",
}


@dataclass
class StudyResult:
    study: optuna.Study
    directory: Path
    summary: str
    complete: bool  # the study has all its trials (False: interrupted; re-run to resume)

    @property
    def best(self) -> optuna.trial.FrozenTrial | None:
        found = best_trials(self.study)
        return found[0] if found else None


def tune(
    space: str | Path | Space,
    *,
    trials: int | None = None,
    workers: int = 1,
    storage: str | None = None,
    out: str | Path | None = None,
    own_process: bool = False,
) -> StudyResult:
    """Run the study of a space file until it has its trials (resuming one that exists), with
    `workers` processes here; write trials.csv and best.yaml to the study directory.
    `own_process`: run even a single worker in a child process (the CLI does), so that a SIGKILL of
    it (the OOM killer) is reported and its trial failed, as with several; in this process it
    starts faster, and a SIGKILL ends the caller with it."""
    space = space if isinstance(space, Space) else load_space(space)
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    _check_trackers(space)
    directory = study_dir(space, str(out) if out else None)
    url = storage_url(space, directory, storage)
    total = space.total(trials)
    space.trials = total  # what the workers and the sampler's start-up share are sized by
    directory.mkdir(parents=True, exist_ok=True)
    study = open_study(space, url)  # creates the tables and the study once, before workers race to
    _check_fresh(study, directory)
    if workers == 1 and not own_process:  # a crash raises here, its traceback the report
        codes = {os.getpid(): 0 if work(space, url, directory, total) >= 0 else INTERRUPTED}
    else:
        codes = _spawn(space, url, directory, total, workers)
    study = open_study(space, url)
    killed = {pid: _signal_name(-code) for pid, code in codes.items() if code < 0}
    fail_gone(study, {pid: f"was killed by {name}" for pid, name in killed.items()})  # not RUNNING until a resume
    has_all = sum(map(finished, study.get_trials(deepcopy=False))) >= total
    # a killed worker's trial taken back by another worker (study.py requeue_lost) leaves the study whole
    complete = all(code == 0 or (code < 0 and has_all) for code in codes.values())
    summary = write_outputs(study, space, directory)
    crashed = [pid for pid, code in codes.items() if code == CRASHED]
    if killed:
        summary += "\n" + killed_report(study, killed, complete)
    if crashed:
        summary += "\n" + crash_report(study, crashed)
    elif any(code == INTERRUPTED for code in codes.values()):
        summary += "\ninterrupted: run the same command again to resume the study"
    return StudyResult(study, directory, summary, complete)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal: no name
        return f"signal {number}"


def killed_report(study: optuna.Study, killed: dict[int, str], complete: bool) -> str:
    """The lines saying which workers a signal killed (no Python handler ran: SIGKILL, a segfault),
    the trial each was running, and what became of it: run again by another worker, or queued to
    run again (resuming its run directory) when the same command is re-run."""
    trials = study.get_trials(deepcopy=False)
    lines = []
    for pid, name in killed.items():
        held = [t for t in trials if (t.user_attrs.get("worker") or {}).get("pid") == pid and "lost" in t.user_attrs]
        cause = KILLED_BY.get(name, "")
        where = ", ".join(f"in trial {t.number}{_rerun(t, trials)}" for t in held) or "between trials"
        lines.append(f"killed: worker pid {pid} ended by {name} {where}{cause}")
    if not complete:
        lines.append("run the same command again to resume the study (a killed worker's trial runs again, once)")
    return "\n".join(lines)


def _rerun(lost: optuna.trial.FrozenTrial, trials: list[optuna.trial.FrozenTrial]) -> str:
    origin = lost.user_attrs.get("rerun_of", lost.number)
    again = [t for t in trials if t.user_attrs.get("rerun_of") == origin and t.number > lost.number]
    if again:
        return f" (run again as trial {again[0].number}: {again[0].state.name})"
    if "rerun_of" in lost.user_attrs:  # requeue_lost runs a lost trial again once: its point may be what kills
        return f", itself a re-run of trial {origin} (not run again: the study samples another point in its place)"
    return " (not run again yet)"


def _check_trackers(space: Space) -> None:
    """A tracker the base turns on needs its library: say so once, before any trial starts, not
    in every trial's failure."""
    log_cfg = space.base.get("log")
    for name in ("mlflow", "wandb"):
        section = log_cfg.get(name) if isinstance(log_cfg, dict) else None
        if isinstance(section, dict) and section.get("enabled") and not installed(name):
            key = f"base.log.{name}.enabled"
            raise ConfigError(f"{space.path}: {key} is true but {name} is not installed; {install_command(name)}")


def _check_fresh(study: optuna.Study, directory: Path) -> None:
    trials_dir = directory / "trials"
    if not study.get_trials(deepcopy=False) and trials_dir.is_dir() and any(trials_dir.iterdir()):
        raise ConfigError(
            f"{trials_dir} holds trials of another study (this storage has none); "
            "pass another --out, or the --storage those trials belong to"
        )


def crash_report(study: optuna.Study, pids: list[int]) -> str:
    """The lines saying which trials crashed (an exception in the worker with these pids, not a
    signal): the error, and the run directory whose checkpoint the re-run resumes."""
    lines = [
        f"crashed: trial {t.number} raised {t.user_attrs['crashed']} (its traceback is above, in the worker's "
        f"output; its run directory: {t.user_attrs.get('run_dir', '-')}); fix the error, then run the same "
        "command again to resume the study (the trial runs again)"
        for t in study.get_trials(deepcopy=False)
        if "crashed" in t.user_attrs and (t.user_attrs.get("worker") or {}).get("pid") in pids
    ]
    return "\n".join(lines) or f"crashed: worker pid(s) {pids} ended with an error (the traceback is above)"


def _spawn(space: Space, url: str, directory: Path, total: int, workers: int) -> dict[int, int]:
    """`workers` processes on this machine, one torch thread each (they share the cores); each
    one's exit code by pid: INTERRUPTED when a signal interrupted its trial, CRASHED on an error."""
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's torch at import
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(space, url, directory, total, i)) for i in range(workers)]
    for proc in procs:
        proc.start()
    # A SIGTERM to this process goes on to the workers: each stops its trial cleanly (saved, queued
    # again for the resume). Ctrl-C reaches them through the terminal's process group already.
    previous = signal.signal(signal.SIGTERM, lambda *_: [os.kill(p.pid, signal.SIGTERM) for p in procs if p.pid])
    try:
        for proc in procs:
            _join(proc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {int(proc.pid or 0): int(proc.exitcode or 0) for proc in procs}


def _join(proc: multiprocessing.process.BaseProcess) -> None:
    while True:
        try:
            proc.join()
            return
        except KeyboardInterrupt:  # the worker got it too and is stopping its trial: wait for it
            continue


def _worker(space: Space, url: str, directory: Path, total: int, index: int) -> None:
    import sys

    import torch

    torch.set_num_threads(1)
    try:
        code = 0 if work(space, url, directory, total, worker=index) >= 0 else INTERRUPTED
    except KeyboardInterrupt:  # between trials: nothing to save; a claimed trial is queued again on resume
        code = INTERRUPTED
    except Exception:  # its trial is named by study.py:work; the parent must not call this an interruption
        traceback.print_exc()
        code = CRASHED
    sys.exit(code)
