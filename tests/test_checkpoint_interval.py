"""The checkpoint-interval rule (orchestrator/interval.py): Young's interval counts the run's own
rollbacks as failures beside the hardware's."""

import math
from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.interval import CheckpointInterval, poisson_rate_low
from trimtab.orchestrator.journal import Decision

STEP_S, STALL_S = 0.5, 0.34  # small on CPU: a step, and a save of its 17 MB checkpoint


def test_a_rollback_brings_the_checkpoints_closer_and_a_fault_free_run_keeps_its_interval():
    """36 steps of 0.5 s at checkpoint.every 50 on one device: the hardware's MTBF (Llama 3's rate,
    ~35,000 h) keeps 50. A rollback that threw away 38 steps in 18 s trained makes the failures'
    rate at least 0.105 / 18 s (its 90% lower confidence bound): sqrt(2 x 0.34 x 171) = 10.8 s, 21
    steps (with the hardware's rate beside it), 16 to a power of two, judged at once, with the stall
    and the replay in the evidence; not again at the saves after it."""
    cfg = OrchestratorConfig()
    assert cfg.checkpoint_interval.rollbacks  # on by default
    cfg.checkpoint_interval.rollbacks = False
    off = CheckpointInterval(cfg)  # orchestrator.checkpoint_interval.rollbacks off: the hardware's alone
    off.observe(36, [STEP_S] * 36, STALL_S, world=1, every=50, configured=50)
    off.rolled_back(38)
    assert off.observe(37, [STEP_S], STALL_S, world=1, every=50, configured=50) is None
    rule = CheckpointInterval(OrchestratorConfig())
    assert rule.observe(36, [STEP_S] * 36, STALL_S, world=1, every=50, configured=50) is None
    rule.rolled_back(38)
    f = rule.observe(37, [], 0.0, world=1, every=50, configured=50)
    assert f is not None and f.rule == "checkpoint_interval"
    assert f.evidence["steps"] == 16 and f.evidence["was"] == 50
    assert f.evidence["rollbacks"] == 1 and f.evidence["replayed_steps"] == 38
    assert f.evidence["save_stall_s"] == STALL_S and f.evidence["trained_s"] == 18.0
    assert "1 rollback(s)" in f.summary
    # judged at the rollback: the saves after it leave the interval, though the rate falls as the run trains
    assert rule.observe(60, [STEP_S] * 23, STALL_S, world=1, every=16, configured=50) is None


def interval_after(rollbacks: int, steps: int, step_s: float, stall_s: float, configured: int = 50) -> int:
    """The interval, in steps, the rule sets after `rollbacks` in `steps` steps of `step_s` (one device)."""
    rule = CheckpointInterval(OrchestratorConfig())
    rule.observe(steps, [step_s] * steps, stall_s, world=1, every=configured, configured=configured)
    for _ in range(rollbacks):
        rule.rolled_back(10)
    f = rule.observe(steps + 1, [], 0.0, world=1, every=configured, configured=configured)
    return f.evidence["steps"] if f else configured


def test_one_rollback_is_no_rate_to_checkpoint_every_step_by_but_many_rollbacks_are():
    """An MTBF from one event has a spread as large as itself: one rollback in 10 steps of 1 s with a
    save of 5% of a step made Young's interval sqrt(2 x 0.05 x 10) = 1 s, a checkpoint every step.
    At the rate's 90% lower bound (Garwood 1936: 0.105 events, not 1) it is sqrt(2 x 0.05 x 95) = 3 steps (4, the
    nearest power of two);
    ten rollbacks in the same 10 s are evidence enough (6.2 events at the bound): every step again, and
    so is a save truly cheap beside a step (0.1% of it) after one rollback."""
    assert poisson_rate_low(1) == pytest.approx(-math.log(0.9), rel=1e-6)  # chi2(0.1, 2) / 2, closed form
    assert poisson_rate_low(1) < poisson_rate_low(2) / 2 < poisson_rate_low(10) / 10 < 1  # nears n as n grows
    assert interval_after(1, 10, 1.0, 0.05, configured=1) == 1  # any interval fits under a configured one
    # Young's 4, 1 and 1 steps: held at the rollbacks' floor, a quarter of checkpoint.every 50 (16)
    assert interval_after(1, 10, 1.0, 0.05) == interval_after(10, 10, 1.0, 0.05) == 16
    assert interval_after(1, 10, 1.0, 0.001) == 16


