"""A source whose word salad is spread over many small documents that outweigh its real ones: its own reference is
then mostly salad, against whose random pairs real pages' word order looked random too (the full rule named 22 of
50 licence paragraphs beside 800 salad documents of licence words, in training and `data prepare` alike). Judged by
the small-source rule then (junk._mostly_salad), whose second witness is each document's own word order."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from test_quality import clean_documents
from trimtab.data import junk

pytestmark = pytest.mark.usefixtures("one_thread")
REAL = Path(__file__).with_name("data") / "real_pieces.jsonl"  # licences, man pages, docs: real English


def source(n_salad: int) -> tuple[list[str], np.ndarray]:
    """Real documents (trimtab's source and real English pieces) and `n_salad` documents of 150-300 of their words
    drawn at random, shuffled together; bool [D]: which are salad."""
    rng = random.Random(0)
    real = clean_documents() + [json.loads(line)["text"] for line in REAL.read_text().splitlines()]
    vocab = [w for text in real for w in text.split()]
    salad = [" ".join(rng.choice(vocab) for _ in range(rng.randint(150, 300))) for _ in range(n_salad)]
    texts = [(t, False) for t in real] + [(t, True) for t in salad]
    rng.shuffle(texts)
    return [t for t, _ in texts], np.array([s for _, s in texts])


def test_real_documents_beside_more_word_salad_are_not_named_with_it():
    texts, salad = source(500)  # ~110K words of salad beside ~35K real ones
    named = np.array([v is not None and v.kind == "word salad" for v in junk.kinds(texts)])
    assert named[salad].mean() > 0.6  # the salad still mostly named (0.69; the full rule's 0.91, with real pages:)
    assert named[~salad].sum() <= 3, np.flatnonzero(named & ~salad)  # 1; before: 21 of the 134 real pages named


def test_a_source_mostly_real_is_judged_by_the_full_rule_as_before():
    texts, salad = source(40)
    verdicts = junk.kinds(texts)
    assert not junk._mostly_salad(texts, verdicts, None)
    named = np.array([v is not None and v.kind == "word salad" for v in verdicts])
    assert named[salad].mean() > 0.75 and not named[~salad].any()  # 0.82, as before
