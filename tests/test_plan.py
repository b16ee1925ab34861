"""The Chinchilla planner: `trimtab plan` against hand-computed numbers, and the live planner
through the real loop on the debug preset (one thread, a few seconds a run)."""

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from helpers import StopAt, freeze_heap
from trimtab.checkpoint import list_checkpoints
from trimtab.cli import main
from trimtab.config import derive, load_config, merge
from trimtab.config.plan import PlanConfig
from trimtab.errors import ConfigError
from trimtab.plan import Hardware, LossFit, RunProgress, effective_tokens, fit_loss_curve, live_status, make_plan
from trimtab.plan.curve import format_status, recommend_steps
from trimtab.rundir import read_decisions

# A made-up accelerator: 1 TFLOP/s, 1 GB, bf16 activations (2 bytes): no measurement in the tests.
HW = Hardware(
    name="test", kind="cuda", precision="bf16", peak_flops=1e12, peak_source="test datasheet", memory_bytes=10**9
)

# ------------------------------------------------------------------------------------ the static plan


def test_debug_plan_matches_hand_computed_values():
    # debug: V=512, D=96, 5 layers, 4 heads / 2 KV heads of 24, SwiGLU 256, tied embeddings.
    emb = 512 * 96
    layer = 96 * (4 + 2 * 2) * 24 + 96 * 96 + 3 * 96 * 256 + 2 * 96  # qkv, wo, w1/w2/w3, two norms
    total = emb + 5 * layer + 96  # + final norm
    assert total == 557_088
    plan = make_plan(load_config(preset="debug"), hardware=HW)
    assert (plan.model.total, plan.model.active, plan.model.non_embedding) == (total, total, total - emb)
    assert plan.model.compute_params_kind == "total"
    assert plan.optimal_tokens == plan.tokens == 20 * total == 11_141_760
    assert plan.steps == math.ceil(20 * total / 2048) == 5441
    matmul = 5 * (layer - 2 * 96)  # linear weights only
    fpt = 6 * (matmul + emb) + 12 * 5 * 96 * 64  # 6 x (blocks + lm head) + attention at seq_len 64
    assert plan.model.flops_per_token == fpt == 3_704_832
    assert plan.flops == fpt * 20 * total and plan.flops_6nd == 6 * total * 20 * total
    assert (plan.run_steps, plan.run_tokens) == (100, 100 * 2048)
    # memory: 16 bytes per parameter of model state; activations per token of the 1024-token micro-batch
    m = plan.memory
    assert (m.weights, m.gradients, m.optimizer) == (4 * total, 4 * total, 8 * total)
    norm = 4 * 96 + 4  # fp32 input and 1/rms
    attention = norm + 2 * (3 * 96 + 2 * 48) + 4 * 4  # bf16: qkv input, q, k, v, SDPA out; lse
    ffn = norm + 2 * (96 + 3 * 256)  # bf16: the input cast once, w1, w3, their product
    head = norm + 4 * 96 + 8  # final norm, the fused loss's gradient of its output (no logits), ids
    assert m.activations == 1024 * (5 * (attention + ffn) + head)
    assert m.casts == 2 * (total - emb)  # autocast's bf16 copies of the matmul weights
    assert m.total == 16 * total + m.casts + m.activations and m.fits is True
    assert plan.hours == pytest.approx(plan.flops / (1e12 * 0.46) / 3600)  # the trainer's dense MFU on an H100


