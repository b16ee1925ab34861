"""Junk that packs like text: what the packing screen (quality.py) cannot see, judged on every document.

A tokenizer trained on a corpus packs three kinds of junk as well as the corpus's text, so bytes per
token do not give them away (measured at 4,096 tokens: never flagged):

- mis-encoded pages (mojibake.py: `mojibake_share`), UTF-8 read as cp1252 or Latin-1 and written back.
- random letters at a language's letter frequencies (`letter_structure`): letters drawn independently
  share no information with their neighbours and do not alternate vowels and consonants
  (quality.latin_language's structure, Shannon 1951 and Sukhotin 1962).
- word salad (`word_salad`): real words in random order. A language's next word is predictable from
  the one before (a bigram model's perplexity is far under a unigram model's; Shannon 1951), so
  the corpus's own bigram counts (the document's own left out) give its adjacent words positive
  pointwise mutual information on average; words in random order have none (Church and Hanks
  1990, "Word Association Norms, Mutual Information, and Lexicography").
- scrambled words (`scrambled`): text spelt backwards, or each word's letters shuffled, keeps the
  corpus's letters, their neighbours' structure and (reversed) its word order, so neither test above
  sees it (measured: 0 of 60 reversed, 18 of 60 shuffled named); its long words are the corpus's
  letters misspelt, which a real document's words, in the corpus's language or another, seldom are.
- hex dumps and base64 (dumps.py: `dump_share`), bytes written out as text.
- repeated text (repeats.py: `repeated_share`), a line or passage over and over: a generator in a loop, log spam.
  A source whose documents are mostly that is kept and said once (`spare_repeats`): a toy corpus repeated on purpose.
- random characters (quality.random_characters), judged in every document by itself.

The reference's word and pair counts and the word-salad and scrambled-word statistics are bigrams.py's.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trimtab.data import quality, word_order
from trimtab.data.bigrams import (
    KNOWN_PAIRS,
    Bigrams,
    doc_lengths,
    salad_bits_of_ids,
    scrambled,
    text_hashes,
    word_ids,
)
from trimtab.data.dumps import DUMP, dump_share, dump_span
from trimtab.data.mojibake import MOJIBAKE_SHARE, mojibake_share
from trimtab.data.repeats import REPEATED, repeated_share
from trimtab.words import counted

MIN_CHARS = quality.MIN_BYTES  # shorter documents are not judged: too few words or pairs to say
LETTERS = 0.9  # random letters are judged in documents at least this share letters (of non-space characters)
CORPUS_WORDS = 100_000  # words a reference (a run's corpus, a prepare sample) needs for word salad to be judged
# Not lower: the statistic is a plug-in estimate of pointwise mutual information (Church and Hanks 1990) from the
# reference's pair counts, and a language's informative pairs are rare ones (Zipf): against a small reference most of
# a real document's adjacent pairs are unseen, scored near 0 bits as a shuffled document's are. Measured (each document
# judged against the rest, a tenth of them salad): 1.5 KB pieces of man pages, licences and docs/*.md, site-packages'
# METADATA pages and a mix with code, real pieces named: 20K words 0-2.4%, 50K 0-0.8%, 100K 0-0.2%, 200K-400K
# 0.1-0.4% (borderline, 1.3-1.5 bits: lists of names and numbers), stdlib code chunks 0 of 456; salad named at
# 100K: 24-40 of ~50 in man pages, licences and mixes (Markdown READMEs', mostly not prose: 10 of 52).
# It was 400K when pairs within a word were scored (docs/data.md). A test needing no reference (word_order.py) is
# too weak alone. A smaller source's spellings are still judged (scrambled words), and its word order by a stricter
# rule, measured in docs/data.md (junk):
SMALL_WORDS = 5_000  # under CORPUS_WORDS (down to these), a document is word salad only when all four agree:
SMALL_BITS = 0.4  # its bits, smoothed by each word's followers (bigrams.prior), are under this (0.7 before them: a
# stdlib docstring scored 0.68), chosen on a tuning half of real text split by source file; on the other, real pieces
# named 2 -> 0 of 13,274, salad 789 -> 828 of 1,325 (bench/junk_bars.py, docs/data.md);
ANTI_ORDER = -0.5  # above this (far under 0, its adjacent words avoid each other: "key: value" lines, an order);
SMALL_KNOWN = 0.1  # the reference holds this share of its distant pairs (KNOWN_PAIRS; salad: 0.03-0.3, as its
# source's real pages); and its own repeated word pairs do not put it in order (word_order.ordered)
PIECE_WORDS = 20_000  # a document of twice this or more is judged in pieces, and by itself first (`alone`)
MIN_PAIRS = 40  # adjacent word pairs, both words seen elsewhere in the corpus, a document needs to be judged
SALAD_BITS = 1.5  # adjacent words' mean pointwise mutual information, less distant ones', under this: word salad
PROSE = 0.8  # share of a document's non-space characters in words for word salad to be judged (code: ~0.6)
# a line ending in one of these opens a block or bracket whose body the next lines indent: code's layout. Code
# whose identifiers are most of its characters passes PROSE (stdlib chunks: 0.80-0.92), and its word pairs come
# from its own file's names, which a reference without that file lacks (1.5 KB chunks of stdlib files outside an
# 8 MB sample: 362 of 4,482 scored as word salad, the code's own shuffled words 0.1-1.3 bits)
OPENERS = ":{([\\,="
MIN_LONG = 20  # such words a document needs for scrambled words to be judged
SCRAMBLED = 0.3  # share of a document's long words so misspelt: scrambled (real text: <= 0.13, scrambled >= 0.8)
# numbered from 1 in a prepared shard's index (0: none): a new kind goes last, so shards prepared before read alike
KINDS = (
    "mojibake",
    "random letters",
    "word salad",
    "scrambled words",
    "hex or base64 dump",
    "random characters",
    "repeated text",
)
# share of a source's judged documents (MIN_CHARS) that, once repeated text, are kept as its meant content: a toy
# corpus ("def f(x): ..." * 400) or a text repeated on purpose, which leaving out would leave nothing to train on
MOSTLY_REPEATED = 0.5
# share of a source's words in the documents its own reference names word salad over which that reference is mostly
# salad, and the source is judged by the small-source rule (`_mostly_salad`)
MOSTLY_SALAD = 0.5
SAID = {  # what each kind is, on the console
    "mojibake": "UTF-8 text read as cp1252/Latin-1",
    "random letters": "letters without a language's structure between neighbours",
    "word salad": "real words in random order",
    "scrambled words": "text spelt backwards or with each word's letters shuffled",
    "hex or base64 dump": "bytes written out as hex digits or base64, not text",
    "random characters": "characters drawn at random, as random bytes or printable noise are",
    "repeated text": "a line or passage repeated over and over, as log spam or a generator in a loop writes it",
}
_WORD = re.compile(r"[^\W\d_]+")
_SPACE = re.compile(r"\s")


def letter_structure(text: str) -> tuple[float, float] | None:
    """(bits of structure between `text`'s neighbouring letters (quality.structure; independently drawn
    letters: under quality.STRUCTURE), bits of information between its neighbouring characters, their
    part that quality.random_characters reads too) when it is mostly letters (LETTERS) in words; None else."""
    symbols = quality.symbols_of(text)
    letters, spaces = quality.letter_counts(symbols)
    if letters < LETTERS * max(len(symbols) - spaces, 1) or spaces < quality.SPACES * len(symbols):
        return None
    bits = quality.information(symbols)
    return quality.structure(symbols, bits), bits


def words(text: str) -> list[str]:
    """`text`'s words, lower-cased, read a window at a time (quality.windows: cut before whitespace, so the words are
    the whole text's), each distinct word one str: a 5 MB document's 850K words each its own str held 13 bytes a
    character (65 MB), shared 3."""
    shared: dict[str, str] = {}
    return [shared.setdefault(w, w) for piece in quality.windows(text) for w in _WORD.findall(piece.lower())]


def word_count(text: str) -> int:
    """len(_WORD.findall(text)), a window at a time: whole, a long text's list of words held 13 bytes a character."""
    return sum(len(_WORD.findall(piece)) for piece in quality.windows(text))


