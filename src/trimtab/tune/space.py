"""The space file of `trimtab tune`: a study, a base config, a per-trial budget and the config keys
to search (docs/tune.md). Parsed and checked here, before any trial runs: a wrong key is a
ConfigError naming the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml

from trimtab.config import RunConfig, derive, load_config, merge, nested, parse_yaml, yaml_text
from trimtab.errors import ConfigError

SAMPLERS = ("tpe", "cmaes", "nsga2", "grid", "random")
PRUNERS = ("none", "median", "percentile", "hyperband", "successive_halving", "threshold")
OBJECTIVES = ("val_loss", "val_ppl", "flops")  # every one minimized; flops: the trial's training compute
KINDS = ("log_uniform", "uniform", "int", "choice")
SECTIONS = ("study", "base", "budget", "space")
STUDY_KEYS = (
    "name",
    "sampler",
    "pruner",
    "objectives",
    "trials",
    "seed",
    "out",
    "storage",
    "settle_steps",
    "orchestrator_aware",
)
BUDGET_KEYS = ("max_steps", "tokens", "eval_every")
DEFAULT_TRIALS = 20


@dataclass
class SearchParam:
    """One searched config key: its kind and range (or choices), `steps` points for a grid."""

    key: str
    kind: str
    values: list[Any]  # [low, high] for ranges, the choices for `choice`
    steps: int = 0

    def distribution(self) -> optuna.distributions.BaseDistribution:
        d = optuna.distributions
        if self.kind == "choice":
            return d.CategoricalDistribution(self.values)
        if self.kind == "int":
            return d.IntDistribution(int(self.values[0]), int(self.values[1]))
        return d.FloatDistribution(float(self.values[0]), float(self.values[1]), log=self.kind == "log_uniform")

    def grid(self) -> list[Any]:
        """The values a grid tries: the choices, or `steps` points over the range (geometric for
        log_uniform, whole numbers for int)."""
        if self.kind == "choice":
            return list(self.values)
        lo, hi = self.values
        n = self.steps
        if self.kind == "int":
            return sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)}) if n > 1 else [lo]
        if self.kind == "log_uniform":  # clamped: exp(log(hi)) may round past hi
            ratio = math.log(hi) - math.log(lo)
            return [min(max(lo * math.exp(ratio * i / max(n - 1, 1)), lo), hi) for i in range(n)]
        return [lo + (hi - lo) * i / max(n - 1, 1) for i in range(n)]

    def ends(self) -> tuple[Any, Any]:
        return self.values[0], self.values[-1]


@dataclass
class Space:
    path: Path
    name: str
    sampler: str = "tpe"
    sampler_options: dict[str, Any] = field(default_factory=dict)
    pruner: str = "none"
    pruner_options: dict[str, Any] = field(default_factory=dict)
    objectives: list[str] = field(default_factory=lambda: ["val_loss"])
    trials: int | None = None  # None: the grid's size for a grid, else DEFAULT_TRIALS
    seed: int = 0
    out: str = ""
    storage: str = ""
    settle_steps: int = 3  # an evaluation is reported once this many steps passed with no intervention
    orchestrator_aware: bool = True  # False: every evaluation is reported at once (for comparison)
    base: dict[str, Any] = field(default_factory=dict)
    base_file: Path | None = None
    budget: dict[str, Any] = field(default_factory=dict)
    params: list[SearchParam] = field(default_factory=list)

    def where(self, key: str) -> str:
        return f"{self.path}: {key}"

    def total(self, trials: int | None = None) -> int:
        """Trials the study runs in all: the command line's, the file's, else the grid's size or 20;
        a grid never more than its points."""
        n = trials or self.trials or (self.grid_size() if self.sampler == "grid" else DEFAULT_TRIALS)
        return min(n, self.grid_size()) if self.sampler == "grid" else n

    def grid_space(self) -> dict[str, list[Any]]:
        return {p.key: p.grid() for p in self.params}

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid_space().values())

    def config(self, values: dict[str, Any], out: str | Path, extra: dict[str, Any] | None = None) -> RunConfig:
        """The run config of a trial with these parameter values, written to `out`; `extra`
        (the study's defaults, e.g. its MLflow experiment) fills what the base leaves unset."""
        # workers share a console: no progress bars unless the base asks for them
        data = merge(merge({"log": {"progress": False}}, extra or {}), self.base)
        data = merge(data, self._budget_overrides())
        for key, value in values.items():  # the searched keys last: they win over base and budget
            data = merge(data, nested(key.split("."), value))
        data["out"] = str(out)
        cfg = load_config(self.base_file, overrides=data)
        if cfg.checkpoint.dir:  # one run a checkpoint.dir (it resumes what it finds): a prefix a trial
            cfg = derive(cfg, {"checkpoint": {"dir": f"{cfg.checkpoint.dir.rstrip('/')}/{Path(out).name}"}})
        if "tokens" in self.budget:  # a token budget: as many steps as this trial's batch needs
            steps = max(1, math.ceil(int(self.budget["tokens"]) / cfg.train.batch_tokens))
            cfg = derive(cfg, {"train": {"max_steps": steps}})
        return cfg

    def _budget_overrides(self) -> dict[str, Any]:
        train = {k: v for k, v in self.budget.items() if k in ("max_steps", "eval_every")}
        return {"train": train} if train else {}


def load_space(path: str | Path) -> Space:
    """Parse and check a space file: every section and key known, every searched key a config key
    (a config is built at the low ends and at the high ends of the space)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"space file '{path}' not found; pass the YAML file that names the study and its space")
    try:
        raw = parse_yaml(yaml_text(path)) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    _known(raw, SECTIONS, str(path), "top-level section")
    space = Space(path=path, name=path.stem)
    _parse_study(space, _section(raw, "study", path))
    _parse_base(space, raw.get("base", {}))
    space.budget = _section(raw, "budget", path)
    _known(space.budget, BUDGET_KEYS, space.where("budget"), "budget key")
    space.params = [_param(space, k, v) for k, v in _section(raw, "space", path).items()]
    if not space.params:
        raise ConfigError(
            f"{space.where('space')}: no key to search; add e.g. 'optim.lr: {{log_uniform: [1e-4, 3e-2]}}'"
        )
    _check_combination(space)
    _check_keys(space)
    return space


def _section(raw: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: '{name}' must be a mapping")
    return value


def _known(data: dict[str, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown {what} '{key}'; valid: {', '.join(allowed)}")


def _named(value: Any, allowed: tuple[str, ...], where: str) -> tuple[str, dict[str, Any]]:
    """`tpe` or `{tpe: {n_startup_trials: 4}}`: a name and its options."""
    if isinstance(value, dict) and len(value) == 1:
        ((name, options),) = value.items()
        options = options or {}
    else:
        name, options = value, {}
    if name not in allowed or not isinstance(options, dict):
        raise ConfigError(f"{where}: '{value}' is not one of {', '.join(allowed)} (optionally {{NAME: {{options}}}})")
    return name, options


def _parse_study(space: Space, study: dict[str, Any]) -> None:
    _known(study, STUDY_KEYS, space.where("study"), "study key")
    space.name = str(study.get("name", space.name))
    space.sampler, space.sampler_options = _named(study.get("sampler", "tpe"), SAMPLERS, space.where("study.sampler"))
    space.pruner, space.pruner_options = _named(study.get("pruner", "none"), PRUNERS, space.where("study.pruner"))
    default = ["val_loss", "flops"] if space.sampler == "nsga2" else ["val_loss"]
    objectives = study.get("objectives", default)
    space.objectives = [objectives] if isinstance(objectives, str) else list(objectives)
    for name in space.objectives:
        if name not in OBJECTIVES:
            raise ConfigError(f"{space.where('study.objectives')}: unknown objective '{name}'; one of {OBJECTIVES}")
    space.seed = _whole(space.where("study.seed"), study.get("seed", 0), None)
    space.out, space.storage = str(study.get("out", "")), str(study.get("storage", ""))
    space.settle_steps = _whole(space.where("study.settle_steps"), study.get("settle_steps", 3), 0)
    space.orchestrator_aware = bool(study.get("orchestrator_aware", True))
    if "trials" in study:
        space.trials = _whole(space.where("study.trials"), study["trials"], 1)


def _parse_base(space: Space, base: Any) -> None:
    """`base:` is config sections (with `preset`), or a config file path, or both (`config: FILE`
    under the sections); a relative file is found next to the space file."""
    if isinstance(base, str):
        base = {"config": base}
    if not isinstance(base, dict):
        raise ConfigError(f"{space.where('base')}: must be config sections or a config file path")
    base = dict(base)
    if "config" in base:
        file = Path(str(base.pop("config")))
        space.base_file = file if file.is_absolute() else space.path.parent / file
        if not space.base_file.is_file():
            raise ConfigError(f"{space.where('base.config')}: config file '{space.base_file}' not found")
    space.base = base


def _param(space: Space, key: str, spec: Any) -> SearchParam:
    where = space.where(f"space.{key}")
    hint = "write e.g. {log_uniform: [1e-4, 3e-2]}, {uniform: [0, 0.2]}, {int: [0, 100]} or {choice: [1, 2]}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: {hint}")
    kinds = [k for k in spec if k in KINDS]
    extra = [k for k in spec if k not in (*KINDS, "steps")]
    if len(kinds) != 1 or extra:
        raise ConfigError(f"{where}: one of {', '.join(KINDS)} (and optionally steps) expected; {hint}")
    kind, values = kinds[0], spec[kinds[0]]
    if not isinstance(values, list):
        raise ConfigError(f"{where}: {kind} takes a list; {hint}")
    if not values:
        raise ConfigError(f"{where}: {kind} needs at least one value; {hint}")
    if kind != "choice":
        values = [_number(v, whole=kind == "int") for v in values]
        _check_range(where, kind, values)
    elif _takes_float(key):  # as a run config reads them: a float key's '1e-4' is the number
        values = [_number(v) for v in values]
    steps = _whole(f"{where}.steps", spec["steps"], 1) if "steps" in spec else 0
    if kind == "choice" and steps:
        raise ConfigError(f"{where}: steps is for ranges; a choice already lists its values")
    return SearchParam(key=key, kind=kind, values=values, steps=steps)


def _number(value: Any, whole: bool = False) -> Any:
    """A numeric string as its number, as run configs read one: YAML 1.1 (PyYAML) reads 1e-4 as
    text, only 1.0e-4 as a number. With `whole`, a whole number as an int ('1e3': 1000). Anything
    else (a word, 'nan', 'inf') is returned as it is, for the caller's check to refuse."""
    if not isinstance(value, str):
        return value
    try:
        number = float(value)
    except ValueError:
        return value
    if not math.isfinite(number):
        return value
    return int(number) if whole and number.is_integer() else number


def _whole(where: str, value: Any, low: int | None) -> int:
    """A whole number (a YAML int, or text such as '1e3') of at least `low`: a value int() would
    truncate (2.5 grid points) or refuse with a traceback ('abc') is an error naming the key."""
    number = _number(value, whole=True)
    if isinstance(number, float) and number.is_integer():  # YAML's 2.0
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or (low is not None and number < low):
        bound = "" if low is None else f" >= {low}"
        raise ConfigError(f"{where}: must be a whole number{bound}, got {value!r}")
    return number


def _takes_float(key: str) -> bool:
    """Whether run config key `key` (dotted) is a float (or may be one); False for an unknown key,
    which the config build at the space's ends names."""
    tp: Any = RunConfig
    for name in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return False
        tp = typing.get_type_hints(tp).get(name)
    return tp is float or float in typing.get_args(tp)


def _check_range(where: str, kind: str, values: list[Any]) -> None:
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: {kind} takes [low, high] numbers (e.g. [1e-4, 3e-2]), got {values}")
    lo, hi = values
    if lo >= hi:
        raise ConfigError(f"{where}: low {lo} must be below high {hi}")
    if kind == "log_uniform" and lo <= 0:
        raise ConfigError(f"{where}: log_uniform needs low > 0, got {lo}; use uniform for ranges from 0")
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise ConfigError(f"{where}: int takes whole numbers, got {values}")


def _check_combination(space: Space) -> None:
    n = len(space.objectives)
    if space.sampler == "nsga2" and n != 2:
        raise ConfigError(f"{space.where('study.objectives')}: nsga2 searches two objectives, e.g. [val_loss, flops]")
    if space.sampler == "cmaes" and n != 1:
        raise ConfigError(f"{space.where('study.sampler')}: cmaes optimizes one objective; use nsga2 or tpe")
    if space.pruner != "none" and n != 1:
        raise ConfigError(f"{space.where('study.pruner')}: Optuna prunes single-objective studies only; set none")
    if space.sampler == "grid":
        for p in space.params:
            if p.kind != "choice" and p.steps < 1:
                raise ConfigError(
                    f"{space.where('space.' + p.key)}: a grid needs finite values; add 'steps: N' "
                    "(N points over the range) or use choice"
                )


def _check_keys(space: Space) -> None:
    """Build the config at both ends of the space, so an unknown key or a bad value fails now."""
    for end in (0, 1):
        values = {p.key: p.ends()[end] for p in space.params}
        try:
            space.config(values, out="unused")
        except ConfigError as exc:
            _check_base(space)  # a typo in base: or budget: fails at both ends: blame its section
            keys = ", ".join(f"{k}={v}" for k, v in values.items())
            raise ConfigError(
                f"{space.path}: the space's {'low' if end == 0 else 'high'} ends ({keys}) over the base config "
                f"do not make a valid config: {exc}; fix the key or range in the space file"
            ) from None


def _check_base(space: Space) -> None:
    """Build the config of base: alone, then with budget:, naming the section at fault. Called only
    once an end of the space failed: a base the searched keys make valid (a seq_len above the
    preset's max_seq_len, with model.max_seq_len searched) is not refused."""
    extra = f" (or its config file {space.base_file})" if space.base_file else ""
    sections = (("base", {}, f"base: section{extra}"), ("budget", space._budget_overrides(), "budget: section"))
    for name, overrides, fix in sections:
        try:
            load_config(space.base_file, overrides=merge(merge(space.base, overrides), {"out": "unused"}))
        except ConfigError as exc:
            raise ConfigError(
                f"{space.where(name)}: not a valid config: {exc}; fix it in the space file's {fix}"
            ) from None