def test_moe_plan_uses_active_parameters_and_says_so():
    # debug-moe: layers [dense, moe] x 2, 8 experts of width 128 (256 / top_k 2), top-2.
    dense = 96 * 192 + 96 * 96 + 3 * 96 * 256 + 2 * 96
    moe = 96 * 192 + 96 * 96 + 2 * 96 + 8 * 96 + 3 * 8 * 96 * 128  # router + experts
    total = 512 * 96 + 2 * dense + 2 * moe + 96
    active = total - 2 * 6 * 3 * 96 * 128  # 6 of 8 experts idle per token in each MoE layer
    plan = make_plan(load_config(preset="debug-moe"), dataset_tokens=10**6, hardware=HW)
    assert (plan.model.total, plan.model.active) == (total, active) == (899_424, 457_056)
    assert plan.model.compute_params_kind == "active"
    assert plan.optimal_tokens == 20 * active and plan.optimal_tokens_total_params == 20 * total
    assert plan.steps == math.ceil(20 * active / 2048)
    assert any("ACTIVE parameters" in n and f"{20 * total:,}" in n for n in plan.notes)
    # activations of a MoE layer: the router in fp32 (input, logits, top-2 indices and weights) and,
    # per routed copy (a capacity factor drops some, pads none), its input, SwiGLU, the combined
    # copy, two indices
    m = plan.memory
    norm, attention = 388, 388 + 2 * (3 * 96 + 2 * 48) + 16
    moe = norm + 4 * 96 + 4 * 8 + 12 * 2 + 2 * (2 * 2 * 96 + 3 * 2 * 128 + 16)
    dense = norm + 2 * (96 + 3 * 256)
    per_token = 2 * (2 * attention + dense + moe) + norm + 4 * 96 + 8
    assert m.activations == round(1024 * per_token)


def test_epochs_follow_muennighoff_and_warn_on_repetition():
    cfg = load_config(preset="debug")
    fresh = make_plan(cfg, dataset_tokens=10**7, hardware=HW).data  # 1.1 epochs
    assert fresh.epochs == pytest.approx(11_141_760 / 10**7) and fresh.warnings == []
    assert fresh.effective_tokens == pytest.approx(10**7 + 10**7 * 15.4 * (1 - math.exp(-(fresh.epochs - 1) / 15.4)))

    repeated = make_plan(cfg, dataset_tokens=10**6, hardware=HW)  # 11.1 epochs: worth less, not capped
    d = repeated.data
    assert d.recommended_epochs == d.epochs and repeated.tokens == 11_141_760
    assert len(d.warnings) == 1 and "beyond ~4 epochs" in d.warnings[0]
    worth = effective_tokens(10**6, d.epochs) / (d.epochs * 10**6)
    assert f"~{worth:.0%} fresh" in d.warnings[0] and 0.7 < worth < 0.8

    capped = make_plan(cfg, dataset_tokens=10**5, hardware=HW)  # 111 epochs: bounded to 16
    assert capped.data.recommended_epochs == 16 and capped.tokens == 1_600_000
    assert capped.steps == math.ceil(1_600_000 / 2048) == 782
    assert capped.data.run_epochs == pytest.approx(204_800 / 10**5)
    assert "by ~16 epochs" in capped.data.warnings[0] and "20.0K parameters" in capped.data.warnings[0]
    assert effective_tokens(100, 0.5) == 50 and effective_tokens(100, 1) == 100


def test_budget_mode_splits_compute_and_judges_the_preset():
    cfg = load_config(preset="debug")
    plan = make_plan(cfg, budget_flops=1.2e17, hardware=HW)
    b = plan.budget
    assert b.optimal_params == pytest.approx(math.sqrt(1.2e17 / 120))  # N = sqrt(C / (6 x 20))
    assert b.optimal_tokens == pytest.approx(20 * b.optimal_params)
    assert b.preset_tokens == pytest.approx(1.2e17 / 3_704_832)
    assert b.preset_steps == math.ceil(b.preset_tokens / 2048)
    assert b.hours == pytest.approx(1.2e17 / (1e12 * 0.46) / 3600)
    assert "smaller than compute-optimal" in b.verdict and b.nearest_preset == "dense-25m"
    hours = make_plan(cfg, budget_hours=2, hardware=HW).budget  # 2 h x 3600 s x 1e12 x MFU 0.46
    assert hours.flops == pytest.approx(2 * 3600 * 1e12 * 0.46)
    near = make_plan(cfg, budget_flops=6 * 557_088 * 20 * 557_088, hardware=HW).budget
    assert near.optimal_params == pytest.approx(557_088) and "close to compute-optimal" in near.verdict
    with pytest.raises(ConfigError, match="needs a peak"):
        make_plan(
            cfg,
            budget_hours=1,
            hardware=Hardware(
                name="x", kind="cpu", precision="fp32", peak_flops=None, peak_source="no peak", memory_bytes=None
            ),
        )
    with pytest.raises(ConfigError, match="must be > 0"):
        make_plan(cfg, dataset_tokens=0, hardware=HW)