def spaced(text: str) -> np.ndarray:
    """bool [W]: whether each of `words(text)` is parted from the one before by whitespace (the first: True). Word
    salad shuffles whitespace-separated words, so the words within one ("don't", "e.g.", "--no-color", "self.x")
    stay neighbours in it: only pairs across a space say whether the words are in order. A window at a time: each
    after the first starts with whitespace, so its first word is parted from the one before, as in the whole text."""
    return np.concatenate([_spaced(piece) for piece in quality.windows(text)])


def _spaced(text: str) -> np.ndarray:
    gaps = _WORD.split(text.lower())[:-1]  # gaps[i]: the characters before word i
    return np.fromiter((i == 0 or bool(_SPACE.search(g)) for i, g in enumerate(gaps)), dtype=bool, count=len(gaps))


def prose(text: str, ws: list[str]) -> bool:
    """Whether words are at least PROSE of `text`'s non-space characters and it is not laid out as
    code (`nested`): word salad is judged in prose only (code's tables and byte literals are not
    words in order, nor junk of this kind)."""
    return sum(map(len, ws)) >= PROSE * len("".join(text.split())) and not nested(text)


def nested(text: str) -> bool:
    """Whether a line of `text` is indented deeper than the one before it, which ends in a block or
    bracket opener (OPENERS): code's layout, which words in random order (one line) lack."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    depth = [len(line) - len(line.lstrip()) for line in lines]
    return any(d > before and line[-1] in OPENERS for line, before, d in zip(lines, depth, depth[1:]))


@dataclass(frozen=True)
class Verdict:
    """Why a document is junk: its kind, its score and the bar the score crossed (evidence)."""

    kind: str  # one of KINDS
    score: float
    bar: float
    # a dump's UTF-8 byte range [start, end) in the document's text, first to last dump character (`dump_span`):
    # where to cut it out of a file that is text besides (an embedded font, a certificate); None: other kinds
    span: tuple[int, int] | None = None

    def __str__(self) -> str:
        what = {
            "mojibake": "of its non-ASCII characters in UTF-8 read as cp1252/Latin-1, at least",
            "random letters": "bits of structure between neighbouring letters, under",
            "word salad": "bits of information between adjacent words (less distant ones'), under",
            "scrambled words": "of its long words unknown to the corpus but its words' letters rearranged, at least",
            "hex or base64 dump": "of its characters in groups of hex digits or base64 runs, at least",
            "random characters": f"bits of information between neighbouring characters ({quality.CHAR_BITS:g}+ "
            "bits each, incompressible), under",
            "repeated text": "of its characters in one stretch repeating its earlier text, at least",
        }[self.kind]
        where = f", bytes {self.span[0]:,}-{self.span[1]:,} of its text" if self.span else ""
        return f"{self.kind}: {self.score:.2f} {what} {self.bar:g}{where}"

    @staticmethod
    def row(verdict: Verdict | None) -> tuple[float, ...]:
        """(kind number, score, bar, span start, span end) as a prepared shard's index keeps them (nan: none)."""
        if verdict is None:
            return (0, math.nan, math.nan, math.nan, math.nan)
        start, end = verdict.span or (math.nan, math.nan)
        return (KINDS.index(verdict.kind) + 1, verdict.score, verdict.bar, start, end)

    @staticmethod
    def of_row(code: float, score: float, bar: float, start: float = math.nan, end: float = math.nan) -> Verdict | None:
        """The verdict of an index row; shards prepared before spans were kept have none."""
        span = None if math.isnan(start) else (int(start), int(end))
        return Verdict(KINDS[int(code) - 1], float(score), float(bar), span) if code >= 1 else None


