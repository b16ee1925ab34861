"""The orchestrator's memory of what it did: advice changes nothing and is judged as nothing, an
incident's rollbacks are its own, a breakage after the replay got clear is a new one, early wrecked
weights are an LR far too high, rows are not condemned while the model is unstable, outcomes judge
what the decision did, and the fault injector fires what it records (units: a fake view, no run)."""

import math
from types import SimpleNamespace

import pytest

from test_orchestrator_units import View, act, finding, metrics
from test_outliers import Data
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.faults import FaultInjector
from trimtab.orchestrator.journal import Decision, Journal
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.outcomes import Outcomes
from trimtab.orchestrator.outliers import OutlierRows
from trimtab.orchestrator.policy import Policy
from trimtab.rundir import read_decisions


class Run(View):
    """A view the orchestrator can decide through: requests recorded, lines said."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests, self.said = [], []
        self.control = SimpleNamespace(request=lambda action, on_done=None, **p: self.requests.append((action, p)))

    def say(self, line):
        self.said.append(line)


def nonfinite(step):
    return Finding(rule="nonfinite", family="instability", step=step, evidence={}, summary="loss nan", strength=1.0)


# ------------------------------------------------------------------------------------ advice


def test_advice_changes_no_policy_state():
    """An LR cut, a rollback for broken weights and a give-back, each planned and not applied:
    the ladder, the LR owed and the incident stay as they were (the cut had entered the debt and
    a rollback's the replay memory: a run that never cut its LR later gave it back x2)."""
    policy = Policy(OrchestratorConfig())
    plans = [policy.plan(finding(s), View()) for s in (101, 102, 103)]
    assert plans[-1].action == "scale_lr" and policy.ladder.rung == 0 and policy.lr_debt == 1.0
    assert policy.last_lr_change < 0 and policy.quiet(300, View()) is None  # no give-back of a cut never made
    broken = [policy.plan(nonfinite(s), View(probe=math.nan)) for s in (104, 105, 106)][-1]
    assert broken.action == "rollback" and (policy.rollbacks, policy.broken_at, policy.last_rollback_to) == (0, -1, -1)
    applied = act(policy, nonfinite(107), View(probe=math.nan))  # NaN weights: rolled back at the first finding
    assert applied.action == "rollback" and "lr_factor" not in applied.params and policy.rollbacks == 1  # as it was


def test_advice_is_journaled_once_judged_as_nothing_and_a_switch_to_auto_starts_clean(tmp_path):
    """advise mode on NaN weights: a skip and a rollback advised again and again (36 decisions in
    60 steps), each judged "not recovered" (0 of 11 rollbacks recovered, when none was applied),
    so after `ctl mode auto` the rollback fell to advice and the run trained on NaN weights."""
    orchestrator = Orchestrator(OrchestratorConfig(mode="advise"), tmp_path)
    run = Run(probe=math.nan, last_good=20)
    for s in range(25, 73):
        orchestrator.decide(run, nonfinite(s))
    (rollback,) = orchestrator.journal.decisions  # NaN weights: a rollback from the first finding, no skip
    assert rollback.action == "rollback" and "lr_factor" not in rollback.params
    assert rollback.evidence["seen_again"] == 47 and rollback.evidence["last_seen_at"] == 72 and run.requests == []
    assert rollback.outcome["result"] == "not applied"
    assert orchestrator.journal.track_record("nonfinite", "rollback") == (0, 0)
    orchestrator.mode = "auto"  # trimtab ctl RUN mode auto
    decided = orchestrator.decide(run, nonfinite(73))
    assert decided.action == "rollback" and decided.mode == "auto" and decided.confidence == 0.75
    assert run.requests == [("rollback", {"to": "last_good", "skip_rows": []})]  # no "broke again" cut
    assert orchestrator.policy.rollbacks == 1 and decided.outcome is None  # judged once steps follow
    assert len(read_decisions(tmp_path)) == 2  # the advice, once, and the rollback applied


def test_nan_weights_from_updates_applied_in_advise_are_rolled_back_at_the_first_auto_step(tmp_path):
    """debug, advise, weights_nan@10, `ctl mode auto` at step 19: the NaN updates applied in advise left
    the weights NaN, yet the first auto step was a skip_step ("not recovered") before the rollback at 21.
    A skipped step cannot heal them: the weights are checked and rolled back at once, and said so."""
    orchestrator, run = Orchestrator(OrchestratorConfig(mode="advise"), tmp_path), Run(probe=math.nan, last_good=0)
    run.context_free_loss, run.pretrain = lambda: None, {"steps": 60}
    for step in range(10, 20):  # advise: each NaN update applied
        run.step = step
        orchestrator._observe(run, metrics(step, loss=math.nan, grad_norm=math.nan))
    (advised,) = orchestrator.journal.decisions  # weights NaN from step 10: a rollback advised, then again
    assert (advised.action, advised.step, advised.mode) == ("rollback", 10, "advise")
    assert advised.evidence["seen_again"] == 9 and run.requests == []
    orchestrator.mode = "auto"  # trimtab ctl RUN mode auto
    m = metrics(20, loss=math.nan, grad_norm=math.nan)
    m.skipped, run.step = True, 20
    orchestrator._observe(run, m)
    decided = orchestrator.journal.decisions[-1]
    assert (decided.step, decided.action, decided.mode) == (20, "rollback", "auto")
    assert "a weight or an optimizer moment is not finite" in decided.reasoning
    assert run.requests == [("rollback", {"to": "last_good", "skip_rows": []})]
    orchestrator.last_step, run.step, run.probe = 20, 0, 5.0
    orchestrator.on_rollback(run, {})
    m = metrics(1, loss=math.nan, grad_norm=math.nan)
    m.skipped, run.step = True, 1
    orchestrator._observe(run, m)
    assert orchestrator.journal.decisions[-1].action == "skip_step"


def test_nan_weights_in_auto_are_rolled_back_at_the_first_nonfinite_step():
    """debug, auto, weights_nan@15: two skip_steps "not recovered" (15, 16) came before the rollback at 17,
    though no skipped step heals NaN weights. The first non-finite step checks them; a NaN loss of finite
    weights (a bad batch) still skips."""
    policy = Policy(OrchestratorConfig())
    assert act(policy, nonfinite(15), View(probe=5.0)).action == "skip_step"  # finite weights: a bad batch
    broken = act(policy, nonfinite(16), View(probe=math.nan))
    assert broken.action == "rollback" and broken.params == {"to": "last_good", "skip_rows": []}
    assert "a weight or an optimizer moment is not finite" in broken.reasoning and policy.rollbacks == 1


def test_a_give_back_never_passes_the_multiplier_the_lr_was_cut_from():
    """debug-moe: cuts advised (not applied) still entered the debt, and give-backs took the LR to
    4x the schedule. Only applied cuts are owed, and a give-back stops where the cut began."""
    cfg = OrchestratorConfig()
    cfg.lr_restore_after = 10
    policy = Policy(cfg)
    for s in (1, 2, 3):  # x0.5 applied at a multiplier of 1
        act(policy, finding(s), View())
    assert policy.lr_debt == 0.5
    restore = policy.quiet(13, View(lr_scale=0.75))  # a person raised it to 0.75 since
    assert restore.params["factor"] == pytest.approx(1 / 0.75)  # back to 1, not x2 to 1.5
    assert policy.quiet(13, View(lr_scale=1.0)) is None and policy.lr_debt == 1.0  # set back by hand: owed nothing


# ------------------------------------------------------------------------------------ incidents


def test_a_breakage_after_the_replay_got_clear_is_a_new_one_replayed_as_it_was():
    """debug-moe, weights_nan@25 and @55: the replay from 20 passed step 27 and saved a good
    checkpoint at 40, yet the second rollback cut the LR "broke again within the replay" (final
    val 4.406 against 4.310 clean)."""
    policy = Policy(OrchestratorConfig())
    first = act(policy, nonfinite(25), View(probe=math.nan, last_good=20))  # NaN weights: rolled back at once
    assert first.params == {"to": "last_good", "skip_rows": []}
    policy.shift(25 - 20)
    for s in range(21, 55):
        policy.quiet(s, View(last_good=40 if s >= 40 else 20))
    second = act(policy, nonfinite(55), View(probe=math.nan, last_good=40))
    assert second.params == {"to": "last_good", "skip_rows": []} and "again" not in second.reasoning
    assert policy.lr_debt == 1.0 and policy.rollbacks == 1  # a new incident: its first rollback


def test_rollbacks_are_counted_per_incident_and_one_that_keeps_breaking_stops():
    """debug-mod, weights_nan@30/90/150/210: four unrelated faults, each replayed clear; the
    fourth ended the run "3 rollbacks used" (a run-wide count). A breakage that comes back before
    the replay gets clear still spends the incident's rollbacks and stops."""
    policy = Policy(OrchestratorConfig())
    for fault in (30, 90, 150, 210):
        plan = act(policy, nonfinite(fault), View(probe=math.nan, last_good=fault - 10))
        assert plan.action == "rollback" and "lr_factor" not in plan.params
        policy.shift(10)
        for s in range(fault - 9, fault + 30):  # the replay passes the fault and saves a good checkpoint
            policy.quiet(s, View(last_good=fault - 10 if s < fault + 20 else fault + 20))
        assert policy.rollbacks == 0
    stuck = Policy(OrchestratorConfig())
    for _ in range(3):  # each replay breaks before it passes step 27
        assert act(stuck, nonfinite(25), View(probe=math.nan)).action == "rollback"
        stuck.shift(5)
        for s in range(21, 25):
            stuck.quiet(s, View())
    stop = act(stuck, nonfinite(25), View(probe=math.nan))
    assert stop.action == "stop" and "3 rollbacks used on one incident" in stop.params["reason"]


def test_a_rollback_that_would_replay_exactly_what_failed_goes_further_back():
    """debug at train.batch_tokens=1024, checkpoint.every=10: spikes at 11-16 (the warm-up peak), every
    update withheld, rolled back to step 10, whose weights were the ones that spiked: the replay met the
    same rows with the same weights (the LR acts on no withheld update), six spikes "not recovered" again
    before a second rollback went further back."""
    quiet = View(bad_row_loss=5.0)  # the rows score as held-out ones: none is left out
    stale = Policy(OrchestratorConfig())
    stale.updated_at = 20  # the last applied update: the one the good checkpoint at 20 holds
    plan = [act(stale, finding(s), quiet) for s in range(21, 27)][-1]
    assert plan.action == "rollback" and plan.params == {"to": 19, "skip_rows": []}
    assert "would replay exactly what failed (no update was applied after step 20" in plan.reasoning
    assert plan.evidence["last_update"] == 20 and stale.last_rollback_to == 19
    moved = Policy(OrchestratorConfig())
    moved.updated_at = 22  # an update applied since the checkpoint: the replay differs
    assert [act(moved, finding(s), quiet) for s in range(21, 27)][-1].params == {"to": "last_good", "skip_rows": []}
    scored = Policy(OrchestratorConfig())
    scored.updated_at = 20  # rows left out: the replay meets others
    assert [act(scored, finding(s), View()) for s in range(21, 27)][-1].params["to"] == "last_good"
    alone = Policy(OrchestratorConfig())
    alone.updated_at = 20
    stop = [act(alone, finding(s), View(bad_row_loss=5.0, checkpoints=(20,))) for s in range(21, 27)][-1]
    assert stop.action == "stop" and "no checkpoint from before that update" in stop.params["reason"]
    broken = Policy(OrchestratorConfig())
    broken.updated_at = 20  # NaN losses: weights a fault or a flipped bit broke, not an update (weights_nan)
    plans = [act(broken, nonfinite(s), View(bad_row_loss=5.0, last_good=20)) for s in range(21, 27)]
    nan = next(p for p in plans if p.action == "rollback")
    assert nan.params["to"] == "last_good" and "replay exactly" not in nan.reasoning


def test_each_ladder_rollback_names_its_incident():
    """debug-mod at optim.lr=1.0: four rollbacks with max_rollbacks 3, two incidents of two each (the
    first closed at a good checkpoint of its replay); the journal named neither."""
    policy = Policy(OrchestratorConfig())
    first = act(policy, nonfinite(25), View(probe=math.nan, last_good=20))
    assert first.evidence["incident_rollback"] == 1 and "rollback 1 of this incident's" in first.reasoning
    assert "new incident" not in first.reasoning
    policy.shift(5)
    for s in range(21, 45):
        policy.quiet(s, View(last_good=40 if s >= 40 else 20))
    second = act(policy, nonfinite(55), View(probe=math.nan, last_good=40))
    assert second.evidence == {"incident_rollback": 1, "max_rollbacks": 3}
    assert "a new incident: the last closed at step 40" in second.reasoning


def test_weights_wrecked_early_in_a_phase_are_an_lr_far_too_high():
    """debug-hybrid at optim.lr=0.5: gradient norms over 100 from step 4, their updates withheld
    (so the loss never rose above its start for above_start), the probe 8.6 against 6.2 at step
    0: rollbacks with x0.5 cuts spent the budget and the run gave up where off completed."""
    policy = Policy(OrchestratorConfig())
    policy.measured(6.216, 0)  # the untouched weights' held-out loss (step 0's checkpoint)
    plans = [act(policy, finding(s, rule="grad"), View(probe=8.604, last_good=0)) for s in (4, 5, 6)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "rollback"]
    assert plans[-1].params == {"to": "last_good", "skip_rows": [], "lr_factor": 0.1}
    assert "worse than its untouched ones (6.216)" in plans[-1].reasoning
    # owed part way, as above_start's cuts (a young model's held-out score on text unlike its rows rises too)
    assert "never past the midpoint" in plans[-1].reasoning and policy.lr_debt == pytest.approx(0.1)
    # the rows of the stretch after such a cut are the model's doing, not bad data: the LR comes down
    policy.shift(6)
    policy.probe_baseline = 5.0
    after = [act(policy, finding(s), View(probe=5.0, last_good=0)) for s in (20, 21, 22)][-1]
    assert after.action == "scale_lr"
    # the same breakage mid-run is replayed as it was (a transient, for all it shows)
    later = Policy(OrchestratorConfig())
    later.measured(6.216, 0)
    later.probe_baseline = 4.5
    plan = [act(later, finding(s, rule="grad"), View(probe=8.0, last_good=100)) for s in (120, 121, 122)][-1]
    assert plan.action == "rollback" and "lr_factor" not in plan.params


def test_no_lr_cut_at_the_last_step():
    """nan_loss on the last 3 steps ended in scale_lr(0.5) at the final step: a cut that acts on no
    step of the run and stays in its checkpoint for an extension."""
    policy = Policy(OrchestratorConfig())
    plans = [act(policy, finding(s), View(total_steps=100)) for s in (98, 99, 100)]
    assert [p.action for p in plans] == ["skip_step"] * 3 and "no LR cut at the run's last step" in plans[-1].reasoning
    assert policy.lr_debt == 1.0 and policy.ladder.rung == 0


# ------------------------------------------------------------------------------------ rows


def test_no_row_is_judged_while_the_model_is_unstable():
    """debug at optim.lr=0.5: rows 515, 1793, 522 (stdlib files) were left out for good as
    "garbage, a broken encoding, a corrupt record" at steps where the LR wrecked every row."""
    rule, data = OutlierRows(OrchestratorConfig()), Data()
    for _ in range(5):
        rule.observe(data.step_metrics())
    step = data.step_metrics({10_000: 9.0})
    step.unsettled = True  # instability within the escalation window (Policy.unsettled)
    assert rule.observe(step) is None and not rule.suspects
    wrecked = data.step_metrics({10_001: 11.3})  # most rows 2 nats up: the model's doing
    wrecked.row_losses = {r: (v + 2.0 if r != 10_001 else v, t) for r, (v, t) in wrecked.row_losses.items()}
    assert rule.observe(wrecked) is None and not rule.suspects
    assert rule.observe(data.step_metrics({10_002: 9.0})).evidence["rows"] == [10_002]  # calm: named


def test_a_spike_alone_leaves_rows_judged_and_a_cut_or_rollback_does_not():
    """Bad data spread thinly spikes every few steps: were a spike enough to call the model
    unsettled, the rows rule would judge no row for the whole run (the healing benchmark's
    thin_bad_data left none of its 104 bad rows out). An LR cut or a rollback is the model's."""
    policy = Policy(OrchestratorConfig())
    policy.ladder.last_step = 40  # a spike finding at step 40, answered by skipping
    assert not policy.unsettled(45)
    policy.unstable_at = 40  # an LR cut or a rollback there
    assert policy.unsettled(45) and not policy.unsettled(40 + OrchestratorConfig().escalation_window)


# ------------------------------------------------------------------------------------ outcomes


def pending(journal, step, rule="spike", action="skip_step", family="instability", loss_before=5.0):
    d = Decision(
        id=journal.next_id(),
        step=step,
        rule=rule,
        evidence={},
        reasoning="",
        action=action,
        params={},
        confidence=0.75,
        mode="auto",
        family=family,
        loss_before=loss_before,
    )
    return journal.add(d)


def test_a_skip_is_judged_on_its_own_trouble_and_a_plateau_raise_on_a_real_fall(tmp_path):
    """A skip followed 10 healthy steps later by another fault of its family was "not recovered"
    though the loss fell; an LR raise at optim.lr=1e-6 (6.2414 -> 6.2344, still ln(vocab)) was
    "recovered"."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig())
    skip = pending(journal, 10)
    for s in range(11, 31):
        found = [finding(s, rule="grad")] if s == 21 else []
        outcomes.follow(metrics(s, loss=4.9 if s != 21 else 9.0), found)
    assert skip.outcome["result"] == "recovered" and skip.outcome["findings_after"] == 0
    again = pending(journal, 40)
    for s in range(41, 61):
        outcomes.follow(metrics(s, loss=4.9), [finding(s)] if s == 42 else [])  # back before it settled
    assert again.outcome["result"] == "not recovered"
    for after, result in ((6.2344, "not recovered"), (6.15, "recovered")):
        raise_ = pending(journal, 100, "plateau", "scale_lr", "plateau", loss_before=6.2414)
        for s in range(101, 121):
            outcomes.follow(metrics(s, loss=after), [])
        assert raise_.outcome["result"] == result


def test_decisions_of_a_branch_a_rollback_abandoned_are_judged_on_that_branch(tmp_path):
    """The skips before a rollback were judged on the replay of steps from before the fault
    (loss_before == loss_after): the branch they acted in is what they are judged on."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig())
    for s in range(1, 25):
        outcomes.follow(metrics(s, loss=5.0), [])
    skip = pending(journal, 25)
    for s in (26, 27):
        outcomes.follow(metrics(s, loss=math.nan), [finding(s)])
    rollback = pending(journal, 27, action="rollback")  # decided after step 27's read, as the orchestrator does
    rows = pending(journal, 27, "rows", "skip_data", "data")
    outcomes.rolled_back(20, rollback.id)
    assert skip.outcome["result"] == "not recovered" and skip.outcome["rolled_back"] and skip.outcome["steps"] == 2
    assert rows.outcome == {"result": "cut short", "steps": 0, "rolled_back": True}
    assert rollback.outcome is None  # judged on the replay: its effect
    for s in range(21, 41):
        outcomes.follow(metrics(s, loss=4.95), [])
    assert rollback.outcome["result"] == "recovered" and rollback.outcome["replayed_steps"] == 4


def test_a_rollback_is_judged_on_its_incident_not_on_a_new_fault_after_the_replay_settled(tmp_path):
    """debug, weights_nan at 12 and 22: the rollback decided at 14 (to step 8) replayed past step
    14, healthy, and a good checkpoint at 16 ended its incident; the second fault's NaNs at 22-24,
    within its 20 steps, had it judged "not recovered". A recurrence before the replay got past
    the step it was decided at, or before it settled, is still its failure."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig())
    for s in range(1, 12):
        outcomes.follow(metrics(s, loss=5.0), [])
    clean = pending(journal, 14, action="rollback")
    outcomes.rolled_back(8, clean.id)
    for s in range(9, 29):  # the replay, then a new fault at 22-24
        outcomes.follow(metrics(s, loss=math.nan if 22 <= s <= 24 else 4.9), [finding(s)] if 22 <= s <= 24 else [])
    assert clean.outcome["result"] == "recovered" and clean.outcome["findings_after"] == 0
    for broke_at in (12, 17):  # within the replay of steps 9-14; past it, before 5 healthy steps
        again = pending(journal, 14, action="rollback")
        outcomes.rolled_back(8, again.id)
        for s in range(9, 29):
            outcomes.follow(metrics(s, loss=4.9), [finding(s)] if s == broke_at else [])
        assert again.outcome["result"] == "not recovered", broke_at


def test_a_replay_still_the_run_before_bit_for_bit_is_no_recovery_yet(tmp_path):
    """debug, checkpoint.every 20, outcome_after 10, weights_nan@38: the rollback at 40 (to step 20)
    was "recovered" on the replay of steps 21-30, the same losses as before (loss_before ==
    loss_after), before it reached the fault. It is judged once the replay differs (step 38, clean:
    the fault was transient); a fault back right after an identical replay is reproducible."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig(outcome_after=10))
    before = {s: 5.0 - 0.01 * s for s in range(1, 38)}  # healthy; NaNs at 38-40
    for s in range(1, 41):
        outcomes.follow(metrics(s, loss=before.get(s, math.nan)), [] if s in before else [finding(s)])
    for fault_back in (False, True):
        rollback = pending(journal, 40, action="rollback")
        outcomes.rolled_back(20, rollback.id)
        for s in range(21, 38):
            outcomes.follow(metrics(s, loss=before[s]), [])
        assert rollback.outcome is None  # 17 steps, each the run before's: not judged on them
        outcomes.follow(metrics(38, loss=math.nan if fault_back else 4.6), [finding(38)] if fault_back else [])
        outcome = rollback.outcome
        assert outcome["identical_steps"] == outcome["replayed_steps"] == 17 and outcome["steps"] == 18
        if fault_back:
            assert outcome["result"] == "not recovered" and outcome["reproduced_at"] == 38
        else:
            assert outcome["result"] == "recovered" and "reproduced_at" not in outcome


def test_a_balance_coefficient_raised_from_zero_says_so():
    f = Finding(
        rule="moe",
        family="moe/1",
        step=50,
        evidence={"layer": 1, "kind": "collapse", "strikes": 0, "busiest": 0},
        summary="",
        strength=1.0,
    )
    view = SimpleNamespace(moe_knobs=lambda layer: {"balance_coef": 0.0})
    remedy = remedies.moe(f, view, OrchestratorConfig())
    assert remedy.params == {"value": 0.01, "layer": 1}  # model.moe.balance_coef's default (remedies._raised)
    assert "it was 0 (off): it starts at 0.01" in remedy.reasoning and "4x" not in remedy.reasoning


# ------------------------------------------------------------------------------------ a person's word


def test_a_config_change_with_no_effect_is_not_journaled_as_applied(tmp_path):
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    run = Run()
    run.step = 40
    effect = "no effect: this is not a DPO run (only trimtab dpo reads dpo.*)"
    orchestrator._configured(run, {"key": "dpo.beta", "old": 0.1, "new": 0.5, "effect": effect})
    (decision,) = orchestrator.journal.decisions
    assert decision.applied == [] and decision.outcome == {"result": "no effect"}


# ------------------------------------------------------------------------------------ fault injection


def test_a_fault_armed_for_a_step_fires_on_its_retry_after_an_out_of_memory_error(tmp_path):
    """oom@20 with nan_loss@20: faults.json said nan_loss@20 fired, step 20's loss was finite (the
    retry's on_step_start disarmed it after its firing was counted)."""
    injector = FaultInjector(["oom@20", "nan_loss@20"], tmp_path)
    batch = SimpleNamespace(rows=[])
    injector.on_step_start(SimpleNamespace(step=19), batch)  # step 20: its forward runs out of memory
    injector.on_step_start(SimpleNamespace(step=19), batch)  # the retry, smaller (training/oom.py)
    assert injector._fire_nan is not None and injector.record["fired"] == {"nan_loss@20": 1}
    injector.on_step_end(SimpleNamespace(step=20), None)
    injector.on_step_start(SimpleNamespace(step=20), batch)
    assert injector._fire_nan is None


def test_an_evaluation_fault_does_not_fire_again_when_a_rollback_replays_its_step(tmp_path):
    injector = FaultInjector(["eval_error@50"], tmp_path)
    injector.run = run = SimpleNamespace(step=50, evaluating=True)
    for _ in range(2):  # every forward of that evaluation
        with pytest.raises(RuntimeError, match="injected by eval_error@50"):
            injector._maybe_eval_fault(None, ())
    run.evaluating = False
    injector._maybe_eval_fault(None, ())  # training goes on, and a rollback replays step 50
    run.evaluating = True
    injector._maybe_eval_fault(None, ())  # its evaluation again: the fault fired already
    assert injector.record["evaluations"] == {"eval_error@50": [50]}


def test_a_rollback_to_the_step_just_before_its_fault_tells_a_reproduced_fault(tmp_path):
    """A rollback to the step just before the fault replays the fault's own step first: no healthy
    step before it to find unchanged, and that step, a finding's, had no healthy loss to compare
    with, so a fault back bit for bit (the same rows met the same weights) never got "reproduced_at".
    The faulty step's own loss before tells it; a different loss there is not the run before."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig(outcome_after=5))
    for s in range(1, 21):
        outcomes.follow(metrics(s, loss=5.0 - 0.01 * s), [])
    outcomes.follow(metrics(21, loss=9.0), [finding(21)])
    for loss, reproduced in ((9.0, True), (8.7, False)):
        rollback = pending(journal, 21, action="rollback")
        outcomes.rolled_back(20, rollback.id)
        outcomes.follow(metrics(21, loss=loss), [finding(21)])
        for s in range(22, 26):
            outcomes.follow(metrics(s, loss=4.8), [])
        assert rollback.outcome["result"] == "not recovered" and rollback.outcome["found_after"] == ["spike@21"]
        assert rollback.outcome.get("reproduced_at") == (21 if reproduced else None), loss


def test_a_good_checkpoint_just_past_the_rollback_does_not_close_its_incident():
    """The checkpoint interval shortened after a rollback saved a good checkpoint one step past it, which
    closed the incident: a cause that persists opened incident after incident, each with its own
    max_rollbacks. Closing takes a good checkpoint after outcome_after steps without instability."""
    policy = Policy(OrchestratorConfig())
    act(policy, nonfinite(25), View(probe=math.nan, last_good=20))
    policy.shift(25 - 20)
    for s in range(21, 30):  # the replay passes step 25 and saves a good checkpoint at 28
        policy.quiet(s, View(last_good=28 if s >= 28 else 20))
    assert policy.rollbacks == 1  # still open
    second = act(policy, nonfinite(30), View(probe=math.nan, last_good=28))
    assert second.evidence["incident_rollback"] == 2 and "new incident" not in second.reasoning
