"""`faults healed` counts incidents, not decisions: one fault's skipped steps, rollback and the
replay's decisions are one incident; notes (action none), follow-ups (make_up, lr_restore, the
data watch), the tuning of a sound run and a person's commands heal nothing; the runs table counts
notes apart from decisions. The journals are shaped as real runs wrote them (debug preset, the
fault-mix sweep)."""

from __future__ import annotations

import json
from pathlib import Path

from trimtab.report.runs import format_table, list_runs
from trimtab.rundir import healed, incidents


def decision(step: int, rule: str, action: str, result: str | None = "recovered", **fields) -> dict:
    family = {"nonfinite": "instability", "spike": "instability", "rows": "data", "data": "data"}.get(rule, rule)
    applied = [] if action == "none" else [f"{action} applied"]
    record = {"step": step, "rule": rule, "family": family, "action": action, "params": {}, "mode": "auto"}
    return record | {"applied": applied, "outcome": {"result": result} if result else None} | fields


THROUGHPUT_NOTE = decision(31, "throughput", "none")  # a fault-free run on a shared CPU
# bad_rows@40 over 120 steps: two withheld spikes, the make-up, then the poisoned rows left out as they recur
BAD_ROWS = (
    [decision(40, "spike", "skip_step", "not recovered"), decision(42, "spike", "skip_step")]
    + [decision(47, "make_up", "set_total_steps")]
    + [decision(s, "rows", "skip_data") for s in (88, 89, 90, 96)]
    + [decision(s, "rows", "skip_data", None) for s in (100, 110, 113, 117, 118)]
)
# lr_spike@12 and weights_nan@15: the cut, the NaN steps and their rollback to step 8, the replay's lr decisions
LR_AND_NAN = [
    decision(12, "lr", "scale_lr"),
    decision(15, "nonfinite", "skip_step", "not recovered"),
    decision(16, "nonfinite", "skip_step", "not recovered"),
    decision(17, "nonfinite", "rollback"),
    decision(9, "lr", "scale_lr", "not recovered"),
    decision(12, "lr", "scale_lr"),
    decision(17, "make_up", "set_total_steps"),
]


def test_a_fault_free_runs_note_heals_nothing():
    assert healed([THROUGHPUT_NOTE]) == 0 and incidents([THROUGHPUT_NOTE]) == []
    tuned = [decision(60, "plateau", "scale_lr"), decision(80, "checkpoint_interval", "set_checkpoint_every")]
    person = [decision(70, "manual", "scale_lr", "applied", mode="manual")]
    assert healed(tuned + person) == 0 and incidents(tuned + person) == []  # a sound run tuned: no fault


def test_one_fault_is_one_incident_however_many_decisions_answer_it():
    assert healed(BAD_ROWS) == 1 and len(incidents(BAD_ROWS)) == 1
    assert healed(LR_AND_NAN) == 2  # two faults: the lr rule's and the NaN weights' (its replay stays in it)
    assert [[d["step"] for d in i] for i in incidents(LR_AND_NAN)] == [[12, 9, 12], [15, 16, 17]]


def test_an_incident_is_healed_only_when_it_ended_recovered():
    stopped = [decision(15, "nonfinite", "skip_step", "not recovered"), decision(17, "nonfinite", "stop", "stopped")]
    advice = [decision(15, "nonfinite", "skip_step", "not applied", applied=[])]  # advise mode: nothing applied
    pending = [decision(15, "nonfinite", "skip_step", None)]
    assert healed(stopped) == healed(advice) == healed(pending) == 0
    abandoned = [decision(15, "nonfinite", "rollback", abandoned=True)]
    assert healed(abandoned) == 0


def test_faults_far_apart_are_incidents_of_their_own():
    twice = [decision(12, "nonfinite", "rollback"), decision(300, "nonfinite", "rollback", "not recovered")]
    assert len(incidents(twice)) == 2 and healed(twice) == 1


def fake_run(path: Path, journal: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"preset: debug\nout: {path}\n")
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens": 100}) + "\n")
    (path / "summary.json").write_text(json.dumps({"status": "completed", "step": 1, "tokens": 100, "seconds": 1.0}))
    (path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in journal))
    return path


def test_the_runs_table_counts_notes_apart_and_incidents_healed(tmp_path):
    fake_run(tmp_path / "clean", [THROUGHPUT_NOTE])
    fake_run(tmp_path / "bad_rows", BAD_ROWS + [THROUGHPUT_NOTE])
    rows = {r["run"]: r for r in list_runs(tmp_path, "run")}
    assert (rows["clean"]["decisions"], rows["clean"]["notes"], rows["clean"]["healed"]) == (0, 1, 0)
    assert (rows["bad_rows"]["decisions"], rows["bad_rows"]["notes"], rows["bad_rows"]["healed"]) == (12, 1, 1)
    header = format_table(list(rows.values())).splitlines()[0]
    assert "decisions  notes  faults healed" in header


