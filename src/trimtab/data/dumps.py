"""Hex dumps and base64 in text (`dump_share`): `xxd`, `od`, `hexdump -C` output packs at ~5.5 bytes per token
and its characters carry ~4 bits, so neither the packing screen nor quality.random_characters names it; most of
its characters are in whitespace-separated groups of hex digits or long base64 runs, which real code's hex
constants and hashes (`0x1f`, one digest in a line) are a small share of. Judged per document by junk.kinds."""

from __future__ import annotations

import re
import string

# Share of a document's non-space characters in hex groups or base64 runs (`dump_share`) from which it is a dump.
# Measured on 1.2 KB of random bytes, /bin/ls and stdlib text as xxd, xxd -p, od -A x -t x1z, hexdump -C, base64:
# 0.50-1.0 (the ASCII column is the rest); the stdlib's 5,492 .py files and 1.5 KB pieces of them: <= 0.04
DUMP = 0.5
DUMP_DIGITS = 0.03  # digits of its characters a dump has at least (hex dumps ~0.4, base64 ~0.1; the stdlib's: ~0.02)
HEX_LETTERS = 0.05  # hex groups count only when at least this share of their characters are a-f (decimal tables: 0)
# A blob holding "/" counts when its neighbouring letters and digits change class (upper case, lower case, digit) this
# share of the time at least: random bytes as base64 ~0.62 (1 - the classes' squared shares 26/62, 26/62, 10/62;
# 40 characters: >= 0.32 in 2,000 draws). Paths and URLs are words between slashes ("cfnlint/data/schemas/resources/
# 0300e1630e8b2eb9", pip RECORD files: <= 0.21) and a fraction of long integers ("I/8777...") numbers. A blob
# without "/" (hex, most base64 lines) counts as before: a binary's zero runs mix little. Measured on the stdlib's and
# .venv's text files cut in 1.5 KB pieces: 172 of 298,610 named dumps before, 46 after (embedded base64 images and
# certificates, hex tables, curve constants); `xxd`, `xxd -p`, `od`, `hexdump -C`, base64 of /bin/ls: as before.
BLOB_MIXING = 0.3
# bytes as hex: two digits each, a digit among them ("6c6f", "00000010:", an offset); "cafe", a constant "0010005": not
_HEX_GROUP = re.compile(r"(?=\D*\d)(?:[0-9a-fA-F]{2})+:?")
# base64 or hex wrapped at 64-76 columns or in one line: longer than identifiers ("xmlSecOpenSSLTransformDes3CbcId")
_BLOB = re.compile(r"[A-Za-z0-9+/]{40,}={0,2}")
_GROUP = re.compile(r"\S+")  # a whitespace-separated group, as str.split() gives them
_NO_DIGITS = str.maketrans("", "", "0123456789")
_CLASSES = str.maketrans(
    string.ascii_uppercase + string.ascii_lowercase + string.digits, "U" * 26 + "l" * 26 + "d" * 10
)


def dump_share(text: str) -> float:
    """The share of `text`'s non-space characters in whitespace-separated groups of bytes as hex (`_HEX_GROUP`;
    HEX_LETTERS of their characters a-f, or a table of numbers would be one) or in base64 or hex blobs (`_BLOB`,
    with a digit and a letter): a hex dump's bytes and offsets, a certificate, an embedded image."""
    if len(text) - len(text.translate(_NO_DIGITS)) < DUMP_DIGITS * len(text):  # most documents: read once, in C
        return 0.0
    groups = text.split()
    hexed = [g for g in groups if len(g) < 40 and _HEX_GROUP.fullmatch(g)]  # longer: a blob
    n_hex = sum(map(len, hexed))
    if sum(c.isalpha() for g in hexed for c in g) < HEX_LETTERS * n_hex:
        n_hex = 0
    n_blob = sum(len(b) for b in (m.group() for m in _BLOB.finditer(text)) if _blob(b))
    return (n_hex + n_blob) / max(sum(map(len, groups)), 1)


def dump_span(text: str) -> tuple[int, int]:
    """The UTF-8 byte range [start, end) of `text` from its first to its last character that `dump_share` counts
    (hex groups, base64 or hex blobs): the region a user cuts out. Read for documents judged dumps only."""
    hexed = [m for m in _GROUP.finditer(text) if len(m.group()) < 40 and _HEX_GROUP.fullmatch(m.group())]
    letters = sum(c.isalpha() for m in hexed for c in m.group())
    pieces = [m.span() for m in hexed] if letters >= HEX_LETTERS * sum(len(m.group()) for m in hexed) else []
    pieces += [m.span() for m in _BLOB.finditer(text) if _blob(m.group())]
    first, last = min(a for a, _ in pieces), max(b for _, b in pieces)
    return len(text[:first].encode()), len(text[:last].encode())


def _blob(run: str) -> bool:
    """Whether a `_BLOB` run counts: a digit and a letter, and no "/" unless it mixes classes (BLOB_MIXING)."""
    return (
        any(c.isdigit() for c in run)
        and any(c.isalpha() for c in run)
        and ("/" not in run or _mixing(run) >= BLOB_MIXING)
    )


def _mixing(run: str) -> float:
    """The share of `run`'s neighbouring letters and digits (its / and + left out) of different classes, upper
    case, lower case or digit: random bytes as base64 or hex mix them (BLOB_MIXING), words and numbers do not."""
    classes = run.translate(_CLASSES).replace("+", "").replace("/", "")
    return sum(a != b for a, b in zip(classes, classes[1:])) / max(len(classes) - 1, 1)
