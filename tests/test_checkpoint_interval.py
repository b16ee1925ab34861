"""The checkpoint-interval rule (orchestrator/interval.py): Young's interval counts the run's own
rollbacks as failures beside the hardware's."""

from types import SimpleNamespace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.interval import CheckpointInterval

STEP_S, STALL_S = 0.5, 0.34  # small on CPU: a step, and a save of its 17 MB checkpoint


def test_a_rollback_brings_the_checkpoints_closer_and_a_fault_free_run_keeps_its_interval():
    """36 steps of 0.5 s at checkpoint.every 50 on one device: the hardware's MTBF (Llama 3's rate,
    ~35,000 h) keeps 50. A rollback that threw away 38 steps makes the failures' rate 1 in 18 s
    trained: sqrt(2 x 0.34 x 18) = 3.5 s, 6 steps (with the hardware's rate beside it), judged at
    once, with the stall and the replay in the evidence; not again at the saves after it."""
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
    assert f.evidence["steps"] == 6 and f.evidence["was"] == 50
    assert f.evidence["rollbacks"] == 1 and f.evidence["replayed_steps"] == 38
    assert f.evidence["save_stall_s"] == STALL_S and f.evidence["trained_s"] == 18.0
    assert "1 rollback(s)" in f.summary
    # judged at the rollback: the saves after it leave the interval, though the rate falls as the run trains
    assert rule.observe(60, [STEP_S] * 23, STALL_S, world=1, every=6, configured=50) is None


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
    resumed = Orchestrator(OrchestratorConfig(), tmp_path)
    resumed.load_state_dict(orchestrator.state_dict())
    assert (resumed.interval.rollbacks, resumed.interval.replayed) == (1, 36)
