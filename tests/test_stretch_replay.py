"""A long stretch of fully row-gated steps, replayed on clean rows once it ends (stretch_replay.py).

Debug, 200 steps, `bad_batch@25:25`: every row of steps 25-49 gated, their 25 updates lost at the schedule's
peak LR and 20 made up at its tail (val +2.1% over clean). Now the first clean step after the stretch (50) rolls
back to the newest checkpoint at or before step 24 with the stretch's 800 rows left out, the LR kept: the replay
trains steps 25-49 on the clean rows that follow. Short stretches (make_up pays them), a stream that stays
garbage (the garbage stop) and a replay that meets garbage again are not replayed."""

from dataclasses import replace

import trimtab
from helpers import faulted
from test_orchestrator_units import View, metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.withheld import WithheldUpdates
from trimtab.rundir import read_decisions

ROWS = 32


def _step(step: int, gated: int, skipped: bool):
    rows = list(range(ROWS * step, ROWS * step + ROWS))
    return replace(metrics(step), rows=rows, gated_rows=rows[:gated], skipped=skipped)


def _stretch(first: int, n: int, end: int):
    """Clean steps, then `n` from `first` whose every row the gate left out, then clean to `end`."""
    return [_step(s, ROWS if first <= s < first + n else 0, first <= s < first + n) for s in range(1, end + 1)]


def _findings(steps, guard=None):
    guard = guard or WithheldUpdates(OrchestratorConfig(withheld_window=20))
    return [f for m in steps if (f := guard.observe(m)) is not None]


def test_a_long_stretch_is_replayed_at_its_first_clean_step_with_its_rows_left_out():
    """Before: no finding for 25 fully gated steps (test_withheld_data: a short stretch keeps its answers)."""
    found = _findings(_stretch(25, 25, 200))
    assert [(f.step, f.family) for f in found] == [(50, "data")]
    ev = found[0].evidence
    assert ev["replay"] == "25-49" and ev["to"] == 24 and ev["fully_gated"] == 25
    assert ev["skip_rows"] == list(range(25 * ROWS, 50 * ROWS))  # every gated row, named for the loader
    assert found[0].summary == "the 25 steps 25-49 trained on nothing (every row garbage, left out)"


def _view(tmp_path, *steps: int) -> View:
    """A view whose run directory holds checkpoints at `steps` (the remedy names the one restored)."""
    for step in steps:
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    view = View(checkpoints=steps)
    view.run_dir = tmp_path
    return view


def test_the_replay_is_a_rollback_before_the_stretch_keeping_the_lr(tmp_path):
    found = _findings(_stretch(15, 15, 40))
    policy = Policy(OrchestratorConfig())
    plan = policy.plan(found[0], _view(tmp_path, 0, 20))
    assert plan.action == "rollback" and plan.params == {"to": 14, "skip_rows": list(range(15 * ROWS, 30 * ROWS))}
    assert "LR kept" in plan.reasoning
    assert found[0].summary.endswith(
        "trained on nothing (every row garbage, left out): replayed from step 0 on clean rows"
    )
    plan.applied()
    assert policy.lr_debt == 1.0 and policy.rollbacks == 1  # no cut to give back
    none = Policy(OrchestratorConfig()).plan(_findings(_stretch(15, 15, 40))[0], View(checkpoints=(20,)))
    assert none.action == "none" and "no checkpoint at or before step 14" in none.reasoning


def test_checkpoints_far_before_the_stretch_leave_it_to_the_make_up(tmp_path):
    """A replay from step 0 of a stretch at 200-214 would train 215 steps again for 15 updates (over 4x)."""
    found = _findings(_stretch(200, 15, 230))
    plan = Policy(OrchestratorConfig()).plan(found[0], _view(tmp_path, 0))
    assert plan.action == "none" and "215 steps again for 15 updates" in plan.reasoning
    assert found[0].summary.endswith("not replayed (from step 0: 215 steps for 15 updates)")


def test_short_stretches_partial_gating_and_garbage_to_the_end_are_not_replayed():
    assert _findings(_stretch(60, 4, 120)) == []  # bad_batch@60:4: make_up pays 4 steps
    assert _findings(_stretch(15, 7, 120)) == []  # under 0.4 of the window (8 steps)
    assert [f.step for f in _findings(_stretch(15, 8, 120))] == [23]
    thin = [_step(s, ROWS // 4 if 15 <= s < 40 else 0, False) for s in range(1, 80)]  # bad_rows: a quarter gated
    assert _findings(thin) == []
    to_the_end = _findings(_stretch(15, 200, 120))
    assert [(f.step, f.family) for f in to_the_end][:1] == [(55, "data")]  # the stop, never a replay
    assert not [f for f in to_the_end if "replay" in f.evidence]


def test_a_replay_that_meets_garbage_again_is_not_replayed_twice_and_a_resume_keeps_that():
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    assert [f.step for f in _findings(_stretch(25, 25, 50), guard)] == [50]
    guard.shift()  # the rollback to step 0: the replay meets garbage at 25-49 again
    resumed = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    resumed.load_state_dict(guard.state_dict())
    assert _findings(_stretch(25, 25, 60), resumed) == []
    later = _findings([_step(s, ROWS if 100 <= s < 125 else 0, 100 <= s < 125) for s in range(61, 140)], resumed)
    assert [f.step for f in later] == [125]  # a new stretch past the replayed one's end: its own replay


def test_a_real_run_replays_the_stretch_once_on_clean_rows(tmp_path):
    """The trainer end to end (debug, 24 steps, a window of 6: 5 fully gated steps are a stretch to replay)."""
    cfg = faulted(tmp_path / "run", ["bad_batch@8:5"], 24, checkpoint={"every": 5}, orchestrator={"withheld_window": 6})
    summary = trimtab.train(cfg)
    assert summary["status"] == "completed" and summary["step"] == 24
    decisions = read_decisions(tmp_path / "run")
    replays = [d for d in decisions if d["rule"] == "withheld"]
    assert [(d["family"], d["action"], d["step"]) for d in replays] == [("data", "rollback", 13)]
    assert replays[0]["summary"].endswith("replayed from step 5 on clean rows")
    assert len(replays[0]["params"]["skip_rows"]) == 5 * 32  # debug's 32 rows a step
    gated = [d["step"] for d in decisions if d["rule"] == "row_gate"]
    assert gated == [8, 9, 10, 11, 12]  # the replay met no garbage: its rows were left out
    assert not [d for d in decisions if d["action"] in ("scale_lr", "set_lr")]
