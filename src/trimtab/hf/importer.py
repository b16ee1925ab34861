"""A Hugging Face model directory into trimtab: config.json -> ModelConfig, safetensors -> the
model's weights (streamed, tensor by tensor, into a model built without initialising), and its
tokenizer used as is.

A run initialised from such a directory keeps what it came from in RUN_DIR/hf_source.json (the
class, config.json, the weights' dtype), so export can give it back in its own class and dtype:
an imported model exported untrained has the original files' tensors, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trimtab.config import ModelConfig
from trimtab.data import TextTokenizer
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf.architectures import COMMON, DEFAULTS, NULLABLE, TRIMTAB, architecture, to_model_config
from trimtab.hf.remote import moe_structure
from trimtab.hf.tensors import Part, Recorder, from_hf
from trimtab.model import Transformer
from trimtab.model.catalog import uninitialised
from trimtab.model.upgrade import UpgradedReader, is_legacy

SOURCE = "hf_source.json"  # in a run directory initialised from a Hugging Face model
TIE_CHUNK = 1 << 22  # elements of each of a tied file's head and embedding read at once to compare
Keep = Callable[[torch.Tensor, "torch.Tensor | Part"], Any]  # (the model's tensor, a whole one to copy into it)


def is_hf_dir(path: str | Path) -> bool:
    """A transformers model directory (config.json + safetensors), not a trimtab run."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


class SafetensorsDir:
    """The tensors of model.safetensors or of the shards model.safetensors.index.json lists,
    read one at a time. Each read opens its file anew: a tensor is a view of the file's memory
    map, and a handle kept open would keep every page read so far mapped (resident), doubling
    the peak memory of a conversion (measured: 9.1 vs 4.8 GB importing a 4.4 GB model)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        self.index = index if index.is_file() else None
        if self.index:
            self.files = {name: path / shard for name, shard in _weight_map(index).items()}
        elif (path / "model.safetensors").is_file():
            with _opened(path / "model.safetensors") as f:
                self.files = {name: path / "model.safetensors" for name in f.keys()}  # noqa: SIM118
        else:
            raise CheckpointError(
                f"{path}: no model.safetensors or model.safetensors.index.json; trimtab reads safetensors "
                "weights (save the model with save_pretrained(..., safe_serialization=True))"
            )

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def __call__(self, name: str) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_tensor(name))

    def part(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """Only `box` of tensor `name`, read from the file (not a view of the whole tensor's pages)."""
        return self._read(name, lambda handle: handle.get_slice(name)[box])

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._read(name, lambda handle: handle.get_slice(name).get_shape()))

    def _read(self, name: str, take: Callable[[Any], Any]) -> Any:
        file = self.files[name]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in model.safetensors.index.json)")
        with _opened(file) as handle:
            try:
                return take(handle)
            except SafetensorError:  # the file holds no such tensor: the index maps it wrongly
                raise CheckpointError(
                    f"{self.index}: lists tensor '{name}' in {file.name}, which does not hold it; the index "
                    "belongs to other shards: download the index and shards again"
                ) from None

    def unlisted(self) -> list[str]:
        """Safetensors files beside the index that it reads no tensor from."""
        if not self.index:
            return []
        used = {file.name for file in self.files.values()}
        return sorted(f.name for f in self.index.parent.glob("*.safetensors") if f.name not in used)

    def dtype(self) -> torch.dtype:
        """The dtype of the floating-point weights (the first tensor's, read from one element of it)."""
        name = next(iter(sorted(self.files)))
        return self.part(name, tuple(slice(0, min(n, 1)) for n in self.shape(name))).dtype


def _opened(file: Path) -> Any:
    """safe_open(file), a damaged file (truncated by an interrupted download or copy, or not
    safetensors at all) refused naming it: safetensors' own error names neither file nor fix."""
    try:
        return safe_open(str(file), "pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({exc}); it is damaged or incomplete (an interrupted "
            "download or copy): download it again, or save the model again with save_pretrained"
        ) from None


