"""Mis-encoded pages (`mojibake_share`): UTF-8 read as cp1252 or Latin-1 and written back ("Ã©tÃ©" for "été").
Told by ftfy's test (Speer, "ftfy: fixes text for you"): the characters' cp1252/Latin-1 bytes decode as UTF-8
again, for many of the page's non-ASCII characters. Judged per document by junk.kinds."""

from __future__ import annotations

import re

from trimtab.data import quality

MOJIBAKE_RUNS = 4  # mis-encoded characters a page needs to be judged mis-encoded
MOJIBAKE_SHARE = 0.5  # of its non-ASCII characters in them (mis-encoded pages: ~1)


def mojibake_share(text: str) -> float | None:
    """The share of `text`'s non-ASCII characters in runs whose cp1252/Latin-1 bytes are one UTF-8
    character ("Ã©" for "é", "â€™" for "’") when a page read in the wrong encoding: at least
    MOJIBAKE_RUNS such runs, holding at least MOJIBAKE_SHARE of them (ftfy's test, without its
    dependency); None for the rest."""
    if text.isascii():  # most documents: nothing to have been mis-encoded
        return None
    runs = [run for run in _MOJIBAKE_RUN.findall(text) if _round_trips(run)]
    foreign = len(text) - len(text.encode("ascii", errors="ignore"))
    share = sum(map(len, runs)) / max(foreign, 1)
    return share if len(runs) >= MOJIBAKE_RUNS and share >= MOJIBAKE_SHARE else None


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
    more = f"[{re.escape(quality.bytes_as_text(0x80, 0xBF))}]"
    leads = ((0xC2, 0xDF, 1), (0xE0, 0xEF, 2), (0xF0, 0xF4, 3))
    return re.compile("|".join(f"[{re.escape(quality.bytes_as_text(lo, hi))}]{more}{{{n}}}" for lo, hi, n in leads))


_MOJIBAKE_RUN = _run_pattern()
