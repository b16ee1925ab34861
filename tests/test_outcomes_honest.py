"""What the orchestrator claims about its own decisions: an outcome the run's end judged on too few
steps, a note that did nothing, the LR chart's schedule, and the faults healed a run counts."""

from types import SimpleNamespace

import pytest

from helpers import FakeTrainer
from test_orchestrator_incidents import pending
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.remedies import Remedy
from trimtab.report.figures import learning_rate
from trimtab.report.page import _outcome
from trimtab.rundir import healed, incidents, read_decisions
from trimtab.training.metrics import step_metrics


def _finding(rule, family, step):
    return Finding(rule=rule, family=family, step=step, evidence={}, summary=rule, strength=1.0)


def _follow(orchestrator, steps, findings=()):
    for step in steps:
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=4.9, grad_norm=1.0), list(findings))


def test_a_decision_the_run_ended_right_after_is_too_early_and_heals_nothing(tmp_path):
    """An RL run's rl_signal decision 1 step before the end was "recovered" with every group still
    flat, and rundir.healed counted it as a fault healed."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    settled = pending(orchestrator.journal, 92, "nonfinite", "skip_step")  # 5 healthy steps answered it
    _follow(orchestrator, range(93, 99))
    back = pending(orchestrator.journal, 98, "spike", "scale_lr")
    spike = _finding("spike", "instability", 99)
    _follow(orchestrator, [99], [spike])  # the trouble back: a failure shows in any number of steps
    early = pending(orchestrator.journal, 99, "rl_signal", "set_dynamic_sampling", family="rl_signal")
    _follow(orchestrator, [100])
    last = pending(orchestrator.journal, 100, "nonfinite", "skip_step")  # at the last step: nothing followed
    orchestrator.on_train_end(FakeTrainer(tmp_path), {})
    results = {d["id"]: d["outcome"] for d in read_decisions(tmp_path)}
    assert results[last.id] == {"result": "too early", "steps": 0}
    assert results[early.id]["result"] == "too early" and results[early.id]["steps"] == 1
    assert results[early.id]["loss_after"] == pytest.approx(4.9)  # what was measured is kept
    assert results[settled.id]["result"] == "recovered"
    assert results[back.id]["result"] == "not recovered"
    assert healed(read_decisions(tmp_path)) == 1  # the skip: not the decision judged on 1 step
    assert orchestrator.journal.track_record("rl_signal", "set_dynamic_sampling") == (0, 0)
    shown = _outcome({"outcome": results[early.id]}, 20)
    assert shown == "too early (on 1 of the 20 steps it is judged on: the run ended first)"


def test_a_not_recovered_outcome_names_the_findings_that_said_so(tmp_path):
    """nan_loss@20 + grad_spike@23: the skip at 20 was "not recovered" with only "findings_after": 1;
    a person could not tell the NaN come back from the grad rule's own fault, answered by its own
    decision. The outcome names the rule and step, and the report says it."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    skip = pending(orchestrator.journal, 20, "nonfinite", "skip_step")
    _follow(orchestrator, [21, 22])
    _follow(orchestrator, [23], [_finding("grad", "instability", 23), _finding("throughput", "throughput", 23)])
    _follow(orchestrator, range(24, 41))
    (judged,) = [d for d in read_decisions(tmp_path) if d["id"] == skip.id]
    assert judged["outcome"]["result"] == "not recovered" and judged["outcome"]["found_after"] == ["grad@23"]
    assert _outcome(judged, 20) == "not recovered (the trouble back: grad at step 23)"


def test_a_note_is_noted_not_recovered(tmp_path):
    """A throughput slowdown logged (action none, make_up "log only") was judged on the loss after
    it: "recovered", a healing that never was."""
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), FakeTrainer(tmp_path)
    slow = _finding("throughput", "throughput", 15)
    note = orchestrator._decide(run, slow, Remedy(action="none", reasoning="log only"))
    _follow(orchestrator, range(16, 40))
    assert note.outcome == {"result": "noted", "steps": 0}
    assert orchestrator.journal.pending() == []


def _record(**metrics):
    line = {"step": 50, "tokens": 5000, **metrics}
    return SimpleNamespace(name="r", train=[line], lines=[line])


