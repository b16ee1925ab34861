"""trimtab tune: space files, samplers, storage shared by workers, resume, and pruning that knows
the orchestrator. Trials are tiny debug runs (a 2-layer d=32 model, 20 steps: about a second)."""

from __future__ import annotations

import csv
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.rundir import DECISIONS_FILE, write_jsonl
from trimtab.tune import load_space, tune
from trimtab.tune.objective import _tell
from trimtab.tune.outputs import write_outputs
from trimtab.tune.study import (
    check_trained_as,
    claim,
    open_study,
    quiet,
    requeue_lost,
    storage_url,
    this_worker,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {
    "preset": "debug",
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1},
    "train": {"eval_tokens": 2048},
    "log": {"tensorboard": False, "report": False},
    "checkpoint": {"every": 0},
}
LR = {"optim.lr": {"log_uniform": [1.0e-3, 1.0e-2]}}


def write_space(tmp_path: Path, name: str = "s", study=None, space=None, base=None, budget=None) -> Path:
    doc = {
        "study": {"name": name, "seed": 0, **(study or {})},
        "base": {**TINY, **(base or {})},
        "budget": budget or {"max_steps": 20, "eval_every": 5},
        "space": space or LR,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def states(result) -> list[str]:
    return [t.state.name for t in result.study.get_trials()]


# ---------------------------------------------------------------------------------- space files


@pytest.mark.parametrize(
    ("space", "study", "words"),
    [
        ({"optim.lrr": {"uniform": [0.001, 0.01]}}, {}, ["optim.lrr", "did you mean 'optim.lr'"]),
        ({"optim.lr": {"uniform": [0.01, 0.001]}}, {}, ["space.optim.lr", "below"]),
        ({"optim.lr": {"log_uniform": [0, 0.01]}}, {}, ["log_uniform needs low > 0"]),
        ({"optim.lr": {"log_uniform": ["1e-2", "1e-4"]}}, {}, ["space.optim.lr", "low 0.01 must be below high 0.0001"]),
        ({"optim.lr": {"uniform": ["low", "1e-2"]}}, {}, ["space.optim.lr", "takes [low, high] numbers"]),
        ({"optim.lr": {"choice": []}}, {}, ["space.optim.lr", "choice needs at least one value"]),
        ({"optim.lr": {"normal": [0, 1]}}, {}, ["space.optim.lr", "log_uniform"]),
        ({"optim.lr": {"uniform": [0.001, 0.01]}}, {"sampler": "grid"}, ["grid needs finite values", "steps"]),
        (LR, {"sampler": "bayes"}, ["study.sampler", "tpe"]),
        (LR, {"sampler": "nsga2", "objectives": ["val_loss"]}, ["two objectives"]),
        (LR, {"objectives": ["val_loss", "flops"], "pruner": "median"}, ["single-objective"]),
        (LR, {"direction": "max"}, ["unknown study key 'direction'"]),
        ({"optim.warmup_steps": {"int": [-5, 5]}}, {}, ["low ends", "'optim.warmup_steps' must be >= 0"]),
    ],
)
def test_space_errors_name_the_file_key_and_fix(tmp_path, space, study, words):
    path = write_space(tmp_path, space=space, study=study)
    with pytest.raises(ConfigError) as exc:
        load_space(path)
    assert str(path) in str(exc.value)
    for word in words:
        assert word in str(exc.value)


def test_space_reads_numbers_yaml_reads_as_text(tmp_path):
    # YAML 1.1 reads 1e-4 as text; a run config takes it as a number, and so does a space file
    path = tmp_path / "s.yaml"
    path.write_text(
        "base: {preset: debug}\n"
        "space:\n"
        "  optim.lr: {log_uniform: [1e-4, 1e-2]}\n"
        "  optim.warmup_steps: {int: [0, 1e1]}\n"
        "  optim.weight_decay: {choice: [1e-2, 0.1]}\n"
        "  log.mlflow.experiment: {choice: ['1e3', e]}\n"  # a str key's choices stay text
    )
    params = {p.key: p.values for p in load_space(path).params}
    assert params == {
        "optim.lr": [1e-4, 1e-2],
        "optim.warmup_steps": [0, 10],
        "optim.weight_decay": [1e-2, 0.1],
        "log.mlflow.experiment": ["1e3", "e"],
    }
    assert isinstance(params["optim.warmup_steps"][1], int)


@pytest.mark.parametrize(
    ("base", "budget", "words"),
    [
        ({"optim": {"lrr": 1}}, None, ["s.yaml: base:", "'optim.lrr'", "the space file's base: section"]),
        ({}, {"max_steps": -1}, ["s.yaml: budget:", "'train.max_steps'", "the space file's budget: section"]),
    ],
)
def test_a_typo_in_base_or_budget_is_blamed_on_its_section(tmp_path, base, budget, words):
    with pytest.raises(ConfigError) as exc:
        load_space(write_space(tmp_path, base=base, budget=budget))
    for word in words:
        assert word in str(exc.value)
    assert "low ends" not in str(exc.value)  # not blamed on the searched keys


def test_a_base_the_searched_keys_make_valid_is_not_refused(tmp_path):
    # data.seq_len 256 is above the debug preset's model.max_seq_len (128), which the space raises
    base = {"data": {"seq_len": 256}}
    space = {"model.max_seq_len": {"choice": [256, 512]}}
    assert load_space(write_space(tmp_path, base=base, space=space)).params[0].values == [256, 512]


def test_space_grid_points_and_budget(tmp_path):
    space = load_space(
        write_space(
            tmp_path,
            study={"sampler": "grid"},
            space={
                "optim.lr": {"log_uniform": [1e-4, 1e-2], "steps": 3},
                "optim.warmup_steps": {"int": [0, 10], "steps": 3},
                "model.n_layers": {"choice": [1, 2]},
            },
            budget={"tokens": 10000, "eval_every": 5},
        )
    )
    grid = space.grid_space()
    assert grid["optim.lr"] == pytest.approx([1e-4, 1e-3, 1e-2])
    assert grid["optim.warmup_steps"] == [0, 5, 10]
    assert space.total() == 18 and space.total(5) == 5 and space.total(100) == 18
    cfg = space.config({"optim.lr": 1e-3, "optim.warmup_steps": 5, "model.n_layers": 1}, out=tmp_path / "r")
    assert cfg.train.max_steps == 5  # 10000 tokens / 2048 per step, rounded up
    assert (cfg.model.n_layers, cfg.train.eval_every, cfg.log.progress) == (1, 5, False)


# ---------------------------------------------------------------------------------- studies


def test_tpe_study_resumes_to_its_count_and_writes_best_yaml(tmp_path):
    path = write_space(tmp_path, study={"sampler": "tpe"})
    out = tmp_path / "study"
    first = tune(path, trials=2, out=out)
    assert first.complete and states(first) == ["COMPLETE"] * 2
    second = tune(path, trials=4, out=out)  # the same study, resumed: two more trials
    trials = second.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert len({t.params["optim.lr"] for t in trials}) == 4  # none drawn twice, none run twice
    assert sorted(Path(t.user_attrs["run_dir"]).name for t in trials) == [f"trial_{i:04d}" for i in range(4)]
    for t in trials:  # every trial is an ordinary run directory
        run = Path(t.user_attrs["run_dir"])
        assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
        assert t.user_attrs["flops"] > 0 and t.user_attrs["status"] == "completed"
    best = load_config(out / "best.yaml")  # `trimtab train best.yaml` accepts it
    assert best.optim.lr == pytest.approx(second.best.params["optim.lr"])
    assert best.run_dir == out / "best" and best.train.max_steps == 20
    with open(out / "trials.csv") as fh:
        assert [row["state"] for row in csv.DictReader(fh)] == ["COMPLETE"] * 4
    assert "best: trial" in second.summary


@pytest.mark.slow  # 11 s; CI's two workers on one study: test_two_workers_share_one_sqlite_study
def test_grid_runs_every_point_once_across_two_workers(tmp_path):
    space = {"optim.lr": {"choice": [0.002, 0.005]}, "optim.warmup_steps": {"int": [0, 4], "steps": 2}}
    result = tune(write_space(tmp_path, study={"sampler": "grid"}, space=space), workers=2, out=tmp_path / "g")
    points = sorted((t.params["optim.lr"], t.params["optim.warmup_steps"]) for t in result.study.get_trials())
    assert points == [(0.002, 0), (0.002, 4), (0.005, 0), (0.005, 4)]


def test_nsga2_two_objectives_val_loss_and_compute(tmp_path):
    space = {"optim.lr": {"log_uniform": [1e-3, 1e-2]}, "train.batch_tokens": {"choice": [1024, 2048]}}
    result = tune(write_space(tmp_path, study={"sampler": "nsga2"}, space=space), trials=3, out=tmp_path / "n")
    assert result.study.directions == [optuna.study.StudyDirection.MINIMIZE] * 2
    per_token = set()
    for t in result.study.get_trials():  # compute: 20 steps x batch_tokens x the model's FLOPs per token
        assert t.values[0] == pytest.approx(t.user_attrs["val_loss"])
        assert t.values[1] == pytest.approx(t.user_attrs["flops"])
        per_token.add(round(t.values[1] / (20 * t.params["train.batch_tokens"])))
    assert len(per_token) == 1
    assert (tmp_path / "n" / "best.yaml").is_file()
    assert "Pareto front" in result.summary or "best:" in result.summary


def test_two_workers_share_one_sqlite_study(tmp_path):
    # 4 steps a trial: what is shared is the study, not the training (20 steps: 20.5 s of CPU, 4: 15.3,
    # most of it the two spawned workers importing torch)
    path = write_space(tmp_path, study={"sampler": "tpe"}, budget={"max_steps": 4, "eval_every": 2})
    result = tune(path, trials=4, workers=2, out=tmp_path / "w")
    trials = result.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4  # exactly four: no surplus, no failure
    assert len({t.params["optim.lr"] for t in trials}) == 4
    assert len({t.user_attrs["run_dir"] for t in trials}) == 4


def test_a_trial_left_running_by_a_dead_worker_is_run_again(tmp_path, monkeypatch):
    path = write_space(tmp_path)
    out = tmp_path / "d"
    space = load_space(path)
    out.mkdir()
    study = open_study(space, storage_url(space, out), grace=1)
    with quiet():
        dead = study.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-3, 1e-2, log=True)})
    study._storage.record_heartbeat(dead._trial_id)  # its worker beat once, then died
    lr = dead.params["optim.lr"]
    monkeypatch.setattr("trimtab.tune.study.GRACE_S", 1)
    time.sleep(1.5)
    result = tune(path, trials=2, out=out)
    trials = result.study.get_trials()
    assert trials[0].state == TrialState.FAIL
    rerun = [t for t in trials if t.user_attrs.get("rerun_of") == 0]
    assert len(rerun) == 1 and rerun[0].params["optim.lr"] == lr and rerun[0].state == TrialState.COMPLETE
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2


