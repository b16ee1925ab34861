"""train.init_from: where a run starts from another's weights (a run directory, a checkpoint,
a Hugging Face model directory), and the errors that name what it lacks or how its model
differs from this run's, with the command that trains on from it. A sharded run's model (built
on the meta device) is never read whole: each rank fills its own shards (sharded_init_from)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from trimtab import hf
from trimtab.checkpoint import is_sharded, latest_valid, verify
from trimtab.checkpoint_load import check_fits, load_model, weight_names
from trimtab.config import ModelConfig, RunConfig, read_saved
from trimtab.config.checks import leaves, thawed
from trimtab.distributed.metainit import keep_shard, local_box
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf.importer import (
    apply_hf_structure,
    check_not_config_less,
    import_weights,
    read_config,
    read_source,
    source_record,
)
from trimtab.model import Transformer
from trimtab.model.upgrade import UpgradedReader, is_legacy
from trimtab.rundir import CONFIG

if TYPE_CHECKING:
    from trimtab.distributed import Parallel

Fill = Callable[[nn.Module], tuple[Path, "dict | None"]]  # a sharded model's shards filled: (source, HF record)
TIED = {"tok_emb.weight", "lm_head.weight"}


def init_weights_from(cfg: RunConfig, model: Transformer) -> tuple[Path, dict | None]:
    """train.init_from: start from another run's (or checkpoint's) weights, or a Hugging Face
    model's; returns where they came from and the Hugging Face model's record export keeps (a run of
    a run of such a model keeps its first run's, so its export has that model's ids, dtype and class)."""
    source = Path(cfg.train.init_from)
    if hf.is_hf_dir(source):
        dtype = import_weights(model, source)
        return source, source_record(source, dtype)
    path, verified = _checkpoint(source)
    try:
        load_model(model, path, verified=verified)
    except CheckpointError as exc:
        raise ConfigError(_unfit(cfg, source, exc)) from None
    return path, _run_record(source)


def sharded_init_from(cfg: RunConfig, model: Transformer, dist: Parallel) -> Fill:
    """train.init_from for a model built on the meta device, to be sharded: no rank builds or reads
    it whole. Its structure (each MoE layer's expert count) is applied now, before Parallel.wrap
    shards it, and a checkpoint's weights checked against its header; returns what fills this rank's
    shards once materialise has allocated them, one tensor at a time: a sharded checkpoint's own
    shards (DCP, as a resume reads them), a one-process checkpoint's part of each tensor (a
    safetensors slice), a Hugging Face tensor converted whole, then cut (metainit.keep_shard)."""
    source = Path(cfg.train.init_from)
    if hf.is_hf_dir(source):
        apply_hf_structure(model, source, read_config(source))

        def fill_hf(sharded: nn.Module) -> tuple[Path, dict | None]:
            dtype = import_weights(sharded, source, keep=keep_shard)
            return source, source_record(source, dtype)

        return fill_hf
    path, verified = _checkpoint(source)
    try:
        state = json.loads((path / "state.json").read_text()) if verified else verify(path)
        check_fits(model, path, state)  # names and shapes from the header, the structure applied
    except CheckpointError as exc:
        raise ConfigError(_unfit(cfg, source, exc)) from None
    record = _run_record(source)

    def fill(sharded: nn.Module) -> tuple[Path, dict | None]:
        try:
            if is_sharded(path):
                dist.load_model(sharded, None, state, path)
            else:
                stream_weights(sharded, path)
        except CheckpointError as exc:
            raise ConfigError(_unfit(cfg, source, exc)) from None
        return path, record

    return fill


@torch.no_grad()
def stream_weights(model: nn.Module, path: Path) -> None:
    """A one-process checkpoint's model.safetensors into a sharded model, one tensor at a time,
    each rank reading only its part of each from the file (an older checkpoint's fused attention
    read whole, to regroup it: model/upgrade.py). A tensor of another pipeline stage is skipped
    (check_fits compared the whole model); one of this rank's the file lacks is refused by name."""
    file, names = path / "model.safetensors", weight_names(path)
    params = model.state_dict()
    legacy = UpgradedReader(partial(_read, file, box=None), names, model.cfg) if is_legacy(names) else None
    done = set()
    for name in sorted(legacy.names if legacy else names):
        if name not in params:
            continue
        target = params[name]
        if legacy is not None:
            keep_shard(target, legacy(name))
        else:
            box = local_box(target, target.shape)
            (target if box is None else target.to_local()).copy_(_read(file, name, box=box))
        done.add(name)
    if getattr(model.cfg, "tie_embeddings", False) and done & TIED:
        done |= TIED  # stored once: the head is the embedding
    missing = sorted(params.keys() - done)
    if missing:
        raise CheckpointError(f"{file}: holds no tensor '{missing[0]}' of this model ({len(missing)} missing)")


