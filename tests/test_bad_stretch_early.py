"""A long stretch of garbage batches early in a run (bench/healing.py bad_data_early_long, debug, 120
steps, `bad_batch@15:15`): the row gate left out every row of steps 15-29, so their updates were
withheld, and the withheld-updates guard read 11 of 20 withheld as a run that does not train: a rollback
with the LR x0.1, given back over 80 steps, val 4.438 against 4.171 clean. Steps the gate emptied are
the data's: the guard does not count them (withheld.py)."""

from dataclasses import replace

from test_orchestrator_units import metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.withheld import WithheldUpdates

ROWS = 32


def _step(step: int, gated: int, skipped: bool):
    rows = list(range(ROWS * step, ROWS * step + ROWS))
    return replace(metrics(step), rows=rows, gated_rows=rows[:gated], skipped=skipped)


def _findings(gated: int) -> list:
    """Steps 1-14 clean, 15-29 withheld with `gated` of their rows left out by the row gate, 30-40 clean."""
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    steps = [_step(s, gated if 15 <= s < 30 else 0, 15 <= s < 30) for s in range(1, 41)]
    return [f for m in steps if (f := guard.observe(m)) is not None]


def test_a_stretch_of_steps_whose_every_row_the_gate_left_out_is_no_frozen_run():
    assert _findings(gated=ROWS) == []


def test_withheld_steps_with_rows_left_to_train_still_count():
    """A spike's withheld steps, or steps the gate emptied only in part: the guard fires as before."""
    assert [f.step for f in _findings(gated=0)] == [25]
    assert [f.step for f in _findings(gated=ROWS - 1)] == [25]
