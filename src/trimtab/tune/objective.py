"""One trial: an ordinary trimtab run in STUDY_DIR/trials/trial_NNNN, fed to Optuna.

The pruner sees the run's evaluations through PruningHook, which knows the orchestrator: an
evaluation is reported only once it has *settled* (a few steps passed without an intervention),
one taken in the healing window after an intervention (the orchestrator's outcome window,
`orchestrator.outcome_after` steps) is held back, and one that a rollback abandoned is dropped,
so a fault the orchestrator healed is not held against the trial's hyperparameters. A run the
orchestrator gave up on (exit code 3) is pruned with its reason.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from trimtab.api import train_or_raise
from trimtab.errors import RunFinished, TrimtabError
from trimtab.model.catalog import model_size
from trimtab.rundir import healed, read_decisions, read_metrics
from trimtab.training.hooks import Hook
from trimtab.training.services.signals import PREEMPTED_EXIT, handle_signals
from trimtab.tune.space import Space

if TYPE_CHECKING:
    from trimtab.config import RunConfig
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView

log = logging.getLogger(__name__)

GAVE_UP = 3  # exit code of a run the orchestrator stopped as unrecoverable (docs/orchestrator.md)


class PruningHook(Hook):
    """Reports settled evaluations to the trial and stops the run through Control when the pruner says so."""

    def __init__(self, trial: optuna.Trial, space: Space):
        self.trial = trial
        self.aware = space.orchestrator_aware
        self.settle = space.settle_steps
        self.pending: list[tuple[int, float]] = []  # evaluations waiting to settle
        self.reported: list[int] = []
        self.held: list[int] = []  # evaluations in a healing window, never reported
        self.pruned = ""  # why the pruner stopped the run
        self.last = (0, float("nan"))  # the last evaluation reported

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self.pending.append((metrics["step"], float(metrics["val_loss"])))
        if not self.aware:  # the plain Optuna integration: report and ask at once
            self._settle(run, final=True)
            self._ask(run)

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        if self.pending and self._settle(run, final=False):
            self._ask(run)

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        # The steps after the restored one are trained again: what was measured there is abandoned.
        self.pending = [(s, v) for s, v in self.pending if s <= run.step]

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self._settle(run, final=True)  # the last evaluation: reported for the other trials' pruning

    def _settle(self, run: RunView, final: bool) -> bool:
        """Report the pending evaluations that have settled; True when one was reported."""
        window = run.cfg.orchestrator.outcome_after
        interventions = _intervention_steps(run.run_dir) if self.aware else []
        reported = False
        for step, value in list(self.pending):
            if not final and run.step < step + self.settle:
                continue
            self.pending.remove((step, value))
            if any(d <= step < d + window or step < d <= step + self.settle for d in interventions):
                self.held.append(step)
            elif step not in self.reported:  # a step trained again after a rollback keeps its first report
                self.trial.report(value, step)
                self.reported.append(step)
                self.last = (step, value)
                reported = True
        return reported

    def _ask(self, run: RunView) -> None:
        if self.pruned or run.stopping or not self.trial.should_prune():
            return
        step, value = self.last
        pruner = type(self.trial.study.pruner).__name__
        self.pruned = f"{pruner} at step {step} (val_loss {value:.4f})"
        run.control.request("stop", reason=f"pruned by {self.pruned}")


def _intervention_steps(run_dir: Path) -> list[int]:
    """Steps at which the orchestrator (or a person) changed the run: applied decisions of the
    kept trajectory (a skipped update, an LR change, a rollback, ...)."""
    return [d["step"] for d in read_decisions(run_dir) if d.get("applied") and d.get("action") not in (None, "none")]


@dataclass
class TrialResult:
    state: TrialState
    values: list[float] | None
    interrupted: bool = False


def run_trial(study: optuna.Study, trial: optuna.Trial, space: Space, study_dir: Path) -> TrialResult:
    """Sample the trial's config, train it in its run directory and tell the study how it ended."""
    params = {p.key: _suggest(trial, p.key, p.distribution()) for p in space.params}
    rerun = trial.user_attrs.get("rerun_of")  # a re-run resumes the interrupted trial's run directory
    run_dir = study_dir / "trials" / f"trial_{rerun if rerun is not None else trial.number:04d}"
    try:
        cfg = space.config(params, run_dir, extra=study_defaults(space, study_dir))
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("config", cfg.to_dict())
        hook = PruningHook(trial, space) if space.pruner != "none" else None
        # the run reuses this handler (signals.py), so a signal it took after its last step (the final
        # evaluation, the report) still stops the study: the run ends completed, and would swallow it
        with Heartbeat(study, trial), handle_signals() as signals:
            summary = _train(cfg, hook)
    except TrimtabError as exc:  # a bad point of the space (a config the model cannot take): this trial only
        log.warning("trial %d failed: %s", trial.number, exc)
        trial.set_user_attr("error", str(exc))
        study.tell(trial, state=TrialState.FAIL)
        return TrialResult(TrialState.FAIL, None)
    result = _tell(study, trial, space, cfg, summary, hook)
    result.interrupted = result.interrupted or signals.received is not None
    return result


