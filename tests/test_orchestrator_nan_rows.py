"""NaN / inf losses and the rows they were computed on: a NaN that does not repeat when the same
rows are scored again, or that every row shows alike, is no evidence against a row (units with a
fake view; one short run on the debug preset)."""

import json
import math

import trimtab
from test_orchestrator_loop import debug_cfg
from test_orchestrator_units import View, act, finding
from test_outliers import Data
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.outliers import OutlierRows
from trimtab.orchestrator.policy import Policy
from trimtab.rundir import read_decisions

HARD = 3  # a clean row the model finds hard: far above the held-out rows, yet finite


def nan_loss(step: int) -> Finding:
    rows = [10 * step + i for i in range(10)]
    evidence = {"loss": math.nan, "grad_norm": math.nan}
    return Finding(
        rule="nonfinite", family="instability", step=step, evidence=evidence, summary="", strength=1.0, rows=rows
    )


def sound(scores: dict[int, float]) -> View:
    """Weights that score held-out data as at the last good checkpoint; training rows score as given
    (5.0 unless named)."""
    view = View(probe=5.0)
    view.row_losses = lambda rows: {r: scores.get(r, 5.0) for r in rows}
    return view


def ladder() -> Policy:
    policy = Policy(OrchestratorConfig())
    policy.probe_baseline = 5.0
    return policy


def test_nan_losses_leave_out_no_row_that_scores_finite_on_its_own():
    """The steps' losses were NaN, yet each of their rows scores finite on the same weights: the NaN
    did not come from a row, and the one hard row (above the outlier threshold) stays in training;
    the ladder climbs to its LR cut instead."""
    policy, view = ladder(), sound({10 * 2 + HARD: 9.0})
    plans = [act(policy, nan_loss(s), view) for s in (1, 2, 3)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "scale_lr"]


def test_the_rollback_after_nan_losses_keeps_the_rows_that_score_finite():
    """Rung 2 scores the incident's rows too: after NaN losses alone it leaves none of them out for
    a finite score."""
    policy, view = ladder(), sound({10 * 2 + HARD: 9.0})
    plans = [act(policy, nan_loss(s), view) for s in range(1, 7)]
    assert [p.action for p in plans][-1] == "rollback"
    assert plans[-1].params["skip_rows"] == []
    assert plans[-1].evidence["nonfinite_losses"] and plans[-1].evidence["rows_scored"] == 60


def test_a_row_whose_own_loss_is_not_finite_is_left_out_after_nan_losses():
    policy, view = ladder(), sound({10 * 2 + HARD: 9.0, 10 * 3 + 1: math.inf})
    plans = [act(policy, nan_loss(s), view) for s in (1, 2, 3)]
    assert plans[-1].action == "skip_data" and plans[-1].params == {"rows": [31]}  # not the hard row
    assert "score NaN or inf on their own" in plans[-1].reasoning


def test_rows_that_are_all_not_finite_blame_none_of_them():
    """Every row NaN alike on weights that score held-out data well: the forward's, not a row's."""
    policy, view = ladder(), sound({r: math.nan for r in range(200)})
    plans = [act(policy, nan_loss(s), view) for s in (1, 2, 3)]
    assert plans[-1].action == "scale_lr"


def test_spikes_still_leave_out_the_rows_that_score_high():
    """Finite high losses (a spike, also with NaN steps in the incident) are what a high row
    explains: the spike's own rows are scored at once (spikes.py), and the climb's scoring of the
    incident's rows, had they not been, names the same one."""
    view = sound({10 * 2 + HARD: 9.0})
    policy = ladder()
    plans = [act(policy, nan_loss(1), view), act(policy, finding(2, rows=[23]), view)]
    assert plans[-1].action == "skip_data" and plans[-1].params == {"rows": [23]}
    climb = ladder()
    climb.unstable_at = 0  # unsettled: a lone spike's rows are not scored, the climb's are
    plans = [act(climb, nan_loss(1), view), act(climb, finding(2, rows=[23]), view), act(climb, nan_loss(3), view)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "skip_data"] and plans[-1].params == {"rows": [23]}


def test_a_non_finite_score_does_not_poison_the_reference():
    """Without held-out rows the scored rows are the reference: a NaN among them must not make the
    threshold NaN (every comparison with it false, the high row kept)."""
    view = sound({**{r: math.nan for r in range(12)}, 12: 9.0, **{r: 5.0 + 0.01 * r for r in range(13, 20)}})
    view.held_out_row_losses = lambda limit: []
    bad, evidence = DataAttribution(OrchestratorConfig()).score(view, list(range(20)))
    assert bad == list(range(13)) and evidence["threshold"] < 9.0 and evidence["rows_nonfinite"] == 12


def test_a_step_whose_only_row_is_not_finite_names_no_row():
    """One row a step and its loss NaN: nothing tells the row from the forward."""
    rule, data = OutlierRows(OrchestratorConfig()), Data()
    for _ in range(5):
        rule.observe(data.step_metrics())
    m = data.step_metrics()
    m.rows, m.row_losses = [7], {7: (math.nan, 64)}
    assert rule.observe(m) is None and not rule.suspects


def test_a_nan_loss_fault_leaves_no_row_out_through_the_loop(tmp_path):
    """debug, nan_loss for 3 steps: the probe finds the weights sound, so the data was suspected,
    and a clean row that scored above the threshold was left out for good."""
    run = tmp_path / "r"
    assert trimtab.train(debug_cfg(run, steps=16, faults=["nan_loss@12:3"]))["status"] == "completed"
    actions = [(d["step"], d["rule"], d["action"]) for d in read_decisions(run)]
    assert actions == [
        (12, "nonfinite", "skip_step"),
        (13, "nonfinite", "skip_step"),
        (14, "nonfinite", "scale_lr"),
        (16, "make_up", "set_total_steps"),  # the withheld updates, made up at the last step (sound)
    ]
    assert json.loads((run / "faults.json").read_text())["fired"] == {"nan_loss@12:3": 3}


def test_isolated_nan_losses_on_sound_weights_keep_the_lr():
    """debug, a NaN loss every 10 steps: the weights sound each time, the steps between healthy, no
    row NaN on its own; the ladder cut the LR at the third (x0.5, x0.25 at the ninth) and rolled
    back at the sixth, 4.43 against 4.17 fault-free. Nothing ties the NaNs to the weights or the LR:
    every one is skipped, the LR kept, nothing rolled back (back to back they still cut it, above)."""
    policy, view = ladder(), sound({})
    plans = [act(policy, nan_loss(s), view) for s in range(10, 100, 10)]
    assert [p.action for p in plans] == ["skip_step"] * 9
    assert "keep the LR" in plans[2].reasoning and policy.ladder.rung == 0
