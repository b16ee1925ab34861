"""train.init_from: where a run starts from another's weights (a run directory, a checkpoint,
a Hugging Face model directory), and the errors that name what it lacks or how its model
differs from this run's, with the command that trains on from it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from trimtab import hf
from trimtab.checkpoint import is_sharded, latest_valid
from trimtab.checkpoint_load import load_model
from trimtab.config import RunConfig, read_saved
from trimtab.config.checks import leaves
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf.importer import check_not_config_less, import_weights, read_source, source_record
from trimtab.model import Transformer
from trimtab.rundir import CONFIG


def init_weights_from(cfg: RunConfig, model: Transformer) -> tuple[Path, dict | None]:
    """train.init_from: start from another run's (or checkpoint's) weights, or a Hugging Face
    model's; returns where they came from and the Hugging Face model's record export keeps (a run of
    a run of such a model keeps its first run's, so its export has that model's ids, dtype and class)."""
    source = Path(cfg.train.init_from)
    if hf.is_hf_dir(source):
        dtype = import_weights(model, source)
        return source, source_record(source, dtype)
    found = latest_valid(source) if (source / "checkpoints").is_dir() else None
    path = found[0] if found else source
    check_not_config_less(path, f"config key 'train.init_from' = '{source}'")
    if not ((path / "model.safetensors").is_file() or is_sharded(path)):
        raise ConfigError(
            f"config key 'train.init_from' = '{source}' has no valid checkpoint; "
            "point it at a run directory, a checkpoints/step_* directory or a Hugging Face model directory"
        )
    try:
        load_model(model, path, verified=found is not None)
    except CheckpointError as exc:
        raise ConfigError(_unfit(cfg, source, exc)) from None
    fix = (
        f"restore it (config key 'train.init_from' = '{source}'), or remove it to train on without it "
        "(this run's export is then trimtab's own mapping of the model, float32)"
    )
    return path, read_source(run_dir_of(str(source)), fix)


def _unfit(cfg: RunConfig, source: Path, exc: CheckpointError) -> str:
    """Why train.init_from's weights do not fit this run's model, and the command that trains on
    from them: the model.* settings that differ from those of the run that trained them (its
    config.yaml), where it has one; the weights' own account otherwise."""
    run = run_dir_of(str(source))
    try:
        theirs = leaves(asdict(read_saved(run).model), "model.")
    except (ConfigError, OSError):
        return f"config key 'train.init_from' = '{source}': {exc}"
    ours = leaves(asdict(cfg.model), "model.")
    differ = [f"{k} {theirs[k]} there, {ours[k]} here" for k in ours if k in theirs and theirs[k] != ours[k]]
    command = "rl" if cfg.rl.enabled else "dpo" if cfg.dpo.enabled else "train"  # `train` would drop RL / DPO
    return (
        f"config key 'train.init_from' = '{source}' holds another model than this run's ({'; '.join(differ[:4])}"
        f"{'; ...' if len(differ) > 4 else ''}): train on with that run's model settings, e.g. "
        f"trimtab {command} {run / CONFIG} --set train.init_from={source} --out DIR (or its --preset)"
    )


def no_init_from(init_from: str) -> ConfigError:
    return ConfigError(
        f"config key 'train.init_from' = '{init_from}' does not exist; point it at a run directory, a "
        "checkpoints/step_* directory or a Hugging Face model directory"
    )


def no_init_tokenizer(init_from: str) -> ConfigError:
    """train.init_from names a directory with no tokenizer.json in it or its run directory (a run
    that never saved, an empty or a checkpoints/ directory): no model to start RL or DPO from."""
    return ConfigError(
        f"config key 'train.init_from' = '{init_from}' is no trimtab run, checkpoint or Hugging Face model "
        f"directory with a tokenizer (no {run_dir_of(init_from) / 'tokenizer.json'}); point it at a run "
        "directory that has saved a checkpoint, a checkpoints/step_* directory or a Hugging Face model "
        "directory, or set data.tokenizer beside a checkpoint"
    )


def run_dir_of(init_from: str) -> Path:
    path = Path(init_from)
    return path.parent.parent if path.name.startswith("step_") else path
