"""DPO's data: preference pairs (a prompt, a chosen and a rejected response), read from a JSONL
file of {"prompt", "chosen", "rejected"} (any format data/formats.py reads) or derived from the
built-in arithmetic task (chosen: the right answer, rejected: a wrong one, from a seed), so the
whole path (a supervised warm start, then DPO) runs offline; and their tokens.

A pair's texts become tokens as the model will see them: with a Hugging Face tokenizer's chat
template, the prompt as a user turn and each response as the assistant's reply (the template's
end-of-turn tokens part of the response); without one, the prompt as RL's prompts are
(rl/tasks.py) and each response followed by the end-of-text token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from trimtab.data.arithmetic import problems
from trimtab.data.chat import TemplateError, render_document
from trimtab.data.sources import Document
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError
from trimtab.rl.tasks import json_lines

KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str
    where: str = ""  # FILE:LINE for a pair read from a file


@dataclass(frozen=True)
class Tokens:
    """A pair as token ids: the prompt's, and each response's after it."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def width(self) -> int:
        """Input positions of the longer of its two sequences (prompt + response - 1)."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected)) - 1

    @property
    def positions(self) -> int:
        """Input positions of its two sequences, padding excluded."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected) - 2


def read_pairs(path: Path) -> list[Pair]:
    """Every pair of a file; a DataError naming the file and line of a bad one."""
    out = []
    for record, value in json_lines(path):
        if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in KEYS):
            missing = [k for k in KEYS if not isinstance(value, dict) or not isinstance(value.get(k), str)]
            raise DataError(
                f"{record.where}: a preference pair needs {', '.join(repr(k) for k in missing)} (text), e.g. "
                '{"prompt": "2+3=", "chosen": " 5", "rejected": " 6"}'
            )
        if value["chosen"] == value["rejected"]:
            raise DataError(f"{record.where}: its chosen and rejected responses are the same text; fix or drop it")
        if not value["prompt"].strip():  # no context to prefer one response in
            raise DataError(f'{record.where}: an empty "prompt"; give the text the responses follow, or drop it')
        out.append(Pair(value["prompt"], value["chosen"], value["rejected"], record.where))
    if not out:
        raise DataError(f"{path}: no preference pairs in it")
    return out


def arithmetic_pairs(n: int, seed: int = 0, digits: int = 2, split: str = "train") -> list[Pair]:
    """`n` pairs of the built-in task's split (data/arithmetic.py): the problem's text as the warm
    start saw it (`12+34= 46`) chosen, the answer off by 1 to 9 either way rejected."""
    rng = random.Random(seed * 7919 + 1)
    out = []
    for prompt, answer in problems(n, seed, digits, split):
        wrong = int(answer) + rng.choice([-1, 1]) * rng.randint(1, 9)
        out.append(Pair(prompt, f" {answer}", f" {wrong}"))
    return out


def tokenize(pair: Pair, tok: TextTokenizer) -> Tokens:
    """A pair's tokens (see the module docstring). Its texts are a person's, read as training
    reads a document's (TextTokenizer.encode_text): special-token text in them is text, so a
    response quoting the end-of-text token does not end there; only a chat template's own
    special tokens are special (encode_documents, with the markup render_document found)."""
    chat = tok.chat
    if chat is None or chat.template is None:
        response = lambda text: tok.encode_text(text) + [tok.eos_id]  # noqa: E731
        return Tokens(tok.encode_text(pair.prompt, specials=True), response(pair.chosen), response(pair.rejected))
    turns = [[("user", pair.prompt), ("assistant", reply)] for reply in (pair.chosen, pair.rejected)]
    try:
        rendered = [render_document(chat, t) for t in turns]
    except TemplateError as exc:
        raise DataError(f"{pair.where or 'a preference pair'}: {exc}") from None
    docs = [Document(segments, markup=markup) for segments, markup in rendered]
    # each: the prompt (not trainable), the reply with its end-of-turn (trainable), what follows
    first = [next(i for i, (_, trainable) in enumerate(doc.segments) if trainable) for doc in docs]
    ids = tok.encode_documents(docs)
    prompt = [t for segment in ids[0][: first[0]] for t in segment]
    chosen, rejected = (segments[i] for segments, i in zip(ids, first))
    return Tokens(prompt, chosen, rejected)
