"""Each phase's data, built before the first step (training/setup.py): its sources opened, the
tokenizer chosen, its rows split into training and held-out, and its length; an RL or DPO run's one
phase (rl/phase.py, rl/dpo_phase.py) with the tokenizer of the model it trains."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from trimtab.config import DataConfig, OptimConfig, RunConfig
from trimtab.config.row_rules import MIN_OWN
from trimtab.data import BatchLoader, Rows, TextTokenizer, get_tokenizer
from trimtab.data.dataset import build_phase_data, first_prepared, open_eval_source, open_sources
from trimtab.data.held_out import HeldOut, flagged_rows, held_out, screened_out
from trimtab.data.packing import ConcatRows, unigram_entropy
from trimtab.data.prepared import ShardedRows
from trimtab.data.quality import Flagged
from trimtab.errors import ConfigError, DataError
from trimtab.paths import cache_dir
from trimtab.rl.dpo_phase import DPOPhase, build_dpo_phase
from trimtab.rl.phase import RLPhase, build_rl_phase
from trimtab.training.init_from import no_init_from, no_init_tokenizer
from trimtab.training.run_length import kept_whole, left_out_tokens, mixed_sources, resolve_max_steps
from trimtab.training.run_tokenizer import given_tokenizer
from trimtab.training.source_names import kept_names

log = logging.getLogger(__name__)
CONTEXT = 0.8  # the data rewards context where a bigram scores under this share of the unigram entropy
_RUN_TOK = "the run directory's tokenizer.json"  # what a resume without data.tokenizer tokenizes with


@dataclass(kw_only=True)
class Phase:
    """One stretch of training with its own data and schedule (pretrain, finetune)."""

    name: str
    start: int  # global step at which the phase begins
    steps: int
    data: DataConfig
    optim: OptimConfig
    train_rows: Rows | ConcatRows | ShardedRows
    eval_rows: HeldOut  # its micro-batches at the budget training runs at: training/evaluation.py held_out
    skipped_records: int
    weights: list[float]  # each source's share of a step's tokens (data.mix)
    names: list[str]
    # documents the garbage screen flagged and kept (data.garbage_filter=warn) and their training
    # rows, per source: the orchestrator reads them through RunView.garbage_rows
    flagged: list[Flagged] = field(default_factory=list)
    tokenizer: str = ""  # the rows' tokenizer's fingerprint: a resume over another one is named (data/batches.py)

    @cached_property
    def context_free_loss(self) -> float | None:
        """The training targets' unigram entropy, the loss of a model blind to context, where the
        data rewards context: a bigram scores under CONTEXT x it (text: 0.54-0.61; random digits
        0.91, where a sound model stays at that level); else None (data/packing.py unigram_entropy,
        read on the first ask)."""
        levels = unigram_entropy(self.train_rows) if self.train_rows is not None else None
        return levels[0] if levels is not None and levels[1] < CONTEXT * levels[0] else None

    def loader(self, cfg: RunConfig, pad_id: int, rank: int = 0, world: int = 1) -> BatchLoader:
        """The phase's loader; under data parallelism it serves this rank's share of each step."""
        return BatchLoader(
            self.train_rows,
            cfg.train.batch_tokens,
            cfg.train.micro_budget,
            seed=cfg.train.seed,
            pad_id=pad_id,
            rank=rank,
            world=world,
            weights=self.weights,
            names=self.names,
            section="finetune.data" if self.name == "finetune" else "data",
            tokenizer=(self.tokenizer, f"data.tokenizer ({cfg.data.tokenizer})" if cfg.data.tokenizer else _RUN_TOK),
        )


def _prepared_tokenizer(prepared: Path) -> TextTokenizer:
    """The tokenizer prepared shards were made with (prepare writes it beside them): missing, `trimtab data
    prepare` run again over the same files rebuilds it as it was (data/prepare.py checks its sha256)."""
    path, key = prepared / "tokenizer.json", f"the tokenizer of {prepared}"
    if not path.is_file():
        raise DataError(
            f"{key} ({path}) is missing: the shards' token ids mean nothing without it; run the same `trimtab data "
            "prepare` again over the same files (it rebuilds the tokenizer the shards were made with, or says why it "
            "cannot), or restore the file"
        )
    return TextTokenizer.load(path, key=key)


def build_phases(
    cfg: RunConfig,
    tok_source: Path | None,
    decided: dict[int, bool] | None = None,
    names: dict[int, list[str]] | None = None,
) -> tuple[TextTokenizer, list[Phase]]:
    """Open or read each phase's sources, get the tokenizer (the run's own one when resuming, else
    data.tokenizer, else a prepared source's, else a BPE trained on the documents), split.
    `decided`: a resumed checkpoint's garbage decisions (screened_decisions), which its held-out
    split follows whatever orchestrator.mode is now; `names`: its sources' names (saved_names), kept."""
    if cfg.rl.enabled or cfg.dpo.enabled:
        return _rl_phases(cfg, tok_source)
    specs = [("pretrain", cfg.data, cfg.optim, "data")]
    if cfg.finetune.steps:
        specs.append(("finetune", cfg.finetune.data, cfg.finetune.optim, "finetune.data"))
    tok = given_tokenizer(cfg, tok_source)
    if tok is None and (prepared := first_prepared([data for _, data, _, _ in specs])) is not None:
        tok = _prepared_tokenizer(prepared)
    chat = tok.chat if tok is not None else None  # a Hugging Face tokenizer formats chats its own way
    opened = [open_sources(data, key, chat) for _, data, _, key in specs]
    evals = [open_eval_source(data, key, chat) for _, data, _, key in specs]
    if tok is None:
        docs = [d for group in opened + [[e] for e in evals if e] for s in group for d in (s.docs or [])]
        tok = get_tokenizer(cfg.data, docs, cache_dir())
    phases, start = [], 0
    for (name, data, optim, key), sources, eval_source in zip(specs, opened, evals):
        built = build_phase_data(data, sources, tok, cfg.train.seed, cache_dir(), eval_source)
        built.names = kept_names(data, built.names, (names or {}).get(len(phases)), key)  # one series a source
        screened = (decided or {}).get(len(phases), screened_out(data, cfg))
        # the flagged documents' rows left out from the start are not trained on: not counted as repeated
        left = left_out_tokens(built.train, flagged_rows(built.train) if screened else frozenset())
        left = kept_whole(built, key, left)  # a source flagged whole is trained on all the same
        mixed = mixed_sources(built, key, left)
        trained = built.train.n_tokens - sum(left)
        steps = cfg.finetune.steps if name == "finetune" else resolve_max_steps(cfg, trained, tok, mixed)
        held = held_out(built, cfg.train.micro_budget, cfg.train.eval_tokens, tok.pad_id, cfg.train.seed, screened)
        _say_thin_reference(cfg, held, key)
        phases.append(
            Phase(
                name=name,
                start=start,
                steps=steps,
                data=data,
                optim=optim,
                train_rows=built.train,
                eval_rows=held,
                skipped_records=built.skipped_records,
                weights=built.weights,
                names=built.names,
                flagged=built.train.flagged_rows(),
                tokenizer=tok.fingerprint,
            )
        )
        start += steps
    return tok, phases


