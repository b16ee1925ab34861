"""Rule rl_hacking's held-out fall across a rollback (orchestrator/rl_held_out.py): the fall's readings
taken after the rollback's target were of weights the rollback threw away. Kept over the rollback, a
collapsed reading of x30 the documented LR (1/200, from 53/200) was pooled with the replay's first
reading at the cut LR (17/200) as "2 evaluations" and the run stopped on one reading of its own; a
replay back at its start's rate (50/200) would have been stopped the same way (51/400 pooled)."""

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.rl_held_out import RewardHacking


def rolled_back(mon: RewardHacking, state: dict) -> None:
    """What Orchestrator._load_monitors does on a rollback: the checkpoint's state, KEPT_ON_ROLLBACK kept."""
    kept = {key: getattr(mon, key) for key in mon.KEPT_ON_ROLLBACK}
    mon.load_state_dict(state)
    for key, value in kept.items():
        setattr(mon, key, value)


def test_a_replay_is_judged_on_its_own_readings_not_the_discarded_ones() -> None:
    mon = RewardHacking(OrchestratorConfig())
    target = mon.state_dict()  # the step-0 checkpoint, saved before the step-0 evaluation
    assert mon.observe_eval(0, 0, 0.265, 53, 200) is None
    assert mon.observe_eval(10, 0, 0.005, 1, 200) is None  # the collapse: one reading, under patience
    rolled_back(mon, target)  # another rule (rl_reward) rolled back to step 0 with the LR cut
    assert mon.observe_eval(10, 0, 0.25, 50, 200) is None, "a replay back at its start's rate is no fall"
    found = [mon.observe_eval(step, 0, 0.0, 0, 200) for step in (20, 30)]
    assert found[0] is None and found[1] is not None, "the replay's own fall still fires at patience 2"
    assert found[1].evidence["evaluations"] == 2 and found[1].evidence["fall_solved"] == 0
