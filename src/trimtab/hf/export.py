"""`trimtab export RUN_DIR --out DIR`: a run's checkpoint as a directory transformers loads
offline (AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR)).

    DIR/config.json, generation_config.json
       model.safetensors, or model-0000K-of-0000N.safetensors + model.safetensors.index.json
       tokenizer.json, tokenizer_config.json, special_tokens_map.json
       README.md                the model card (hf/card.py)
       trimtab_export.json      the files this export wrote (a re-export replaces only those)
       [configuration_trimtab.py, modeling_trimtab.py: trust_remote_code, when no standard class
        computes the model; hf/remote]

Tensors stream from the checkpoint to the shards one at a time: the memory held is one shard
(max_shard_bytes) plus a tensor, never a second copy of the model. The directory appears whole
or not at all (written beside DIR, then renamed). Into a directory that holds an earlier export,
the files that export wrote (its trimtab_export.json) are replaced and any others kept; a non-empty
directory without that record is refused, never emptied.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trimtab.checkpoint import is_sharded, list_checkpoints, local_run, saved_healthy, say_skipped, verify
from trimtab.checkpoint_load import read_sharded_weights
from trimtab.config import ModelConfig, RunConfig, read_saved
from trimtab.data import TextTokenizer
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf.architectures import export_class, to_hf_config, window_back
from trimtab.hf.card import model_card
from trimtab.hf.importer import SafetensorsDir, is_hf_dir, read_source
from trimtab.hf.tensors import Getter, to_hf
from trimtab.model.upgrade import UpgradedReader, is_legacy
from trimtab.snapshots import list_snapshots, snapshot_root
from trimtab.storage import export_record, is_url, open_remote, publish

log = logging.getLogger(__name__)
MARKER = "trimtab_export.json"  # {"trimtab_export": 1, "files": [what the export wrote]}
MAX_SHARD_BYTES = 4 * 2**30  # shards above this size split (transformers' own default is 5 GB)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_run(run_dir: str | Path, out: str | Path, **options: Any) -> Path | str:
    """export_checkpoint(run_dir, out, **options), returning `out` alone."""
    return export_checkpoint(run_dir, out, **options)[0]


def export_checkpoint(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    snapshot: int | None = None,
) -> tuple[Path | str, Path]:
    """Export checkpoint `step` (default: the newest valid one), or lean snapshot `snapshot`
    (snapshots.py), of `run_dir` into `out`. dtype: float32 | bfloat16 | float16; default the
    imported model's own, else float32. Either may be in object storage (a URL): `run_dir` a
    run's checkpoint.dir, `out` a prefix the export is uploaded to (_export_to). Returns `out` and
    the checkpoint (or snapshot) directory exported: the newest may have been skipped as corrupt,
    and `trimtab export` says which step it wrote."""
    if is_url(str(out)):
        return _export_to(str(out), run_dir, step=step, dtype=dtype, max_shard_bytes=max_shard_bytes, snapshot=snapshot)
    if is_url(str(run_dir)) and step is not None and snapshot is None:
        run_dir = f"{str(run_dir).rstrip('/')}/step_{step:06d}"  # that checkpoint alone is fetched
    run_dir, out = local_run(run_dir, "trimtab export's RUN_DIR"), Path(out)
    if is_hf_dir(run_dir):
        raise CheckpointError(
            f"'{run_dir}' is a Hugging Face model directory already (config.json, no config.yaml); export takes a "
            "run directory: pass the --out of a run, or train from this one with --set train.init_from first"
        )
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"'{run_dir}' is not a run directory (no config.yaml); pass the --out of a run")
    fix = "restore it, or remove it to export with trimtab's own mapping of the model (float32 unless --dtype)"
    source = read_source(run_dir, fix)
    dtype = dtype or (source["dtype"] if source else "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    job = Export(run_dir, read_saved(run_dir), source, DTYPES[dtype], max_shard_bytes)
    candidates = _candidates(run_dir, step) if snapshot is None else [_snapshot(run_dir, snapshot)]
    skipped: list[tuple[Path, CheckpointError]] = []  # said as the checkpoint loader says them, once
    for path in candidates:
        try:
            job.write(path, out)
        except CorruptCheckpoint as exc:
            skipped.append((path, CheckpointError(str(exc))))
            if step is not None or path == candidates[-1]:
                say_skipped(skipped[:-1], None)
                raise skipped[-1][1] from None
            continue
        say_skipped(skipped, path)
        if step is None and snapshot is None:
            _say_if_unhealthy(run_dir, path)
        return out, path
    raise AssertionError("unreachable: the last candidate returns or raises")


def _export_to(url: str, run_dir: str | Path, **options: Any) -> tuple[str, Path]:
    """An export into object storage: the store checked first (storage.open_remote: a missing
    bucket, no credentials, exit 2 before any work), the export written whole in a local staging
    folder, then uploaded with trimtab_export.json last (storage.publish): a prefix without it
    is an upload that did not finish."""
    remote = open_remote(url, "trimtab export --out")
    previous = export_record(remote, MARKER)  # refuses a prefix holding files not an export's
    with tempfile.TemporaryDirectory(prefix="trimtab-export-") as staging:
        local, exported = export_checkpoint(run_dir, Path(staging) / "out", **options)
        publish(local, remote, MARKER, previous)
    return url, exported


class CorruptCheckpoint(Exception):
    """The checkpoint failed verification while it was being exported."""


@dataclass
class Export:
    run_dir: Path
    cfg: RunConfig
    source: dict | None  # hf_source.json of an imported model
    dtype: torch.dtype
    max_shard_bytes: int

    def write(self, path: Path, out: Path) -> Path:
        """Convert checkpoint `path` into `out`. Its manifest is checked (sha256 of every file) in a
        thread while the tensors convert (hashlib releases the GIL: the check costs no wall time);
        a corrupt checkpoint raises CorruptCheckpoint and leaves nothing behind."""
        with ThreadPoolExecutor(1) as pool:
            verified = pool.submit(verify, path)
            previous = _previous_files(out)
            tmp = _fresh(out)
            try:
                state = _read_state(path, verified)
                tok = TextTokenizer.load(self.run_dir / "tokenizer.json")
                arch = self._model(_reader(path, self.cfg.model), state, tok, tmp)
                chat = _chat_trained(self.cfg)
                _write_json(tmp / "generation_config.json", _generation_config(tok, self.source, chat))
                write_tokenizer(tok, tmp, _positions(tmp, self.cfg.model.max_seq_len), chat=chat)
                (tmp / "README.md").write_text(model_card(self.run_dir, self.cfg, state, arch, self.source))
                _result(verified)
                _install(tmp, out, previous)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if not isinstance(exc, CorruptCheckpoint):
                    _result(verified)  # a file unreadable because it is corrupt (truncated) is said as such
                raise
        return out

    def _model(self, get: Getter, state: dict[str, Any], tok: TextTokenizer, tmp: Path) -> str:
        """config.json and the weights in the class that computes the model; returns the class."""
        moe_state = state.get("moe", {})
        model_cfg = _live_config(self.cfg.model, moe_state)
        biased = any(bool(get(f"blocks.{i}.ffn.expert_bias").any()) for i in map(int, moe_state))
        prefer = self.source["config"]["architectures"][0] if self.source else ""
        arch = export_class(model_cfg, moe_state, biased, prefer)
        ids = _token_ids(tok, self.source)
        _warn_tokenizer_class(arch, tok)
        if arch is None:
            return _remote(get, model_cfg, state, tmp, ids, self)
        dtype = str(self.dtype).removeprefix("torch.")
        hf = to_hf_config(model_cfg, arch, ids, dtype)
        theirs = self.source["config"] if self.source else {}
        hf |= window_back(theirs, arch, model_cfg.max_seq_len)
        _write_json(tmp / "config.json", {**theirs, **hf})
        write_shards(to_hf(get, model_cfg, arch, moe_state), tmp, self.dtype, self.max_shard_bytes)
        return arch


def _positions(out: Path, context: int) -> int:
    """The positions the exported config.json gives the model (max_position_embeddings), which the
    tokenizer's model_max_length says too: trimtab's context, or, where an imported model's sliding
    window capped it, the positions it came with (window_back). A Mistral (window 16 of 64
    positions) went out with model_max_length 16 beside max_position_embeddings 64: transformers
    truncated and warned at 16 tokens what the model reads 64 of."""
    return int(json.loads((out / "config.json").read_text()).get("max_position_embeddings", context))


def _warn_tokenizer_class(arch: str | None, tok: TextTokenizer) -> None:
    """transformers' AutoTokenizer loads any qwen2 model's tokenizer as Qwen2Tokenizer, whatever
    tokenizer_config.json names, and that class rebuilds the pre-tokenizer as Qwen's: another
    tokenizer (trimtab's own, a model with attention biases exported as Qwen2) then tokenizes
    differently there, silently. A Qwen tokenizer is rebuilt as itself."""
    if arch == "Qwen2ForCausalLM" and not str((tok.hf or {}).get("tokenizer_class", "")).startswith("Qwen2Tokenizer"):
        log.warning(
            "exported as Qwen2ForCausalLM (attention biases), whose tokenizer transformers' AutoTokenizer "
            "replaces with Qwen2Tokenizer, which splits text otherwise than this run's tokenizer.json: load the "
            "tokenizer with transformers.PreTrainedTokenizerFast.from_pretrained(DIR), not AutoTokenizer"
        )


def _candidates(run_dir: Path, step: int | None) -> list[Path]:
    """Checkpoints to export, newest first: the one at `step`, or all (the first valid one wins)."""
    found = list_checkpoints(run_dir)[::-1]
    if step is not None:
        found = [p for p in found if p.name == f"step_{step:06d}"]
        if not found:
            have = ", ".join(p.name.removeprefix("step_").lstrip("0") or "0" for p in list_checkpoints(run_dir))
            raise CheckpointError(f"{run_dir} has no checkpoint at step {step} (it has: {have or 'none'})")
    if not found:
        raise CheckpointError(f"'{run_dir}' has no checkpoint yet; train it first")
    return found


def _say_if_unhealthy(run_dir: Path, path: Path) -> None:
    """Warn when the newest checkpoint, exported by default, was saved while the run was not healthy
    (state.json "good": false: an escalation under way, or an instability in the steps just before;
    a rollback would not return to it), naming the newest one that was: the person chooses."""
    if saved_healthy(path):
        return
    healthy = [p for p in list_checkpoints(run_dir) if p < path and saved_healthy(p)]
    step = int(path.name.removeprefix("step_"))
    other = (
        f"the newest healthy checkpoint is step {int(healthy[-1].name.removeprefix('step_'))}: export it with --step"
        if healthy
        else "no earlier checkpoint was saved healthy"
    )
    log.warning(
        '%s: checkpoint step %d, exported, was saved while the run was not healthy (state.json "good": false: '
        "an escalation under way or an instability just before; decisions.jsonl says which); %s",
        run_dir,
        step,
        other,
    )


def _snapshot(run_dir: Path, step: int) -> Path:
    path = snapshot_root(run_dir) / f"step_{step:06d}"
    if not path.is_dir():
        have = ", ".join(p.name.removeprefix("step_").lstrip("0") or "0" for p in list_snapshots(run_dir))
        raise CheckpointError(f"{run_dir} has no lean snapshot at step {step} (it has: {have or 'none'})")
    return path


def _read_state(path: Path, verified: Future) -> dict[str, Any]:
    """state.json before its verification ends (an unreadable one is the verification's error)."""
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        _result(verified)
        raise


def _result(verified: Future) -> None:
    try:
        verified.result()
    except CheckpointError as exc:
        raise CorruptCheckpoint(str(exc)) from None


def _reader(path: Path, cfg: ModelConfig) -> Getter:
    """trimtab tensors of a checkpoint by name, read on demand (a sharded checkpoint is assembled
    whole first: torch.distributed.checkpoint reads it that way); an older checkpoint's in the
    current layout (model/upgrade.py)."""
    reader = _Tensors(read_sharded_weights(path)) if is_sharded(path) else SafetensorsDir(path)
    return UpgradedReader(reader, reader.names, cfg) if is_legacy(reader.names) else reader


class _Tensors(dict):
    """Tensors held in memory, read like a SafetensorsDir (names, call by name)."""

    @property
    def names(self) -> set[str]:
        return set(self)

    def __call__(self, name: str) -> torch.Tensor:
        return self[name]


def _live_config(cfg: ModelConfig, moe_state: dict[str, dict[str, float]]) -> ModelConfig:
    """The model config with what surgery changed: the expert count when every MoE layer has
    the same one (unequal counts leave as remote code)."""
    counts = {int(s["n_experts"]) for s in moe_state.values()}
    if len(counts) != 1:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=counts.pop()))


