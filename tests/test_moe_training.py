"""Mixture-of-Experts through the real training loop: aux losses in the objective, telemetry in
metrics.jsonl, expert surgery with a consistent optimizer, and exact resume after surgery."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config, merge
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.rundir import read_decisions
from trimtab.training.hooks import Hook
from trimtab.training.instrument import Instrument

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_cfg(out, steps=16, **overrides):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 1024, "log_every": 2},
        "data": {"max_bytes": 150_000},
        "log": {"progress": False, "tensorboard": False},
        "checkpoint": {"every": 4},
    }
    return load_config(preset="debug-moe", overrides=merge(base, overrides))


class Surgeon(Instrument):
    """Acts like a person with `trimtab ctl`: surgery and knob changes mid-run. A test instrument
    too: it checks the live optimizer through its FaultHandle (a hook's view has none)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.done = stop_at, []

    def on_step_end(self, trainer, out):
        c = trainer.control
        plan = {
            6: ("add_expert", {"layer": 1}),
            8: ("prune_expert", {"layer": 3, "expert": 2}),
            10: ("reinit_expert", {"layer": 1, "expert": 0}),
            11: ("set_router_temperature", {"value": 1.5}),
        }
        if out.step in plan:
            action, params = plan[out.step]
            c.request(action, on_done=self.done.append, **params)
        if out.step == 7:  # right after adding: the optimizer holds exactly the live parameters
            model, optimizer = self.handle.model, self.handle.optimizer
            live = {id(p) for p in model.parameters()}
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            assert live == held
            moe = model.blocks[1].ffn
            state = optimizer.state[moe.w1]
            assert state["exp_avg"].shape == moe.w1.shape  # moments follow the new shape
            assert state["exp_avg"][8].abs().sum() > 0  # the added expert starts from its source's moments
            # the run's sizes follow (summary.json gave the starting size after surgery)
            assert self.handle._trainer.sizes["params"] == sum(p.numel() for p in model.parameters())
        if out.step == self.stop_at:
            trainer.control.request("stop", reason="test")


def test_moe_preset_trains_with_aux_loss_and_telemetry(tmp_path):
    summary = trimtab.train(moe_cfg(tmp_path / "r", steps=20))
    assert summary["status"] == "completed"
    lines = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "loss" in m]
    assert train[-1]["loss"] < train[0]["loss"]
    last = train[-1]
    assert last["aux_loss"] > 0
    for layer in (1, 3):  # layer_pattern [dense, moe] over 4 layers
        assert 0 <= last[f"moe/{layer}/dropped"] < 1
        assert last[f"moe/{layer}/max_load"] >= 1.0 and last[f"moe/{layer}/load_cv"] >= 0
        assert 0 < last[f"moe/{layer}/entropy"] <= torch.log(torch.tensor(8.0)).item() + 1e-4
        assert len(last[f"moe/{layer}/tokens_per_expert"]) == 8
        assert sum(last[f"moe/{layer}/tokens_per_expert"]) == 1024 * 2  # every token's top-2, before capacity
    assert summary["active_params"] < summary["params"]


def test_surgery_mid_run_then_resume_is_exact(tmp_path):
    surgeon = Surgeon()
    trimtab.train(moe_cfg(tmp_path / "a"), hooks=[surgeon])
    assert surgeon.done == [
        "layer 1: add expert 8 (8 -> 9 experts)",
        "layer 3: prune expert 2 (8 -> 7 experts)",
        "layer 1: reinit expert 0 as a copy of expert 1 (9 -> 9 experts)",
        "router_temperature 1 -> 1.5 (all MoE layers)",
    ]
    trimtab.train(moe_cfg(tmp_path / "b"), hooks=[Surgeon(stop_at=12)])
    trimtab.train(moe_cfg(tmp_path / "b"), hooks=[Hook()])  # resumes from step 12 with the new shapes
    a = load_file(str(list_checkpoints(tmp_path / "a")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "b")[-1] / "model.safetensors"))
    assert a["blocks.1.ffn.w1"].shape[0] == 9 and a["blocks.3.ffn.w1"].shape[0] == 7
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = trimtab.generate(tmp_path / "b", "def ", max_new_tokens=8)  # generation sees the new shapes
    assert isinstance(text, str)


