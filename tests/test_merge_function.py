"""trimtab merge refuses inputs whose weights compute different functions or whose tokenizers give
other ids (the output would take the first input's tokenizer and config), naming both inputs, the
setting and its two values; settings that change neither (a run's training hyper-parameters, the
length bound, the dtype) do not block a merge."""

import json
import warnings

import pytest
import torch
import yaml

from hf_helpers import llama_style_tokenizer, write_run
from trimtab import api
from trimtab.config.model import ModelConfig
from trimtab.config.sparse import MoEConfig
from trimtab.errors import ConfigError
from trimtab.merge import merge
from trimtab.model import build_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (tiny HF models)")
# one worker for the module (--dist loadgroup): its module-scoped run and Llama are made once, not on each worker
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("test_merge_function")]
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000}}
TRAIN = {"max_steps": 2, "eval_every": 0}


def linear(*paths):
    return {"merge_method": "linear", "models": [{"model": str(p)} for p in paths]}


def refused(paths, tmp_path, setting, first, second):
    """merge(paths) raises naming both inputs, `setting` and its two values."""
    a, b = (str(p) for p in paths)
    message = f"{a} and {b} are not one architecture with one tokenizer: {setting} is {first} in {a}, {second} in {b}"
    with pytest.raises(ConfigError) as caught:
        merge(linear(*paths), tmp_path / "out")
    assert message in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step `debug` run (its BPE trained on the first 150 kB of the builtin corpus)."""
    root = tmp_path_factory.mktemp("runs")
    api.train(preset="debug", out=str(root / "a"), train=TRAIN, **FAST)
    return root / "a"


# ---- trimtab runs -------------------------------------------------------------------------------


def test_runs_with_other_tokenizers_of_one_vocabulary_size_are_refused(run, tmp_path):
    """(a) Another corpus gives another BPE of the same size: the shapes agree, the ids do not."""
    other = tmp_path / "other"
    api.train(preset="debug", out=str(other), train=TRAIN, **{**FAST, "data": {"max_bytes": 60000}})
    vocab_a, vocab_b = (json.loads((r / "tokenizer.json").read_text())["model"]["vocab"] for r in (run, other))
    assert len(vocab_a) == len(vocab_b) and vocab_a != vocab_b  # the bug's case: one size, other ids
    token = next(t for t in vocab_a if vocab_a[t] != vocab_b.get(t))  # the first id that differs
    refused((run, other), tmp_path, f"tokenizer['model']['vocab'][{token!r}]", vocab_a[token], vocab_b.get(token))


def test_runs_that_differ_only_in_training_settings_merge(run, tmp_path):
    """Optimizer, schedule, step count and seed change the weights, not what they compute."""
    other = tmp_path / "other"
    optim = {"lr": 1e-2, "weight_decay": 0.0, "warmup_steps": 1}
    api.train(preset="debug", out=str(other), train={**TRAIN, "max_steps": 3, "seed": 4}, optim=optim, **FAST)
    cfg_a, cfg_b = (yaml.safe_load((r / "config.yaml").read_text()) for r in (run, other))
    assert cfg_a["optim"]["lr"] != cfg_b["optim"]["lr"] and cfg_a["train"]["max_steps"] != cfg_b["train"]["max_steps"]
    out = merge(linear(run, other), tmp_path / "merged")
    a, b, m = (api.load_run(r)[1].state_dict() for r in (run, other, out))
    for name in m:
        assert torch.allclose(m[name], (a[name] + b[name]) / 2, atol=1e-7), name


@pytest.mark.parametrize(
    ("change", "setting", "first", "second"),
    [
        ({"mod_capacity": 0.25}, "Mixture-of-Depths capacity['1']", 0.5, 0.25),
        ({"router_temperature": 0.5}, "router_temperature['1']", 1.0, 0.5),
        ({"cfg": {"moe": {"top_k": 1}}}, "model.moe.top_k", 2, 1),
        ({"capacity_factor": 2.0, "balance_coef": 0.1}, None, None, None),  # training-only knobs: merges
        (
            {"cfg": {"max_seq_len": 128, "init_std": 0.05, "moe": {"router_jitter": 0.1, "z_loss_coef": 0.0}}},
            None,
            None,
            None,
        ),
    ],
)
def test_live_router_and_depth_settings_count(run, tmp_path, change, setting, first, second):
    """Run directories whose MoE / Mixture-of-Depths knobs (live, from the checkpoint: the
    orchestrator changes them) or model config differ with the tensors' shapes alike."""
    tok = api.load_run(run)[2]
    widths = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "ffn_hidden": 64}
    base = {"vocab_size": tok.vocab_size, **widths, "layer_pattern": ["dense", "moe+mod"], "max_seq_len": 64}
    paths = []
    for name, edit in (("a", {}), ("b", change)):
        cfg = {**base, **edit.get("cfg", {})}
        moe = MoEConfig(**{"n_experts": 4, "top_k": 2, "expert_hidden": 32, **cfg.pop("moe", {})})
        torch.manual_seed(0)
        model = build_model(ModelConfig(**cfg, moe=moe))
        (_, router), (_, layer) = model.mod_layers()[0], model.moe_layers()[0]
        router.target = edit.get("mod_capacity", router.target)
        for knob in ("router_temperature", "capacity_factor", "balance_coef"):
            setattr(layer, knob, edit.get(knob, getattr(layer, knob)))
        paths.append(write_run(tmp_path / name, model, tok))
    if setting is None:
        merge(linear(*paths), tmp_path / "out")
    else:
        refused(paths, tmp_path, setting, first, second)