def test_a_trial_whose_worker_here_is_gone_is_taken_back_at_once(tmp_path):
    """A resumed `trimtab tune` after its worker was killed waited out the 60 s heartbeat grace for
    the dead worker's trial. A worker of this machine whose pid is gone is not waited for; one of
    another machine (or a live one) is judged by its heartbeat still."""
    space = load_space(write_space(tmp_path))
    study = open_study(space, storage_url(space, tmp_path))  # the default grace: 60 s
    space.trials = 3
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid is no process now
    workers = [
        {**this_worker(), "pid": dead.pid},
        {**this_worker(), "pid": dead.pid, "machine": "another-host"},
        this_worker(),  # this process: alive
    ]
    claimed = [claim(study, 3, tmp_path) for _ in workers]
    for trial, worker in zip(claimed, workers):
        assert trial.user_attrs["worker"] == this_worker()  # a claim says whose it is
        trial.suggest_float("optim.lr", 1e-3, 1e-2, log=True)  # as run_trial does: a re-run takes its point
        study._storage.set_trial_user_attr(trial._trial_id, "worker", worker)
    requeue_lost(study)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "RUNNING", "WAITING"]
    assert f"pid {dead.pid}" in trials[0].user_attrs["lost"] and trials[3].user_attrs["rerun_of"] == 0
    assert claim(study, 3, tmp_path).user_attrs["rerun_of"] == 0  # taken back now, not after 60 s


