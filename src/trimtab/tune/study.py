"""The study: storage, sampler, pruner, and the workers that share it.

Workers on this machine or others join one study through its storage (SQLite in the study
directory by default, any database URL Optuna accepts). A worker claims a trial only while the
study is short of its count, so N trials run in all, never more, and none twice:

- on this machine the claim (count, then ask) holds a file lock in the study directory;
- across machines a trial that finds itself past the count (another machine claimed in the same
  instant) is told FAIL with the user attr `surplus` before it trains;
- a trial whose worker died (no heartbeat for GRACE_S) or was interrupted is marked FAIL, not
  counted, and its parameters are queued again: the next worker re-runs it, resuming its run
  directory where it has one. A worker of this machine that is provably gone (its pid no longer
  its process: fail_gone) is not waited out for GRACE_S; the heartbeat judges other machines'.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from trimtab.config import parse_yaml
from trimtab.config.checks import leaves
from trimtab.errors import ConfigError
from trimtab.tune.objective import run_trial
from trimtab.tune.space import Space

log = logging.getLogger(__name__)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextmanager
def quiet() -> Iterator[None]:
    """Heartbeats and fail_stale_trials are marked experimental, and Optuna expects heartbeats
    with Study.optimize; a study here runs through ask/tell with its own heartbeat thread."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


class GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid, without its study.stop() when the grid is done (allowed only inside
    Study.optimize; here the worker's count ends the study)."""

    def after_trial(self, *args: object, **kwargs: object) -> None:
        pass


HEARTBEAT_S = 10  # a running trial records its heartbeat this often
GRACE_S = 60  # ... and is stale (its worker gone) after this long without one
POLL_S = 2.0  # a worker with nothing to claim checks again this often (others' trials may fail)
SQLITE_TIMEOUT_S = 120  # several processes write one SQLite file: wait for its lock, do not fail


def study_dir(space: Space, out: str | None = None) -> Path:
    return Path(out or space.out or f"runs/tune/{space.name}")


def storage_url(space: Space, directory: Path, storage: str | None = None) -> str:
    return storage or space.storage or f"sqlite:///{(directory / 'study.db').resolve()}"


def make_storage(url: str, grace: int | None = None) -> RDBStorage:
    """An RDB storage with heartbeats; SQLite waits for a locked database instead of failing."""
    grace = grace or GRACE_S
    heartbeat = min(HEARTBEAT_S, grace)
    engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    try:
        with quiet():
            return RDBStorage(url, engine_kwargs=engine, heartbeat_interval=heartbeat, grace_period=grace)
    except Exception as exc:  # a malformed URL, a database that cannot be reached
        raise ConfigError(f"study storage '{url}' cannot be opened: {exc}; pass an Optuna database URL") from None


def make_sampler(space: Space, seed: int) -> optuna.samplers.BaseSampler:
    s, options = optuna.samplers, dict(space.sampler_options)
    try:
        if space.sampler == "grid":
            return GridSampler(space.grid_space(), seed=seed)
        if space.sampler == "tpe":  # sized by the budget: Optuna's 10 random start-up trials are most of a small study
            options.setdefault("n_startup_trials", min(10, max(2, space.total() // 4)))
            options.setdefault("multivariate", True)  # lr and warm-up (say) interact: model them jointly
        cls = {"tpe": s.TPESampler, "cmaes": s.CmaEsSampler, "nsga2": s.NSGAIISampler, "random": s.RandomSampler}
        return cls[space.sampler](seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"{space.where('study.sampler')}: {exc}") from None


def make_pruner(space: Space) -> optuna.pruners.BasePruner:
    p, options = optuna.pruners, dict(space.pruner_options)
    if space.pruner == "hyperband":  # resources are training steps: from the first evaluation to the budget
        options.setdefault("min_resource", int(space.budget.get("eval_every", 1)))
        if "max_steps" in space.budget:
            options.setdefault("max_resource", int(space.budget["max_steps"]))
    cls = {
        "none": p.NopPruner,
        "median": p.MedianPruner,
        "percentile": p.PercentilePruner,
        "hyperband": p.HyperbandPruner,
        "successive_halving": p.SuccessiveHalvingPruner,
        "threshold": p.ThresholdPruner,
    }
    try:
        return cls[space.pruner](**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{space.where('study.pruner')}: {exc}") from None


def open_study(space: Space, url: str, worker: int = 0, grace: int | None = None) -> optuna.Study:
    """Create or join the study (load_if_exists: re-running resumes it). The sampler's seed moves
    with the worker and with the trials already there, so two workers, or a resumed worker, do
    not draw the same random start-up points again."""
    storage = make_storage(url, grace=grace)
    directions = ["minimize"] * len(space.objectives)
    study = optuna.create_study(
        study_name=space.name, storage=storage, directions=directions, load_if_exists=True, pruner=make_pruner(space)
    )
    if len(study.directions) != len(directions):
        raise ConfigError(
            f"study '{space.name}' in {url} has {len(study.directions)} objective(s), the space file "
            f"{len(directions)}; use another study.name or --storage"
        )
    check_trained_as(study, space, url)
    seed = space.seed + 1000 * worker + len(study.get_trials(deepcopy=False))
    if space.sampler == "grid":  # the grid's order comes from the seed and trial k takes point k: one order for all
        seed = space.seed
    study.sampler = make_sampler(space, seed)
    return study


def trained_as(space: Space) -> dict[str, Any]:
    """What a trial's result depends on besides its parameters: the space file's base: (and the
    config file it names) and budget:, as JSON holds them; not log: (progress bars, trackers)."""
    recorded: dict[str, Any] = {"base": space.base, "budget": space.budget}
    if space.base_file is not None:
        recorded["base.config"] = parse_yaml(space.base_file.read_text())
    for key in ("base", "base.config"):
        if isinstance(recorded.get(key), dict):
            recorded[key] = {k: v for k, v in recorded[key].items() if k != "log"}
    return json.loads(json.dumps(recorded, default=str))


def check_trained_as(study: optuna.Study, space: Space, url: str) -> None:
    """A study resumed with another base: or budget: than its trials ran with is refused: its best
    would be picked across budgets (a 20-step trial against 4-step ones). The first open records them."""
    now = trained_as(space)
    before = study.user_attrs.get("trained_as")
    if before is None:  # a new study, or one an older trimtab ran
        study.set_user_attr("trained_as", now)
        return
    old, new = leaves(before), leaves(now)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    changed = [f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys]
    if changed:
        raise ConfigError(
            f"{space.path}: study '{space.name}' in {url} ran its trials with another base:/budget: "
            f"({'; '.join(changed)}), and trials of both would be compared; put them back, or start another "
            "study (a new study.name, --out or --storage)"
        )


def counted(t: FrozenTrial) -> bool:
    """A trial that counts toward the study's total: done, running, queued, or failed on its own
    (an error); not one that a dead or interrupted worker left, nor a surplus claim."""
    if t.state == TrialState.FAIL:
        return "error" in t.user_attrs
    return True


def finished(t: FrozenTrial) -> bool:
    return t.state.is_finished() and counted(t)


@contextmanager
def claim_lock(directory: Path) -> Iterator[None]:
    """One claim at a time among the workers of this machine."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".claim.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine() -> str:
    """Where a pid means one process: the host, its boot (a reboot reuses pids) and the pid
    namespace (containers on one host share its name and boot); on a system without /proc, the host."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {_read('/proc/sys/kernel/random/boot_id')} {namespace}".strip()


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, from /proc; "" where /proc does not say);
    None when no live process has the pid (none, or a zombie a parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's: alive
        pass
    fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()  # after the command's name, which may hold spaces
    if len(fields) < 20:
        return ""
    return None if fields[0] in ("Z", "X") else fields[19]


def this_worker() -> dict[str, object]:
    """The worker's record on the trials it claims: what tells, on this machine, that it is gone."""
    return {"machine": machine(), "pid": os.getpid(), "started": process_start(os.getpid())}


def gone(worker: object) -> bool:
    """The worker of a trial is provably not running: it ran on this machine, and its pid is no
    process now or another one (started at another time). False when unsure (another machine)."""
    if not isinstance(worker, dict) or worker.get("machine") != machine() or not isinstance(worker.get("pid"), int):
        return False
    now = process_start(worker["pid"])
    return now is None or (bool(now) and now != worker.get("started"))


def fail_gone(study: optuna.Study, ended: dict[int, str] | None = None) -> None:
    """Running trials whose worker is gone (gone()) become FAIL now, as fail_stale_trials makes them
    after GRACE_S without a heartbeat: a resumed study takes them back at once. `ended`: how a
    worker of this command ended, by pid (its parent knows: "was killed by SIGKILL")."""
    storage = study._storage  # noqa: SLF001  optuna's own fail_stale_trials works through it
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if not gone(worker):
            continue
        how = (ended or {}).get(worker["pid"], "ended before it finished")
        try:
            lost = f"its worker (pid {worker['pid']} on {socket.gethostname()}) {how}"
            storage.set_trial_user_attr(t._trial_id, "lost", lost)  # noqa: SLF001
            storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)  # noqa: SLF001
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
            pass


def requeue_lost(study: optuna.Study) -> None:
    """Stale trials (a worker that died) become FAIL; each lost trial (stale or interrupted) is
    queued again once with its parameters, so its share of the budget is run."""
    fail_gone(study)
    with quiet():
        optuna.storages.fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    again = {t.user_attrs.get("rerun_of") for t in trials}
    for t in trials:
        lost = t.state == TrialState.FAIL and not counted(t) and "surplus" not in t.user_attrs
        origin = t.user_attrs.get("rerun_of", t.number)
        if lost and origin not in again and t.params:
            study.enqueue_trial(t.params, user_attrs={"rerun_of": origin}, skip_if_exists=False)
            again.add(origin)


def claim(study: optuna.Study, total: int, directory: Path) -> optuna.Trial | None | bool:
    """A trial to run; None when the study has its `total`; False when the rest are running."""
    with claim_lock(directory):
        requeue_lost(study)
        trials = study.get_trials(deepcopy=False)
        if sum(map(finished, trials)) >= total:
            return None
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if sum(map(counted, trials)) >= total and not waiting:
            return False
        with quiet():
            trial = study.ask()
        study._storage.record_heartbeat(trial._trial_id)  # noqa: SLF001  stale-able from its first instant
        trial.set_user_attr("worker", this_worker())  # gone-able too, on this machine
    ahead = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number and counted(t)]
    if len(ahead) >= total and "rerun_of" not in trial.user_attrs:  # another machine claimed the last one
        trial.set_user_attr("surplus", True)
        study.tell(trial, state=TrialState.FAIL)
        return False
    return trial


def work(space: Space, url: str, directory: Path, total: int, worker: int = 0) -> int:
    """One worker: claim and run trials until the study has `total`. Returns the trials it ran;
    stops early (returning -1) when a trial was interrupted by a signal."""
    study = open_study(space, url, worker)
    ran = 0
    while True:
        trial = claim(study, total, directory)
        if trial is None:
            return ran
        if trial is False:
            time.sleep(POLL_S)
            continue
        try:
            result = run_trial(study, trial, space, directory)
        except Exception as exc:  # a bug, not a bad point of the space: name the trial for the study's summary
            with suppress(optuna.exceptions.UpdateFinishedTrialError):  # raised after the trial was told
                trial.set_user_attr("crashed", f"{type(exc).__name__}: {exc}")
            raise
        ran += 1
        values = ", ".join(f"{v:.4f}" for v in result.values or [])
        print(f"[tune] trial {trial.number} (worker {worker}): {result.state.name} {values} {trial.params}", flush=True)
        if result.interrupted:
            return -1
