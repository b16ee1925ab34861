"""A stretch that trains on nothing clean, half of it gated and half withheld by the loss or grad rules
(withheld.py _untrained): the fully gated steps were not counted for two windows and the stretch's rows
were under 90% gated, so neither the count (10 of 20) nor the data's stop answered and the run went on
with frozen weights. Now past two windows since the guard last answered it is the instability answer.
And the row gate's skip_data that fell to advice is no standing advice: its rows were out of their
step's update before it was journaled (rundir.py standing_advice)."""

import json
from dataclasses import replace

import trimtab
from test_orchestrator_units import View, metrics
from trimtab.cli_train import _standing_advice
from trimtab.config import load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.withheld import WithheldUpdates
from trimtab.rundir import read_decisions, standing_advice

ROWS = 32


def _step(step: int, gated: int, skipped: bool):
    rows = list(range(ROWS * step, ROWS * step + ROWS))
    return replace(metrics(step), rows=rows, gated_rows=rows[:gated], skipped=skipped)


def _mixed(step: int, period: int = 2, clean: int = 1):
    """Clean before 15; from 15 on, of each `period` steps `clean` withheld by a spike with no row gated
    (the period's last), the others' every row gated."""
    if step < 15:
        return _step(step, 0, False)
    spiked = (step - 15) % period >= period - clean
    return _step(step, 0 if spiked else ROWS, True)


def _findings(steps, guard=None):
    guard = guard or WithheldUpdates(OrchestratorConfig(withheld_window=20))
    return [f for m in steps if (f := guard.observe(m)) is not None]


def test_half_gated_half_withheld_by_a_spike_is_answered_past_two_windows():
    """Before: no finding in 120 steps (106 updates withheld, none trained)."""
    found = _findings(_mixed(s) for s in range(1, 121))
    assert [(f.step, f.family) for f in found] == [(55, "instability"), (97, "instability")]
    ev = found[0].evidence
    assert ev["steps"] == "15-55" and ev["withheld"] == 41 and ev["window"] == 41
    assert ev["rows_gated"] == 21 * ROWS and ev["rows_seen"] == 41 * ROWS
    assert "none trained on clean rows" in found[0].summary
    plan = Policy(OrchestratorConfig()).plan(found[0], View())
    assert plan.action == "rollback" and plan.params["lr_factor"] < 1
    assert "41 of the last 41 updates were withheld" in plan.reasoning


def test_the_share_of_rows_gated_picks_the_answer():
    """Two of three steps gated (67% of the rows): before, nothing; the instability answer now (a third
    of the steps had clean rows the loss rule withheld). Nineteen of twenty (95%): the data's stop, as before."""
    two_of_three = _findings(_mixed(s, period=3) for s in range(1, 121))
    assert [(f.step, f.family) for f in two_of_three][:1] == [(55, "instability")]
    nineteen = _findings(_mixed(s, period=20) for s in range(1, 121))
    assert [(f.step, f.family) for f in nineteen][:1] == [(55, "data")]


def test_the_counts_answer_starts_the_stretchs_two_windows_over():
    """Two withheld by a spike of each three: the count answers every 16-17 steps (its findings of the
    code before, test_withheld_data.py) and the stretch adds none of its own."""
    found = _findings(_mixed(s, period=3, clean=2) for s in range(1, 120))
    assert [(f.step, f.family) for f in found] == [(s, "instability") for s in (31, 47, 64, 80, 97, 113)]


def test_a_resume_keeps_the_stretchs_count():
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    assert _findings((_mixed(s) for s in range(1, 40)), guard) == []
    resumed = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # as the checkpoint keeps it
    assert [f.step for f in _findings((_mixed(s) for s in range(40, 60)), resumed)] == [55]


def test_a_real_run_of_gated_and_grad_withheld_steps_is_answered(tmp_path):
    """Debug, every odd step from 9 garbage (gated), every even one a gradient x1000 (withheld by the grad
    rule), a window of 4: before, no answer by step 20 (2 of 4 counted; 160 of the 288 rows of steps 9-17
    gated). At 80 steps and a window of 6 from step 15 the first answer came at step 37, 22 steps on, from a
    step the gate let a row through; now at the stretch's 13th, 27. Here at step 17, with a rollback and the LR cut."""
    faults = [f"bad_batch@{s}" for s in range(9, 21, 2)] + [f"grad_spike@{s}" for s in range(10, 21, 2)]
    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(tmp_path / "run"),
            "faults": faults,
            "train": {"max_steps": 20, "eval_every": 0},
            "orchestrator": {"withheld_window": 4},
            "log": {"progress": False, "report": False, "tensorboard": False},
        },
    )
    trimtab.train(cfg)
    guard = [d for d in read_decisions(tmp_path / "run") if d["rule"] == "withheld"]
    assert guard, "no answer: the run trained on nothing from step 9"
    first = guard[0]
    assert (first["step"], first["family"], first["action"]) == (17, "instability", "rollback")
    assert "none trained on clean rows" in first["summary"] and first["params"]["lr_factor"] < 1


def _gate_advice(step: int, rows: list[int]) -> dict:
    """The row gate's skip_data fallen to advice (debug, bad_batch@15:106: at step 41 after 0 of 7 recovered)."""
    return {
        "id": step,
        "step": step,
        "rule": "row_gate",
        "family": "data",
        "action": "skip_data",
        "params": {"rows": rows},
        "mode": "advise",
        "evidence": {"rows": rows, "gated": True},
        "summary": f"{len(rows)} rows gated before the update",
    }


def test_the_gates_rows_fallen_to_advice_are_no_standing_advice(tmp_path):
    """Before: `advice standing, not applied (1 ...)`: step 55 row_gate: skip_data (32 rows), rows the gate
    had left out of step 55's update, at the end of a run the data's stop ended."""
    watch = _gate_advice(56, [7, 8]) | {"rule": "data", "evidence": {"rows": [7, 8]}, "summary": "2 rows score high"}
    decisions = [_gate_advice(54, [1, 2]), _gate_advice(55, [3, 4]), watch]
    assert [d["rule"] for d in standing_advice(decisions)] == ["data"]  # the data watch's rows trained: advice
    run = tmp_path / "run"
    run.mkdir()
    (run / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions[:2]))
    assert _standing_advice(str(run)) == []  # the end of `trimtab train`'s output: no advice line
