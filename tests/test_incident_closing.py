"""How incidents end for `trimtab runs` and the report: a restart on fewer ranks that the run's end came to
before a step followed it continued (no fault healed), and the ladder's incidents are counted by the ladder's
own incident numbers (rundir.incidents). Units: a fake view, no run."""

import math
from dataclasses import asdict

from test_orchestrator_incidents import Run, nonfinite
from test_orchestrator_units import finding
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy
from trimtab.orchestrator.restarts import restart_finding
from trimtab.rundir import healed, incidents, read_decisions

LOST = {"kind": "lost_rank", "ranks_to_blame": [1], "step": 20, "resumed_step": 19, "steps_lost": 1, "down_s": 5.0}


def test_a_restart_on_fewer_ranks_the_end_came_to_at_once_continued(tmp_path):
    """2 ranks, rank 1 lost at step 20 of 20, resumed on 1 at step 20 (an emergency save): the run completed
    with no step after the restart, and on_train_end turned its "too early" into "recovered" ("faults healed
    1"), where a restart on fewer ranks judged on its steps reads "continued". On the same world: recovered."""
    for world, result, count in ((1, "continued", 0), (2, "recovered", 1)):
        run_dir = tmp_path / str(world)
        run_dir.mkdir()
        orchestrator, run = Orchestrator(OrchestratorConfig(), run_dir), Run()
        run.step = run.total_steps = 20
        orchestrator.decide(run, restart_finding({**LOST, "world_before": 2, "world_after": world}, 20))
        orchestrator.on_train_end(run, {"status": "completed"})
        (restart,) = read_decisions(run_dir)
        assert restart["outcome"]["result"] == result and healed([restart]) == count
    assert restart["outcome"] == {"result": "recovered", "steps": 0}  # the last one's: the same world


def test_every_ladder_decision_carries_its_incidents_number(tmp_path):
    """NaN weights at step 25: rollback 1 of incident 1. Its replay saved a good checkpoint at 40 and trained
    quiet past it, and the ladder closed the incident (ladder.py _clear); a gradient spike at 55 is a skip that
    opens incident 2 (before, only a rollback's incident_rollback said a new one began), one at 60 is in it, and
    one escalation_window steps later opens incident 3. Follow-ups (lr_restore: NOT_FAULTS) carry none."""
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), Run(probe=math.nan, last_good=20)
    first = orchestrator.decide(run, nonfinite(25))
    orchestrator.last_step, run.step, run.probe = 25, 20, 5.0
    orchestrator.on_rollback(run, {})
    for step in range(21, 55):
        run.last_good = 40 if step >= 40 else 20
        orchestrator.policy.quiet(step, run)
    spikes = [orchestrator.decide(run, finding(step, rule="grad")) for step in (55, 60, 60 + 50)]
    assert first.action == "rollback" and [d.action for d in spikes] == ["skip_step"] * 3
    assert [d.evidence["incident"] for d in (first, *spikes)] == [1, 2, 2, 3]
    assert [len(i) for i in incidents([asdict(d) for d in orchestrator.journal.decisions])] == [1, 2, 1]
    restore = Finding(rule="lr_restore", family="instability", step=170, evidence={}, summary="", strength=0.8)
    given_back = Remedy(action="scale_lr", params={"factor": 2.0}, reasoning="quiet since the LR cut")
    assert "incident" not in orchestrator._decide(run, restore, given_back).evidence
