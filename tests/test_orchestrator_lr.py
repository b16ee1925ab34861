"""A learning rate that is simply too high (a finetuning LR typed for pretraining, a slipped
exponent): caught from the first steps, cut decisively, never given back."""

import json

import pytest

import trimtab
from test_orchestrator_loop import debug_cfg
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
    assert not [d for d in decisions if d["rule"] == "lr_restore"]
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [m for m in lines if "loss" in m and not m.get("abandoned")]
    assert kept[-1]["loss"] < kept[0]["loss"] - 0.5  # trains from the sound start at the cut LR
    assert kept[-1]["lr_scale"] == pytest.approx(0.1)  # the cut holds to the end
    assert summary["exit_code"] == 0


def test_the_preset_lr_raises_no_above_start_finding(tmp_path):
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=30))
    assert not [d for d in read_decisions(run) if d["rule"] == "above_start"]
