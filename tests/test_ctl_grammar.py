"""What a person reads of ctl and the journal counts in words that agree: "1 step", not "1 steps" (`ctl
checkpoint-every 1` was journaled "checkpoint every 20 -> 1 steps" and said "a checkpoint every 1 steps";
`ctl max-staleness 1`, "RL rollouts at most 1 steps behind")."""

from types import SimpleNamespace

import pytest

from test_raise_undone import Broken, _incident, _policy
from trimtab.training.actions import counted, describe
from trimtab.training.control import Control


@pytest.mark.parametrize(
    ("action", "params", "said"),
    [
        ("set_checkpoint_every", {"steps": 1}, "a checkpoint every 1 step"),
        ("set_checkpoint_every", {"steps": 50}, "a checkpoint every 50 steps"),
        ("set_max_staleness", {"steps": 1}, "RL rollouts at most 1 step behind"),
        ("set_max_staleness", {"steps": 0}, "RL rollouts at most 0 steps behind"),
        ("set_total_steps", {"steps": 1}, "run length 1 step"),
        ("set_generation_rows", {"at_once": 1}, "RL generation 1 row at a time"),
        ("set_overlong_penalty", {"tokens": 1}, "RL overlong penalty over the last 1 token"),
        ("skip_data", {"rows": [3]}, "leave out 1 row"),
        ("rollback", {"to": 5, "skip_rows": [7]}, "roll back to 5, skip 1 row"),
        ("rollback", {"to": 5, "skip_rows": [7, 8]}, "roll back to 5, skip 2 rows"),
    ],
)
def test_the_journal_and_console_words_of_an_action_agree_with_their_count(action, params, said):
    assert describe(action, params) == said


def test_what_control_says_it_did_agrees_with_its_count():
    trainer = SimpleNamespace(
        state=SimpleNamespace(checkpoint_every=0), cfg=SimpleNamespace(checkpoint=SimpleNamespace(every=20))
    )
    assert Control(trainer)._set_checkpoint_every(1) == "checkpoint every 20 -> 1 step"
    assert Control(trainer)._set_checkpoint_every(5) == "checkpoint every 1 -> 5 steps"
    assert counted(1, "older checkpoint") == "1 older checkpoint" and counted(2, "node") == "2 nodes"


def test_a_raise_one_step_before_the_trouble_says_one_step():
    policy = _policy(raise_at=None)
    policy.person_raised(46, 3.0, "trimtab ctl scale_lr 3")
    *_, rollback = _incident(policy, Broken(lr_scale=1.0, last_good=40), 45)
    assert "at step 46 (trimtab ctl scale_lr 3), 1 step before the trouble" in rollback.reasoning
