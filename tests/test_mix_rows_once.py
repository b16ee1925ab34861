"""Scenario mixes: a step whose bad rows both the data watch and the rows rule name is one decision."""

from types import SimpleNamespace

from test_orchestrator_incidents import Run
from test_orchestrator_units import metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding


def _finding(rule: str, rows: list[int]) -> Finding:
    return Finding(rule=rule, family="data", step=144, evidence={"rows": rows}, summary=f"{rule} rows", strength=1.0)


def test_rows_the_watch_and_the_rows_rule_both_name_are_left_out_by_one_decision(tmp_path):
    """debug-hybrid, bad_rows@48:6 and bad_batch@140:3 (200 steps): during the watch after step 140,
    the recurring bad_rows rows were named by both rules at the same step, two skip_data each."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    orchestrator.monitors = {
        "rows": SimpleNamespace(observe=lambda m: _finding("rows", [2008, 7]), confirm=lambda *a: None)
    }
    orchestrator.policy.data.watch = lambda run, m, updated_at: _finding("data", [2008])
    run = Run()
    run.step, run.pretrain = 144, {"steps": 200}
    orchestrator._observe(run, metrics(144))
    (decision,) = [d for d in orchestrator.journal.decisions if d.action == "skip_data"]
    assert decision.rule == "data" and decision.params["rows"] == [2008, 7]
    assert decision.evidence["rows_rule"]["rows"] == [7, 2008]
    assert [action for action, _ in run.requests] == ["skip_data"]
