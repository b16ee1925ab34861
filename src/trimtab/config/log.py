"""The `log:` section: console progress, TensorBoard, the end-of-run report, the experiment
trackers (MLflow, Weights & Biases: training/services/tracking.py, docs/tracking.md) and live
metrics for Prometheus (training/services/prometheus.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check


@dataclass
class MlflowConfig(Section):
    """MLflow tracking (training/services/tracking.py): metrics, the resolved config, decisions as events,
    the report and the final checkpoint as artifacts."""

    enabled: bool = False
    uri: str = ""  # tracking URI; empty: sqlite:///<the run directory's parent>/mlflow.db (no server)
    experiment: str = ""  # empty: the preset's name
    log_checkpoint: bool = True  # the final checkpoint as an artifact (a copy: mind the size)

    def validate(self) -> None:
        # A tracker that fails at its start only warns (it never stops a run): a URI that cannot
        # work is caught here instead, before training. A bare path means MLflow's file store,
        # which we do not use: write file:/path to mean it.
        _check(
            not self.uri or "://" in self.uri or self.uri.startswith(("file:", "databricks")),
            "log.mlflow.uri",
            f"must be a tracking URI (sqlite:///path/mlflow.db, http://host:5000, file:/path), not {self.uri!r}",
        )
        _check(
            not self.experiment or self.experiment.strip() == self.experiment,
            "log.mlflow.experiment",
            "must not begin or end with spaces",
        )


@dataclass
class WandbConfig(Section):
    """Weights & Biases tracking (training/services/tracking.py); offline writes <run_dir>/wandb for
    `wandb sync` later and needs no network."""

    enabled: bool = False
    project: str = "trimtab"
    mode: str = "offline"  # offline | online
    log_checkpoint: bool = True  # the final checkpoint in the run's artifact (a copy: mind the size)

    def validate(self) -> None:
        _check(self.mode in ("offline", "online"), "log.wandb.mode", "must be offline or online")
        # W&B's own rules for a project name, checked here rather than failing at the first log.
        bad = set(self.project) & set("/\\#?%:")
        _check(
            0 < len(self.project) <= 128 and not bad,
            "log.wandb.project",
            "must be 1-128 characters, none of / \\ # ? % :",
        )


@dataclass
class PrometheusConfig(Section):
    """Live metrics for Prometheus (training/services/prometheus.py, docs/tracking.md): every rank
    serves /metrics on `port` + its local rank, labelled with the run, the rank and the host."""

    enabled: bool = False
    port: int = 9400
    addr: str = "0.0.0.0"  # the interface to listen on (127.0.0.1: this machine only)

    def validate(self) -> None:
        _check(1 <= self.port <= 65535, "log.prometheus.port", "must be a TCP port, 1-65535")


@dataclass
class LogConfig(Section):
    progress: bool = True  # progress bar on the console
    tensorboard: bool = True
    report: bool = True  # write RUN_DIR/report.html at the end of the run (trimtab report)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)

    def validate(self) -> None:
        self.mlflow.validate()
        self.wandb.validate()
        self.prometheus.validate()
