"""`trimtab eval PATH`: a run's newest weights or a Hugging Face directory, scored on a text file
(--data) and/or lm-evaluation-harness tasks (--tasks); results written beside a run, never into
a Hugging Face directory (results_folder).

    FOLDER/<time>[_N].json    what was evaluated (checkpoint step, tasks, limit, versions) and
                              the results (lm-eval's per-task metrics, the file's perplexity);
                              FOLDER: --out, else a run's PATH/eval, else ./eval/<PATH's name>
    PATH/summary.json "eval"  the latest results, merged in (a run directory's, results in PATH/eval)

lm-evaluation-harness is optional (`pip install -c constraints.txt -e '.[eval]'`); the tasks
shipped in trimtab/evaluation/tasks (trimtab_tiny, _gen, _ppl) run offline. Its INFO log lines
are off while it runs (its warnings stay); LMEVAL_LOG_LEVEL, lm-eval's own setting, brings them
back (e.g. LMEVAL_LOG_LEVEL=INFO). Progress bars show on a terminal only, for the slow part (scoring
rolling windows, generating): in a log file each redraw was a line of its own.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any
from unittest import mock

from trimtab.api import load_run_at
from trimtab.checkpoint import local_run
from trimtab.errors import ConfigError, DataError
from trimtab.evaluation.held_out import is_prepared, prepared_figures, run_held_out
from trimtab.evaluation.perplexity import read_texts, score_text
from trimtab.extras import installed, missing, require
from trimtab.hf.importer import is_hf_dir
from trimtab.rundir import CONFIG, read_summary, write_json, write_summary

TASKS_DIR = Path(__file__).parent / "tasks"  # trimtab's own offline tasks
log = logging.getLogger(__name__)


def evaluate(
    path: str | Path,
    *,
    tasks: list[str] = (),
    data: str | None = None,
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    stride: int | None = None,
    sets: Sequence[str] = (),
    held_out: bool = False,
    split: str = "held-out",
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Score the model at `path` and record the results (module docstring; `out`: their folder);
    returns them, with `recorded_in` (the folder) or `not_recorded` (why not) added. `sets`: --set
    items over a run directory's config (api.load_run_at). `held_out`: the run's own held-out rows;
    `split` (held-out or all): which rows of a prepared directory given as `data` (evaluation/held_out.py)."""
    if not tasks and not data and not held_out:
        raise ConfigError(
            "trimtab eval needs --tasks and/or --data (or --held-out); e.g. --tasks trimtab_tiny or --data notes.txt"
        )
    manager = task_manager(tasks, include_path) if tasks else None  # before the model: a wrong name fails fast
    path = local_run(path, "trimtab eval's PATH")  # a run in object storage: its cached copy, where results go
    folder = results_folder(path, out)  # before the model loads: a folder inside it is refused at once
    cfg, model, tok, step = load_run_at(path, sets)  # the step of the checkpoint scored (None: a Hugging Face model)
    results: dict[str, Any] = {"model": str(path), "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if sets:  # scored under other settings than the run's: the record says which
        results["sets"] = list(sets)
    if data and is_prepared(data):  # its rows, as training cuts them (evaluation/held_out.py)
        results["prepared"] = {"directory": str(data), **prepared_figures(data, cfg, model, tok, split)}
    elif data:
        results["data"] = {"file": str(data), **score_text(model, tok, read_texts(data, cfg.data), stride, batch_size)}
    if held_out:
        if step is None:
            raise ConfigError(
                f"--held-out: '{path}' is a Hugging Face model directory, with no run's held-out data; "
                "pass a trimtab run directory, or score a file with --data FILE"
            )
        results["held_out"] = run_held_out(path, cfg, model, tok)
    if tasks:
        results["tasks"] = run_tasks(model, tok, tasks, manager, limit, num_fewshot, batch_size)
        results["versions"] = {"lm_eval": metadata.version("lm_eval")}
    problem = _record(path, results, folder)
    if problem:
        results["not_recorded"] = problem
    else:
        results["recorded_in"] = str(folder)
    return results


def results_folder(path: Path, out: str | Path | None) -> Path:
    """Where evaluate records its results: `out`; a run directory's PATH/eval; for a Hugging Face
    directory eval/<its name> in the current directory, as it is no run's and is uploaded to the Hub
    as it is (its eval/ folder went up with the weights). The run an export came from is not known:
    its trimtab_export.json does not name it. A Hugging Face directory that holds the current directory
    is refused before its model loads: its results would land inside it."""
    if out is not None:
        return Path(out)
    if not is_hf_dir(path):
        return path / "eval"
    folder = Path("eval") / path.resolve().name
    if folder.resolve().is_relative_to(path.resolve()):
        raise ConfigError(
            f"trimtab eval {path}: its results would go to {folder.resolve()}, inside the Hugging Face model "
            "directory, which stays as exported; pass --out DIR for them, or run from another directory"
        )
    return folder


_TASK_LINE = re.compile(r"^(?:task|group|tag):\s*([\w.-]+)\s*$", re.MULTILINE)


def own_tasks(folder: Path = TASKS_DIR) -> list[str]:
    """The names the YAML files under `folder` declare (`task:`, `group:`, `tag:` lines), read as
    text: trimtab's shipped tasks, without importing lm-eval."""
    found = (_TASK_LINE.findall(f.read_text(errors="replace")) for f in sorted(folder.rglob("*.yaml")))
    return sorted({name for names in found for name in names})


def check_task_names(tasks: list[str], include_path: str | None) -> None:
    """A ConfigError for a name that no task YAML mentions at all, trimtab's, --include-path's or
    lm-eval's (their text searched in about a second, where indexing lm-eval's registry takes ~12 s
    and a model loads besides); names mentioned somewhere are left to lm-eval's registry."""
    own = own_tasks()
    unknown = [t for t in tasks if t not in own]
    for f in Path(include_path).rglob("*.yaml") if include_path and unknown else ():
        text = f.read_text(errors="replace")
        unknown = [t for t in unknown if t not in text]
    words = set().union(*lm_eval_folders().values()) if unknown else set()
    unknown = [t for t in unknown if t not in words]
    if unknown:
        raise ConfigError(_unknown(unknown[0], own))


_WORD = re.compile(r"[\w.-]+")  # a task, group or tag name: the characters lm-eval's names use


@functools.cache
def lm_eval_folders() -> dict[Path, frozenset[str]]:
    """Each folder of lm-eval's own tasks (lm_eval/tasks/<folder>, e.g. arithmetic, mmlu) and the
    names its YAML files mention, read as text without importing lm-eval (~1.5 s on 2 CPU cores)."""
    spec = importlib.util.find_spec("lm_eval")
    roots = [Path(folder) / "tasks" for folder in spec.submodule_search_locations or []]
    return {
        folder: frozenset(w for f in folder.rglob("*.yaml") for w in _WORD.findall(f.read_text(errors="replace")))
        for root in roots
        for folder in sorted(root.iterdir())
        if folder.is_dir() and folder.name != "__pycache__"
    }


def _unknown(name: str, own: list[str]) -> str:
    return (
        f"--tasks: unknown task '{name}'; trimtab's own are {', '.join(own)}, or name a task lm-eval knows "
        "(`lm_eval --tasks list` lists them) or add --include-path DIR holding its YAML"
    )


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager knowing every one of `tasks`, or a ConfigError naming the first it
    does not (checked before any model loads: check_task_names first, then the registry)."""
    if not installed("lm_eval"):
        raise ConfigError(missing("lm_eval", "--tasks"))
    check_task_names(tasks, include_path)
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + ([str(include_path)] if include_path else [])
    manager = TaskManager(include_path=paths, include_defaults=False)  # indexing lm-eval's own takes seconds
    if any(t not in manager.all_tasks for t in tasks):
        try:
            narrow = _narrow_manager(tasks, paths)
        except (AttributeError, KeyError, TypeError):  # task_index entries of another shape (a newer lm-eval)
            narrow = None
        manager = narrow or TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(_unknown(unknown[0], own_tasks()))
    return manager


def _narrow_manager(tasks: list[str], paths: list[str]) -> Any:
    """A TaskManager over only the folders of lm-eval's tasks that mention `tasks` or, in turn, the
    members of their groups and tags (lm_eval_folders): the same tasks as its whole registry, which
    takes ~12 s to index (14,000 YAML files parsed); None where that cannot be told, for the whole
    registry: a name it does not know, or a tag declared in two folders (each folder is a root of
    its own, and a later root's tag replaces an earlier one's instead of adding to it)."""
    from lm_eval.tasks import TaskManager

    folders, chosen, wanted = lm_eval_folders(), set(), set(tasks)
    while new := {f for f, words in folders.items() if f not in chosen and wanted & words}:
        chosen |= new
        # In the reverse of the whole registry's file order: a name two folders declare is then the
        # first's there (one root skips a later duplicate) and here (a later root overrides).
        manager = TaskManager(include_path=[*sorted(chosen, reverse=True), *paths], include_defaults=False)
        wanted, tags = _members(manager.task_index, tasks)
    if not chosen or any(t not in manager.all_tasks for t in tasks):
        return None
    index = manager.task_index
    if any(index[tag].tags != {n for n, e in index.items() if tag in e.tags and e.kind.name != "TAG"} for tag in tags):
        return None  # a tag that lost the tasks of an earlier root (docstring)
    return manager


def _members(index: dict[str, Any], names: list[str]) -> tuple[set[str], set[str]]:
    """Every name `names` reach in lm-eval's task index (themselves, their groups' members and
    tags' tasks, recursively), and the tags among them. Entries as TaskManager.task_index gives them."""
    seen, tags, todo = set(), set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        entry = index.get(name)
        if entry is not None and entry.kind.name == "TAG":
            tags.add(name)
            todo += sorted(entry.tags)
        elif entry is not None and entry.kind.name == "GROUP":
            members = (entry.cfg or {}).get("task") or []
            for m in members if isinstance(members, list) else [members]:
                ref = m.get("group", m.get("task")) if isinstance(m, dict) else m
                todo += [ref] if isinstance(ref, str) else []
    return seen, tags


def run_tasks(model, tok, tasks, manager, limit, num_fewshot, batch_size) -> dict[str, Any]:
    """lm-evaluation-harness's simple_evaluate with the trimtab adapter and `manager` (task_manager's);
    per-task metrics."""
    lm_eval = require("lm_eval", "--tasks")

    from trimtab.evaluation.adapter import TrimtabLM

    unreachable = _hub_unreachable(tasks)
    with _quiet_lm_eval(), _dataset_unreachable(tasks, unreachable), _hub_offline(bool(unreachable)):
        out = lm_eval.simple_evaluate(
            model=TrimtabLM(model, tok, batch_size),
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=0,
        )
    return {task: _clean(metrics) for task, metrics in out["results"].items()}


HUB_PROBE_S = 3.0  # one HEAD to the Hub's endpoint; an unresolved name or a refused connection fails in ~0.05 s


def _hub_unreachable(tasks: Sequence[str]) -> str:
    """Why the Hugging Face Hub cannot be reached from here, asked once before lm-eval loads a dataset; ''
    where it answers, where offline mode is on already (datasets refuses a download at once then) or where
    every task is trimtab's own (their data is in the package)."""
    if set(tasks) <= set(own_tasks()):
        return ""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return ""
    try:  # through huggingface_hub's own client: its proxies and HF_ENDPOINT
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S)
    except Exception as exc:  # no answer at all (a name not resolved, a refused connection, a timeout, a proxy's error)
        return f"{constants.ENDPOINT} is unreachable: {exc}"
    return ""