def kinds(texts: Sequence[str], reference: Bigrams | None = None, mostly: bool | None = None) -> list[Verdict | None]:
    """Each document's junk verdict, None for none. Word salad is judged against `reference`'s
    bigrams (default: the documents' own, less the large ones `alone` names), when it holds CORPUS_WORDS
    (SMALL_WORDS: by the small-source rule, whose bar is SMALL_BITS), in pieces of PIECE_WORDS. Documents under
    MIN_CHARS characters are not judged. Random characters (quality.random_characters) are judged in every
    document, by the document alone: the packing screen judges a document against its own source's median,
    which a source made of them sets. `mostly`: whether their source is mostly word salad (`mostly_salad`, on its
    sample); None: judged on `texts` themselves."""
    found = alone(texts)
    if reference is None and found:  # their pairs are noise: the rest's own reference holds without them
        rest = [t for i, t in enumerate(texts) if i not in found]
        reference = Bigrams.of([words(t) for t in rest], rest) if rest else None
    verdicts = _judged(texts, reference)
    if _mostly_salad(texts, verdicts, reference) if mostly is None else mostly:
        verdicts = _judged(texts, reference, small=True)
    return [found.get(i, verdict) for i, verdict in enumerate(verdicts)]


def _mostly_salad(texts: Sequence[str], verdicts: Sequence[Verdict | None], reference: Bigrams | None) -> bool:
    """Whether `texts` were judged by the full rule (`reference`, None: their own, holds CORPUS_WORDS) and those judged
    word salad hold MOSTLY_SALAD of their words. A source's own reference (prepare's: its sample's) is then mostly
    salad, whose random pairs a real document's pairs are no likelier than, so the full rule (SALAD_BITS) named real
    pages too: 800 documents of salad of licence words beside 50 licence paragraphs, 22 of the 50 named, in training
    and prepare alike. The small-source rule's second witness, each document's own word order (word_order.py), spares
    them (1 of 50; 747 of the 800 salad still named). Prepare judges it per source, on its sample (`mostly_salad`)."""
    lengths = np.array([word_count(t) for t in texts], dtype=np.int64)
    full = (int(lengths.sum()) if reference is None else reference.total) >= CORPUS_WORDS
    salad = np.array([v is not None and v.kind == "word salad" for v in verdicts], dtype=bool)
    return full and bool(lengths[salad].sum() >= MOSTLY_SALAD * max(int(lengths.sum()), 1))


