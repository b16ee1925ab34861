"""Prompts with verifiable answers: a JSONL file of {"prompt": ..., "answer": ...} (any format
data/formats.py reads), or the built-in arithmetic task, generated from a seed, so the whole
path (a supervised warm start, then RL) runs offline.

The built-in task: `A+B=` or `A-B=` with operands below 10^digits; the answer is the result's
digits. Problems are split into train and held-out by a hash of the problem, so the held-out ones
are never trained on whatever the seed and size.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from pathlib import Path

from trimtab.data.formats import parse_json, records
from trimtab.errors import DataError


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    where: str = ""  # FILE:LINE for a problem read from a file


def held_out(prompt: str, share: float = 0.1) -> bool:
    """Whether a problem is in the held-out split (a stable hash, not the draw's order)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def arithmetic(n: int, seed: int = 0, digits: int = 2, split: str = "train", share: float = 0.1) -> list[Problem]:
    """`n` distinct problems of the split (`train` or `held_out`), the same for the same
    arguments. Fewer if the split has fewer (digits=1: 200 problems in all)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split '{split}': train or held_out")
    rng, top = random.Random(seed), 10**digits
    if digits <= 2:  # every problem, shuffled: the split runs out instead of drawing forever
        every = [(a, op, b) for a in range(top) for op in "+-" for b in range(top)]
        rng.shuffle(every)
        draws = iter(every)
    else:
        draws = ((rng.randrange(top), rng.choice("+-"), rng.randrange(top)) for _ in itertools.count())
    problems: dict[str, Problem] = {}
    for a, op, b in draws:
        if len(problems) == n:
            break
        prompt = f"{a}{op}{b}="
        if held_out(prompt, share) == (split == "held_out"):
            problems.setdefault(prompt, Problem(prompt, str(a + b if op == "+" else a - b)))
    return list(problems.values())


def read_problems(path: Path) -> list[Problem]:
    """Every problem of a prompt file; a DataError naming the file and line of a bad one."""
    out = []
    for record in records(Path(path), fmt="jsonl"):
        value = parse_json(record)
        if not isinstance(value, dict) or not isinstance(value.get("prompt"), str) or "answer" not in value:
            raise DataError(
                f'{record.where}: a prompt record needs "prompt" (text) and "answer", e.g. '
                '{"prompt": "2+3=", "answer": "5"}'
            )
        out.append(Problem(value["prompt"], str(value["answer"]), record.where))
    if not out:
        raise DataError(f"{path}: no prompts in it")
    return out
