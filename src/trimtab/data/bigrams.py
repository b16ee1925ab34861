"""Word and word-pair counts of a reference corpus, and the statistics data/junk.py judges word order and
spelling by: adjacent words' pointwise mutual information against distant ones' (word salad; Church and
Hanks 1990) and the share of a document's long words that are the reference's letters rearranged
(scrambled words; Rawlinson 1976). Split out of junk.py, which decides the verdicts."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

# distant word pairs of a document (quality.information's stride) the rest of the reference holds, under which
# word order is not judged (measured against a 10 MB English and code sample: English prose and code >= 0.15,
# word salad of them >= 0.30; Spanish, Russian, Turkish pages 0.03-0.06, their word order scored 0.5-1.4 bits)
KNOWN_PAIRS = 0.2
PRIOR = 2.0  # the full rule's Dirichlet prior weight of P(next) in P(next | word) (`prior`)
GROUP_WORDS = 1 << 16  # words salad_bits_of_ids judges at once (junk.PIECE_WORDS: a document's pieces, 20K words)
SCRAMBLE_LETTERS = 4  # words of this many letters or more are judged scrambled (shorter ones are anagrams by chance)
SPELLING = 0.1  # a word under this share of its letters' spellings in the rest of the corpus is misspelt


@dataclass(frozen=True)
class Bigrams:
    """A reference corpus's word and adjacent-pair counts, which documents' word order is judged
    against; `members`: 64-bit hashes of its documents' texts (a member's own counts are left out
    when it is judged). Built once from `trimtab data prepare`'s sample and kept beside the manifest
    (BIGRAMS), so every batch of every job, and files added later, are judged against the same."""

    vocab: dict[str, int]
    words: np.ndarray  # int64 [V]: each word's count
    pairs: np.ndarray  # int64 [P], sorted: a * V + b for each adjacent pair (a, b) seen
    pair_counts: np.ndarray  # int64 [P]
    members: np.ndarray  # uint64 [D], sorted

    @property
    def total(self) -> int:
        return int(self.words.sum())

    @classmethod
    def of(cls, docs: Sequence[list[str]], texts: Sequence[str]) -> Bigrams:
        """The counts of `docs` (each a document's words), the texts they were read from."""
        vocab: dict[str, int] = {}
        return cls.of_ids(word_ids(docs, vocab), doc_lengths(docs), vocab, texts)

    @classmethod
    def of_ids(cls, ids: np.ndarray, lengths: np.ndarray, vocab: dict[str, int], texts: Sequence[str]) -> Bigrams:
        """The same from the documents' words as `vocab`'s ids, back to back (`lengths` each)."""
        doc = np.repeat(np.arange(len(lengths)), lengths)
        same = doc[:-1] == doc[1:]
        pairs, counts = np.unique((ids[:-1] * len(vocab) + ids[1:])[same], return_counts=True)
        words = np.bincount(ids, minlength=len(vocab)).astype(np.int64)
        return cls(vocab, words, pairs, counts.astype(np.int64), np.unique(text_hashes(texts)))

    def save(self, fh: BinaryIO) -> None:
        np.savez(fh, vocab=np.array(list(self.vocab), dtype=str), words=self.words, pairs=self.pairs,
                 pair_counts=self.pair_counts, members=self.members)  # fmt: skip

    @functools.cached_property
    def followers(self) -> np.ndarray:
        """int64 [V]: how many distinct words the reference holds after each word (its pairs' first words)."""
        return np.bincount(self.pairs // max(len(self.vocab), 1), minlength=len(self.vocab)).astype(np.int64)

    @functools.cached_property
    def anagrams(self) -> dict[str, int]:
        """{a word's letters in order (`_letters`): how often the reference holds words of those letters},
        for words of SCRAMBLE_LETTERS or more; computed once per reference (a prepare job judges many batches)."""
        counts: dict[str, int] = {}
        for word, n in zip(self.vocab, self.words.tolist()):  # vocab's ids are 0, 1, ... in order
            if len(word) >= SCRAMBLE_LETTERS:
                key = _letters(word)
                counts[key] = counts.get(key, 0) + n
        return counts

    @classmethod
    def load(cls, path: Path) -> Bigrams:
        with np.load(path) as z:
            vocab = {str(w): i for i, w in enumerate(z["vocab"])}
            return cls(vocab, z["words"], z["pairs"], z["pair_counts"], z["members"])


def text_hashes(texts: Sequence[str]) -> np.ndarray:
    """uint64 [D]: each text's first 8 bytes of blake2b: which documents are the reference's own."""
    return np.array([int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little") for t in texts],
                    dtype=np.uint64)  # fmt: skip


def word_ids(docs: Sequence[list[str]], vocab: dict[str, int], grow: bool = True) -> np.ndarray:
    """int64: the documents' words back to back as `vocab`'s ids; a word it lacks gets the next id
    (added to it when `grow`, else len(vocab) for all of them)."""
    flat = list(itertools.chain.from_iterable(docs))
    if grow:
        for w in dict.fromkeys(flat):  # distinct words in order: a Python step per word, not per occurrence
            vocab.setdefault(w, len(vocab))
        return np.fromiter(map(vocab.__getitem__, flat), dtype=np.int64, count=len(flat))
    return np.fromiter(map(vocab.get, flat, itertools.repeat(len(vocab))), dtype=np.int64, count=len(flat))


def doc_lengths(docs: Sequence[list[str]]) -> np.ndarray:
    return np.array([len(ws) for ws in docs], dtype=np.int64)


def salad_bits(
    docs: Sequence[list[str]], reference: Bigrams, member: np.ndarray, apart: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(bits [D], pairs [D]): how much better `reference` (less the document's own counts where it
    is a `member`, bool [D]) predicts each document's words from the word before than from a word
    far away in it (a golden-ratio stride, as in quality.information): the mean pointwise mutual
    information of its adjacent words less that of distant ones, so what a domain's vocabulary
    does to both cancels (zero in expectation for words in random order); and how many adjacent
    pairs were scored (both words seen elsewhere in the reference; none where the reference holds under
    KNOWN_PAIRS of its distant pairs: a language or domain it holds little of, whose real pairs it
    has seen as seldom as random ones). `apart`: bool [N], the words back to back `spaced` from the one
    before (default: all), of which only those adjacent pairs are scored. A corpus of 6 MB: about a second."""
    # words the reference lacks: counted 0, their pairs not scored
    return salad_bits_of_ids(word_ids(docs, reference.vocab, grow=False), doc_lengths(docs), reference, member, apart)


def salad_bits_of_ids(ids: np.ndarray, lengths: np.ndarray, reference: Bigrams, member: np.ndarray,
                apart: np.ndarray | None = None, known: float = KNOWN_PAIRS, followers: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`salad_bits` of the words as `reference`'s ids; `followers`: smoothed by their distinct followers (`prior`).
    Judged in groups of documents of about GROUP_WORDS words (`_groups`), each alone: a document's statistic is its
    own words' only, so the same; all at once, a 5 MB document's 850K words held ~150 bytes a word (124 MB)."""
    parts = []
    for a, b, lo, hi in _groups(lengths):
        ids_, member_, apart_ = ids[lo:hi], np.asarray(member, dtype=bool)[a:b], None if apart is None else apart[lo:hi]
        parts.append(_salad_bits(ids_, lengths[a:b], reference, member_, apart_, known, followers))
    if not parts:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    return np.concatenate([bits for bits, _ in parts]), np.concatenate([n for _, n in parts])


def _groups(lengths: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(first, end) documents and their (first, end) words of consecutive groups of GROUP_WORDS words or fewer (a
    larger document a group of its own)."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    out, a = [], 0
    while a < len(lengths):
        b = max(a + 1, int(np.searchsorted(ends, ends[a] + GROUP_WORDS, side="right")) - 1)
        out.append((a, b, int(ends[a]), int(ends[b])))
        a = b
    return out


def _salad_bits(ids: np.ndarray, lengths: np.ndarray, reference: Bigrams, member: np.ndarray,
                apart: np.ndarray | None, known: float, followers: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    doc = np.repeat(np.arange(len(lengths)), lengths)
    start = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    local = np.arange(len(ids)) - start[doc]
    step = np.array([_stride(int(n)) for n in lengths], dtype=np.int64)
    far = start[doc] + local * step[doc] % np.maximum(lengths[doc], 1) if len(ids) else ids
    counts = _Counts(reference, ids, doc, np.asarray(member, dtype=bool))
    near_bits, near_n, _ = _mean_pmi(counts, ids, counts.own_word, doc, len(lengths), followers, apart)
    far_bits, _, far_seen = _mean_pmi(counts, ids[far], counts.own_word[far], doc, len(lengths), followers)
    return near_bits - far_bits, np.where(far_seen >= known, near_n, 0)


def _stride(n: int) -> int:
    """The golden-ratio stride coprime with n: it visits each of n positions once."""
    return next(s for s in range(int(0.618 * n) + 1, 2 * n + 2) if math.gcd(s, n) == 1)


class _Counts:
    """The reference's word and pair counts (words as its ids; one more id for words it lacks) and
    the judged documents' own, those of members only (what is left out of the reference for each)."""

    def __init__(self, ref: Bigrams, ids: np.ndarray, doc: np.ndarray, member: np.ndarray) -> None:
        self.size, self.ref = len(ref.vocab) + 1, ref
        self.total = ref.total
        self.words = np.concatenate([ref.words, [0]])
        own = member[doc] if len(doc) else np.zeros(0, dtype=bool)
        self.own_word = np.where(own, _own_counts(doc, ids), 0)  # [N]: each position's word's count in its document
        ids, doc = ids[own], doc[own]
        same = doc[:-1] == doc[1:]
        pairs = (ids[:-1] * self.size + ids[1:])[same]
        self.own_pairs, self.own_pair_counts = np.unique(doc[:-1][same] * self.size**2 + pairs, return_counts=True)
        self.doc_words = np.bincount(doc, minlength=len(member))

    @functools.cached_property
    def followers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(each word's distinct followers in the reference [V + 1], and keyed by document and first word, how many of
        them only a member holds (its own count of the pair is all of the reference's): what the rest lacks)."""
        own_first = self.own_pairs % self.size**2 // self.size
        only = self.own_pair_counts == self.pair(own_first, self.own_pairs % self.size)
        keys, counts = np.unique((self.own_pairs // self.size**2 * self.size + own_first)[only], return_counts=True)
        return np.concatenate([self.ref.followers, [0]]), keys, counts

    def pair(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The reference's count of each pair (a, b) (its keys are a * V + b, V its vocabulary)."""
        known = (a < self.size - 1) & (b < self.size - 1)
        return np.where(known, _lookup(self.ref.pairs, self.ref.pair_counts, a * (self.size - 1) + b), 0)


def _mean_pmi(
    c: _Counts, ids: np.ndarray, own: np.ndarray, doc: np.ndarray, n_docs: int, followers: bool = False,
    apart: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Per document, (bits, scored, seen): the mean log2 P(next | word) / P(next) of the pairs of adjacent `ids` (one
    document's positions in order, `doc` of each; `own`: each one's count in its document where a
    member, else 0), counted on the reference less that document; P(next | word) smoothed towards P(next) with the
    weight `prior` (of `followers`). Pairs whose words the rest of the reference lacks are not scored, nor those whose
    second word is not `apart` (bool [N]) from the first; `seen`: the share of all its pairs it holds."""
    same = doc[:-1] == doc[1:]
    d, a, b = doc[:-1][same], ids[:-1][same], ids[1:][same]
    first, nxt = c.words[a] - own[:-1][same], c.words[b] - own[1:][same]
    pair = c.pair(a, b) - _lookup(c.own_pairs, c.own_pair_counts, d * c.size**2 + a * c.size + b)
    rest = np.maximum(c.total - c.doc_words[d], 1)
    valid = (first > 0) & (nxt > 0) & (True if apart is None else apart[1:][same])
    p_next = np.where(valid, nxt, 1) / rest
    weight = prior(c, a, d, followers)
    p_cond = (pair + weight * p_next) / (np.maximum(first, 0) + weight)
    bits = np.where(valid, np.log2(np.maximum(p_cond, 1e-300) / p_next), 0.0)
    scored = np.bincount(d, weights=valid, minlength=n_docs)
    pairs = np.maximum(np.bincount(d, minlength=n_docs), 1)
    seen = np.bincount(d, weights=valid & (pair > 0), minlength=n_docs) / pairs
    return np.bincount(d, weights=bits, minlength=n_docs) / np.maximum(scored, 1), scored.astype(np.int64), seen


def prior(c: _Counts, a: np.ndarray, d: np.ndarray, followers: bool) -> np.ndarray | float:
    """The weight of P(next) in each pair's P(next | word) (first words `a`, of documents `d`): PRIOR (MacKay and Peto
    1995), or with `followers` (the small-source rule's, junk.SMALL_WORDS) how many distinct words the rest of the
    reference holds after the word, how often it was followed by a word not seen after it before (Witten and Bell
    1991). PRIOR gives a pair unseen after a frequent word the word's whole count as evidence against it ("the
    collections" after 3,816 "the"s: -10.9 bits; -2.2 by its followers), though a small reference has not seen most of
    a language's pairs: a stdlib docstring (unittest.TestResult's) scored 0.68 bits beside 62K words of docstrings,
    under the small-source bar of 0.7 then (junk.SMALL_BITS), 0.90 by its followers. Against 100K words or more
    (the full rule) they named 19 -> 17 of 20,018 held-out real pieces and no more salad: PRIOR kept there
    (bench/junk_bars.md, docs/data.md)."""
    if not followers:
        return PRIOR
    held, own_keys, own_counts = c.followers
    return np.maximum(held[a] - _lookup(own_keys, own_counts, d * c.size + a), 1)


def scrambled(
    docs: Sequence[list[str]], ids: np.ndarray, reference: Bigrams, member: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(share [D], long [D]): of each document's words of SCRAMBLE_LETTERS or more (`long` of them),
    the share misspelt: under SPELLING of the rest of `reference`'s (less a `member`'s own counts)
    words of the same letters. Words spelt backwards ("nruter") or with their letters shuffled
    (Rawlinson 1976's "Cmabrigde") are, however often the junk repeats them, as the corpus spells
    their letters right far more often; a real document's rare words and a language the reference
    lacks are seldom (their letters spell no other word: nothing to be misspelt against)."""
    lengths = doc_lengths(docs)
    flat = list(itertools.chain.from_iterable(docs))
    doc = np.repeat(np.arange(len(docs)), lengths)
    key: dict[str, int] = {}  # each distinct long word's letters in order, numbered in this batch
    number = {w: key.setdefault(_letters(w), len(key)) for w in dict.fromkeys(flat) if len(w) >= SCRAMBLE_LETTERS}
    letters = np.fromiter(map(number.get, flat, itertools.repeat(len(key))), dtype=np.int64, count=len(flat))
    del flat
    held = np.fromiter((reference.anagrams.get(k, 0) for k in key), dtype=np.int64, count=len(key))
    own = np.asarray(member, dtype=bool)[doc] if len(doc) else np.zeros(0, dtype=bool)
    words, held = np.concatenate([reference.words, [0]]), np.concatenate([held, [0]])
    own_words, own_letters = _OwnCounts(doc, ids), _OwnCounts(doc, letters)
    n_long, n_found = np.zeros(len(docs)), np.zeros(len(docs))
    for lo in range(0, len(doc), GROUP_WORDS):  # a window of words at a time: the sums are of 0s and 1s, exact
        at = slice(lo, lo + GROUP_WORDS)
        d, mine = doc[at], own[at]
        word_elsewhere = words[ids[at]] - np.where(mine, own_words.of(d, ids[at]), 0)
        letters_elsewhere = held[letters[at]] - np.where(mine, own_letters.of(d, letters[at]), 0)
        long = letters[at] < len(key)
        n_long += np.bincount(d, weights=long, minlength=len(docs))
        n_found += np.bincount(d, weights=long & (word_elsewhere < SPELLING * letters_elsewhere), minlength=len(docs))
    return n_found / np.maximum(n_long, 1), n_long.astype(np.int64)


class _OwnCounts:
    """How often each (document, id) occurs among `doc`, `ids` (`_own_counts`'s), looked up a window at a time."""

    def __init__(self, doc: np.ndarray, ids: np.ndarray) -> None:
        self.size = int(ids.max()) + 1 if len(ids) else 1
        keys = doc * self.size + ids
        span = (int(doc[-1]) + 1) * self.size if len(doc) else 0  # doc ascends
        if span <= 4 * len(keys):  # a few long documents (one file): counted without np.unique's sorted copies
            counts = np.bincount(keys, minlength=span)
            self.keys = np.flatnonzero(counts)
            self.counts = counts[self.keys]
        else:
            self.keys, self.counts = np.unique(keys, return_counts=True)

    def of(self, doc: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return _lookup(self.keys, self.counts, doc * self.size + ids)


def _letters(word: str) -> str:
    return "".join(sorted(word))


def _own_counts(doc: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[N]: how often each position's id occurs in its document."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    _, at, counts = np.unique(doc * (int(ids.max()) + 1) + ids, return_inverse=True, return_counts=True)
    return counts[at]


def _lookup(keys: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The counts of `wanted` in sorted `keys` (0 where absent)."""
    if not len(keys):
        return np.zeros(len(wanted), dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return np.where(keys[at] == wanted, counts[at], 0)