def test_the_orchestrator_counts_its_rollbacks_and_a_resume_keeps_them(tmp_path):
    """on_rollback gives the interval rule the steps its own rollback threw away (a person's rollback
    is no failure); the count is in the orchestrator's state, so a resumed run judges with it (the
    interval rule's own window starts afresh)."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    orchestrator.last_step = 36
    orchestrator.on_rollback(SimpleNamespace(step=0), {})  # a person's (ctl rollback): a choice, no failure
    assert (orchestrator.interval.rollbacks, orchestrator.interval.replayed) == (0, 0)
    orchestrator.rolling_back = 7  # the orchestrator's own decision 7 asked for it
    orchestrator.on_rollback(SimpleNamespace(step=0), {})
    assert (orchestrator.interval.rollbacks, orchestrator.interval.replayed) == (1, 36)
    assert orchestrator.interval.latest == 7  # its outcome, once judged, says whether the remedy took
    resumed = Orchestrator(OrchestratorConfig(), tmp_path)
    resumed.load_state_dict(orchestrator.state_dict())
    assert (resumed.interval.rollbacks, resumed.interval.replayed) == (1, 36)


def test_a_remedied_rollback_gives_the_interval_back_and_a_recurring_one_shortens_it():
    """debug-hybrid at 30x its LR: one rollback for the LR (cut, outcome "recovered") left the run
    saving every 3-4 steps for good (`small`: every step). Once the latest rollback's outcome is
    "recovered" they count no more and the interval goes back to checkpoint.every; "not recovered"
    keeps them counting, and a rollback after a healed one counts them all again."""
    rule = CheckpointInterval(OrchestratorConfig())
    rule.observe(36, [STEP_S] * 36, STALL_S, world=1, every=50, configured=50)
    rule.rolled_back(38, decision=5)
    assert rule.observe(37, [], 0.0, world=1, every=50, configured=50).evidence["steps"] == 16
    rule.judged({4: "recovered"})  # another decision's outcome: the rollback's still unjudged
    assert rule.observe(40, [STEP_S] * 3, STALL_S, world=1, every=16, configured=50) is None
    rule.judged({5: "recovered"})
    assert rule.observe(41, [STEP_S], 0.0, world=1, every=16, configured=50) is None  # hysteresis: 5 steps on
    f = rule.observe(87, [STEP_S] * 46, 0.0, world=1, every=16, configured=50)  # 50 steps trained since 16 was set
    assert f is not None and f.evidence["steps"] == 50 and f.evidence["healed_rollbacks"] == 1
    assert "rollbacks" not in f.evidence and "ended in a recovery" in f.summary
    rule.rolled_back(10, decision=9)  # the run fails again: both rollbacks are failures
    again = rule.observe(88, [STEP_S], 0.0, world=1, every=50, configured=50)
    assert again.evidence["rollbacks"] == 2 and again.evidence["steps"] == 16  # the rollbacks' floor
    rule.judged({9: "not recovered"})
    assert rule.observe(89, [STEP_S], STALL_S, world=1, every=again.evidence["steps"], configured=50) is None
    rule.rolled_back(10, decision=11)  # the same fault's next try (debug-hybrid at 30x: x0.1, x0.5, x0.5)
    resumed = CheckpointInterval(OrchestratorConfig())
    resumed.load_state_dict(rule.state_dict())
    assert (resumed.rollbacks, resumed.healed, resumed.failures, resumed.latest) == (3, 0, 3, 11)
    resumed.judged({9: "not recovered", 11: "recovered"})
    assert resumed.failures == 0


def test_twin_runs_whose_save_stalls_differ_a_little_keep_the_same_checkpoints():
    """The save stall is measured: 0.34 s and 0.37 s (twin runs, one rollback) made 21 and 22 steps,
    different checkpoints; rounded to the nearest power of two both are 16."""
    assert interval_after(1, 36, STEP_S, 0.34) == interval_after(1, 36, STEP_S, 0.37) == 16


def test_the_orchestrator_tells_the_interval_its_rollbacks_outcomes(tmp_path):
    """The rollback's decision, judged "recovered" in the journal, heals it at the next read."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    orchestrator.last_step, orchestrator.rolling_back = 7, 3
    orchestrator.on_rollback(SimpleNamespace(step=0), {})
    run = SimpleNamespace(step=8, total_steps=100, checkpoint_every=4, world=1)
    run.cfg = SimpleNamespace(checkpoint=SimpleNamespace(every=20))
    orchestrator._checkpoint_interval(run, [STEP_S], 0.0)
    assert orchestrator.interval.failures == 1  # not judged yet
    fields = {"id": 3, "step": 7, "rule": "above_start", "evidence": {}, "reasoning": "", "action": "rollback"}
    rollback = Decision(**fields, params={}, confidence=0.65, mode="auto", outcome={"result": "recovered"})
    orchestrator.journal.decisions.append(rollback)
    orchestrator._checkpoint_interval(run, [STEP_S], 0.0)
    assert (orchestrator.interval.failures, orchestrator.interval.healed) == (0, 1)


def test_the_rollbacks_hold_the_interval_in_bounds_and_it_swings_back_no_sooner_than_an_interval():
    """debug-mod, checkpoint.every 20: a rollback set 8 steps, its "recovered" outcome 20 again, and
    the next rollback 8 (20 -> 8 -> 20 within 20 steps; elsewhere 2-4 steps, a good checkpoint one step
    past each rollback). The rollbacks shorten it to a quarter of checkpoint.every at most, the hardware's
    MTBF alone may go below; lengthened only once checkpoint.every steps were trained at the short one."""
    rule = CheckpointInterval(OrchestratorConfig())
    rule.observe(20, [1.0] * 20, 0.01, world=1, every=20, configured=20)
    rule.rolled_back(18, decision=3)
    short = rule.observe(21, [], 0.0, world=1, every=20, configured=20)
    assert short.evidence["steps"] == 4 and short.evidence["young_s"] == 1.95  # 2 steps, floored at 20 / 4
    rule.judged({3: "recovered"})
    for step in range(22, 40):  # the outcome came 18 steps on: held at 4
        assert rule.observe(step, [1.0], 0.0, world=1, every=4, configured=20) is None
    back = rule.observe(41, [1.0] * 2, 0.0, world=1, every=4, configured=20)
    assert back is not None and back.evidence["steps"] == 20
    cfg = OrchestratorConfig()
    cfg.checkpoint_interval.mtbf_hours = 0.0005  # hardware failing every 1.8 s: its own Young's is 0.2 s
    failing = CheckpointInterval(cfg)
    failing.observe(20, [1.0] * 20, 0.01, world=1, every=20, configured=20)
    failing.rolled_back(18)
    assert failing.observe(21, [], 0.0, world=1, every=20, configured=20).evidence["steps"] == 1