def test_a_study_resumed_with_another_budget_is_refused(tmp_path):
    """`trimtab tune` resumed after budget.max_steps went from 20 to 4 ran the new trials at 4 steps
    and picked its best across both budgets (the 20-step trial, by its training alone)."""
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())  # as open_study's, without a database
    check_trained_as(study, load_space(write_space(tmp_path)), "db")
    progress = write_space(tmp_path, base={"log": {"progress": True}})  # not what a trial's result depends on
    check_trained_as(study, load_space(progress), "db")
    shorter = write_space(tmp_path, budget={"max_steps": 4, "eval_every": 5})
    with pytest.raises(ConfigError, match=r"s.yaml: study 's' in db .* \(budget.max_steps 20 -> 4\).* another study"):
        check_trained_as(study, load_space(shorter), "db")
    assert study.user_attrs["trained_as"]["budget"]["max_steps"] == 20


# ---------------------------------------------------------------------------------- pruning


def test_a_trial_a_person_stopped_is_pruned_and_the_study_goes_on(tmp_path):
    """`trimtab ctl TRIAL_RUN stop` on one bad trial ended the whole study as interrupted (exit 1),
    and its resume re-ran the trial the person had stopped."""
    space = load_space(write_space(tmp_path))
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-3, 1e-2, log=True)})
    cfg = space.config(trial.params, tmp_path / "trial")
    (tmp_path / "trial").mkdir()
    stop = {"id": 1, "step": 12, "rule": "manual", "action": "stop", "params": {"reason": "bad trial"}}
    write_jsonl(tmp_path / "trial" / DECISIONS_FILE, [{**stop, "applied": ["stopping: bad trial"]}])
    summary = {"status": "stopped (bad trial)", "exit_code": 0, "step": 12, "tokens": 100}
    result = _tell(study, trial, space, cfg, summary, None)
    assert result.state == TrialState.PRUNED and not result.interrupted
    assert study.trials[0].user_attrs["pruned_reason"] == "a person: trimtab ctl stop (bad trial)"
    sigterm = study.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-3, 1e-2, log=True)})
    later = {**summary, "status": "stopped (SIGTERM)", "step": 20}  # the stop was another session's
    assert _tell(study, sigterm, space, cfg, later, None).interrupted


