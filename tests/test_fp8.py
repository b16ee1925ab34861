"""train.precision fp8 (training/services/float8.py, hardware.choose_precision): refused with its
reason where float8 tensor cores are missing; where allowed, the linear layers train in float8
through torchao (here on the CPU, torchao's emulated float8 matmuls standing in for the GPU's),
checkpoints keep their keys, and a run resumes in either precision."""

import importlib.util
import json

import pytest
import torch

from trimtab import hardware
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.training.loss import cross_entropy_sum
from trimtab.training.services.float8 import to_float8

# torchao imported by the tests that use it, not at collection (2.3 s of CPU in each test worker)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")


def float8_linear() -> type:
    from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415

    return Float8Linear


SETS = ["train.eval_every=0", "log.progress=false", "log.tensorboard=false", "data.max_bytes=150000"]
SETS += ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "optim.warmup_steps=0", "train.log_every=1"]
# torchao's float8 matmul on a CPU is a slow reference (~70 ms a call at 512 tokens): few tokens
SETS += ["data.seq_len=32", "train.batch_tokens=256", "train.micro_batch_tokens=256", "train.eval_tokens=256"]
SETS += ["optim.lr=1e-2"]
FP8 = "train.precision=fp8"


def test_fp8_is_refused_with_the_reason_where_float8_matmuls_are_missing():
    with pytest.raises(ConfigError, match=r"train.precision=fp8: .*8\.9\+.*this is cpu; use bf16"):
        hardware.choose_precision(torch.device("cpu"), "fp8")
    with pytest.raises(ConfigError, match="train.fp8_recipe"):
        load_config(preset="debug", sets=["train.fp8_recipe=blockwise"])
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(preset="debug", sets=["train.precision=fp4"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_linear_layers_train_in_float8_and_keep_their_names(recipe):
    cfg = load_config(preset="debug", sets=[*SETS, "model.vocab_size=256"])
    torch.manual_seed(0)
    plain = build_model(cfg.model)
    fp8 = build_model(cfg.model)
    fp8.load_state_dict(plain.state_dict())
    weights = {n: p for n, p in fp8.named_parameters()}
    swapped = to_float8(fp8, recipe)
    # every attention and feed-forward projection, not the lm head
    assert len(swapped) == 2 * 5 and not any("lm_head" in n for n in swapped)
    assert all(isinstance(fp8.get_submodule(n), float8_linear()) for n in swapped)
    assert type(fp8.lm_head) is torch.nn.Linear
    # the same Parameters under the same names: checkpoints and optimizers are unchanged
    assert {n: p for n, p in fp8.named_parameters()} == weights and fp8.state_dict().keys() == plain.state_dict().keys()

    tokens = torch.randint(0, 256, (4, 32))
    losses = []
    for model in (plain, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy_sum(model.hidden(tokens[:, :-1]), model.lm_head.weight, tokens[:, 1:]) / (4 * 31)
        loss.backward()
        losses.append(loss.item())
    # float8's 3-bit mantissa moves the loss a little, not much
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    for (name, p), q in zip(plain.named_parameters(), fp8.parameters()):
        assert q.grad is not None and torch.isfinite(q.grad).all(), name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.9, (name, cos.item())


def test_a_run_trains_in_fp8_and_resumes_in_bf16(tmp_path, monkeypatch):
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    monkeypatch.setattr(hardware, "fp8_unsupported", lambda device: None)  # the CPU stands in for an sm89+ GPU
    run = {"out": str(tmp_path / "run")}
    # d_model 32: torch's float8 matmul on a CPU (torch._scaled_mm) is a scalar loop, ~0.3 s a call
    # at 256 x 64 x 64 on the 2-core CI host, its time as M*K*N: at 64 the run spent 27 s of CPU,
    # at 32 11 s; lr 2e-2 keeps the smaller model's 4 steps well clear of the 0.3 the loss must fall
    sets = [*SETS, "model.d_model=32", "optim.lr=2e-2"]
    fp8 = Trainer(setup(load_config(preset="debug", overrides=run, sets=[*sets, "train.max_steps=4", FP8])))
    assert fp8.precision.name == "fp8" and fp8.precision.autocast_dtype == torch.bfloat16
    assert sum(isinstance(m, float8_linear()) for m in fp8.model.modules()) == 10
    summary = fp8.fit()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    assert summary["precision"] == "fp8" and "float8" in summary["precision_reason"]

    bf16 = [*sets, "train.max_steps=5", "train.precision=bf16"]
    resumed = Trainer(setup(load_config(preset="debug", overrides=run, sets=bf16)))
    assert resumed.state.step == 4 and not any(isinstance(m, float8_linear()) for m in resumed.model.modules())
    resumed.fit()
