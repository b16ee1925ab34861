"""How the orchestrator judges checkpoints and outcomes: a checkpoint saved at a withheld step's own
step can be good, and unused make-up credit is given back (units: a fake view, no run)."""

import math

from test_orchestrator_incidents import Run
from test_orchestrator_units import metrics
from trimtab.config.orchestrator import MakeUpRule, OrchestratorConfig
from trimtab.orchestrator import make_up
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.make_up import MakeUp


class Pretraining(Run):
    def context_free_loss(self):
        return None  # the LR rule's unigram bar: not what these tests judge


def _orchestrator(tmp_path, probe):
    """Nine healthy steps read, the initial checkpoint's held-out loss 5.0 the reference."""
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), Pretraining(probe=probe)
    run.pretrain = {"steps": 120}
    orchestrator.policy.measured(5.0, 0)
    for step in range(1, 10):
        run.step = step
        orchestrator._observe(run, metrics(step, loss=5.0 - 0.01 * step))
    return orchestrator, run


def _nan(orchestrator, run, step, withheld=True):
    m = metrics(step, loss=math.nan, grad_norm=math.nan)
    m.skipped, run.step = withheld, step
    orchestrator._observe(run, m)


def test_a_checkpoint_at_a_withheld_step_is_good_when_its_weights_score_sound(tmp_path):
    """debug, a NaN every 10 steps with checkpoint.every 10: each save fell on a NaN step, none was
    good (5 quiet steps asked), and the rollback at step 60 went back to step 0. The NaN step's
    update never touched the weights: a probe as sound as a diagnosis asks makes the save good."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    _nan(orchestrator, run, 10)
    assert orchestrator.policy.ladder.last_step == 10 and orchestrator.policy.ladder.rung == 0
    assert orchestrator.healthy(run)
    run.probe = 5.2  # an update before the flagged step broke the weights: 0.2 nats worse than the reference
    assert not orchestrator.healthy(run)
    run.probe = 4.95  # sound against the untouched weights' 5.0 only: wrecked weights early score as well
    assert not orchestrator.healthy(run)
    run.probe = None  # nothing to compare (RL, DPO): as before, not good until SETTLED quiet steps
    assert not orchestrator.healthy(run)
    run.probe, run.step = 5.5, 16
    assert orchestrator.healthy(run)  # quiet since: good without a probe


def test_a_checkpoint_after_an_update_that_stood_at_a_flagged_step_is_not_good(tmp_path):
    """advise mode, or a step the gate's ceiling let through: the flagged update is in the weights."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    _nan(orchestrator, run, 10, withheld=False)
    assert not orchestrator.healthy(run)
    run.step = 16
    assert orchestrator.healthy(run)
    state = orchestrator.state_dict()
    again = Orchestrator(OrchestratorConfig(), tmp_path)
    again.load_state_dict(state)
    run.step = 12
    assert again.stood_at == 10 and not again.healthy(run)  # a resume keeps it


def test_an_escalation_under_way_keeps_a_withheld_steps_checkpoint_bad(tmp_path):
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    orchestrator.policy.ladder.rung = 1  # the LR was cut for this incident
    _nan(orchestrator, run, 10)
    assert not orchestrator.healthy(run)


def _steps(rule, first, last, total, skipped=()):
    """MakeUp's findings over steps first..last (pretraining of 60 steps, run length `total`)."""
    found = []
    for step in range(first, last + 1):
        m = metrics(step)
        m.skipped = step in skipped
        last_unstable = max((s for s in skipped if s <= step), default=-1)
        if (f := rule.observe(m, last_unstable, total, 60)) is not None:
            found.append(f)
            total = f.evidence["new_total"]
    return found, total


def test_steps_granted_for_withheld_updates_a_rollback_replayed_are_given_back(tmp_path):
    """debug, nan_loss@22 and weights_nan@28 (60 steps, checkpoint.every 10): step 22 was made up
    (61 steps), the rollback to step 20 replayed it without a NaN, and the credit was never used:
    the run ended at 61 with every update of its kept trajectory applied."""
    rule = MakeUp(MakeUpRule())
    (made,), total = _steps(rule, 1, 29, 60, skipped=(22, 28, 29))
    assert made.step == 27 and total == 61
    rule.rolled_back(20)
    assert rule.credit == 1
    (back,), total = _steps(rule, 21, 40, total)
    assert back.step == 27 and back.evidence["new_total"] == 60 and total == 60
    remedy = make_up.remedy(back, None, OrchestratorConfig())
    assert remedy.action == "set_total_steps" and remedy.params == {"steps": 60, "by": "make_up"}
    assert rule.credit == 0 and _steps(rule, 41, 60, total)[0] == []


def test_credit_the_replay_uses_is_not_given_back():
    rule = MakeUp(MakeUpRule())
    _, total = _steps(rule, 1, 29, 60, skipped=(22,))
    rule.rolled_back(20)
    found, total = _steps(rule, 21, 60, total, skipped=(22,))  # the replay withholds step 22 again
    assert found == [] and total == 61 and rule.credit == 0


