"""`trimtab tune` stopped by a signal: the study stops, whenever in a trial the signal lands."""

import os
import signal
from types import SimpleNamespace

import optuna
import yaml
from optuna.trial import TrialState

from trimtab.training.services.signals import handle_signals
from trimtab.tune import load_space, objective


class _FinishedTrainer:
    """A trainer past its last step (in its final evaluation, save or report): a stop request
    comes too late to change how the run ends."""

    stop_reason = ""
    dist = SimpleNamespace(on_signal=lambda name: name)

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


def _write_study(tmp_path):
    """s.yaml: a one-knob study of 20-step debug trials, evaluated every 5 steps."""
    doc = {
        "study": {"name": "s", "seed": 0},
        "base": {"preset": "debug"},
        "budget": {"max_steps": 20, "eval_every": 5},
        "space": {"optim.lr": {"log_uniform": [1.0e-3, 1.0e-2]}},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))


def _train_signalled_after_its_last_step(cfg, hooks):
    """api.train_or_raise as far as signals go: its handler, attached to the trainer, takes the signal."""
    with handle_signals(trainer=_FinishedTrainer(), run_dir=cfg.run_dir):
        signal.raise_signal(signal.SIGTERM)
    return {"status": "completed", "exit_code": 0, "val_loss": 4.0, "tokens": 0}


def test_a_signal_in_a_trials_last_moments_still_stops_the_study(tmp_path, monkeypatch):
    """SIGTERM while a trial was in its final evaluation or report: the run ended completed (right:
    its steps were done), and the worker, none the wiser, claimed the next trial; `tune` ran on.
    The trial counts, and is marked interrupted: its worker stops (study.py:work returns -1, exit 1)."""
    _write_study(tmp_path)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())  # as open_study's, without a database
    monkeypatch.setattr(objective, "train_or_raise", _train_signalled_after_its_last_step)
    before = signal.getsignal(signal.SIGTERM)
    result = objective.run_trial(study, study.ask(), load_space(tmp_path / "s.yaml"), tmp_path)
    assert result.interrupted and result.state == TrialState.COMPLETE and result.values == [4.0]
    assert signal.getsignal(signal.SIGTERM) is before


def _train_crashing(cfg, hooks):
    raise RuntimeError("a bug in the run")


def test_a_crashed_trial_is_reported_as_a_crash_not_an_interruption(tmp_path, monkeypatch, capsys):
    """A worker whose trial raised (not a signal) exited 1, as an interrupted one does, and the study said
    'interrupted: run the same command again': the crash must be named, with its trial and run directory."""
    import pytest

    import trimtab.tune as tune_pkg
    from trimtab.tune.study import open_study, storage_url, study_dir

    _write_study(tmp_path)
    space = load_space(tmp_path / "s.yaml")
    space.trials = 2
    directory = study_dir(space, str(tmp_path / "study"))
    directory.mkdir(parents=True)
    url = storage_url(space, directory, None)
    monkeypatch.setattr(objective, "train_or_raise", _train_crashing)
    with pytest.raises(SystemExit) as ended:
        tune_pkg._worker(space, url, directory, 2, 0)  # in this process: its pid is the worker's
    assert ended.value.code == tune_pkg.CRASHED != tune_pkg.INTERRUPTED
    assert "RuntimeError: a bug in the run" in capsys.readouterr().err  # the traceback
    report = tune_pkg.crash_report(open_study(space, url), [os.getpid()])
    assert report.startswith("crashed: trial 0 raised RuntimeError: a bug in the run")
    assert str(directory / "trials" / "trial_0000") in report and "interrupted" not in report


