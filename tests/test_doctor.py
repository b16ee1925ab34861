"""`trimtab doctor` on the CPU, and the micro-batch estimate and precision choices behind it."""

import json

import torch

from trimtab.cli import main
from trimtab.config import load_config
from trimtab.training import device as dev


def test_doctor_reports_what_a_run_would_choose(capsys):
    assert main(["doctor", "--preset", "debug"]) == 0
    out = capsys.readouterr().out
    chosen = dev.choose_precision(torch.device("cpu"), "auto")
    assert f"precision: {chosen.name} - {chosen.reason}" in out
    for needle in (
        "torch 2.",
        "device: cpu (",
        "bf16: ",
        "attention: SDPA picks ",
        "optimizer: AdamW fused",
        "memory: RAM ",
        "distributed: ",
        "gloo",
        "torchrun --nproc_per_node",
        "micro-batch for preset 'debug': ~2,048 tokens",
        "--set train.micro_batch_tokens=2048",
    ):
        assert needle in out, (needle, out)


def test_doctor_json_holds_every_fact(capsys):
    assert main(["doctor", "--preset", "small", "--json", "--nproc", "2", "--strategy", "fsdp"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == {
        "versions",
        "device",
        "precision",
        "attention",
        "fused_adamw",
        "memory",
        "distributed",
        "micro_batch",
    }
    assert (
        facts["device"]["name"] == "cpu" and facts["distributed"]["gloo"] and facts["distributed"]["default"] == "gloo"
    )
    assert facts["attention"]["backend"] in ("flash_attention", "math", "efficient_attention")
    assert facts["memory"]["ram_total"] > 0 and facts["memory"]["gpu_total"] is None
    mb = facts["micro_batch"]
    assert mb["processes"] == 2 and mb["strategy"] == "fsdp" and mb["fits"] and mb["tokens"] % 256 == 0


def test_doctor_names_the_fsdp_size_of_a_model_that_does_not_fit(capsys):
    assert main(["doctor", "--preset", "dense-7b"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "FSDP over" in out


def test_micro_batch_estimate_grows_with_memory_and_stays_a_whole_number_of_rows():
    cfg = load_config(preset="dense-1b")
    seq = cfg.data.seq_len
    small, large = (dev.suggest_micro_batch(cfg, gb * 2**30, "bf16") for gb in (40, 80))
    assert small.fits and large.tokens > small.tokens and small.tokens % seq == large.tokens % seq == 0
    assert not dev.suggest_micro_batch(cfg, 4 * 2**30, "bf16").fits  # 16 bytes a parameter alone is 19 GiB
    fp32 = dev.suggest_micro_batch(cfg, 80 * 2**30, "fp32")
    assert fp32.bytes_per_token == 2 * large.bytes_per_token and fp32.tokens < large.tokens
    sharded = dev.suggest_micro_batch(cfg, 80 * 2**30, "bf16", world=8, sharded=True)
    assert sharded.state_bytes < large.state_bytes / 4 and sharded.tokens > large.tokens
    ckpt = dev.suggest_micro_batch(cfg, 80 * 2**30, "bf16", checkpointing=True)
    assert ckpt.bytes_per_token < large.bytes_per_token / 5
    tiny = load_config(preset="debug")
    assert dev.suggest_micro_batch(tiny, 64 * 2**30, "fp32").tokens == tiny.train.batch_tokens  # capped


def test_ampere_gpu_gets_bf16_and_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        p = dev.choose_precision(torch.device("cuda"), "auto")
        assert p.name == "bf16" and "TF32" in p.reason and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    p = dev.choose_precision(torch.device("cuda"), "auto")
    assert p.name == "fp16" and "GradScaler" in p.reason