def _previous_files(out: Path) -> list[str]:
    """The files an earlier export wrote into `out` ([] for a new or empty directory). Refuses a
    non-empty directory without trimtab's record of them: its files are someone's, not ours."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise ConfigError(f"--out '{out}' is a file, not a directory; choose a new or empty directory")
    if not any(out.iterdir()):
        return []
    try:
        files = json.loads((out / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--out '{out}' is not empty and is not an exported model (it has no valid {MARKER}, which "
            "trimtab export writes to record its files; an export by a trimtab before it has none either); "
            "trimtab never deletes files it did not write: choose a new or empty directory, or empty this one "
            "yourself"
        ) from None
    # only plain names inside `out`: an edited record must not make a re-export delete elsewhere
    return [f for f in files if isinstance(f, str) and f == Path(f).name and f not in ("", ".", "..")]


def _fresh(out: Path) -> Path:
    """A temp dir beside `out`, where the export is written before it is installed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _install(tmp: Path, out: Path, previous: list[str]) -> None:
    """Move the export written in `tmp` into `out`. A new (or empty) `out` appears whole, renamed
    at once; into an earlier export, file by file: its files replaced or removed, others kept."""
    files = sorted(p.name for p in tmp.iterdir())
    _write_json(tmp / MARKER, {"trimtab_export": 1, "files": [*files, MARKER]})
    if not out.exists() or not any(out.iterdir()):
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        return
    # the record lists old and new files first: a crash midway leaves every file we wrote ours
    _write_json(out / MARKER, {"trimtab_export": 1, "files": sorted({*previous, *files, MARKER})})
    for name in files:
        os.replace(tmp / name, out / name)
    for name in set(previous) - {*files, MARKER}:
        stale = out / name
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    os.replace(tmp / MARKER, out / MARKER)
    tmp.rmdir()


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, dtype: torch.dtype, max_bytes: int) -> None:
    """Save (name, tensor) pairs as safetensors of at most max_bytes each (a larger single tensor
    gets a shard of its own): model.safetensors, or numbered shards and their index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    names: list[list[str]] = [[]]
    for name, tensor in tensors:
        tensor = tensor.to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_bytes:
            _save(shards[-1], out / f".shard{len(shards)}")
            shards.append({})
            names.append([])
            size = 0
        shards[-1][name] = tensor
        names[-1].append(name)
        size, total = size + nbytes, total + nbytes
    _save(shards[-1], out / f".shard{len(shards)}")
    if len(shards) == 1:
        os.replace(out / ".shard1", out / "model.safetensors")
        return
    weight_map = {}
    for k, shard_names in enumerate(names, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f".shard{k}", out / file)
        weight_map.update(dict.fromkeys(shard_names, file))
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save(shard: dict[str, torch.Tensor], path: Path) -> None:
    save_file(shard, str(path), metadata={"format": "pt"})
    shard.clear()  # the shard's tensors go with it


def _token_ids(tok: TextTokenizer, source: dict | None) -> dict[str, Any]:
    if source:
        return {k: source["config"].get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def _generation_config(tok: TextTokenizer, source: dict | None, chat: bool) -> dict[str, Any]:
    """An imported model's own, else trimtab's ids; after chat training in trimtab's format (its
    own tokenizer's, or an export's of it) the end-of-turn token as a second eos, so generation
    stops where the assistant's turn ends."""
    found = dict(source["generation_config"]) if source and source.get("generation_config") else None
    ids = found or _token_ids(tok, source)
    if chat and tok.chat is None:
        from trimtab.data.sources import END

        ids["eos_token_id"] = [tok.eos_id, tok.encode(END)[0]]
    return ids


