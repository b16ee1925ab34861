"""The end check's replay: a rollback at a phase's end with no finding, whose replay ends at the same
held-out loss, met the data's doing, not a fault's (orchestrator/diagnosis.py: verify_end)."""

from dataclasses import dataclass

from test_orchestrator_units import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy


@dataclass
class EndView(View):
    step: int = 20
    last_good: int = 0  # no good checkpoint but the phase's start: a 20-step run saving every 20
    checkpoints: tuple[int, ...] = (0,)


def end_check(policy, view):
    """verify_end's remedy, applied (as the orchestrator applies it in auto mode), or None."""
    found = policy.verify_end(view)
    if found is None:
        return None
    found[1].applied()
    return found[1]


def rolled_back_once(probe=8.021):
    """A debug run on two text files: the training loss fell 6.2 -> 3.6 in 20 calm steps while the
    held-out loss rose from the untouched weights' 6.186 to 8.021; the end check rolled back."""
    policy, view = Policy(OrchestratorConfig()), EndView(probe=probe)
    policy.measured(6.186, 0)  # the untouched weights' held-out loss, the phase's start
    first = end_check(policy, view)
    assert first.action == "rollback" and "lr_factor" not in first.params
    policy.load_state_dict(policy.state_dict())  # what a checkpoint keeps of it
    policy.shift(20)  # the rollback to step 0 (core.py: on_rollback), the policy kept
    return policy, view


def test_a_replay_that_ends_at_the_same_held_out_loss_keeps_the_state_without_an_lr_cut():
    # before: a second rollback with the LR x0.1 (the run ended 1.1 nats worse), then a stop
    policy, view = rolled_back_once()
    second = end_check(policy, view)
    assert second.action == "none" and "the data and the schedule lead there" in second.reasoning
    assert view.lr_scale == 1.0 and policy.broken_at == -1 and policy.rollbacks == 1
    assert not policy.unsettled(21)  # no instability marked: the rows rule judges again


def test_a_replay_that_ends_elsewhere_is_judged_as_before():
    policy, view = rolled_back_once()
    view.probe = 6.0  # a transient fault's wreck: the replay ends sound
    assert end_check(policy, view) is None
    policy, view = rolled_back_once()
    view.probe = 9.5  # worse again, not the same state: the ladder's answer, a rollback with an LR cut
    again = end_check(policy, view)
    assert again.action == "rollback" and again.params["lr_factor"] == 0.1
