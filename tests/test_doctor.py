"""`trimtab doctor` on the CPU, and the micro-batch estimate and precision choices behind it."""

import dataclasses
import json
import re

import pytest
import torch

from trimtab import hardware
from trimtab.cli import main
from trimtab.config import load_config
from trimtab.model.catalog import meta_model, model_size
from trimtab.plan import Hardware
from trimtab.plan.memory import USABLE_FRACTION, memory_plan, suggest_micro_batch


def test_doctor_reports_what_a_run_would_choose(capsys):
    assert main(["doctor", "--preset", "debug"]) == 0
    out = capsys.readouterr().out
    chosen = hardware.choose_precision(torch.device("cpu"), "auto")
    if chosen.name == "bf16":  # native bf16: the preset's own step refines it (the test below)
        assert re.search(r"^precision: (bf16|fp32) - .*training step measured", out, re.M), out
    else:  # the reason quotes a ratio measured at each call ("2.5x"): compare it without the figures
        assert re.sub(r"[\d.]+x", "Nx", f"precision: {chosen.name} - {chosen.reason}") in re.sub(r"[\d.]+x", "Nx", out)
    for needle in (
        "torch 2.",
        "device: cpu (",
        "bf16: ",
        "MFU reference: ",
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


@pytest.mark.parametrize(
    "preset, bf16_s, expected", [("debug", 1.5, "fp32"), ("small", 0.5, "bf16"), ("dense-7b", None, "bf16")]
)
def test_doctor_reports_the_precision_the_presets_own_step_chose(monkeypatch, tmp_path, preset, bf16_s, expected):
    """On a CPU with native bf16, train.precision auto times the model's step (cpu_precision.py);
    doctor asks the same question of the preset, so it reports what a run will train in. A preset
    that sets its precision (dense-7b: bf16) is not probed, nor is its 7B model built."""
    from trimtab import doctor
    from trimtab.training.services import cpu_precision

    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path))
    native = hardware.Precision(torch.device("cpu"), "bf16", "CPU (AVX512_BF16) bf16 matmul measured 2.0x faster")
    monkeypatch.setattr(
        cpu_precision,
        "choose_precision",
        lambda dev, asked: native if asked == "auto" else hardware.choose_precision(dev, asked),
    )
    probed = []

    def probe(model, rows, seq_len):
        probed.append(model.num_params())
        return {"fp32_s": 1.0, "bf16_s": bf16_s, "measured": "2026-11-25", "reps": 3}

    monkeypatch.setattr(cpu_precision, "_probe", probe)
    monkeypatch.setattr(doctor, "peak_flops", lambda precision: (1e11, "a test's"))  # not measured: 2 s a dtype
    facts = doctor.collect(preset=preset, device="cpu")
    assert facts["precision"]["choice"] == expected, facts["precision"]["reason"]
    assert len(probed) == (0 if bf16_s is None else 1)


def test_plan_on_a_cpu_plans_the_precision_the_models_step_chose(monkeypatch, tmp_path):
    """`trimtab plan` asks what doctor and a run ask: on a CPU with native bf16 whose `debug` step runs
    slower in bf16, the run trains in fp32, so the plan's peak, activation width (4 bytes) and
    autocast copies (none) are fp32's; it planned bf16 before (2 bytes, copies, a 2.3x higher peak)."""
    from trimtab.plan import memory
    from trimtab.training.services import cpu_precision

    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path))
    native = hardware.Precision(torch.device("cpu"), "bf16", "CPU (AVX512_BF16) bf16 matmul measured 2.0x faster")
    for module in (cpu_precision, memory):
        monkeypatch.setattr(module, "choose_precision", lambda dev, asked: native)
    for module in (hardware, memory):  # the CLI's device and the plan's: a CPU on a GPU machine too
        monkeypatch.setattr(module, "pick_device", lambda *args, **kwargs: torch.device("cpu"))
    step = {"fp32_s": 1.0, "bf16_s": 1.5, "measured": "2026-12-02", "reps": 3}
    monkeypatch.setattr(cpu_precision, "_probe", lambda model, rows, seq_len: step)
    monkeypatch.setattr(memory, "peak_flops", lambda precision: ({"fp32": 1e11, "bf16": 2e11}[precision.name], "test"))
    assert main(["plan", "--preset", "debug", "--out", str(tmp_path / "plan")]) == 0
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert (saved["hardware"]["precision"], saved["hardware"]["peak_flops"]) == ("fp32", 1e11)
    assert (saved["memory"]["activation_bytes"], saved["memory"]["casts"]) == (4, 0)


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
        "layout",
    }
    assert facts["layout"] is None  # no GPU here: `trimtab plan --gpu` proposes one
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


def test_doctor_says_which_checkpointing_lets_a_row_fit(monkeypatch, capsys):
    """dense-1b in 26 GiB of RAM: its model state leaves room for one row only when every block
    recomputes its forward; the doctor says so beside the configured mode's verdict."""
    from trimtab import doctor

    memory = {"ram_total": 32 * 2**30, "ram_available": 26 * 2**30, "gpu_total": None, "gpu_free": None}
    monkeypatch.setattr(doctor, "_memory", lambda dev: memory)
    monkeypatch.setattr(doctor, "peak_flops", lambda precision: (1e11, "a test's"))  # not measured: 2 s a dtype
    assert main(["doctor", "--preset", "dense-1b"]) == 0
    out = capsys.readouterr().out
    assert "one row of 4,096 tokens does NOT fit" in out and "checkpointing off)" in out
    assert re.search(r"by train.activation_checkpointing: off none, selective none, full [\d,]+ tokens", out), out


