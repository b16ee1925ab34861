"""A large file's share of `trimtab data prepare`'s 8 MB sample (prepare._sample), read from across it rather than
from its head: a file whose text changes past its head (a crawl's later domains, a log's later years, a code dump
whose vendored junk comes last) gave the garbage screen's scale and the junk screen's word pairs its head's kind
only. WINDOWS windows, one at a seeded place in each of as many equal strata of the file (stratified sampling: every
part of the file is drawn from, none twice), each cut to whole lines: bounded reads, nothing else of the file read.
Uncompressed plain text and JSONL only: a compressed archive or a table cannot be entered mid-way, and keeps its
head."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from trimtab.data import formats

WINDOWS = 16  # places a large file's share is read from
MAX_LINE = 1 << 20  # bytes read past a window's end for its last line to end; a longer line ends the window unread


def seekable(path: Path, fmt: str) -> bool:
    """Whether `path` can be read from anywhere: plain text or JSONL, not compressed, not a table."""
    return formats.kind_of(path, fmt) != "columnar" and path.suffix.lower() not in formats.COMPRESSED


def spans(path: Path, share: int) -> list[formats.Span]:
    """[start, end, 0] byte ranges of `path` of about share / WINDOWS bytes each, one in each of WINDOWS equal strata,
    at an offset drawn from a generator seeded by the file's name and size (the same file: the same sample), each
    from a line start to a line start; empty ones left out. Line numbers are not counted (0): the sample names no
    line."""
    size = path.stat().st_size
    length = max(share // WINDOWS, 1)
    rng = random.Random(f"{path.name}:{size}")
    out = []
    with open(path, "rb") as fh:
        for k in range(WINDOWS):
            low, high = k * size // WINDOWS, (k + 1) * size // WINDOWS
            offset = low + int(rng.random() * max(high - low - length, 0))
            start, end = _line_start(fh, offset), _line_start(fh, min(offset + length, size))
            if start is not None and end is not None and end > start:
                out.append([start, end, 0])
    return out


def _line_start(fh: BinaryIO, offset: int) -> int | None:
    """The first line start at or after `offset` (the file's end when none), None past MAX_LINE bytes of one line."""
    if offset == 0:
        return 0
    fh.seek(offset - 1)
    block = fh.read(MAX_LINE + 1)
    at = block.find(b"\n")
    if at >= 0:
        return offset + at
    return offset - 1 + len(block) if len(block) <= MAX_LINE else None


def text(path: Path, spans_: list[formats.Span]) -> Iterator[str]:
    """Each span of a plain-text file as text; a span that is not UTF-8 or holds a NUL byte (a binary file) ends the
    reading with formats.Unreadable, as reading the file whole does."""
    with open(path, "rb") as fh:
        for start, end, _ in spans_:
            fh.seek(start)
            try:
                piece = fh.read(end - start).decode("utf-8-sig" if start == 0 else "utf-8")
            except UnicodeDecodeError as exc:
                raise formats.Unreadable(f"{path}: not UTF-8 ({exc.reason}) near byte {start + exc.start}") from None
            if "\x00" in piece:
                raise formats.Unreadable(f"{path}: a NUL byte near byte {start}: binary")
            yield piece
