"""Rows the row gate left out at a rollback's step go with the rollback (deciding.py _gated_rows): out of
their step's update already, they change nothing it restores. Held back as any change beside an emergency,
the replay met them again and gated them again (debug at 10x the LR, bad_rows@10:4: the 8 rows gated at
step 12, the rollback's, journaled in 3 decisions over two rollbacks)."""

from test_deciding_emergency import Replicated
from test_orchestrator_incidents import nonfinite
from trimtab.config import load_config
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.outliers import gate_finding, left_out_once


class Gated(Replicated):
    vocab_size = 512


def _gated(step: int, rows: list[int]):
    losses = {r: (8.0 if r in rows else 5.0, 64) for r in range(16)}
    return StepMetrics(step=step, loss=5.5, grad_norm=1.0, row_losses=losses, gated_rows=rows, rows=list(range(16)))


def test_rows_gated_at_a_rollbacks_step_are_left_out_with_it(tmp_path):
    cfg = load_config(None).orchestrator
    orchestrator, run = Orchestrator(cfg, tmp_path), Gated()
    rollback = orchestrator.decide(run, nonfinite(12))
    gated = orchestrator.decide(run, gate_finding(_gated(12, [4, 8]), cfg.row_gate))
    assert run.requests == [(rollback.action, rollback.params), ("skip_data", {"rows": [4, 8]})]
    assert gated.outcome is None  # requested: its result is journaled when the loop applies it


def test_other_changes_still_wait_for_the_rollback(tmp_path):
    """The rows rule's skip (rows judged after the fact, not yet out of any update) waits as before."""
    cfg = load_config(None).orchestrator
    orchestrator, run = Orchestrator(cfg, tmp_path), Gated()
    rollback = orchestrator.decide(run, nonfinite(12))
    finding = gate_finding(_gated(12, [4]), cfg.row_gate)
    finding.rule = "rows"
    held = orchestrator.decide(run, finding)
    assert [a for a, _ in run.requests] == ["rollback"] and held.outcome["dropped_by"] == rollback.id


def test_rows_a_rollback_leaves_out_itself_are_noted_on_it_not_left_out_twice(tmp_path):
    """A rollback whose skip_rows hold some of the gated rows: those are noted in its evidence, the rest
    left out by the gate's decision."""
    cfg = load_config(None).orchestrator
    orchestrator, run = Orchestrator(cfg, tmp_path), Gated()
    rollback = orchestrator.decide(run, nonfinite(12))
    rollback.params["skip_rows"] = [4]
    finding = left_out_once(gate_finding(_gated(12, [4, 8]), cfg.row_gate), orchestrator.journal)
    assert finding.evidence["rows"] == [8] and rollback.evidence["row_gate"]["rows"] == [4]
    assert f"decision #{rollback.id}" in finding.summary
