import math

import pytest
import torch
from torch import nn

from trimtab.config import OptimConfig
from trimtab.training.optim import build_optimizer, lr_at, param_groups


def cfg(**kw):
    return OptimConfig(**{"lr": 1.0, "min_lr_ratio": 0.1, "warmup_steps": 10, **kw})


def test_warmup_then_cosine_endpoints():
    c = cfg(schedule="cosine")
    assert lr_at(0, 110, c) == pytest.approx(0.1)
    assert lr_at(9, 110, c) == pytest.approx(1.0)
    assert lr_at(60, 110, c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, 110, c) == pytest.approx(0.1)


def test_wsd_is_flat_then_decays_linearly():
    c = cfg(schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, 110, c) == pytest.approx(1.0)
    assert lr_at(90, 110, c) == pytest.approx(1.0)  # progress 0.8: decay starts
    assert lr_at(100, 110, c) == pytest.approx(0.55)
    assert lr_at(110, 110, c) == pytest.approx(0.1)


def test_constant_and_linear():
    assert lr_at(500, 110, cfg(schedule="constant")) == 1.0
    assert lr_at(60, 110, cfg(schedule="linear")) == pytest.approx(0.55)


def test_cyclic_schedules():
    tri = cfg(schedule="triangular", warmup_steps=0, cycle_steps=10)
    assert [lr_at(s, 1000, tri) for s in (0, 5, 10, 15, 20)] == pytest.approx([0.1, 0.55, 1.0, 0.55, 0.1])
    tri2 = cfg(schedule="triangular2", warmup_steps=0, cycle_steps=10)
    assert lr_at(30, 1000, tri2) == pytest.approx(0.1 + 0.9 / 2)  # second peak at half height
    exp = cfg(schedule="exp_range", warmup_steps=0, cycle_steps=10, gamma=0.9)
    assert lr_at(10, 1000, exp) == pytest.approx(0.1 + 0.9 * 0.9**10)


def test_a_cyclic_schedules_warm_up_ends_where_its_first_cycle_starts():
    """Warmed to lr, a cyclic schedule fell 10x in one step after the warm-up (to the cycle's low
    end, where each cycle starts), then climbed back: the warm-up now ends at that low end."""
    for schedule in ("triangular", "triangular2", "exp_range"):
        c = cfg(schedule=schedule, warmup_steps=5, cycle_steps=10, gamma=0.99)
        lrs = [lr_at(s, 1000, c) for s in range(40)]
        assert lrs[4] == pytest.approx(0.1) and lrs[5] == pytest.approx(0.1), schedule
        assert max(abs(b - a) for a, b in zip(lrs, lrs[1:])) <= 0.09 + 1e-9, schedule  # a cycle's slope: 0.9 / 10
        assert lrs[15] == pytest.approx(1.0 if schedule != "exp_range" else 0.1 + 0.9 * 0.99**10), schedule  # 1st peak
    assert lr_at(2, 1000, cfg(schedule="cosine", warmup_steps=5)) == pytest.approx(0.6)  # others warm to lr


def test_schedule_is_a_pure_function():
    c = cfg(schedule="cosine")
    assert [lr_at(s, 200, c) for s in range(200)] == [lr_at(s, 200, c) for s in range(200)]


def test_decay_groups_exclude_embeddings_norms_and_biases():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 4  # embedding, linear bias, norm weight + bias


def test_fused_adamw_on_cpu_by_default():
    opt = build_optimizer(nn.Linear(3, 3), OptimConfig(), torch.device("cpu"))
    assert opt.defaults["fused"] is True
