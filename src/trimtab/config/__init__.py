"""Typed, validated run configuration.

A run config is built in layers, later ones winning:
    dataclass defaults < preset file < user YAML file < CLI flags < --set section.key=value

Every key is checked: an unknown key names the closest valid one, a wrong type or range names
the field. Each component receives only its own section (model code sees ModelConfig, ...).

A config is resolved once, by resolve(): older key names and YAML's value quirks translated (only
there: the code knows one name per thing), every section validated, the values left at auto
filled (the model's widths), and the result frozen: setting a field of a resolved config raises.
Code that needs a different config derives a new one (derive(cfg, {section: {key: value}})), which
goes through resolve() again; a config built by hand (RunConfig(...)) is a draft until resolved.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trimtab.config.checks import Section, _check, check_sections, freeze, leaves
from trimtab.config.coerce import from_dict, known_only, merge, nested
from trimtab.config.data import DataConfig
from trimtab.config.distributed import DistributedConfig, check_splits
from trimtab.config.dpo import DPOConfig, grad_ceiling
from trimtab.config.log import LogConfig
from trimtab.config.model import ModelConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.plan import PlanConfig
from trimtab.config.provenance import (
    OVERRIDE,
    SET,
    command_origin,
    origins,
    saved_sources,
    saved_values,
    sources,
    with_sources,
)
from trimtab.config.renames import upgrade
from trimtab.config.resilience import ResilienceConfig
from trimtab.config.rl import RLConfig
from trimtab.config.train import CHECKPOINTING as CHECKPOINTING  # re-exported: train.activation_checkpointing's values
from trimtab.config.train import CheckpointConfig, FinetuneConfig, OptimConfig, TrainConfig
from trimtab.errors import ConfigError, SavedConfigError

log = logging.getLogger(__name__)
PRESET_DIR = Path(__file__).parent.parent / "presets"
DEFAULT_PRESET = "small"


@dataclass
class RunConfig(Section):
    preset: str = DEFAULT_PRESET
    out: str = ""  # run directory; empty: runs/<preset>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # torchrun launches
    plan: PlanConfig = field(default_factory=PlanConfig)  # live Chinchilla planner (docs/planner.md)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)  # hangs, restarts (docs/resilience.md)
    rl: RLConfig = field(default_factory=RLConfig)  # reinforcement learning on verifiable rewards (docs/rl.md)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # preference pairs (docs/rl.md, DPO)
    faults: list[str] = field(default_factory=list)  # injected faults, KIND@STEP[:PARAM] (tests, bench)

    def validate(self) -> None:
        """Check every section (no value changes: resolve() is what fills and freezes)."""
        for section in (
            self.model,
            self.data,
            self.optim,
            self.train,
            self.checkpoint,
            self.log,
            self.finetune,
            self.orchestrator,
            self.distributed,
            self.plan,
            self.resilience,
            self.rl,
            self.dpo,
        ):
            section.validate()
        check_splits(self.distributed, self.model)
        _check(not (self.rl.enabled and self.dpo.enabled), "dpo.enabled", "and rl.enabled are two runs; turn one off")
        for key, data in (("data.seq_len", self.data), ("finetune.data.seq_len", self.finetune.data)):
            _check(
                data.seq_len <= self.model.max_seq_len or (key.startswith("finetune") and not self.finetune.steps),
                key,
                f"{data.seq_len} is larger than the model's model.max_seq_len="
                f"{self.model.max_seq_len}; lower it or raise model.max_seq_len",
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.out or f"runs/{self.preset}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# building and validating


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():  # most often a run directory, given to resume it: "does not exist" misled
        saved = path / "config.yaml"
        fix = f"to resume the run, pass its config: {saved}" if saved.is_file() else "pass a YAML config file"
        raise ConfigError(f"config file '{path}' is a directory, not a YAML file; {fix}")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; check the path")
    try:
        data = parse_yaml(yaml_text(path)) or {}
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}:{exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run config must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_yaml(text: str) -> Any:
    """YAML as yaml.safe_load reads it, a key written twice in one mapping refused
    (DuplicateKeyError, a yaml.YAMLError: its message starts with the line). Read by libyaml's
    parser (8x the pure one: 13 against 106 ms for the presets and configs/, ~3 a run, many a
    test); text it refuses is read again by the pure one, whose error is the one raised: its
    wording and marks are what users and tests were shown."""
    try:
        return yaml.load(text, Loader=_UniqueKeyCLoader)
    except yaml.YAMLError:
        return yaml.load(text, Loader=_UniqueKeyLoader)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice; the message starts with the line of the second."""


