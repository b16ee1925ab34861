"""An emergency (an instability rollback or stop, the replicas rule's rollback) is its step's one set of
actions (deciding.py emergency_at), whichever of the step's hook calls decided the others: the step's
own checks (a transient fault, a straggler, the replicas) and every step of a read of several."""

import math
from types import SimpleNamespace

from test_orchestrator_incidents import Run, nonfinite
from test_orchestrator_units import finding
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


def test_a_transient_faults_exclusion_held_by_a_rollback_is_requested_once_the_rollback_applies(monkeypatch, tmp_path):
    """Rank 3 a suspect device at step 12, the step's weights NaN: the exclusion waited for the rollback and was
    never requested after it (only a recurring fault came back: a transient one does not recur on the replay).
    Now it is decided again at the step the rollback restored, and the held decision says so."""
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, rerun={"exclude": True, "suspect_after": 1})
    verdict = {"verdict": "transient", "loss": [2.0, 2.1], "grad_norm": [1.0, 1.0], "ranks": [3]}
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=verdict))
    orchestrator.last_step, run.step = 12, 10
    orchestrator.on_rollback(run, {})  # the loop applied the rollback (Control.apply goes on to what follows)
    assert [action for action, _ in run.requests] == ["rollback", "exclude_node"]
    rollback, held, again = orchestrator.journal.decisions
    assert "decided again once it is applied" in held.applied[0]
    assert (again.step, again.action, again.params, again.evidence["found_at"]) == (10, "exclude_node", {"node": 1}, 12)
    assert orchestrator.held == []


def test_a_failed_rollback_lets_the_exclusion_it_held_go_ahead(monkeypatch, tmp_path):
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, rerun={"exclude": True, "suspect_after": 1})
    done = {}
    run.control = SimpleNamespace(request=lambda action, on_done=None, **p: done.setdefault(action, on_done))
    verdict = {"verdict": "transient", "loss": [2.0, 2.1], "grad_norm": [1.0, 1.0], "ranks": [3]}
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=verdict))
    run.step = 12  # the run goes on from the state it left
    done["rollback"]("failed: no checkpoint to roll back to")
    assert list(done) == ["rollback", "exclude_node"] and orchestrator.emergency is None


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


def test_a_ladder_climb_held_by_the_replicas_rollback_climbs_again_when_the_replay_meets_it(monkeypatch, tmp_path):
    """Spikes at steps 5 and 8 skipped, a third at step 12 earns an LR cut, and the replicas disagree at 12 (agreed
    at 10): their rollback holds the cut. Not kept for after the rollback (the replay from step 10 meets step 12
    again, or not if the corruption caused it), but planning the cut had spent the ladder's count: the replay's
    spike at 12 was a skip. The ladder goes back to its count, and the replay's spike earns the cut."""
    orchestrator, run = _two_nodes(monkeypatch, tmp_path, replicas={"every": 4})
    run.probe = None  # no held-out probe: the ladder climbs on its count alone
    for step in (5, 8):
        orchestrator.decide(run, finding(step))
    orchestrator._read = lambda run, commands=True: orchestrator.decide(run, finding(orchestrator.last_step))
    odd = {"ranks": [1], "checksums": ["a", "b"], "agreed_step": 10, "every": 4}
    found = Finding(rule="replicas", family="replicas", step=12, evidence=odd, summary="rank 1 differs", strength=1.0)
    orchestrator.replicas.observe = lambda step, checksum: found
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=None))
    orchestrator.last_step, run.step = 12, 10
    orchestrator.on_rollback(run, {})  # the replicas' rollback applied
    orchestrator.replicas.observe = lambda step, checksum: None
    orchestrator.on_step_end(run, SimpleNamespace(step=12, rerun=None))  # the replay's step 12 spikes again
    held, replayed = orchestrator.journal.decisions[-2:]
    assert (held.action, held.outcome["result"]) == ("scale_lr", "cut short")
    assert (replayed.step, replayed.action, replayed.outcome) == (12, "scale_lr", None)
