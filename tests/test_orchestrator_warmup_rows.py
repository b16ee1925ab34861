"""Garbage rows in the LR's warm-up pull the updates' gain down as an LR far too high does: the
LR rule tells them apart by where the low gains are (only the steps whose loss jumped back up),
and the orchestrator leaves those steps' rows out instead of cutting a sound LR."""

import json

import pytest

import trimtab
from test_orchestrator_loop import debug_cfg, train_lines
from trimtab.config import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.trends import AboveStart
from trimtab.rundir import read_decisions

pytestmark = pytest.mark.usefixtures("one_thread")

# debug's first steps with garbage at steps 5-8 (bad_batch@5:4, measured): the loss jumps back to
# its start and the gains fall from 0.68-0.97 to 0.30-0.36
GARBAGE = [(6.251, 0.97), (6.211, 0.883), (6.12, 0.69), (6.043, 0.677), (6.262, 0.357), (6.262, 0.296)]
GARBAGE += [(6.268, 0.327), (6.275, 0.36)]


def _observe(mon, curve, first=1):
    findings = []
    for step, (loss, gain) in enumerate(curve, first):
        m = StepMetrics(step=step, loss=loss, grad_norm=1.0, update_gain=gain, rows=[10 * step, 10 * step + 1])
        findings.append(mon.observe(m))
    return [f for f in findings if f is not None]


def test_low_gains_only_where_the_loss_jumped_blame_those_steps_rows_once_a_phase():
    mon = AboveStart(OrchestratorConfig())
    (f,) = _observe(mon, GARBAGE)
    assert f.step == 8 and f.evidence["jumped_steps"] == [5, 6, 7, 8]
    assert f.evidence["rows"] == [50, 51, 60, 61, 70, 71, 80, 81]
    assert f.evidence["gain"] < 0.4 <= f.evidence["gain_rest"]
    assert not mon.fired  # the LR is not suspect: no gradient-norm check follows
    # the same again in the phase (the replay without those rows overshoots too): the LR's
    mon.load_state_dict(AboveStart(OrchestratorConfig()).state_dict())  # a rollback to the phase's start
    (again,) = _observe(mon, GARBAGE)
    assert "jumped_steps" not in again.evidence and mon.fired


def _gated(curve, trained, gain=None):
    """GARBAGE's steps as a run with the row gate sees them: from step 5 each step's second row is
    garbage the gate left out, whose score (8.3) stands in the reported loss; its first row, the one
    trained, scores `trained(step)`, and the update delivered `gain` on it (GARBAGE's own: None)."""
    steps = []
    for step, (loss, measured) in enumerate(curve, 1):
        rows = [10 * step, 10 * step + 1]
        m = StepMetrics(step=step, loss=loss, grad_norm=1.0, update_gain=measured, rows=rows)
        if step >= 5:
            m.row_losses, m.gated_rows = {rows[0]: (trained(step), 64), rows[1]: (8.3, 64)}, [rows[1]]
            m.update_gain = measured if gain is None else gain
        steps.append(m)
    return steps


def test_a_jump_of_rows_the_gate_left_out_is_not_blamed_and_their_steps_gains_are_the_lrs():
    """debug at 10x the LR, bad_rows@10:4: step 10's loss jumped (6.17) only by the 10 garbage rows the
    gate had left out (the rest 5.43); above_start blamed the step's 32 rows, rolled back to step 0
    without them, and cut the LR on the replay anyway (val 5.243 against 5.220 off). The jump is judged
    on the rows trained. A gated step's gain is measured on them too (training/gain.py; with the garbage
    scored again after the update step 10 read -0.41, and gated steps were left uncounted, so a bad-rows
    run at an LR far too high kept it): sound there, no finding; overshooting, the LR's."""
    mon = AboveStart(OrchestratorConfig())
    assert [f for m in _gated(GARBAGE, lambda step: 6.0 - 0.02 * step, 0.7) if (f := mon.observe(m))] == []
    assert mon.early_jumps == [] and len(mon.first_gains) == 8
    hot = AboveStart(OrchestratorConfig())
    (f,) = [f for m in _gated(GARBAGE, lambda step: 6.0 - 0.02 * step) if (f := hot.observe(m))]
    assert f.step == 8 and "jumped_steps" not in f.evidence and hot.fired  # the trained rows' gains: the LR's
    missed = AboveStart(OrchestratorConfig())  # the trained rows jumped too: garbage the gate missed
    (f,) = [f for m in _gated(GARBAGE, lambda step: 6.27) if (f := missed.observe(m))]
    assert [j["rows"] for j in missed.early_jumps] == [[50], [60], [70], [80]]
    assert f.evidence["jumped_steps"] == [5, 6, 7, 8] and f.evidence["rows"] == [50, 60, 70, 80]


def test_low_gains_on_every_step_are_the_lrs_even_with_a_jump_among_them():
    mon = AboveStart(OrchestratorConfig())
    falling = [(6.25 - 0.05 * s, g) for s, g in enumerate([0.3, 0.25, 0.35, 0.2, 0.3, 0.3, 0.25])]
    falling[4] = (6.3, 0.3)  # one step back up: its gain is as low as the others'
    (f,) = _observe(mon, falling)
    assert "jumped_steps" not in f.evidence and mon.fired


# debug-hybrid, bad_batch@5:4 (measured): the gains at the garbage (0.28-0.63) keep the median of 7
# over 0.4; the model is slow for the rest of the run (4.77 against 4.13 clean) and no rule fired
HYBRID = [(6.236, 1.009), (6.216, 1.0), (6.125, 0.802), (6.045, 0.739), (6.271, 0.63), (6.27, 0.436)]
HYBRID += [(6.275, 0.283), (6.286, 0.472), (5.867, 0.113), (5.779, 1.018), (5.649, 0.65), (5.569, 0.863)]
HYBRID += [(5.51, 0.881), (5.409, 0.853), (5.359, 0.865)]


