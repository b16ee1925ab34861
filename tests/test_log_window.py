"""A log line's figures over its window of steps (training/metrics.py step_metrics)."""

import json
import math

import trimtab
from test_trainer import debug_cfg
from trimtab.cli_train import _print_summary


def test_a_nonfinite_step_is_counted_apart_not_averaged_into_its_log_line(tmp_path, capfd):
    """One NaN step, skipped by the orchestrator, made its whole window read "loss nan" (metrics,
    console, TensorBoard) while the steps around it trained finite: a user read training as broken.
    The line's loss and gradient norm are the finite steps' means, and the NaN step is counted."""
    run_dir = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run_dir, steps=6, faults=["nan_loss@2"], train={"log_every": 3}))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {m["step"]: m for m in lines if "loss" in m}
    assert sorted(logged) == [3, 6]
    first, second = logged[3], logged[6]
    assert math.isfinite(first["loss"]) and math.isfinite(first["grad_norm"]) and math.isfinite(first["grad_norm_max"])
    assert first["nonfinite_steps"] == 1 and first["skipped_steps"] == 1
    assert "nonfinite_steps" not in second and 0 < second["loss"] < first["loss"] + 1
    # a line counts its window's skipped steps, the summary the run's: the last line's 0 is not the run's
    assert second["skipped_steps"] == 0 and summary["skipped_steps"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["skipped_steps"] == 1
    assert "step 3/6 loss " in (err := capfd.readouterr().err) and "(1 non-finite step apart)" in err
    _print_summary(summary)
    assert "1 update withheld (skipped steps)" in capfd.readouterr().out
