"""Withheld updates the make-up cap refused stay owed through a checkpoint: a resume to a longer
train.max_steps raises the cap and they are made up then (orchestrator/make_up.py)."""

from trimtab.config.orchestrator import MakeUpRule, OrchestratorConfig
from trimtab.orchestrator.make_up import MakeUp, remedy
from trimtab.orchestrator.monitors import StepMetrics


def observe(rule: MakeUp, step: int, total: int, skipped: bool = False, unstable: int = -1):
    return rule.observe(StepMetrics(step=step, loss=1.0, grad_norm=1.0, skipped=skipped), unstable, total, total)


def test_an_update_the_cap_refused_is_made_up_after_a_resume_to_a_longer_run():
    # debug, 34 steps (cap 3): steps 10-12 withheld and made up, step 30's refused at step 35
    first = MakeUp(MakeUpRule(quiet_steps=5, max_fraction=0.1))
    for n in (10, 11, 12):
        observe(first, n, 34, skipped=True, unstable=n)
    assert observe(first, 17, 34, unstable=12).evidence["extend"] == 3
    observe(first, 30, 37, skipped=True, unstable=30)
    refused = observe(first, 35, 37, unstable=30)
    assert refused.evidence["extend"] == 0 and remedy(refused, None, OrchestratorConfig()).action == "none"
    assert observe(first, 36, 37) is None  # the cap is still spent: not said again every step
    resumed = MakeUp(MakeUpRule(quiet_steps=5, max_fraction=0.1))
    resumed.load_state_dict(first.state_dict())
    made = observe(resumed, 38, 60)  # resumed with --max-steps 60: the cap is 6, 3 of it spent
    assert made is not None and (made.evidence["withheld_steps"], made.evidence["extend"]) == ([30], 1)
    assert made.evidence["new_total"] == 61 and remedy(made, None, OrchestratorConfig()).action == "set_total_steps"
    assert observe(resumed, 39, 61) is None and resumed.state_dict()["refused"] == []  # made up once


def test_a_run_too_short_to_spare_a_step_carries_its_withheld_update_into_a_longer_resume():
    short = MakeUp(MakeUpRule(quiet_steps=1))  # 10% of 9 steps: not one step to spare, so not a word
    observe(short, 3, 9, skipped=True, unstable=3)
    assert observe(short, 5, 9, unstable=3) is None
    longer = MakeUp(MakeUpRule(quiet_steps=1))
    longer.load_state_dict(short.state_dict())
    made = observe(longer, 10, 30)  # resumed to 30 steps: a cap of 3
    assert made is not None and (made.evidence["withheld_steps"], made.evidence["new_total"]) == ([3], 31)


def test_a_rollback_over_a_refused_step_trains_it_again_instead():
    rule = MakeUp(MakeUpRule(quiet_steps=1, max_fraction=0.1))
    observe(rule, 4, 9, skipped=True, unstable=4)
    observe(rule, 6, 9, unstable=4)  # cap 0: carried
    rule.rolled_back(2)  # step 4 is trained again: owed no longer
    assert observe(rule, 10, 30) is None and rule.state_dict()["refused"] == []


def test_the_steps_make_up_adds_do_not_raise_the_cap_for_what_it_refused():
    rule = MakeUp(MakeUpRule(quiet_steps=5, max_fraction=0.1))  # 100 steps: a cap of 10
    for n in range(10, 25):
        observe(rule, n, 100, skipped=True, unstable=n)
    assert observe(rule, 29, 100, unstable=24).evidence["extend"] == 10  # 5 refused
    assert [observe(rule, n, 110) for n in (30, 31)] == [None, None]  # 10% of 110 is 11: no creep
    assert observe(rule, 32, 130).evidence["extend"] == 3  # a resume to 130 steps: a cap of 13
