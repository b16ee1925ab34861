"""The data watch (orchestrator/attribution.py) judges a mixture's rows against their own source's
held-out rows, as the rows rule judges them among their source's (outliers.py)."""

from __future__ import annotations

import random

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution


class MixView:
    """A mixture's run: a memorised source d (its held-out rows ~1.6 fill most of the first 64), a
    rare fresh one a (held-out ~4.8, its training rows ~5.4), and c and e, whose eval splits hold
    2 rows and none."""

    def __init__(self, scores: dict[int, tuple[str, float]]):
        rng = random.Random(0)
        self.scores = scores
        self.held = {
            "d": [rng.gauss(1.6, 0.1) for _ in range(48)],
            "a": [rng.gauss(4.8, 0.3) for _ in range(40)],
            "c": [3.0, 3.1],
            "e": [],
        }

    def row_losses(self, rows):
        return {r: self.scores[r][1] for r in rows}

    def row_parts(self, rows):
        return {r: self.scores[r][0] for r in rows}

    def row_sources(self, rows):
        return {f"{self.scores[r][0]}.py": 1 for r in rows}

    def held_out_row_losses(self, limit, part=None):
        # the sets in mixture order, as HeldOut holds them: without a part, d's rows come first
        return (self.held[part] if part else [x for p in ("d", "a", "c", "e") for x in self.held[p]])[:limit]


def test_a_rare_sources_fresh_rows_are_judged_against_its_own_held_out_rows():
    """Soak (debug, stdlib files at weight 0.1 beside abc.py at 0.9): the watch judged the rare
    source's fresh rows (~5.4 nats) against held-out rows mixed across sources, whose median the
    memorised source's pulled down, and left them out as garbage. Judged against the rare source's
    own held-out rows none is; garbage in any source still is, a source with too few held-out rows
    among its own scored rows (c), or with too few of those against every source's (e); the evidence
    names each row's source."""
    rng = random.Random(1)
    scores = {r: ("a", rng.gauss(5.4, 0.15)) for r in range(6)}
    scores |= {r: ("d", rng.gauss(1.1, 0.05)) for r in range(100, 130)}
    scores |= {r: ("c", rng.gauss(3.2, 0.2)) for r in range(200, 210)}
    watch = DataAttribution(OrchestratorConfig())
    assert watch.score(MixView(scores), list(scores))[0] == []  # the mixed reference's median: 1.7
    scores |= {7: ("a", 10.0), 130: ("d", 7.0), 210: ("c", 9.0), 303: ("e", 9.0)}
    bad, evidence = watch.score(MixView(scores), list(scores))
    assert bad == [7, 130, 210, 303] and evidence["parts"] == {"7": "a", "130": "d", "210": "c", "303": "e"}
    references = evidence["references"]
    assert references["a"]["median"] == pytest.approx(4.8, abs=0.15) and references["a"]["reference"] == "own held-out"
    assert references["c"]["reference"] == "own scored rows" and references["c"]["rows"] == 11
    assert references["e"]["reference"] == "all sources' held-out" and references["e"]["rows"] == 64
    assert evidence["reference_median"] == references["a"]["median"]  # the first bad row's source's
