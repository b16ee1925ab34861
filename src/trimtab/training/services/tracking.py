"""Experiment trackers as hooks (docs/tracking.md): MLflow and Weights & Biases see a run's
metrics, its resolved config, every orchestrator decision and, at the end, the report and the
final checkpoint. Both libraries are optional (the `track` extra) and imported only when enabled.

A tracker never breaks training: one that fails mid-run warns once and goes quiet (the run's own
files hold everything; a tracker is a copy). A tracker enabled but not installed is refused before
training starts. Trackers keep their run id in the checkpoint, so a resumed run continues the same
tracked run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.checkpoint import latest_valid
from trimtab.config.log import LogConfig, MlflowConfig, WandbConfig
from trimtab.errors import ConfigError
from trimtab.extras import install_command, installed
from trimtab.rundir import CONFIG, DECISIONS_FILE, METRICS_FILE, SUMMARY, json_text, read_decisions
from trimtab.training.hooks import Hook

if TYPE_CHECKING:
    from trimtab.training.view import RunView

log = logging.getLogger(__name__)


def tracking_hooks(log_cfg: LogConfig, run_dir: Path) -> list[Hook]:
    hooks: list[Hook] = []
    if log_cfg.tensorboard:
        quiet_tensorboard_writer()
    if log_cfg.mlflow.enabled:
        _require("mlflow", "log.mlflow.enabled")
        _check_file_store(log_cfg.mlflow.uri)
        hooks.append(MlflowTracker(log_cfg.mlflow, run_dir))
    if log_cfg.wandb.enabled:
        _require("wandb", "log.wandb.enabled")
        hooks.append(WandbTracker(log_cfg.wandb, run_dir))
    return hooks


def quiet_tensorboard_writer() -> None:
    """TensorBoard's writer thread dies at its first failed write (a full disk) and Python prints
    its traceback; TensorBoardLogger (training/hooks.py) meets the same error at its next write,
    says it once and goes on. Only that thread's OSError is kept quiet (threading.excepthook
    filtered, once per process); any other thread's error, or another error, is printed as before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # no TensorBoard: no writer thread to quiet
        return
    printed = threading.excepthook
    if getattr(printed, "quiets_tensorboard", False):
        return

    def excepthook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            printed(args)

    excepthook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = excepthook


def _require(module: str, key: str) -> None:
    if not installed(module):
        raise ConfigError(f"{key} is true but {module} is not installed; {install_command(module)}, or set {key}=false")


def _check_file_store(uri: str) -> None:
    """MLflow 3's file store (`file:/path`) refuses to open unless MLFLOW_ALLOW_FILE_STORE is set: the
    tracker's start failed with a warning and the run trained untracked (debug, log.mlflow.uri=file:/tmp/x,
    mlflow 3.18). Refused here, before training, as a URI that cannot work is (config/log.py)."""
    if not uri.startswith("file:"):
        return
    import mlflow
    from mlflow import environment_variables

    allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # absent: a version that opens it
    if allow is not None and not allow.get():
        raise ConfigError(
            f"log.mlflow.uri: {uri} is MLflow's file store, which mlflow {mlflow.__version__} no longer opens by "
            "default; use sqlite:///PATH/mlflow.db (or leave log.mlflow.uri empty: a SQLite file beside the run "
            "directories), or export MLFLOW_ALLOW_FILE_STORE=true to use the file store anyway"
        )


