"""A dead MoE expert revived as a copy of the busiest (MoE.reinit_expert), and the dead_expert
fault that starves one through the real training loop (orchestrator/faults.py)."""

import json

import pytest
import torch

import trimtab
from trimtab.config import load_config, merge
from trimtab.config.sparse import MoEConfig
from trimtab.errors import ConfigError
from trimtab.model.moe import MoE
from trimtab.orchestrator.fault_specs import parse_fault

pytestmark = pytest.mark.usefixtures("one_thread")
D, H = 16, 24


def moe_cfg(out, steps, **overrides):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 1024, "log_every": 1},
        "data": {"max_bytes": 150_000},
        "log": {"progress": False, "tensorboard": False},
        "checkpoint": {"every": 0},
    }
    return load_config(preset="debug-moe", overrides=merge(base, overrides))


def sharp_top1() -> MoE:
    """4 experts, top-1, router_temperature 0.1 (the sharp router a mid-pack row loses under), expert 3 dead."""
    torch.manual_seed(0)
    m = MoE(D, H, MoEConfig(n_experts=4, top_k=1, router_temperature=0.1, capacity_factor=0.0), init_std=0.3)
    with torch.no_grad():
        m.expert_bias[3] = -2.0  # never selected
    return m


def test_a_revived_expert_under_a_sharp_top1_router_takes_a_share_of_the_busiest_tokens():
    m, x = sharp_top1(), torch.randn(8, 64, D)
    m(x)
    counts = m.stats["tokens_per_expert"]
    busiest = int(counts.argmax())
    assert counts[3] == 0
    m.reinit_expert(3)
    assert torch.allclose(m.w1[3], m.w1[busiest], rtol=0.05, atol=0.05)  # trained weights, not random ones
    assert m.expert_bias[3] == m.expert_bias[busiest]
    m(x)
    share = float(m.stats["tokens_per_expert"][3] / x[..., 0].numel())
    # A row at the others' mean is nobody's first choice at temperature 0.1: 0.8% here.
    assert share > 0.1, share


def test_dead_expert_fault_starves_the_last_expert_of_the_layer(tmp_path):
    cfg = moe_cfg(tmp_path / "r", steps=3, faults=["dead_expert@2:3"], orchestrator={"mode": "off"})
    trimtab.train(cfg)
    lines = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    loads = {m["step"]: (m["moe/1/tokens_per_expert"], m["moe/3/tokens_per_expert"]) for m in lines if "loss" in m}
    assert all(layer3[-1] == 0 for step, (_, layer3) in loads.items() if step >= 2)
    assert loads[1][1][-1] > 0 and all(layer1[-1] > 0 for layer1, _ in loads.values())  # before it, and layer 1


def test_dead_expert_fault_spec_names_a_moe_layer(tmp_path):
    assert parse_fault("dead_expert@7").param is None and parse_fault("dead_expert@7:3").param == 3
    with pytest.raises(ConfigError, match="dead_expert@STEP\\[:LAYER\\]"):
        parse_fault("dead_expert@7:x")
    with pytest.raises(ConfigError, match="names no MoE layer"):
        trimtab.train(moe_cfg(tmp_path / "r", steps=2, faults=["dead_expert@1:0"]))
