"""What `trimtab data prepare` says at its end about the documents it flagged and the records it skipped
(moved out of prepare.py, which holds the preparing)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from trimtab.data import junk, quality
from trimtab.data.shards import PACKING, SKIPPED_SHOWN
from trimtab.words import counted


def garbage_line(manifest: dict[str, Any], kinds: Counter[str], names: list[str], dropped: bool) -> str:
    """One console line for the documents this prepare flagged, by kind (`kinds`: shards.PACKING or
    one of junk.KINDS, each with its count); the files prepared before it have their own counts in
    the manifest."""
    count = sum(kinds.values())
    places = ", ".join(names[: quality.SHOWN]) + (", ..." if count > quality.SHOWN else "")
    done = "left out (--garbage-filter drop)" if dropped else "kept; --garbage-filter drop leaves them out"
    said = []
    if kinds[PACKING]:
        scale = manifest["garbage"]
        said.append(
            f"{kinds[PACKING]:,} pack under {scale['threshold']:.2f}x the sources' median {scale['median']:.2f} bytes "
            "per token, as random bytes, base64, hex dumps, mis-encoded text and scripts "
            "the tokenizer does not know do"
        )
    said += [f"{kinds[kind]:,} {kind} ({junk.SAID[kind]})" for kind in junk.KINDS if kinds[kind]]
    flagged = f"{counted(count, 'document')} flagged (counted per file in the manifest)"
    return f"{flagged}: {'; '.join(said)}: {places}; {done}"


def skipped_line(count: int, where: list[str]) -> str:
    """One console line for the malformed records a prepare skipped: how many, the first few
    (the manifest counts them per file)."""
    places = ", ".join(where[:SKIPPED_SHOWN]) + (", ..." if count > min(len(where), SKIPPED_SHOWN) else "")
    return f"skipped {count:,} malformed record{'s' if count != 1 else ''}: {places}"
