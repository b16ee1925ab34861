"""Experiment tracking (training/services/tracking.py), offline: MLflow in a local SQLite store and W&B in
offline mode, on tiny real runs with an injected fault (so there is a decision to track)."""

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.training.services import tracking

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


def test_mlflow_holds_the_metrics_config_decisions_report_and_checkpoint(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import trimtab

    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # MLflow's own defaults would write ./mlflow.db or ./mlruns here

    # weights_nan: the first non-finite step rolls back to step 6, and steps 7-8 are trained again
    faults = ["weights_nan@8"]
    _train(tmp_path / "a", 10, {"mlflow": {"enabled": True}}, faults=faults, checkpoint={"every": 3})
    client, runs = _mlflow_run(tmp_path / "mlflow.db", "debug")  # default store: beside the run directory
    assert len(runs) == 1
    run, run_id = runs[0], runs[0].info.run_id
    assert run.info.run_name == "a" and run.info.status == "FINISHED"
    assert float(run.data.params["optim.lr"]) > 0 and run.data.params["model.n_layers"].isdigit()
    assert json.loads(run.data.params["faults"]) == faults  # lists as JSON
    # MLflow keeps both branches: the abandoned steps 7-8, then the replayed ones after the marker
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [*range(1, 9), 7, 8, 9, 10]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "rollback")] == [(6, 1.0)]
    assert [m.step for m in client.get_metric_history(run_id, "val_loss")] == [5, 10]
    assert [m.step for m in client.get_metric_history(run_id, "decision/rollback")] == [8]
    assert run.data.tags["decision.1"] == "step 8 nonfinite -> rollback"
    assert run.data.tags["trimtab.status"] == "completed"
    assert run.data.tags["trimtab.version"] == trimtab.__version__ and run.data.tags["trimtab.preset"] == "debug"
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "decisions.jsonl", "decisions.table.json", "summary.json", "checkpoint"} <= names
    if (tmp_path / "a" / "report.html").exists():
        assert "report.html" in names
    rows = json.loads(Path(client.download_artifacts(run_id, "decisions.table.json", str(tmp_path))).read_text())
    # the rollback may be followed by checkpoint_interval's (the run's rollbacks count in Young's MTBF;
    # whether it moves the interval depends on the measured save stall)
    table = [(r[1], r[2], r[3]) for r in rows["data"]]
    assert [d for d in table if d[1] != "checkpoint_interval"][-1] == (8, "nonfinite", "rollback")
    # the tag MlflowClient.log_table sets: the UI shows the file as a table
    assert {"path": "decisions.table.json", "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    (ckpt,) = client.list_artifacts(run_id, "checkpoint")
    assert ckpt.path == "checkpoint/step_000010"
    assert {"model.safetensors", "state.json"} <= {Path(a.path).name for a in client.list_artifacts(run_id, ckpt.path)}
    assert (tmp_path / "mlartifacts").is_dir() and not any((tmp_path / "cwd").iterdir())  # nothing in the CWD


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    pytest.importorskip("mlflow")
    store = {"mlflow": {"enabled": True, "uri": f"sqlite:///{tmp_path / 'store.db'}", "experiment": "resumed"}}
    _train(tmp_path / "r", 6, store, checkpoint={"every": 3})
    _train(tmp_path / "r", 10, store, checkpoint={"every": 3})
    client, runs = _mlflow_run(tmp_path / "store.db", "resumed")
    assert len(runs) == 1
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert steps == list(range(1, 11)) and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.max_steps"] == "6"  # params: the first session's config


def _wandb_records(path: Path) -> Iterator:
    """The records of an offline run's .wandb file. wandb 0.31 has no Python reader of its own
    (wandb-core, in Go, writes and syncs it), so this reads its format: a 7-byte header, then
    LevelDB's log format (32 KiB blocks of chunks: crc32, length, type) around protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a .wandb file"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _settled_records(path: Path, timeout_s: float = 30.0) -> list:
    """_wandb_records once the file is whole: wandb-core (a process of its own) may still be
    writing its last record when wandb.finish() has returned (seen under load: a truncated tail)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(_wandb_records(path))
        except DecodeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_writes_the_run_with_config_metrics_and_decisions(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    _train(tmp_path / "w", 8, {"wandb": {"enabled": True}}, faults=["nan_loss@3"])
    (offline,) = (tmp_path / "w" / "wandb").glob("offline-run-*")
    (history_file,) = offline.glob("run-*.wandb")
    records = _settled_records(history_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "w" and "debug" in run.tags
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["optim"]["lr"] > 0 and config["preset"] == "debug"
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["train/step"] for h in history if "loss" in h] == list(range(1, 9))
    assert [h["train/step"] for h in history if "val_loss" in h] == [5, 8]
    assert [h["train/step"] for h in history if "decision/skip_step" in h] == [3]
    (table,) = offline.glob("files/media/table/decisions_*.table.json")
    rows = json.loads(table.read_text())["data"]
    assert [(r[1], r[2], r[3]) for r in rows] == [(3, "nonfinite", "skip_step")]
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    files = {e.path for a in artifacts for e in a.manifest.contents}
    assert {"decisions.jsonl", "config.yaml", "checkpoint/step_000008/model.safetensors"} <= files


def test_tracking_off_writes_nothing_and_a_missing_library_is_named(tmp_path, monkeypatch):
    for module in ("mlflow", "wandb"):  # None in sys.modules: any import of them raises
        monkeypatch.setitem(sys.modules, module, None)
    _train(tmp_path / "off", 2, {"report": False})
    monkeypatch.undo()
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
    assert "mlflow: metrics failed (OSError: the tracking server went away); tracking paused" in caplog.text
    assert "tracking stops, training goes on" in caplog.text  # tried once more at the end, then no more


def test_a_tracking_server_that_blips_gets_what_it_missed_when_it_is_back(tmp_path, monkeypatch, caplog):
    """A failure ended tracking for the run: a server down for seconds (with MLflow's retries at 2, ~6 s) left
    its run without the rest of the metrics and decisions. It is tried again later (RETRY_AFTER, 0 here), and
    gets the records and decisions taken meanwhile, in order."""
    pytest.importorskip("mlflow")
    monkeypatch.setattr(tracking, "RETRY_AFTER", 0.0)
    sent, failed = tracking.MlflowTracker.metrics, []

    def blips(self, metrics):
        if metrics["step"] in (3, 4) and len(failed) < 3:  # down for steps 3-4 (tried again at each)
            failed.append(metrics["step"])
            raise ConnectionError("connection reset")
        sent(self, metrics)

    monkeypatch.setattr(tracking.MlflowTracker, "metrics", blips)
    summary = _train(tmp_path / "c", 8, {"mlflow": {"enabled": True}}, faults=["nan_loss@4"])
    assert summary["status"] == "completed" and failed == [3, 3, 3]
    client, (run,) = _mlflow_run(tmp_path / "mlflow.db", "debug")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 9))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "decision/skip_step")] == [4]
    assert run.info.status == "FINISHED" and "back after 3 failed tries" in caplog.text


