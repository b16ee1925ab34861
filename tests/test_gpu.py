"""CUDA-only paths, run where a GPU is (`pytest -m gpu`; skipped without one): bf16 training,
resume, a real out-of-memory error and micro-batch auto-sizing under a memory cap, grouped_mm
experts, the fused loss's memory, torch.compile, and RL's rollouts and steps. Tiny models:
seconds each, the compile aside."""

import gc
import json

import pytest
import torch
import torch.nn.functional as F

import trimtab
from helpers import StopAt
from trimtab.config import load_config
from trimtab.config.sparse import MoEConfig
from trimtab.model.moe import MoE
from trimtab.rundir import read_decisions
from trimtab.training.loss import cross_entropy_sum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
AUTO = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp16"  # pre-Ampere: fp16


def cuda_cfg(out, steps=20, sets=(), preset="debug"):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1, "device": "cuda"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 8},
        "log": {"progress": False, "tensorboard": False},
        # timing-based, so not reproducible: off where a test compares runs
        "orchestrator": {"throughput": {"enabled": False}},
    }
    return load_config(preset=preset, overrides=base, sets=list(sets))


def lines(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged(run_dir, key="loss"):
    return {m["step"]: m[key] for m in lines(run_dir) if key in m}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_cuda_run_trains_in_bf16_learns_and_reports_memory_and_mfu(tmp_path):
    summary = trimtab.train(cuda_cfg(tmp_path / "r", steps=40))
    assert summary["status"] == "completed" and summary["device"].startswith("cuda")
    assert summary["precision"] == AUTO, summary["precision_reason"]
    losses = list(logged(tmp_path / "r").values())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(m["cuda_max_alloc_mb"] > 0 for m in lines(tmp_path / "r") if "loss" in m)
    if "mfu" in summary:  # a GPU in hardware.GPUS: its datasheet peak
        assert 0 < summary["mfu"] < 1


def test_cuda_resume_continues_the_same_run(tmp_path):
    """Stopped at step 7 and resumed, the loss curve is the uninterrupted one: the same rows in the
    same order, the same RNG (CUDA's too) and optimizer state. CUDA's atomics-based kernels (the
    attention and embedding backward) do not add in a fixed order, so this compares to fp32
    rounding rather than bitwise as the CPU test does."""
    sets = ["train.precision=fp32"]
    trimtab.train(cuda_cfg(tmp_path / "a", steps=16, sets=sets))
    first = trimtab.train(cuda_cfg(tmp_path / "b", steps=16, sets=sets), hooks=[StopAt(7)])
    assert first["step"] == 7
    second = trimtab.train(cuda_cfg(tmp_path / "b", steps=16, sets=sets))
    assert second["step"] == 16 and second["steps_this_session"] == 9
    a, b = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert a.keys() == b.keys() and logged(tmp_path / "a", "tokens") == logged(tmp_path / "b", "tokens")
    torch.testing.assert_close(torch.tensor(list(b.values())), torch.tensor(list(a.values())), rtol=1e-4, atol=0)


def _peak_reserved(out, sets) -> int:
    """The peak of a run's steps: two, since the first step's peak comes before AdamW's moments
    exist and every later step carries them (a cap calibrated on one step let step 2 run out)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trimtab.train(cuda_cfg(out, steps=2, sets=sets))
    return torch.cuda.max_memory_reserved()


def _train_capped(cap_bytes: float, cfg) -> dict:
    """trimtab.train(cfg) with this process's CUDA memory capped at `cap_bytes` (lifted after)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap_bytes / torch.cuda.get_device_properties(0).total_memory)
    try:
        return trimtab.train(cfg)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_a_real_cuda_oom_halves_the_micro_batch_until_the_step_fits(tmp_path):
    """train.micro_batch_tokens 0 (auto) under a memory cap the whole batch exceeds and a quarter
    of it fits (set_per_process_memory_fraction, calibrated from two uncapped runs): the
    allocator's own OutOfMemoryError reaches the orchestrator, which halves the micro-batch and
    retries the same rows until the step fits, and the run completes."""
    batch = 65536
    sets = [f"train.batch_tokens={batch}", "train.eval_tokens=4096", "train.precision=fp32", "data.max_bytes=2000000"]
    whole = _peak_reserved(tmp_path / "whole", [*sets, f"train.micro_batch_tokens={batch}"])
    quarter = _peak_reserved(tmp_path / "quarter", [*sets, f"train.micro_batch_tokens={batch // 4}"])
    assert whole > 1.5 * quarter, (whole, quarter)  # the cap below separates them
    run = tmp_path / "capped"
    summary = _train_capped((whole + quarter) / 2, cuda_cfg(run, steps=4, sets=[*sets, "train.micro_batch_tokens=0"]))
    assert summary["status"] == "completed"
    ds = [d for d in read_decisions(run) if d["rule"] == "oom"]
    assert ds and ds[0]["step"] == 1 and "out of memory" in str(ds[0]["evidence"]).lower(), ds
    settled = set(logged(run, "micro_batch_tokens").values())
    assert len(settled) == 1 and batch // 4 <= settled.pop() < batch, settled


def test_a_real_cuda_oom_at_one_row_turns_on_selective_checkpointing(tmp_path):
    """A row of 4,096 tokens of a 512-wide model, under a cap between its step's peak with
    checkpointing off and with selective (calibrated from two uncapped runs): the orchestrator
    cannot halve one row, so it recomputes more (selective), retries the same row, and the run
    completes at one row."""
    seq = 4096
    sets = [f"data.seq_len={seq}", f"model.max_seq_len={seq}", "model.d_model=512", "model.n_heads=8"]
    sets += [f"train.batch_tokens={2 * seq}", f"train.micro_batch_tokens={seq}", f"train.eval_tokens={seq}"]
    sets += ["data.max_bytes=2000000", "train.precision=bf16"]
    off = _peak_reserved(tmp_path / "off", sets)
    selective = _peak_reserved(tmp_path / "selective", [*sets, "train.activation_checkpointing=selective"])
    assert off > 1.2 * selective, (off, selective)  # the cap below separates them
    run = tmp_path / "capped"
    summary = _train_capped((off + selective) / 2, cuda_cfg(run, steps=4, sets=sets))
    assert summary["status"] == "completed", summary["status"]
    ds = [d for d in read_decisions(run) if d["rule"] == "oom"]
    assert [(d["action"], d["params"]) for d in ds] == [("set_activation_checkpointing", {"mode": "selective"})], ds


@pytest.mark.skipif(AUTO != "bf16" or torch.cuda.get_device_capability() < (8, 0), reason="grouped_mm needs sm80+")
@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_grouped_experts_match_padded_on_cuda_in_bf16(capacity_factor):
    """impl auto takes grouped_mm on CUDA in bf16 autocast; it computes what the padded bmm layout
    does (outputs and gradients to bf16 rounding), dropless and with a capacity."""
    torch.manual_seed(0)
    m = MoE(256, 128, MoEConfig(n_experts=16, top_k=4, capacity_factor=capacity_factor)).cuda()
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    g = torch.randn(4, 128, 256, device="cuda")
    got = {}
    for impl in ("auto", "padded"):
        m.impl, x.grad = impl, None
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert m.grouped_layout(x.flatten(0, 1)) == (impl == "auto")
            y = m(x)
        (y.float() * g).sum().backward()
        got[impl] = (y.detach().float(), x.grad, m.w1.grad, m.w2.grad, m.router.grad)
    for name, a, b in zip(("y", "x.grad", "w1.grad", "w2.grad", "router.grad"), got["auto"], got["padded"]):
        assert rel_err(a, b) < 1e-2, name


def test_moe_trains_on_cuda(tmp_path):
    summary = trimtab.train(cuda_cfg(tmp_path / "r", steps=30, preset="debug-moe"))
    assert summary["status"] == "completed" and summary["precision"] == AUTO
    losses = list(logged(tmp_path / "r").values())
    assert losses[-1] < losses[0] - 0.5, losses


def _peak_above_now(f):
    """f()'s result and the most CUDA memory it allocated beyond what was allocated before."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = f()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(AUTO != "bf16", reason="bf16 autocast, as trained on this GPU's class")
def test_fused_loss_matches_the_plain_loss_and_keeps_no_logits_on_cuda():
    """bf16 autocast as in training, 16,384 tokens x a 32,000 vocabulary: the plain loss keeps
    [N, V] logits and log-probabilities (2 GB in fp32 alone); the fused loss, whose forward takes
    the gradients chunk by chunk, peaks at a fraction of that, forward and backward together
    (in 1,024-token chunks here; CUDA's default chunk is larger, for speed: chunk_tokens)."""
    torch.manual_seed(0)
    N, D, V = 16384, 512, 32000
    hidden = torch.randn(1, N, D, device="cuda", requires_grad=True)
    head = (0.02 * torch.randn(V, D, device="cuda")).requires_grad_()
    targets = torch.randint(0, V, (1, N), device="cuda")
    targets[0, :100] = -100

    def plain():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = F.linear(hidden, head)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        return loss.detach(), torch.autograd.grad(loss, (hidden, head))

    def fused():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_sum(hidden, head, targets, chunk=1024)
        return loss.detach(), torch.autograd.grad(loss, (hidden, head))

    (ref, ref_grads), plain_peak = _peak_above_now(plain)
    (got, grads), fused_peak = _peak_above_now(fused)
    assert rel_err(got, ref) < 1e-3
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) < 2e-2
    assert fused_peak < plain_peak / 4 and fused_peak < N * V * 4 / 2, (fused_peak / 2**20, plain_peak / 2**20)


def test_compiled_cuda_training_matches_eager(tmp_path):
    eager = trimtab.train(cuda_cfg(tmp_path / "e", steps=8, sets=["train.compile=false"]))
    compiled = trimtab.train(cuda_cfg(tmp_path / "c", steps=8, sets=["train.compile=true"]))
    assert compiled["status"] == "completed" and compiled["compile"]["enabled"] and not eager["compile"]["enabled"]
    assert compiled["compile"]["cold_start_s"] > 0
    a, b = logged(tmp_path / "e"), logged(tmp_path / "c")
    torch.testing.assert_close(torch.tensor(list(b.values())), torch.tensor(list(a.values())), rtol=2e-2, atol=0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="float8 needs sm89+"
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_on_cuda_alongside_bf16(tmp_path, recipe):
    """The same 40 steps in bf16 and in float8: both learn, and fp8's curve stays near bf16's
    (float8's 3-bit mantissa: a few percent, not a different run)."""
    pytest.importorskip("torchao.float8")
    sets = ["model.d_model=256", "model.n_heads=4", "model.n_layers=2"]
    bf16 = trimtab.train(cuda_cfg(tmp_path / "bf16", steps=40, sets=[*sets, "train.precision=bf16"]))
    fp8_sets = [*sets, "train.precision=fp8", f"train.fp8_recipe={recipe}"]
    fp8 = trimtab.train(cuda_cfg(tmp_path / "fp8", steps=40, sets=fp8_sets))
    assert bf16["status"] == fp8["status"] == "completed" and fp8["precision"] == "fp8"
    a, b = logged(tmp_path / "bf16"), logged(tmp_path / "fp8")
    assert b[40] < b[1] - 0.5, b
    late = [abs(a[s] - b[s]) / a[s] for s in range(31, 41)]
    assert max(late) < 0.05, late
    assert read_decisions(tmp_path / "fp8") == []  # the orchestrator saw nothing to heal


def test_rl_rollouts_on_cuda_are_the_cpus_and_an_rl_run_trains_there(tmp_path, monkeypatch):
    """RL on a GPU (issue 35): a ragged batch's greedy rollouts on CUDA (SDPA in every decoding
    step; the CPU decodes in its own products) are the CPU's tokens with the same behaviour
    log-probabilities, in fp32; then `trimtab rl` runs its steps on CUDA in bf16, rewards scored by
    the verifier pool, the figures logged."""
    from test_rl_rollout import EOS, PROMPTS, model
    from trimtab.cli import main
    from trimtab.rl.rollout import generate

    # fp32 as the CPU computes it: a CUDA run turns TF32 on for the process (hardware.py)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cpu = model([])
    on_cpu = generate(cpu, PROMPTS, 12, EOS, temperature=0.0)
    on_gpu = generate(cpu.cuda(), PROMPTS, 12, EOS, temperature=0.0)
    assert [r.tokens for r in on_gpu] == [r.tokens for r in on_cpu]
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    base = tmp_path / "base"
    assert trimtab.train(cuda_cfg(base, steps=2))["status"] == "completed"
    sets = ["rl.reward=python:rl_verifiers:starts_with_space", "rl.prompts_per_step=8", "rl.group_size=8"]
    sets += ["rl.max_new_tokens=4", "rl.held_out=8", "train.eval_every=4", f"train.init_from={base}"]
    sets += ["train.device=cuda", "log.progress=false", "train.log_every=1"]
    argv = ["rl", "--preset", "debug", "--out", str(tmp_path / "rl"), "--max-steps", "4"]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    rl = [m for m in lines(tmp_path / "rl") if "rl/reward" in m]
    assert [m["step"] for m in rl] == [1, 2, 3, 4] and all(m["rl/verifier_failures"] == 0 for m in rl)
    assert any("rl/held_out_pass@1" in m for m in lines(tmp_path / "rl"))