def _weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's {tensor: shard file}, a damaged index refused naming it."""
    try:
        found = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:  # AttributeError: JSON, but not an object
        found, reason = None, str(exc) or type(exc).__name__
    else:
        reason = "no 'weight_map' of tensor names to shard files"
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise CheckpointError(
            f"{index}: not a valid safetensors index ({reason}); it is damaged or incomplete (an interrupted "
            "download or copy): download it again, or save the model again with save_pretrained"
        )
    return found


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json as a dict; a damaged one (cut short, not UTF-8, JSON but not an object: an
    AttributeError traceback before) refused naming the file and the way back."""
    return _json_object(Path(path) / "config.json", "model settings")


def _json_object(file: Path, what: str) -> dict[str, Any]:
    """A JSON object file of the model directory (config.json, generation_config.json), a damaged
    one refused naming it and the way back."""
    try:
        found = json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:
        found, reason = None, str(exc) or type(exc).__name__
    else:
        reason = f"JSON, but a {type(found).__name__}, not an object of {what}"
    if not isinstance(found, dict):
        raise ConfigError(
            f"{file}: unreadable ({reason}); it is damaged or incomplete (an interrupted download or a hand edit): "
            "download it again with the model, or save the model again with save_pretrained"
        )
    return found


def check_not_config_less(path: Path, what: str) -> None:
    """Safetensors weights with neither config.json nor state.json beside them: a Hugging Face
    model whose config.json was not downloaded or was deleted (read as a trimtab checkpoint, it
    failed on 'unreadable state.json', a file such a directory never has). `what` names the key."""
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    if weights and not (path / "state.json").exists() and not path.name.startswith("step_"):
        raise ConfigError(
            f"{what} holds safetensors weights but no config.json (a Hugging Face model's settings) nor "
            "state.json (a trimtab checkpoint's): if it is a downloaded model, download its config.json too; "
            "if it is a trimtab run, point at the run directory (its --out)"
        )


def model_config(path: str | Path) -> ModelConfig:
    """The trimtab ModelConfig of a Hugging Face directory (ConfigError naming the field it
    cannot implement)."""
    return to_model_config(read_config(path), str(Path(path) / "config.json"))


def import_weights(
    model: Transformer, path: str | Path, *, assign: bool = False, keep: Keep = torch.Tensor.copy_
) -> torch.dtype:
    """Fill `model` (built from model_config(path)) with the directory's weights, converted tensor
    by tensor (fp32 in the model); every parameter must be set, every tensor used. Returns the
    file's dtype. `assign` (a CPU model): the tensors become the parameters instead of being
    copied into them, so a tensor that needs no conversion stays the file's memory map, as
    transformers loads it (no second copy of the model written; pages read as used). `keep`
    copies a whole converted tensor into the model's (a sharded model's: metainit.keep_shard,
    this rank's part of it; a tensor copied as is, or the grouped attention projection, comes as
    a tensors.Part, of which the rank reads only its part)."""
    path = Path(path)
    hf = read_config(path)
    reader = SafetensorsDir(path)
    sharded = keep is not torch.Tensor.copy_ and not assign
    get = Recorder(reader, reader.names, lazy=sharded)
    if is_legacy(reader.names):  # a trimtab-class export from before the grouped attention layout
        upgraded = UpgradedReader(reader, reader.names, model.cfg)
        get = Recorder(upgraded, upgraded.names)
    arch = apply_hf_structure(model, path, hf)
    params = model.state_dict()
    put = _Assigner(model) if assign else partial(_copy, keep=keep)
    done = set()
    pairs = ((name, get.part(name)) for name in sorted(get.names)) if arch == TRIMTAB else from_hf(get, model.cfg, arch)
    try:
        for name, tensor in pairs:
            if sharded and name not in params:  # another pipeline stage's layer (a Part: never read)
                continue
            put(params, name, tensor, path)
            done.add(name)
    except KeyError as exc:
        raise CheckpointError(f"{path}: tensor {exc} is missing; {_missing_why(reader)}") from None
    except _ShapeError as exc:
        raise CheckpointError(f"{exc}{_defaulted(hf, arch)}") from None
    get.check_all_used(str(path), model.cfg.tie_embeddings)
    if model.cfg.tie_embeddings:
        _check_tied_head(reader, "tok_emb.weight" if arch == TRIMTAB else "model.embed_tokens.weight", path)
    missing = [k for k in params if k not in done and not _derived(model, k)]
    if missing:
        raise CheckpointError(f"{path}: nothing sets '{missing[0]}' of the trimtab model (a conversion gap)")
    return reader.dtype()


def apply_hf_structure(model: Transformer, path: Path, hf: dict[str, Any]) -> str:
    """config.json's architecture; a trimtab-class export's MoE layers given their expert counts
    (surgery may have changed them), before its weights (and before a sharded model is sharded)."""
    arch = architecture(hf, str(path / "config.json"))
    if arch == TRIMTAB:  # its own names; each MoE layer's expert count first
        model.load_moe_state(moe_structure(model.cfg, hf))
    return arch


def _missing_why(reader: SafetensorsDir) -> str:
    unlisted = reader.unlisted()
    if unlisted:
        return (
            f"model.safetensors.index.json does not list the tensors of {', '.join(unlisted)} (an index from "
            "another save): download the index again, or save the model again with save_pretrained"
        )
    return "config.json describes a model it does not hold"


def _defaulted(hf: dict[str, Any], arch: str) -> str:
    """The sizes config.json leaves to its class's defaults: a shape mismatch is most likely one."""
    absent = sorted(k for k in COMMON & DEFAULTS.get(arch, {}).keys() if _defaults_to(hf, k))
    if not absent:
        return ""
    taken = ", ".join(f"'{k}' ({DEFAULTS[arch][k]})" for k in absent)
    return f"; config.json has no {taken}, so {arch}'s default was taken: add the model's value"