def test_jumped_steps_that_delivered_less_are_blamed_at_the_end_of_the_first_steps():
    mon = AboveStart(OrchestratorConfig())
    (f,) = _observe(mon, HYBRID)
    assert f.step == 15 and f.evidence["jumped_steps"] == [5, 6, 7, 8] and "gain_rest" not in f.evidence
    assert f.evidence["rows"] == [50, 51, 60, 61, 70, 71, 80, 81] and f.evidence["median_gain"] == pytest.approx(0.802)
    assert not mon.fired
    mon.load_state_dict(AboveStart(OrchestratorConfig()).state_dict())  # the rollback: blamed once a phase
    assert _observe(mon, HYBRID) == []


def test_jumps_of_a_model_trained_before_are_not_blamed_on_its_rows():
    """A finetune from trained weights (train.init_from: debug finetuned from a 60-step run) starts
    below the data's unigram entropy, and its loss jumps with each batch's difficulty: its first
    steps' jumps left 128 clean rows out with a rollback to step 0. Rows are blamed on jumps only
    for a young model (its start above the unigram entropy), which HYBRID's is."""
    young = AboveStart(OrchestratorConfig())
    young.unigram = 5.26  # debug's training targets' unigram entropy (the orchestrator sets it per phase)
    (f,) = _observe(young, HYBRID)
    assert f.evidence["jumped_steps"] == [5, 6, 7, 8]
    trained = AboveStart(OrchestratorConfig())
    trained.unigram = 5.26
    assert _observe(trained, [(loss - 2.0, gain) for loss, gain in HYBRID]) == []


def test_jumps_are_not_blamed_on_the_rows_while_the_lr_is_cut_or_found_too_high():
    """A replay at an LR cut for being far too high jumps too (debug at 100x, cut to 10x: steps 11-12;
    a finetuning phase at 30x cut twice): the LR's, not the rows'."""
    cut = AboveStart(OrchestratorConfig())
    findings = []
    for step, (loss, gain) in enumerate(HYBRID, 1):
        m = StepMetrics(step=step, loss=loss, grad_norm=1.0, update_gain=gain, rows=[step], lr_scale=0.1)
        findings += [f] if (f := cut.observe(m)) is not None else []
    assert findings == []
    found = AboveStart(OrchestratorConfig())
    found.fired = True  # the loss above its start, or overshooting updates, earlier in the phase
    assert _observe(found, HYBRID) == []


# debug-moe at 3x the LR (measured): step 8 overshoots (gain -0.66) and the loss jumps at 9, whose
# update delivers more than most (1.21) as it falls back; the stall at the unigram level follows
MOE_3X = [(6.256, 0.842), (6.183, 0.595), (6.018, 0.549), (5.911, 0.69), (5.769, 0.673), (5.599, 0.371)]
MOE_3X += [(5.416, 0.627), (5.331, -0.656), (5.796, 1.21), (5.196, 0.706), (5.118, 0.685), (5.153, 0.107)]
MOE_3X += [(5.155, 0.531), (5.1, 0.383), (5.096, 0.454)]


def test_a_jump_the_lr_caused_is_not_blamed_on_the_rows():
    mon = AboveStart(OrchestratorConfig())
    (found,) = _observe(mon, MOE_3X)  # the LR, by the first 15 gains (median 0.627, lower quartile 0.454)
    assert found.step == 15 and "steady_gain" in found.evidence and "rows" not in found.evidence
    assert [j["step"] for j in mon.early_jumps] == [9]  # a jump, but no garbage's: it delivered more than most


@pytest.mark.parametrize("gate", [True, False])
def test_garbage_in_the_warm_up_is_left_out_and_the_lr_kept(tmp_path, gate):
    """debug, garbage rows at steps 5-8 (bad_batch@5:4): the orchestrator rolled back to the start
    and cut the LR x0.32 with the garbage kept (+9.7% against a clean run at 120 steps). The row gate
    now leaves those rows out as each step meets them (model-free: their tokens score as uniform
    draws under the frequencies of the rows trained on), no rollback; without the gate above_start
    restores step 0 and trains again without those rows, at the preset's LR."""
    cfg = debug_cfg(
        tmp_path,
        16,
        faults=["bad_batch@5:4"],
        train={"batch_tokens": 2048},
        data={"max_bytes": 400_000},
        orchestrator={"row_gate": {"enabled": gate}},
    )
    summary = trimtab.train(cfg)
    assert summary["status"] == "completed"
    decisions = read_decisions(tmp_path)
    poisoned = json.loads((tmp_path / "faults.json").read_text())["poisoned"]
    assert train_lines(tmp_path)[-1]["lr_scale"] == 1.0
    if gate:
        gated = [d for d in decisions if d["rule"] == "row_gate"]
        assert sorted(r for d in gated for r in d["params"]["rows"]) == sorted(poisoned)
        assert [d["step"] for d in gated] == [5, 6, 7, 8]
        assert not [d for d in decisions if d["action"] == "rollback"]
        return
    (d,) = [d for d in decisions if d["rule"] == "above_start"]
    assert d["action"] == "rollback" and d["params"]["to"] == 0 and "lr_factor" not in d["params"]
    assert sorted(d["params"]["skip_rows"]) == sorted(poisoned)
    assert d["evidence"]["jumped_steps"] == [5, 6, 7, 8]
