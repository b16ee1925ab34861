"""A checkpoint read into a model: load_checkpoint (weights, optimizer, state.json, verified),
load_model (its structure first, then its weights, checked against the model), and what can be
read without loading (the weights' names and shapes, check_fits before a resume writes
anything). A sharded checkpoint (checkpoint.py's format) is reassembled whole in one process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trimtab.checkpoint import SHARDED, is_sharded, verify
from trimtab.errors import CheckpointError
from trimtab.model.upgrade import upgrade_weights


def load_checkpoint(
    path: Path, full_weights: bool = True, verified: bool = False, optimizer: bool = True
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any], dict[str, Any]]:
    """(weights, optim.pt, state.json) of a checkpoint, verified against its manifest unless the
    caller just did (`verified`). A sharded checkpoint has no optimizer state in optim.pt (it is
    in dcp/), and its weights are assembled whole only when `full_weights` (None otherwise: a
    data-parallel run loads its own shards). `optimizer=False` skips optim.pt ({}): weights only."""
    state = json.loads((path / "state.json").read_text()) if verified else verify(path)
    optim_state = _read(torch.load, path / "optim.pt", weights_only=True, map_location="cpu") if optimizer else {}
    if is_sharded(path):
        return (read_sharded_weights(path) if full_weights else None), optim_state, state
    weights = _read(load_file, path / "model.safetensors")
    return weights, optim_state, state


def _read(reader: Any, file: Path, **kwargs: Any) -> Any:
    """reader(file): a file that changed since it verified (a disk error, a truncation) is a CheckpointError
    naming it (torch.load says RuntimeError, safetensors SafetensorError), which a rollback takes as a failed
    load (training/checkpointing.py); a missing file, a disk error stay OSErrors."""
    try:
        return reader(str(file), **kwargs)
    except OSError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{file}: unreadable ({type(exc).__name__}: {exc}); it changed since it was verified"
        ) from exc


def load_model(model: torch.nn.Module, path: Path, verified: bool = False) -> dict[str, Any]:
    """A verified checkpoint's model into `model` (one process): its structure, then its weights;
    returns the checkpoint's state.json. For generation, finetuning from a run, and the trainer's
    one-process resume alike (distributed.Parallel.load_model under torchrun). `verified`: the
    caller just verified it (latest_valid): its every file is not hashed twice."""
    weights, _, state = load_checkpoint(path, optimizer=False, verified=verified)
    apply_structure(model, state, path)
    load_weights(model, weights, path)
    return state


def apply_structure(model: torch.nn.Module, state: dict[str, Any], source: Path | str = "the checkpoint") -> None:
    """What state.json holds of the model beyond its weights, applied before them: each MoE
    layer's expert count (surgery changes it) and live router knobs, each Mixture-of-Depths
    layer's target capacity (the orchestrator and people change them while training). A
    checkpoint whose MoE or MoD layers are not the model's is refused, naming both."""
    for kind, name, ours in (("moe", "MoE", model.moe_layers()), ("mod", "Mixture-of-Depths", model.mod_layers())):
        saved, here = sorted(int(i) for i in state.get(kind, {})), [i for i, _ in ours]
        if kind in state and saved != here:
            raise CheckpointError(
                f"{source}: its {name} layers are {saved}, this model's {here}: the model config "
                "(the preset, model.layer_pattern) differs from the one that trained it; use the same "
                "model settings (the run's own preset) or a new --out"
            )
    model.load_moe_state(state.get("moe", {}))
    model.load_mod_state(state.get("mod", {}))


def weight_names(path: Path) -> list[str]:
    """The names of a checkpoint's weights, from the safetensors header or the DCP metadata."""
    return list(weight_shapes(path))


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A checkpoint's weights' names and shapes, read from the safetensors header or the DCP
    metadata (no tensor data)."""
    if is_sharded(path):
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(Path(path) / SHARDED)).read_metadata().state_dict_metadata
        return {key.removeprefix("model."): tuple(m.size) for key, m in meta.items() if key.startswith("model.")}
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def check_fits(model: torch.nn.Module, path: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights would not load into `model` (load_model's checks, from
    the checkpoint's header alone), before anything is written: a resume that cannot compare
    the run's config.yaml with its own (damaged) compares with the checkpoint."""
    apply_structure(model, state, path)
    _check_weights(model, {k: torch.empty(shape, device="meta") for k, shape in weight_shapes(path).items()}, path)


def read_sharded_weights(path: Path) -> dict[str, torch.Tensor]:
    """Whole weight tensors from a sharded checkpoint, in this process alone (any world size
    wrote it): torch.distributed.checkpoint reassembles every tensor from its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(path) / SHARDED))
    meta = reader.read_metadata().state_dict_metadata
    weights = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in weights.items()}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Load weights saved by save_checkpoint (tied tensors were stored once; an older checkpoint's
    attention projection regrouped, model/upgrade.py)."""
    weights = _check_weights(model, weights, source)
    model.load_state_dict(weights, strict=False)


def _check_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """`weights` in the model's layout (upgraded), refused with CheckpointError if they do not fit it."""
    if hasattr(model, "cfg"):  # a trimtab Transformer
        weights = upgrade_weights(weights, model.cfg)
    expected = model.state_dict()
    missing = [k for k in expected if k not in weights and not _is_tied(model, k, weights)]
    unexpected = [k for k in weights if k not in expected]
    mismatched = [k for k, v in weights.items() if k in expected and v.shape != expected[k].shape]
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{source}: weights do not fit this model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, shape mismatch {mismatched[:3]}); the model config differs from the "
            "one that trained it: use the same model settings or a new --out"
        )
    return weights


def _is_tied(model: torch.nn.Module, key: str, weights: dict[str, torch.Tensor]) -> bool:
    sd = model.state_dict()
    ptr = sd[key].data_ptr()
    return any(k in weights for k, v in sd.items() if k != key and v.data_ptr() == ptr)
