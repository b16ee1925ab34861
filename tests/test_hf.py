"""Hugging Face interop: export to transformers classes and import from them, measured against
transformers itself (tiny random models built locally, no hub), fp32, |logit difference| <= 1e-4."""

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors import safe_open

from trimtab import api
from trimtab.checkpoint import save_checkpoint
from trimtab.config import RunConfig, dump_config, load_config
from trimtab.data.sources import Document
from trimtab.data.tokenizer import TextTokenizer, _train_bpe
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf import export_run
from trimtab.model import build_model
from trimtab.sampling import generate

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000}}
TOL = 1e-4


def hf_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def max_diff(ours, theirs, vocab, seed=0):
    x = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(x) - theirs(x).logits).abs().max().item()


def greedy_same(ours, theirs, vocab, n=32):
    prompt = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1)).tolist()[0]
    mine = generate(ours, prompt, n, temperature=0, top_k=0, top_p=1.0)
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return mine == out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step `debug` run (dense)."""
    out = tmp_path_factory.mktemp("hf") / "run"
    api.train(preset="debug", out=str(out), train={"max_steps": 3, "eval_every": 0}, **FAST)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    docs = [Document([(f"def f{i}(x):\n    return x * {i}\n", True)]) for i in range(200)]
    return TextTokenizer(_train_bpe(docs, 300))


def write_run(path, model, tok, step=0):
    """A run directory holding `model` as checkpoint `step` (what training would leave)."""
    cfg = RunConfig(model=model.cfg, out=str(path))
    cfg.data.seq_len = min(cfg.data.seq_len, model.cfg.max_seq_len)
    path.mkdir(parents=True)
    dump_config(cfg, path / "config.yaml")
    tok.save(path / "tokenizer.json")
    state = {"moe": model.moe_state(), "mod": model.mod_state(), "tokens": 0}
    save_checkpoint(path, step, model.state_dict(), {}, state, keep=1)
    return path


def moe_model(tok, pattern=("dense", "moe"), **moe):
    """A random debug-moe-shaped model (init_std 0.2: confident logits for greedy decoding)."""
    cfg = load_config(preset="debug-moe").model
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, init_std=0.2, max_seq_len=64, layer_pattern=list(pattern))
    cfg.moe = dataclasses.replace(cfg.moe, expert_hidden=0, **moe)
    torch.manual_seed(0)
    return build_model(cfg).eval()


# ---- export ---------------------------------------------------------------------------------


def test_a_dense_run_exports_as_llama_with_its_tokenizer_and_card(trained, tmp_path):
    out = export_run(trained, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    cfg, model, tok = api.load_run(trained)
    theirs = hf_load(out)
    assert max_diff(model, theirs, cfg.model.vocab_size) <= TOL
    assert greedy_same(model, theirs, cfg.model.vocab_size)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    return 42  # ünïcode"
    assert hf_tok(text).input_ids == tok.encode(text)
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (tok.eos_id, tok.pad_id, None)
    assert hf_tok.model_max_length == cfg.model.max_seq_len
    card = (out / "README.md").read_text()
    assert "LlamaForCausalLM" in card and "tokens seen" in card and "decisions" in card
    assert "final validation loss" in card


def test_export_a_chosen_step_in_bfloat16_and_in_shards(trained, tmp_path):
    out = export_run(trained, tmp_path / "hf", step=0, dtype="bfloat16", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    with safe_open(str(out / shards[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    theirs = hf_load(out, dtype=torch.float32)
    weights = api.load_run(trained)[1]  # newest; step 0 differs from it
    step0 = build_model(weights.cfg)
    from trimtab.checkpoint import load_model

    load_model(step0, trained / "checkpoints" / "step_000000")
    bf16 = theirs.model.embed_tokens.weight
    assert torch.equal(bf16, step0.tok_emb.weight.to(torch.bfloat16).float())
    with pytest.raises(CheckpointError, match="no checkpoint at step 7"):
        export_run(trained, tmp_path / "other", step=7)


def test_export_refuses_to_overwrite_what_is_not_an_export(trained, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an exported model"):
        export_run(trained, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("pattern", "moe", "arch"),
    [
        (["moe"], {"top_k": 2}, "MixtralForCausalLM"),  # all MoE, renormalised top-2
        (["dense", "moe"], {"top_k": 1, "n_shared_experts": 1}, "Qwen2MoeForCausalLM"),  # raw top-1, ungated shared
        (["moe", "dense"], {"top_k": 2}, "Qwen2MoeForCausalLM"),  # dense layers interleaved, no shared expert
    ],
)
def test_moe_exports_to_the_class_with_its_function_with_the_live_router_folded_in(
    tokenizer, tmp_path, pattern, moe, arch
):
    model = moe_model(tokenizer, pattern, **moe)
    for _, layer in model.moe_layers():  # what the orchestrator and surgery leave behind
        layer.router_temperature = 1.7
        layer.add_expert(0)
    out = export_run(write_run(tmp_path / "run", model, tokenizer), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    theirs = hf_load(out)
    assert max_diff(model, theirs, tokenizer.vocab_size) <= TOL
    assert greedy_same(model, theirs, tokenizer.vocab_size)
    for _, layer in model.moe_layers():  # control: without the temperature the function differs
        layer.router_temperature = 1.0
    assert max_diff(model, theirs, tokenizer.vocab_size) > 1e-2
