"""Data attribution (orchestrator/attribution.py) against a small held-out reference: the bar widens
as a t quantile does for a spread estimated from few rows, so a reference whose spread came out tight
by chance leaves no clean row out, while garbage is still caught."""

from __future__ import annotations

import random

from test_data_watch_blame import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution

# debug, train.seed=3: the held-out split is one document of 9 rows; these 9 have a MAD-based spread
# of 0.12 where the text's rows spread 0.25 (a draw the MAD's ~40% standard error at n=9 allows)
SMALL = [5.08, 5.12, 5.12, 5.2, 5.2, 5.2, 5.28, 5.28, 5.32]


def _step() -> dict[int, float]:
    """A bad stretch's rows: 27 clean rows as the text spreads (5.2, 0.25), a clean hard one 2.8 of
    the text's spreads out (a normal tail over a watch's 320 rows reaches 3.4), and 4 garbage rows as
    debug's step 20 scored them (7.07)."""
    rng = random.Random(3)
    clean = {r: min(rng.gauss(5.2, 0.25), 5.6) for r in range(27)}
    return clean | {27: 5.2 + 2.8 * 0.25} | {r: 7.07 for r in range(28, 32)}


def test_a_small_references_tight_spread_leaves_no_clean_row_out_and_garbage_still_goes():
    data = DataAttribution(OrchestratorConfig())
    bad, evidence = data.score(View(_step(), SMALL), list(range(32)))
    assert evidence["reference_rows"] == 9 and evidence["reference_spread"] < 0.13
    assert bad == [28, 29, 30, 31]  # before: 4 x 0.12 = 0.48 -> the 0.5-nat floor, and row 27 (0.7 out) left out
    assert evidence["threshold"] > 5.2 + 2.8 * 0.25


def test_the_widening_fades_as_the_reference_grows():
    """64 held-out rows (the default reference_rows): the bar moves by under a tenth of itself."""
    rng = random.Random(0)
    held = [rng.gauss(5.14, 0.14) for _ in range(64)]
    evidence = DataAttribution(OrchestratorConfig()).score(View({0: 5.1}, held), [0])[1]
    gap, spread = evidence["threshold"] - evidence["reference_median"], evidence["reference_spread"]
    assert 4 * spread < gap < 1.1 * 4 * spread


def test_a_held_out_split_of_few_rows_gives_way_to_the_steps_own_rows():
    """debug, seed 0, bad_rows@20: the held-out split held 3 rows of one file (spread 0.013), so the
    bar was the 0.5-nat floor over their median and a clean row 0.5 over it was left out with the
    garbage. Under MIN_OWN held-out rows the step's scored rows are the reference, as a mixture
    source's are: the clean row stays, the garbage (4 rows as debug's step 20 scored them) goes."""
    rows = _step() | {27: 5.8}
    bad, evidence = DataAttribution(OrchestratorConfig()).score(View(rows, [5.24, 5.25, 5.26]), list(rows))
    assert bad == [28, 29, 30, 31]  # before: row 27 too, over 5.25 + 0.5
    assert evidence["reference_rows"] == 32 and evidence["threshold"] > 5.8
