"""train.compile: auto compiles only a run long enough to repay the compile; the summary
reports the cold start paid."""

import pytest
import torch

from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.training.services.compiling import (
    COLD_START_S,
    MARGIN,
    SPEEDUP,
    TYPICAL_MFU,
    CompileChoice,
    StepTimes,
    choose_compile,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def steps_to_repay(kind: str, step_flops: float, peak: float) -> float:
    """Steps whose saved time equals MARGIN cold starts, from the module's own constants."""
    step_s = step_flops / (peak * TYPICAL_MFU[kind])
    return MARGIN * COLD_START_S[kind] / (step_s * (1 - 1 / SPEEDUP[kind]))


@pytest.fixture
def toolchain(monkeypatch):
    """As on a machine with inductor's compilers (this one may lack Triton for CUDA)."""
    monkeypatch.setattr("trimtab.training.services.compiling.missing_toolchain", lambda kind: "")


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_auto_compiles_exactly_the_runs_long_enough_to_repay_it(kind, toolchain):
    device, flops, peak = torch.device(kind), 6e15, 1e15  # about 10 s a step at 50%-ish MFU
    n = steps_to_repay(kind, flops, peak)
    short, long = (
        choose_compile("auto", device, int(n * 0.9), flops, peak),
        choose_compile("auto", device, int(n * 1.1) + 1, flops, peak),
    )
    assert not short.enabled and short.reason.endswith("eager")
    assert long.enabled and long.reason.endswith("compiled")
    assert f"{int(n * 1.1) + 1} steps" in long.reason  # the arithmetic is in the log line


def test_a_1b_model_on_an_h100_compiles_and_the_small_preset_on_a_cpu_does_not(toolchain):
    dense_1b = choose_compile("auto", CUDA, 20_000, 65_536 * 6 * 1.1e9, 989e12)
    assert dense_1b.enabled
    small = load_config(preset="small")
    # the README's main job: small's 200 steps of 8,192 tokens at 28.7 MFLOPs a token, on the
    # 2-core CPUs measured (bf16 peak 351 GFLOP/s; fp32 about 100): eager on both
    step_flops = small.train.batch_tokens * 28_704_768
    for peak in (351e9, 100e9):
        assert not choose_compile("auto", CPU, small.train.max_steps, step_flops, peak).enabled
    assert small.train.compile == "auto"


def test_explicit_choice_wins_and_unknowns_stay_eager():
    assert choose_compile("true", CPU, 1, 1.0, None) == CompileChoice(True, "train.compile=true")
    assert not choose_compile("false", CUDA, 10**9, 1e18, 1e15).enabled
    assert not choose_compile("auto", CUDA, 10**9, 1e18, None).enabled  # an unknown GPU: no estimate
    mps = choose_compile("auto", torch.device("mps"), 10**9, 1e18, 1e15)
    assert not mps.enabled and "not measured on mps" in mps.reason


def test_auto_stays_eager_without_the_compiler_inductor_needs(monkeypatch):
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"include": "/nowhere"})
    assert "no Python.h" in choose_compile("auto", CPU, 10**9, 1e18, 1e11).reason
    monkeypatch.undo()
    monkeypatch.setattr("shutil.which", lambda name: None)
    choice = choose_compile("auto", CPU, 10**9, 1e18, 1e11)
    assert not choice.enabled and "no C++ compiler" in choice.reason
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # Triton there, no C compiler
    assert "no C compiler" in choose_compile("auto", CUDA, 10**9, 1e18, 1e15).reason
    assert choose_compile("true", CPU, 1, 1.0, None).enabled  # asked for: torch says what is missing


def test_config_reads_booleans_and_rejects_other_values():
    assert load_config(preset="debug", sets=["train.compile=true"]).train.compile == "true"
    assert load_config(preset="debug", overrides={"train": {"compile": False}}).train.compile == "false"
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(preset="debug", sets=["train.compile=sometimes"])


