"""`ctl set-lr` inside a warm-up sets the LR the warm-up rises to (schedule.set_lr_level): reckoned from the
warm-up's LR of the moment, the schedule's shape kept from it multiplied the rest of the warm-up, so
`set-lr 1e-3` at step 2 of a 1,000-step warm-up to 3e-4 set a multiplier of x1,000 (0.3 at its end), and the
orchestrator counted it a raise of x1,000 (a person's value under the configured LR)."""

import pytest

from trimtab.config import OptimConfig
from trimtab.training.schedule import phase_lr, set_lr_level


class Phase:
    def __init__(self, optim: OptimConfig, steps: int = 2000):
        self.optim, self.start, self.steps = optim, 0, steps


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant", "linear"])
def test_in_a_warm_up_set_lr_replaces_the_lr_it_rises_to(schedule):
    phase = Phase(OptimConfig(lr=3e-4, warmup_steps=1000, schedule=schedule))
    assert phase_lr(phase, 0, 2, []) == pytest.approx(3e-4 * 3 / 1000)
    assert set_lr_level(phase, 0, 2, []) == pytest.approx(3e-4)  # set-lr 1e-3: x3.3, not x1,111
    assert set_lr_level(phase, 0, 1500, []) == pytest.approx(phase_lr(phase, 0, 1500, []))  # past it: the step's


def test_a_cyclic_warm_up_rises_to_the_cycles_low_end():
    phase = Phase(OptimConfig(lr=1e-3, warmup_steps=100, schedule="triangular", min_lr_ratio=0.1, cycle_steps=50))
    assert set_lr_level(phase, 0, 10, []) == pytest.approx(1e-4)


def test_a_warm_up_held_back_by_withheld_updates_is_still_a_warm_up():
    """Updates withheld in the warm-up hold it back (TrainState.warm_behind): its last steps are warm-up yet."""
    phase = Phase(OptimConfig(lr=3e-4, warmup_steps=10, schedule="cosine"))
    assert set_lr_level(phase, 0, 10, [], [0, 3]) == pytest.approx(3e-4)
    assert phase_lr(phase, 0, 10, [], [0, 3]) < 3e-4


def test_a_re_warm_after_an_extension_is_a_warm_up_too():
    phase = Phase(OptimConfig(lr=3e-4, warmup_steps=40, schedule="cosine"), steps=200)
    restarts = [[0, 100, 3e-5]]  # the phase ended at 100, extended: re-warms from 3e-5
    assert phase_lr(phase, 0, 101, restarts) < 3e-4
    assert set_lr_level(phase, 0, 101, restarts) == pytest.approx(3e-4)


def test_the_orchestrator_counts_the_raise_from_the_same_level():
    """people.py's raise (what above_start and a rollback undo) is the multiplier Control._set_lr sets."""
    from types import SimpleNamespace

    from trimtab.orchestrator.people import _lr_factor

    run = SimpleNamespace(scheduled_lr=9e-7, set_lr_level=3e-4, lr_scale=1.0)
    assert _lr_factor(run, "set_lr", {"value": 1e-3}) == pytest.approx(1e-3 / 3e-4)
