"""The bench/ scripts' dry runs: each runs end to end, tiny, and writes nothing (BENCHMARKS.md
is written only by a real run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def dry_run(name: str) -> str:
    """`trimtab bench NAME --dry-run`'s output, after checking it succeeded and wrote nothing."""
    run = subprocess.run(
        [sys.executable, "-m", "trimtab", "bench", name, "--dry-run"], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.rstrip().endswith("dry run: BENCHMARKS.md not written")
    return run.stdout


@pytest.mark.slow  # one process with the four variants, then one per variant for its peak RSS: a minute or two
def test_moe_step_dry_run_prints_every_variant_and_the_ratios():
    out = dry_run("moe_step")
    assert "## MoE training step (bench/moe_step.py --preset debug-moe)\n" in out
    for variant in ("trimtab", "trimtab-loop", "hf-grouped_mm", "hf-eager"):
        assert f"\n| {variant} | " in out, variant
    trainer = "trimtab (Trainer at the preset's defaults)"
    for ratio in (
        "trimtab-loop / hf-grouped_mm",
        "trimtab-loop / hf-eager",
        f"{trainer} / hf-grouped_mm",
        f"{trainer} / hf-eager",
    ):
        assert f"- {ratio}" in out and "target >= " in out, ratio
    assert "as parity: " in out and "> 1 in every repetition: " in out
    assert "a step of each in turn" in out  # the variants interleaved in one process per repetition


@pytest.mark.slow  # seven variants, each a subprocess that builds a model and trains 2 tiny steps: a minute or two
def test_mod_dry_run_prints_every_variant_the_ratios_and_peak_memory():
    out = dry_run("mod")
    assert "## Mixture-of-Depths and hybrid step time (bench/mod.py)\n" in out
    assert "| 2 | dense | " in out and "| 1 (reference) |" in out
    for variant in ("**mod 0.5**", "mod 0.25", "mod 0.125", "dense+mod 0.125", "moe", "hybrid"):
        row = next((ln for ln in out.splitlines() if ln.startswith(f"| 2 | {variant} | ")), None)
        assert row is not None, variant
        assert row.count("x (") == 1 and " MB" not in row, row  # the ratio's interval; RSS as a number
    assert "peak RSS MB" in out
    assert "- mod 0.5 / dense step time, 2 torch threads: **" in out and "target <= 0.7x: " in out


@pytest.mark.slow  # five subprocesses (four variants and a repeat), each building a model and training 2 steps
def test_memory_dry_run_prints_every_variant_and_the_ratios():
    out = dry_run("memory")
    assert "## Activation memory: largest batch under a cap (bench/memory.py --preset debug)\n" in out
    for variant in ("trimtab", "trimtab+ckpt", "transformers", "transformers+ckpt"):
        assert f"\n| {variant} | >= 1 | 64 | " in out, variant  # --max-rows 1 in a dry run; debug's seq_len 64
    for ratio in ("trimtab / transformers", "trimtab+ckpt / transformers+ckpt", "trimtab+ckpt / trimtab"):
        assert f"- largest batch, {ratio}: **" in out, ratio
    assert "- repeatability: trimtab at 1 rows measured twice, " in out
    assert "micro-batch auto-sizing: " in out  # skipped with its reason on CPU, measured on CUDA


@pytest.mark.slow  # builds debug and times a few steps in fp32 and bf16: under a minute where bf16 is native
def test_precision_dry_run_prints_the_speedup_and_what_auto_chose():
    from trimtab.hardware import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        pytest.skip("no native bf16 on this CPU: the benchmark refuses (bf16 is emulated, minutes a step)")
    out = dry_run("precision")
    assert "## bf16 autocast on this CPU (bench/precision.py)\n" in out
    assert "\n| debug | " in out and "(>= 1.1x: " in out


def test_gpu_dry_run_trains_trimtab_and_the_plain_loop_on_cpu():
    out = dry_run("gpu")
    assert "## GPU training step (`bench/gpu.py --preset debug`)" in out
    assert "\n| trimtab | " in out and "\n| plain | " in out and "- trimtab / plain: **" in out


def test_gpu_reports_saved_repetitions_without_running(tmp_path):
    """--load: the repetitions of earlier invocations (--save, e.g. from a lent GPU) in one table."""
    rep = {"date": "2026-11-25", "tokens_per_s": 100.0, "step_s": [0.5, 0.6], "warmup_s": 2.0, "mfu": 0.4}
    rep |= {"peak_mem_gb": 1.0, "device": "NVIDIA H200", "torch": "2.11.0"}
    (tmp_path / "a.json").write_text(json.dumps({"trimtab": [rep | {"cold_start_s": 1.0}], "plain": [rep]}))
    (tmp_path / "b.json").write_text(json.dumps({"trimtab-compile": [rep | {"tokens_per_s": 120.0}]}))
    args = ["--preset", "moe-7b", "--moe-impl", "padded", "--dry-run", "--load", "a.json", "b.json"]
    run = subprocess.run([sys.executable, str(BENCH / "gpu.py"), *args], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "## GPU training step (`bench/gpu.py --preset moe-7b --moe-impl padded`)" in run.stdout
    assert "| trimtab | 100 | 100 | 0.500-0.600 | 40.0% | 2.0 | 1.0 | 1.0 |" in run.stdout
    assert "- trimtab-compile / trimtab: **1.200x**" in run.stdout and "2026-11-25, NVIDIA H200" in run.stdout


def test_loss_dry_run_checks_every_chunk_size_against_the_plain_loss():
    out = dry_run("loss")
    assert "## Fused cross-entropy (bench/loss.py)" in out
    for variant in ("plain", "fused 128", "fused 256"):
        assert f"\n| {variant} | " in out, variant


def test_interop_dry_run_times_the_four_operations_in_rounds_and_states_parity():
    out = dry_run("interop")
    assert "## Hugging Face export and import (bench/interop.py)" in out and "Time: 2 rounds" in out
    for op in ("trimtab export", "trimtab import", "transformers load", "transformers save"):
        assert f"\n| {op} | " in out, op
    for ratio in ("trimtab export / transformers save", "trimtab import / transformers load"):
        assert f"- {ratio}, time: **" in out and "as parity: " in out, ratio
