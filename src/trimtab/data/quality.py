"""Garbage documents found before training, by how the tokenizer packs them.

A BPE trained on a corpus packs its text into tokens of several bytes (2-4 bytes per token for
vocabularies of 512-32K on code and English); random bytes, base64 and hex dumps, mis-encoded text
(mojibake) and letters of scripts the tokenizer never learnt fall apart into single bytes and
characters, 1-2 bytes per token (the compression view of a tokenizer's fertility, subwords per
word, of Rust et al. 2021, "How Good is Your Tokenizer?"). A source's own documents set the
scale: a document is flagged when its log bytes per token lies `sigma` robust standard deviations
(1.4826 x the median absolute deviation) under the source's median, and under CAP x the median
whatever the spread (a source of near-identical documents would otherwise flag small variation).

Why before training: once a model has learnt the mode "random characters here", such a document
scores near the corpus's median loss per token, so the orchestrator's per-row rule
(orchestrator/outliers.py) cannot see it (docs/orchestrator.md, the rows rule's blind spot).

Measured (docs/data.md): on the built-in corpus with ~3% garbage documents of five kinds, the
threshold falls at 0.48-0.52x the median; precision 1.00 / recall 0.79 with a 512-token BPE (hex
dumps pack like text there), 0.93 / 0.99 with 4,096 (the false ones are embedded binary literals,
garbage to a language model too). A minority language inside a source packs like garbage too: a
document whose characters are mostly letters of a script other than Latin (Japanese, Chinese,
Korean, Cyrillic, Greek, Arabic, Devanagari, ...) is that, and never flagged (`other_script`): 5% of
Japanese passages in an English corpus were all flagged, and the orchestrator in auto mode left
every one out of training. Garbage is Latin letters, digits and symbols (base64, hex, printable
noise) or mis-encoded text, whose letters are Latin-1's.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

MIN_BYTES = 256  # shorter documents are not judged: a few tokens say little of how text packs
MIN_DOCS = 20  # judged documents a source needs for its median to be a reference
CAP = 0.75  # a flagged document packs under this fraction of the median, however tight the source
SHOWN = 5  # documents named on the console
# a document whose non-space characters are at least this share letters (or marks) of a script
# other than Latin is a minority language's (Japanese prose: ~0.85; base64, hex: 0; mojibake: Latin-1)
SCRIPT_SHARE = 0.5
LATIN_END = 0x370  # Latin and its extensions, IPA and combining marks end here; Greek starts


@dataclass(frozen=True)
class Screened:
    """What the screen found in one source's documents."""

    flagged: np.ndarray  # bool [D]: packs under threshold x the median
    packing: np.ndarray  # float [D]: bytes per token of each document
    median: float  # the source's median bytes per token (judged documents only); nan: none judged
    threshold: float  # the flagged documents' packing is under this fraction of the median

    @property
    def count(self) -> int:
        return int(self.flagged.sum())


@dataclass(frozen=True)
class Scale:
    """What a source's flagged documents were judged by: for the orchestrator's evidence."""

    key: str  # the source's config key (data.source, data.mix[1].source, ...)
    median: float  # the source's median bytes per token
    threshold: float  # flagged documents pack under this fraction of the median


@dataclass(frozen=True)
class Flagged:
    """Documents the screen flagged and kept (data.garbage_filter=warn) in one source's training
    split, and the training rows at least half made of their tokens: what the orchestrator leaves
    out (orchestrator/screened.py). A packed row mixes documents, hence the half."""

    scale: Scale
    documents: int  # flagged documents with tokens in the training split
    names: tuple[str, ...]  # the first SHOWN of them, as the console names them
    packing: tuple[float, ...]  # their bytes per token as a fraction of the median
    rows: np.ndarray  # int64 [R]: indices into the phase's training rows

    def shifted(self, by: int) -> Flagged:
        """The same with its rows numbered from `by`: a source's rows within a mixture's one set."""
        return replace(self, rows=self.rows + by)


