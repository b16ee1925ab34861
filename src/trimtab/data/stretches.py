"""Junk inside a long plain-text file that is mostly text: its stretches, judged and said on their own.

A long text file is one document read in pieces (formats.TEXT_CHUNK_CHARS); it is flagged whole when its junk
holds half its characters (shards._Encoder._in_pieces). Judged in pieces of 1M characters, 400K characters of
word salad in the middle of a 3 MB file of prose held 40% of one piece and 13% of the file: nothing was named,
and the salad was trained on. Each piece is judged in stretches of JUDGE_CHARS (cut where the file's pieces are,
so the tokens are the whole file's), and a junk stretch of a file kept is said, and left out with
data.garbage_filter=drop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trimtab.data import formats, junk

# Characters a long text file's stretch is judged in: about 0.75 x junk.PIECE_WORDS words (English: ~6-7 characters
# a word), one judging piece, so a stretch of junk of twice this is judged junk in at least one stretch whole.
JUDGE_CHARS = 100_000
SHOWN = 5  # stretches named on the console


@dataclass
class Stretch:
    """Characters [start, end) of a file's document judged junk (`why`: junk.Verdict's words)."""

    file: int
    start: int
    end: int
    why: str

    def joins(self, other: Stretch) -> bool:
        return self.file == other.file and self.end == other.start


def split(text: str) -> list[str]:
    """A long text file's piece in stretches of at most JUDGE_CHARS characters, cut as its pieces are cut."""
    return list(formats.pieces(text, JUDGE_CHARS))


def merged(found: Sequence[Stretch]) -> list[Stretch]:
    """Adjacent stretches of one file as one (the first one's verdict)."""
    out: list[Stretch] = []
    for s in found:
        if out and out[-1].joins(s):
            out[-1] = Stretch(s.file, out[-1].start, s.end, out[-1].why)
        else:
            out.append(s)
    return out


def inside(texts: Sequence[str], names: Sequence[str], flagged: Sequence[bool]) -> list[tuple[str, int, int, str]]:
    """(name, start, end, why) of the junk stretches inside the documents not flagged whole of over 2 x JUDGE_CHARS
    characters, each document's stretches judged against each other (as prepare judges a long file's): training's
    in-memory screen judged a long document whole only, so 400K characters of salad in a 3 MB file (13%) went
    unsaid and were trained on."""
    return [(names[s.file], s.start, s.end, s.why) for s in found_in(texts, flagged)]


def found_in(texts: Sequence[str], flagged: Sequence[bool]) -> list[Stretch]:
    """The junk stretches of `inside`, each document's merged."""
    found: list[Stretch] = []
    for i, text in enumerate(texts):
        if flagged[i] or len(text) <= 2 * JUDGE_CHARS:
            continue
        parts, start = split(text), 0
        for part, why in zip(parts, junk.kinds(parts)):
            if why is not None:
                found.append(Stretch(i, start, start + len(part), str(why)))
            start += len(part)
    return merged(found)


def mostly_text(texts: Sequence[str], found: Sequence[Stretch]) -> set[int]:
    """The documents whose junk stretches (`found`) hold under half their characters: mostly text, as prepare's rule
    flags a long file whole only when its junk holds half its characters (shards._Encoder._in_pieces)."""
    junk_chars: dict[int, int] = {}
    for s in found:
        junk_chars[s.file] = junk_chars.get(s.file, 0) + s.end - s.start
    return {i for i, chars in junk_chars.items() if 2 * chars < len(texts[i])}


def left_out(text: str, found: Sequence[Stretch]) -> str:
    """`text` less its junk stretches (`found`, in order): the rest of the document, as prepare's drop keeps it."""
    kept, at = [], 0
    for s in found:
        kept.append(text[at : s.start])
        at = s.end
    return "".join([*kept, text[at:]])


def line(found: Sequence[tuple[str, int, int, str]], dropped: bool, training: bool = False) -> str:
    """The console line for junk stretches (path, start, end, why) inside files otherwise kept."""
    chars = sum(end - start for _, start, end, _ in found)
    shown = ", ".join(f"{p} characters {a:,}-{b:,} ({why})" for p, a, b, why in found[:SHOWN])
    more = ", ..." if len(found) > SHOWN else ""
    done = (
        "left out (--garbage-filter drop), the rest of each file kept"
        if dropped
        else ("kept, and trained on; --garbage-filter drop leaves them out and keeps the rest of each file")
    )
    if training:  # training's in-memory screen: its documents, its config key
        done = (
            "left out (data.garbage_filter=drop), the rest of each document trained on"
            if dropped
            else "kept, and trained on; data.garbage_filter=drop leaves them out, the rest of each document trained on"
        )
    return (
        f"{len(found):,} stretches of junk ({chars:,} characters) inside long text files that are mostly text "
        f"(data/stretches.py): {shown}{more}; {done}"
    )
