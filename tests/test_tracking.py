"""Experiment tracking (training/tracking.py), offline: MLflow in a local SQLite store and W&B in
offline mode, on tiny real runs with an injected fault (so there is a decision to track)."""

import json
from pathlib import Path

import pytest

from trimtab.errors import ConfigError
from trimtab.training import tracking

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = {"data": {"max_bytes": 150_000}, "log": {"progress": False, "tensorboard": False}}


def _train(out: Path, steps: int, log: dict, **sections) -> dict:
    from trimtab.api import train

    return train(
        preset="debug",
        out=str(out),
        data=QUICK["data"],
        log={**QUICK["log"], **log},
        train={"max_steps": steps, "log_every": 1, "eval_every": 5},
        **sections,
    )


def _mlflow_run(db: Path, experiment: str):
    client = pytest.importorskip("mlflow.tracking").MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {db}"
    runs = client.search_runs([exp.experiment_id])
    return client, runs


def test_mlflow_holds_the_metrics_config_decisions_report_and_checkpoint(tmp_path):
    pytest.importorskip("mlflow")
    _train(tmp_path / "a", 10, {"mlflow": {"enabled": True}}, faults=["nan_loss@4"])
    client, runs = _mlflow_run(tmp_path / "mlflow.db", "debug")  # default store: beside the run directory
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "a" and run.info.status == "FINISHED"
    assert float(run.data.params["optim.lr"]) > 0 and run.data.params["model.n_layers"].isdigit()
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 11))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [5, 10]
    (decision,) = client.get_metric_history(run.info.run_id, "decision/skip_step")
    assert decision.step == 4
    assert run.data.tags["decision.1"] == "step 4 nonfinite -> skip_step"
    assert run.data.tags["trimtab.status"] == "completed"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.html", "config.yaml", "decisions.jsonl", "summary.json", "checkpoint"} <= names
    (ckpt,) = client.list_artifacts(run.info.run_id, "checkpoint")
    assert ckpt.path == "checkpoint/step_000010"
    assert (tmp_path / "mlartifacts").is_dir() and not Path("mlruns").exists()  # never in the working directory


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    pytest.importorskip("mlflow")
    store = {"mlflow": {"enabled": True, "uri": f"sqlite:///{tmp_path / 'store.db'}", "experiment": "resumed"}}
    _train(tmp_path / "r", 6, store, checkpoint={"every": 3})
    _train(tmp_path / "r", 10, store, checkpoint={"every": 3})
    client, runs = _mlflow_run(tmp_path / "store.db", "resumed")
    assert len(runs) == 1
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert sorted(set(steps)) == list(range(1, 11))


def test_wandb_offline_writes_the_run_with_config_metrics_and_decisions(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    _train(tmp_path / "w", 8, {"wandb": {"enabled": True}}, faults=["nan_loss@3"])
    (offline,) = (tmp_path / "w" / "wandb").glob("offline-run-*")
    (history,) = offline.glob("run-*.wandb")
    data = history.read_bytes()  # W&B's protobuf log: its keys are stored as they are
    for key in (b"val_loss", b"train/step", b"decision/skip_step", b"optim", b"step_000008"):
        assert key in data, key
    (table,) = offline.glob("files/media/table/decisions_*.table.json")
    rows = json.loads(table.read_text())["data"]
    assert [(r[1], r[2], r[3]) for r in rows] == [(3, "nonfinite", "skip_step")]


def test_tracking_off_writes_nothing_and_a_missing_library_is_named(tmp_path, monkeypatch):
    _train(tmp_path / "off", 2, {"report": False})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["off"]
    assert not (tmp_path / "off" / "wandb").exists()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"log.mlflow.enabled is true but mlflow is not installed.*\[track\]"):
        _train(tmp_path / "missing", 2, {"mlflow": {"enabled": True}})


def test_a_failing_tracker_never_breaks_training(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow")

    def broken(self, metrics):
        raise OSError("the tracking server went away")

    monkeypatch.setattr(tracking.MlflowTracker, "metrics", broken)
    summary = _train(tmp_path / "b", 4, {"mlflow": {"enabled": True}})
    assert summary["status"] == "completed" and summary["step"] == 4
    assert "mlflow: metrics failed (OSError: the tracking server went away); tracking stops" in caplog.text
