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
every one out of training. A minority language in Latin letters (Vietnamese, Polish, Turkish, Czech
pages in an English crawl, with a tokenizer trained on English: all flagged before) is told from
garbage by how its characters follow one another (`latin_language`): natural text's adjacent
characters share information (Shannon 1951, "Prediction and Entropy of Printed English") and its
vowels and consonants alternate (Sukhotin 1962), where letters drawn at random, at whatever
frequencies, show neither. Garbage is Latin letters, digits and symbols (base64, hex, printable
noise), random letters, or mis-encoded text, whose letters are Latin-1's.
"""

from __future__ import annotations

import math
import re
import unicodedata
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from trimtab.words import counted

MIN_BYTES = 256  # shorter documents are not judged: a few tokens say little of how text packs
MIN_DOCS = 20  # judged documents a source needs for its median to be a reference
CAP = 0.75  # a flagged document packs under this fraction of the median, however tight the source
SHOWN = 5  # documents named on the console
# a document whose non-space characters are at least this share letters (or marks) of a script
# other than Latin is a minority language's (Japanese prose: ~0.85; base64, hex: 0; mojibake: Latin-1)
SCRIPT_SHARE = 0.5
LATIN_END = 0x370  # Latin and its extensions, IPA and combining marks end here; Greek starts
# A flagged document in Latin letters is a language's when (measured on Vietnamese, Polish, Turkish, Czech,
# Indonesian and Swahili prose of 260-1,500 bytes against garbage of 260-1,500 bytes, docs/data.md):
LETTERS = 0.75  # letters of its non-space characters are at least this share (prose 0.96-0.99; printable
# noise 0.50-0.63, hex dumps 0.21-0.33, mis-encoded CJK 0.34-0.41)
SPACES = 0.08  # whitespace of its characters (prose 0.11-0.24; base64 wrapped at 76 columns: 0.01)
MOJIBAKE = 0.25  # non-ASCII characters in UTF-8 byte pairs read as cp1252/Latin-1, under this share
# (mis-encoded Polish, Vietnamese, Turkish: 0.77-1.0, CJK 0.67; Czech's own letters: up to 0.13)
STRUCTURE = 0.45  # adjacent-character information + 2 x vowel alternation, bits (prose 0.71-1.47; random
# letters, uniform, at English frequencies or accented: -0.25-0.28)
CAPITALS = 0.5  # of a spared document's letters upper case: said as text in capitals (its own words, not learnt so)
VOWELS = frozenset("aeiouyıøæœ")  # base letters after NFD (ı, ø, æ, œ do not decompose)
# A document is random characters (`random_characters`, judged in every document by data/junk.py) when its characters
# are drawn independently from many, as random bytes, base64 and random text over a small alphabet are: the packing
# screen cannot see them where a mixture of code, prose and ~25 languages widens the spread (its threshold falls to
# 0.35-0.37x the median, under random Latin-1's 0.47-0.66x), nor in a source made of them (its median is theirs).
# Measured on documents of 512-2,048 characters (gnupg's help in 27 languages, English licences, the stdlib in
# 1.5 KB pieces: 114K real documents; at CHAR_BITS 4 and INCOMPRESSIBLE: docs/*.md, src/ and tests/ of this repository
# whole and in 1.5 KB pieces, 3,900, and the stdlib and site-packages in pieces, 120K: 0 flagged but 4 pieces of
# hexadecimal digits of pi, a hex dump):
NOISE_BITS = 0.25  # adjacent characters' information (`information`) under this (random Latin-1, base64, hex: <= 0.11
# bits; real text >= 0.39, but for tables of numbers and code points in the stdlib: -0.11-0.25, periodic)
CHAR_BITS = 4.0  # and the entropy of its characters at least this, 16 equally likely or more (random text over 18
# symbols, letters and space or digits and punctuation: >= 4.1; base64 >= 5.9; random Latin-1 >= 7.2; the stdlib's
# tables of random integers: 3.5-3.7, real data whose digits are as random as noise's, so not flagged)
INCOMPRESSIBLE = 1.0  # and zlib (level 9) packs it into no fewer bits a character than that entropy: nothing repeats
# beyond the characters' frequencies (random text over 8-256 symbols, 512-2,048 characters: >= 1.02; tables of code
# points, whose digits collapse into one symbol but whose lines repeat: under)
NOISE_CHARS = 512  # shorter documents are not so judged: random Latin-1 of 260 characters reaches 0.27 bits, text 0.14
# zlib level 1 packs a text into no less than 0.99x level 9's size (measured: random text over 8-256 symbols and the
# stdlib whole and in 1.5 KB pieces, 0.991-2.1x; level 9 searches more matches), so a document level 1 packs under
# GLANCE (a margin under that 0.99) x INCOMPRESSIBLE x CHAR_BITS bits a character is no random characters, known at a
# third (1.5 KB) to a fifth (whole files) of the cost of `information`: 96% of the stdlib's pieces, of its files too
GLANCE = 0.9


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
    # per named document: what data/junk.py found in one that packs like text (its kind, score and bar); "": none
    why: tuple[str, ...] = ()

    def reasons(self) -> list[str]:
        """Per named document, why it was flagged: its junk verdict, or its packing against the median."""
        why = self.why or ("",) * len(self.names)
        return [said or f"{packing:.2f}x the median bytes per token" for said, packing in zip(why, self.packing)]

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


def random_characters(text: str, bits: float | None = None) -> bool:
    """Whether `text` (NOISE_CHARS or more, not another script's: its words are single characters) is
    characters drawn independently (NOISE_BITS between neighbours) from many (CHAR_BITS) that do not
    compress beyond their frequencies (INCOMPRESSIBLE): random bytes, base64, random text over a small
    alphabet. A table of numbers is as independent but of fewer characters, or repeats, so not garbage
    of this kind. `bits`: the information between its neighbours, where the caller has it (data/junk.py: a
    document of letters, whose structure it judged); else the cheap test first, as it decides most documents
    (GLANCE), then the information."""
    if len(text) < NOISE_CHARS:
        return False
    if bits is None:
        if 8 * len(zlib.compress(text.encode(), 1)) < GLANCE * INCOMPRESSIBLE * CHAR_BITS * len(text):
            return False
        bits = information(symbols_of(text))
    if bits >= NOISE_BITS or other_script(text):
        return False
    _, counts = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), return_counts=True)
    p = counts / counts.sum()
    each = float(-(p * np.log2(p)).sum())
    return each >= CHAR_BITS and 8 * len(zlib.compress(text.encode(), 9)) >= INCOMPRESSIBLE * each * len(text)


def other_script(text: str) -> bool:
    """Whether `text` is written mostly in letters of a script other than Latin (SCRIPT_SHARE of
    its non-space characters): a language the tokenizer knows little of, not garbage."""
    chars = [c for c in text if not c.isspace()]
    letters = sum(1 for c in chars if ord(c) >= LATIN_END and unicodedata.category(c)[0] in "LM")
    return bool(chars) and letters >= SCRIPT_SHARE * len(chars)


def latin_language(text: str) -> bool:
    """Whether `text` reads as a natural language in Latin letters rather than garbage: mostly
    letters (LETTERS), in words (SPACES), not mis-encoded (MOJIBAKE), and its characters depend on
    their neighbours as a language's do (STRUCTURE), which no sequence of independently drawn
    letters does, whatever their frequencies or accents. Read for flagged documents only."""
    symbols = symbols_of(text)
    letters, spaces = letter_counts(symbols)
    if not letters or letters < LETTERS * (len(symbols) - spaces) or spaces < SPACES * len(symbols) or _mojibake(text):
        return False
    return structure(symbols) >= STRUCTURE


def structure(symbols: np.ndarray, bits: float | None = None) -> float:
    """Bits of structure between neighbouring characters (`symbols_of`'s): adjacent-symbol information (`bits`, when
    known) + 2 x vowel alternation, which STRUCTURE bars (data/junk.py's random letters too)."""
    return (information(symbols) if bits is None else bits) + 2 * alternation(symbols)


def letter_counts(symbols: np.ndarray) -> tuple[int, int]:
    """(letters, whitespace) among `symbols_of`'s symbols, counted a WINDOW at a time."""
    letters = spaces = 0
    for start in range(0, len(symbols), WINDOW):
        window = symbols[start : start + WINDOW]
        letters += int(_letter(window).sum())
        spaces += int((window == SPACE).sum())
    return letters, spaces


def _letter(symbols: np.ndarray) -> np.ndarray:
    return (symbols != SPACE) & (symbols != DIGIT) & (symbols != OTHER)


SPACE, DIGIT, OTHER = ord(" "), ord("0"), ord(".")
_IS_VOWEL = np.isin(np.arange(max(map(ord, VOWELS)) + 2), [ord(c) for c in VOWELS])  # by code point; past: no
_WHITESPACE = re.compile(r"\s")  # str.isspace's characters (both Py_UNICODE_ISSPACE)
_TABLE: dict[int, str | None] = {}  # str.translate's: character -> symbol (None: a combining mark, dropped)
# Characters (symbols) a long text is read in by symbols_of and the neighbour statistics: whole, a 5 MB document's
# int64 symbols, their pair codes and np.unique's sorted copies held 36 bytes a character (180 MB, data/junk.py's
# letter_structure), a 50 MB one 1.8 GB; in windows, the uint16 symbols (2 bytes a character) and one window's
# pairs (~60 bytes a symbol of a window): 4 bytes a character
WINDOW = 1 << 16


def symbols_of(text: str) -> np.ndarray:
    """Code points (uint16, uint32 past the BMP) of the characters a reader sees: letters lower-cased without their
    combining marks (NFD), so that Vietnamese tones and Polish ogoneks are not new letters, one
    symbol for all whitespace, one for digits, one for everything else. Each distinct character is
    classified once per process (_TABLE): the screen reads every flagged document. Read a WINDOW at a time."""
    out, n = np.empty(len(text), dtype=np.uint16), 0
    for piece in windows(text):
        decomposed = unicodedata.normalize("NFD", piece)
        for code in {ord(c) for c in set(decomposed)} - _TABLE.keys():
            _TABLE[code] = _symbol(chr(code))
        codes = np.frombuffer(decomposed.translate(_TABLE).encode("utf-32-le"), dtype=np.uint32)
        if len(codes) and out.dtype == np.uint16 and int(codes.max()) > 0xFFFF:  # past the BMP: 4 bytes a symbol
            out = out.astype(np.uint32)
        if n + len(codes) > len(out):  # decomposed into more symbols than characters (Hangul's jamo, marks kept as ".")
            grown = np.empty(max(n + len(codes), len(out) + len(text) // 8), dtype=out.dtype)
            grown[:n], out = out[:n], grown
        out[n : n + len(codes)] = codes
        n += len(codes)
    return out[:n]


def windows(text: str) -> list[str]:
    """`text` in pieces of WINDOW characters or more, each cut before the first whitespace from there: each
    piece's words (str.split) and NFD are the whole text's there (one without whitespace is one piece)."""
    pieces, at = [], 0
    while len(text) - at > WINDOW and (found := _WHITESPACE.search(text, at + WINDOW)) is not None:
        pieces.append(text[at : found.start()])
        at = found.start()
    return [*pieces, text[at:]]


def _symbol(c: str) -> str | None:
    kind = unicodedata.category(c)[0]
    if kind == "L":
        return c.lower()
    if c.isspace():
        return " "
    return None if kind == "M" else "0" if c.isdigit() else "."


def information(symbols: np.ndarray) -> float:
    """Mutual information of adjacent symbols, bits: the entropy of pairs of symbols far apart (a
    golden-ratio stride through the text, as independent in prose as in noise) less that of adjacent
    pairs. Same symbols, same number of pairs: the small-sample bias of both estimates cancels (a
    document of 256 bytes sees a few hundred of the ~700 possible letter pairs)."""
    n = len(symbols)
    step = next(s for s in range(int(0.618 * n) + 1, 2 * n + 2) if math.gcd(s, n) == 1)  # visits every symbol
    return _pair_entropy(symbols, step) - _pair_entropy(symbols, 1)


def _pair_entropy(symbols: np.ndarray, step: int) -> float:
    """Entropy (bits) of the pairs of neighbours in the sequence symbols[i * step % n], i < n: each window's pairs
    counted (np.unique), the counts merged, so the same counts in the same order as the whole sequence's."""
    n = len(symbols)
    keys, counts = [], []
    for start in range(0, n - 1, WINDOW):
        at = np.arange(start, min(start + WINDOW, n - 1) + 1, dtype=np.int64)
        pair = symbols[at * step % n if step != 1 else at].astype(np.uint64)
        key, count = np.unique((pair[:-1] << np.uint64(21)) | pair[1:], return_counts=True)  # code points < 2**21
        keys.append(key)
        counts.append(count)
    if len(keys) > 1:
        merged, inverse = np.unique(np.concatenate(keys), return_inverse=True)
        counts = [np.bincount(inverse, weights=np.concatenate(counts), minlength=len(merged)).astype(np.int64)]
    total = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    p = total / max(int(total.sum()), 1)
    return float(-(p * np.log2(p)).sum())


def alternation(symbols: np.ndarray) -> float:
    """How much more often adjacent letters of a word are a vowel and a consonant than chance
    (2p(1 - p), p the vowels' share): languages alternate them (Sukhotin 1962), random letters do not.
    Counted a WINDOW at a time (the last symbol of one window paired with the next's first)."""
    n = len(symbols)
    letters = vowels = pairs = alternating = 0
    for start in range(0, n, WINDOW):
        end = min(start + WINDOW, n)
        vowel = _IS_VOWEL[np.minimum(symbols[start : end + 1], len(_IS_VOWEL) - 1)]
        is_letter = _letter(symbols[start : end + 1])
        both = is_letter[:-1] & is_letter[1:]
        letters += int(is_letter[: end - start].sum())
        vowels += int((vowel & is_letter)[: end - start].sum())
        pairs += int(both.sum())
        alternating += int(((vowel[:-1] != vowel[1:]) & both).sum())
    if not pairs:
        return 0.0
    p = vowels / letters
    return alternating / pairs - 2 * p * (1 - p)


def bytes_as_text(first: int, last: int) -> str:
    """The characters cp1252 and Latin-1 read the bytes first..last as."""
    raw = bytes(range(first, last + 1))
    return "".join(sorted(set(raw.decode("latin-1") + raw.decode("cp1252", errors="ignore"))))


# a UTF-8 lead byte then a continuation byte, read as cp1252 or Latin-1: "Å‚" for "ł", "Ã©" for "é"
_MOJIBAKE_PAIR = re.compile(f"[{re.escape(bytes_as_text(0xC2, 0xF4))}][{re.escape(bytes_as_text(0x80, 0xBF))}]")


def _mojibake(text: str) -> bool:
    """Whether MOJIBAKE of the non-ASCII characters are in such pairs: a page read in the wrong
    encoding, garbage."""
    foreign = len(text) - len(text.encode("ascii", errors="ignore"))
    return foreign > 0 and 2 * len(_MOJIBAKE_PAIR.findall(text)) >= MOJIBAKE * foreign


def language(text: str) -> str:
    """What a document that packs like garbage is written in, in words, when it is a language the
    tokenizer knows little of: another script (other_script), or natural text in Latin letters
    (latin_language), which in capitals (CAPITALS of its letters) is most likely the corpus's own
    language shouted (a licence's disclaimer): a BPE learns words in lower case; "" for garbage."""
    if other_script(text):
        return "another script than Latin"
    if not latin_language(text):
        return ""
    letters = [c for c in text if c.isalpha()]
    return "in capitals" if sum(map(str.isupper, letters)) >= CAPITALS * len(letters) else "Latin letters"


def spare_scripts(flagged: np.ndarray, text_of: Callable[[int], str]) -> tuple[np.ndarray, dict[int, str]]:
    """`flagged` less the documents written in a language (`language`), and those: index -> what
    they are written in; `text_of(i)` is document i's text, read for the flagged ones only."""
    spared = {int(i): said for i in np.flatnonzero(flagged) if (said := language(text_of(int(i))))}
    kept = np.asarray(flagged).copy()
    kept[list(spared)] = False
    return kept, spared


def spared_line(count: int, key: str, names: list[str]) -> str:
    """The documents `spare_scripts` kept: how many, the first SHOWN named (each with what it is written in)."""
    more = ", ..." if count > len(names) else ""
    return (
        f"{key}: {counted(count, 'document')} {'packs' if count == 1 else 'pack'} like garbage but "
        f"{'reads' if count == 1 else 'read'} as natural text: {', '.join(names)}{more}; kept and "
        "trained, not flagged (text in capitals, another script, or a language in Latin letters the tokenizer "
        "learnt little of splits into short tokens)"
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
        f"{key}: {len(where):,} of {counted(len(found.flagged), 'document')} ({share:.1%} of the bytes) pack under "
        f"{found.threshold:.2f}x the source's median {found.median:.2f} bytes per token, as random "
        f"bytes, base64, hex dumps, mis-encoded text and scripts the tokenizer does not know do: {first}{more}; {done}"
    )