def flat_config(cfg: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 3e-4}} -> {"optim.lr": "0.0003"}; lists as JSON (trackers take strings)."""
    out: dict[str, str] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


TABLE_COLUMNS = ("id", "step", "rule", "action", "confidence", "reasoning", "evidence", "outcome")


def decision_table(run_dir: Path) -> list[list[Any]]:
    """The kept decisions as rows of TABLE_COLUMNS; evidence and outcome as JSON text (a table
    cell holds one value, and an outcome is null until the journal measures it). W&B's and MLflow's
    tables are JSON, which has no NaN: a NaN in evidence (a NaN loss's) as rundir.json_text writes it, a
    cell's as null (a string would change the column's type, which wandb.Table refuses)."""
    nested = ("evidence", "outcome")
    return [[_cell(d.get(c), c in nested) for c in TABLE_COLUMNS] for d in read_decisions(run_dir)]


def _cell(value: Any, nested: bool) -> Any:
    if nested:
        return json_text(value, default=str)
    return None if isinstance(value, float) and not math.isfinite(value) else value


def trimtab_version() -> str:
    import trimtab  # here, not at the top: trimtab/__init__ imports the API, which imports this module

    return trimtab.__version__


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}  # NaN too: evidence


RETRY_AFTER = 60.0  # seconds before a tracker that failed is tried again, doubled after each failure in a row
OUTAGES = 5  # failures in a row (about half an hour down) before tracking stops for the run
BACKLOG = 10_000  # metric records kept for a tracker that is down, sent when it is back (the oldest dropped past it)


class Tracker(Hook):
    """What both trackers share: failure containment, decisions sent once each as the journal
    takes them (Hook.on_decision), the end.

    A failure pauses the tracker, not the run's tracking: a server that blipped for seconds ended tracking
    for the run (MLflow's retries at 2: ~6 s). It is tried again after RETRY_AFTER seconds, doubling, and the
    metrics and decisions taken meanwhile are sent then, in order; after OUTAGES failures in a row it stops.
    A failed try costs the step it falls in the client's own retries, so tries are spaced, not made each step."""

    name = "tracker"

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_id: str | None = None
        self.sent_decisions: set[int] = set()
        self.queued: list[
            dict[str, Any]
        ] = []  # decisions not sent yet (taken before the tracker started, or while down)
        self.backlog: list[dict[str, Any]] = []  # metric records not sent yet (while down)
        self.dropped = 0  # metric records the backlog had no room for
        self.live = False  # between start and end: decisions go out as they come
        self.started = False
        self.run: RunView | None = None
        self.failures, self.retry_at = 0, 0.0  # failures in a row; no try before retry_at (time.monotonic)
        self.broken = False

    def guard(self, what: str, call, *args, force: bool = False) -> None:
        """`call`, after what a failure left unsent; a failure pauses the tracker (class docstring). `force`:
        tried even while paused (the run's end: no later try)."""
        if self.broken or (time.monotonic() < self.retry_at and not force):
            return
        try:
            self._catch_up()
            call(*args)
        except Exception as exc:  # noqa: BLE001 -- a tracker is a copy of the run's files: never fatal
            self._failed(what, exc)
            return
        if self.failures:
            lost = f", {self.dropped} metric records dropped" if self.dropped else ""
            log.warning("%s: back after %d failed tries; what it missed is sent%s", self.name, self.failures, lost)
        self.failures = self.dropped = 0

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        reason = f"{self.name}: {what} failed ({type(exc).__name__}: {exc})"
        if self.failures >= OUTAGES or not self.live:  # not live: the run's end
            self.broken, self.backlog, self.queued = True, [], []
            log.warning("%s; tracking stops, training goes on", reason)
            return
        wait = RETRY_AFTER * 2 ** (self.failures - 1)
        self.retry_at = time.monotonic() + wait
        log.warning("%s; tracking paused, tried again in %.0f s (training goes on)", reason, wait)

    def _catch_up(self) -> None:
        """The start if it failed, then the decisions and metric records a failure left unsent, oldest first."""
        if not self.started:
            self.start(self.run)
            self.started = True
        while self.queued:
            d = self.queued[0]
            if d["id"] not in self.sent_decisions:
                self.decision(d)
                self.sent_decisions.add(d["id"])
            self.queued.pop(0)
        while self.backlog:
            self.metrics(self.backlog[0])
            self.backlog.pop(0)

    def _send(self, what: str, metrics: dict[str, Any]) -> None:
        if self.broken:
            return
        self.backlog.append(metrics)
        if len(self.backlog) > BACKLOG:
            del self.backlog[0]
            self.dropped += 1
        self.guard(what, lambda: None)

    def on_train_start(self, run: RunView) -> None:
        self.run, self.live = run, True
        self.guard("start", lambda: None)

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._send("metrics", metrics)

    def on_decision(self, run: RunView, decision: dict[str, Any]) -> None:
        self.queued.append(decision)
        if self.live:
            self.guard("decisions", lambda: None)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._send("metrics", metrics)

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        # Trackers append; they cannot take the abandoned steps back. A marker says where the
        # replayed steps begin (metrics.jsonl and the report tell kept from abandoned).
        self._send("rollback", {"step": run.step, "rollback": 1.0})

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self.live = False  # a failure now stops it: there is no later try
        if self.run is not None:
            self.guard("end", self.end, summary, force=True)

    def artifacts(self) -> list[Path]:
        """The report, the run's own files and (newest valid) final checkpoint."""
        files = [self.run_dir / n for n in ("report.html", CONFIG, DECISIONS_FILE, METRICS_FILE)]
        return [f for f in files if f.is_file()]

    def checkpoint(self) -> Path | None:
        found = latest_valid(self.run_dir)
        return found[0] if found else None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "sent_decisions": sorted(self.sent_decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")
        self.sent_decisions = set(state.get("sent_decisions", []))

    def start(self, run: RunView) -> None: ...

    def metrics(self, metrics: dict[str, Any]) -> None: ...

    def decision(self, d: dict[str, Any]) -> None: ...

    def end(self, summary: dict[str, Any]) -> None: ...


HTTP_RETRIES = 2  # MLFLOW_HTTP_REQUEST_MAX_RETRIES unless the environment sets it (MlflowTracker.start)


class MlflowTracker(Tracker):
    """MLflow through MlflowClient with an explicit run id (no global active run: several runs in
    one process, such as tune's trials, never cross). Decisions: a metric `decision/<action>` at
    the decision's step (its confidence) and tags; the journal itself as an artifact."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_dir: Path):
        super().__init__(run_dir)
        self.cfg = cfg
        root = self.run_dir.resolve().parent
        self.uri = cfg.uri or f"sqlite:///{root / 'mlflow.db'}"
        self.artifact_root = (root / "mlartifacts").as_uri()
        self.client = None

    def start(self, run: RunView) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow retries each HTTP request 7 times with a doubling backoff (about 4 minutes): a server that is
        # down held the run's start for over 10 minutes (log.mlflow.uri=http://127.0.0.1:9, 5 connects), and
        # each later call would stall training as long before the tracker gave up. 2 retries (6 s) unless set.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
        exp_id = self.connect(MlflowClient, self.cfg.experiment or run.cfg.preset)
        if self.run_id is not None:  # a resumed run continues its tracked run
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {
            "trimtab.preset": run.cfg.preset,
            "trimtab.run_dir": str(self.run_dir.resolve()),
            "trimtab.version": trimtab_version(),
        }
        self.run_id = self.client.create_run(exp_id, run_name=self.run_dir.name, tags=tags).info.run_id
        from mlflow.entities import Param

        # MLflow's limits: keys of 250 characters, values of 6000 (a long data.mix list is cut).
        params = [Param(_key(k)[:250], v[:6000]) for k, v in flat_config(run.cfg.to_dict()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def connect(self, client: type, name: str, tries: int = 5) -> str:
        """The client, and the experiment's id (created if new). Processes starting together on a
        new store (tune's workers) race to create its tables and the experiment: losers retry. A server
        (http, https) has no such race, and its client retries on its own: tried once."""
        tries = 1 if self.uri.startswith(("http://", "https://")) else tries
        for attempt in range(1, tries):
            try:
                self.client = client(tracking_uri=self.uri)
                return self._experiment(name)
            except Exception:  # noqa: BLE001 -- MLflow raises several kinds here; the last try raises
                time.sleep(0.5 * attempt)
        self.client = client(tracking_uri=self.uri)
        return self._experiment(name)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name, self.artifact_root)

    def metrics(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(metrics["step"])
        batch = [Metric(_key(k), v, now, step) for k, v in numbers(metrics).items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def decision(self, d: dict[str, Any]) -> None:
        self.client.log_metric(self.run_id, f"decision/{d['action']}", float(d.get("confidence", 1.0)), step=d["step"])
        self.client.set_tag(self.run_id, f"decision.{d['id']}", f"step {d['step']} {d['rule']} -> {d['action']}")

    def end(self, summary: dict[str, Any]) -> None:
        for path in self.artifacts():
            self.client.log_artifact(self.run_id, str(path))
        self.client.log_dict(self.run_id, _jsonable(summary), SUMMARY)
        self.table()
        ckpt = self.checkpoint() if self.cfg.log_checkpoint else None
        if ckpt is not None:
            self.client.log_artifacts(self.run_id, str(ckpt), f"checkpoint/{ckpt.name}")
        self.client.set_tag(self.run_id, "trimtab.status", summary.get("status", ""))
        # a SIGTERM's stop (exit 143, "stopped (SIGTERM)": preempted, it resumes) is KILLED, not FAILED
        stopped = str(summary.get("status", "")).startswith("stopped")
        status = "FINISHED" if summary.get("exit_code", 0) in (0, None) else "KILLED" if stopped else "FAILED"
        self.client.set_terminated(self.run_id, status=status)

    def table(self) -> None:
        """decisions.table.json in the format of MlflowClient.log_table (pandas' "split" JSON) and
        its tag, so the UI shows it as a table. Not log_table itself: it needs pandas, and it
        appends to an existing table, which would repeat every decision of a resumed run."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        name = "decisions.table.json"
        self.client.log_dict(self.run_id, {"columns": list(TABLE_COLUMNS), "data": decision_table(self.run_dir)}, name)
        logged = json.loads(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        if {"path": name, "type": "table"} not in logged:
            logged.append({"path": name, "type": "table"})
            self.client.set_tag(self.run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(logged))


def _key(name: str) -> str:
    """MLflow metric and param names: alphanumerics, _ - . / and space; others become _."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def _jsonable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as the trackers' JSON holds it: no NaN (rundir.json_text)."""
    return json.loads(json_text(summary, default=str))


class WandbTracker(Tracker):
    """Weights & Biases; offline (the default) writes RUN_DIR/wandb for `wandb sync`, no network.
    W&B's step must only grow, so metrics go on their own axis `train/step` (define_metric) and a
    replayed step after a rollback is logged again, not dropped."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path):
        super().__init__(run_dir)
        self.cfg = cfg
        self.wb = None

    def start(self, run: RunView) -> None:
        import wandb

        if self.run_id is None:
            self.run_id = uuid.uuid4().hex[:12]
        self.wb = wandb.init(
            project=self.cfg.project,
            name=self.run_dir.name,
            id=self.run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=self.cfg.mode,
            config=run.cfg.to_dict(),
            tags=[run.cfg.preset, f"trimtab-{trimtab_version()}"],
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.wb.define_metric("train/step")
        self.wb.define_metric("*", step_metric="train/step")

    def metrics(self, metrics: dict[str, Any]) -> None:
        self.wb.log({**numbers(metrics), "train/step": int(metrics["step"])})

    def decision(self, d: dict[str, Any]) -> None:
        self.wb.log({f"decision/{d['action']}": float(d.get("confidence", 1.0)), "train/step": d["step"]})

    def end(self, summary: dict[str, Any]) -> None:
        import wandb

        self.wb.log({"decisions": wandb.Table(columns=list(TABLE_COLUMNS), data=decision_table(self.run_dir))})
        self.wb.summary.update({k: v for k, v in _jsonable(summary).items() if isinstance(v, (int, float, str))})
        artifact = wandb.Artifact(f"run-{self.run_id}", type="trimtab-run")
        for path in self.artifacts():
            artifact.add_file(str(path))
        ckpt = self.checkpoint() if self.cfg.log_checkpoint else None
        if ckpt is not None:
            artifact.add_dir(str(ckpt), name=f"checkpoint/{ckpt.name}")
        self.wb.log_artifact(artifact)
        self.wb.finish(exit_code=int(summary.get("exit_code", 0) or 0))
