"""Word salad in a source under junk.CORPUS_WORDS words: judged by the small-source rule (junk.SMALL_WORDS), where it
passed unjudged before; a real document is named only when its reference's pairs, its distant pairs' coverage and
its own repeated pairs (data/word_order.py) all agree."""

import json
import logging
import random
import re
from pathlib import Path

import numpy as np

from test_quality import phase
from trimtab.config import DataConfig
from trimtab.data import junk, word_order

# 1.5 KB pieces of docs/*.md in a shuffled order, frozen on 2026-12-02 (10K words): the docs' edits no longer move
# the counts below
PIECES = Path(__file__).resolve().parent / "data" / "real_pieces.jsonl"


def pieces(words: int) -> list[str]:
    """The frozen pieces (PIECES) in order, holding `words` words or just more."""
    found = [json.loads(line)["text"] for line in PIECES.read_text().splitlines()]
    out: list[str] = []
    while sum(len(junk.words(text)) for text in out) < words:
        out.append(found[len(out)])
    return out


def salad(texts: list[str], rng: random.Random, n: int) -> list[str]:
    """Documents of 230 of the source's own whitespace-separated words, drawn at random as often as it uses them."""
    tokens = [token for text in texts for token in text.split()]
    return [" ".join(rng.choice(tokens) for _ in range(230)) for _ in range(n)]


def test_word_salad_in_a_10k_word_source_is_named_and_its_real_pages_are_not():
    """A 10K-word source (docs/*.md) with 12 documents of salad: before, none named (under CORPUS_WORDS the word
    order was not judged); now most are, against the small-source bar, and no real piece is."""
    real = pieces(10_000)
    bad = salad(real, random.Random(1), 12)
    verdicts = junk.kinds(real + bad)
    assert not [v for v in verdicts[: len(real)] if v is not None and v.kind == "word salad"]
    named = [v for v in verdicts[len(real) :] if v is not None and v.kind == "word salad"]
    assert len(named) >= 9 and all(v.bar == junk.SMALL_BITS for v in named)


def test_a_source_under_small_words_is_not_judged():
    real = pieces(3_000)
    verdicts = junk.kinds(real + salad(real, random.Random(2), 4))
    assert not [v for v in verdicts if v is not None and v.kind == "word salad"]


def ordered(texts: list[str]) -> list[bool]:
    tokens = [junk.words(text) for text in texts]
    apart = np.concatenate([junk.spaced(text) for text in texts])
    return word_order.ordered(tokens, apart, np.arange(len(texts)), junk.text_hashes(texts)).tolist()


def test_own_word_order_sees_repeated_pairs_and_lines_that_never_repeat_one():
    """Prose repeating its phrases is in order (more repeats than its shuffles), so are "key: value" lines whose
    pairs never repeat while their shuffles' do ("extra provides"); its words drawn at random are not."""
    rng = random.Random(3)
    prose = " ".join(["the model is trained on the data and the data is read by the model"] * 8)
    lines = "".join(f"Provides-Extra: name{i}\n" for i in range(60))
    drawn = salad([prose], rng, 1)[0]
    assert ordered([prose, lines, drawn]) == [True, True, False]
    assert ordered([drawn]) == [False] and ordered([lines, prose]) == [True, True]  # the same alone: seeded by text


def test_a_run_says_once_that_a_small_source_s_word_order_was_not_judged(tmp_path, caplog):
    """A run's screen (packing._screen) skipped a source under junk.SMALL_WORDS words silently; it now says so once,
    and a source of 10K words is judged, its salad named, the line not said."""
    for name, words in (("small", 3_000), ("mid", 10_000)):
        real = pieces(words)
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in real + salad(real, random.Random(4), 3)))
        cfg = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            phase(cfg)
        said = [r.getMessage() for r in caplog.records if "was not judged" in r.getMessage()]
        # the salad lines named (most of them: the rate moves with docs/*.md's text), never a real piece's
        named = {int(n) for n in re.findall(rf"{name}\.jsonl:(\d+) \(word salad", caplog.text)}
        assert len(said) == (name == "small"), caplog.text
        assert bool(named and named <= {len(real) + 1, len(real) + 2, len(real) + 3}) == (name == "mid"), caplog.text


def test_one_long_line_of_salad_that_is_most_of_its_source_is_named_and_the_real_pages_are_not():
    """A line of 45K words drawn from a 10K-word source's own (400K words of GPL-3's in one line, in a soak) was
    most of the source's reference: left out of it to be judged, the rest held too few of its distant pairs to judge
    it (not named), and its pairs, noise, named 3 real pages. Its pieces are judged against each other first
    (junk.alone), and the rest against a reference without it."""
    real = pieces(10_000)
    tokens = [token for text in real for token in text.split()]
    rng = random.Random(5)
    line = " ".join(rng.choice(tokens) for _ in range(45_000))
    verdicts = junk.kinds(real + [line])
    assert verdicts[-1] is not None and verdicts[-1].kind == "word salad"
    assert [str(v) for v in verdicts[:-1] if v] == []
    assert list(junk.alone(real + [line])) == [len(real)]  # prepare's reference leaves it out the same way