def test_surgery_errors_name_the_fix(tmp_path):
    done = []

    class Bad(Hook):
        def on_train_start(self, run):
            run.control.request("add_expert", on_done=done.append, layer=0)
            run.control.request("prune_expert", on_done=done.append, layer=1, expert=8)
            with pytest.raises(ConfigError, match="whole number"):
                run.control.request("prune_expert", layer=1, expert=-1)

    trimtab.train(moe_cfg(tmp_path / "r", steps=2), hooks=[Bad()])
    first, second = done  # applied by the loop after the first step
    assert first.startswith("failed: ") and "not a MoE layer" in first
    assert second.startswith("failed: ") and "experts 0..7" in second


def test_active_params_and_flops_count_top_k_of_the_experts():
    cfg = load_config(preset="debug-moe", sets=["model.vocab_size=512"]).model
    model = build_model(cfg)
    moe = model.blocks[1].ffn
    per_expert = moe.w1[0].numel() + moe.w2[0].numel() + moe.w3[0].numel()
    layers = len(model.moe_layers())
    assert model.num_params() - model.num_params(active=True) == layers * (8 - 2) * per_expert
    dense = load_config(preset="debug-moe", sets=["model.layer_pattern=[dense]", "model.vocab_size=512"]).model
    # expert width = dense width / top_k, so a token's FLOPs match the dense model's, plus the router
    extra = model.flops_per_token(64) - build_model(dense).flops_per_token(64)
    assert extra == 6 * layers * moe.router.numel()


class Starve(Instrument):
    """Makes expert 5 of layer 1 unreachable (a selection bias no token overcomes): a dead expert.
    A test instrument: it writes through its FaultHandle, as fault injection does."""

    def on_step_start(self, trainer, batch):
        if trainer.step == 0:
            self.handle.model.blocks[1].ffn.expert_bias[5] = -1e4


def test_dead_expert_is_reinitialised_and_gets_traffic_again(tmp_path):
    cfg = moe_cfg(
        tmp_path / "r",
        steps=24,
        orchestrator={"moe": {"window": 5, "dead_patience": 8, "imbalance": 100, "max_drop": 1.0}},
    )
    trimtab.train(cfg, hooks=[Starve()])
    moe = [d for d in read_decisions(tmp_path / "r") if d["rule"] == "moe"]
    assert moe and moe[0]["action"] == "reinit_expert" and moe[0]["params"] == {"layer": 1, "expert": 5}
    assert moe[0]["evidence"]["kind"] == "dead" and len(moe[0]["applied"]) == 1
    assert re.fullmatch(
        r"layer 1: reinit expert 5 as a copy of expert [0-46-7] \(8 -> 8 experts\)", moe[0]["applied"][0]
    )
    lines = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-2]["moe/1/idle_experts"] == 0  # the revived expert is routed to again


def test_imbalance_raises_the_balance_loss(tmp_path):
    # 20 steps: two windows of 8 are judged by step 16, where both layers' first decision falls
    cfg = moe_cfg(
        tmp_path / "r",
        steps=20,
        model={"moe": {"capacity_factor": 1.0}},
        orchestrator={"moe": {"window": 8, "imbalance": 1.01, "improving": 1e-6, "grace_steps": 0}},  # act at once
    )
    trimtab.train(cfg)
    moe = [d for d in read_decisions(tmp_path / "r") if d["rule"] == "moe"]
    actions = {d["action"] for d in moe}
    assert "set_balance_coef" in actions, moe  # every layer is above 1.01x fair share
    coef = next(d for d in moe if d["action"] == "set_balance_coef")
    over = max(1.0, coef["evidence"]["max_load"] / 1.01)  # x2, scaled by how far over the bar (remedies._raised)
    assert coef["params"]["value"] == pytest.approx(0.01 * min(4.0, 2 * over), rel=1e-3)
    assert "balance_coef 0.01 -> " in coef["applied"][0]


def test_dropped_tokens_raise_the_capacity_factor(tmp_path):
    cfg = moe_cfg(
        tmp_path / "r",
        steps=20,
        model={"moe": {"capacity_factor": 1.0}},
        orchestrator={"moe": {"window": 8, "imbalance": 100, "max_drop": 0.05, "grace_steps": 0}},
    )
    trimtab.train(cfg)
    moe = [d for d in read_decisions(tmp_path / "r") if d["rule"] == "moe"]
    assert moe and all(d["action"] == "set_capacity_factor" for d in moe), moe
    assert moe[0]["params"]["value"] == pytest.approx(1.25) and moe[0]["evidence"]["dropped"] > 0.05


