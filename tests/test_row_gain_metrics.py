"""metrics.jsonl carries the update gain (training/gain.py) where the orchestrator measured it."""

import json
import math

import torch

import trimtab
from test_trainer import debug_cfg
from trimtab.training.metrics import gain_metrics


def test_the_measured_update_gain_is_logged_with_the_steps_it_was_measured_on(tmp_path):
    """above_start measures the gain over a phase's first 15 steps and judges the LR by it, but no log
    line said it: a user could not read why an LR was cut (evidence only in decisions.jsonl)."""
    run_dir = tmp_path / "r"
    trimtab.train(debug_cfg(run_dir, steps=20, train={"log_every": 5}))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {m["step"]: m for m in lines if "loss" in m}
    assert sorted(logged) == [5, 10, 15, 20]
    for step in (5, 10, 15):  # measured: a sound LR delivers most of what its gradient promised
        gain, worst = logged[step]["update_gain"], logged[step]["update_gain_min"]
        assert math.isfinite(gain) and worst <= gain and 0.05 < gain < 2.0
    assert "update_gain" not in logged[20]  # past the rule's steps: not measured, not logged


def test_withheld_updates_and_unmeasured_windows_log_no_gain():
    assert gain_metrics([]) == {}
    assert gain_metrics([torch.tensor(math.inf), torch.tensor(math.nan)]) == {}
    figures = gain_metrics([torch.tensor(0.8), torch.tensor(math.nan), torch.tensor(-0.4)])
    assert abs(figures["update_gain_min"] + 0.4) < 1e-6 and abs(figures["update_gain"] - 0.2) < 1e-6