def test_the_lr_chart_draws_the_schedule_as_logged():
    """lr_spike@45:10 then the orchestrator's x0.1 cut: lr 1.4e-3 at lr_scale 0.1, the schedule 1.4e-3.
    The chart drew lr / lr_scale, a schedule 10x the real one."""
    fig = learning_rate([_record(lr=1.4e-3, lr_scale=0.1, lr_scheduled=1.4e-3)])
    scheduled = next(t for t in fig.data if t.name == "r scheduled")
    assert list(scheduled.y) == [pytest.approx(1.4e-3)]
    older = learning_rate([_record(lr=1.4e-3, lr_scale=0.5)])  # logged before lr_scheduled was
    assert list(next(t for t in older.data if t.name == "r scheduled").y) == [pytest.approx(2.8e-3)]


def test_the_log_line_has_the_schedules_own_lr():
    out = SimpleNamespace(scheduled_lr=1.4e-3, aux_loss=None, moe=None, mod=None)
    trainer = SimpleNamespace(
        window=SimpleNamespace(read=lambda: ([5.0], [1.0], 0), tokens=1024, seconds=1.0, gains=[]),
        state=SimpleNamespace(step=50, phase=0, lr_scale=0.1, tokens=51200),
        phases=[SimpleNamespace(name="pretrain")],
        loader=SimpleNamespace(micro_batch_tokens=1024, epoch=0, metrics=dict),
        cfg=SimpleNamespace(rl=SimpleNamespace(enabled=False)),
        scaler=None,
        peak_flops=0,
        last_step_out=out,
        device=SimpleNamespace(type="cpu"),
    )
    line = step_metrics(trainer, 1.4e-3)
    assert line["lr_scheduled"] == 1.4e-3 and line["lr"] / line["lr_scale"] == pytest.approx(1.4e-2)


def _journaled(step, rule, action, result, steps=20, family="instability"):
    outcome = {"result": result, "steps": steps}
    return {"id": step, "step": step, "rule": rule, "family": family, "action": action, "outcome": outcome}


def test_distinct_faults_are_distinct_incidents():
    """nan_loss@20, bad_rows@30 and nan_loss@57 on one run: one instability incident within 50 steps,
    "faults healed 1". The skip at 20 recovered: bad data after it, or a NaN once its step settled
    (by 25: a later finding is another fault, outcomes.py), is another fault."""
    journal = [
        _journaled(20, "nonfinite", "skip_step", "recovered"),
        _journaled(30, "spike", "skip_data", "recovered"),
        _journaled(31, "data", "skip_data", "recovered", family="data"),
        _journaled(57, "nonfinite", "scale_lr", "too early", steps=8),
    ]
    assert [[d["step"] for d in i] for i in incidents(journal)] == [[20], [30], [57]]
    assert healed(journal) == 2


def test_one_fault_stays_one_incident():
    """A skip the trouble came back after, a rollback's replay, and a bad stretch's rows left out in
    turn (each measured on its own rows) answer one fault."""
    skips = [
        _journaled(10, "spike", "skip_step", "not recovered"),
        _journaled(12, "spike", "skip_step", "not recovered"),
        _journaled(14, "spike", "rollback", "recovered"),
        _journaled(9, "spike", "skip_step", "recovered"),  # the replay decided it again
    ]
    stretch = [_journaled(s, "spike", "skip_data", "recovered") for s in (100, 103, 106)]
    assert [len(i) for i in incidents(skips + stretch)] == [4, 3] and healed(skips + stretch) == 2


def _replayed_rollback(tmp_path, above):
    """A rollback at step 40 to step 20, its replay of steps 21-40 `above` x the losses those steps
    had before (the same rows at the same point of the schedule), with step-to-step noise of 0.01."""
    tmp_path.mkdir()
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    first = {step: 6.0 - 0.05 * step for step in range(1, 41)}
    for step, loss in first.items():
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=loss, grad_norm=1.0), [])
    rollback = pending(orchestrator.journal, 40, "above_start", "rollback", loss_before=first[40])
    for step in range(21, 41):
        noise = 0.01 * (-1) ** step
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=first[step] * above + noise, grad_norm=1.0), [])
    (judged,) = [d for d in read_decisions(tmp_path) if d["id"] == rollback.id]
    assert judged["outcome"]["replayed_steps"] == 20
    return judged["outcome"]


