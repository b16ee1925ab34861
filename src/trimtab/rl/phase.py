"""An RL run's one phase (rl.enabled, `trimtab rl`): its prompts, split into the ones trained on
and the held-out ones, and its loader (rl/batches.py). training/setup.py builds it in place of
the pretraining and finetuning phases; the loop takes it as it takes them."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab.config import DataConfig, OptimConfig, RunConfig
from trimtab.data.arithmetic import SOURCE, digits_of, split_held_out
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import ConfigError
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.rewards import verifier
from trimtab.rl.tasks import Problem, arithmetic, builtin, longest_tokens, read_problems

log = logging.getLogger(__name__)
SAMPLE = 2048  # the built-in task's prompts a refusal measures a difficulty by (_too_many_digits)


@dataclass
class RLPhase:
    name: str
    start: int
    steps: int
    data: DataConfig  # seq_len: the longest prompt + response (the OOM handler's smallest micro-batch)
    optim: OptimConfig
    problems: list[Problem]
    held_out: list[Problem]
    tok: TextTokenizer
    max_prompt_tokens: int
    skipped_records: int = 0
    weights: list[float] = field(default_factory=lambda: [1.0])
    names: list[str] = field(default_factory=lambda: ["rl"])
    train_rows: Any = None  # no token rows: the prompts are the data

    def loader(self, cfg: RunConfig, pad_id: int, rank: int = 0, world: int = 1) -> RolloutLoader:
        del pad_id  # padding is the tokenizer's
        train = cfg.train
        ours = RolloutLoader(
            self.problems,
            self.tok,
            cfg.rl,
            train.micro_batch_tokens,  # 0 (auto): the whole step (RolloutLoader)
            train.seed,
            self.max_prompt_tokens,
            self.held_out,
            rank,
            world,
        )
        ours.on_difficulty = lambda: self.fit(ours)
        return ours

    def fit(self, loader: RolloutLoader) -> None:
        """data.seq_len, a row's longest (the OOM handler's smallest micro-batch, training/control.py), widened to
        `loader`'s prompts at its difficulty: a raise's (rl/curriculum.py), and a resume's at a raised one (it was
        the configured difficulty's again, under one row of the longer prompts)."""
        longest = loader.max_prompt_tokens + loader.cfg.max_new_tokens
        self.data = dataclasses.replace(self.data, seq_len=max(self.data.seq_len, longest))


def problems_of(cfg: RunConfig) -> tuple[list[Problem], list[Problem]]:
    """rl.prompts split into the problems trained on and rl.held_out held-out ones (a file's by
    split_held_out: a held-out prompt never reaches training; the built-in task's by its hash split)."""
    spec, seed, n_held = cfg.rl.prompts, cfg.train.seed, cfg.rl.held_out
    try:
        digits = digits_of(spec)
    except ValueError as exc:
        raise ConfigError(f"rl.prompts {exc}") from None
    if digits is not None:
        return builtin(digits, seed, n_held)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"rl.prompts '{spec}' is no file; a JSONL of prompts and answers, or {SOURCE}")
    train, held = split_held_out(read_problems(path), n_held, lambda p: p.prompt)
    if not train:
        raise ConfigError(
            f"rl.prompts '{spec}': every prompt fell in the held-out split (one prompt holds nearly every "
            "line); add other prompts"
        )
    if n_held and not held:  # it evaluated nothing, and rule rl_hacking watched nothing, without a word
        log.warning(
            f"rl.held_out={n_held}: rl.prompts '{spec}' has {len(train)} line(s) and at most a tenth of a file is "
            "held out, so none is: the run has no held-out evaluation (rl/held_out_*, rule rl_hacking); give it "
            "10 or more lines, or set rl.held_out=0"
        )
    elif len(held) < n_held:  # the cap took some, unsaid (dpo.pairs said it): rule rl_hacking judges over fewer
        log.warning(
            f"rl.held_out={n_held}: rl.prompts '{spec}' holds out {len(held)} of its {len(train) + len(held)} "
            "prompts (at most a tenth of a file is held out, so that most of it trains): rl/held_out_* and rule "
            "rl_hacking are over those; a larger file holds out more"
        )
    return train, held