def test_a_credit_paid_counts_against_the_cap_and_is_credited_again_by_the_next_rollback():
    """debug, 60 steps, make_up.max_fraction 0.05 (cap 3), quiet_steps 2, bad_batch@12, weights_nan@15,
    bad_batch@15:4, bad_batch@30:4: step 12 made up (61), the rollback to step 10 credited it, the replay
    withheld 14-16 (the credit paid one, 2 added: 63) and 30-33 later. The run ended at 64 (4 above 60,
    under a cap of 3: the paid step was not counted as made up) and said "(0 not: the cap is reached)"."""
    rule = MakeUp(MakeUpRule(quiet_steps=2, max_fraction=0.05))
    _, total = _steps(rule, 1, 14, 60, skipped=(12,))
    assert total == 61
    rule.rolled_back(10)
    (paid,), total = _steps(rule, 11, 20, total, skipped=(14, 15, 16))
    assert (paid.evidence["credit"], paid.evidence["extend"], total) == (1, 2, 63)
    assert "not: the cap" not in make_up.remedy(paid, None, OrchestratorConfig()).reasoning  # all 3 made up
    (capped,), total = _steps(rule, 21, 40, total, skipped=(30, 31, 32, 33))
    assert capped.evidence["extend"] == 0 and total == 63  # 60 + the cap, never above it
    assert rule.made == [14, 15, 16] and rule.refused == [30, 31, 32, 33]
    rule.rolled_back(10)
    assert rule.credit == total - 60  # every step granted is a credit once the replay trains its step again
    found, total = _steps(rule, 11, 40, total)
    assert [f.evidence["new_total"] for f in found] == [60] and total == 60


def test_make_up_line_says_how_many_the_cap_let_it_make_up():
    """debug, 30 steps, bad_batch@6:3, nan_loss@12 (max_fraction 0.1, cap 3): the line said "4 updates
    withheld (steps 6-12) -> run length 33 steps", as if all 4 were made up; one stays owed."""
    rule = MakeUp(MakeUpRule(max_fraction=0.05))  # cap 3 of the 60-step phase
    (capped,), total = _steps(rule, 1, 20, 60, skipped=(6, 7, 8, 12))
    assert total == 63 and rule.refused == [12]
    assert capped.summary.endswith(", 3 made up, 1 stay owed (orchestrator.make_up.max_fraction=0.05 reached)")
    (whole,), _ = _steps(MakeUp(MakeUpRule()), 1, 20, 60, skipped=(6, 7, 8, 12))
    assert whole.summary == "4 updates withheld (steps 6-12)"  # all made up: nothing more to say


def test_the_last_applied_update_follows_the_steps_and_a_rollback(tmp_path):
    """The orchestrator records each step whose update stood (the gate's flag; ladder.py _same_replay
    asks whether a replay can differ), and a rollback takes it back to the restored step."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    assert orchestrator.policy.updated_at == 9
    _nan(orchestrator, run, 10)
    assert orchestrator.policy.updated_at == 9  # withheld: the weights are step 9's
    orchestrator.last_step, run.step = 10, 5
    orchestrator.on_rollback(run, {})
    assert orchestrator.policy.updated_at == 5


def test_a_persons_skip_is_not_made_up_and_the_make_up_says_whose_it_makes_up(tmp_path):
    """debug, two `ctl skip-step`s (at steps 7 and 10: updates 8 and 11 withheld): make_up lengthened
    the run 40 -> 42, journaled as "the update gate withheld 2 update(s)". The docs promise the gate's
    withheld updates of bad steps made up; a person's skip is theirs, and both entries say so."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    run.total_steps = 120
    orchestrator._manual(run, "skip_step", {})  # at step 9: step 10's update withheld
    (skip,) = orchestrator.journal.decisions
    assert "not made up" in skip.reasoning and run.requests == [("skip_step", {"by": "person"})]
    withheld = metrics(10)
    withheld.skipped, withheld.skip_by, run.step = True, "person", 10  # the step says whose (StepOutput.skip_by)
    orchestrator._observe(run, withheld)
    _nan(orchestrator, run, 11)  # the gate's own
    for step in range(12, 17):
        run.step = step
        orchestrator._observe(run, metrics(step, loss=4.9))
    made = orchestrator.journal.decisions[-1]
    assert (made.rule, made.action, made.params["steps"]) == ("make_up", "set_total_steps", 121)
    assert made.evidence["withheld_steps"] == [11] and made.evidence["person_skips"] == [10]
    assert "of bad steps (the orchestrator's)" in made.reasoning
    assert "step(s) 10 a person withheld (`trimtab ctl skip-step`) are theirs, not made up" in made.reasoning


def test_a_flagged_update_a_rollback_moves_past_step_0_still_keeps_checkpoints_bad(tmp_path):
    """The update that stood at step 10, rolled back from 12 to step 0: -2 read as none (saves.py: < 0), and a
    checkpoint of the replay's first steps was good on its probe alone, as if no flagged update had stood."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    _nan(orchestrator, run, 10, withheld=False)
    orchestrator.last_step, run.step = 12, 0
    orchestrator.on_rollback(run, {})
    assert orchestrator.stood_at == 0
    run.step = 3
    assert not orchestrator.healthy(run)  # 3 steps after it: not settled
