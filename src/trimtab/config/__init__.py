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

from trimtab.config.checks import Section, _check, _finite, _positive, check_sections, freeze
from trimtab.config.coerce import from_dict, known_only, merge, nested
from trimtab.config.data import DataConfig
from trimtab.config.distributed import DistributedConfig, check_splits
from trimtab.config.dpo import DPOConfig, grad_ceiling
from trimtab.config.log import LogConfig
from trimtab.config.loss_scale import LossScaleConfig
from trimtab.config.model import ModelConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.plan import PlanConfig
from trimtab.config.provenance import origins, sources, with_sources
from trimtab.config.renames import upgrade
from trimtab.config.resilience import ResilienceConfig
from trimtab.config.rl import RLConfig
from trimtab.errors import ConfigError, SavedConfigError

log = logging.getLogger(__name__)
PRESET_DIR = Path(__file__).parent.parent / "presets"
DEFAULT_PRESET = "small"


CHECKPOINTING = ("off", "selective", "full")  # train.activation_checkpointing
SCHEDULES = ("cosine", "wsd", "constant", "linear", "triangular", "triangular2", "exp_range")


@dataclass
class OptimConfig(Section):
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # floor of decaying schedules, as a fraction of lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured and logged)
    schedule: str = "cosine"
    warmup_steps: int = 50
    decay_fraction: float = 0.2  # WSD: share of the steps spent in the final decay
    cycle_steps: int = 200  # cyclic schedules: steps per half cycle
    gamma: float = 0.999  # exp_range: amplitude decay per step
    fused: str = "auto"  # auto | true | false: fused AdamW kernel

    def validate(self) -> None:
        _positive(self, "optim", "lr", "eps", "cycle_steps")
        _finite(self, "optim", "lr", "eps", "weight_decay")
        _check(self.schedule in SCHEDULES, "optim.schedule", f"must be one of {', '.join(SCHEDULES)}")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2", "must be in [0, 1)")
        for key in ("weight_decay", "grad_clip", "warmup_steps"):
            _check(getattr(self, key) >= 0, f"optim.{key}", f"must be >= 0 (got {getattr(self, key)})")
        _check(0 < self.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")
        _check(0 < self.gamma <= 1, "optim.gamma", "must be in (0, 1]")
        _check(self.fused in ("auto", "true", "false"), "optim.fused", "must be auto, true or false")


@dataclass
class TrainConfig(Section):
    # Pretraining steps; "auto": the Chinchilla budget (20 tokens per active parameter, Hoffmann
    # et al. 2022) from the planner. train.epochs, when set, wins over both.
    max_steps: int | str = 1000
    epochs: float = 0.0  # > 0: as many steps as this many passes over the training data
    batch_tokens: int = 16384  # target tokens per optimizer step
    # Token budget of one forward/backward (padding included). 0: auto, the largest that fits:
    # the first step runs as one micro-batch and the orchestrator's OOM path halves it until it fits.
    micro_batch_tokens: int = 4096
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda | mps
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 | fp8 (CUDA sm89+, torchao; docs/precision.md)
    # fp8's scaling: tensorwise (one scale per tensor, fastest) | rowwise (a scale per row, more accurate)
    fp8_recipe: str = "tensorwise"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16's (config/loss_scale.py)
    # auto | true | false. auto: torch.compile when the run is long enough to repay its compile
    # time (training/services/compiling.py); short and CPU-sized runs stay eager.
    compile: str = "auto"
    # off | selective | full (docs/planner.md, "Activation checkpointing"). full: each block keeps
    # only its input and runs its forward again in the backward (a third more compute); selective:
    # a block keeps its matmuls' and attention's outputs and recomputes only the cheap ops between
    # them (norms, rotations, activations, casts), 0.6-0.75x the memory of off at a few percent.
    activation_checkpointing: str = "off"
    eval_every: int = 200  # 0: only at the end
    eval_tokens: int = 65536  # cap on tokens per evaluation
    # Seconds an evaluation may run; past it, it is abandoned (journaled) and training goes on. 0: no limit
    eval_timeout: float = 1800.0
    log_every: int = 10
    init_from: str = ""  # run dir or checkpoint dir whose weights start this run (finetuning)

    @property
    def micro_budget(self) -> int:
        """The micro-batch budget to start with: micro_batch_tokens, or the whole step when auto."""
        return self.micro_batch_tokens or self.batch_tokens

    def validate(self) -> None:
        _positive(self, "train", "batch_tokens", "log_every", "eval_tokens")
        _check(
            self.max_steps == "auto" or (isinstance(self.max_steps, int) and self.max_steps > 0),
            "train.max_steps",
            f"must be a positive number of steps or auto, got {self.max_steps!r}",
        )
        _check(self.epochs >= 0, "train.epochs", "must be >= 0 (0: train.max_steps decides)")
        _check(
            0 <= self.micro_batch_tokens <= self.batch_tokens,
            "train.micro_batch_tokens",
            "must be between 0 (auto: the largest that fits) and train.batch_tokens",
        )
        _check(self.device in ("auto", "cpu", "cuda", "mps"), "train.device", "must be auto, cpu, cuda or mps")
        _check(
            self.precision in ("auto", "fp32", "bf16", "fp16", "fp8"),
            "train.precision",
            "must be auto, fp32, bf16, fp16 or fp8",
        )
        _check(self.fp8_recipe in ("tensorwise", "rowwise"), "train.fp8_recipe", "must be tensorwise or rowwise")
        self.loss_scale.validate()
        _check(self.compile in ("auto", "true", "false"), "train.compile", "must be auto, true or false")
        _check(
            self.activation_checkpointing in CHECKPOINTING,
            "train.activation_checkpointing",
            f"must be one of {', '.join(CHECKPOINTING)} (true reads as full, false as off)",
        )
        _check(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        _check(self.eval_timeout >= 0, "train.eval_timeout", "must be >= 0 (0: no limit)")


@dataclass
class CheckpointConfig(Section):
    every: int = 200  # steps between checkpoints (0: only at the end and on signals)
    keep: int = 3  # newest checkpoints kept (beside them: the last good one, the best evaluation's)
    # Written in the background: a save stalls training only while the state is copied to host
    # memory, once per save (DCP's async save; docs/resilience.md, "Asynchronous checkpoints")
    asynchronous: bool = False
    # Lean snapshots (snapshots.py): weights only, bf16, every N steps (0: none), for evaluation
    # and export; the newest snapshot_keep kept, and every snapshot_keep_every-th step's (0: none)
    snapshot_every: int = 0
    snapshot_keep: int = 3
    snapshot_keep_every: int = 0
    # Object storage for the checkpoints (docs/storage.md): "" keeps them in the run directory
    # alone; s3://bucket/prefix (any fsspec URL) also uploads each one there, manifest last, and a
    # run directory without a valid checkpoint resumes from the newest complete one there.
    # Credentials come from the standard AWS environment and files, never from here.
    dir: str = ""

    def validate(self) -> None:
        _check(self.every >= 0, "checkpoint.every", "must be >= 0")
        _check(
            not self.dir or "://" in self.dir,
            "checkpoint.dir",
            f"must be a storage URL (s3://bucket/prefix, any fsspec URL) or empty, got {self.dir!r}",
        )
        _check(
            "@" not in self.dir.split("://", 1)[-1].split("/", 1)[0],
            "checkpoint.dir",
            "must not hold credentials (user:password@); use the standard AWS environment or files",
        )
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1")
        _check(self.snapshot_every >= 0, "checkpoint.snapshot_every", "must be >= 0 (0: no snapshots)")
        _check(self.snapshot_keep >= 1, "checkpoint.snapshot_keep", "must be >= 1")
        _check(self.snapshot_keep_every >= 0, "checkpoint.snapshot_keep_every", "must be >= 0 (0: none)")


@dataclass
class FinetuneConfig(Section):
    """An optional second phase on its own data and schedule, run after max_steps of pretraining."""

    steps: int = 0  # 0: no finetuning phase
    # seq_len 0 (unset): the run's data.seq_len, filled by resolve(); the rows must fit the same model
    data: DataConfig = field(default_factory=lambda: DataConfig(source="", format="auto", seq_len=0))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=10))

    def validate(self) -> None:
        _check(self.steps >= 0, "finetune.steps", "must be >= 0")
        if self.steps:
            _check(
                bool(self.data.source), "finetune.data.source", "must name the finetuning data when finetune.steps > 0"
            )
            self.data.validate()
            self.optim.validate()


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
    (DuplicateKeyError, a yaml.YAMLError: its message starts with the line)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice; the message starts with the line of the second."""


class _UniqueKeyLoader(yaml.SafeLoader):
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
        return super().construct_mapping(node, deep=deep)


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
) -> RunConfig:
    """Resolve a run config: defaults < preset < YAML file < overrides < --set items."""
    user = read_yaml(path) if path else {}
    check_sections(user, RunConfig, str(path))
    cli = merge(dict(overrides or {}), set_changes(sets))
    name = cli.get("preset") or preset or user.get("preset") or DEFAULT_PRESET
    user, cli = upgrade(user, str(path)), upgrade(cli, "the overrides")
    layered = merge(merge(preset_dict(name), user), cli)
    layered["preset"] = name
    found = origins(user, upgrade(copy.deepcopy(dict(overrides or {}))), upgrade(set_changes(sets)), path)
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
    cfg.orchestrator.grad.max_norm = grad_ceiling(cfg.dpo, cfg.orchestrator.grad.max_norm)
    cfg.validate()
    return freeze(cfg)


def _whole_rows(batch_tokens: int, data: DataConfig) -> int:
    """train.batch_tokens rounded up to whole packed rows of data.seq_len: a step draws rows until it
    holds batch_tokens (data/batches.py), so 3000 at seq_len 64 trained 3,008 a step while the plan,
    train.epochs and the Chinchilla budget counted 3,000. Unpacked rows vary in length: left as set."""
    seq = data.seq_len
    if not data.pack or seq <= 0 or batch_tokens <= 0 or batch_tokens % seq == 0:
        return batch_tokens
    rounded = -(-batch_tokens // seq) * seq
    log.warning(
        "train.batch_tokens=%d is not a whole number of data.seq_len=%d rows: a step trains whole rows, so it is "
        "%d (set train.batch_tokens to a multiple of data.seq_len to silence this)",
        batch_tokens,
        seq,
        rounded,
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
        return resolve(_without_removed(read_yaml(path), path))
    except ConfigError as exc:
        raise SavedConfigError(
            f"{exc}. It is the config run directory '{run_dir}' was trained with: restore it, or remove it and "
            "run `trimtab train` with this run's settings, which writes it again and resumes from the checkpoints",
            problem=str(exc),
        ) from None


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