def build_rl_phase(cfg: RunConfig, tok: TextTokenizer) -> RLPhase:
    if cfg.train.max_steps == "auto" or cfg.train.epochs > 0:
        raise ConfigError("rl: set train.max_steps to the RL steps to take (auto and train.epochs are pretraining's)")
    verifier(cfg.rl.reward)  # a verifier that is not there is told now, not at the first step's scoring
    if cfg.rl.held_out_reward:
        verifier(cfg.rl.held_out_reward, "rl.held_out_reward")
    _refuse_too_many_digits(cfg, tok)
    train, held = problems_of(cfg)
    longest = _longest(tok, train + held)
    if longest + cfg.rl.max_new_tokens > cfg.model.max_seq_len:
        raise ConfigError(_too_long(cfg, tok, train + held, longest))
    data = dataclasses.replace(cfg.data, seq_len=longest + cfg.rl.max_new_tokens)
    return RLPhase("rl", 0, int(cfg.train.max_steps), data, cfg.optim, train, held, tok, longest)


def _longest(tok: TextTokenizer, problems: list[Problem]) -> int:
    return max(len(tok.encode(p.prompt, specials=True)) for p in problems)


def _too_long(cfg: RunConfig, tok: TextTokenizer, problems: list[Problem], longest: int) -> str:
    """Why the longest prompt and its response do not fit, naming the prompt's file and line (a
    file's): a prompt that fills model.max_seq_len alone leaves lowering rl.max_new_tokens no use."""
    digits = digits_of(cfg.rl.prompts)
    if digits:  # the built-in task's prompts are its difficulty's: fewer digits, not a shorter response
        return _too_many_digits(cfg, tok, digits, longest)
    where = next(p.where for p in problems if len(tok.encode(p.prompt, specials=True)) == longest)
    at = f" ({where})" if where else ""
    if longest >= cfg.model.max_seq_len:
        return (
            f"rl.prompts: a prompt of {longest} tokens{at} fills model.max_seq_len={cfg.model.max_seq_len} "
            "alone, with no room for a response; shorten the prompt or drop it"
        )
    return (
        f"rl.max_new_tokens={cfg.rl.max_new_tokens} after a prompt of {longest} tokens{at} exceeds "
        f"model.max_seq_len={cfg.model.max_seq_len}; lower rl.max_new_tokens to at most "
        f"{cfg.model.max_seq_len - longest} or shorten the prompts"
    )


def _refuse_too_many_digits(cfg: RunConfig, tok: TextTokenizer) -> None:
    """The built-in task refused on a sample's longest prompts, before the whole task is drawn and measured
    (100,000 prompts encoded, and 2,048 a difficulty of the search: 208,000 encodes, 15-25 s at
    builtin:arithmetic:99 on 2 cores, ~70 s on a loaded host; now 6 s, mostly _too_many_digits' sure fit). A sample
    that fits leaves the word to the whole task's measure."""
    try:
        digits = digits_of(cfg.rl.prompts)
    except ValueError:
        return  # problems_of names the key
    if digits is None:
        return
    longest = longest_tokens(tok, arithmetic(SAMPLE, cfg.train.seed, digits))
    if longest + cfg.rl.max_new_tokens > cfg.model.max_seq_len:
        raise ConfigError(_too_many_digits(cfg, tok, digits, longest))


def _too_many_digits(cfg: RunConfig, tok: TextTokenizer, digits: int, longest: int) -> str:
    """The built-in task's refusal: it named rl.max_new_tokens (at 99 digits, "at most 1"), a response too short to
    answer, where the digits are what to lower; it names the most that fit (a search over the difficulties, each by
    the longest of a sample of its prompts: a tokenizer's merges make a prompt's tokens no function of its digits)."""
    room, low, high = cfg.model.max_seq_len - cfg.rl.max_new_tokens, 0, digits - 1
    while low < high:  # the most digits in [0, digits - 1] whose sampled prompts fit: longer operands, longer prompts
        mid = (low + high + 1) // 2
        if longest_tokens(tok, arithmetic(SAMPLE, cfg.train.seed, mid)) <= room:
            low = mid
        else:
            high = mid - 1
    while low and _longest(tok, sum(builtin(low, cfg.train.seed, cfg.rl.held_out), [])) > room:
        low -= 1  # the sample's longest under the whole task's, as build_rl_phase measures it: the first sure fit
    fix = (
        f"set rl.prompts={SOURCE}:{low} (the most digits that fit) or raise model.max_seq_len"
        if low
        else "not even 1 digit fits: lower rl.max_new_tokens or raise model.max_seq_len"
    )
    return (
        f"rl.prompts {cfg.rl.prompts}: the built-in task at {digits} digits has prompts of {longest} tokens, with "
        f"rl.max_new_tokens={cfg.rl.max_new_tokens} over model.max_seq_len={cfg.model.max_seq_len}; {fix}"
    )
