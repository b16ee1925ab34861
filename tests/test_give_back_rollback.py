"""A give-back whose probation a rollback interrupts (give_back.py, policy.py shift): the instability that called
the rollback is the give-back's failure, whichever checkpoint the rollback restores. The rollback is applied before
the next quiet step judges the probation, and Policy.shift used to move the give-back's step below 0 first when the
run rolled back further than the give-back's own step (a give-back at step 32, a rollback from 70 to 30: 32 - 40),
read as no give-back on probation: the failure went uncounted and the cut was given back again at the first wait."""

import pytest

import trimtab
from test_lr_given_back import _quiet_until, _spike
from test_lr_too_high_floor import View
from trimtab.config import load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy
from trimtab.rundir import read_decisions


def _given_back_at_32() -> tuple[Policy, View]:
    """An applied x0.1 cut at step 12, given back x2 at step 32 (on probation from there)."""
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=0.1, total_steps=160)
    policy._owe(0.1, 1.0)
    policy.last_lr_change = 12
    assert _quiet_until(policy, view, 13, 32) == [(32, 2.0)]
    return policy, view


@pytest.mark.parametrize("rolled_back_to", [30, 0])  # a checkpoint after the give-back's step or before it
def test_instability_whose_rollback_replays_past_the_give_back_counts_as_its_failure(rolled_back_to):
    policy, view = _given_back_at_32()
    policy.plan(_spike(70), view)  # the finding that called the rollback, then the rollback itself
    policy.shift(70 - rolled_back_to)
    assert policy.restore_failed == 1 and policy.last_restore == -1
    # tried once more at twice the wait: 40 quiet steps from the restored step (the finding's, shifted), not 20
    again = rolled_back_to + 40
    assert _quiet_until(policy, view, rolled_back_to + 1, again) == [(again, 2.0)]


def test_a_rollback_without_instability_keeps_an_earlier_give_back_on_probation():
    """A rollback no instability called (a person's): the given-back LR is kept for the replay, so the give-back
    stays on probation even when its step lies before the restored checkpoint; instability later is its failure."""
    policy, view = _given_back_at_32()
    policy.shift(50)  # from step 60 to step 10
    assert policy.restore_failed == 0 and policy.last_restore >= 0
    policy.plan(_spike(15), view)
    _quiet_until(policy, view, 16, 16)
    assert policy.restore_failed == 1


@pytest.mark.slow
def test_a_run_rolled_back_to_step_0_after_a_give_back_waits_twice_as_long_to_give_it_back_again(tmp_path):
    """debug at 3x, seed 0: the LR found too high at step 13 (rolled back to step 0, x0.316), given back at 20;
    at 73 found too high again and rolled back to step 0 (73 steps, past the give-back's step 20). That
    instability was the give-back's failure: given back again at step 40 of the replay (the doubled wait), where
    the uncounted failure gave it back at 20, the first wait again."""
    sets = ["optim.lr=0.009", "train.seed=0", "train.max_steps=100", "train.precision=fp32"]
    sets += ["checkpoint.every=50", "orchestrator.checkpoint_interval.enabled=false", "log.progress=false"]
    overrides = {"out": str(tmp_path), "faults": ["weights_noise@75:3"]}
    trimtab.train(load_config(preset="debug", overrides=overrides, sets=sets))
    journal = [d for d in read_decisions(tmp_path, abandoned=True) if d["rule"] in ("lr_restore", "above_start")]
    first = next(i for i, d in enumerate(journal) if d["rule"] == "lr_restore")
    rollback = next(d for d in journal[first:] if d["action"] == "rollback")
    again = next(d for d in journal[journal.index(rollback) :] if d["rule"] == "lr_restore")
    restored = rollback["params"]["to"]
    assert again["step"] - restored >= 40, (rollback, again)  # twice outcome_after, not once
    assert "once more" in again["reasoning"]