def _suggest(trial: optuna.Trial, name: str, dist: optuna.distributions.BaseDistribution) -> Any:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, optuna.distributions.IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)


def _train(cfg: RunConfig, hook: PruningHook | None) -> dict[str, Any]:
    try:
        return train_or_raise(cfg, [hook] if hook else [])
    except RunFinished as finished:  # a re-run of a trial whose run had already ended
        return finished.summary


def study_defaults(space: Space, study_dir: Path) -> dict[str, Any]:
    """What every trial gets unless the base says otherwise: with MLflow on, one experiment (the
    study's name) in one store in the study directory, so the whole study lands together."""
    mlflow = space.base.get("log", {}).get("mlflow", {})
    if not (isinstance(mlflow, dict) and mlflow.get("enabled")):
        return {}
    uri = f"sqlite:///{study_dir.resolve() / 'mlflow.db'}"
    return {"log": {"mlflow": {"experiment": space.name, "uri": uri}}}


def _tell(
    study: optuna.Study,
    trial: optuna.Trial,
    space: Space,
    cfg: RunConfig,
    summary: dict[str, Any],
    hook: PruningHook | None,
) -> TrialResult:
    """The run's end as an Optuna trial state: PRUNED by the pruner or by an orchestrator that gave
    up (with the reason), FAIL for other failures, COMPLETE with the objectives."""
    decisions = read_decisions(cfg.run_dir)  # the kept ones, as `trimtab runs` counts them
    attrs = {
        "status": summary.get("status"),
        "exit_code": summary.get("exit_code"),
        "val_loss": summary.get("val_loss"),
        "flops": float(summary.get("tokens", 0)) * model_size(cfg).flops_per_token,
        "decisions": len(decisions),
        "faults_healed": healed(decisions),
        "held_evals": hook.held if hook else [],
        "lr_scale": final_lr_scale(cfg.run_dir),
    }
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    pruned = hook.pruned if hook else ""
    person = _stopped_by_person(decisions, summary)
    if pruned or person or summary.get("exit_code") == GAVE_UP:
        reason = f"pruner: {pruned}" if pruned else person or f"orchestrator: {summary.get('status')}"
        trial.set_user_attr("pruned_reason", reason)
        study.tell(trial, state=TrialState.PRUNED)
        return TrialResult(TrialState.PRUNED, None)
    if summary.get("exit_code") not in (0, None, PREEMPTED_EXIT):  # a SIGTERM's stop: interrupted, below
        trial.set_user_attr("error", str(summary.get("status")))
        study.tell(trial, state=TrialState.FAIL)
        return TrialResult(TrialState.FAIL, None)
    early = str(summary.get("status", "")).startswith("stopped (early stopping")  # a result, as a length is
    if summary.get("status") != "completed" and not early:  # stopped by a signal: not counted, re-run on resume
        trial.set_user_attr("interrupted", str(summary.get("status")))
        study.tell(trial, state=TrialState.FAIL)
        return TrialResult(TrialState.FAIL, None, interrupted=True)
    values = [_objective(name, summary, attrs) for name in space.objectives]
    study.tell(trial, values)
    return TrialResult(TrialState.COMPLETE, values)


def final_lr_scale(run_dir: Path) -> float:
    """The LR multiplier (the orchestrator's cuts, a person's scale-lr) at the kept trajectory's last
    logged step: a trial healed of an LR far too high trained at a fraction of its sampled optim.lr."""
    scales = [m["lr_scale"] for m in read_metrics(run_dir) if isinstance(m.get("lr_scale"), int | float)]
    return float(scales[-1]) if scales else 1.0


def _stopped_by_person(decisions: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Why a person stopped the run (`trimtab ctl TRIAL_RUN stop`), when its last step was theirs:
    a trial pruned by hand, not an interruption (which ended the study and re-ran the trial on resume)."""
    stops = [d for d in decisions if d.get("rule") == "manual" and d.get("action") == "stop" and d.get("applied")]
    if not stops or stops[-1].get("step") != summary.get("step") or summary.get("status") == "completed":
        return ""
    return f"a person: trimtab ctl stop ({(stops[-1].get('params') or {}).get('reason', 'stop requested')})"


def _objective(name: str, summary: dict[str, Any], attrs: dict[str, Any]) -> float:
    value = attrs["flops"] if name == "flops" else summary.get(name)
    return float("nan") if value is None else float(value)


class Heartbeat:
    """Records the trial's heartbeat in the storage while it trains, so a worker that dies leaves
    a trial other workers can tell is stale (optuna's fail_stale_trials)."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial):
        self.storage, self.trial_id = study._storage, trial._trial_id  # noqa: SLF001
        interval = getattr(self.storage, "get_heartbeat_interval", lambda: None)()
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as exc:  # a missed beat is retried; the trial must not die of it
                log.debug("heartbeat failed: %s", exc)
            if self.stop.wait(self.interval):
                return

    def __enter__(self) -> Heartbeat:
        if self.interval:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
