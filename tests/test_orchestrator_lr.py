"""A learning rate that is simply too high (a finetuning LR typed for pretraining, a slipped
exponent): caught from the first steps, cut decisively, given back at most part way once quiet."""

import json
import math

import pytest

import trimtab
from test_orchestrator_loop import debug_cfg, train_lines
from trimtab.rundir import read_decisions

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_learning_rate_100x_too_high_is_cut_within_the_first_steps_and_the_run_restarts_sound(tmp_path):
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=30, optim={"lr": 0.3}))  # the preset's is 3e-3
    decisions = read_decisions(run)
    first = decisions[0]
    assert (first["rule"], first["action"]) == ("above_start", "rollback"), [d["rule"] for d in decisions]
    assert first["step"] <= 10 and first["params"]["lr_factor"] == pytest.approx(0.1)
    assert first["params"]["to"] == "last_good" and "rolled back" in first["applied"][0]
    restores = [d for d in decisions if d["rule"] == "lr_restore"]
    assert all(d["step"] >= 20 for d in restores)  # a quiet window (outcome_after) into the replay from step 0
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [m for m in lines if "loss" in m and not m.get("abandoned")]
    assert kept[-1]["loss"] < kept[0]["loss"] - 0.5  # trains from the sound start at the cut LR
    # the cut holds (a second may deepen it: below), given back at most to the midpoint of 100x and 10x
    assert kept[-1]["lr_scale"] <= 0.1**0.5 * 0.1 + 1e-9
    assert summary["exit_code"] == 0


def test_the_preset_lr_raises_no_above_start_finding(tmp_path):
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=30))
    assert not [d for d in read_decisions(run) if d["rule"] == "above_start"]


def test_a_cut_lr_still_too_high_is_cut_again_from_the_start(tmp_path):
    """One x0.1 cut of a 100x LR leaves it 10x the preset's: the loss stays under its start, so
    the loss line never fires again. The replay's updates still overshoot a little (gain just
    under 0.4): cut x0.32 and trained again from step 0; that replay's median gain still short of a
    sound LR's (trends.py SOUND_GAIN) halves it, and the next replay's overshoot cuts it again: the
    LR ends within 2x of the preset's (x0.1 x 0.32 x 0.5 x 0.63 = 0.01 of 100x), where the old
    cuts left it at 3.2x."""
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=45, optim={"lr": 0.3}, checkpoint={"every": 15}))
    cuts = [d for d in read_decisions(run) if d["rule"] == "above_start"]
    assert [d["action"] for d in cuts[:3]] == ["rollback"] * 3, [(d["step"], d["action"]) for d in cuts]
    assert "level" in cuts[0]["evidence"] and cuts[0]["params"]["lr_factor"] == pytest.approx(0.1)
    assert cuts[1]["evidence"]["gain"] < 0.4 and cuts[1]["params"]["lr_factor"] == pytest.approx(0.1**0.5)
    assert cuts[1]["params"]["to"] == 0 and "to step 0" in cuts[1]["applied"][0]
    assert cuts[2]["evidence"]["gain"] < cuts[2]["evidence"]["sound_gain"] and cuts[2]["params"]["lr_factor"] == 0.5
    given = [d for d in read_decisions(run) if d["rule"] == "lr_restore"]
    factors = [d["params"].get("lr_factor", d["params"].get("factor", 1.0)) for d in cuts + given]
    kept = [m for m in train_lines(run) if not m.get("abandoned")]
    assert kept[-1]["lr_scale"] == pytest.approx(math.prod(factors))  # the cuts hold, given back part way once quiet
    assert 0.005 <= kept[-1]["lr_scale"] <= 0.02  # within 2x of the preset's LR (100x its)
    assert kept[-1]["loss"] < kept[0]["loss"] - 1.0
    assert summary["exit_code"] == 0


def test_a_finetuning_lr_far_too_high_is_cut_back_at_the_phase_start_and_the_replay_judged_afresh(tmp_path):
    """Pretraining, then a finetuning phase at ~30x the preset's LR (no warm-up): above_start
    rolls back to the checkpoint where pretraining ended, LR x0.1, twice. That checkpoint holds
    the orchestrator's pretraining windows; the finetuning steps replayed after it start them
    afresh as the first pass did. (They were judged against pretraining's trend: every replayed
    step a "spike", updates withheld, an LR cut and a rollback spent on nothing.)"""
    run = tmp_path / "r"
    finetune = {"steps": 16, "data": {"source": "builtin", "seq_len": 64}, "optim": {"lr": 0.1, "warmup_steps": 0}}
    summary = trimtab.train(debug_cfg(run, steps=24, finetune=finetune))
    decisions = read_decisions(run, abandoned=True)
    assert [(d["rule"], d["action"], d["params"].get("lr_factor")) for d in decisions] == [
        ("above_start", "rollback", 0.1)
    ] * 2, decisions
    assert all("rolled back from step 28 to step 24" in d["applied"][0] for d in decisions)
    assert summary["exit_code"] == 0 and summary["step"] == 40
