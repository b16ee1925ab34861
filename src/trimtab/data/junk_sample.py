"""The junk screen (data/junk.py) on a sample of a source's documents, for a figure that must come fast: `trimtab
plan --data` on raw text, where training judges every document (data/packing.py _screen) at about 3 s a MB on one
core (measured: 1.2 MB of word salad beside licences, 4.1 s), which would make a plan of a 100 MB corpus take minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trimtab.data import junk

# characters judged: over CORPUS_WORDS words of English (~6 characters a word), so word salad is judged by the full
# rule (junk.CORPUS_WORDS), not the small-source one; about 3 s
SAMPLE_CHARS = 1_000_000


@dataclass(frozen=True)
class Sampled:
    """The documents judged (`which`: indices into the source's, sorted), their verdicts, and whether that was the
    whole source, each document whole (`whole`: then its figures are training's own)."""

    which: np.ndarray
    verdicts: list[junk.Verdict | None]
    whole: bool


def sampled_kinds(texts: Sequence[str], budget: int = SAMPLE_CHARS, seed: int = 0) -> Sampled:
    """junk.kinds (then junk.spare_repeats, as training) on documents of `texts` drawn in a seeded order until
    `budget` characters, each cut to its first `budget` (a document of one huge line judged on its head: junk.kinds
    judges one of 2 x junk.PIECE_WORDS words in pieces, against each other, as training does)."""
    order = np.random.default_rng(seed).permutation(len(texts))
    taken, chars = [], 0
    for i in order:
        if chars >= budget:
            break
        taken.append(int(i))
        chars += min(len(texts[i]), budget)
    which = np.sort(np.array(taken, dtype=np.int64))
    judged = [texts[i][:budget] for i in which]
    verdicts, _ = junk.spare_repeats(judged, junk.kinds(judged))
    whole = len(which) == len(texts) and all(len(texts[i]) <= budget for i in which)
    return Sampled(which, verdicts, whole)