def test_cli_prints_and_saves_the_plan(tmp_path, capsys):
    out = tmp_path / "plan"
    assert (
        main(
            [
                "plan",
                "--preset",
                "debug-moe",
                "--out",
                str(out),
                "--dataset-tokens",
                "1e6",
                "--gpu",
                "H100",
                "--budget-hours",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "9,141,120 = 20 x 457,056 active parameters" in text and "H100 datasheet" in text
    assert "Budget" in text and f"saved {out / 'plan.json'}" in text
    saved = json.loads((out / "plan.json").read_text())
    assert saved["optimal_tokens"] == 9_141_120 and saved["data"]["dataset_tokens"] == 10**6
    assert saved["hardware"]["peak_flops"] == 989e12 and saved["budget"]["flops"] == pytest.approx(3600 * 989e12 * 0.31)
    assert (out / "plan.txt").read_text().startswith("trimtab plan: preset debug-moe (moe)")
    assert main(["plan", "--preset", "debug", "--out", str(out), "--gpu", "nope"]) == 2
    assert "unknown GPU 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "nosuch"], "--data 'nosuch' does not exist; check the path"),
        (["--data", "nosuch*.txt"], "--data 'nosuch*.txt' matches no file"),
    ],
)
def test_cli_errors_name_the_flags_typed(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)  # nosuch: relative to here
    assert main(["plan", "--preset", "debug", "--out", str(tmp_path / "plan"), "--gpu", "H100", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "data.source" not in err


def test_data_path_estimated_from_bytes_or_counted_with_the_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)  # 10,800 bytes
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run"), "data": {"max_bytes": 0}})
    plan = make_plan(cfg, data_path=str(corpus), hardware=HW)
    # one document: the split holds out its tail, leaving int(0.98 x its tokens) (data/prepared.py hold_out)
    assert plan.data.dataset_tokens == int(10_800 / 4 * 0.98) and "estimated from 10,800 bytes" in plan.data.source

    from trimtab.data import TextTokenizer
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import train_tokenizer

    # a tokenizer that gives tokens: an empty BPE encoded the text to none, the end-of-text alone,
    # which the hold-out takes whole (no training row: the run would refuse the data)
    train_tokenizer([Document([(corpus.read_text(), True)])], 300).save(tmp_path / "tok.json")
    cfg = derive(cfg, {"data": {"tokenizer": str(tmp_path / "tok.json")}})
    counted = make_plan(cfg, data_path=str(corpus), hardware=HW).data
    tok = TextTokenizer.load(tmp_path / "tok.json")
    assert counted.dataset_tokens == int((len(tok.encode(corpus.read_text())) + 1) * 0.98)
    assert "counted with the tokenizer" in counted.source


def test_data_tokenizer_may_be_a_directory_holding_a_tokenizer_json_as_in_training(tmp_path):
    """data.tokenizer as training reads it (data/tokenizer.py: configured_tokenizer): a directory
    holding a tokenizer.json counts the tokens with it; a path that holds none is named, not
    silently estimated from the bytes."""
    from trimtab.data import TextTokenizer
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import train_tokenizer
    from trimtab.errors import DataError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    folder = tmp_path / "tokenizer"
    train_tokenizer([Document([(corpus.read_text(), True)])], 300).save(folder / "tokenizer.json")
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run"), "data": {"max_bytes": 0}})
    counted = make_plan(derive(cfg, {"data": {"tokenizer": str(folder)}}), data_path=str(corpus), hardware=HW).data
    tok = TextTokenizer.load(folder / "tokenizer.json")
    assert counted.dataset_tokens == int((len(tok.encode(corpus.read_text())) + 1) * 0.98)
    assert f"counted with the tokenizer {folder}" in counted.source
    with pytest.raises(DataError, match="data.tokenizer .* is a directory without a tokenizer.json"):
        make_plan(derive(cfg, {"data": {"tokenizer": str(tmp_path)}}), data_path=str(corpus), hardware=HW)


def test_plan_imports_no_training_loop_or_orchestrator():
    root = Path(trimtab.__file__).parent
    names = {
        n.module
        for p in (root / "plan").glob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ImportFrom) and n.module
    }
    assert not [n for n in names if n.startswith("trimtab.orchestrator")]
    assert not [n for n in names if n.startswith("trimtab.training")]  # hardware facts come from trimtab.hardware


# ------------------------------------------------------------------------------------ the loss-curve fit


def test_fit_recovers_a_power_law_and_flags_a_flat_curve():
    tokens = [1e4 * i for i in range(1, 41)]
    fit = fit_loss_curve(tokens, [2.0 + 3.0 * (t / 4e5) ** -0.5 for t in tokens])
    assert (fit.E, fit.B, fit.beta) == pytest.approx((2.0, 3.0, 0.5), rel=1e-6)  # d_ref = 4e5, the last point
    assert fit.r2 == pytest.approx(1.0) and fit.predict(1e5) == pytest.approx(2 + 3 * 0.25**-0.5)
    flat = fit_loss_curve(tokens, [3.0 + 0.01 * (i % 2) for i in range(40)])
    assert flat.B == 0 and flat.r2 == 0 and flat.E == pytest.approx(3.005)


def test_recommended_length_by_hand():
    fit = LossFit(E=2.0, B=1.0, beta=1.0, d_ref=1000.0, r2=1.0, points=20)  # L = 2 + 10 / steps at 100 tok/step
    run = RunProgress(step=30, tokens=3000, total_steps=100, original_steps=100, warmup_steps=0, dataset_tokens=10**4)
    # longest allowed run 150 steps: 2 + 10/150; within 1% of it needs 10 / steps <= 0.0873 -> 115 steps
    assert recommend_steps(fit, run, 100.0, PlanConfig(), lambda s: True) == 115
    loose = PlanConfig(tolerance=0.2)  # anything from 21 steps is within 20%: the floor, 50% of the run
    assert recommend_steps(fit, run, 100.0, loose, lambda s: True) == 50
    assert recommend_steps(fit, run, 100.0, loose, lambda s: s >= 80) == 80  # the LR guard pulls it back
    assert recommend_steps(fit, run, 100.0, PlanConfig(tolerance=0.2, min_change=0.6), lambda s: True) == 100
    # a curve fitted below 0 (an RL objective's): the tolerance is of its size, not a scale that
    # moved the limit below every candidate (StopIteration crashed `trimtab rl`'s live planner);
    # -2 + 10/150 = -1.933, within 1% of its size needs 10 / steps <= 0.0860 -> 117 steps
    below = LossFit(E=-2.0, B=1.0, beta=1.0, d_ref=1000.0, r2=1.0, points=20)
    assert recommend_steps(below, run, 100.0, PlanConfig(), lambda s: True) == 117
    points = [[s, 100 * s, 2 + 10 / s] for s in range(1, 31)]
    status = live_status(points, run, PlanConfig())
    assert (status.recommendation, status.recommended_steps, status.phase) == ("extend", 115, "convergence")
    assert status.token_progress == pytest.approx(0.3) and status.planned_epochs == pytest.approx(1.0)
    assert status.epochs_seen == pytest.approx(0.3)  # 3,000 of the 10,000 tokens: not the planned total
    assert "Epochs: 0.30 of 1.00 planned   Token progress: 30.0%" in format_status(status, adjust=False)
    # convergence: share of the fitted drop from the first point (step 1) to the 150-step run done by step 30
    assert status.convergence == pytest.approx((10 - 10 / 30) / (10 - 10 / 150), rel=0.02)


# ------------------------------------------------------------------------------------ the live planner


def live_cfg(out, steps=40, **plan):
    torch.set_num_threads(1)
    base = {
        "out": str(out),
        # fp32: the fit below is pinned to the numbers; bf16 on CPU rounds differently per machine
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "log_every": 1,
            "batch_tokens": 1024,
            "eval_tokens": 1024,
            "precision": "fp32",
        },
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 6},
        "log": {"progress": False, "tensorboard": False},
        "orchestrator": {"throughput": {"enabled": False}},
        "plan": {"status_every": 15, "min_points": 4},
    }
    return load_config(preset="debug", overrides=merge(base, {"plan": plan}))