def test_a_replay_above_its_reference_by_more_than_its_noise_is_not_recovered(tmp_path):
    """A rollback with an LR cut x0.316 (debug, bad_batch every 10 steps) replayed its steps 4.4%
    above their losses before and was "recovered" within the flat 5%. Paired step by step, 3%
    above with noise of 0.01 is far past the noise: not recovered; a faithful replay is."""
    assert _replayed_rollback(tmp_path / "a", 1.03)["result"] == "not recovered"
    assert _replayed_rollback(tmp_path / "b", 1.0)["result"] == "recovered"


def test_a_faithful_replay_on_a_flat_loss_is_recovered(tmp_path):
    """DPO at ln 2 (debug, weights_nan@8): rolled back to step 5, its replay of steps 6-7 the run
    before bit for bit (no noise to measure) and its new steps 1e-5 nats over the loss before read
    "not recovered", so `trimtab runs` counted 0 faults healed. The replay's own excess is 0."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    first = {step: 0.6931 + 1e-4 * (-1) ** step for step in range(1, 8)}
    for step, loss in first.items():
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=loss, grad_norm=1.0), [])
    rollback = pending(orchestrator.journal, 8, "nonfinite", "rollback", loss_before=0.6931)
    for step in range(6, 26):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=first.get(step, 0.69311), grad_norm=1.0), [])
    (judged,) = [d for d in read_decisions(tmp_path) if d["id"] == rollback.id]
    assert judged["outcome"]["identical_steps"] == judged["outcome"]["replayed_steps"] == 2
    assert judged["outcome"]["result"] == "recovered" and healed(read_decisions(tmp_path)) == 1


def test_a_restart_whose_session_completes_the_run_heals_its_fault_however_few_steps_followed(tmp_path):
    """An emergency save at step 19 of 20: the restart's session trained step 20 and completed the run, yet
    its `resume` decision read "too early" (0 steps followed it) and `trimtab runs` counted 0 faults healed.
    A run that did not complete leaves it too early; any other decision taken as late stays too early."""
    for status, healed_count in (("completed", 1), ("stopped (SIGTERM)", 0)):
        run_dir = tmp_path / status[:7]
        run_dir.mkdir()
        orchestrator = Orchestrator(OrchestratorConfig(), run_dir)
        restart = pending(orchestrator.journal, 19, "restart", "resume", family="cluster")
        skip = pending(orchestrator.journal, 19, "nonfinite", "skip_step")
        _follow(orchestrator, [20])
        orchestrator.on_train_end(FakeTrainer(run_dir), {"status": status})
        results = {d["id"]: d["outcome"]["result"] for d in read_decisions(run_dir)}
        assert results[restart.id] == ("recovered" if healed_count else "too early")
        assert results[skip.id] == "too early"
        assert healed(read_decisions(run_dir)) == healed_count


def test_two_restarts_are_two_faults_healed_once_the_first_session_trained_on():
    """Rank 1 killed at steps 12 and 30 of 40 (torchrun --max-restarts 3): two restarts, both recovered, read
    "faults healed 1" (one incident: the same family within 50 steps). A restart whose session trained on is
    settled as a skipped step is; a second loss right after a restart (a crash loop) stays its incident."""
    recovered = {"result": "recovered", "steps": 20}
    restart = {"rule": "restart", "family": "cluster", "action": "resume", "mode": "auto", "outcome": recovered}
    assert healed([{**restart, "step": 11}, {**restart, "step": 29}]) == 2
    assert healed([{**restart, "step": 11}, {**restart, "step": 13}]) == 1


def test_rows_left_out_are_answered_once_healthy_steps_followed_however_near_the_end(tmp_path):
    """A spike's skip_data 16 steps before the run's end stayed "too early" (soak, 2 ranks and one
    process alike): rows left out for good answer their trouble as a skipped step does, once SETTLED
    healthy steps followed; rows back within them are not recovered."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    left_out = pending(orchestrator.journal, 80, "spike", "skip_data", family="data")
    _follow(orchestrator, range(81, 97))
    orchestrator.on_train_end(FakeTrainer(tmp_path), {})
    (judged,) = [d for d in read_decisions(tmp_path) if d["id"] == left_out.id]
    assert judged["outcome"]["result"] == "recovered" and judged["outcome"]["steps"] == 16
    assert healed(read_decisions(tmp_path)) == 1