def test_median_pruner_stops_a_bad_trial(tmp_path):
    path = write_space(
        tmp_path,
        study={"sampler": "random", "pruner": {"median": {"n_startup_trials": 1}}},
        space={"optim.lr": {"log_uniform": [1e-7, 1e-2]}},
    )
    out = tmp_path / "m"
    space = load_space(path)
    out.mkdir()
    study = open_study(space, storage_url(space, out))
    study.enqueue_trial({"optim.lr": 5e-3})
    study.enqueue_trial({"optim.lr": 1e-7})  # learns nothing: worse than the median at its first evaluation
    result = tune(path, trials=2, out=out)
    good, bad = result.study.get_trials()
    assert good.state == TrialState.COMPLETE
    assert bad.state == TrialState.PRUNED
    assert bad.user_attrs["pruned_reason"].startswith("pruner: MedianPruner at step 5")
    summary = yaml.safe_load((Path(bad.user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["step"] < 20 and summary["status"].startswith("stopped (pruned by MedianPruner")


def test_orchestrator_gave_up_is_pruned_with_its_reason(tmp_path):
    base = {"faults": ["weights_nan@6"], "orchestrator": {"max_rollbacks": 0}}
    result = tune(write_space(tmp_path, base=base), trials=1, out=tmp_path / "u")
    (trial,) = result.study.get_trials()
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs["pruned_reason"].startswith("orchestrator: gave up")
    assert trial.user_attrs["exit_code"] == 3


def test_a_trial_the_orchestrators_early_stop_ended_is_a_result_not_an_interruption(tmp_path):
    """orchestrator.early_stop in the base: a trial it stops (exit 0, status "stopped (early
    stopping ...)") counts with its val_loss; it was taken for a signal's interruption, failed, and
    the study stopped at once with exit code 1."""
    base = {"orchestrator": {"early_stop": {"enabled": True, "patience": 1, "min_delta": 10.0}}}
    result = tune(write_space(tmp_path, base=base), trials=2, out=tmp_path / "u")
    assert states(result) == ["COMPLETE", "COMPLETE"] and result.complete
    assert all(t.values[0] > 0 for t in result.study.get_trials())


def test_a_healed_fault_is_not_held_against_the_trial(tmp_path):
    """A NaN stretch the orchestrator heals (skipped updates) leaves the evaluation after it worse
    than the fault-free run's; a pruner fed at once prunes the trial for it, the aware one does not."""
    lr = {"optim.lr": {"choice": [5e-3]}}
    clean = tune(write_space(tmp_path, "clean", space=lr), trials=1, out=tmp_path / "c")
    clean_run = Path(clean.study.get_trials()[0].user_attrs["run_dir"])
    at10 = next(m["val_loss"] for m in _evals(clean_run) if m["step"] == 10)
    # from step 10 on, the fault-free run passes it at every evaluation
    threshold = {"threshold": {"upper": at10 + 0.02, "n_warmup_steps": 10}}
    faults = {"faults": ["nan_loss@7:3"], "orchestrator": {"outcome_after": 10}}  # its LR cut at 9 of 22: judged
    runs = {}
    for aware in (False, True):
        study = {"pruner": threshold, "orchestrator_aware": aware}
        name = f"aware{aware}"
        runs[aware] = tune(write_space(tmp_path, name, study, lr, faults), trials=1, out=tmp_path / name)
    blind, aware = runs[False].study.get_trials()[0], runs[True].study.get_trials()[0]
    assert blind.state == TrialState.PRUNED and "ThresholdPruner at step 10" in blind.user_attrs["pruned_reason"]
    assert aware.state == TrialState.COMPLETE and aware.user_attrs["faults_healed"] >= 1
    assert 10 in aware.user_attrs["held_evals"] and 10 not in aware.intermediate_values
    assert aware.values[0] == pytest.approx(
        yaml.safe_load(Path(aware.user_attrs["run_dir"], "summary.json").read_text())["val_loss"]
    )


def _evals(run_dir: Path) -> list[dict]:
    from trimtab.rundir import read_metrics

    return [m for m in read_metrics(run_dir) if "val_loss" in m]


def test_a_best_trial_healed_of_a_far_too_high_lr_says_the_lr_it_trained_at(tmp_path):
    """Soak: lr 1.178 on debug was the study's best (val_loss 5.146) after the orchestrator cut its
    LR twice (x0.01: 0.0118 in effect); the summary and best.yaml named 1.178 and said nothing."""
    space = load_space(write_space(tmp_path, space={"optim.lr": {"log_uniform": [1e-3, 10.0]}}))
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-3, 10.0, log=True)})
    run = tmp_path / "trial"
    cfg = space.config({"optim.lr": 2.0}, run)
    trial.set_user_attr("config", cfg.to_dict())
    run.mkdir()
    steps = [{"step": s, "loss": 5.0, "lr": 2.0 * scale, "lr_scale": scale} for s, scale in ((5, 0.1), (20, 0.01))]
    write_jsonl(run / "metrics.jsonl", [*steps, {"step": 20, "val_loss": 5.1}])
    summary = {"status": "completed", "exit_code": 0, "step": 20, "tokens": 100, "val_loss": 5.1}
    assert _tell(study, trial, space, cfg, summary, None).state == TrialState.COMPLETE
    text = write_outputs(study, space, tmp_path / "out")
    assert "its LR multiplier ended at x0.01" in text and "effective optim.lr 0.02," in text
    assert "# its LR multiplier ended at x0.01" in (tmp_path / "out" / "best.yaml").read_text()


