"""`trimtab plan --data` on raw text: the junk screen training runs on it (data/packing.py _screen, data/junk.py),
on a sample (data/junk_sample.py) so the plan stays fast. A prepared directory's is its manifest's (chinchilla.py);
raw text had none, so a corpus of random characters was planned at its full 49,000 tokens, where training refuses
it, and a corpus 75% word salad by bytes was planned whole, where training leaves the salad out."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trimtab.config import RunConfig
from trimtab.errors import ConfigError
from trimtab.words import all_of

if TYPE_CHECKING:
    from trimtab.data.junk import Verdict
    from trimtab.data.junk_sample import Sampled

log = logging.getLogger(__name__)
SHOWN = 3  # junk documents named


@dataclass(frozen=True)
class Screened:
    """The share of the data's bytes judged junk (the sample's: an estimate), how many of each kind, and whether
    training leaves those documents out of its tokens (data.garbage_filter=drop, or warn with the orchestrator in
    auto mode: data/held_out.py screened_out)."""

    share: float
    kinds: str
    left_out: bool


def screen(cfg: RunConfig, texts: Sequence[str], names: Sequence[str], path: str, key: str) -> Screened | None:
    """The junk screen of the documents `texts` (named `names`) read from `path`; None with data.garbage_filter=off or
    none judged junk. Every document junk is refused as training refuses it (a source of junk alone:
    packing.JunkSource); a sample all junk is judged whole first, as the sample cannot tell every document."""
    from trimtab.data.held_out import screened_out
    from trimtab.data.junk_sample import SAMPLE_CHARS, sampled_kinds

    if cfg.data.garbage_filter == "off" or not texts:
        return None
    found = sampled_kinds(texts)
    junky = np.array([v is not None for v in found.verdicts], dtype=bool)
    if not junky.any():
        return None
    kinds = _kinds(found.verdicts)
    if junky.all() and not found.whole:
        found = _judged_whole(texts)  # the sample cannot tell a source of junk alone, which training refuses
        junky = np.array([v is not None for v in found.verdicts], dtype=bool)
        kinds = _kinds(found.verdicts)
    if found.whole and junky.all():
        raise ConfigError(
            f"{key} {path}: {all_of(len(texts), 'document')} is junk ({kinds}; data/junk.py): training "
            "refuses it alone and leaves it out of a mixture, so it has no training tokens; plan on the data that "
            "trains, or set data.garbage_filter=off to count it as it is"
        )
    n_bytes = np.array([len(texts[i].encode()) for i in found.which], dtype=np.float64)
    share = float(n_bytes[junky].sum() / max(n_bytes.sum(), 1.0))
    shown = [f"{names[i]} ({v})" for i, v in zip(found.which, found.verdicts) if v][:SHOWN]
    where = (
        "of its documents"
        if found.whole
        else f"of a sample of {len(found.which):,} of its {len(texts):,} documents (their first {SAMPLE_CHARS:,} "
        "characters at most: an estimate)"
    )
    said = (
        f"{int(junky.sum()):,} {where} ({share:.1%} of the bytes) are junk ({kinds}; data/junk.py, as training judges "
        f"them): {', '.join(shown)}"
    )
    left_out = cfg.data.garbage_filter == "drop" or screened_out(cfg.data, cfg)
    log.warning("%s %s: %s", key, path, said)
    return Screened(share, kinds, left_out)


def _kinds(verdicts: Sequence[Verdict | None]) -> str:
    """How many documents of each junk kind, e.g. "2 random characters, 5 word salad"."""
    return ", ".join(f"{n:,} {kind}" for kind, n in sorted(Counter(v.kind for v in verdicts if v).items()))


def _judged_whole(texts: Sequence[str]) -> Sampled:
    """Every document judged whole, as training judges them (data/packing.py _screen): only when the sample is all
    junk, where a warning let `plan --data` plan a source that training refuses; a rare case, so its full cost
    (about 3 s a MB, junk_sample.py) is paid only there."""
    from trimtab.data import junk
    from trimtab.data.junk_sample import Sampled  # noqa: F811 (the runtime import; lazy, as the screen's are)

    verdicts, _ = junk.spare_repeats(list(texts), junk.kinds(list(texts)))
    return Sampled(np.arange(len(texts), dtype=np.int64), verdicts, True)