def test_step_times_report_the_cold_start_over_the_first_steps():
    times = StepTimes()
    for s in [31.0, 1.0, 1.2, 0.8] + [5.0] * 20:  # steps past the window do not count
        times.add(s)
    got = times.summary(CompileChoice(True, "train.compile=true"))
    assert got["first_step_s"] == 31.0 and got["steady_step_s"] == 5.0  # median of steps 2-11
    assert got["cold_start_s"] == 26.0
    assert StepTimes().summary(CompileChoice(False, "x"))["cold_start_s"] is None


def test_the_cold_start_is_never_negative():
    """Issue #30: summary.json's cold_start_s was first - median on eager runs too, as often below 0 as not."""
    times = StepTimes()
    for s in [0.07, 0.08, 0.09, 0.08]:  # an eager run: the first step is not the slowest
        times.add(s)
    eager = times.summary(CompileChoice(False, "auto: eager"))
    assert eager["cold_start_s"] is None and eager["first_step_s"] == 0.07 and eager["steady_step_s"] == 0.08
    assert times.summary(CompileChoice(True, "train.compile=true"))["cold_start_s"] == 0.0  # recompiles in the window


def _grads(model, forward, tokens) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = forward(tokens)
    aux = model.aux_loss()  # the MoE and MoD layers' losses, recorded inside the checkpoint
    (out.square().mean() + (0 if aux is None else aux)).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def layer_records_traced(monkeypatch):
    """As train.compile sets it for debug-hybrid (distributed/wrapping.py), restored after."""
    from trimtab.distributed.wrapping import prepare_block_compile
    from trimtab.model import build_model

    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    prepare_block_compile(build_model(load_config(preset="debug-hybrid", sets=["model.vocab_size=512"]).model))


