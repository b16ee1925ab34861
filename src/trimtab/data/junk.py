"""Junk that packs like text: what the packing screen (quality.py) cannot see, judged on every document.

A tokenizer trained on a corpus packs three kinds of junk as well as the corpus's text, so bytes per
token do not give them away (measured at 4,096 tokens: never flagged):

- mis-encoded pages (`mojibake`): UTF-8 read as cp1252 or Latin-1 and written back ("Ã©tÃ©" for
  "été"). Told by ftfy's test (Speer, "ftfy: fixes text for you"): the characters' cp1252/Latin-1
  bytes decode as UTF-8 again, for many of the page's non-ASCII characters.
- random letters at a language's letter frequencies (`random_letters`): letters drawn independently
  share no information with their neighbours and do not alternate vowels and consonants
  (quality.latin_language's structure, Shannon 1951 and Sukhotin 1962).
- word salad (`word_salad`): real words in random order. A language's next word is predictable from
  the one before (a bigram model's perplexity is far under a unigram model's; Shannon 1951), so
  the corpus's own bigram counts (the document's own left out) give its adjacent words positive
  pointwise mutual information on average; words in random order have none (Church and Hanks
  1990, "Word Association Norms, Mutual Information, and Lexicography").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from trimtab.data import quality

MIN_CHARS = quality.MIN_BYTES  # shorter documents are not judged: too few words or pairs to say
MOJIBAKE_RUNS = 4  # mis-encoded characters a page needs to be judged mis-encoded
MOJIBAKE_SHARE = 0.5  # of its non-ASCII characters in them (mis-encoded pages: ~1)
LETTERS = 0.9  # random letters are judged in documents at least this share letters (of non-space characters)
CORPUS_WORDS = 400_000  # words a corpus (or a prepare batch) needs for word salad to be judged: the rest of it is
# the reference (measured: 0.03% of real documents flagged against 20 MB, 0.2-0.7% against 4 MB batches, 2-5% 1 MB)
MIN_PAIRS = 40  # adjacent word pairs, both words seen elsewhere in the corpus, a document needs to be judged
SALAD_BITS = 1.5  # adjacent words' mean pointwise mutual information, less distant ones', under this: word salad
PROSE = 0.8  # share of a document's non-space characters in words for word salad to be judged (code: ~0.6)
PRIOR = 2.0  # Dirichlet prior weight of the next word's unigram probability (smooths the bigram estimate)
_WORD = re.compile(r"[^\W\d_]+")


def mojibake(text: str) -> bool:
    """Whether `text` is a page read in the wrong encoding: at least MOJIBAKE_RUNS runs of characters
    whose cp1252/Latin-1 bytes are one UTF-8 character ("Ã©" for "é", "â€™" for "’"), holding at
    least MOJIBAKE_SHARE of its non-ASCII characters (ftfy's test, without its dependency)."""
    runs = [run for run in _MOJIBAKE_RUN.findall(text) if _round_trips(run)]
    foreign = len(text) - len(text.encode("ascii", errors="ignore"))
    return len(runs) >= MOJIBAKE_RUNS and sum(map(len, runs)) >= MOJIBAKE_SHARE * foreign


def _round_trips(run: str) -> bool:
    for encoding in ("cp1252", "latin-1"):
        try:
            run.encode(encoding).decode("utf-8")
            return True
        except UnicodeError:
            continue
    return False


def _run_pattern() -> re.Pattern[str]:
    """A UTF-8 lead byte and its continuation bytes, each as cp1252 or Latin-1 reads it."""
    more = f"[{re.escape(quality._bytes_as_text(0x80, 0xBF))}]"
    leads = ((0xC2, 0xDF, 1), (0xE0, 0xEF, 2), (0xF0, 0xF4, 3))
    return re.compile("|".join(f"[{re.escape(quality._bytes_as_text(lo, hi))}]{more}{{{n}}}" for lo, hi, n in leads))


_MOJIBAKE_RUN = _run_pattern()


def random_letters(text: str) -> bool:
    """Whether `text`, mostly letters in words, shows no more structure between neighbouring letters
    than letters drawn independently (quality.STRUCTURE)."""
    symbols = quality._symbols(text)
    space = symbols == quality.SPACE
    letter = ~space & (symbols != quality.DIGIT) & (symbols != quality.OTHER)
    if int(letter.sum()) < LETTERS * max(len(symbols) - int(space.sum()), 1) or space.sum() < quality.SPACES * len(
        symbols
    ):
        return False
    vowel = quality._IS_VOWEL[np.minimum(symbols, len(quality._IS_VOWEL) - 1)]
    return quality._information(symbols) + 2 * quality._alternation(letter, vowel) < quality.STRUCTURE


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def salad_bits(docs: Sequence[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """(bits [D], pairs [D]): how much better the rest of the corpus predicts each document's words
    from the word before than from a word far away in it (a golden-ratio stride, as in
    quality._information): the mean pointwise mutual information of its adjacent words less that of
    distant ones, so what a domain's vocabulary does to both cancels (zero in expectation for words in
    random order); and how many adjacent pairs were scored (both words seen elsewhere in the corpus).
    All documents at once: a corpus of 6 MB takes about a second."""
    vocab: dict[str, int] = {}
    ids = np.array([vocab.setdefault(w, len(vocab)) for ws in docs for w in ws], dtype=np.int64)
    lengths = np.array([len(ws) for ws in docs], dtype=np.int64)
    doc = np.repeat(np.arange(len(docs)), lengths)
    start = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    local = np.arange(len(ids)) - start[doc]
    step = np.array([_stride(int(n)) for n in lengths], dtype=np.int64)
    far = ids[start[doc] + local * step[doc] % np.maximum(lengths[doc], 1)] if len(ids) else ids
    counts = _Counts(ids, doc, max(len(vocab), 1))
    near_bits, near_n = _mean_pmi(counts, ids, doc, len(docs))
    far_bits, _ = _mean_pmi(counts, far, doc, len(docs))
    return near_bits - far_bits, near_n


def _stride(n: int) -> int:
    """The golden-ratio stride coprime with n: it visits each of n positions once."""
    return next(s for s in range(int(0.618 * n) + 1, 2 * n + 2) if math.gcd(s, n) == 1)


class _Counts:
    """Word and adjacent-pair counts of the corpus and of each document (words as ids)."""

    def __init__(self, ids: np.ndarray, doc: np.ndarray, size: int) -> None:
        self.size, self.n_docs = size, int(doc.max()) + 1 if len(doc) else 0
        self.total = len(ids)
        self.words = np.bincount(ids, minlength=size)
        same = doc[:-1] == doc[1:]
        pairs = (ids[:-1] * size + ids[1:])[same]
        self.pairs, self.pair_counts = np.unique(pairs, return_counts=True)
        self.own_words, self.own_word_counts = np.unique(doc * size + ids, return_counts=True)
        self.own_pairs, self.own_pair_counts = np.unique(doc[:-1][same] * size * size + pairs, return_counts=True)
        self.doc_words = np.bincount(doc, minlength=self.n_docs)


def _mean_pmi(c: _Counts, ids: np.ndarray, doc: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document, the mean log2 P(next | word) / P(next) of the pairs of adjacent `ids` (one
    document's positions in order, `doc` of each), counted on the corpus less that document;
    P(next | word) smoothed towards P(next) with PRIOR (MacKay and Peto 1995). Pairs whose words the
    rest of the corpus lacks are not scored."""
    same = doc[:-1] == doc[1:]
    d, a, b = doc[:-1][same], ids[:-1][same], ids[1:][same]
    first = c.words[a] - _lookup(c.own_words, c.own_word_counts, d * c.size + a)
    nxt = c.words[b] - _lookup(c.own_words, c.own_word_counts, d * c.size + b)
    pair = _lookup(c.pairs, c.pair_counts, a * c.size + b)
    pair = pair - _lookup(c.own_pairs, c.own_pair_counts, d * c.size * c.size + a * c.size + b)
    rest = np.maximum(c.total - c.doc_words[d], 1)
    valid = (first > 0) & (nxt > 0)
    p_next = np.where(valid, nxt, 1) / rest
    p_cond = (pair + PRIOR * p_next) / (np.maximum(first, 0) + PRIOR)
    bits = np.where(valid, np.log2(np.maximum(p_cond, 1e-300) / p_next), 0.0)
    scored = np.bincount(d, weights=valid, minlength=n_docs)
    return np.bincount(d, weights=bits, minlength=n_docs) / np.maximum(scored, 1), scored.astype(np.int64)


def _lookup(keys: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The counts of `wanted` in sorted `keys` (0 where absent)."""
    if not len(keys):
        return np.zeros(len(wanted), dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return np.where(keys[at] == wanted, counts[at], 0)


def prose(text: str, ws: list[str]) -> bool:
    """Whether words are at least PROSE of `text`'s non-space characters: word salad is judged in
    prose only (code's tables and byte literals are not words in order, nor junk of this kind)."""
    return sum(map(len, ws)) >= PROSE * len("".join(text.split()))


def kinds(texts: Sequence[str]) -> list[str]:
    """Each document's junk kind ("mojibake", "random letters", "word salad") or "" for none; the
    corpus's bigrams are the documents' own (word salad is judged in a corpus of CORPUS_WORDS only).
    Documents under MIN_CHARS characters are not judged."""
    tokens = [words(t) for t in texts]
    bits, scored = salad_bits(tokens)
    if sum(map(len, tokens)) < CORPUS_WORDS:  # too little text to say which words follow which
        scored = np.zeros(len(texts), dtype=np.int64)
    out = []
    for i, text in enumerate(texts):
        if len(text) < MIN_CHARS:
            out.append("")
        elif mojibake(text):
            out.append("mojibake")
        elif random_letters(text):
            out.append("random letters")
        else:
            salad = scored[i] >= MIN_PAIRS and bits[i] < SALAD_BITS and prose(text, tokens[i])
            out.append("word salad" if salad else "")
    return out


def report(kind_of: Sequence[str], which: np.ndarray, names: Sequence[str], key: str, dropped: bool) -> str:
    """One console line for the documents `which` (bool [D]) that pack like text but are junk: how
    many of each kind, the first few by name, and what was done."""
    where = np.flatnonzero(which)
    counts = Counter(kind_of[i] for i in where)
    first = ", ".join(f"{names[i]} ({kind_of[i]})" for i in where[: quality.SHOWN])
    more = ", ..." if len(where) > quality.SHOWN else ""
    done = (
        "left out (data.garbage_filter=drop)"
        if dropped
        else "kept (the orchestrator in auto mode leaves their training rows out); data.garbage_filter=drop leaves "
        "them out, off skips this check"
    )
    kinds_said = ", ".join(f"{n:,} {kind}" for kind, n in sorted(counts.items()))
    return (
        f"{key}: {len(where):,} of {len(which):,} documents pack like text but are junk ({kinds_said}; "
        f"data/junk.py): {first}{more}; {done}"
    )