def status_lines(run_dir):
    return [json.loads(ln) for ln in (run_dir / "plan_status.jsonl").read_text().splitlines()]


def test_live_status_in_a_real_run(tmp_path, capsys):
    summary = trimtab.train(live_cfg(tmp_path / "r", steps=30))
    assert summary["step"] == summary["total_steps"] == 30  # plan.adjust is off: the length never changes
    err = capsys.readouterr().err
    assert "[step 15] CHINCHILLA STATUS" in err and "[step 30] CHINCHILLA STATUS" in err
    assert "Convergence: " in err and "Phase: " in err and "Recommendation: " in err
    first, last = status_lines(tmp_path / "r")
    assert (first["step"], last["step"]) == (15, 30)
    assert first["token_progress"] == pytest.approx(0.5) and last["token_progress"] == pytest.approx(1.0)
    rows = [json.loads(r) for r in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["step"]: r["tokens"] for r in rows if "loss" in r}
    assert last["tokens"] == tokens[30] == 30 * 1024  # 16 packed rows of 64 a step
    from trimtab.training.phase_data import build_phases

    # the run's own data and tokenizer (setup() would stop: the run is finished)
    _, phases = build_phases(live_cfg(tmp_path / "r", steps=30), tmp_path / "r" / "tokenizer.json")
    dataset = phases[0].train_rows.n_tokens
    assert last["planned_epochs"] == pytest.approx(30 * 1024 / dataset) == first["planned_epochs"]
    assert first["epochs_seen"] == pytest.approx(15 * 1024 / dataset)  # so far, half the planned run
    assert last["epochs_seen"] == pytest.approx(last["planned_epochs"])
    assert f"Epochs: {first['epochs_seen']:.2f} of {first['planned_epochs']:.2f} planned" in err
    assert last["fit"]["points"] == 20 and last["fit"]["r2"] > 0.5  # steps 11..30, after the 10-step warm-up
    assert last["loss_now"] == pytest.approx(LossFit(**last["fit"]).predict(tokens[30]))
    assert [d for d in read_decisions(tmp_path / "r", abandoned=True) if d["rule"] == "convergence"] == []