def _rl_phases(cfg: RunConfig, tok_source: Path | None) -> tuple[TextTokenizer, list[RLPhase | DPOPhase]]:
    """An RL or DPO run's one phase, with the tokenizer of the model it trains."""
    tok = given_tokenizer(cfg, tok_source)
    if tok is None and cfg.train.init_from and not Path(cfg.train.init_from).exists():  # said as `train` says it
        raise no_init_from(cfg.train.init_from)
    if tok is None and cfg.train.init_from:  # it was set: "set train.init_from" would send the user in a circle
        raise no_init_tokenizer(cfg.train.init_from)
    if tok is None:
        raise ConfigError(
            f"{'dpo' if cfg.dpo.enabled else 'rl'}: the tokenizer of the model to train is unknown; set "
            "train.init_from (a trimtab run or a Hugging Face model directory) or data.tokenizer"
        )
    return tok, [build_dpo_phase(cfg, tok) if cfg.dpo.enabled else build_rl_phase(cfg, tok)]


def _say_thin_reference(cfg: RunConfig, held: HeldOut, key: str) -> None:
    """Said once: a held-out split of fewer rows than orchestrator.data.reference_rows gives the data
    watch and the spike attribution a reference of only those (their median and spread: 9 rows of
    one file on the debug preset with train.seed=3, whose eval split is one document of 28). The
    sample (HeldOut.reference) cannot make that up; only more held-out data can."""
    # the rows the reference samples: a flagged document's, left out of training, are not (HeldOut.reference)
    rows = sum(len(r) - len(skip) for (r, _, _), skip in zip(held.sets, held.skips))
    want = cfg.orchestrator.data.reference_rows
    if cfg.orchestrator.mode != "off" and 0 < rows < want:
        # under MIN_OWN rows the data watch judges a step's rows among themselves (orchestrator/attribution.py)
        against = f"those {rows}" if rows >= MIN_OWN else "each step's own rows, a keener bar given more held-out rows"
        log.info(
            "%s: its held-out split holds %d row%s, under orchestrator.data.reference_rows=%d: the orchestrator "
            "judges training rows against %s; raise %s.eval_fraction or give %s.eval_source for a sounder "
            "reference",
            key,
            rows,
            "" if rows == 1 else "s",
            want,
            against,
            key,
            key,
        )