def test_micro_batch_estimate_grows_with_memory_and_stays_a_whole_number_of_rows():
    cfg = load_config(preset="dense-1b")
    seq = cfg.data.seq_len
    small, large = (suggest_micro_batch(cfg, gb * 2**30, "bf16") for gb in (40, 80))
    assert small.fits and large.tokens > small.tokens and small.tokens % seq == large.tokens % seq == 0
    # plan/memory.py's per-token bytes: the tensors autograd keeps (tests/test_plan.py measures
    # them), fp32 norm inputs and bf16 attention / SwiGLU activations per layer, and at the head the
    # final norm's and the fused loss's gradient of its output (fp32; no logits). Pinned; before
    # they were counted tensor by tensor, 1,503,232 bytes (0.77x: H100's measured peak read 31% over);
    # then 1,945,532, until the model shed three tensors it kept for nothing (model/layers.py).
    assert large.bytes_per_token == 1_506_236 and (small.tokens, large.tokens) == (8192, 32768)
    assert not suggest_micro_batch(cfg, 4 * 2**30, "bf16").fits  # 16 bytes a parameter alone is 16 GiB
    fp32 = suggest_micro_batch(cfg, 80 * 2**30, "fp32")
    # fp32 doubles only the low-precision part: the residual stream and the head's are fp32 anyway
    assert large.bytes_per_token < fp32.bytes_per_token < 2 * large.bytes_per_token and fp32.tokens < large.tokens
    sharded = suggest_micro_batch(cfg, 80 * 2**30, "bf16", world=8, sharded=True)
    casts = 2 * meta_model(cfg).num_params(exclude_embeddings=True)  # autocast's bf16 weights: not under FSDP
    assert sharded.state_bytes == (large.state_bytes - casts) // 8 and sharded.tokens > large.tokens
    ckpt = suggest_micro_batch(cfg, 80 * 2**30, "bf16", checkpointing="full")
    assert ckpt.bytes_per_token < large.bytes_per_token / 4 and ckpt.tokens > 4 * large.tokens
    # selective keeps the matmuls' and attention's outputs: about 0.73x of off (dense-1b), without a second forward
    selective = suggest_micro_batch(cfg, 80 * 2**30, "bf16", checkpointing="selective")
    assert 0.6 < selective.bytes_per_token / large.bytes_per_token < 0.8 and selective.tokens > large.tokens
    tiny = load_config(preset="debug")
    assert suggest_micro_batch(tiny, 64 * 2**30, "fp32").tokens == tiny.train.batch_tokens  # capped


@pytest.mark.parametrize(
    "preset, gib, precision, world, strategy, ckpt",
    [
        ("dense-1b", 40, "bf16", 1, "ddp", "false"),
        ("dense-1b", 40, "bf16", 1, "ddp", "selective"),
        ("dense-1b", 80, "fp32", 1, "ddp", "true"),
        ("dense-7b", 80, "bf16", 8, "fsdp", "true"),
        ("mod-1b", 40, "bf16", 1, "ddp", "false"),
        ("hybrid-100b", 80, "bf16", 64, "fsdp", "true"),
    ],
)
def test_doctor_suggests_the_most_rows_the_plan_says_fit(preset, gib, precision, world, strategy, ckpt):
    """One estimate: `trimtab plan`'s memory total of the suggested micro-batch fits in the usable
    share of the memory, and one more row would not."""
    sets = [f"distributed.strategy={strategy}", f"train.activation_checkpointing={ckpt}"]
    cfg = load_config(preset=preset, sets=[*sets, f"train.precision={precision}"])
    memory, seq = gib * 2**30, cfg.data.seq_len
    advice = suggest_micro_batch(cfg, memory, precision, world=world, sharded=strategy == "fsdp")
    assert advice.fits and advice.tokens < cfg.train.batch_tokens  # not capped: memory is the limit
    hw, params = (
        Hardware(
            name="test",
            kind="cuda",
            precision=precision,
            peak_flops=None,
            peak_source="",
            memory_bytes=memory,
            devices=world,
        ),
        model_size(cfg),
    )

    def planned_total(tokens: int) -> int:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_tokens=tokens))
        return memory_plan(trial, params.total, hw, params.non_embedding).total

    assert planned_total(advice.tokens) <= USABLE_FRACTION * memory < planned_total(advice.tokens + seq)


def test_ampere_gpu_gets_bf16_and_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        p = hardware.choose_precision(torch.device("cuda"), "auto")
        assert p.name == "bf16" and "TF32" in p.reason and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    p = hardware.choose_precision(torch.device("cuda"), "auto")
    assert p.name == "fp16" and "GradScaler" in p.reason


def test_doctor_device_mps_without_mps_is_one_line_and_exit_2(capsys, monkeypatch):
    """`trimtab doctor --device mps` on a machine without MPS: a traceback before; now exit 2 and
    one line naming the flag and the choices."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert main(["doctor", "--device", "mps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trimtab: error: --device=mps ") and "auto, cpu, cuda, mps" in err[0]


def test_doctor_takes_the_runs_set_items_as_train_does(monkeypatch, capsys):
    """`trimtab doctor --set ...` sizes the run a person will launch, not the bare preset (before: argparse
    refused --set, so a run's own micro-batch or checkpointing could not be checked); a bad key is named."""
    import json

    from trimtab import doctor

    monkeypatch.setattr(doctor, "peak_flops", lambda precision: (1e11, "a test's"))  # not measured: 2 s a dtype
    sets = ["--set", "train.micro_batch_tokens=512", "--set", "train.activation_checkpointing=full"]
    assert main(["doctor", "--preset", "debug", "--device", "cpu", "--json", *sets]) == 0
    micro = json.loads(capsys.readouterr().out)["micro_batch"]
    assert micro["configured"] == 512 and micro["checkpointing"] == "full"
    assert main(["doctor", "--preset", "debug", "--device", "cpu", "--set", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err