# ---- Hugging Face directories -------------------------------------------------------------------


def _save(path, config_class, model_class, tok, **fields):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_class(config_class(**fields)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


LLAMA = {
    "vocab_size": 320, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 1e4, "rms_norm_eps": 1e-6,
}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return _save(
        root / "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, llama_style_tokenizer(), **LLAMA
    )


@pytest.mark.parametrize(
    ("change", "setting", "first", "second"),
    [
        # (c) the reported pair: norm eps is the first difference named, then rope_theta alone
        ({"rope_theta": 5e5, "rms_norm_eps": 1e-2}, "model.norm_eps", 1e-6, 0.01),
        ({"rope_theta": 5e5}, "model.rope_theta", 10000.0, 500000.0),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "model.rope_scaling['type']", "'none'", "'linear'"),
        ({"tie_word_embeddings": True}, "model.tie_embeddings", False, True),
        # 8 heads of 2 and 4 KV heads: q, k and v of the same shapes as 4 heads of 4 and 2 KV heads
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 2}, "model.n_heads", 4, 8),
    ],
)
def test_llamas_computing_other_functions_are_refused(llama, tmp_path, change, setting, first, second):
    other = _save(
        tmp_path / "other",
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        llama_style_tokenizer(),
        **{**LLAMA, **change},
    )
    refused((llama, other), tmp_path, setting, first, second)


def test_llamas_differing_in_length_bound_and_dtype_merge(llama, tmp_path):
    """max_position_embeddings only bounds the length; the dtype is the file's, not the function's."""
    tok = llama_style_tokenizer()
    other = _save(tmp_path / "o", transformers.LlamaConfig, transformers.LlamaForCausalLM, tok, **LLAMA)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128, "dtype": "bfloat16"}))
    assert api.load_run(merge(linear(llama, other), tmp_path / "out"))[0].model.max_seq_len == 64


def test_mixtrals_with_other_top_k_are_refused(tmp_path):
    """(b) Top-2 and top-1 routing over the same experts: one set of tensors, two functions."""
    mixtral = {
        **{k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rms_norm_eps")},
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    tok = llama_style_tokenizer()
    args = (transformers.MixtralConfig, transformers.MixtralForCausalLM, tok)
    top2 = _save(tmp_path / "top2", *args, **mixtral)
    top1 = _save(tmp_path / "top1", *args, **{**mixtral, "num_experts_per_tok": 1})
    refused((top2, top1), tmp_path, "model.moe.top_k", 2, 1)