def _defaults_to(hf: dict[str, Any], key: str) -> bool:
    """Whether the class default gives `key` (absent, or null where null is not "derived")."""
    return key not in hf or (hf[key] is None and key not in NULLABLE)


class _ShapeError(CheckpointError):
    """A tensor whose shape is not the one config.json describes."""


def _check_tied_head(reader: SafetensorsDir, embedding: str, path: Path) -> None:
    """A tied model whose file holds a head too: many save both, equal; a different one is
    refused (tying would drop it silently, and transformers may load it untied instead). Compared
    TIE_CHUNK elements at a time: never both whole tensors (a large vocabulary's) in memory at once."""
    if "lm_head.weight" not in reader.names or embedding not in reader.names:
        return
    shape = reader.shape("lm_head.weight")
    if shape != reader.shape(embedding) or not _equal_by_rows(reader, ("lm_head.weight", embedding), shape):
        raise CheckpointError(
            f"{path}: tensor 'lm_head.weight' differs from '{embedding}', but config.json has tie_word_embeddings "
            "true (the head is the embedding); set tie_word_embeddings to false to keep this head, or remove "
            "lm_head.weight from the file to tie it"
        )


def _equal_by_rows(reader: SafetensorsDir, names: tuple[str, str], shape: torch.Size) -> bool:
    """torch.equal of two tensors of `shape`, read a block of rows of each at a time."""
    rest = tuple(slice(0, n) for n in shape[1:])
    rows = max(1, TIE_CHUNK // max(1, shape[1:].numel()))
    for start in range(0, shape[0], rows):
        box = (slice(start, min(start + rows, shape[0])), *rest)
        if not torch.equal(*(reader.part(name, box) for name in names)):
            return False
    return True


def _check_shape(target: torch.Tensor, name: str, tensor: torch.Tensor, path: Path) -> None:
    if target.shape != tensor.shape:
        raise _ShapeError(
            f"{path}: tensor for '{name}' has shape {list(tensor.shape)}, the config.json says {list(target.shape)}"
        )


def _copy(params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, path: Path, keep: Keep) -> None:
    _check_shape(params[name], name, tensor, path)
    with torch.no_grad():
        keep(params[name], tensor)


class _Assigner:
    """Sets a model's tensor by name to the given tensor itself, converted only where it must be
    (dtype, a transposed view made contiguous), every tied name with it (the embedding and the
    head are one Parameter). The parameter built beside it, never written, is dropped unused."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        by_object: dict[int, list[str]] = {}
        for name, tensor in named:
            by_object.setdefault(id(tensor), []).append(name)
        self.aliases = {name: by_object[id(tensor)] for name, tensor in named}

    def __call__(self, params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, path: Path) -> None:
        target = params[name]
        _check_shape(target, name, tensor, path)
        tensor = tensor.to(device=target.device, dtype=target.dtype).contiguous()  # itself when it agrees
        first, _, leaf = self.aliases[name][0].rpartition(".")
        old = self.model.get_submodule(first)._parameters.get(leaf)
        new = torch.nn.Parameter(tensor, requires_grad=old.requires_grad) if old is not None else tensor
        for alias in self.aliases[name]:  # one object for every tied name
            owner, _, leaf = alias.rpartition(".")
            module = self.model.get_submodule(owner)
            (module._parameters if old is not None else module._buffers)[leaf] = new


def _derived(model: Transformer, key: str) -> bool:
    """State that a Hugging Face file does not hold: the tied head, MoE selection biases (none in
    these classes: zero)."""
    return (key == "lm_head.weight" and model.cfg.tie_embeddings) or key.endswith("expert_bias")


def import_model(path: str | Path) -> tuple[Transformer, torch.dtype]:
    """A trimtab model (eval mode) holding a Hugging Face directory's weights, and their dtype."""
    model = uninitialised(model_config(path))
    dtype = import_weights(model, path, assign=True)
    return model.eval(), dtype


def load_tokenizer(path: str | Path) -> TextTokenizer:
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"{path}: no tokenizer.json; trimtab uses a Hugging Face model's fast tokenizer as is "
            "(save it with tokenizer.save_pretrained)"
        )
    fix = "download it again with the model, or save it again with tokenizer.save_pretrained"  # not a run's
    return TextTokenizer.load(path / "tokenizer.json", key=f"the tokenizer of {path}", fix=fix)