def mostly_salad(texts: Sequence[str], reference: Bigrams) -> bool:
    """Whether a source's sample (`texts`, `reference`: their word pairs, `reference()`) is mostly word salad
    (`_mostly_salad`): prepare then judges each batch of the source by the small-source rule, as training judges the
    source whole. Judged per batch (shards.ENCODE_CHARS, one file's documents), a file of real pages beside a larger
    file of salad was under the bar: 68 of 300 real paragraphs named (docs/data.md)."""
    return _mostly_salad(texts, kinds(texts, reference, mostly=False), reference)


def alone(texts: Sequence[str]) -> dict[int, Verdict]:
    """{index: its verdict} of the documents of 2 x PIECE_WORDS words or more whose pieces, judged against each
    other alone, are word salad. A source's reference is its documents' own word pairs: 400K words of salad in one
    line beside 25K of licences were most of theirs, so the salad's pairs were the reference (left out of it to be
    judged, the rest held too few of its distant pairs for its order to be judged at all), and named real pages
    (docs/data.md). A real document's pieces predict each other's word order; salad's do not."""
    found = {}
    for i, text in enumerate(texts):
        if len(text) >= 2 * PIECE_WORDS and len(words(text)) >= 2 * PIECE_WORDS:
            verdict = _judged([text])[0]
            if verdict is not None and verdict.kind == "word salad":
                found[i] = verdict
    return found


def reference(texts: Sequence[str]) -> Bigrams:
    """The word pairs of a sample (`trimtab data prepare`'s) that its sources' word salad is judged against: its
    large documents of word salad (`alone`) left out, as a run's own reference leaves them out (`kinds`)."""
    found = alone(texts)
    kept = [text for i, text in enumerate(texts) if i not in found]
    return Bigrams.of([words(t) for t in kept], kept)


def _judged(texts: Sequence[str], reference: Bigrams | None = None, small: bool = False) -> list[Verdict | None]:
    """`kinds` but `alone`: word salad judged against `reference`, or the documents' own bigrams; by the small-source
    rule when `small` or the reference holds under CORPUS_WORDS words."""
    tokens = [words(t) for t in texts]
    lengths = doc_lengths(tokens)
    cut = pieces(lengths)
    if reference is None:  # the documents' own: their words mapped to ids once
        vocab: dict[str, int] = {}
        ids = word_ids(tokens, vocab)
        reference, member = Bigrams.of_ids(ids, cut, vocab, []), np.ones(len(texts), dtype=bool)
    else:
        ids, member = word_ids(tokens, reference.vocab, grow=False), np.isin(text_hashes(texts), reference.members)
    small = small or reference.total < CORPUS_WORDS
    if reference.total >= SMALL_WORDS:
        bits, scored = _word_order(texts, tokens, ids, cut, reference, member, small)
    else:  # too little text to say which words follow which
        bits, scored = np.zeros(len(texts)), np.zeros(len(texts), dtype=np.int64)
    share, long = scrambled(tokens, ids, reference, member)
    bar = SMALL_BITS if small else SALAD_BITS
    return [
        _verdict(text, ws, float(b), int(n), float(s) if m >= MIN_LONG else 0.0, bar)
        for text, ws, b, n, s, m in zip(texts, tokens, bits, scored, share, long)
    ]


def pieces(lengths: np.ndarray) -> np.ndarray:
    """int64 [P]: the words of each piece the documents of `lengths` words are judged in for word salad, in order:
    a document of 2 x PIECE_WORDS or more is cut into equal pieces of PIECE_WORDS or more, each judged against the
    reference less itself, its other pieces included."""
    counts = piece_counts(lengths)
    return np.concatenate([np.diff(np.linspace(0, n, k + 1).astype(np.int64)) for n, k in zip(lengths, counts)] + [
        np.zeros(0, dtype=np.int64)])  # fmt: skip


