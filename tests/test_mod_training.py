"""Mixture-of-Depths and hybrid presets through the real training loop: telemetry and warm-up in
metrics.jsonl, exact resume, generation, the capacity action (Control and ctl), and the
orchestrator giving capacity back when the loss says it was cut too far."""

import json

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config, merge
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.ctl import parse_command
from trimtab.orchestrator.mod_health import MoDQuality
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.rundir import read_decisions
from trimtab.training.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_for(preset, out, steps=16, **overrides):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 1024, "log_every": 1},
        "data": {"max_bytes": 150_000},
        "log": {"progress": False, "tensorboard": False},
        "checkpoint": {"every": 4},
        "model": {"mod": {"warmup_steps": 8}},
    }
    return load_config(preset=preset, overrides=merge(base, overrides))


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]


class Act(Hook):
    """Requests an action at a step, like a person with `trimtab ctl`; may stop the run."""

    def __init__(self, at=None, action=None, stop_at=None, **params):
        self.at, self.action, self.params, self.stop_at, self.done = at, action, params, stop_at, []

    def on_step_end(self, trainer, out):
        if out.step == self.at:
            trainer.control.request(self.action, on_done=self.done.append, **self.params)
        if out.step == self.stop_at:
            trainer.control.request("stop", reason="test")


@pytest.mark.parametrize("preset", ["debug-mod", "debug-hybrid"])
def test_preset_trains_resumes_exactly_and_generates(tmp_path, preset):
    summary = trimtab.train(cfg_for(preset, tmp_path / "a"))
    assert summary["status"] == "completed"
    lines = metrics(tmp_path / "a")
    mod_layers = [k.split("/")[1] for k in lines[0] if k.startswith("mod/") and k.endswith("/capacity")]
    assert mod_layers == (["1", "3"] if preset == "debug-mod" else ["2", "3"])
    last = mod_layers[-1]
    caps = [m[f"mod/{last}/capacity"] for m in lines]
    target = 0.5 if preset == "debug-mod" else 0.25
    assert caps[0] == 1.0 and caps[4] == pytest.approx(1 - 4 / 8 * (1 - target)) and caps[-1] == target
    assert all(0 <= m[f"mod/{last}/predictor_acc"] <= 1 and 0 < m[f"mod/{last}/gate"] < 1 for m in lines)
    assert lines[-1]["aux_loss"] > 0 and lines[-1]["loss"] < lines[0]["loss"]
    trimtab.train(cfg_for(preset, tmp_path / "b"), hooks=[Act(stop_at=6)])
    trimtab.train(cfg_for(preset, tmp_path / "b"))  # resumes from step 4, mid warm-up
    a = load_file(str(list_checkpoints(tmp_path / "a")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "b")[-1] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(trimtab.generate(tmp_path / "b", "def ", max_new_tokens=12), str)


def test_capacity_action_applies_and_survives_resume(tmp_path):
    cfg = cfg_for("debug-mod", tmp_path / "r", steps=12)
    act = Act(at=5, action="set_mod_capacity", value=0.25, layer=3, stop_at=6)
    trimtab.train(cfg, hooks=[act])
    assert act.done == ["MoD capacity 0.5 -> 0.25 (layer 3)"]
    seen = {}

    class Look(Hook):
        def on_train_start(self, trainer):
            seen.update({i: target for i, (_, target) in trainer.mod_capacities().items()})

    trimtab.train(cfg_for("debug-mod", tmp_path / "r", steps=12), hooks=[Look()])
    assert seen == {1: 0.5, 3: 0.25}  # from the checkpoint, not the config
    assert metrics(tmp_path / "r")[-1]["mod/3/capacity"] == 0.25
    assert parse_command("mod-capacity", ["0.25", "3"]) == {
        "action": "set_mod_capacity",
        "params": {"value": 0.25, "layer": 3},
    }
    with pytest.raises(trimtab.errors.ConfigError, match="'value' must be a number in"):
        trimtab.train(
            cfg_for("debug-mod", tmp_path / "bad", steps=6), hooks=[Act(at=1, action="set_mod_capacity", value=1.5)]
        )


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_orchestrator_gives_capacity_back_when_the_loss_rises(tmp_path, mode):
    """Every layer MoD; at step 30 a person cuts the capacity to 2% of the tokens. The loss
    rises at once; the orchestrator puts the capacity back to 0.5 (off: it stays cut)."""
    cfg = cfg_for(
        "debug-mod",
        tmp_path / "r",
        steps=40,
        model={"layer_pattern": ["mod"], "mod": {"warmup_steps": 0}},
        orchestrator={"mode": mode, "mod": {"tolerance": 0.03}},
    )
    trimtab.train(cfg, hooks=[Act(at=30, action="set_mod_capacity", value=0.02)])
    caps = [m["mod/0/capacity"] for m in metrics(tmp_path / "r")]
    if mode == "off":
        assert caps[-1] == pytest.approx(0.02)
        return
    mod = [d for d in read_decisions(tmp_path / "r") if d["rule"] == "mod"]
    assert len(mod) == 1 and mod[0]["action"] == "set_mod_capacity" and mod[0]["params"] == {"value": 0.5}
    assert 31 <= mod[0]["step"] <= 35 and mod[0]["evidence"]["capacity_after"] < 0.2
    assert mod[0]["applied"] == ["MoD capacity 0.02 -> 0.5 (all MoD layers)"]
    assert caps[-1] == 0.5


def feed(monitor, rows):
    found = []
    for step, (cap, loss) in enumerate(rows):
        f = monitor.observe(StepMetrics(step=step, loss=loss, grad_norm=1.0, progress=0.5, mod_capacity=cap))
        found += [f] if f else []
    return found


def test_mod_monitor_fires_only_when_a_capacity_fall_costs_loss():
    cfg = OrchestratorConfig()
    warmup = [(1.0 - 0.05 * i, 5.0 - 0.05 * i) for i in range(13)]  # capacity and loss both fall
    assert feed(MoDQuality(cfg), warmup) == []
    no_fall = [(0.5, 4.0)] * 10 + [(0.5, 4.5)] * 3  # a loss rise with the capacity unchanged
    assert feed(MoDQuality(cfg), no_fall) == []
    cut = [(0.5, 4.0)] * 10 + [(0.05, 4.4)] * 3
    found = feed(MoDQuality(cfg), cut)
    assert len(found) == 1 and found[0].evidence["restore_to"] == 0.5
    assert found[0].evidence["rise"] == pytest.approx(0.1) and found[0].strength == 1.0
    # an RL objective: 0 while no group has a signal, then signed; no relative rise to judge
    policy = [(0.5, 0.0)] * 10 + [(0.05, 0.0)] + [(0.05, -0.01), (0.05, 0.02)]
    assert feed(MoDQuality(cfg), policy) == []
