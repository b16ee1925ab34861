"""The ladder's step marks under a rollback (policy.py shift): -1 means no finding, so a finding a rollback moves
back must stay at step 0 at the least. A finding at step 9, rolled back from 10 to 0, became -1: no instability
seen, so a plateau raise went through on the replay's first steps; a finding moved below 0 was no longer moved by
the next rollback either. An old checkpoint's -1 still reads as none."""

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy


def test_a_finding_a_rollback_moves_past_step_0_is_still_a_finding():
    policy = Policy(OrchestratorConfig())
    policy.ladder.last_step = policy.rl.last_step = 9  # a finding at step 9
    policy.shift(10)  # rolled back from step 10 to step 0
    assert policy.ladder.last_step == 0 and policy.rl.last_step == 0
    policy.shift(5)  # a second rollback keeps it a finding
    assert policy.ladder.last_step == 0 and policy.rl.last_step == 0


def test_no_finding_stays_none_through_a_rollback():
    policy = Policy(OrchestratorConfig())  # an old checkpoint's -1 loads as this
    policy.shift(10)
    assert policy.ladder.last_step == -1 and policy.rl.last_step == -1 and policy.last_restore == -1