@pytest.mark.parametrize("mode", ["off", "selective", "full"])
def test_every_layer_kind_compiles_block_by_block_with_eager_gradients(mode, layer_records_traced):
    """train.compile compiles each block on its own (distributed/wrapping.py), its activation
    checkpoint inside it. fullgraph=True raises at any graph break; aot_eager traces forward and
    backward as inductor would but runs them eagerly (seconds, not a CPU compile's minute).
    debug-hybrid holds every layer kind: dense, MoE, MoD and MoE+MoD."""
    from trimtab.model import build_model

    cfg = load_config(preset="debug-hybrid", sets=["model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.set_activation_checkpointing(mode)
    tokens = torch.randint(0, 512, (2, 64))
    eager_out, eager = _grads(model, model.hidden, tokens)
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    compiled_out, compiled = _grads(model, model.hidden, tokens)
    torch.testing.assert_close(compiled_out, eager_out)
    for name, grad in compiled.items():  # the MoD predictors' zero gradients exist only compiled
        torch.testing.assert_close(grad, eager.get(name, torch.zeros_like(grad)), msg=name)
    assert eager.keys() <= compiled.keys()


def test_a_compiled_block_keeps_what_selective_checkpointing_keeps_eager(layer_records_traced):
    """The checkpoint is traced inside each compiled block, with its policy: the activations a
    training forward keeps per token are eager's. A checkpoint around a compiled block saw no
    ops to keep (inductor: 9.2 KB a token kept against eager's 28.5 on `small`; aot_eager 9% off)."""
    from trimtab.model import build_model
    from trimtab.model.recompute import measure_kept_bytes
    from trimtab.training.loss import model_loss

    cfg = load_config(preset="debug", sets=["model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    tokens = torch.randint(0, 512, (8, 65))

    def kept() -> dict[str, float]:
        out = {}
        for mode in ("off", "selective", "full"):
            model.set_activation_checkpointing(mode)
            out[mode] = measure_kept_bytes(model, lambda t: model_loss(model, t, None), lambda n: tokens[:n])
        return out

    eager = kept()
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    compiled = kept()
    assert compiled["full"] < compiled["selective"] < compiled["off"]
    assert compiled["selective"] == pytest.approx(eager["selective"], rel=0.01), (compiled, eager)


def test_train_compile_compiles_each_block_not_the_whole_stack(layer_records_traced):
    """One process: every block compiled on its own (blocks of a kind share their code: a deep
    model compiles in a shallow one's time), model.hidden itself eager."""
    from trimtab.distributed.parallel import Parallel
    from trimtab.model import build_model

    cfg = load_config(preset="debug", sets=["model.vocab_size=512"])
    model = build_model(cfg.model)
    fn = Parallel.start(cfg.distributed, CPU).wrap(model, True, None)
    assert fn == model.hidden
    assert all(block._compiled_call_impl is not None for block in model.blocks)


def compile_counting(model) -> list:
    """Compile `model`'s blocks with a backend that runs each graph eager and lists it: the
    list of every graph compiled from then on."""
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend=counting)
    return graphs


def test_generation_through_compiled_blocks_stays_eager():
    """A KV cache's forward (rollouts, samples) changes its shapes and cache position every step:
    compiled, each block recompiled up to torch.compile's limit and fell back (41 recompiles for
    16 tokens of debug-hybrid). Block.decode runs it eager: no graph, the same tokens."""
    from trimtab.model import build_model
    from trimtab.rl.rollout import generate

    cfg = load_config(preset="debug-hybrid", sets=["model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    prompts = [[5, 9, 12], [7, 1, 3, 44, 2, 8, 19], [100, 200]]
    eager = generate(model, prompts, 12, 0, temperature=0, record_routing=True)
    graphs = compile_counting(model)
    compiled = generate(model, prompts, 12, 0, temperature=0, record_routing=True)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    assert [r.logprobs for r in compiled] == [r.logprobs for r in eager]
    assert graphs == []


def test_every_kind_of_block_stays_compiled_through_modes_evaluation_and_generation(layer_records_traced):
    """Each kind of block holds its own compiled entries of the one Block.forward (training,
    evaluation, each checkpointing mode): debug-hybrid's four kinds outgrew torch.compile's
    default 8 in training and evaluation alone, and later modes ran eager. prepare_block_compile
    sizes the limit to the kinds: a mode set last (an OOM's) still compiles, in every kind."""
    from trimtab.model import build_model
    from trimtab.rl.rollout import generate
    from trimtab.training.loss import model_loss

    cfg = load_config(preset="debug-hybrid", sets=["model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    graphs = compile_counting(model)
    tokens = torch.randint(0, 512, (2, 33))
    for mode in ("off", "selective"):
        model.set_activation_checkpointing(mode)
        model_loss(model, tokens, None).backward()
        with torch.no_grad():
            model_loss(model.eval(), tokens, None)
        model.train()
    generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 4, 0, temperature=0)
    before = len(graphs)
    model.set_activation_checkpointing("full")
    model_loss(model, tokens, None).backward()
    assert len(graphs) - before >= len(set(cfg.model.layers)), "a kind of block ran the full mode eager"


def test_a_compiled_run_through_the_trainer_compiles_every_block_and_trains_as_eager(tmp_path, monkeypatch):
    """trimtab.train with train.compile=true, debug-hybrid (every kind of block) under selective
    checkpointing: each block is compiled (aot_eager here: inductor's CPU build costs ~15 s a
    run), the summary says so, and the loss curve is the eager run's to fp32 rounding."""
    import json

    import trimtab
    from helpers import assert_close, config
    from trimtab.model.transformer import Block

    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    compiled = []
    compile_ = torch.nn.Module.compile

    def as_aot_eager(block, *args, **kwargs):
        compiled.append(block)
        compile_(block, backend="aot_eager")

    monkeypatch.setattr(Block, "compile", as_aot_eager)
    torch._dynamo.reset()
    curves = {}
    for flag in ("false", "true"):
        sets = [f"train.compile={flag}", "train.activation_checkpointing=selective", "train.max_steps=4"]
        summary = trimtab.train(load_config(preset="debug-hybrid", overrides=config(tmp_path / flag), sets=sets))
        assert summary["status"] == "completed" and summary["compile"]["enabled"] == (flag == "true")
        rows = [json.loads(line) for line in (tmp_path / flag / "metrics.jsonl").read_text().splitlines()]
        curves[flag] = [row["loss"] for row in rows if "loss" in row]
    assert len(compiled) == load_config(preset="debug-hybrid").model.n_layers
    assert len(curves["true"]) == 4
    assert_close(curves["true"], curves["false"])  # 1e-4: aot_eager's decompositions round apart (3e-5 by step 4)
