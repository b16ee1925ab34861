"""Models no standard transformers class computes leave through trimtab's own modeling file
(trust_remote_code): Mixture-of-Depths, hybrids, MoE with a selection bias and unequal expert
counts after surgery. Parity against trimtab itself, loaded by transformers offline."""

import ast
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from hf_helpers import TOL, greedy_same, hf_load, max_diff, write_run
from trimtab.config import load_config
from trimtab.hf import export_run
from trimtab.model import build_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
REMOTE = Path(__file__).parent.parent / "src" / "trimtab" / "hf" / "remote"


def model_of(preset, tok, **changes):
    cfg = load_config(preset=preset).model
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, init_std=0.2, max_seq_len=64, **changes)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def decisions(model, vocab):
    """Per MoD layer, the share of tokens its predictor sends through the block."""
    shares = []
    hooks = [
        block.depth.predictor.register_forward_hook(lambda m, i, o: shares.append((o > 0).float().mean().item()))
        for block in model.blocks
        if block.depth is not None
    ]
    with torch.no_grad():
        model(torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    return shares


def remote_export(model, tok, tmp_path):
    out = export_run(write_run(tmp_path / "run", model, tok), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["TrimtabForCausalLM"]
    return hf_load(out, trust_remote_code=True)


@pytest.mark.parametrize("preset", ["debug-mod", "debug-hybrid"])
def test_mixture_of_depths_and_hybrids_leave_with_their_own_function(preset, tokenizer, tmp_path):
    model = model_of(preset, tokenizer)
    shares = decisions(model, tokenizer.vocab_size)
    assert any(0 < s < 1 for s in shares), shares  # some tokens processed, some skipped
    theirs = remote_export(model, tokenizer, tmp_path)
    assert max_diff(model, theirs, tokenizer.vocab_size) <= TOL
    assert greedy_same(model, theirs, tokenizer.vocab_size)


def test_the_export_command_says_how_a_remote_code_model_loads(tokenizer, tmp_path, capsys):
    """`trimtab export` of a MoD model prints the load call with trust_remote_code=True (as
    written without it, transformers refuses), and its tokenizer's through PreTrainedTokenizerFast;
    a dense export's calls have neither."""
    from trimtab.cli import main

    for preset, remote in (("debug-mod", True), ("debug", False)):
        run = write_run(tmp_path / preset, model_of(preset, tokenizer), tokenizer)
        assert main(["export", str(run), "--out", str(tmp_path / f"{preset}-hf")]) == 0
        printed = capsys.readouterr().out
        assert ("from_pretrained(DIR, trust_remote_code=True)" in printed) is remote, printed
        # its tokenizer needs no code: said, else transformers 5 asks "Do you wish to run the custom code?"
        assert ("PreTrainedTokenizerFast.from_pretrained(DIR)" in printed) is remote, printed


def test_moe_after_surgery_with_a_selection_bias_and_a_gated_shared_expert(tokenizer, tmp_path):
    base = load_config(preset="debug-moe").model.moe
    moe_cfg = dataclasses.replace(base, n_shared_experts=1, shared_gate=True, top_k=1)
    model = model_of("debug-moe", tokenizer, attn_bias=True, qk_norm=True, head_dim=48, moe=moe_cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms away from 1 and biases away from 0: a wrong mapping shows
                p.add_(0.3 * torch.randn_like(p))
    layers = model.moe_layers()
    layers[0][1].add_expert(0)  # unequal counts: 9 and 8
    for _, layer in layers:
        layer.expert_bias.copy_(0.05 * torch.randn_like(layer.expert_bias))
        layer.router_temperature = 0.6
    theirs = remote_export(model, tokenizer, tmp_path)
    assert max_diff(model, theirs, tokenizer.vocab_size) <= TOL
    assert greedy_same(model, theirs, tokenizer.vocab_size)
    for _, layer in layers:  # control: the bias steers selection, so dropping it changes the function
        layer.expert_bias.zero_()
        layer.router_temperature = 1.0
    assert max_diff(model, theirs, tokenizer.vocab_size) > 1e-2


def test_the_modeling_files_need_no_trimtab():
    for name in ("modeling_trimtab.py", "configuration_trimtab.py"):
        tree = ast.parse((REMOTE / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not any(m.split(".")[0] == "trimtab" for m in imported), name


def test_a_remote_code_export_imports_back_and_exports_bitwise(tokenizer, tmp_path):
    """The class export uses is one import reads: a surgically changed, biased MoE comes back with
    its expert counts and routing, and goes out again with the same tensors."""
    from safetensors import safe_open

    from trimtab import api

    model = model_of("debug-hybrid", tokenizer)
    layers = model.moe_layers()
    layers[0][1].add_expert(0)
    for _, layer in layers:
        layer.expert_bias.copy_(0.05 * torch.randn_like(layer.expert_bias))
        layer.router_temperature = 0.8
    out = export_run(write_run(tmp_path / "run", model, tokenizer), tmp_path / "hf")
    _, back, _ = api.load_run(out)
    assert [m.n_experts for _, m in back.moe_layers()] == [m.n_experts for _, m in layers]
    with torch.no_grad():
        x = torch.randint(0, tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        assert (back(x) - model(x)).abs().max().item() <= TOL
    again = export_run(write_run(tmp_path / "run2", back, tokenizer), tmp_path / "hf2")
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(again / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


@pytest.mark.parametrize("preset", ["debug-mod", "debug-hybrid"])
def test_left_padded_batched_generation_equals_one_prompt_at_a_time(preset, tokenizer, tmp_path):
    """What lm-eval does at batch size > 1: prompts of unequal length, left-padded, with their
    attention_mask. Each row's logits and greedy text are those of its prompt alone."""
    model = model_of(preset, tokenizer)
    theirs = remote_export(model, tokenizer, tmp_path)
    theirs.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, tokenizer.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 6)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batched = theirs(ids, attention_mask=mask).logits
        out = theirs.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for row, prompt in enumerate(prompts):
            alone = theirs(torch.tensor([prompt])).logits[0]
            assert (batched[row, width - len(prompt) :] - alone).abs().max().item() <= TOL
            assert (model(torch.tensor([prompt]))[0] - alone).abs().max().item() <= TOL
            single = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert out[row, width:].tolist() == single[0, len(prompt) :].tolist(), row


def test_a_remote_code_exports_tokenizer_loads_as_a_standard_one_without_remote_code(tokenizer, tmp_path):
    """Only the model needs trust_remote_code: AutoTokenizer gives transformers' own fast tokenizer
    (the custom config is refused, or not asked for, and the tokenizer never needs it)."""
    remote_export(model_of("debug-mod", tokenizer), tokenizer, tmp_path)
    out = tmp_path / "hf"
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert "AutoTokenizer" not in json.loads((out / "config.json").read_text())["auto_map"]
    text = "def f3(x):\n    return x * 3\n"
    for kw in ({}, {"trust_remote_code": False}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_tok = transformers.AutoTokenizer.from_pretrained(out, **kw)
        assert type(hf_tok).__module__.startswith("transformers.")
        assert hf_tok(text).input_ids == tokenizer.encode(text)
        assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tokenizer.eos_id, tokenizer.pad_id)


def test_the_printed_tokenizer_load_of_a_remote_code_export_warns_nothing(tokenizer, tmp_path, capsys):
    """The tokenizer call `trimtab export` prints for a hybrid, run as printed, loads without
    "You are using a model of type `trimtab`..." (transformers 5's AutoTokenizer with
    trust_remote_code=False falls back to a bare config of the model and warns) and without a
    question; so does AutoTokenizer given the model's own trust_remote_code=True."""
    import logging
    import re

    from trimtab.cli import main

    run = write_run(tmp_path / "run", model_of("debug-hybrid", tokenizer), tokenizer)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    call = re.search(r"its tokenizer with (\w+)\.from_pretrained\(DIR(.*?)\)", capsys.readouterr().out)
    kwargs = dict(kw.split("=") for kw in call.group(2).replace(" ", "").split(",") if kw)
    printed = (getattr(transformers, call.group(1)), {k: v == "True" for k, v in kwargs.items()})
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' logger does not propagate to pytest's caplog
    logging.getLogger("transformers").addHandler(handler)
    try:
        for cls, kw in (printed, (transformers.AutoTokenizer, {"trust_remote_code": True})):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hf_tok = cls.from_pretrained(out, **kw)
            said = [r.getMessage() for r in records] + [str(w.message) for w in caught]
            assert not [m for m in said if "model of type" in m], (cls, kw, said)
            assert hf_tok("def f3(x):").input_ids == tokenizer.encode("def f3(x):")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert "Do you wish to run the custom code" not in capsys.readouterr().out


def test_a_bfloat16_export_runs_at_its_own_dtype(tokenizer, tmp_path):
    """`trimtab export --dtype bfloat16` of a hybrid loads in bfloat16 (transformers' dtype auto),
    and its forward runs: the float32 rotary tables promoted q and k to float32 beside a bfloat16 v,
    which scaled_dot_product_attention refused. Close to the float32 model, as bfloat16 rounding allows."""
    model = model_of("debug-hybrid", tokenizer)
    out = export_run(write_run(tmp_path / "run", model, tokenizer), tmp_path / "hf", dtype="bfloat16")
    theirs = hf_load(out, trust_remote_code=True)
    assert theirs.dtype == torch.bfloat16
    x = torch.randint(0, tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, logits = model(x), theirs(x).logits
    assert logits.dtype == torch.bfloat16
    # mean, not max: a Mixture-of-Depths choice near its threshold may flip under bfloat16 rounding
    assert (logits.float() - ours).abs().mean().item() <= 0.1 * ours.abs().mean().item()
    assert (logits.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.8
