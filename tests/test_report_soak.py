"""What a long run resumed after kills shows in its report (the soak test's findings): a decision
whose session was killed before its outcome was measured, then abandoned by the resume from an
earlier checkpoint, is never judged; the finished run's report said "pending" for it."""

from __future__ import annotations

from pathlib import Path

from trimtab.report.markers import _hover
from trimtab.report.page import _decisions_table, _outcome
from trimtab.report.run import RunRecord, outcome_result

# A rollback decided at step 482 in a session killed a moment later; the run resumed at step 400
# and finished: the journal keeps it, marked abandoned, with no outcome (decisions.jsonl of the soak)
KILLED = {
    "id": 29,
    "step": 482,
    "rule": "spike",
    "action": "rollback",
    "mode": "auto",
    "outcome": None,
    "abandoned": True,
}
WAITING = {"id": 30, "step": 600, "rule": "spike", "action": "skip_step", "mode": "auto", "outcome": None}
JUDGED = {
    "id": 31,
    "step": 500,
    "rule": "spike",
    "action": "skip_step",
    "mode": "auto",
    "abandoned": True,
    "outcome": {"result": "cut short", "steps": 0, "rolled_back": True},
}


def _run(decisions: list[dict]) -> RunRecord:
    return RunRecord(
        path=Path("r"), name="r", config={}, lines=[], decisions=decisions, plan=[], summary=None, status="completed"
    )


def test_an_abandoned_decision_never_judged_is_not_pending() -> None:
    for said in (_outcome(KILLED, 10), _hover(_run([KILLED]), KILLED), _decisions_table(_run([KILLED]))):
        assert "pending" not in said
        assert "never judged" in said


def test_a_kept_decision_still_waits_and_a_judged_one_keeps_its_result() -> None:
    assert outcome_result(WAITING) == "pending"
    assert "outcome: pending" in _hover(_run([WAITING]), WAITING)
    assert outcome_result(JUDGED) == "cut short"
    assert _outcome(JUDGED, 10).startswith("cut short")
