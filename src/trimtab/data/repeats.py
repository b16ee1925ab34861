"""Repeated text (`repeated_share`): a line or passage written over and over (log spam, a navigation menu on every
page, a generator stuck in a loop). Its tokens and characters are the corpus's own, so the packing screen and the
other junk tests pass it, yet training on it teaches the model to repeat (Lee et al. 2022, "Deduplicating Training
Data Makes Language Models Better"). Gopher's repetition filters (Rae et al. 2021, "Scaling Language Models", A.1.1)
measure the share of a document's characters in duplicated word n-grams; here the share of its characters in the
longest stretch of whitespace-separated words that each continue a run of REPEAT_WORDS words met earlier in it (its
first copy not counted). One stretch, not all of them: a Debian copyright file repeats its licence once per
holder, with their names between (all duplicated runs: up to 0.84 of such a file, as much as a loop), while a loop
repeats back to back. A line repeated: ~1; a passage repeated k times: 1 - 1/k; a file that is 20% text then a
loop: ~0.8. Judged per document by junk.kinds."""

from __future__ import annotations

import numpy as np

from trimtab.data import quality

# words in a run that counts as a repeat (Gopher's longest duplicate n-gram, 10: shorter runs recur in real text, a
# licence's "WITHOUT ANY WARRANTY; without even the implied warranty" or code's "self.assertEqual(")
REPEAT_WORDS = 10
# share of a document's characters in one stretch repeating its earlier text from which it is repeated text (passages
# repeated 5-50x: 0.8-0.98; a line repeated: ~1; 20% text then a loop: ~0.8). Real files of 256 bytes or more, none
# over it: 23,300 of /usr/share/common-licenses, /usr/lib/python3.11, man1 pages and /usr/share/doc, worst 0.41
# (a copyright file); 22,694 .py files of a virtualenv's site-packages, worst 0.38.
REPEATED = 0.5
MIN_WORDS = 4 * REPEAT_WORDS  # fewer words: too few runs to say
# a row's most common tokens counted as "a handful" (row_repeat_share): a run of one character, a table of zeros
# and commas, base64's "=" padding are one to four tokens repeated
HANDFUL = 4
_MIX = np.uint64(0x9E3779B97F4A7C15)  # the golden ratio's 64 bits: a multiplicative hash's multiplier (Knuth)


def repeated_share(text: str) -> float:
    """The share of `text`'s non-space characters in its longest stretch of words that each continue a run of
    REPEAT_WORDS words which occurred earlier in it (the first occurrence not counted); 0.0 for under MIN_WORDS.
    Its words are read a window at a time (quality.windows) into uint32 ids and lengths: whole, a 5 MB document's
    words as strings, their int64 hashes and np.unique's copies held 20 bytes a character (100 MB); now 5."""
    ids, lengths = _ids(text)
    if len(ids) < MIN_WORDS:
        return 0.0
    starts = _repeat_starts(ids)
    del ids
    if not len(starts):
        return 0.0
    repeated = np.zeros(len(lengths), dtype=bool)  # each repeated run's REPEAT_WORDS words
    for k in range(REPEAT_WORDS):
        repeated[starts + k] = True
    return _longest_run(lengths, repeated) / float(lengths.sum())


def _longest_run(lengths: np.ndarray, repeated: np.ndarray) -> float:
    """The characters of the longest stretch of consecutive `repeated` words."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], repeated.astype(np.int8), [0]])))
    if not len(edges):
        return 0.0
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return float((ends[edges[1::2]] - ends[edges[::2]]).max())


def _ids(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint32 ids, int32 lengths) of `text`'s whitespace-separated words, each numbered by its first occurrence."""
    number: dict[str, int] = {}
    ids, lengths = [], []
    for piece in quality.windows(text):
        words = piece.split()
        ids.append(np.fromiter((number.setdefault(w, len(number)) for w in words), dtype=np.uint32, count=len(words)))
        lengths.append(np.fromiter(map(len, words), dtype=np.int32, count=len(words)))
    return np.concatenate(ids), np.concatenate(lengths)


def _repeat_starts(ids: np.ndarray) -> np.ndarray:
    """The positions whose run of REPEAT_WORDS words occurred at an earlier position (polynomial hashes modulo 2**64,
    compared whole: equal hashes of different runs are ~2**-64 apart): after a stable sort of the hashes, each but
    the first (the earliest) of a group of equal ones."""
    n = len(ids) - REPEAT_WORDS + 1
    key = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping around 2**64 is the hash
        for k in range(REPEAT_WORDS):
            key *= _MIX
            key += ids[k : k + n]
            key += np.uint64(1)
    order = np.argsort(key, kind="stable")
    key = key[order]
    return np.sort(order[1:][key[1:] == key[:-1]])


def row_repeat_share(targets: np.ndarray) -> float:
    """The share of a row's target tokens that are its HANDFUL most common ones; 0.0 for under 4 x HANDFUL targets
    (too few to say: any 4 of 8 are half). The data watch (orchestrator/attribution.py) keeps a row of REPEATED or
    more as a repeat, not poison: a long run of one character in clean text (debug, seed 1: a test_quopri.py row,
    37 of its 64 targets one "zzzz" token, 0.64 in its four commonest) scores high until the model has learnt the
    run. Random tokens over V are nearly all distinct: 64 of V = 512 put ~0.1 of a row in its four commonest."""
    if len(targets) < 4 * HANDFUL:
        return 0.0
    counts = np.unique(targets, return_counts=True)[1]
    return float(np.sort(counts)[-HANDFUL:].sum()) / len(targets)
