"""setup(): everything a run needs, built before the first step: the process group, data per
phase and tokenizer (training/phase_data.py), model (wrapped for data parallelism), precision,
the checkpoint to resume, and the run directory. The Trainer receives this BuiltRun and trains it.

All user input is read and checked here, before the run directory is touched, so bad input
never leaves a damaged run behind; a run that has already reached its length stops before
anything is built (training/resume.py). A resume's checks against its checkpoint (the data
position, the phase lengths) are the Trainer's, which writes config.yaml after them: a refused
resume leaves the run directory as it was.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trimtab import hf
from trimtab.checkpoint import local_run
from trimtab.checkpoint_load import check_fits
from trimtab.config import RunConfig, derive, dump_yaml, read_saved, resolve
from trimtab.config.checks import leaves
from trimtab.config.model import LIVE_MODEL_KEYS
from trimtab.config.provenance import header
from trimtab.data import TextTokenizer
from trimtab.data.held_out import screened_decisions
from trimtab.distributed import Parallel
from trimtab.distributed.group import broadcast_object, heartbeat_store
from trimtab.distributed.metainit import MetaInit, materialise, meta_reason, pending
from trimtab.errors import CheckpointError, ConfigError, SavedConfigError
from trimtab.hardware import Precision, choose_precision, pick_device
from trimtab.hf.importer import SOURCE
from trimtab.model import Transformer, build_model
from trimtab.model.meta import build_on_meta
from trimtab.peaks import peak_flops
from trimtab.resilience.elastic import name_session
from trimtab.resilience.watchdog import Watchdog
from trimtab.resilience.watchdogs import make_watchdog
from trimtab.rundir import CONFIG, write_atomic, write_json
from trimtab.storage import is_url
from trimtab.training.changes import TRAINED, checkpoint_config
from trimtab.training.hf_model import adopt_hf_model
from trimtab.training.init_from import init_weights_from, no_init_from, sharded_init_from
from trimtab.training.phase_data import Phase, build_phases
from trimtab.training.resume import resume_point
from trimtab.training.run_tokenizer import tokenizer_source
from trimtab.training.services.compiling import CompileChoice, choose_compile
from trimtab.training.services.cpu_precision import refine_cpu_precision
from trimtab.training.services.float8 import to_float8
from trimtab.training.services.signals import blocking
from trimtab.training.services.storage import local_sources, open_store
from trimtab.training.source_names import saved_names
from trimtab.write_errors import os_error

log = logging.getLogger(__name__)


def complete(cfg: RunConfig, tok: TextTokenizer, phases: list[Phase]) -> RunConfig:
    """The run's config completed with the values only the data knows, so config.yaml records
    exactly what was built: the vocabulary (the tokenizer's, when model.vocab_size is 0) and
    the pretraining length (train.max_steps from train.epochs or auto). A new config: `cfg` is
    resolved, never changed."""
    m = cfg.model
    if 0 < m.vocab_size < tok.vocab_size:
        raise ConfigError(_vocab_too_small(cfg, tok.vocab_size))
    changes = {"model": {"vocab_size": m.vocab_size or tok.vocab_size}, "train": {"max_steps": phases[0].steps}}
    return derive(cfg, changes)


def _vocab_too_small(cfg: RunConfig, tokens: int) -> str:
    """The error of a model vocabulary smaller than the tokenizer's, with the fix that applies: an
    imported model's vocab_size is its config.json's (adopt_hf_model), not model.vocab_size's."""
    vocab, model_dir = cfg.model.vocab_size, cfg.train.init_from
    if model_dir and (hf.is_hf_dir(model_dir) or (cfg.run_dir / SOURCE).is_file()):
        return f"train.init_from: {hf.too_few_embeddings(model_dir, vocab, tokens)}"
    return (
        f"config key 'model.vocab_size' ({vocab}) is smaller than the tokenizer's vocabulary ({tokens}); "
        "set it to 0 to follow the tokenizer"
    )


def check_resume_compatible(cfg: RunConfig, vocab: int = 0, trained: Any = None) -> dict[str, tuple[Any, Any]] | None:
    """A run dir with checkpoints only resumes with the same model: each model.* key that differs
    from the checkpoint's config (`trained`, its state.json copy: changes.checkpoint_config; else
    config.yaml's, which a person's edit in place made the same as this one's) is named, unless it is a
    live knob (LIVE_MODEL_KEYS). Returns the live knobs this config changes (key: (old, new)), for the
    resume to apply over the checkpoint's; None where neither is read (config.yaml missing or damaged:
    a disk fault, a hand edit): the caller checks the model against the checkpoint itself
    (checkpoint_load.check_fits) before config.yaml is written again. `vocab`: the tokenizer's
    vocabulary, which model.vocab_size 0 follows (complete())."""
    before = checkpoint_config(trained)
    if before is None and not (cfg.run_dir / "config.yaml").is_file():
        return None
    try:
        saved = leaves((before or read_saved(cfg.run_dir)).to_dict()["model"], "model.")
    except SavedConfigError as exc:
        log.warning("%s; the model is checked against the checkpoint instead", exc.problem)
        return None
    ours = leaves(cfg.to_dict()["model"], "model.")
    differ = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
    refused = [f"{k}: {old!r} there, {new!r} now" for k, (old, new) in differ.items() if k not in LIVE_MODEL_KEYS]
    if refused:
        raise CheckpointError(
            f"{cfg.run_dir} holds a run with a different model ({'; '.join(refused[:4])}"
            f"{f'; and {len(refused) - 4} more' if len(refused) > 4 else ''}); use a new --out or the same model "
            "settings (of the model.* keys only the MoE / MoD router knobs may change on resume)"
            + _new_vocab(cfg, differ, vocab)
        )
    return {k: v for k, v in differ.items() if k in LIVE_MODEL_KEYS}


def _new_vocab(cfg: RunConfig, differ: dict[str, tuple[Any, Any]], vocab: int) -> str:
    """A resume's vocab_size that changed with the tokenizer, not with model.vocab_size: name the tokenizer
    read now (data.tokenizer, or RUN_DIR/tokenizer.json replaced), which the model's settings did not choose."""
    old, new = differ.get("model.vocab_size", (None, None))
    if new is None or new != vocab:
        return ""
    now = f"data.tokenizer ({cfg.data.tokenizer})" if cfg.data.tokenizer else str(cfg.run_dir / "tokenizer.json")
    return (
        f". model.vocab_size follows the tokenizer, and the one read now, {now}, has {new} tokens where the "
        f"run's had {old}: it is not the tokenizer this run trained with; resume with that one (leave "
        "data.tokenizer unset, and its tokenizer.json as the run wrote it)"
    )


def prepare_run_dir(cfg: RunConfig, tok: TextTokenizer, hf_source: dict | None = None) -> None:
    run_dir = cfg.run_dir
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    if hf_source is not None:  # what export needs to give an imported model back as it came
        write_json(run_dir / SOURCE, hf_source)
    # the first line says which keys this session set (config/provenance.py): the next resume's changes read it
    write_atomic(run_dir / CONFIG, header(cfg) + dump_yaml(cfg.to_dict()))
    if not (run_dir / "tokenizer.json").is_file():
        try:
            tok.save(run_dir / "tokenizer.json")  # atomic (a temp file, then a rename)
        except Exception as exc:  # tokenizers' bare Exception for a failed write: its errno, and where
            raise os_error(exc, run_dir / "tokenizer.json") or exc from None


@dataclass(kw_only=True)
class BuiltRun:
    """What setup() built: the Trainer trains this."""

    cfg: RunConfig
    dist: Parallel  # data parallelism under torchrun; one process otherwise
    precision: Precision
    tok: TextTokenizer
    phases: list[Phase]
    model: Transformer
    forward: Callable[[torch.Tensor], torch.Tensor]  # model.hidden, compiled and wrapped (DDP / FSDP2)
    scaler: torch.amp.GradScaler | None  # fp16 only
    resume: tuple[Path, dict[str, Any]] | None  # the newest valid checkpoint, to resume from
    peak: tuple[float | None, str]  # peak FLOP/s for MFU, and where the figure comes from
    compile: CompileChoice  # train.compile resolved (auto: by the run's expected length)
    sizes: dict[str, int]  # the whole model's parameter counts and training FLOPs per token
    watchdog: Watchdog  # this rank's hang watchdog (resilience/watchdog.py), fed by the loop
    # a resume's live model knobs the config changes (check_resume_compatible): key -> (old, new)
    live_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def check_policy_ranks(cfg: RunConfig, dist: Parallel) -> None:
    """RL and DPO under torchrun: data parallelism, each rank taking its share of a step's
    prompts (pairs) with the whole model (its generation runs alone: a sharded model's ranks
    would have to decode in lockstep)."""
    section, key, per_step, items = (
        ("rl", "rl.prompts_per_step", cfg.rl.prompts_per_step, "prompts")
        if cfg.rl.enabled
        else ("dpo", "dpo.pairs_per_step", cfg.dpo.pairs_per_step, "pairs")
    )
    if dist.sharded or cfg.resilience.ft.enabled:
        raise ConfigError(
            f"{section} under torchrun: data parallelism only (distributed.strategy=ddp, no tensor, expert or "
            "pipeline parallelism, no resilience.ft): each rank generates with the whole model"
        )
    if per_step % dist.dp_world:
        raise ConfigError(
            f"{key}={per_step} must be a multiple of the {dist.dp_world} data-parallel ranks (each takes its "
            f"share of the step's {items})"
        )


def setup(cfg: RunConfig) -> BuiltRun:
    """Build a run from its config: join torchrun's process group, find the checkpoint to resume
    (RunFinished if the run is already at its length), choose device and precision, read and
    tokenize the data, build the model (from train.init_from's weights on a fresh run), wrap it,
    and, on a fresh run, write config.yaml and tokenizer.json into the run directory (a resume
    writes them once the trainer has taken the checkpoint: one it refuses changes nothing)."""
    cfg, dist = _join(cfg)
    # checkpoint.dir checked before anything is written; no valid checkpoint here: the store's newest (storage.py)
    resume = resume_point(cfg, dist, open_store(cfg))
    if resume:  # restored from the store, a run of a Hugging Face model has its hf_source.json only now
        cfg = adopt_hf_model(cfg)
    cfg = _fetch_init_from(cfg, dist, resume)
    precision = choose_precision(dist.device, cfg.train.precision)
    cfg = dist.main_first(local_sources, cfg)  # data paths in object storage: their cached copies
    decided = screened_decisions(resume[1] if resume else None)
    names = saved_names(resume[1] if resume else None)
    tok, phases = dist.main_first(build_phases, cfg, tokenizer_source(cfg), decided, names)
    cfg = complete(cfg, tok, phases)
    live = check_resume_compatible(cfg, tok.vocab_size, resume[1].get(TRAINED)) if resume else {}  # after complete
    model, precision, hf_source, meta = _make_model(cfg, dist, precision, resume, check_fit=live is None)
    sizes = model_sizes(model, cfg.data.seq_len)  # before wrap: a pipeline stage holds only its own layers
    peak = peak_flops(precision)
    steps = max(0, sum(p.steps for p in phases) - (resume[1]["train"].get("step", 0) if resume else 0))
    compiling = choose_compile(
        cfg.train.compile, dist.device, steps, cfg.train.batch_tokens * sizes["flops_per_token"], peak[0]
    )
    log.info("torch.compile %s", compiling.reason)
    forward = dist.wrap(model, compiling.enabled, precision)
    if meta is not None:  # sharded now: each rank allocates and draws (or reads) its own part only
        materialise(model, meta)
        if meta.weights is not None:
            source, hf_source = meta.weights(model)
            log.info("initialised from %s (train.init_from): each rank read its own shards", source)
    if not resume:  # a resume writes config.yaml once the trainer took it (Checkpointing.resume)
        dist.on_main(prepare_run_dir, cfg, tok, hf_source)
    return BuiltRun(
        cfg=cfg,
        dist=dist,
        precision=precision,
        tok=tok,
        phases=phases,
        model=model,
        forward=forward,
        scaler=dist.grad_scaler(precision, cfg.train.loss_scale),
        resume=resume,
        peak=peak,
        compile=compiling,
        sizes=sizes,
        watchdog=make_watchdog(cfg.resilience, cfg.run_dir, dist.rank, dist.world, _heartbeat_store(cfg, dist)),
        live_changes=live or {},
    )


def _heartbeat_store(cfg: RunConfig, dist: Parallel) -> Callable[[], Any] | None:
    """How the ranks' heartbeats reach torchrun's store (resilience/heartbeat.py); None outside torchrun."""
    if dist.world == 1 or "MASTER_ADDR" not in os.environ:
        return None
    return lambda: heartbeat_store(cfg.resilience.min_timeout_s)


def _join(cfg: RunConfig) -> tuple[RunConfig, Parallel]:
    """Seed, resolve the config, join torchrun's process group and check RL's / DPO's rank layout."""
    torch.manual_seed(cfg.train.seed)
    cfg = adopt_hf_model(resolve(cfg))  # a draft RunConfig(...) is resolved here; a resolved one is kept
    with blocking("waiting in init_process_group for the other ranks"):  # no Python handler runs there
        dist = Parallel.start(cfg.distributed, pick_device(cfg.train.device))
    name_session(broadcast_object(uuid.uuid4().hex))  # what tells this session's rank beats from a lost one's
    if (cfg.rl.enabled or cfg.dpo.enabled) and dist.world > 1:
        check_policy_ranks(cfg, dist)
    return cfg, dist


def _fetch_init_from(cfg: RunConfig, dist: Parallel, resume: tuple[Path, dict[str, Any]] | None) -> RunConfig:
    """A fresh run's train.init_from in object storage, fetched; a missing one refused before the data is read."""
    if cfg.train.init_from and is_url(cfg.train.init_from) and not resume:
        local = dist.main_first(local_run, cfg.train.init_from, "train.init_from")
        log.info("train.init_from %s: fetched into %s", cfg.train.init_from, local)
        cfg = derive(cfg, {"train": {"init_from": str(local)}})
    if cfg.train.init_from and not resume and not Path(cfg.train.init_from).exists():
        raise no_init_from(cfg.train.init_from)
    return cfg


def _make_model(
    cfg: RunConfig,
    dist: Parallel,
    precision: Precision,
    resume: tuple[Path, dict[str, Any]] | None,
    *,
    check_fit: bool,
) -> tuple[Transformer, Precision, dict | None, MetaInit | None]:
    """Build the model (checked against the resumed checkpoint when check_fit), settle the
    precision all ranks train in, load a fresh run's train.init_from weights (the Hugging Face source
    record, or None, comes back with the model and precision), and convert it for fp8. A model the
    ranks shard (FSDP2, tensor, expert, pipeline parallelism) is built on the meta device: its MetaInit comes
    back too, for materialise after Parallel.wrap (distributed/metainit.py meta_reason says which);
    any other is built on the CPU and moved to the device."""
    initialised = bool(cfg.train.init_from) and not resume  # weights read from train.init_from
    whole = meta_reason(dist)
    if whole:
        meta = None
        if dist.sharded:
            log.info("building the whole model on every rank before sharding it: %s", whole)
        model = build_model(cfg.model).to(dist.device)
    else:
        draw = resume is None and not initialised  # a resume loads weights and generator, init_from weights
        model = build_on_meta(cfg.model, draw=draw)
        meta = pending(dist, model, draw=draw)
        log.info("model built on the meta device: each rank allocates and initialises its own shards")
    if check_fit:
        check_fits(model, *resume)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing)
    saved = resume[1].get("precision") if resume else None
    precision = dist.same_precision(refine_cpu_precision(precision, cfg, model, saved))
    log.info("precision %s: %s", precision.name, precision.reason)
    hf_source = None
    if initialised and meta is not None:  # its structure now, its shards' weights after materialise
        meta.weights = sharded_init_from(cfg, model, dist)
    elif initialised:
        source, hf_source = init_weights_from(cfg, model)
        log.info("initialised from %s (train.init_from)", source)
    if precision.name == "fp8":
        if cfg.distributed.tp > 1:
            raise ConfigError("train.precision=fp8 with distributed.tp > 1 is not supported yet; use bf16 or tp 1")
        to_float8(model, cfg.train.fp8_recipe)
    return model, precision, hf_source, meta


def model_sizes(model: Any, seq_len: int) -> dict[str, int]:
    """The model's parameter counts and training FLOPs per token: counted at setup, and again after
    expert surgery (training/control.py), which changes them (summary.json gave the starting size)."""
    return {
        "params": model.num_params(),
        "non_embedding_params": model.num_params(exclude_embeddings=True),
        "active_params": model.num_params(active=True),
        "flops_per_token": model.flops_per_token(seq_len),
    }