def test_a_worker_killed_by_sigkill_is_named_and_its_trial_failed_not_called_interrupted(tmp_path, monkeypatch):
    """A worker SIGKILLed mid-trial (the kernel's OOM killer) left its trial RUNNING in the study and the
    summary said 'interrupted: run the same command again' (exit 1), even when another worker had run the
    trial again and the study had all its trials. The kill is named, with its likely cause and the trial;
    the trial is FAIL (lost) at once; the study, whole after the re-run, is complete."""
    import subprocess

    import trimtab.tune as tune_pkg
    from trimtab.tune.study import claim, open_study, storage_url, study_dir, this_worker

    doc = {"study": {"name": "s", "seed": 0}, "base": {"preset": "debug"}, "budget": {"max_steps": 20}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**doc, "space": {"optim.lr": {"uniform": [1e-3, 1e-2]}}}))
    space = load_space(tmp_path / "s.yaml")
    space.trials = 1
    directory = study_dir(space, str(tmp_path / "study"))
    directory.mkdir(parents=True)
    study = open_study(space, storage_url(space, directory, None))
    worker = subprocess.Popen(["sleep", "60"])
    worker.kill()  # SIGKILL, as the OOM killer sends it
    worker.wait()
    killed = claim(study, 1, directory)
    lr = killed.suggest_float("optim.lr", 1e-3, 1e-2)
    study._storage.set_trial_user_attr(killed._trial_id, "worker", {**this_worker(), "pid": worker.pid})
    study.enqueue_trial({"optim.lr": lr}, user_attrs={"rerun_of": 0, "config": {}})  # another worker's re-run
    again = study.ask()
    study.tell(again, again.suggest_float("optim.lr", 1e-3, 1e-2))
    monkeypatch.setattr(tune_pkg, "_spawn", lambda *args: {worker.pid: worker.returncode, os.getpid(): 0})

    result = tune_pkg.tune(space, trials=1, workers=2, out=directory)
    assert result.complete and "interrupted" not in result.summary
    assert (
        f"killed: worker pid {worker.pid} ended by SIGKILL in trial 0 (run again as trial 1: COMPLETE): most often "
        "the kernel's out-of-memory killer" in result.summary
    )
    lost = result.study.get_trials()[0]
    assert lost.state == TrialState.FAIL and lost.user_attrs["lost"].endswith("was killed by SIGKILL")


def test_the_cli_runs_even_one_worker_in_its_own_process_so_its_sigkill_is_reported(tmp_path, monkeypatch, capsys):
    """`trimtab tune --workers 1` ran its worker in the command's own process: the OOM killer's SIGKILL
    ended the command with it, unreported, its trial left RUNNING. The command now outlives the worker:
    the kill is named with its trial, the trial is FAIL, and the exit code 1 says to resume."""
    import re
    import subprocess

    import pytest

    import trimtab.tune as tune_pkg
    from trimtab.cli import main
    from trimtab.tune.study import claim, open_study, study_dir, this_worker

    _write_study(tmp_path)
    space = load_space(tmp_path / "s.yaml")
    space.trials = 1
    directory = study_dir(space, str(tmp_path / "study"))
    directory.mkdir(parents=True)
    worker = subprocess.Popen(["sleep", "60"])
    worker.kill()  # SIGKILL, as the OOM killer sends it
    worker.wait()

    lr = []

    def spawned(space, url, directory, total, workers):  # the one worker claims its trial and is killed
        trial = claim(open_study(space, url), total, directory)
        lr.append(trial.suggest_float("optim.lr", 1e-3, 1e-2, log=True))
        trial.set_user_attr("worker", {**this_worker(), "pid": worker.pid})
        return {worker.pid: worker.returncode}

    monkeypatch.setattr(tune_pkg, "_spawn", spawned)
    monkeypatch.setattr(tune_pkg, "work", lambda *args, **kwargs: pytest.fail("the worker ran in the command"))
    code = main(["tune", str(tmp_path / "s.yaml"), "--trials", "1", "--workers", "1", "--out", str(directory)])
    out = capsys.readouterr().out
    assert code == 1 and f"killed: worker pid {worker.pid} ended by SIGKILL in trial 0 (not run again yet)" in out
    assert "run the same command again to resume the study" in out
    assert re.search(rf"0 FAIL +optim.lr={lr[0]:.6f} +its worker \(pid {worker.pid} on .+\) was killed by SIGKILL", out)