def too_few_embeddings(path: str | Path, vocab: int, tokens: int) -> str:
    """The error of a model at `path` whose config.json vocab_size is under its tokenizer's vocabulary: ids from
    vocab_size up index no embedding (`trimtab eval` of such a directory ended in torch's "IndexError: index out
    of range in self" at its first forward)."""
    return (
        f"the model at {path} has vocab_size {vocab} in its config.json, smaller than its tokenizer's vocabulary "
        f"({tokens}): ids from {vocab} up have no embedding; use the tokenizer the model was trained with, or grow "
        f"its embeddings in transformers (model.resize_token_embeddings({tokens}), then save_pretrained)"
    )


def read_source(run_dir: str | Path, fix: str) -> dict[str, Any] | None:
    """RUN_DIR/hf_source.json (source_record), None for a run not imported from Hugging Face; a
    damaged one (a disk fault) is refused naming it and `fix`."""
    record = Path(run_dir) / SOURCE
    if not record.is_file():
        return None
    try:
        found = json.loads(record.read_text())
    except ValueError:
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("config"), dict):
        raise ConfigError(
            f"{record} is damaged: it should record the Hugging Face model this run was initialised from; {fix}"
        )
    return found


def source_record(path: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """What RUN_DIR/hf_source.json keeps of an imported model."""
    path = Path(path)
    generation = path / "generation_config.json"
    return {
        "path": str(path.resolve()),
        "config": read_config(path),
        "dtype": str(dtype).removeprefix("torch."),
        # a damaged one refused, not a JSONDecodeError traceback (after a whole merge's work)
        "generation_config": _json_object(generation, "generation settings") if generation.is_file() else None,
    }