class _UniqueKeys:
    """safe_load that refuses a key written twice in one mapping. PyYAML keeps the last silently,
    so a second `model:` section (or `lr:` twice) dropped the first one's keys without a word. A
    key that overrides one merged in with `<<: *anchor` is not a duplicate: the merge is YAML's."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, Hashable) and key in first:
                raise DuplicateKeyError(
                    f"{line}: key '{key}' is written twice in one section (first on line {first[key]}); YAML "
                    "would keep only the last and drop the first without a word: merge the two into one"
                )
            if isinstance(key, Hashable):
                first[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]  # the loader's, below


class _UniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    pass


class _UniqueKeyCLoader(_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # pure where no libyaml
    pass


def yaml_text(path: Path) -> str:
    """The file as UTF-8 text (YAML's encoding), a file that is not (a binary, a Latin-1 export)
    refused naming its line: a UnicodeDecodeError traceback before."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start}); a config must be a UTF-8 YAML "
            "file: check that this is the config you meant, or save it as UTF-8"
        ) from None


def preset_dict(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        names = available_presets()
        near = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"unknown preset '{name}'; {hint}available: {', '.join(names)}")
    data = read_yaml(path)
    data.pop("description", None)
    return data


def parse_set(item: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003); the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set '{item}' must look like section.key=value")
    key, raw = item.split("=", 1)
    parts = key.partition("[")[0].strip().split(".")
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)  # data.mix.0.weight
    if "[" in key or numbered is not None:  # a list's item (data.mix[0].weight) is not a path of sections
        name = ".".join(parts[:numbered])
        raise ConfigError(
            f"--set '{item}': a list's items are not set one by one; set {name} whole, e.g. "
            f"--set '{name}=[{{source: web, weight: 0.7}}, {{source: code, weight: 0.3}}]', or write it in the YAML"
        )
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def set_changes(sets: Sequence[str]) -> dict[str, Any]:
    """--set items as the sections of keys they change (as in YAML), the later item winning."""
    changes: dict[str, Any] = {}
    for item in sets:
        keys, value = parse_set(item)
        changes = merge(changes, nested(keys, value))
    return changes


def load_config(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] = (),
    fixed: tuple[str, dict[str, Any]] | None = None,
) -> RunConfig:
    """Resolve a run config: defaults < preset < YAML file < overrides < --set items. `fixed`: a
    subcommand's own settings, (its name, sections of keys), under the overrides (`trimtab rl`)."""
    user = read_yaml(path) if path else {}
    check_sections(user, RunConfig, str(path))
    command, own = fixed or ("", {})
    cli = merge(merge(copy.deepcopy(own), dict(overrides or {})), set_changes(sets))
    name = cli.get("preset") or preset or user.get("preset") or DEFAULT_PRESET
    user, cli = upgrade(user, str(path)), upgrade(cli, "the overrides")
    layered = merge(merge(preset_dict(name), user), cli)
    layered["preset"] = name
    layers = [(command_origin(command), own), (OVERRIDE, dict(overrides or {})), (SET, set_changes(sets))]
    saved = saved_sources(Path(path)) if path else None  # a run's own config.yaml: not a person's every key
    below = leaves(resolve({**preset_dict(name), "preset": name}).to_dict()) if saved is not None else None
    then = saved_values(Path(path)) if saved is not None else None  # a key its line names, edited since
    layered_keys = [(origin, upgrade(copy.deepcopy(keys))) for origin, keys in layers]
    found = origins(user, path, layered_keys, saved, below, then)
    try:
        return with_sources(resolve(layered), found)  # who set each key: the resume's changes say it
    except ConfigError as exc:
        raise _in_file(exc, path, user, cli) from None


def _in_file(exc: ConfigError, path: str | Path | None, user: dict[str, Any], cli: dict[str, Any]) -> ConfigError:
    """A key's error names the YAML file the key's value came from (not a preset's, not a --set's):
    the user must know which file to edit, and a preset's keys say nothing of it."""
    found = re.search(r"config key '([^']+)'", str(exc))
    if path is None or found is None or str(exc).startswith(f"{path}:"):
        return exc
    keys = found.group(1).split(".")
    if _has(user, keys) and not _has(cli, keys):
        return type(exc)(f"{path}: {exc}")
    return exc