def moe_lines(run_dir):
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_expert_collapse_is_detected_and_balance_comes_back(tmp_path):
    """expert_collapse@12 gives expert 0 of every MoE layer a +1 selection bias: it is every token's
    choice (max_load E / top_k = 4), and stays so without the orchestrator. With it, the collapse
    is found on its third step and, the selection bias leading by 1 (a raised balance loss cannot
    move it: that was the first remedy, and the reset came only on the recurrence), the router is
    reset at once, after which the load spreads again."""
    quiet = {"window": 5, "imbalance": 100, "max_drop": 1.0}  # only the collapse rule speaks
    off = moe_cfg(
        tmp_path / "off", steps=24, train={"log_every": 1}, faults=["expert_collapse@12"], orchestrator={"mode": "off"}
    )
    trimtab.train(off)
    lines = moe_lines(tmp_path / "off")
    assert all(m[f"moe/{layer}/max_load"] == pytest.approx(4.0) for m in lines[12:] for layer in (1, 3))
    assert max(m["moe/1/max_load"] for m in lines[:11]) < 4.0  # not collapsed before the fault

    trimtab.train(
        moe_cfg(
            tmp_path / "auto",
            steps=40,
            train={"log_every": 1},
            faults=["expert_collapse@12"],
            orchestrator={"moe": quiet},
        )
    )
    moe = [d for d in read_decisions(tmp_path / "auto") if d["rule"] == "moe"]
    assert all(d["evidence"]["kind"] == "collapse" and d["step"] > 12 for d in moe), moe
    layer1 = [d for d in moe if d["params"]["layer"] == 1]
    assert [(d["step"], d["action"]) for d in layer1[:1]] == [(14, "reset_router")], layer1
    assert layer1[0]["params"]["expert"] == 0 and "bias 1 -> 0" in layer1[0]["applied"][0]
    resets = [d for d in moe if d["action"] == "reset_router"]
    assert {d["params"]["layer"] for d in resets} == {1, 3}  # a finding on one layer does not hide the other's
    assert max(d["step"] for d in resets) <= 30, moe
    tail = moe_lines(tmp_path / "auto")[-5:]
    for layer in (1, 3):
        assert sum(m[f"moe/{layer}/max_load"] for m in tail) / 5 < 2.5, tail  # collapsed: 4.0
        assert sum(m[f"moe/{layer}/load_cv"] for m in tail) / 5 < 0.7, tail  # collapsed: ~1.15


def test_a_rollback_keeps_the_router_knobs_as_it_keeps_the_lr_scale(tmp_path):
    """A router temperature turned at step 6 (a person's, or the MoE rule's remedy), then a
    rollback to step 4: the temperature stays 1.5 (the checkpoint's 1.0 came back with the
    weights, undoing the correction), while an expert added after step 4 goes (its weights did)."""

    class Turn(Hook):
        def __init__(self):
            self.sent, self.rolled, self.seen, self.said = set(), False, None, []

        def on_step_end(self, run, out):
            if out.step == 6 and "knobs" not in self.sent:
                self.sent.add("knobs")
                run.control.request("set_router_temperature", value=1.5)
                run.control.request("add_expert", layer=1)
            elif out.step == 7 and "rollback" not in self.sent:
                self.sent.add("rollback")
                run.control.request("rollback", to=4, on_done=self.said.append)
            elif self.rolled and self.seen is None:  # the first step trained again
                self.seen = run.moe_knobs(1)

        def on_rollback(self, run, saved_state):
            self.rolled = True

    turn = Turn()
    trimtab.train(moe_cfg(tmp_path / "r", steps=8, checkpoint={"every": 4}), hooks=[turn])
    assert turn.rolled and turn.seen["router_temperature"] == 1.5 and turn.seen["n_experts"] == 8
    # the expert the rollback undid is said in what it applied (it was silent: the journal still showed 8 -> 9)
    assert any("layer 1: 9 -> 8 experts" in line for line in turn.said), turn.said