def _read(file: Path, name: str, box: tuple[slice, ...] | None) -> torch.Tensor:
    """Tensor `name` of a safetensors file, or only its `box`; the file opened anew for each (a
    handle kept open keeps every page read so far resident: hf/importer.py SafetensorsDir)."""
    with safe_open(str(file), "pt") as f:
        return f.get_tensor(name) if box is None else f.get_slice(name)[box]


def _checkpoint(source: Path) -> tuple[Path, bool]:
    """train.init_from's checkpoint (a run's newest valid one, verified) and whether it was verified."""
    found = latest_valid(source) if (source / "checkpoints").is_dir() else None
    path = found[0] if found else source
    check_not_config_less(path, f"config key 'train.init_from' = '{source}'")
    if not ((path / "model.safetensors").is_file() or is_sharded(path)):
        raise ConfigError(
            f"config key 'train.init_from' = '{source}' has no valid checkpoint; "
            "point it at a run directory, a checkpoints/step_* directory or a Hugging Face model directory"
        )
    return path, found is not None


def _run_record(source: Path) -> dict | None:
    """The Hugging Face record of the run train.init_from names (a run of an imported model), or None."""
    fix = (
        f"restore it (config key 'train.init_from' = '{source}'), or remove it to train on without it "
        "(this run's export is then trimtab's own mapping of the model, float32)"
    )
    return read_source(run_dir_of(str(source)), fix)


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
    keys = [k for k in ours if k in theirs and theirs[k] != ours[k]]
    derived = [k for k in keys if k in _derived(cfg.model)]
    differ = [f"{k} {theirs[k]} there, {ours[k]} here" for k in keys if k not in derived or len(derived) == len(keys)]
    if len(derived) < len(keys) and derived:
        differ.append(f"and the widths derived from them: {', '.join(derived)}")
    command = "rl" if cfg.rl.enabled else "dpo" if cfg.dpo.enabled else "train"  # `train` would drop RL / DPO
    return (
        f"config key 'train.init_from' = '{source}' holds another model than this run's ({'; '.join(differ[:5])}"
        f"{'; ...' if len(differ) > 5 else ''}): train on with that run's model settings, e.g. "
        f"trimtab {command} {run / CONFIG} --set train.init_from={source} --out DIR (or its --preset)"
    )


# The widths ModelConfig.resolved fills when left at 0 (auto): the config records them filled, so
# a changed model.d_model also shows as a changed head_dim and ffn_hidden nobody set.
AUTO_WIDTHS = ("n_kv_heads", "head_dim", "ffn_hidden", "moe.expert_hidden", "moe.shared_hidden")


def _derived(model: ModelConfig) -> set[str]:
    """The model.* auto widths that `model` holds at the value its other settings give them."""
    auto = thawed(model)
    auto.n_kv_heads = auto.head_dim = auto.ffn_hidden = auto.moe.expert_hidden = auto.moe.shared_hidden = 0
    filled, ours = leaves(asdict(auto.resolved()), "model."), leaves(asdict(model), "model.")
    return {f"model.{k}" for k in AUTO_WIDTHS if filled[f"model.{k}"] == ours[f"model.{k}"]}


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
