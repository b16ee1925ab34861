"""The bench/ scripts' dry runs: each runs end to end, tiny, and writes nothing (BENCHMARKS.md
is written only by a real run)."""

import subprocess
import sys

import pytest


@pytest.mark.slow  # four variants, each a subprocess that builds a model and trains 2 steps: minutes on 2 cores
def test_moe_step_dry_run_prints_every_variant_and_the_ratios():
    run = subprocess.run(
        [sys.executable, "-m", "trimtab", "bench", "moe_step", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "## MoE training step (bench/moe_step.py --preset debug-moe)\n" in out
    for variant in ("trimtab", "trimtab-loop", "hf-grouped_mm", "hf-eager"):
        assert f"\n| {variant} | " in out, variant
    for ratio in ("trimtab-loop / hf-grouped_mm", "trimtab-loop / hf-eager", "trimtab (Trainer, preset defaults)"):
        assert f"- {ratio}" in out and "target >= " in out, ratio
    assert "> 1 in every repetition: " in out
    assert out.rstrip().endswith("dry run: BENCHMARKS.md not written")
