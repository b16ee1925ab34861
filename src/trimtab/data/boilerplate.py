"""Boilerplate: the same line in many documents (a licence header at the top of most files, a cookie banner or a
navigation menu on every page). Each document is text, so no per-document screen (junk.py, repeats.py) sees it, yet a
corpus that is a fifth boilerplate spends a fifth of its tokens on a few lines the model learns by heart (Lee et al.
2022, "Deduplicating Training Data Makes Language Models Better", remove such spans across documents). Measured on
`trimtab data prepare`'s sample and said in its report and manifest (`boilerplate`), not removed: a line repeated on
purpose (a code file's `from __future__ import annotations`) is the corpus's own. Line-level, as Gopher's and C4's
line filters are (Rae et al. 2021, A.1.1; Raffel et al. 2020, 2.2): lines of LINE_CHARS or more after whitespace is
collapsed, in at least MIN_DOCS documents and DOC_SHARE of them. Measured (share of non-space characters in such
lines): 149 man pages 2.5% ("There is NO WARRANTY..."), 150 site-packages modules 2.6%, 171 stdlib modules 0.2%,
docs/*.md 0%, 153 packages' METADATA 5.3% (classifiers), 826 /usr/share/doc/*/copyright files 18.8% (licence texts)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

LINE_CHARS = 30  # shorter lines recur by chance ("OPTIONS", "return None", "}")
MIN_DOCS = 5  # documents a line must be in to be boilerplate (fewer: a passage quoted a few times)
DOC_SHARE = 0.02  # ... and this share of them (in a large sample, a line in 5 of 10,000 documents is not)
SHOWN = 3  # the most common such lines said on the console


def measure(texts: Sequence[str]) -> dict[str, Any]:
    """{"share": the share of `texts`' non-space characters in boilerplate lines, "lines": [[the share of
    documents holding it, the line], ...] for the SHOWN most common, "documents": len(texts)}."""
    docs = [[" ".join(line.split()) for line in text.splitlines()] for text in texts]
    counts = Counter(line for lines in docs for line in {line for line in lines if len(line) >= LINE_CHARS})
    bar = max(MIN_DOCS, DOC_SHARE * len(texts))
    common = {line for line, n in counts.items() if n >= bar}
    total = sum(len("".join(text.split())) for text in texts)
    held = sum(len(line) - line.count(" ") for lines in docs for line in lines if line in common)
    top = sorted(common, key=lambda line: (-counts[line], line))[:SHOWN]
    return {
        "share": held / max(total, 1),
        "lines": [[counts[line] / len(texts), line] for line in top],
        "documents": len(texts),
    }


def said(found: dict[str, Any]) -> str:
    """The console line for `measure`'s result."""
    lines = "; ".join(f'"{line[:80]}" in {share:.0%} of them' for share, line in found["lines"])
    return (
        f"boilerplate: {found['share']:.1%} of the sample's text ({found['documents']:,} documents) is lines found in "
        f"{MIN_DOCS}+ documents and {DOC_SHARE:.0%}+ of them (licence headers, banners, menus; data/boilerplate.py): "
        f"{lines}. Kept; deduplicate the sources if it is not meant to be learnt"
    )