def _chat_trained(cfg: RunConfig) -> bool:
    """Whether a phase trained on chat records (their template then goes with the tokenizer)."""
    from trimtab.data.sources import is_chat

    phases = [cfg.data] + ([cfg.finetune.data] if cfg.finetune.steps else [])
    return any(is_chat(data) for data in phases)


def write_tokenizer(tok: TextTokenizer, out: Path, max_len: int, chat: bool) -> None:
    """tokenizer.json and the settings AutoTokenizer reads: a Hugging Face tokenizer's own
    (model_max_length set if it had none), else trimtab's specials; after chat training in
    trimtab's format (its own tokenizer's, or an export's of it without a template), its chat
    template (data/sources.py CHAT_TEMPLATE, the format the model learned)."""
    from trimtab.data.sources import CHAT_TEMPLATE
    from trimtab.data.tokenizer import EOS, PAD

    tok.save(out / "tokenizer.json")  # a Hugging Face one writes its tokenizer_config.json too
    settings = dict(tok.hf) if tok.hf else {"eos_token": EOS, "pad_token": PAD, "bos_token": None}
    settings.setdefault("model_max_length", max_len)
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    settings.setdefault("clean_up_tokenization_spaces", False)
    if chat and tok.chat is None:
        settings["chat_template"] = CHAT_TEMPLATE
    _write_json(out / "tokenizer_config.json", settings)
    special = {k: settings[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if settings.get(k)}
    _write_json(out / "special_tokens_map.json", special)


def _remote(
    reader: Getter, cfg: ModelConfig, state: dict[str, Any], out: Path, ids: dict[str, Any], job: Export
) -> str:
    """No standard class computes this model: trimtab's own modeling file (hf/remote)."""
    from trimtab.hf.remote import remote_config, remote_tensors

    names = sorted(reader.names)
    experts = [reader(f"blocks.{i}.ffn.router").shape[0] if "moe" in k else 0 for i, k in enumerate(cfg.layers)]
    dtype = str(job.dtype).removeprefix("torch.")
    _write_json(out / "config.json", remote_config(cfg, experts, out, ids, dtype))
    write_shards(remote_tensors(reader, names, state.get("moe", {})), out, job.dtype, job.max_shard_bytes)
    return "TrimtabForCausalLM"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
