"""Presets: every one loads; the meta-device sizes behind `trimtab presets` match real models and
an independent count; the size classes 1B..300B exist with realistic shapes and budgets."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from trimtab.cli import main
from trimtab.config import available_presets, derive, load_config
from trimtab.model import build_model, preset_size
from trimtab.model.catalog import PresetInfo, format_catalog, model_size, preset_catalog
from trimtab.plan import make_plan, named_gpu

CLASSES = [1e9, 7e9, 14e9, 30e9, 50e9, 100e9, 200e9, 300e9, 2.4e12]  # to the largest the documents name
TOLERANCE = 0.15  # a preset is "in" a size class when its total is within 15% of it
SMALL = 50e6  # below this a preset is built for real on the CPU in the tests


@functools.cache
def catalog() -> dict[str, PresetInfo]:
    return {row.name: row for row in preset_catalog()}


def small_presets() -> list[str]:
    return [name for name, row in catalog().items() if row.total < SMALL]


def large_presets() -> list[str]:
    return [name for name, row in catalog().items() if row.total >= 0.5e9]


def independent_count(name: str, model: torch.nn.Module) -> tuple[int, int, int]:
    """(total, active, FLOPs per token) from the config alone, by the Llama / Mixtral /
    DeepSeekMoE layouts, not through Transformer's counting code. Only the Mixture-of-Depths
    router's size is read off the model (its width is mod.py's choice, not an architecture
    convention); its capacity scaling of FLOPs follows Raposo et al. 2024 section 3.4."""
    cfg = load_config(preset=name)
    m, V, T = cfg.model, cfg.data.bpe_vocab_size, cfg.data.seq_len
    D, L, head = m.d_model, m.n_layers, m.d_model // m.n_heads
    kv = m.n_kv_heads or m.n_heads
    ffn = m.ffn_hidden or math.ceil(8 * D / 3 / m.multiple_of) * m.multiple_of
    expert = m.moe.expert_hidden or max(m.multiple_of, math.ceil(ffn / m.moe.top_k / m.multiple_of) * m.multiple_of)
    attn = 2 * D * D + 2 * D * kv * head  # wq, wo; wk, wv (GQA)
    kinds = [(m.layer_pattern or ["dense"])[i % len(m.layer_pattern or ["dense"])] for i in range(L)]
    capacities = iter(m.mod.layer_capacity or [m.mod.capacity] * sum("mod" in k for k in kinds))
    total = active = V * D * (1 if m.tie_embeddings else 2) + D  # embedding (+ lm head), final norm
    flops = 6 * V * D  # the lm head is a matmul even when tied
    for i, kind in enumerate(kinds):
        if "moe" in kind:
            E, k, S = m.moe.n_experts, m.moe.top_k, m.moe.n_shared_experts
            ffn_all, ffn_used = E * D + 3 * E * D * expert, E * D + 3 * k * D * expert
            ffn_all, ffn_used = ffn_all + 3 * D * S * expert, ffn_used + 3 * D * S * expert
        else:
            ffn_all = ffn_used = 3 * D * ffn  # SwiGLU w1, w3, w2
        route = sum(p.numel() for p in model.blocks[i].depth.parameters()) if "mod" in kind else 0
        total += attn + ffn_all + 2 * D + route
        active += attn + ffn_used + 2 * D + route
        c = next(capacities) if "mod" in kind else 1.0
        flops += 6 * (route + c * (attn + ffn_used)) + 12 * D * T * c * c
    return total, active, round(flops)


def test_every_preset_loads_validates_and_has_a_description():
    from trimtab.config import PRESET_DIR, read_yaml

    names = available_presets()
    assert {"debug", "debug-moe", "small", "dense-1b", "moe-300b"} <= set(names)
    for name in names:
        cfg = load_config(preset=name)  # validates (ConfigError otherwise)
        assert cfg.preset == name and cfg.data.seq_len <= cfg.model.max_seq_len
        assert len(read_yaml(PRESET_DIR / f"{name}.yaml").get("description", "")) > 20, name


@pytest.mark.parametrize("name", small_presets())
def test_small_preset_meta_size_equals_the_real_model_and_an_independent_count(name):
    cfg = load_config(preset=name)
    cfg = derive(cfg, {"model": {"vocab_size": cfg.data.bpe_vocab_size}})
    torch.manual_seed(0)
    real = build_model(cfg.model)
    sizes = (real.num_params(), real.num_params(active=True), real.flops_per_token(cfg.data.seq_len))
    size = model_size(load_config(preset=name))
    assert (size.total, size.active, size.flops_per_token) == sizes
    assert preset_size(name) == size
    row = catalog()[name]
    assert (row.total, row.active, row.flops_per_token) == sizes
    assert independent_count(name, real) == sizes


def test_small_presets_cover_every_cpu_family():
    assert {"debug", "debug-moe", "small", "dense-25m", "moe-40m"} <= set(small_presets())
    assert {catalog()[n].family for n in small_presets()} >= {"dense", "moe"}


def test_each_size_class_from_1b_to_2_4t_has_a_preset():
    for size in CLASSES:
        near = [r.name for r in catalog().values() if abs(r.total / size - 1) <= TOLERANCE]
        assert near, f"no preset within {TOLERANCE:.0%} of {size / 1e9:g}B"
    families = {catalog()[n].family for n in large_presets()}
    assert families == {"dense", "moe", "mod", "hybrid"}


def test_sized_names_tell_family_and_total():
    """`<family>-<size>` names (dense-7b, moe-40m, ...) are within tolerance of the size they
    claim and of the family their layer_pattern gives."""
    sized = 0
    for name, row in catalog().items():
        match = re.fullmatch(r"(dense|moe|mod|hybrid)-(\d+(?:\.\d+)?)([mbt])", name)
        if match:
            sized += 1
            claimed = float(match[2]) * {"m": 1e6, "b": 1e9, "t": 1e12}[match[3]]
            assert abs(row.total / claimed - 1) <= TOLERANCE, (name, row.total)
            assert row.family == match[1], (name, row.family)
    assert sized >= 13


def test_large_presets_have_realistic_shapes_and_budgets():
    for name in large_presets():
        cfg, row = load_config(preset=name), catalog()[name]
        m, t = cfg.model, cfg.train
        assert m.d_model % 128 == 0 and m.d_model // m.n_heads in (64, 128), name
        assert 0 < m.n_kv_heads < m.n_heads, f"{name}: expected GQA"
        assert 4096 <= cfg.data.seq_len <= 8192 and cfg.data.bpe_vocab_size >= 32000, name
        assert not m.tie_embeddings and t.precision == "bf16", name
        assert t.batch_tokens >= 2**21 and t.batch_tokens % t.micro_batch_tokens == 0, name
        assert t.micro_batch_tokens % cfg.data.seq_len == 0, name
        assert 1e-4 <= cfg.optim.lr <= 5e-4 and cfg.optim.warmup_steps >= 1000, name
        # the length is the planner's: 20 tokens per parameter a token uses (active ones for MoE)
        assert t.max_steps == "auto", name
        planned = make_plan(cfg, hardware=named_gpu("H100")).run_tokens
        assert planned == pytest.approx(20 * model_size(cfg, m.vocab_size or None).compute_params, rel=0.01), name
        assert "not trainable on CPU" in row.description, name


def test_learning_rate_does_not_grow_with_dense_size():
    dense = sorted(
        (r.total, load_config(preset=n).optim.lr)
        for n, r in catalog().items()
        if r.family == "dense" and n in large_presets()
    )
    lrs = [lr for _, lr in dense]
    assert len(lrs) >= 5 and lrs == sorted(lrs, reverse=True)


def test_active_is_below_total_exactly_for_presets_with_experts():
    for name, row in catalog().items():
        if row.family in ("moe", "hybrid"):
            assert row.active < row.total, name
        else:
            assert row.active == row.total, name
    mixtral = catalog()["moe-50b"]  # Mixtral 8x7B: 12.9B of 46.7B active
    assert mixtral.active / mixtral.total == pytest.approx(12.9 / 46.7, rel=0.02)
    largest = catalog()["moe-2.4t"]  # the largest the documents name: 300B active in a 2.4T MoE
    assert largest.total == pytest.approx(2.4e12, rel=0.01) and largest.active == pytest.approx(300e9, rel=0.01)


def test_presets_command_lists_every_preset_by_total(monkeypatch, capsys):
    rows = list(catalog().values())
    assert [r.total for r in rows] == sorted(r.total for r in rows)
    monkeypatch.setattr("trimtab.model.catalog.preset_catalog", lambda: rows)
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["preset", "family", "params", "active", "GFLOP/tok"]
    assert [line.split()[0] for line in lines[1:]] == [r.name for r in rows]
    assert lines[1:] == format_catalog(rows).splitlines()[1:]
    big = next(line for line in lines if line.startswith("moe-300b ")).split()
    assert big[1:3] == ["moe", "316B"]
