"""training.services.cpu_precision: train.precision auto keeps bf16 on a CPU only where the model's own
training step measured faster in it."""

import pytest
import torch

from trimtab.config import load_config
from trimtab.hardware import Precision
from trimtab.model import build_model
from trimtab.training.services import cpu_precision as cp


def _cfg(precision="auto", **model):
    sets = [f"train.precision={precision}", "model.vocab_size=64", "data.seq_len=16", "train.micro_batch_tokens=32"]
    sets += [f"model.{k}={v}" for k, v in model.items()]
    return load_config(preset="debug", sets=sets)


BF16 = Precision(torch.device("cpu"), "bf16", "CPU (AVX512_BF16) bf16 matmul measured 2.0x faster")


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """Replace the probe with canned seconds; count its calls."""
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path))
    calls = []

    def fake(model, rows, seq_len):
        calls.append((rows, seq_len))
        return {"fp32_s": timings.fp32, "bf16_s": timings.bf16, "measured": "2026-11-25", "reps": 3}

    monkeypatch.setattr(cp, "_probe", fake)
    timings.calls = calls
    return timings


def test_bf16_kept_where_the_step_is_faster_and_dropped_where_it_is_not(timings):
    cfg = _cfg()
    model = build_model(cfg.model)
    timings.fp32, timings.bf16 = 1.5, 1.0
    kept = cp.refine_cpu_precision(BF16, cfg, model)
    assert kept.name == "bf16" and "1.50x in bf16 autocast" in kept.reason
    assert timings.calls == [(2, 16)]  # a micro-batch's rows (32 tokens / 16), at its sequence length

    other = _cfg(d_model=64)  # another shape: probed again; a slower bf16 step gives fp32
    timings.fp32, timings.bf16 = 1.0, 1.3
    dropped = cp.refine_cpu_precision(BF16, other, build_model(other.model))
    assert dropped.name == "fp32" and "0.77x" in dropped.reason and "under 1.1x" in dropped.reason
    assert dropped.autocast_dtype is None


def test_the_answer_is_cached_per_model_shape(timings):
    cfg = _cfg()
    timings.fp32, timings.bf16 = 1.0, 1.05  # within the margin: fp32
    first = cp.refine_cpu_precision(BF16, cfg, build_model(cfg.model))
    timings.fp32, timings.bf16 = 9.0, 1.0  # a new probe would now say bf16: the cache answers
    again = cp.refine_cpu_precision(BF16, cfg, build_model(cfg.model))
    assert first.name == again.name == "fp32" and len(timings.calls) == 1
    cp.cpu_precision_path().write_text("{not json")  # a corrupt cache is measured again, not an error
    assert cp.refine_cpu_precision(BF16, cfg, build_model(cfg.model)).name == "bf16"
    assert len(timings.calls) == 2


def test_no_probe_unless_auto_on_a_cpu_that_chose_bf16_and_a_small_model(timings, monkeypatch):
    timings.fp32 = timings.bf16 = 1.0
    cfg = _cfg()
    model = build_model(cfg.model)
    fp32 = Precision(torch.device("cpu"), "fp32", "no native bf16")
    assert cp.refine_cpu_precision(fp32, cfg, model) is fp32
    asked = _cfg(precision="bf16")
    bf16 = Precision(torch.device("cpu"), "bf16", "train.precision=bf16 (set in config)")
    assert cp.refine_cpu_precision(bf16, asked, build_model(asked.model)) is bf16
    monkeypatch.setattr(cp, "PROBE_MAX_PARAMS", 1000)  # a large model: matmul-bound, bf16 kept
    large = cp.refine_cpu_precision(BF16, cfg, model)
    assert large.name == "bf16" and "matmul-bound" in large.reason
    assert timings.calls == []


def test_the_probe_times_a_copy_and_leaves_model_and_rng_untouched():
    cfg = _cfg(d_model=32, n_layers=1, n_heads=2)
    model = build_model(cfg.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    entry = cp._probe(model, rows=1, seq_len=8)
    assert entry["fp32_s"] > 0 and entry["bf16_s"] > 0 and entry["reps"] == cp.PROBE_REPS
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_run_keeps_the_precision_it_was_trained_in(timings):
    cfg = _cfg()
    timings.fp32, timings.bf16 = 1.0, 2.0  # a probe now would say fp32
    kept = cp.refine_cpu_precision(BF16, cfg, build_model(cfg.model), saved="bf16")
    assert kept.name == "bf16" and "checkpoint" in kept.reason and timings.calls == []
    fp32 = Precision(torch.device("cpu"), "fp32", "no native bf16")  # moved to a CPU without bf16
    assert cp.refine_cpu_precision(fp32, cfg, build_model(cfg.model), saved="bf16") is fp32


def test_the_trainer_saves_its_precision_and_a_resume_reuses_it(tmp_path, monkeypatch):
    from trimtab import hardware
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)  # bf16 matmuls 2x: a bf16 candidate
    monkeypatch.setattr(hardware, "matmul_seconds", lambda dtype, *a, **k: 1.0 if dtype == torch.float32 else 0.5)
    monkeypatch.setattr(cp, "_probe", lambda *a: {"fp32_s": 1.0, "bf16_s": 2.0, "measured": "x", "reps": 3})
    sets = ["train.eval_every=0", "log.progress=false", "log.tensorboard=false", "data.max_bytes=150000"]
    sets += ["model.d_model=32", "model.n_layers=1", "model.n_heads=2"]
    run = {"out": str(tmp_path / "run")}
    first = Trainer(setup(load_config(preset="debug", overrides=run, sets=[*sets, "train.max_steps=2"])))
    assert first.precision.name == "fp32"  # the model's step measured slower in bf16
    first.fit()
    monkeypatch.setattr(cp, "_probe", lambda *a: {"fp32_s": 2.0, "bf16_s": 1.0, "measured": "x", "reps": 3})
    cp.cpu_precision_path().unlink()  # a new probe would now say bf16
    resumed = Trainer(setup(load_config(preset="debug", overrides=run, sets=[*sets, "train.max_steps=3"])))
    assert resumed.state.step == 2
    assert resumed.precision.name == "fp32" and "checkpoint" in resumed.precision.reason
