"""`trimtab plan` on a CPU with native bf16 times the model's training step (train.precision auto:
training/services/cpu_precision.py). For moe-40m, ~15 s a step in fp32 on 2 cores, its four
rounds took ~2 min (more on a loaded host): the rounds now stop within PROBE_BUDGET_S of steps
(a warm-up and one timed round at least), and the plan says how its precision was chosen."""

from __future__ import annotations

import pytest
import torch

from trimtab.config import load_config
from trimtab.hardware import Precision
from trimtab.model import build_model
from trimtab.plan import plan_command
from trimtab.training.services import cpu_precision as cp


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: each timed step "takes" clock.seconds[dtype] and is counted, nothing runs."""
    calls = []

    def step(model, tokens, dtype):
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        calls.append(name)
        return clock.seconds[name]

    monkeypatch.setattr(cp, "_step_seconds", step)
    clock.calls = calls
    return clock


def tiny():
    return build_model(load_config(preset="debug", sets=["model.vocab_size=64"]).model)


def test_a_long_step_is_timed_within_the_budget(clock):
    """moe-40m's step times (15.7 s fp32, 8.7 s bf16, measured on 2 cores): a warm-up round and
    one timed round, not four rounds (~100 s); the entry says one."""
    clock.seconds = {"fp32": 15.7, "bf16": 8.7}
    entry = cp._probe(tiny(), rows=1, seq_len=8)
    assert clock.calls == ["fp32", "bf16"] * 2
    assert entry["reps"] == 1 and (entry["fp32_s"], entry["bf16_s"]) == (15.7, 8.7)
    assert len(clock.calls) / 2 * (15.7 + 8.7) <= 2 * cp.PROBE_BUDGET_S  # the minimum, two rounds


def test_steps_within_the_budget_get_every_round_and_rounds_stop_before_overrunning(clock):
    clock.seconds = {"fp32": 0.2, "bf16": 0.3}
    assert cp._probe(tiny(), rows=1, seq_len=8)["reps"] == cp.PROBE_REPS
    assert len(clock.calls) == 2 * (cp.PROBE_REPS + 1)
    clock.calls.clear()
    clock.seconds = {"fp32": 4.0, "bf16": 4.0}  # 8 s a round: warm-up + 2 rounds = 24 s, a third would end at 32
    entry = cp._probe(tiny(), rows=1, seq_len=8, budget_s=30.0)
    assert entry["reps"] == 2 and len(clock.calls) / 2 * 8.0 <= 30.0


def test_the_plan_says_how_its_precision_was_chosen(tmp_path):
    """The reason travels into the plan's time section: a timed step's speed-up and round count."""
    reason = "this model's training step measured 0.82x in bf16 autocast (best of 1 steps each, 2026-12-03, cached)"
    text = plan_command(
        None,
        "debug",
        [],
        str(tmp_path),
        dataset_tokens=1e6,
        precision_of=lambda cfg: Precision(torch.device("cpu"), "fp32", reason),
    )
    assert f"  precision       fp32: {reason}" in text