def test_adjust_shortens_the_run_journals_it_and_resumes_exactly(tmp_path):
    # At step 24 the fit (14 points after warm-up) puts a 34-step run within 10% of the predicted
    # loss of the longest allowed run (60 steps), and a 33-step one outside it.
    cfg = dict(adjust=True, tolerance=0.1, status_every=24, min_points=8)
    summary = trimtab.train(live_cfg(tmp_path / "a", **cfg))
    assert summary["status"] == "completed" and summary["step"] == summary["total_steps"] == 34
    (d,) = [d for d in read_decisions(tmp_path / "a", abandoned=True) if d["rule"] == "convergence"]
    assert (d["step"], d["action"], d["params"], d["mode"]) == (24, "set_total_steps", {"steps": 34}, "auto")
    assert d["applied"] == ["total steps 40 -> 34"] and d["family"] == "length"
    ev, fit = d["evidence"], d["evidence"]["fit"]
    assert d["confidence"] == pytest.approx(round(fit["r2"] * 3 / 4, 3)) and d["confidence"] >= 0.3
    curve = LossFit(**fit)
    assert ev["loss_best"] == pytest.approx(curve.predict(60 * 1024))
    assert curve.predict(33 * 1024) > 1.1 * ev["loss_best"] >= curve.predict(34 * 1024) == ev["loss_recommended"]
    assert "saves the compute" in d["reasoning"]
    line = status_lines(tmp_path / "a")[0]
    assert (line["recommendation"], line["recommended_steps"], line["fit"]["points"]) == ("shorten", 34, 14)
    newest = list_checkpoints(tmp_path / "a")[-1]
    state = json.loads((newest / "state.json").read_text())
    assert newest.name == "step_000034" and state["train"]["length_delta"] == -6
    assert len(state["hooks"]["LivePlanner"]["points"]) == 34

    # Interrupted before the decision and resumed: the same decision, status lines and weights.
    first = trimtab.train(live_cfg(tmp_path / "b", **cfg), hooks=[StopAt(12)])
    assert first["step"] == 12
    again = trimtab.train(live_cfg(tmp_path / "b", **cfg))
    assert again["step"] == again["total_steps"] == 34
    assert read_decisions(tmp_path / "b", abandoned=True) == read_decisions(tmp_path / "a", abandoned=True)
    assert status_lines(tmp_path / "b") == status_lines(tmp_path / "a")
    a, b = (load_file(str(list_checkpoints(tmp_path / r)[-1] / "model.safetensors")) for r in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A finished, shortened run stays finished: the length is in the checkpoint, not the config.
    assert trimtab.train(live_cfg(tmp_path / "a", **cfg)) == json.loads((tmp_path / "a" / "summary.json").read_text())


def test_set_total_steps_checks_its_input(tmp_path):
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    trainer = Trainer(setup(live_cfg(tmp_path / "c", steps=4)))
    for bad in (0, -3, 2.5, "10"):
        with pytest.raises(ConfigError, match="steps"):
            trainer.control.request("set_total_steps", steps=bad)
    trainer.control.request("set_total_steps", steps=9)
    assert trainer.control.apply() == ["total steps 4 -> 9"] and trainer.phases[0].steps == 9
    assert trainer.state.length_delta == 5 and trainer.total_steps == 9
    trainer.state.step = 6
    trainer.control.request("set_total_steps", steps=5)
    assert trainer.control.apply() == ["failed: set_total_steps: 5 would end pretraining before the current step 6"]
    with pytest.raises(ConfigError, match="plan.tolerance"):
        load_config(preset="debug", sets=["plan.tolerance=2"])
    with pytest.raises(ConfigError, match="did you mean 'plan.status_every'"):
        load_config(preset="debug", sets=["plan.status_evry=5"])


def test_time_assumes_the_trainers_measured_mfu_for_the_model_on_gpus_and_plan_mfu_when_set():
    """On a GPU the trainer's MFU measured (BENCHMARKS.md): 46% for a dense model eager (an H100),
    55% compiled, 31% for MoE (an H200), less full checkpointing's re-run (x4/3); plan.mfu when set; on a CPU
    the trainer's there (7% dense), 0.4 on other hardware, each said as assumed. The printed plan says which."""
    from trimtab.plan.report import format_plan

    cpu = dataclasses.replace(HW, kind="cpu")
    for preset, sets, hw, mfu, said in (
        ("debug", [], HW, 0.46, "the trainer's, eager dense, on an H100"),
        ("debug", ["train.compile=true"], HW, 0.55, "compiled dense, on an H200"),
        ("debug-moe", ["train.activation_checkpointing=full"], HW, 0.31 * 3 / 4, "eager moe, on an H200"),
        ("debug-moe", ["plan.mfu=0.5"], HW, 0.5, "plan.mfu"),
        ("debug", [], cpu, 0.07, "ASSUMED, the trainer's on a 1-thread Xeon"),
        ("debug", [], dataclasses.replace(HW, kind="mps"), 0.4, "ASSUMED"),
    ):
        plan = make_plan(load_config(preset=preset, sets=sets), hardware=hw)
        assert plan.mfu == pytest.approx(mfu) and plan.hours == pytest.approx(plan.flops / (1e12 * mfu) / 3600)
        line = next(ln for ln in format_plan(plan).splitlines() if ln.startswith("Time on"))
        assert f"MFU {mfu:.0%}: " in line and said in line, line


def test_a_plan_with_a_layout_times_its_run_and_checkpoints_by_the_layouts_step():
    """On many GPUs the layout's step estimate (communication counted: here 1.4x the step at the
    assumed MFU) is the step the checkpoint interval is whole steps of, and the run's time at it
    is shown beside the assumed-MFU time: one plan, one step."""
    from trimtab.plan.memory import named_gpu
    from trimtab.plan.report import format_plan

    plan = make_plan(load_config(preset="moe-2.4t"), hardware=named_gpu("H200", devices=8192))
    step, assumed = plan.layout.best.step_s, plan.run_hours * 3600 / plan.run_steps
    assert plan.resilience.step_s == step and step > 1.3 * assumed
    assert all(s.interval_s / step == pytest.approx(round(s.interval_s / step)) for s in plan.resilience.strategies)
    days = plan.run_steps * step / 86_400
    assert f"  with the layout {days:.1f} days for the configured run" in format_plan(plan)


def test_a_tensor_parallel_rank_keeps_the_gathered_inputs_whole():
    """Sequence parallelism splits the norms and the residual stream over the tp ranks, but the
    matmuls keep the all-gathered input they read (autocast's casts of it: qkv's, and the one
    w1 and w3 share), and selective checkpointing keeps the row-parallel wo output (w2's is not
    kept: no backward reads it), a partial sum of the whole sequence: whole on every rank.
    Measured with model/recompute.py's measure_kept_bytes on each rank of TP=2 over gloo (debug
    at d_model 256, bf16, a square of the hidden states for the loss: the fused loss's share, its
    input's fp32 gradient, is the same size), 3 times a rank: 31,270 B/token off (4 of 6
    readings; the others 2-13% more: a collective's buffer still alive at the forward's end) and
    17,490 selective (6 of 12 in two runs; 4 were 3% less, 2 up to 18% more), where / tp alone
    counts 28,202 and 15,702."""
    from trimtab.plan.memory import kept_bytes_per_rank, kept_bytes_per_token

    sets = ["model.vocab_size=512", "data.seq_len=64", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=2"]
    cfg = load_config(preset="debug", sets=sets)
    for mode, measured in (("off", 31_270), ("selective", 17_490)):
        per_rank, _ = kept_bytes_per_rank(cfg, 2, mode, 2, fused_norm=False)
        assert per_rank == pytest.approx(measured, rel=0.005), (mode, per_rank)
        assert kept_bytes_per_token(cfg, 2, mode, fused_norm=False)[0] / 2 < 0.95 * measured  # / tp alone: 10% low
    assert kept_bytes_per_rank(cfg, 2, "off", 1) == kept_bytes_per_token(cfg, 2, "off")


@pytest.mark.parametrize(
    "preset, sets, autocast",
    [
        ("debug", [], True),
        ("debug", [], False),
        ("debug", ["model.d_model=256", "model.n_kv_heads=1", "model.n_layers=2"], True),
        ("debug-moe", ["model.moe.capacity_factor=0"], True),
        ("debug-moe", ["model.moe.capacity_factor=0"], False),
        ("debug-moe", [], True),  # capacity factor 1.25: copies dropped, never padded
        ("debug-moe", ["model.moe.capacity_factor=0", "model.moe.n_shared_experts=1"], True),
        ("debug-mod", ["model.mod.warmup_steps=0"], True),
        ("debug-hybrid", ["model.mod.warmup_steps=0"], True),
    ],
)
@pytest.mark.parametrize("checkpointing", ["off", "selective", "full"])
def test_the_activation_estimate_is_what_a_forward_leaves_for_its_backward(preset, sets, autocast, checkpointing):
    """plan/memory.py's bytes per token against what a forward really leaves allocated (a CPU:
    torch's composite RMSNorm, fused_norm=False), within 2% (all 27 within 0.5% when written):
    the estimate had counted 0.59-0.70x of it once (SwiGLU's four saved tensors as three, v's
    view holding the whole qkv output, autocast's two casts of the FFN input, the router's fp32
    copies), and a GPU's measured peaks read that low."""
    from trimtab.model import build_model
    from trimtab.model.recompute import measure_kept_bytes
    from trimtab.plan.memory import kept_bytes_per_token
    from trimtab.training.loss import cross_entropy_sum

    freeze_heap()  # measure_kept_bytes collects garbage 4 times
    cfg = load_config(preset=preset, sets=[*sets, "model.vocab_size=512", "data.seq_len=32"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.set_activation_checkpointing(checkpointing)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return cross_entropy_sum(model.hidden(tokens), model.lm_head.weight, tokens)

    measured = measure_kept_bytes(model, loss, lambda rows: torch.randint(0, 512, (rows, cfg.data.seq_len)))
    estimate, _ = kept_bytes_per_token(cfg, 2 if autocast else 4, checkpointing, fused_norm=False)
    assert estimate == pytest.approx(measured, rel=0.02), (measured, estimate)


def test_plan_durations_past_two_years_read_in_years():
    """A 2.4T preset planned on a CPU once printed "34259303950.0 days"; years to 3 digits read."""
    from trimtab.plan.report import _hours

    assert _hours(100) == "4.2 days"
    assert _hours(24 * 700) == "700.0 days"
    assert _hours(299512.4 * 24) == "820 years"
    assert _hours(34259303950 * 24) == "9.38e+07 years"
