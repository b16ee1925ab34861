"""An emergency (an instability rollback or stop, the replicas rule's rollback) is its step's one set of
actions (deciding.py emergency_at), whichever of the step's hook calls decided the others: the step's
own checks (a transient fault, a straggler, the replicas) and every step of a read of several."""

import math
from types import SimpleNamespace

from test_orchestrator_incidents import Run, nonfinite
from trimtab.config import load_config
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding


class Replicated(Run):
    """Two nodes of two DDP ranks (the env set by _two_nodes), NaN weights: a rollback at the first finding."""

    world, replicated, is_main, work_s = 4, True, True, 0.0

    def __init__(self):
        super().__init__(probe=math.nan, last_good=10)
        self.pretrain = {"steps": 60}

    def weight_checksum(self):
        return 0

    def context_free_loss(self):
        return None


def _two_nodes(monkeypatch, tmp_path, **rules):
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = load_config(None, overrides={"orchestrator": rules}).orchestrator
    orchestrator, run = Orchestrator(cfg, tmp_path), Replicated()
    orchestrator.read_every = 1
    # the step's read finds its weights NaN (nonfinite): the ladder's rollback, an emergency
    orchestrator._read = lambda run, commands=True: orchestrator.decide(run, nonfinite(orchestrator.last_step))
    return orchestrator, run


def test_a_stragglers_exclusion_decided_before_the_read_waits_for_the_reads_rollback(monkeypatch, tmp_path):
    """A slow rank 3 named at step 12 with straggler.exclude, the step's weights NaN: the exclusion (a save of
    the broken step, the job restarted from it) was requested before the read's rollback, and both applied.
    Now the rollback alone; the rank is named again at its next slow window (the replay's)."""
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, straggler={"exclude": True})
    slow = {"ranks": [3], "compute_s_per_step": [0.1, 0.1, 0.1, 1.0], "scores": [1, 1, 1, 0.1]}
    found = Finding(rule="straggler", family="straggler", step=12, evidence=slow, summary="rank 3 slow", strength=0.9)
    orchestrator.stragglers.named = {3: 0.1}
    orchestrator.stragglers.observe = lambda step, work_s: found
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=None))
    assert [action for action, _ in run.requests] == ["rollback"]
    rollback, excluded = orchestrator.journal.decisions
    assert (rollback.rule, excluded.action) == ("nonfinite", "exclude_node")
    assert excluded.outcome == {"result": "cut short", "steps": 0, "dropped_by": rollback.id}
    assert orchestrator.stragglers.named == {}


def test_a_transient_faults_exclusion_waits_for_the_reads_rollback(monkeypatch, tmp_path):
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, rerun={"exclude": True, "suspect_after": 1})
    verdict = {"verdict": "transient", "loss": [2.0, 2.1], "grad_norm": [1.0, 1.0], "ranks": [3]}
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=verdict))
    assert [action for action, _ in run.requests] == ["rollback"]
    excluded = orchestrator.journal.decisions[-1]
    assert excluded.action == "exclude_node" and excluded.outcome["result"] == "cut short"


def test_the_replicas_rollback_goes_first_and_the_reads_waits(monkeypatch, tmp_path):
    """Replicas that disagree at step 12 (agreed at 10) and NaN weights read at 12: both rollbacks were
    requested, the replicas' to step 10 and then the ladder's to last_good, which restored a checkpoint
    written since from a copy the replicas rule had just refused. The replicas' alone: the replay from
    before both faults meets the NaN again if it was not the corruption's."""
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, replicas={"every": 4})
    odd = {"ranks": [1], "checksums": ["a", "b"], "agreed_step": 10, "every": 4}
    found = Finding(rule="replicas", family="replicas", step=12, evidence=odd, summary="rank 1 differs", strength=1.0)
    orchestrator.replicas.observe = lambda step, checksum: found
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=None))
    assert run.requests == [("rollback", {"to": 10})]
    replicas, ladder = orchestrator.journal.decisions
    assert ladder.outcome == {"result": "cut short", "steps": 0, "dropped_by": replicas.id}
    assert orchestrator.policy.rollbacks == 0  # the ladder did not climb for a rollback it did not make


def test_a_read_of_several_steps_holds_the_later_steps_changes_until_the_rollback_applies(tmp_path):
    """read_every 10 (a GPU's): the read at step 20 decides step 15's rollback, then a change for step 17,
    in the same hook call; the change outlived the rollback (it was held only at step 15 itself)."""
    orchestrator, run = Orchestrator(load_config(None).orchestrator, tmp_path), Replicated()
    rollback = orchestrator.decide(run, nonfinite(15))
    interval = Finding(
        rule="checkpoint_interval", family="checkpoint", step=17, evidence={"steps": 5}, summary="", strength=1.0
    )
    held = orchestrator.decide(run, interval)
    assert [action for action, _ in run.requests] == ["rollback"]
    assert held.outcome["dropped_by"] == rollback.id
    orchestrator.last_step, run.step = 20, 10
    orchestrator.on_rollback(run, {})  # applied: the replay's changes go ahead
    assert orchestrator.decide(run, interval).outcome is None and run.requests[-1][0] == "set_checkpoint_every"
