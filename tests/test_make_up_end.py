"""Updates withheld in pretraining's last steps (orchestrator.make_up). The rule waited `quiet_steps`
past the last withheld step, which a run's end never gives: debug, 60 steps, nan_loss@59 ended with
59 updates and bad_batch@58:4 with 57, nothing journaled. At pretraining's last step what is owed is
granted when that step is sound (no instability finding at it), and said in a note when it is not,
kept owed for a resume to a longer run: steps added after broken weights skipped the `end` rule's
check of them (weights_noise@24:3, tests/test_orchestrator_end.py)."""

from trimtab.config.orchestrator import MakeUpRule, OrchestratorConfig
from trimtab.orchestrator.make_up import MakeUp, remedy
from trimtab.orchestrator.monitors import Finding, StepMetrics


def _run(rule: MakeUp, steps: range, length: int, skipped: tuple[int, ...], unstable: tuple[int, ...] = ()) -> list:
    """Steps of a pretraining phase `length` steps long; `unstable`: the steps with an instability finding
    (the ladder's last one passed on), `skipped`: those whose update was withheld (by the gate alone where
    not unstable too)."""
    found = []
    for step in steps:
        m = StepMetrics(step=step, loss=4.0, grad_norm=1.0, skipped=step in skipped)
        last = max([s for s in unstable if s <= step], default=-1)
        if (f := rule.observe(m, last, length, length)) is not None:
            found.append(f)
    return found


def _remedy(f: Finding):
    return remedy(f, None, OrchestratorConfig())


def test_a_nan_at_the_second_last_step_is_made_up_at_the_sound_last_step():
    rule = MakeUp(MakeUpRule())
    (made,) = _run(rule, range(1, 61), 60, skipped=(59,), unstable=(59,))
    assert made.step == 60 and made.evidence["withheld_steps"] == [59]  # no quiet steps left to wait for
    assert _remedy(made).action == "set_total_steps" and _remedy(made).params == {"steps": 61, "by": "make_up"}


def test_data_withheld_up_to_the_last_step_is_made_up_and_the_new_end_too():
    """bad_batch@58:4 on debug's 60 steps: the gate withheld 58-60 (data, no instability finding), made up
    at step 60; the fault's 4th step (61) then falls inside the run, made up at its new end: 64 steps."""
    rule = MakeUp(MakeUpRule())
    (made,) = _run(rule, range(1, 61), 60, skipped=(58, 59, 60))
    assert made.step == 60 and _remedy(made).params == {"steps": 63, "by": "make_up"}
    (again,) = _run(rule, range(61, 64), 63, skipped=(61,))
    assert again.step == 63 and _remedy(again).params == {"steps": 64, "by": "make_up"}
    assert rule.made == [58, 59, 60, 61] and rule.owed == rule.refused == []


def test_an_unstable_last_step_is_said_in_a_note_and_kept_owed_for_a_longer_run():
    """weights_noise@24:3: the last step spikes and its update is withheld; lengthening the run there
    replaced the end check of the broken weights. A note names the step instead, nothing silent."""
    rule = MakeUp(MakeUpRule())
    (note,) = _run(rule, range(1, 25), 24, skipped=(22, 24), unstable=(24,))
    assert note.step == 24 and note.evidence["withheld_steps"] == [22, 24] and note.evidence["extend"] == 0
    assert "not made up: the last step is unstable" in note.summary
    advice = _remedy(note)
    assert (
        advice.action == "none" and "22, 24" in advice.reasoning and "step 24) is itself unstable" in advice.reasoning
    )
    assert rule.owed == [] and rule.refused == [22, 24]
    # a resume to 40 steps makes them up once quiet_steps pass
    (made,) = _run(rule, range(25, 41), 40, skipped=())
    assert made.step == 29 and _remedy(made).params == {"steps": 42, "by": "make_up"}


def test_a_stretch_before_the_end_still_waits_for_quiet_steps():
    rule = MakeUp(MakeUpRule())
    (made,) = _run(rule, range(1, 61), 60, skipped=(30,), unstable=(30,))
    assert made.step == 35


def test_pretrainings_last_steps_are_made_up_before_a_finetuning_phase():
    """A finetuning phase cleared what pretraining's last steps withheld: made up at pretraining's
    last step now (phase 0's length 40 of a 50-step run), before the finetuning phase starts."""
    rule = MakeUp(MakeUpRule())
    found = [
        f
        for step in range(1, 41)
        if (f := rule.observe(StepMetrics(step=step, loss=4.0, grad_norm=1.0, skipped=step == 39), 39, 50, 40))
    ]
    assert [(f.step, f.evidence["new_total"]) for f in found] == [(40, 51)]
    ft = StepMetrics(step=41, loss=4.0, grad_norm=1.0, phase=1)
    assert rule.observe(ft, 39, 51, 41) is None and rule.made == [39]