def _lr_cut_replay(tmp_path, replay):
    """above_start at step 35 of a run at an LR far too high (its loss fell fast at first, as such
    an LR's does), rolled back to step 0 with a cut: the replay of steps 1-20 has losses `replay(step)`."""
    tmp_path.mkdir()
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    for step in range(1, 36):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=6.25 - 0.08 * step, grad_norm=1.0), [])
    cut = pending(orchestrator.journal, 35, "above_start", "rollback", loss_before=3.6)
    cut.evidence, cut.params = {"start": 6.25, "since": 1, "gain": 0.15}, {"to": 0, "lr_factor": 0.1}
    for step in range(1, 21):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=replay(step), grad_norm=1.0), [])
    (judged,) = [d for d in read_decisions(tmp_path) if d["id"] == cut.id]
    return judged["outcome"]


def test_an_lr_cut_replay_is_judged_on_its_start_not_on_the_abandoned_too_fast_branch(tmp_path):
    """debug-moe at 30x its LR, cut and rolled back to 0 at step 35: the replay, slower at first than
    the abandoned branch (a too-high LR drops the loss fast before it inflates the weights), read "not
    recovered" paired with that branch's steps, and the cut won 0.40-0.68 nats by the run's end. The
    cut claims the loss falls from where the trouble began: the abandoned branch's at step 1 (6.17, under the
    start), by the window's end (outcomes.py: _claim); a replay that does not is not recovered."""
    healed = _lr_cut_replay(tmp_path / "a", lambda step: 6.25 - 0.04 * step + 0.01 * (-1) ** step)
    assert healed["result"] == "recovered" and healed["loss_before"] == pytest.approx(6.17)
    assert healed["compared_with"] == "the loss at step 1" and healed["loss_end"] == pytest.approx(5.53, abs=0.01)
    assert "replayed_steps" not in healed  # the fault's own steps: no step-by-step pairs
    stuck = _lr_cut_replay(tmp_path / "b", lambda step: 6.27 + 0.01 * (-1) ** step)  # within 5%, not below
    assert stuck["result"] == "not recovered"


def test_a_restart_on_fewer_ranks_continued_and_heals_no_fault(tmp_path):
    """torchrun --standalone 2 ranks, kill_rank@12:1, the job resumed on the one rank left: its resume read
    "recovered" and `trimtab runs` counted a fault healed. The job went on without the rank: "continued",
    with the worlds and what was lost; the same restart on the whole world still recovers."""
    results = {}
    for after in (1, 2):
        run_dir = tmp_path / f"world{after}"
        run_dir.mkdir()
        orchestrator = Orchestrator(OrchestratorConfig(), run_dir)
        restart = pending(orchestrator.journal, 10, "restart", "resume", family="cluster")
        restart.evidence = {
            "kind": "lost_rank",
            "world_before": 2,
            "world_after": after,
            "steps_lost": 1,
            "down_s": 3.5,
        }
        _follow(orchestrator, range(11, 41))
        orchestrator.on_train_end(FakeTrainer(run_dir), {"status": "completed"})
        results[after] = read_decisions(run_dir)
    (smaller,), (whole,) = results[1], results[2]
    assert smaller["outcome"]["result"] == "continued" and healed(results[1]) == 0
    assert (smaller["outcome"]["world_before"], smaller["outcome"]["world_after"]) == (2, 1)
    assert smaller["outcome"]["steps_lost"] == 1 and smaller["outcome"]["down_s"] == 3.5
    assert (
        whole["outcome"]["result"] == "recovered" and "world_after" not in whole["outcome"] and healed(results[2]) == 1
    )
