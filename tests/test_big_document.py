"""One large document (a log, a book dump: one .txt file) read by a run (data.max_bytes=0): tokenized and screened
for junk in memory a small multiple of its size. A 50 MB document took 3.2 GB, 2.8 GB over the run's start (the junk
screen's int64 arrays and np.unique copies a character or a word each, its words as Python strings each, the
document's tokens as Python ints), now 1.06 GB; docs/data.md, "Memory"."""

from __future__ import annotations

import importlib
import logging
import random
import subprocess
import sys
import tracemalloc
import unicodedata
from pathlib import Path

import pytest

from trimtab.config import DataConfig
from trimtab.data import junk, packing, quality, repeats
from trimtab.data.sources import Document

pytestmark = pytest.mark.usefixtures("one_thread")


def _bench_module():
    """bench/bigdoc.py, whose make_text writes the documents measured (its neighbours imported from bench/)."""
    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module("bigdoc")
    finally:
        sys.path.remove(bench)


_prose = _bench_module().make_text  # English of a few standard modules' docstrings, words swapped (seeded)


def _peak(fn, *args) -> int:
    """Python's (and numpy's) peak allocation over fn(*args), bytes."""
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_long_document_is_tokenized_and_screened_in_a_small_multiple_of_its_size(tokenizer, caplog):
    """1 MB of prose as one document through the split a run makes of it (tokenized, screened for garbage and junk,
    held out, cut into rows): Python's allocations peaked at 54 bytes a character, now 18 (2 MB: 53 -> 15; the
    fixture's BPE of code takes a token a character)."""
    text = _prose(1_000_000)
    docs = [Document([(text, True)], "big.txt")]
    with caplog.at_level(logging.ERROR):
        peak = _peak(packing.build_splits, DataConfig(seq_len=64), tokenizer, docs, None, 0, None, "data.source", True)
    assert peak < 30 * len(text), f"{peak / len(text):.1f} bytes a character"


@pytest.mark.parametrize(
    "fn, bound",  # bytes a character: before, whole, 36, 20, 11 and 4.2; now 3.7, 5.3, 2.9 and 1.3
    [(junk.letter_structure, 8), (repeats.repeated_share, 10), (junk.words, 6), (junk.spaced, 3)],
)
def test_the_screens_whole_document_statistics_are_read_in_windows(fn, bound, monkeypatch):
    """The junk screen's statistics of one long text, read a window at a time (quality.windows): a few bytes a
    character, and the same values as the text read whole (one window)."""
    text = _prose(1_500_000, seed=1)
    assert _peak(fn, text) < bound * len(text)
    windowed = fn(text)
    monkeypatch.setattr(quality, "WINDOW", 10 * len(text))
    whole = fn(text)
    assert (windowed == whole).all() if hasattr(whole, "all") else windowed == whole


def test_symbols_read_in_windows_are_the_whole_texts(monkeypatch):
    """A long text is cut before whitespace: each piece's NFD and symbols are the whole text's, combining marks and
    characters past the Basic Multilingual Plane (uint32 symbols there) included."""
    rng = random.Random(2)
    alphabet = ["a", "e", "\u0301", "\u00e9", "\u0928\u093f", "\U0001f600", "7", ".", " ", "\n", "\u2001", "Z"]
    text = "".join(rng.choice(alphabet) for _ in range(3 * quality.WINDOW))
    pieces = quality.windows(text)
    assert len(pieces) >= 3 and "".join(pieces) == text and all(p[0].isspace() for p in pieces[1:])
    windowed, info = quality.symbols_of(text), quality.information(quality.symbols_of(text))
    monkeypatch.setattr(quality, "WINDOW", 10 * len(text))
    assert windowed.tolist() == quality.symbols_of(text).tolist()
    assert info == quality.information(quality.symbols_of(text))


def test_a_text_that_decomposes_into_several_symbols_a_character_is_read_whole():
    """Hangul syllables decompose (NFD) into 2-3 jamo each: the symbols outgrow the text's length at once (a
    228-character piece of the garbage corpus gave 936: the array grown by too little failed to broadcast)."""
    text = "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 " * 40 + "\u0130stanbul " * 5  # Korean words, a dotted capital I
    symbols = quality.symbols_of(text)
    decomposed = unicodedata.normalize("NFD", text)
    expected = [ord(c) for ch in decomposed for c in (quality._symbol(ch) or "")]
    assert len(symbols) > 1.5 * len(text) and symbols.tolist() == expected


@pytest.mark.slow  # two fresh processes on a 1 MB file: ~20 s
def test_the_benchmark_dry_run_measures_both_paths():
    bench = Path(__file__).resolve().parent.parent / "bench" / "bigdoc.py"
    run = subprocess.run([sys.executable, str(bench), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| 1 MB | in memory (a run) |" in run.stdout and "| 1 MB | data prepare |" in run.stdout
