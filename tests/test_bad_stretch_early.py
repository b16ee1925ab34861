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


def _findings(gated: int, stretch: int = 15) -> list:
    """Steps 1-14 clean, `stretch` from 15 withheld with `gated` of their rows left out by the row gate, then clean."""
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    bad = range(15, 15 + stretch)
    steps = [_step(s, gated if s in bad else 0, s in bad) for s in range(1, 15 + stretch + 11)]
    return [f for m in steps if (f := guard.observe(m)) is not None]


def test_a_stretch_of_steps_whose_every_row_the_gate_left_out_is_no_frozen_run():
    found = _findings(gated=ROWS)  # no frozen run: only the stretch's replay at its end (test_stretch_replay.py)
    assert [(f.step, f.family, "replay" in f.evidence) for f in found] == [(30, "data", True)]


def test_withheld_steps_with_rows_left_to_train_still_count():
    """A spike's withheld steps, or steps the gate emptied only in part: the guard fires as before."""
    assert [f.step for f in _findings(gated=0)] == [25]
    assert [f.step for f in _findings(gated=ROWS - 1)] == [25]


def test_garbage_for_good_is_a_run_that_does_not_train_again_past_a_window():
    """Past two windows (40) of fully gated steps a stream that stays garbage is answered (the data's: a stop,
    test_withheld_data.py), a 25-step stretch (the 200-step scenario's) is not (it is replayed once it ends), and a
    resume keeps the streak."""
    found = _findings(gated=ROWS, stretch=25)  # no stop: the stretch's replay at its end
    assert [(f.step, f.family, "replay" in f.evidence) for f in found] == [(40, "data", True)]
    found = _findings(gated=ROWS, stretch=60)  # the stop at the 41st step; were the run not stopped, steps 56-74
    assert [(f.step, "replay" in f.evidence) for f in found] == [(55, False), (75, True)]  # a stretch of their own
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    for s in range(15, 35):
        guard.observe(_step(s, ROWS, True))
    resumed = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    resumed.load_state_dict(guard.state_dict())
    found = [f for s in range(35, 70) if (f := resumed.observe(_step(s, ROWS, True))) is not None]
    assert [f.step for f in found][:1] == [55]
