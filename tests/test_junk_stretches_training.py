"""A one-document source that is mostly text with word salad inside, through training's in-memory screen
(data/packing.py, data/stretches.py): judged salad whole, it was its only document, so the run was refused
("every one of its 1 documents is flagged as junk"), its prose with it. Judged as prepare judges a long file now
(flagged whole only when its junk stretches hold half its characters): its stretches are named, trained on with
warn and left out with drop, the rest of the document trained on."""

import logging
import random
import re

import numpy as np
import pytest

from test_junk import grammar_prose, salad_of
from trimtab.config import DataConfig
from trimtab.data.packing import build_splits
from trimtab.data.sources import Document


@pytest.fixture(scope="module")
def book() -> tuple[str, int, int]:
    return salad_book()


def salad_book() -> tuple[str, int, int]:
    """802K characters of prose, 43% of them word salad in the middle; the salad's characters."""
    rng = random.Random(0)
    paragraphs = [grammar_prose(rng, 2_000) for _ in range(400)]
    head, salad, tail = paragraphs[:112], paragraphs[112:288], paragraphs[288:]
    start = len("\n\n".join(head)) + 2
    middle = "\n\n".join(salad_of(p, rng) for p in salad)
    return "\n\n".join(head) + "\n\n" + middle + "\n\n" + "\n\n".join(tail), start, start + len(middle)


def screened(text: str, tokenizer, caplog, garbage_filter: str) -> tuple[int, list[str]]:
    """The training rows' trainable tokens of `text` as the one document of a source, and the stretches line."""
    cfg = DataConfig(seq_len=64, eval_fraction=0.0, garbage_filter=garbage_filter)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        train, _ = build_splits(
            cfg, tokenizer, [Document([(text, True)], source="book.txt")], None, seed=0, screen=True
        )
    said = [r.getMessage() for r in caplog.records if "stretches of junk" in r.getMessage()]
    return len(train), said


def named(said: str) -> list[tuple[int, int]]:
    return [
        (int(a.replace(",", "")), int(b.replace(",", ""))) for a, b in re.findall(r"characters ([\d,]+)-([\d,]+)", said)
    ]


def test_a_document_mostly_text_is_not_refused_whole_but_its_salad_named(book, tokenizer, caplog):
    text, start, end = book
    rows, said = screened(text, tokenizer, caplog, "warn")
    assert len(said) == 1 and "kept, and trained on" in said[0], said
    assert "data.garbage_filter=drop leaves them out" in said[0]
    stretches = named(said[0])
    assert stretches and all(start - 100_000 < a and b < end + 100_000 for a, b in stretches), (said, start, end)
    assert sum(b - a for a, b in stretches) < len(text) / 2
    kept, dropped = screened(text, tokenizer, caplog, "drop")
    assert "left out (data.garbage_filter=drop)" in dropped[0] and named(dropped[0]) == stretches
    # the named stretches' share of the rows left out, the rest trained on (token counts: within 15% of it)
    share = sum(b - a for a, b in stretches) / len(text)
    assert np.isclose(1 - kept / rows, share, atol=0.15 * share), (kept, rows, share)
