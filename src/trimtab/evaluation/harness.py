"""`trimtab eval PATH`: a run's newest weights or a Hugging Face directory, scored on a text file
(--data) and/or lm-evaluation-harness tasks (--tasks); results written beside the model.

    PATH/eval/<time>.json     what was evaluated (checkpoint step, tasks, limit, versions) and
                              the results (lm-eval's per-task metrics, the file's perplexity)
    PATH/summary.json "eval"  the latest results, merged in (a run directory's summary)

lm-evaluation-harness is optional (`pip install -c constraints.txt -e '.[eval]'`); the tasks
shipped in trimtab/evaluation/tasks (trimtab_tiny, _gen, _ppl) run offline. Its INFO log lines
are off while it runs (its warnings stay); LMEVAL_LOG_LEVEL, lm-eval's own setting, brings them
back (e.g. LMEVAL_LOG_LEVEL=INFO).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any
from unittest import mock

from trimtab.api import load_run
from trimtab.checkpoint import latest_valid, local_run
from trimtab.errors import ConfigError
from trimtab.evaluation.perplexity import read_texts, score_text
from trimtab.extras import installed, missing, require
from trimtab.rundir import CONFIG, read_summary, write_json, write_summary

TASKS_DIR = Path(__file__).parent / "tasks"  # trimtab's own offline tasks


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
) -> dict[str, Any]:
    """Score the model at `path` and record the results (module docstring); returns them."""
    if not tasks and not data:
        raise ConfigError("trimtab eval needs --tasks and/or --data; e.g. --tasks trimtab_tiny or --data notes.txt")
    manager = task_manager(tasks, include_path) if tasks else None  # before the model: a wrong name fails fast
    path = local_run(path, "trimtab eval's PATH")  # a run in object storage: its cached copy, where results go
    _, model, tok = load_run(path)
    results: dict[str, Any] = {"model": str(path), "step": _step(path), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if data:
        results["data"] = {"file": str(data), **score_text(model, tok, read_texts(data), stride, batch_size)}
    if tasks:
        results["tasks"] = run_tasks(model, tok, tasks, manager, limit, num_fewshot, batch_size)
        results["versions"] = {"lm_eval": metadata.version("lm_eval")}
    _record(path, results)
    return results


_TASK_LINE = re.compile(r"^(?:task|group|tag):\s*([\w.-]+)\s*$", re.MULTILINE)


def own_tasks(folder: Path = TASKS_DIR) -> list[str]:
    """The names the YAML files under `folder` declare (`task:`, `group:`, `tag:` lines), read as
    text: trimtab's shipped tasks, without importing lm-eval."""
    found = (_TASK_LINE.findall(f.read_text(errors="replace")) for f in sorted(folder.rglob("*.yaml")))
    return sorted({name for names in found for name in names})


def check_task_names(tasks: list[str], include_path: str | None) -> None:
    """A ConfigError for a name that no task YAML mentions at all, trimtab's, --include-path's or
    lm-eval's (their text searched in about a second, where indexing lm-eval's registry takes ~15 s
    and a model loads besides); names mentioned somewhere are left to lm-eval's registry."""
    own = own_tasks()
    unknown = [t for t in tasks if t not in own]
    if not unknown:
        return
    spec = importlib.util.find_spec("lm_eval")  # its task YAMLs, without importing it (seconds)
    folders = ([Path(include_path)] if include_path else []) + [
        Path(folder) / "tasks" for folder in spec.submodule_search_locations or []
    ]
    for f in (f for folder in folders for f in folder.rglob("*.yaml")):
        text = f.read_text(errors="replace")
        unknown = [t for t in unknown if t not in text]
        if not unknown:
            return
    raise ConfigError(_unknown(unknown[0], own))


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
        manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(_unknown(unknown[0], own_tasks()))
    return manager


def run_tasks(model, tok, tasks, manager, limit, num_fewshot, batch_size) -> dict[str, Any]:
    """lm-evaluation-harness's simple_evaluate with the trimtab adapter and `manager` (task_manager's);
    per-task metrics."""
    lm_eval = require("lm_eval", "--tasks")

    from trimtab.evaluation.adapter import TrimtabLM

    with _quiet_lm_eval():
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


LM_EVAL_LOGGERS = ("lm_eval", "lm-eval")  # its modules log under both names


class _NotForTrimtab(logging.Filter):
    """Drops lm-eval's advice about its own command line (`--metadata`), which trimtab has not;
    lm-eval gives it for every task that builds its dataset in Python, trimtab's shipped ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "can be passed to `--metadata`" not in record.getMessage()


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval at WARNING while it runs (module docstring), unless LMEVAL_LOG_LEVEL says otherwise;
    and not asking git for the commit of the current directory (not the model's: lm-eval records
    it in results trimtab does not keep, and outside a repository git prints an error), nor
    collecting its environment report for those results (torch's collect_env: pip, conda, lscpu
    and nvidia-smi run as subprocesses, ~2 s of each `trimtab eval` on 2 CPU cores)."""
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
    """lm-eval's metric names ("acc,none") without the filter suffix, numbers only."""
    return {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}


def _step(path: Path) -> int | None:
    found = latest_valid(path) if (path / "config.yaml").is_file() else None
    return found[1]["step"] if found else None


def _record(path: Path, results: dict[str, Any]) -> None:
    folder = path / "eval"
    folder.mkdir(exist_ok=True)
    write_json(folder / f"{results['time'].replace(':', '')}.json", results)
    if (path / CONFIG).is_file():  # a run directory: its summary carries the latest results
        write_summary(path, {**(read_summary(path) or {}), "eval": results})