def test_one_fault_in_every_moe_layer_is_one_incident():
    """debug-moe, expert_collapse@10 and weights_nan@28 (the journal as the run wrote it): layers 1 and 3
    collapsed together, answered at steps 20 and 21 (families moe/1, moe/3), the NaN's rollback to 20
    replayed layer 3's reset. Two faults healed, not three; a layer collapsing again long after is another."""
    collapse = [
        decision(20, "moe", "reset_router", family="moe/1"),
        decision(21, "moe", "reset_router", family="moe/3", outcome={"result": "recovered", "rolled_back": True}),
        decision(28, "nonfinite", "skip_step", "not recovered"),
        decision(29, "nonfinite", "rollback"),
        decision(21, "moe", "reset_router", family="moe/3"),
    ]
    assert [[d["step"] for d in i] for i in incidents(collapse)] == [[20, 21, 21], [28, 29]]
    assert healed(collapse) == 2
    again = decision(90, "moe", "reset_router", "not recovered", family="moe/1")
    assert len(incidents([*collapse, again])) == 3 and healed([*collapse, again]) == 2


def test_a_resume_on_another_world_after_a_clean_end_heals_nothing():
    """torchrun 2 ranks, FSDP, kill_rank@7:1 (restarted from step 4), then after it completed
    `trimtab train --max-steps 16` on one process: the report read "faults healed 2" for the one rank
    killed; the second restart (kind resized: a clean end, nothing lost) answers no fault."""
    lost = decision(4, "restart", "resume", family="cluster", evidence={"kind": "lost_rank", "restart": 1})
    resized = {"kind": "resized", "ended": "completed", "restart": 0, "down_s": 0.0}
    relaunched = decision(12, "restart", "resume", family="cluster", evidence=resized)
    assert healed([lost, relaunched]) == 1 and incidents([relaunched]) == []


def test_a_ladders_rollbacks_count_as_the_incidents_it_counted():
    """A rollback "recovered" settled the incident 5 steps later, whatever the ladder said: the LR's next
    rollback, the ladder's second of the same open incident (evidence incident_rollback 2: no good checkpoint
    and outcome_after quiet steps since), read as a new fault healed, and a non-finite loss's rollback the
    ladder opened a new incident for (weights_nan@12 and @22, debug: closed at step 20) stays one of its own."""

    def rollback(step: int, n: int, result: str = "recovered", rule: str = "above_start") -> dict:
        return decision(step, rule, "rollback", result, family="instability", evidence={"incident_rollback": n})

    one = [
        rollback(15, 1),
        decision(22, "above_start", "scale_lr", "not recovered", family="instability"),
        rollback(24, 2),
    ]
    assert len(incidents(one)) == 1 and healed(one) == 1
    two = [rollback(12, 1, rule="nonfinite"), rollback(22, 1, rule="nonfinite")]
    assert len(incidents(two)) == 2 and healed(two) == 2
    again = [*two, rollback(30, 2, "not recovered", rule="nonfinite")]  # the open incident: the latest
    assert [[d["step"] for d in i] for i in incidents(again)] == [[12], [22, 30]] and healed(again) == 1


def test_the_ladders_incident_numbers_group_its_decisions_exactly():
    """One ladder incident (grad spikes skipped, an LR cut, rollback 1 at 15, the replay's spikes at 22 and 30
    skipped while the incident stayed open: ladder.py _clear, rollback 2 at 33) read as two, "faults healed 2":
    the skip at 30 came 5 settled steps after a recovered one, and the second rollback joined it. The ladder's
    number on every decision (evidence `incident`) groups them as it counted them, and splits two incidents a
    skip alone opened the second of (the ladder closed the first: no rollback followed to say so)."""

    def ladder(step: int, action: str, number: int, result: str = "recovered", **evidence) -> dict:
        return decision(step, "grad", action, result, family="instability", evidence={"incident": number, **evidence})

    one = [
        ladder(10, "skip_step", 1),
        ladder(11, "skip_step", 1),
        ladder(12, "scale_lr", 1, "not recovered"),
        ladder(15, "rollback", 1, incident_rollback=1),
        ladder(22, "skip_step", 1),
        ladder(30, "skip_step", 1),
        ladder(33, "rollback", 1, incident_rollback=2),
    ]
    assert len(incidents(one)) == 1 and healed(one) == 1
    two = [ladder(15, "rollback", 1, "not recovered", incident_rollback=1), ladder(40, "skip_step", 2)]
    assert len(incidents(two)) == 2 and healed(two) == 1
