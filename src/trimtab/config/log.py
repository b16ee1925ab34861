"""The `log:` section: console progress, TensorBoard, the end-of-run report and the experiment
trackers (MLflow, Weights & Biases: training/services/tracking.py, docs/tracking.md)."""

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
class LogConfig(Section):
    progress: bool = True  # progress bar on the console
    tensorboard: bool = True
    report: bool = True  # write RUN_DIR/report.html at the end of the run (trimtab report)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        self.mlflow.validate()
        self.wandb.validate()