def test_a_study_whose_trials_all_ended_pruned_does_not_say_not_yet(tmp_path, monkeypatch):
    """Soak: a finished grid over lr 1e3 and 1e30 (both gave up, PRUNED) printed "no trial completed
    yet", as if a trial were still to come; it has ended without a best.yaml."""
    space = load_space(write_space(tmp_path))
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for _ in range(2):
        study.tell(study.ask(), state=TrialState.PRUNED)
    text = write_outputs(study, space, tmp_path / "out")
    assert "yet" not in text and "no trial completed (2 pruned): no best.yaml" in text
    assert not (tmp_path / "out" / "best.yaml").exists()
    study.ask()  # a trial still running: one may complete
    assert "no trial completed yet" in write_outputs(study, space, tmp_path / "out")
    # the command ends with a failing status: a script reading the exit code alone must not take a best.yaml
    from trimtab import tune as tune_module
    from trimtab.cli import main
    from trimtab.tune import StudyResult

    ended = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    ended.tell(ended.ask(), state=TrialState.PRUNED)
    result = StudyResult(ended, tmp_path / "out", "no trial completed (1 pruned)", complete=True)
    monkeypatch.setattr(tune_module, "tune", lambda *a, **k: result)
    assert main(["tune", str(tmp_path / "s.yaml")]) == 3
    result.complete = False  # interrupted: the same command resumes it
    assert main(["tune", str(tmp_path / "s.yaml")]) == 1
