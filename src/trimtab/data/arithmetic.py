"""The built-in arithmetic task: `A+B=` or `A-B=` with operands below 10^digits and the result
as the answer, generated from a seed, so a supervised warm start (`data.source:
builtin:arithmetic`) and RL on the same task (`rl.prompts: builtin:arithmetic`, rl/tasks.py) run
offline.

Problems are split into train and held-out by a hash of the prompt, so a held-out problem is
never trained on, by either, whatever the seed and size. As text for supervised training a
problem is `PROMPT ANSWER` (`12+34= 46`): the space keeps the prompt's tokens those of the prompt
alone under a byte-level BPE (its pre-tokenizer would fuse `=` with a minus sign), so RL's
prompts continue where the warm start's did; the answer's verifiers ignore whitespace.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SOURCE = "builtin:arithmetic"  # [:DIGITS]
DOCUMENTS = 50_000  # problems a supervised source renders at most (2 digits: every train one, ~18,000)


def _rank(prompt: str) -> float:
    """A prompt's place in [0, 1): a stable hash, not the draw's order."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64


def held_out(prompt: str, share: float = 0.1) -> bool:
    """Whether a problem of the built-in task is in its held-out split."""
    return _rank(prompt) < share


def split_held_out(items: list[T], n: int, prompt: Callable[[T], str], share: float = 0.1) -> tuple[list[T], list[T]]:
    """A file's items (RL prompts, DPO pairs) as (trained on, held out): the prompts that hash
    lowest are held out until they hold n items, at most `share` of the file (a small file keeps
    most of itself for training whatever n asks), every item of a held-out prompt with them, so no
    held-out prompt is ever trained on; the rest, in file order, are trained on (n = 0: all).
    Stable: a prompt's place depends on the prompt alone."""
    n = min(n, int(len(items) * share))
    held_prompts: set[str] = set()
    count, total = Counter(prompt(item) for item in items), 0
    for text in sorted(count, key=_rank):
        if total >= n:
            break
        held_prompts.add(text)
        total += count[text]
    held = [item for item in items if prompt(item) in held_prompts]
    return [item for item in items if prompt(item) not in held_prompts], held[:n]


def digits_of(spec: str) -> int | None:
    """DIGITS of `builtin:arithmetic[:DIGITS]` (2 when absent); None for another source; a
    ValueError for a malformed one."""
    if not spec.startswith(SOURCE):
        return None
    rest = spec[len(SOURCE) :]
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and int(rest[1:]) >= 1):
        raise ValueError(f"'{spec}': {SOURCE}[:DIGITS], e.g. {SOURCE}:2")
    return int(rest[1:]) if rest else 2


def problems(n: int, seed: int = 0, digits: int = 2, split: str = "train", share: float = 0.1) -> list[tuple[str, str]]:
    """`n` distinct (prompt, answer) pairs of the split (`train` or `held_out`), the same for the
    same arguments. Fewer if the split has fewer (digits=1: 200 problems in all)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split '{split}': train or held_out")
    rng, top = random.Random(seed), 10**digits
    if digits <= 2:  # every problem, shuffled: the split runs out instead of drawing forever
        every = [(a, op, b) for a in range(top) for op in "+-" for b in range(top)]
        rng.shuffle(every)
        draws = iter(every)
    else:
        draws = ((rng.randrange(top), rng.choice("+-"), rng.randrange(top)) for _ in itertools.count())
    found: dict[str, str] = {}
    for a, op, b in draws:
        if len(found) == n:
            break
        prompt = f"{a}{op}{b}="
        if held_out(prompt, share) == (split == "held_out"):
            found.setdefault(prompt, str(a + b if op == "+" else a - b))
    return list(found.items())


def text(prompt: str, answer: str) -> str:
    """A problem as supervised text (module docstring)."""
    return f"{prompt} {answer}"