def piece_counts(lengths: np.ndarray) -> np.ndarray:
    """int64 [D]: how many pieces (`pieces`) each document of `lengths` words is judged in."""
    return np.maximum(np.asarray(lengths, dtype=np.int64) // PIECE_WORDS, 1)


def _word_order(
    texts: Sequence[str], tokens: list[list[str]], ids: np.ndarray, cut: np.ndarray, reference: Bigrams,
    member: np.ndarray, small: bool,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(bits [D], scored [D]): each document's word salad statistic (bigrams.salad_bits_of_ids), judged in its
    pieces (`cut`: their words) and averaged over their scored pairs; under the small-source rule, smoothed by each
    word's followers (bigrams.prior), a piece in an order of its own (word_order.ordered) or avoiding its pairs
    (ANTI_ORDER) is not scored."""
    owner = np.repeat(np.arange(len(texts)), piece_counts(doc_lengths(tokens)))
    apart = np.concatenate([spaced(t) for t in texts]) if texts else np.zeros(0, dtype=bool)
    known = SMALL_KNOWN if small else KNOWN_PAIRS
    bits, scored = salad_bits_of_ids(ids, cut, reference, member[owner], apart, known, followers=small)
    if small:  # the small-source rule (SMALL_WORDS): not named where its bits or its own repeats say order
        named = np.flatnonzero((scored >= MIN_PAIRS) & (bits < SMALL_BITS))
        flat, starts = [w for ws in tokens for w in ws], np.concatenate([[0], np.cumsum(cut)])
        piece_tokens = [flat[starts[i] : starts[i + 1]] for i in range(len(cut))]
        # seeded by the text and the piece's number within it: a document's answer is its own, whatever the batch
        within = (named - np.searchsorted(owner, owner[named])).astype(np.uint64)
        order = word_order.ordered(piece_tokens, apart, named, text_hashes([texts[i] for i in owner[named]]) ^ within)
        scored = np.where(np.isin(np.arange(len(cut)), named[order | (bits[named] <= ANTI_ORDER)]), 0, scored)
    total = np.bincount(owner, weights=scored, minlength=len(texts))
    mean = np.bincount(owner, weights=bits * scored, minlength=len(texts)) / np.maximum(total, 1)
    return mean, total.astype(np.int64)


def _verdict(
    text: str, ws: list[str], bits: float, scored: int, misspelt: float, bar: float = SALAD_BITS
) -> Verdict | None:
    if len(text) < MIN_CHARS:
        return None
    if (share := mojibake_share(text)) is not None:
        return Verdict("mojibake", share, MOJIBAKE_SHARE)
    if (dumped := dump_share(text)) >= DUMP:
        return Verdict("hex or base64 dump", dumped, DUMP, dump_span(text))
    if (repeated := repeated_share(text)) >= REPEATED:
        return Verdict("repeated text", repeated, REPEATED)
    structure, neighbours = letter_structure(text) or (None, None)
    if structure is not None and structure < quality.STRUCTURE:
        return Verdict("random letters", structure, quality.STRUCTURE)
    # after random letters, the narrower kind: letters and spaces at a language's frequencies are that
    if quality.random_characters(text, neighbours):
        found = quality.information(quality.symbols_of(text)) if neighbours is None else neighbours
        return Verdict("random characters", found, quality.NOISE_BITS)
    if scored >= MIN_PAIRS and bits < bar and prose(text, ws):
        return Verdict("word salad", bits, bar)
    if misspelt >= SCRAMBLED:
        return Verdict("scrambled words", misspelt, SCRAMBLED)
    return None


def report(
    verdicts: Sequence[Verdict | None], which: np.ndarray, names: Sequence[str], n_bytes: np.ndarray, key: str,
    dropped: bool,
) -> str:  # fmt: skip
    """One console line for the documents `which` (bool [D]) that pack like text but are junk: how
    many of each kind, their share of the source's bytes (`n_bytes`: each document's), the first few
    by name with their score and bar, and what was done."""
    where = np.flatnonzero(which)
    share = float(np.asarray(n_bytes)[where].sum()) / max(float(np.sum(n_bytes)), 1.0)
    counts = Counter(verdicts[i].kind for i in where if verdicts[i])
    first = ", ".join(f"{names[i]} ({verdicts[i]})" for i in where[: quality.SHOWN])
    more = ", ..." if len(where) > quality.SHOWN else ""
    done = (
        "left out (data.garbage_filter=drop)"
        if dropped
        else "kept (the orchestrator in auto mode leaves their training rows out); data.garbage_filter=drop leaves "
        "them out, off skips this check"
    )
    kinds_said = ", ".join(f"{n:,} {kind}" for kind, n in sorted(counts.items()))
    return (
        f"{key}: {len(where):,} of {counted(len(which), 'document')} ({share:.1%} of the bytes) pack like text but "
        "are junk "
        f"({kinds_said}; "
        f"data/junk.py): {first}{more}; {done}"
    )


def spare_repeats(
    texts: Sequence[str], verdicts: Sequence[Verdict | None], share: float | None = None
) -> tuple[list[Verdict | None], int]:
    """`verdicts` less those of repeated text when it is at least MOSTLY_REPEATED of the source's judged documents
    (`share`, measured on its sample; default: `texts`' own), which is then a text repeated on purpose that would else
    leave no training row; and how many were spared."""
    repeated = [i for i, v in enumerate(verdicts) if v is not None and v.kind == "repeated text"]
    if share is None:
        share = len(repeated) / max(sum(len(text) >= MIN_CHARS for text in texts), 1)
    if not repeated or share < MOSTLY_REPEATED:
        return list(verdicts), 0
    spared = set(repeated)
    return [None if i in spared else v for i, v in enumerate(verdicts)], len(repeated)


def repeated_fraction(texts: Sequence[str]) -> float:
    """The share of `texts` judged (MIN_CHARS or more) that are repeated text: `spare_repeats`' `share` for a sample."""
    judged = [text for text in texts if len(text) >= MIN_CHARS]
    return sum(repeated_share(text) >= REPEATED for text in judged) / max(len(judged), 1)


def repeats_line(count: int, of: int | None, key: str) -> str:
    """The console line for `count` documents of repeated text kept as most of their source (`of` documents)."""
    share = f"{count:,} of {counted(of, 'document')}" if of is not None else counted(count, "document")
    verb = "is" if count == 1 else "are"
    return (
        f"{key}: {share} {verb} repeated text ({SAID['repeated text']}; data/repeats.py), at least "
        f"{MOSTLY_REPEATED:.0%} of the source, so kept as its meant content (a toy or deliberately repeated corpus): "
        "a model trained on it learns to repeat. If it is not meant, deduplicate it or give the source real text"
    )


def holds_words(texts: Sequence[str], n: int) -> bool:
    """Whether `texts` hold `n` words or more (`words`'), counted no further than the nth."""
    found = itertools.chain.from_iterable(_WORD.finditer(text) for text in texts)
    return next(itertools.islice(found, n - 1, None), None) is not None


def unjudged_line(sources: Sequence[str], samples: Sequence[tuple[int, int] | None] = ()) -> str:
    """The console line for the sources whose reference holds under SMALL_WORDS words: word salad not judged against
    it. `samples`: each source's sample's words and those of them in documents judged word salad whole (`alone`) and
    so left out of its reference, where measured (prepare's). A one-file source of 802K characters, 43% salad, read
    "their sample holds under 5,000 words" and "word salad was not judged" of a sample of 130K words that was judged
    salad whole, while its stretches were judged and one named (docs/data.md)."""
    said = [_sample_said(source, sample) for source, sample in itertools.zip_longest(sources, samples)]
    shown = ", ".join(said[: quality.SHOWN]) + (", ..." if len(said) > quality.SHOWN else "")
    return (
        f"word salad (real words in random order) was not judged against the word pairs of {len(sources):,} "
        f"source(s) ({shown}): their reference holds under {SMALL_WORDS:,} words, too few to tell which words follow "
        f"which (data/junk.py SMALL_WORDS). Judged all the same: their other junk, and the word order of the "
        f"stretches of a long text file of {CORPUS_WORDS:,} words or more, each against the file's others "
        "(data/stretches.py). A larger source of the same kind of text is judged"
    )


def _sample_said(source: str, sample: tuple[int, int] | None) -> str:
    """A source of `unjudged_line`, with its sample's words and those left out of its reference, when known."""
    if sample is None:
        return source
    words, left_out = sample
    if not left_out:
        return f"{source}: a sample of {words:,} words"
    return (
        f"{source}: a sample of {words:,} words, {left_out:,} of them in documents judged word salad whole and so "
        "left out of its reference"
    )