def test_a_tracker_down_for_good_stops_after_its_tries_and_waits_between_them(monkeypatch):
    """Tries are spaced (each costs a step the client's retries), doubling, and end after OUTAGES."""
    clock = [0.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: clock[0])
    tracker, tries = tracking.Tracker(Path("r")), []
    tracker.started, tracker.live, tracker.run = True, True, object()
    tracker.metrics = lambda m: (tries.append(clock[0]), (_ for _ in ()).throw(OSError("down")))
    for second in range(0, 2000, 10):
        clock[0] = float(second)
        tracker.on_log(None, {"step": second, "loss": 1.0})
    assert tries == [0.0, 60.0, 180.0, 420.0, 900.0] and tracker.broken
    assert tracker.backlog == []  # kept while it was tried, not after: the run's files hold them


@pytest.mark.parametrize(
    ("key", "value"),
    [("log.mlflow.uri", "runs/mlflow.db"), ("log.wandb.project", "a/b"), ("log.wandb.mode", "cloud")],
)
def test_a_tracker_setting_that_cannot_work_is_refused_naming_its_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(preset="debug", sets=[f"{key}={value}"])


def test_a_tracking_server_that_is_down_fails_the_start_at_once(tmp_path, monkeypatch):
    """log.mlflow.uri=http://127.0.0.1:9 (nothing listens): MLflow's 7 retries a request inside our 5 connects held
    the run's start for over 10 minutes. A server is tried once, with MLflow's retries at 2 unless set; a SQLite
    store keeps the retries its first writers' race needs."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    made = []

    def refused(tracking_uri):
        made.append(tracking_uri)
        raise ConnectionRefusedError(111, "Connection refused")

    run = type("Run", (), {"cfg": load_config(preset="debug")})()
    for uri, tries in (("http://127.0.0.1:9", 1), (f"sqlite:///{tmp_path / 'm.db'}", 5)):
        made.clear()
        tracker = tracking.MlflowTracker(tracking.MlflowConfig(enabled=True, uri=uri), tmp_path / "r")
        monkeypatch.setattr("mlflow.tracking.MlflowClient", refused)
        with pytest.raises(ConnectionRefusedError):
            tracker.start(run)
        assert made == [uri] * tries
    assert tracking.os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
