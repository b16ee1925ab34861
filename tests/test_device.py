import pytest
import torch

from trimtab import hardware as hw
from trimtab.errors import ConfigError


def test_cpu_without_native_bf16_trains_in_fp32(monkeypatch):
    monkeypatch.setattr(hw, "cpu_has_native_bf16", lambda: False)
    p = hw.choose_precision(torch.device("cpu"), "auto")
    assert p.name == "fp32" and "no native bf16" in p.reason
    assert p.autocast_dtype is None and p.grad_scaler() is None


def test_cpu_with_bf16_picks_the_faster_measured_dtype(monkeypatch):
    monkeypatch.setattr(hw, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(hw, "_matmul_seconds", lambda dtype, *a, **k: 1.0 if dtype == torch.float32 else 0.5)
    p = hw.choose_precision(torch.device("cpu"), "auto")
    assert p.name == "bf16" and "2.0x faster" in p.reason
    monkeypatch.setattr(hw, "_matmul_seconds", lambda dtype, *a, **k: 0.5 if dtype == torch.float32 else 1.0)
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "fp32"


def test_requested_precision_wins_and_fp16_gets_a_scaler():
    p = hw.choose_precision(torch.device("cpu"), "fp16")
    assert p.name == "fp16" and isinstance(p.grad_scaler(), torch.amp.GradScaler)
    with p.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def test_cuda_request_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device=cuda"):
        hw.pick_device("cuda")


def test_cpu_peak_is_measured():
    flops, source = hw.peak_flops(hw.Precision(torch.device("cpu"), "fp32", ""))
    assert flops > 1e9 and source == "measured CPU matmul peak"
