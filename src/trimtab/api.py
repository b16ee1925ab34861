"""The Python API; the CLI is a thin layer over these functions, so scripts drive the same code."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trimtab import hf
from trimtab.checkpoint import latest_valid, list_checkpoints, local_run
from trimtab.checkpoint_load import load_model
from trimtab.config import DataConfig, RunConfig, derive, load_config, read_saved, resolve, set_changes
from trimtab.data import TextTokenizer
from trimtab.distributed import is_main
from trimtab.errors import CheckpointError, ConfigError, RunFinished, TrimtabError
from trimtab.extras import require
from trimtab.model import Transformer, build_model
from trimtab.orchestrator import Orchestrator
from trimtab.orchestrator.faults import FaultInjector
from trimtab.orchestrator.planner import LivePlanner
from trimtab.orchestrator.restarts import Resilience
from trimtab.rundir import CONFIG, read_metrics, write_summary
from trimtab.runlock import check_out, liveness, run_lock
from trimtab.sampling import fit_prompt
from trimtab.sampling import generate as generate_ids
from trimtab.training.hooks import ReportWriter
from trimtab.training.schedule import fixed_lengths
from trimtab.training.services.prometheus import PrometheusExporter
from trimtab.training.services.signals import StartUpInterrupted, handle_signals
from trimtab.training.services.storage import RemoteCheckpoints
from trimtab.training.services.tracking import tracking_hooks
from trimtab.training.setup import BuiltRun, setup
from trimtab.training.trainer import Trainer

log = logging.getLogger(__name__)


def train(config: RunConfig | str | Path | None = None, *, hooks: list = (), **overrides: Any) -> dict:
    """Train (or resume) a run and return its summary.

    `config` is a RunConfig, a YAML path, or None for the default preset; keyword overrides are
    sections, e.g. train(preset="debug", out="runs/x", train={"max_steps": 40}).

    A call that trains nothing warns why and returns what the run has: a run already at the
    length the config asks for, its saved summary (nothing in its directory changes); a SIGTERM
    or SIGINT during start-up, a summary with status "stopped (SIGTERM during start-up)".
    """
    if not isinstance(config, RunConfig):
        config = load_config(config, overrides=overrides)
    elif overrides:
        raise TypeError("pass overrides inside the RunConfig, or pass a YAML path / None with overrides")
    try:
        return train_or_raise(config, hooks)
    except (RunFinished, StartUpInterrupted) as stopped:
        log.warning("%s", stopped)
        return stopped.summary


def train_or_raise(config: RunConfig, hooks: list = ()) -> dict:
    """train() for the CLI: where a call trains nothing it raises RunFinished or
    StartUpInterrupted, whose message says why, instead of returning a summary."""
    # A signal from here to the first step ends start-up cleanly (training/services/signals.py).
    check_out(config.run_dir)
    _check_out_is_no_input(config)
    lengths = fixed_lengths(config)
    before, session = _entries_before(config.run_dir), _Session()
    made = not config.run_dir.exists()  # a folder that was there, even empty, is the user's: it stays
    try:
        with handle_signals(run_dir=config.run_dir, lengths=lengths), run_lock(config.run_dir):  # one per run directory
            session.locked = True  # from here what the directory gains is this session's
            built = setup(config)  # before the hooks: a restore from checkpoint.dir comes first
            hooks = built_in_hooks(config) + list(hooks)
            _check_faults(hooks, built)  # before the Trainer writes a resume's config.yaml
            try:
                session.trainer = Trainer(built, hooks=hooks)
                summary = session.trainer.fit()
            except TrimtabError:  # exit 2 (cli.py), its message the error's
                _close_refused(hooks)
                raise
            if is_main():  # under torchrun every rank returns the same summary; rank 0 writes it
                _write_summary(config.run_dir, summary)
                for hook in hooks:  # checkpoint.dir: the summary and the report too, for a fresh machine
                    if isinstance(hook, RemoteCheckpoints):
                        hook.on_summary()
    except TrimtabError:
        if before is not None and session.refused_before_training(config.run_dir):
            _discard_refused(config.run_dir, before, made)
        raise
    return summary


def _check_out_is_no_input(config: RunConfig) -> None:
    """Refuse an --out that is a Hugging Face model directory (the run trained from scratch beside
    its weights, never reading them, and transformers then loaded the stale export from it), or a
    data source directory (every resume read the run's own config.yaml, metrics.jsonl and
    checkpoints as text: a DataError on metrics.jsonl's records, the run could not go on)."""
    out = config.run_dir.resolve()
    if hf.is_hf_dir(out):
        raise ConfigError(
            f"out '{config.run_dir}' is a Hugging Face model directory (config.json, no config.yaml): a run there "
            f"would not start from its weights; to train from them: --set train.init_from={config.run_dir} with a "
            "new --out"
        )
    named = [("data", config.data), ("finetune.data", config.finetune.data)]
    for section, data in named:
        keyed = [(f"{section}.source", part.source) for part in data.sources]
        if data.mix:
            keyed = [(f"{section}.mix[{i}].source", part.source) for i, part in enumerate(data.sources)]
        for key, value in [*keyed, (f"{section}.eval_source", data.eval_source)]:
            for source in [value] if isinstance(value, str) else value:
                if source and "://" not in source and Path(source).is_dir() and Path(source).resolve() == out:
                    raise ConfigError(
                        f"out '{config.run_dir}' is {key} '{source}': the run's own files (checkpoints, "
                        "metrics.jsonl) would be read as text when it resumes; give --out another directory"
                    )


def _check_faults(hooks: list, built: BuiltRun) -> None:
    """Faults the run cannot take (expert_collapse on a dense model...), refused before anything is written."""
    for hook in hooks:
        if isinstance(hook, FaultInjector):
            step = built.resume[1]["train"].get("step", 0) if built.resume else 0
            rows = built.phases[0].train_rows is not None  # RL's prompts and DPO's pairs are no rows of tokens
            hook.check_run(built.model, built.dist.world, step, rows, built.cfg.rl.enabled)


class _Session:
    """How far train_or_raise got: whether it took the run lock, and the Trainer it built."""

    def __init__(self) -> None:
        self.locked = False
        self.trainer: Trainer | None = None

    def refused_before_training(self, run_dir: Path) -> bool:
        """Refused after taking the lock and before a training step (setup, the Trainer or a hook's
        on_train_start raised): another process's lock refuses before anything is this session's, and
        a line in metrics.jsonl is a step trained, whatever step a rollback has since returned to."""
        trained = self.trainer is not None and self.trainer.state.step
        return self.locked and not trained and not read_metrics(run_dir, abandoned=True)


def _entries_before(run_dir: Path) -> set[str] | None:
    """The names in run_dir before this session (an empty set: no directory yet); None where a run
    is there already (its config.yaml), or on a rank other than 0 (rank 0 writes the directory)."""
    if not is_main() or (run_dir / CONFIG).exists():
        return None
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def _discard_refused(run_dir: Path, before: set[str], made: bool) -> None:
    """A new run refused at start-up (a fault its model cannot take, a busy log.prometheus.port, a
    hook refusing it as it starts) had already written config.yaml, tokenizer.json, goodput.json...:
    a "run" that never ran, which `trimtab runs` listed as failed. What this session added is
    removed, and the directory with it if this session made it (`made`; a folder the user made, even
    an empty one, stays)."""
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path.name in before:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if made:
        with contextlib.suppress(OSError):
            run_dir.rmdir()
    gone = made and not run_dir.exists()
    log.info(
        "the run was refused before it started: %s",
        "the directory it made is removed" if gone else f"what it had written into {run_dir} is removed",
    )


def _close_refused(hooks: list) -> None:
    """A start a hook refused before this session's first step (in its on_train_start) ends the
    session the goodput ledger opened: left open, the next launch into the directory read it as a
    process lost without a word (a `restart` decision, seconds 'down')."""
    for hook in hooks:
        if isinstance(hook, Resilience) and hook.ledger is not None and not hook.steps:
            hook.ledger.close("refused at start-up")


def _write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json; on a full disk the run's outcome (and its exit code) still stands: say so."""
    try:
        write_summary(run_dir, summary)
    except OSError as exc:
        log.warning("summary.json not written (%s); the run's status: %s", exc, summary.get("status"))


def built_in_hooks(config: RunConfig) -> list:
    """The hooks every run has beside the loggers: the orchestrator, the goodput ledger, fault injection when the
    config asks for faults (a test instrument: the Trainer hands it its FaultHandle), the live
    Chinchilla planner (proposing its run-length findings to the orchestrator's policy through
    the loop), and on rank 0 the report and the experiment trackers."""
    orchestrator = Orchestrator(config.orchestrator, config.run_dir)
    # goodput accounting; a restart journaled (orchestrator/restarts.py)
    hooks = [orchestrator, Resilience(config.run_dir, journal=config.orchestrator.mode != "off")]
    if config.faults:
        hooks.append(FaultInjector(config.faults, config.run_dir))
    if config.plan.status_every:  # the live Chinchilla status (docs/planner.md)
        hooks.append(LivePlanner(config.plan, config.run_dir, propose=config.orchestrator.mode != "off"))
    if config.log.prometheus.enabled:  # every rank serves its own /metrics
        require("prometheus_client", "log.prometheus.enabled")
        hooks.append(PrometheusExporter(config.log.prometheus, config.run_dir))
    if is_main():  # files and trackers: rank 0 speaks for the job
        if config.checkpoint.dir:  # object storage: each checkpoint uploaded once on disk (docs/storage.md)
            hooks.append(RemoteCheckpoints(config.checkpoint.dir, config.run_dir, config.checkpoint.keep))
        if config.log.report:
            hooks.append(ReportWriter(config.run_dir))  # after the orchestrator, before the trackers that upload it
        hooks += tracking_hooks(config.log, config.run_dir)
    return hooks


def load_run(run_dir: str | Path) -> tuple[RunConfig, Transformer, TextTokenizer]:
    """The run's resolved config, its newest valid weights and its tokenizer; or, for a Hugging
    Face model directory, a config holding its model and the converted weights."""
    return load_run_at(run_dir)[:3]


def load_run_at(
    run_dir: str | Path, sets: Sequence[str] = ()
) -> tuple[RunConfig, Transformer, TextTokenizer, int | None]:
    """load_run's, and the step of the checkpoint it loaded (None for a Hugging Face directory); `sets`:
    --set items over the run's config.yaml, as `trimtab train` takes them (e.g. model.max_seq_len=512
    with model.rope_scaling to score a longer context)."""
    run_dir = local_run(run_dir, "the run directory")  # a run in object storage: fetched into the cache
    if hf.is_hf_dir(run_dir):
        # data.* say how a file is read (eval --data's text_field, format), not the model: kept
        if model_sets := [item for item in sets if not item.startswith("data.")]:
            raise ConfigError(
                f"--set {model_sets[0]}: '{run_dir}' is a Hugging Face model directory, whose config.json sets the "
                "model; --set changes a trimtab run directory's config.yaml: drop it, or edit config.json"
            )
        model, _ = hf.import_model(run_dir)
        tok = hf.load_tokenizer(run_dir)
        if tok.id_limit > model.cfg.vocab_size:
            raise ConfigError(hf.too_few_embeddings(run_dir, model.cfg.vocab_size, tok.id_limit))
        seq_len = min(DataConfig().seq_len, model.cfg.max_seq_len)  # a valid config to write out (merge)
        cfg = resolve({"model": asdict(model.cfg), "out": str(run_dir), "data": {"seq_len": seq_len}})
        cfg = derive(cfg, set_changes(sets)) if sets else cfg
        return cfg, model, tok, None
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(
            f"'{run_dir}' is neither a run directory (no config.yaml) nor a Hugging Face model directory "
            "(no config.json); pass the --out of a run or a transformers model directory"
        )
    cfg = read_saved(run_dir)
    cfg = derive(cfg, set_changes(sets)) if sets else cfg
    found = latest_valid(run_dir)  # a corrupt newer one is said there, with the one used: once, not again here
    if found is None:
        raise CheckpointError(_no_checkpoint(run_dir))
    model = build_model(cfg.model)
    load_model(model, found[0], verified=True)
    tok = TextTokenizer.load(run_dir / "tokenizer.json", key="the run's tokenizer")
    return cfg, model.eval(), tok, found[1]["step"]


def _sampled_from(run_dir: str | Path, step: int) -> str:
    """Which weights a sample comes from: the newest valid checkpoint, which a run still training
    (its lock held, runlock.liveness) has left behind by the steps since it was saved."""
    running, _ = liveness(run_dir) if Path(run_dir).is_dir() else (False, "")  # a remote run: not probed here
    said = f"sampling from the checkpoint at step {step:,} of {run_dir}"
    return said + (" (the run is still training: its later steps are not in this checkpoint)" if running else "")


def generate(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    seed: int = 0,
) -> str:
    """Continue `prompt` with the run's newest weights (KV-cached sampling). The prompt is tokenized
    as transformers does (a Hugging Face tokenizer's start token first); an empty one without a
    start token begins at end-of-text; a prompt that leaves the context too little room for
    max_new_tokens keeps its end (said); the checkpoint's step is said (a run still training has moved on)."""
    _, model, tok, step = load_run_at(run_dir)
    if step is not None:
        log.info("%s", _sampled_from(run_dir, step))
    ids, given_up = fit_prompt(tok, prompt, model.cfg.max_seq_len, max_new_tokens)  # no positions past the context
    if given_up:
        log.warning("%s", given_up)
    new = generate_ids(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id,
        seed=seed,
        vocab=tok.id_limit,  # a head padded past the tokenizer: those ids have no text
    )
    return tok.decode(new)


def _no_checkpoint(run_dir: Path) -> str:
    """Why `run_dir` has nothing to load: never checkpointed, or every checkpoint corrupt (each
    named in a warning above); "train it first" misled the latter into retraining blind."""
    saved = list_checkpoints(run_dir)
    if not saved:
        return f"'{run_dir}' has no valid checkpoint yet; train it first"
    return (
        f"'{run_dir}': all {len(saved)} checkpoints under {saved[0].parent} are corrupt (each named in a warning "
        "above); restore one from a backup or the run's remote storage, or train the run again"
    )
