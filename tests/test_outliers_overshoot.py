"""The rows rule stands down at a step after an update that overshot (its gain under 0)."""

import json
import random

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.outliers import OutlierRows


def steps(gain_before_out: float) -> tuple[list, OutlierRows]:
    """debug-mod at 10x its LR (lr 3e-2, 60 steps): the level falls ~0.2 a step from 6.25, step 5's
    update reads gain -3.9, and at step 6 a quarter of the clean rows score 1.6-3.1 nats over the
    step's median 5.6 (the warm-up's overshoot); returns the rule's findings of steps 1-8."""
    rule, rng = OutlierRows(OrchestratorConfig()), random.Random(0)
    found = []
    for n in range(1, 9):
        base = 6.25 - 0.2 * n
        special = {60_000 + i: 1.6 + 0.2 * i for i in range(8)} if n == 6 else {}
        losses = {n * 100 + i: (base + rng.gauss(0, 0.1), 64) for i in range(32 - len(special))}
        losses |= {r: (base + gap, 64) for r, gap in special.items()}
        gain = gain_before_out if n == 5 else 0.5
        m = StepMetrics(step=n, loss=base, grad_norm=1.0, rows=list(losses), row_losses=losses, update_gain=gain)
        found.append(rule.observe(m))
    return found, rule


def test_rows_standing_out_after_an_update_that_raised_its_own_batchs_loss_are_not_named():
    """Named, 8 clean rows were left out for good as bad data (rule rows, skip_data at step 6) while
    the model, not the data, was in trouble (above_start rolled it back at step 10)."""
    assert all(f is None for f in steps(-3.9)[0])


def test_the_same_rows_after_a_sound_update_are_still_named():
    found = steps(0.5)[0]
    assert found[5] is not None and found[5].evidence["rows"] == list(range(60_000, 60_008))
    assert all(f is None for i, f in enumerate(found) if i != 5)


def test_the_last_updates_gain_resumes_with_the_rule():
    rule = steps(0.5)[1]
    again = OutlierRows(OrchestratorConfig())
    again.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert again.last_gain == rule.last_gain == 0.5