@contextmanager
def _hub_offline(on: bool) -> Iterator[None]:
    """Hugging Face's offline mode (HF_HUB_OFFLINE=1) for lm-eval's run where the Hub is unreachable: datasets
    reads its cache and local files, and refuses a download at once. It tried the Hub 6 times over ~23 s
    first (backoff 1, 2, 4, 8, 8 s: `trimtab eval RUN --tasks arc_easy`, no network, 30.4 s -> 3.8 s). The
    flags are the modules' own, read when each request is made (the variable is read once, at their import)."""
    if not on:
        yield
        return
    import datasets.config
    from huggingface_hub import constants

    flags = [(constants, "HF_HUB_OFFLINE")] + [(datasets.config, f) for f in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")]
    with ExitStack() as stack:
        for module, flag in flags:
            if hasattr(module, flag):  # an older datasets reads HF_DATASETS_OFFLINE alone
                stack.enter_context(mock.patch.object(module, flag, True))
        yield


@contextmanager
def _dataset_unreachable(tasks: Sequence[str], unreachable: str = "") -> Iterator[None]:
    """A task whose dataset is on the Hugging Face Hub, run without a network (or with HF_HUB_OFFLINE=1)
    and not in the datasets cache: refused in one line naming the way out (`unreachable`: why the Hub is,
    _hub_unreachable). It was a 72-line traceback ending in datasets' "ConnectionError: Couldn't reach
    'Rowan/hellaswag' on the Hub", exit 1."""
    try:
        yield
    except ConnectionError as exc:  # datasets' own, huggingface_hub's OfflineModeIsEnabled
        why = f"{exc}; {unreachable}" if unreachable else str(exc)
        raise DataError(
            f"--tasks {','.join(tasks)}: a task's dataset could not be fetched ({why}); run where the Hugging Face "
            "Hub is reachable or the dataset is already in the datasets cache, or use a task with local data: "
            f"trimtab's own ({', '.join(own_tasks())}) or your own YAML with --include-path"
        ) from None


LM_EVAL_LOGGERS = ("lm_eval", "lm-eval")  # its modules log under both names


class _NotForTrimtab(logging.Filter):
    """Drops lm-eval's advice about its own command line (`--metadata`), which trimtab has not;
    lm-eval gives it for every task that builds its dataset in Python, trimtab's shipped ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "can be passed to `--metadata`" not in record.getMessage()


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval at WARNING while it runs (module docstring), unless LMEVAL_LOG_LEVEL says otherwise;
    without its progress bars (building each task's requests: a bar per task, hundreds of lines in
    a log; its errors still raised; the adapter's own scoring bars show on a terminal only); and
    not asking git for the commit of the current directory (not the model's: lm-eval records
    it in results trimtab does not keep, and outside a repository git prints an error), nor
    collecting its environment report for those results (torch's collect_env: pip, conda, lscpu
    and nvidia-smi run as subprocesses, ~2 s of each `trimtab eval` on 2 CPU cores)."""
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator
    import lm_eval.loggers.utils

    level = logging.getLevelName(os.environ.get("LMEVAL_LOG_LEVEL", "WARNING").upper())
    parents = [logging.getLogger(name) for name in LM_EVAL_LOGGERS]  # children inherit, new ones too
    named = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in LM_EVAL_LOGGERS]
    saved = [(lg, lg.level) for lg in parents]
    noise = _NotForTrimtab()
    with ExitStack() as stack:
        for module in (lm_eval.evaluator, lm_eval.loggers.utils):
            if hasattr(module, "get_git_commit_hash"):
                stack.enter_context(mock.patch.object(module, "get_git_commit_hash", lambda: None))
        if hasattr(lm_eval.evaluator, "add_env_info"):
            stack.enter_context(mock.patch.object(lm_eval.evaluator, "add_env_info", lambda storage: None))
        for module in (lm_eval.api.task, lm_eval.api.model):  # its request-building bars: instant, one a task
            if hasattr(module, "tqdm"):
                stack.enter_context(mock.patch.object(module, "tqdm", functools.partial(module.tqdm, disable=True)))
        for lg in parents:
            lg.setLevel(level if isinstance(level, int) else logging.WARNING)  # an unknown name: the default
        for lg in {*parents, *named}:
            lg.addFilter(noise)
        try:
            yield
        finally:
            for lg in {*parents, *named}:
                lg.removeFilter(noise)
            for lg, old in saved:
                lg.setLevel(old)


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's metric names ("acc,none") without the filter suffix, numbers only. A metric that
    several filters score (gsm8k's "exact_match,strict-match" and "exact_match,flexible-extract")
    keeps lm-eval's full names: cut to one name, the last filter's number replaced the others'.
    lm-eval's `sample_len` is how many examples were scored, no score: `samples`, a count (it was
    printed as "sample_len 8.0000" among the scores)."""
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}
    samples = [int(numbers.pop(k)) for k in list(numbers) if k.split(",")[0] == "sample_len"]
    names = [k.split(",")[0] for k in numbers]
    cleaned = {(k.split(",")[0] if names.count(k.split(",")[0]) == 1 else k): v for k, v in numbers.items()}
    return cleaned | ({"samples": samples[0]} if samples else {})


def _record(path: Path, results: dict[str, Any], folder: Path | None = None) -> str | None:
    """The results into `folder` (default PATH/eval/; and there, a run's summary.json); why not where
    it cannot be written (a read-only directory, a full disk): the scores stand and are printed (an
    OSError traceback lost an evaluation that may have taken hours)."""
    folder, record = folder or path / "eval", None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        record = _new_record(folder, results["time"].replace(":", ""))
        write_json(record, results)
        if folder == path / "eval" and (path / CONFIG).is_file():  # a run's summary carries its latest results
            write_summary(path, {**(read_summary(path) or {}), "eval": results})
    except OSError as exc:
        if record is not None and record.is_file() and not record.stat().st_size:
            record.unlink(missing_ok=True)  # the name claimed, the results not written: no empty record left
        log.warning("results not recorded in %s (%s); they are printed only", folder, exc)
        return f"{folder}: {exc.strerror or exc}"
    return None


def _new_record(folder: Path, stamp: str) -> Path:
    """A name of its own under PATH/eval/ for one evaluation's results: <time>.json, or
    <time>_2.json, ... for a second one in the same second (it overwrote the first), claimed by
    creating the file, so two evaluations running at once never take the same one. `_` sorts
    after `.`: the names still sort in the order the evaluations ran."""
    for n in range(1, 10_000):
        record = folder / (f"{stamp}.json" if n == 1 else f"{stamp}_{n}.json")
        try:
            record.open("x").close()
            return record
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free name for {stamp}.json; remove old records there")
