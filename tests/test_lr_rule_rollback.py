"""The `lr` rule across a rollback: its compensation (the LR multiplier) is a knob a rollback keeps,
so what the rule has accounted for is kept with it, and a replay from before the stray writer's
step withdraws the compensation until the writer is back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import trimtab
from trimtab.config import load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.lr_rule import UnexplainedLR
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.remedies import Remedy
from trimtab.rundir import read_decisions


def lr_metrics(step: int, lr: float, scheduled: float, scale: float) -> StepMetrics:
    return StepMetrics(step=step, loss=5.0, grad_norm=1.0, lr=lr, scheduled_lr=scheduled, lr_scale=scale)


def test_a_rollback_keeps_what_the_lr_rule_accounted_for(tmp_path):
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    saved = orchestrator.state_dict()  # a checkpoint from before the stray writer
    monitor = orchestrator.monitors["lr"]
    assert monitor.observe(lr_metrics(12, lr=1e-2, scheduled=1e-3, scale=1.0)) is not None  # x10: cut to 0.1
    orchestrator._load_monitors(saved, rollback=True)
    assert monitor.explained == pytest.approx(10)  # the multiplier 0.1 the rollback keeps still compensates
    assert orchestrator.ceilings["lr"] == pytest.approx(30)
    assert monitor.observe(lr_metrics(12, lr=1e-3, scheduled=1e-3, scale=0.1)) is None  # no second cut
    orchestrator._load_monitors(saved)  # a resume restores the knob from the checkpoint: and the rule with it
    assert monitor.explained == 1.0


def test_the_compensation_is_withdrawn_when_the_stray_writer_is_gone():
    monitor = UnexplainedLR(OrchestratorConfig())
    cut = monitor.observe(lr_metrics(12, lr=1e-2, scheduled=1e-3, scale=1.0))
    assert cut.evidence["explained"] == 1 and cut.evidence["ratio"] == pytest.approx(10)
    assert monitor.observe(lr_metrics(13, lr=1e-3, scheduled=1e-3, scale=0.1)) is None  # compensated
    back = monitor.observe(lr_metrics(5, lr=1e-4, scheduled=1e-3, scale=0.1))  # a replay before the writer's step
    assert back is not None and back.evidence["explained"] / back.evidence["ratio"] == pytest.approx(10)
    assert "no longer" in back.summary and monitor.explained == pytest.approx(1)
    assert monitor.observe(lr_metrics(6, lr=1e-3, scheduled=1e-3, scale=1.0)) is None
    # a low LR the rule never compensated for is not its to raise
    assert UnexplainedLR(OrchestratorConfig()).observe(lr_metrics(1, lr=1e-5, scheduled=1e-3, scale=1.0)) is None


def test_an_lr_cut_decided_with_a_rollback_is_dropped_with_it(tmp_path):
    """weights_nan@10 + lr_spike@12: at step 12 a rollback to step 5 and the lr rule's x0.1. Applied,
    the cut outlived the restore (knobs do): the replay trained at 0.1x the schedule from step 6 and
    the rule gave the cut back as a fault there. Dropped with the rollback, the rule's account too."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    saved = orchestrator.state_dict()  # the checkpoint of step 5
    requested = []
    run = SimpleNamespace(control=SimpleNamespace(request=lambda name, **_: requested.append(name)), say=print)
    broken = Finding(rule="nonfinite", family="instability", step=12, evidence={}, summary="loss nan", strength=1.0)
    orchestrator._decide(run, broken, Remedy(action="rollback", params={"to": "last_good"}, reasoning="broken"))
    raised = orchestrator.monitors["lr"].observe(lr_metrics(12, lr=1e-2, scheduled=1e-3, scale=1.0))
    cut = orchestrator.decide(run, raised)
    assert requested == ["rollback"]  # the cut is never requested: the multiplier stays the checkpoint's
    assert cut.outcome["result"] == "cut short" and cut.outcome["dropped_by"] == orchestrator.rolling_back
    assert "dropped with the rollback" in cut.applied[0]
    assert orchestrator.journal.track_record("lr", "scale_lr") == (0, 0)  # judges nothing
    orchestrator._load_monitors(saved, rollback=True)
    # the replay before the writer's step is on schedule at multiplier 1: nothing to give back
    assert orchestrator.monitors["lr"].observe(lr_metrics(6, lr=1e-3, scheduled=1e-3, scale=1.0)) is None
    # the writer met again at step 12 is cut then, as the first time
    again = orchestrator.monitors["lr"].observe(lr_metrics(12, lr=1e-2, scheduled=1e-3, scale=1.0))
    assert again is not None and again.evidence["explained"] == 1.0
    rollback = orchestrator.journal.decisions[0]
    orchestrator._applied(rollback, "failed: no checkpoint to roll back to")  # none comes: later cuts apply
    assert orchestrator.decide(run, again).outcome is None and requested == ["rollback", "scale_lr"]


def run_cfg(out, faults=()):
    overrides = {
        "out": str(out),
        "train": {"max_steps": 24, "eval_every": 0, "log_every": 1, "batch_tokens": 1024, "eval_tokens": 1024}
        | {"precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 8},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "faults": list(faults),
        # timing-based rules off; no make-up, so both runs share one schedule
        "orchestrator": {"throughput": {"enabled": False}, "make_up": {"enabled": False}},
    }
    return load_config(preset="debug", overrides=overrides)


def last_line(run_dir):
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "loss" in m][-1]


def test_a_rollback_past_an_lr_cut_does_not_cut_again(tmp_path):
    """lr_spike@12 is cut to 0.1; weights_nan@15 rolls back to step 8, before the writer's step:
    the replay trains on schedule (the cut withdrawn, made again at 12) and ends there."""
    faulty = trimtab.train(run_cfg(tmp_path / "f", ["lr_spike@12", "weights_nan@15"]))
    clean = trimtab.train(run_cfg(tmp_path / "c"))
    ds = [d for d in read_decisions(tmp_path / "f") if d["rule"] == "lr"]
    assert any(d["action"] == "rollback" for d in read_decisions(tmp_path / "f"))
    # the cut; after the rollback to step 8 the writer is not there yet (withdrawn), at step 12 it is again
    assert [d["step"] for d in ds] == [12, 9, 12]
    assert [d["params"]["factor"] for d in ds] == pytest.approx([0.1, 10, 0.1])  # never a second x0.1 on the first
    assert "given back" in ds[1]["reasoning"] and "skipped" not in ds[1]["reasoning"]
    end, clean_end = last_line(tmp_path / "f"), last_line(tmp_path / "c")
    assert end["step"] == clean_end["step"] == 24
    assert end["lr_scale"] == pytest.approx(0.1) and end["lr"] == pytest.approx(clean_end["lr"])  # on schedule
    assert faulty["val_loss"] == pytest.approx(clean["val_loss"], rel=0.03)
