"""A DPO run's one phase (dpo.enabled, `trimtab dpo`): its preference pairs, split into the ones
trained on and the held-out ones, and its loader (rl/preference.py). training/setup.py builds it
in place of the pretraining and finetuning phases; the loop takes it as it takes them."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab.config import DataConfig, OptimConfig, RunConfig
from trimtab.data.arithmetic import SOURCE, digits_of, problems, split_held_out
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import ConfigError, DataError
from trimtab.rl.pairs import Pair, Tokens, arithmetic_pairs, read_pairs, tokenize
from trimtab.rl.preference import PairLoader

log = logging.getLogger(__name__)

TRAIN_PAIRS = 100_000  # the built-in task's training pairs at most (two digits: ~18,000 in all)


@dataclass
class DPOPhase:
    name: str
    start: int
    steps: int
    data: DataConfig  # seq_len: the longest pair's sequence (the OOM handler's smallest micro-batch)
    optim: OptimConfig
    pairs: list[Tokens]
    held_out: list[Tokens]
    # the built-in task's held-out problems (prompt tokens, answer), answered greedily at evaluations
    problems: list[tuple[list[int], str]]
    tok: TextTokenizer
    skipped_records: int = 0
    weights: list[float] = field(default_factory=lambda: [1.0])
    names: list[str] = field(default_factory=lambda: ["dpo"])
    train_rows: Any = None  # no token rows: the pairs are the data

    def loader(self, cfg: RunConfig, pad_id: int, rank: int = 0, world: int = 1) -> PairLoader:
        train = cfg.train
        return PairLoader(
            self.pairs,
            self.held_out,
            cfg.dpo,
            train.micro_batch_tokens,
            train.seed,
            pad_id,
            self.problems,
            self.tok,
            rank,
            world,
        )


def pairs_of(cfg: RunConfig) -> tuple[list[Pair], list[Pair], list[tuple[str, str]]]:
    """dpo.pairs split into the pairs trained on and dpo.held_out held-out ones (split_held_out:
    every pair of a held-out prompt is kept from training), and the built-in task's
    held-out problems (prompt, answer)."""
    spec, seed, n_held = cfg.dpo.pairs, cfg.train.seed, cfg.dpo.held_out
    try:
        digits = digits_of(spec)
    except ValueError as exc:
        raise ConfigError(f"dpo.pairs {exc}") from None
    if digits is not None:
        held = arithmetic_pairs(n_held, seed, digits, split="held_out")
        return arithmetic_pairs(TRAIN_PAIRS, seed, digits), held, problems(n_held, seed, digits, "held_out")
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"dpo.pairs '{spec}' is no file; a JSONL of prompts, chosen and rejected responses, or {SOURCE}"
        )
    train, held = split_held_out(read_pairs(path), n_held, lambda p: p.prompt)
    if not train:
        raise ConfigError(
            f"dpo.pairs '{spec}': every prompt fell in the held-out split (one prompt holds nearly every "
            "pair); add pairs with other prompts"
        )
    if n_held and not held:  # it evaluated nothing (dpo/held_out_*) without a word: as rl.prompts (rl/phase.py)
        log.warning(
            f"dpo.held_out={n_held}: dpo.pairs '{spec}' has {len(train)} pair(s) and at most a tenth of a file is "
            "held out, so none is: the run has no held-out evaluation (dpo/held_out_* figures); give it 10 or more "
            "pairs with distinct prompts, or set dpo.held_out=0"
        )
    elif len(held) < n_held:  # the cap took some: the figures are over fewer pairs than asked, which went unsaid
        log.warning(
            f"dpo.held_out={n_held}: dpo.pairs '{spec}' holds out {len(held)} of its {len(train) + len(held)} "
            "pairs (at most a tenth of a file is held out, so that most of it trains): the dpo/held_out_* figures "
            "are over those; a larger file holds out more"
        )
    return train, held, []


def build_dpo_phase(cfg: RunConfig, tok: TextTokenizer) -> DPOPhase:
    if cfg.train.max_steps == "auto" or cfg.train.epochs > 0:
        raise ConfigError("dpo: set train.max_steps to the DPO steps to take (auto and train.epochs are pretraining's)")
    train, held, answers = pairs_of(cfg)
    tokens = [[tokenize(p, tok) for p in group] for group in (train, held)]
    longest = max((t.width + 1, p.where) for group, toks in zip((train, held), tokens) for p, t in zip(group, toks))
    if longest[0] > cfg.model.max_seq_len:
        raise DataError(
            f"{longest[1] or 'a built-in pair'}: a pair of {longest[0]} tokens (prompt + response) exceeds "
            f"model.max_seq_len={cfg.model.max_seq_len}; shorten it or drop it"
        )
    data = dataclasses.replace(cfg.data, seq_len=longest[0])
    # the built-in task's held-out problems are its held-out pairs' (the same draw): their prompts
    # as the pairs put them (a chat template's turn); a file's pairs have no problems
    prompts = [(t.prompt, a) for t, (_, a) in zip(tokens[1], answers, strict=True)] if answers else []
    return DPOPhase("dpo", 0, int(cfg.train.max_steps), data, cfg.optim, *tokens, prompts, tok)
