"""Prompts with verifiable answers: a JSONL file of {"prompt": ..., "answer": ...} (any format
data/formats.py reads), or the built-in arithmetic task, generated from a seed, so the whole
path (a supervised warm start, then RL) runs offline.

The built-in task and its train / held-out split are data/arithmetic.py's, shared with the
supervised warm start on the same task (`data.source: builtin:arithmetic`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trimtab.data.arithmetic import problems
from trimtab.data.formats import Record, parse_json, records
from trimtab.errors import DataError

TRAIN_PROBLEMS = 100_000  # the built-in task's training problems at most (two digits: ~18,000 in all)
LONGEST = 64  # prompts encoded to find the longest: the longest in characters (all a task of a few digits has)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    where: str = ""  # FILE:LINE for a problem read from a file


def arithmetic(n: int, seed: int = 0, digits: int = 2, split: str = "train", share: float = 0.1) -> list[Problem]:
    """`n` distinct problems of the built-in task's split (`train` or `held_out`; data/arithmetic.py)."""
    return [Problem(prompt, answer) for prompt, answer in problems(n, seed, digits, split, share)]


def builtin(digits: int, seed: int, n_held: int) -> tuple[list[Problem], list[Problem]]:
    """The built-in task at `digits` (its difficulty: rl.prompts builtin:arithmetic:DIGITS, or a curriculum
    step of rule rl_signal's, rl/curriculum.py): its training problems and `n_held` held-out ones."""
    return arithmetic(TRAIN_PROBLEMS, seed, digits), arithmetic(n_held, seed, digits, split="held_out")


def longest_tokens(tok: Any, problems: list[Problem]) -> int:
    """The most tokens among the LONGEST prompts of `problems` longest in characters (`tok` a TextTokenizer): a
    floor under the longest of them all, each being one of them, from 64 encodes instead of one each (a tokenizer's
    merges make a prompt's tokens no function of its characters: one of fewer may have more)."""
    longest = sorted(problems, key=lambda p: len(p.prompt))[-LONGEST:]
    return max(len(tok.encode(p.prompt, specials=True)) for p in longest)


def json_lines(path: Path) -> Iterator[tuple[Record, Any]]:
    """Each line of a JSONL file (any format data/formats.py reads) with its value; a DataError
    naming the file and line of one that is not JSON."""
    for record in records(Path(path), fmt="jsonl"):
        try:
            yield record, parse_json(record)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{record.where}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}); fix the line"
            ) from None


def read_problems(path: Path) -> list[Problem]:
    """Every problem of a prompt file; a DataError naming the file and line of a bad one."""
    out = []
    for record, value in json_lines(path):
        answer = value.get("answer") if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("prompt"), str) or answer is None:
            raise DataError(
                f'{record.where}: a prompt record needs "prompt" (text) and "answer", e.g. '
                '{"prompt": "2+3=", "answer": "5"}'
            )
        if not value["prompt"].strip():  # nothing to condition on: generation had no token to start from
            raise DataError(f'{record.where}: an empty "prompt"; give the text the response follows, or drop it')
        out.append(Problem(value["prompt"], _answer_text(answer, record.where), record.where))
    if not out:
        raise DataError(f"{path}: no prompts in it")
    return out


def _answer_text(answer: Any, where: str) -> str:
    """The answer as the verifiers take it: text, a number as written (5 -> "5"), a list or an
    object as JSON (for a python:MOD:FN verifier to parse; str() gave Python's repr). An empty
    one is refused: `exact` scored an empty response right, and a true/false one (a flag, not an
    answer to compare with) too."""
    if isinstance(answer, bool) or (isinstance(answer, str) and not answer.strip()):
        raise DataError(
            f'{where}: "answer" is {json.dumps(answer)}: give the text a right response ends with (e.g. "5"), '
            "or drop the line"
        )
    if isinstance(answer, float) and not math.isfinite(answer):  # JSON's NaN: a missing value (pandas writes one)
        raise DataError(
            f'{where}: "answer" is {json.dumps(answer)}, not an answer (a missing value?): give the text a right '
            "response ends with, or drop the line"
        )
    if isinstance(answer, (dict, list)):
        return json.dumps(answer, ensure_ascii=False)
    return str(answer)