def flagged_before(bounds: np.ndarray, flagged: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64: the tokens of flagged documents before each token position of the stream the
    documents `bounds` (int64 [D + 1]) delimit (`flagged`: bool [D])."""
    lengths = np.diff(bounds)
    before = np.concatenate([[0], np.cumsum(np.where(flagged, lengths, 0))])
    doc = np.clip(np.searchsorted(bounds, positions, side="right") - 1, 0, len(lengths) - 1)
    inside = np.clip(np.asarray(positions) - bounds[doc], 0, lengths[doc])
    return (before[doc] + np.where(flagged[doc], inside, 0)).astype(np.int64)


def mostly_flagged(bounds: np.ndarray, flagged: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """bool [R]: at least half the tokens of each range [start, end) belong to flagged documents."""
    count = flagged_before(bounds, flagged, ends) - flagged_before(bounds, flagged, starts)
    return 2 * count >= np.asarray(ends) - np.asarray(starts)


def screen(n_bytes: np.ndarray, n_tokens: np.ndarray, sigma: float) -> Screened:
    """Documents of n_bytes UTF-8 bytes and n_tokens tokens each ([D] both): those of at least
    MIN_BYTES whose log bytes per token lies `sigma` robust standard deviations under the median
    of such documents (and under CAP x the median). Nothing is flagged without MIN_DOCS
    documents to measure the source by."""
    packing = packed(n_bytes, n_tokens)
    found = scale(n_bytes, n_tokens, sigma)
    if found is None:
        return Screened(np.zeros(len(packing), dtype=bool), packing, float("nan"), 0.0)
    median, threshold = found
    return Screened(flags(n_bytes, n_tokens, median, threshold), packing, median, threshold)


def packed(n_bytes: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
    """Bytes per token of each document."""
    return np.asarray(n_bytes, dtype=np.float64) / np.maximum(np.asarray(n_tokens, dtype=np.float64), 1)


def scale(n_bytes: np.ndarray, n_tokens: np.ndarray, sigma: float) -> tuple[float, float] | None:
    """(median bytes per token, threshold as a fraction of it) of a source from its documents (or
    a sample of them); None with fewer than MIN_DOCS documents of MIN_BYTES."""
    if not judgeable(n_bytes):
        return None
    judged = np.asarray(n_bytes) >= MIN_BYTES
    logs = np.log(packed(n_bytes, n_tokens)[judged])
    centre = float(np.median(logs))
    spread = 1.4826 * float(np.median(np.abs(logs - centre)))
    return math.exp(centre), min(CAP, math.exp(-sigma * spread))


def judgeable(n_bytes: np.ndarray) -> bool:
    """Whether documents of these sizes are enough for a scale: MIN_DOCS of MIN_BYTES or more."""
    return int((np.asarray(n_bytes) >= MIN_BYTES).sum()) >= MIN_DOCS


def flags(n_bytes: np.ndarray, n_tokens: np.ndarray, median: float, threshold: float) -> np.ndarray:
    """bool [D]: the documents of MIN_BYTES that pack under threshold x median."""
    return (np.asarray(n_bytes) >= MIN_BYTES) & (packed(n_bytes, n_tokens) < threshold * median)


def other_script(text: str) -> bool:
    """Whether `text` is written mostly in letters of a script other than Latin (SCRIPT_SHARE of
    its non-space characters): a language the tokenizer knows little of, not garbage."""
    chars = [c for c in text if not c.isspace()]
    letters = sum(1 for c in chars if ord(c) >= LATIN_END and unicodedata.category(c)[0] in "LM")
    return bool(chars) and letters >= SCRIPT_SHARE * len(chars)


def spare_scripts(flagged: np.ndarray, text_of: Callable[[int], str]) -> tuple[np.ndarray, int]:
    """`flagged` less the documents written in another script (other_script), and how many those
    were; `text_of(i)` is document i's text, read for the flagged ones only."""
    spared = np.zeros(len(flagged), dtype=bool)
    for i in np.flatnonzero(flagged):
        spared[i] = other_script(text_of(int(i)))
    return flagged & ~spared, int(spared.sum())


def spared_line(count: int, key: str) -> str:
    return (
        f"{key}: {count:,} documents pack like garbage but are written in another script than Latin (a "
        "minority language the tokenizer knows little of): kept and trained, not flagged"
    )


def report(found: Screened, names: list[str], n_bytes: np.ndarray, key: str, dropped: bool) -> str:
    """One console line: how many documents, their share of the bytes, the first few by name with
    their packing against the median, and what was done."""
    where = np.flatnonzero(found.flagged)
    share = float(np.asarray(n_bytes)[where].sum()) / max(float(np.sum(n_bytes)), 1.0)
    first = ", ".join(f"{names[i]} ({found.packing[i] / found.median:.2f}x)" for i in where[:SHOWN])
    more = ", ..." if len(where) > SHOWN else ""
    done = (
        "left out (data.garbage_filter=drop)"
        if dropped
        else "kept (the orchestrator in auto mode leaves their training rows out); data.garbage_filter=drop leaves "
        "them out, off skips this check"
    )
    return (
        f"{key}: {len(where):,} of {len(found.flagged):,} documents ({share:.1%} of the bytes) pack under "
        f"{found.threshold:.2f}x the source's median {found.median:.2f} bytes per token, as random bytes, base64, "
        f"hex dumps, mis-encoded text and scripts the tokenizer does not know do: {first}{more}; {done}"
    )
