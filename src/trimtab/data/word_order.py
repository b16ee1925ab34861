"""Whether a document's words are in an order of their own, judged by the document alone: word salad's second
witness in a source too small for its reference's word pairs alone to say (data/junk.py SMALL_WORDS).

A document's adjacent word pairs that it repeats ("the model", "provides-extra: x" lines) are as many as its
whitespace-separated words in random order give only by chance: a permutation test (Good 2005, "Permutation,
Parametric and Bootstrap Tests of Hypotheses") of the repeats against SHUFFLES shuffles of its words. It is too
weak alone (measured: 2.6% of 464 1.5 KB pieces of licences and docs/*.md not above their shuffles, junk.py), so
it only spares: a document the reference would name is not named when its own repeats say it is in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SHUFFLES = 20  # a document above (or under) all of them is in order at p < 1/21 each side
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def ordered(tokens: Sequence[list[str]], apart: np.ndarray, which: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """bool [len(which)]: whether each document `which` (of `tokens`, each document's words; `apart`: bool, each word
    parted from the one before by whitespace, junk.spaced, back to back) repeats more adjacent pairs across whitespace
    than every one of SHUFFLES shuffles of its whitespace-separated words, or fewer (alternating lines, "key: value",
    keep a pair from ever repeating that shuffles repeat). Shuffles are seeded by `seeds` (uint64, the texts'
    hashes), so a document's answer does not depend on the batch it is judged in."""
    starts = np.cumsum([0] + [len(ws) for ws in tokens])
    apart = np.concatenate([apart[starts[i] : starts[i + 1]] for i in which] + [apart[:0]])
    lengths = np.array([len(tokens[i]) for i in which], dtype=np.int64)
    flat = np.array([w for i in which for w in tokens[i]], dtype=str)
    ids = np.unique(flat, return_inverse=True)[1].reshape(-1).astype(np.int64)  # words as ids of their own
    n_docs = len(lengths)
    doc = np.repeat(np.arange(n_docs), lengths)
    size = int(ids.max()) + 1 if len(ids) else 1
    own = _repeats(ids, doc, apart, size, n_docs)
    token = (np.cumsum(apart) - 1).astype(np.uint64)  # each word's whitespace-separated token
    above, under = np.ones(n_docs, dtype=bool), np.ones(n_docs, dtype=bool)
    for k in range(SHUFFLES):
        key = _mix(seeds[doc] ^ _mix(token * _GOLDEN + np.uint64(k + 1)))
        order = np.lexsort((np.arange(len(ids)), key, doc))  # tokens shuffled within each document, kept whole
        shuffled = _repeats(ids[order], doc, apart[order], size, n_docs)
        above &= own > shuffled
        under &= own < shuffled
    return above | under


def _repeats(ids: np.ndarray, doc: np.ndarray, apart: np.ndarray, size: int, n_docs: int) -> np.ndarray:
    """[D]: each document's adjacent pairs across whitespace less its distinct ones (how often pairs recur)."""
    same = (doc[:-1] == doc[1:]) & apart[1:]
    keys = (doc[:-1][same] * size + ids[:-1][same]) * size + ids[1:][same]
    distinct, counts = np.unique(keys, return_counts=True)
    return np.bincount(distinct // (size * size), weights=counts - 1, minlength=n_docs)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea and Flood 2014), elementwise on uint64: a hash as good as a random draw."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