def _has(data: Any, keys: list[str]) -> bool:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def resolve(config: RunConfig | dict[str, Any]) -> RunConfig:
    """The one resolution of a run config, from its layered dict or a draft RunConfig: older key
    names and value spellings translated (upgrade), every key checked and coerced, the model's
    auto widths filled, every section validated, and the result frozen. A resolved config is
    returned as it is; resolving a resolved config's dict gives an equal config."""
    if isinstance(config, RunConfig):
        if config.frozen:
            return config
        config = config.to_dict()
    cfg = from_dict(RunConfig, upgrade(copy.deepcopy(config)))
    cfg.model = cfg.model.resolved()
    if not cfg.finetune.data.seq_len:
        cfg.finetune.data.seq_len = cfg.data.seq_len
    cfg.train.batch_tokens = _whole_rows(cfg.train.batch_tokens, cfg.data)
    if cfg.finetune.steps:  # its steps draw whole rows of its own seq_len: said, the pretraining's rounding kept
        _whole_rows(cfg.train.batch_tokens, cfg.finetune.data, "finetune.data")
    cfg.orchestrator.grad.max_norm = grad_ceiling(cfg.dpo, cfg.orchestrator.grad.max_norm)
    cfg.validate()
    return freeze(cfg)


def _whole_rows(batch_tokens: int, data: DataConfig, key: str = "data") -> int:
    """train.batch_tokens rounded up to whole packed rows of data.seq_len: a step draws rows until it
    holds batch_tokens (data/batches.py), so 3000 at seq_len 64 trained 3,008 a step while the plan,
    train.epochs and the Chinchilla budget counted 3,000. Unpacked rows vary in length: left as set.
    `key`: the section whose rows a step draws (finetune.data in its phase)."""
    seq = data.seq_len
    if not data.pack or seq <= 0 or batch_tokens <= 0 or batch_tokens % seq == 0:
        return batch_tokens
    rounded = -(-batch_tokens // seq) * seq
    log.warning(
        "train.batch_tokens=%d is not a whole number of %s.seq_len=%d rows: a step trains whole rows, so it is "
        "%d (set train.batch_tokens to a multiple of %s.seq_len to silence this)",
        batch_tokens,
        key,
        seq,
        rounded,
        key,
    )
    return rounded


def derive(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """A new resolved config: `cfg` with `changes` (sections of keys, as in YAML) merged over it
    and resolved again; `cfg` itself never changes. Values resolve() filled stay as they were
    (a model's auto widths are not re-derived from a changed d_model: load_config for that). Who set
    each key (config/provenance.py) is `cfg`'s: a derived change is code's, not a person's."""
    return with_sources(resolve(merge(cfg.to_dict(), changes)), sources(cfg))


def read_saved(run_dir: str | Path) -> RunConfig:
    """The resolved config a run directory was trained with (config.yaml), older key names
    upgraded. SavedConfigError where it is missing or damaged (a disk fault, a hand edit)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise SavedConfigError(f"'{run_dir}' holds no config.yaml: not a trimtab run directory; pass a run's --out")
    try:
        return resolve_saved(read_yaml(path), path)
    except ConfigError as exc:
        raise SavedConfigError(
            f"{exc}. It is the config run directory '{run_dir}' was trained with: restore it, or remove it and "
            "run `trimtab train` with this run's settings, which writes it again and resumes from the checkpoints",
            problem=str(exc),
        ) from None


def resolve_saved(data: Any, where: str | Path) -> RunConfig:
    """A config a run saved (config.yaml, a checkpoint's copy: state.json "config") resolved, older key
    names upgraded and the keys this trimtab no longer has left out (said once, naming `where`)."""
    return resolve(_without_removed(data, Path(where)))


_SAID_REMOVED: set[tuple[str, tuple[str, ...]]] = set()  # (config.yaml, keys) said once a process


def _without_removed(data: Any, path: Path) -> Any:
    """A saved config.yaml's keys this trimtab no longer has (removed since the version that wrote
    it) left out, said once: it was written whole by trimtab, not by the person resuming it, who
    upgraded mid-run (the resume refused the run's own config: "unknown config key"). Renamed keys
    are upgraded first (upgrade), not dropped; a person's own config naming one is still an error."""
    if not isinstance(data, dict):
        return data  # not a mapping: resolve's error says so
    data, dropped = known_only(RunConfig, upgrade(data))
    if dropped and (said := (str(path), tuple(dropped))) not in _SAID_REMOVED:
        _SAID_REMOVED.add(said)
        log.warning(
            "%s: ignoring %s, saved by the trimtab that wrote this run and not a setting of this version: "
            "removed since; nothing to do (this session's config.yaml is written without it)",
            path,
            ", ".join(f"'{key}'" for key in dropped),
        )
    return data


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(dump_yaml(cfg.to_dict()))


# libyaml's emitter where PyYAML was built with it: the same text as yaml.safe_dump's pure-Python one (every preset's
# config compared) at a fifth of the CPU, which every run's config.yaml paid (0.015 s a run, 0.16 s under cProfile)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump_yaml(data: Any) -> str:
    """yaml.safe_dump(data, sort_keys=False), through libyaml when it is there."""
    return yaml.dump(data, Dumper=_SAFE_DUMPER, sort_keys=False)
