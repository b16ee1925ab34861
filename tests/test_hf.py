"""Hugging Face interop: export to transformers classes and import from them, measured against
transformers itself (tiny random models built locally, no hub), fp32, |logit difference| <= 1e-4."""

import dataclasses
import json
import logging
import warnings

import pytest
import torch
from safetensors import safe_open

from hf_helpers import TOL, greedy_same, hf_load, llama_style_tokenizer, max_diff, write_run
from trimtab import api
from trimtab.cli import main
from trimtab.config import load_config
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf import export_run
from trimtab.model import build_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step `debug` run (dense)."""
    out = tmp_path_factory.mktemp("hf") / "run"
    api.train(preset="debug", out=str(out), train={"max_steps": 3, "eval_every": 0}, **FAST)
    return out


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
    assert "LlamaForCausalLM" in card and "decisions" in card
    tokens = json.loads((trained / "summary.json").read_text())["tokens"]
    assert tokens > 0 and f"- steps: 3; tokens seen: {tokens:,}\n" in card  # it said 0 for every run
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
    from trimtab.checkpoint_load import load_model

    load_model(step0, trained / "checkpoints" / "step_000000")
    bf16 = theirs.model.embed_tokens.weight
    assert torch.equal(bf16, step0.tok_emb.weight.to(torch.bfloat16).float())
    with pytest.raises(CheckpointError, match="no checkpoint at step 7"):
        export_run(trained, tmp_path / "other", step=7)


def test_export_refuses_to_overwrite_what_is_not_an_export(trained, tmp_path, capsys):
    """A directory with a config.json trimtab did not write is not an earlier export: the CLI
    refuses it (exit 2, naming the directory and the fix) and deletes nothing."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", str(trained), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and "not an exported model" in err and "new or empty directory" in err
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_run(trained, tmp_path / "file")


def test_a_re_export_replaces_only_the_files_the_earlier_export_wrote(trained, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine
    export_run(trained, out, max_shard_bytes=100_000)
    written = set(json.loads((out / "trimtab_export.json").read_text())["files"])
    assert {"config.json", "model.safetensors.index.json", "trimtab_export.json"} <= written
    assert written == {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("keep me")
    assert main(["export", str(trained), "--out", str(out)]) == 0  # one shard now: the numbered ones go
    names = {p.name for p in out.iterdir()}
    assert "notes.txt" in names and "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert not any(n.startswith("model-0") for n in names)
    assert (out / "notes.txt").read_text() == "keep me"
    assert set(json.loads((out / "trimtab_export.json").read_text())["files"]) == names - {"notes.txt"}
    assert not list(tmp_path.glob(".tmp_*"))
    hf_load(out)


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


# ---- import ---------------------------------------------------------------------------------

SMALL = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
SMALL.update(num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3.update(high_freq_factor=4.0, original_max_position_embeddings=16)
ARCHS = {
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mixtral-top1": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 1}),
    "mixtral-top2": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0]}
        | {"shared_expert_intermediate_size": 24, "norm_topk_prob": False},
    ),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, tokenizer):
    """A Llama-style tokenizer saved by transformers: <s> / </s>, no pad token, no trimtab specials."""
    fast = llama_style_tokenizer()
    path = tmp_path_factory.mktemp("hf-tok")
    fast.save_pretrained(path)
    return path


def hf_model(name, path, tok_dir, dtype=torch.float32):
    """A tiny random transformers model of ARCHS[name], saved with its tokenizer into path."""
    cls, extra = ARCHS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**SMALL, **extra, bos_token_id=0, eos_token_id=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
        model.save_pretrained(path)
    for file in tok_dir.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    return model


@pytest.mark.parametrize("name", list(ARCHS))
def test_each_architecture_imports_with_the_same_logits(name, tmp_path, hf_tokenizer):
    theirs = hf_model(name, tmp_path / "hf", hf_tokenizer)
    cfg, ours, tok = api.load_run(tmp_path / "hf")
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL
    assert tok.vocab_size == 300 and tok.eos_id == 1 and tok.pad_id == 1  # as is: no pad token added


@pytest.mark.parametrize(
    ("name", "dtype"), [("llama3", torch.float32), ("qwen2-moe", torch.float32), ("qwen3", torch.bfloat16)]
)
def test_import_train_export_round_trip_is_bitwise_and_finetunes(name, dtype, tmp_path, hf_tokenizer):
    """init_from a Hugging Face directory, train, export: step 0 (the weights before any update)
    comes back with the original files' tensors bit for bit, in their dtype; the trained step
    loads in transformers with the run's own function."""
    hf_model(name, tmp_path / "hf", hf_tokenizer, dtype)
    run = tmp_path / "run"
    data = {"max_bytes": 40000, "seq_len": 32}
    train = {"max_steps": 2, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
    summary = api.train(
        preset="debug", out=str(run), train={**train, "init_from": str(tmp_path / "hf")}, log=FAST["log"], data=data
    )
    assert summary["step"] == 2
    assert json.loads((run / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    back = export_run(run, tmp_path / "back", step=0)
    with (
        safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(back / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    assert json.loads((back / "config.json").read_text())["architectures"] == [
        ARCHS[name][0].replace("Config", "ForCausalLM")
    ]
    trained = export_run(run, tmp_path / "trained")
    _, ours, _ = api.load_run(run)
    assert max_diff(ours, hf_load(trained, dtype=torch.float32), SMALL["vocab_size"]) <= (
        TOL if dtype == torch.float32 else 0.05
    )


def test_a_qwen2_model_is_rl_trained_and_exported_back(tmp_path, hf_tokenizer):
    """`trimtab rl` from a Hugging Face directory (a tiny random Qwen2, tied embeddings, its own
    tokenizer: </s> ends a response), then `trimtab export`: transformers loads the trained
    policy with our logits, and it has moved from the imported weights."""
    from helpers import trimtab_cli

    hf_model("qwen2", tmp_path / "hf", hf_tokenizer)
    run = tmp_path / "rl"
    args = [
        "rl",
        "--preset",
        "debug",
        "--out",
        str(run),
        "--max-steps",
        "3",
        "--set",
        f"train.init_from={tmp_path / 'hf'}",
    ]
    args += ["--set", "rl.prompts_per_step=4", "--set", "rl.group_size=4", "--set", "rl.max_new_tokens=4"]
    args += ["--set", "rl.reward=python:rl_verifiers:starts_with_space", "--set", "rl.held_out=8"]
    args += ["--set", "optim.lr=1e-2", "--set", "optim.warmup_steps=0", "--set", "log.progress=false"]
    args += ["--set", "train.log_every=1"]
    done = trimtab_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "rl/reward" in m] == [1, 2, 3]
    done = trimtab_cli(["export", str(run), "--out", str(tmp_path / "back")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = hf_load(tmp_path / "back", dtype=torch.float32)
    _, ours, _ = api.load_run(run)
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL
    assert max_diff(ours, hf_load(tmp_path / "hf", dtype=torch.float32), SMALL["vocab_size"]) > 1e-3  # it trained


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"my_new_trick": 3}, "my_new_trick"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field(change, field, tmp_path, hf_tokenizer):
    hf_model("llama3", tmp_path, hf_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        api.load_run(tmp_path)
    assert main(["generate", str(tmp_path), "--max-new-tokens", "2"]) == 2


def test_a_file_that_disagrees_with_its_config_is_refused_naming_the_tensor(tmp_path, hf_tokenizer):
    from safetensors.torch import load_file, save_file

    hf_model("llama3", tmp_path, hf_tokenizer)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.extra.weight'"):
        api.load_run(tmp_path)
    del weights["model.layers.0.extra.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        api.load_run(tmp_path)


CHAT = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)


def test_chat_data_uses_the_imported_tokenizers_template_and_trains_on_replies_only(tmp_path, hf_tokenizer):
    from trimtab.config import DataConfig
    from trimtab.data import read_documents

    hf_model("qwen2", tmp_path / "hf", hf_tokenizer)
    settings = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) | {"chat_template": CHAT}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(settings))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4?"},
        {"role": "assistant", "content": "9"},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": messages}) for _ in range(50)) + "\n")
    tok = api.load_run(tmp_path / "hf")[2]
    [doc, *_], _ = read_documents(DataConfig(source=str(data), format="chat"), chat=tok.chat)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        messages, tokenize=False
    )
    assert doc.text == reference  # rendered as transformers renders it
    assert [text for text, trainable in doc.segments if trainable] == ["5</s>\n", "9</s>\n"]
    run = tmp_path / "run"
    train = {"max_steps": 2, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
    api.train(
        preset="debug",
        out=str(run),
        train={**train, "init_from": str(tmp_path / "hf")},
        log=FAST["log"],
        data={"source": str(data), "format": "chat", "seq_len": 32, "eval_fraction": 0.1},
    )
    exported = export_run(run, tmp_path / "back")
    back = transformers.AutoTokenizer.from_pretrained(exported)
    assert back.apply_chat_template(messages, tokenize=False) == reference  # the template goes with it


def test_chat_data_with_a_tokenizer_without_template_is_refused_naming_the_line(tmp_path, hf_tokenizer):
    from trimtab.config import DataConfig
    from trimtab.data import read_documents
    from trimtab.errors import DataError

    hf_model("qwen2", tmp_path / "hf", hf_tokenizer)
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    tok = api.load_run(tmp_path / "hf")[2]
    for skip in (False, True):  # the tokenizer's fault, not the record's: skipping would skip them all
        with pytest.raises(
            DataError, match=r"chat.jsonl:1: a chat record, and the tokenizer has no chat template"
        ) as e:
            read_documents(DataConfig(source=str(data), format="chat", skip_bad_records=skip), chat=tok.chat)
        assert "skip" not in str(e.value)


def test_moe_experts_in_transformers_5_fused_layout_import_too(tmp_path, hf_tokenizer):
    """Some files hold each layer's experts fused (experts.gate_up_proj [E, 2H, D], experts.down_proj
    [E, D, H]) as transformers 5 keeps them in memory: the same model either way."""
    from safetensors.torch import load_file, save_file

    theirs = hf_model("qwen2-moe", tmp_path, hf_tokenizer)
    weights = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1.mlp.experts."
    per_expert = [{n: weights.pop(f"{prefix}{e}.{n}_proj.weight") for n in ("gate", "up", "down")} for e in range(4)]
    weights[prefix + "gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in per_expert])
    weights[prefix + "down_proj"] = torch.stack([w["down"] for w in per_expert])
    save_file(weights, tmp_path / "model.safetensors")
    assert max_diff(api.load_run(tmp_path)[1], theirs, SMALL["vocab_size"]) <= TOL


def test_a_corrupt_newest_checkpoint_exports_the_one_before_and_a_chosen_one_is_refused(
    trained, tmp_path, caplog, capsys
):
    """The one exported is named on the success line (beside the warning, it was not: generate
    and eval said theirs)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    newest = run / "checkpoints" / "step_000003" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF  # a flipped bit: same size, other checksum
    newest.write_bytes(bytes(data))
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert f"exported {run} (checkpoint step 0) to {tmp_path / 'hf'}" in capsys.readouterr().out
    assert "steps: 0;" in (tmp_path / "hf" / "README.md").read_text()  # step 0, the valid one
    with pytest.raises(CheckpointError, match="checksum differs"):
        export_run(run, tmp_path / "hf3", step=3)
    assert not (tmp_path / "hf3").exists()
    with caplog.at_level(logging.WARNING):  # generate and eval load the same one; the loader said which, once
        api.load_run(run)
    said = [r.getMessage() for r in caplog.records if "step_000003" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(f"falling back to {run}/checkpoints/step_000000 (step 0)")


def test_a_chat_trained_run_exports_its_chat_template(trained, tmp_path):
    from trimtab.config import DataConfig
    from trimtab.data import read_documents

    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": messages}) for _ in range(200)) + "\n")
    run = tmp_path / "run"
    train = {"max_steps": 2, "eval_every": 0}
    api.train(preset="debug", out=str(run), train=train, log=FAST["log"], data={"source": str(data), "format": "chat"})
    out = export_run(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    [doc, *_], _ = read_documents(DataConfig(source=str(data), format="chat"))
    assert hf_tok.apply_chat_template(messages, tokenize=False) == doc.text  # the format it learned
    prompt = hf_tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == doc.text[: doc.text.index("5")]
    end = hf_tok.convert_tokens_to_ids("<|end|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [hf_tok.eos_token_id, end]
    plain = export_run(trained, tmp_path / "plain")  # trained on code, not chats: no template
    assert "chat_template" not in json.loads((plain / "tokenizer_config.json").read_text())


def test_hugging_face_models_merge_into_a_run_that_exports_back_to_their_class(tmp_path, hf_tokenizer):
    from trimtab.merge import merge

    a, b = (hf_model("qwen2", tmp_path / name, hf_tokenizer) for name in ("a", "b"))
    recipe = {"merge_method": "linear", "models": [{"model": str(tmp_path / "a")}, {"model": str(tmp_path / "b")}]}
    out = export_run(merge(recipe, tmp_path / "merged"), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    theirs = hf_load(out)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(theirs.get_parameter(name), (p + q) / 2, atol=1e-6), name


def test_an_imported_run_resumes_after_its_source_directory_is_gone(tmp_path, hf_tokenizer):
    import shutil

    hf_model("llama3", tmp_path / "hf", hf_tokenizer)
    run = tmp_path / "run"
    train = {"max_steps": 2, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
    kwargs = {"preset": "debug", "out": str(run), "log": FAST["log"], "data": {"max_bytes": 40000, "seq_len": 32}}
    api.train(train={**train, "init_from": str(tmp_path / "hf")}, **kwargs)
    shutil.rmtree(tmp_path / "hf")
    summary = api.train(train={**train, "max_steps": 4, "init_from": str(tmp_path / "hf")}, **kwargs)
    assert summary["step"] == 4


def test_documents_begin_with_an_imported_tokenizers_start_token_once(tmp_path, hf_tokenizer):
    from trimtab.config import DataConfig
    from trimtab.data.packing import tokenize_documents
    from trimtab.data.sources import Document

    hf_model("llama3", tmp_path / "hf", hf_tokenizer)
    tok = api.load_run(tmp_path / "hf")[2]
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    rendered = "<s>user: hi</s>\n"  # as a chat template writes it: its markup (the specials it writes)
    docs = [
        Document([("def f(x):\n    return x\n", True)]),
        Document([(rendered, False), ("yo", True)], markup=((0, len(rendered)),)),
    ]
    out = tokenize_documents(docs, tok, DataConfig())
    first, second = (out.tokens[out.offsets[i] : out.offsets[i + 1]].tolist() for i in range(2))
    assert first[0] == 0 and first.count(0) == 1 and first[-1] == 1  # bos added, eos closes
    assert second[0] == 0 and second.count(0) == 1  # the template wrote it: not doubled
    assert not out.mask[out.offsets[0]]  # the start token is not a target to learn


def test_a_damaged_hf_source_record_is_named_with_its_fix(tokenizer, tmp_path):
    """hf_source.json garbled by a disk fault: export and a resume name it and the way out (a
    JSONDecodeError traceback before), and export goes on without it once it is removed."""
    from trimtab.training.setup import adopt_hf_model

    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    run = write_run(tmp_path / "r", model, tokenizer)
    (run / "hf_source.json").write_text('{"path": "/models/qw')
    with pytest.raises(ConfigError, match=r"hf_source.json is damaged.*remove it to export"):
        export_run(run, tmp_path / "hf")
    cfg = load_config(preset="debug", overrides={"out": str(run), "train": {"init_from": str(run)}})
    with pytest.raises(ConfigError, match=r"hf_source.json is damaged.*set train.init_from to that model's directory"):
        adopt_hf_model(cfg)
    (run / "hf_source.json").unlink()
    assert (export_run(run, tmp_path / "hf") / "config.json").is_file()


def test_loading_a_run_hashes_its_checkpoint_once_and_says_its_step(trained, monkeypatch):
    """latest_valid verified the newest checkpoint, load_model verified it again, and eval's step
    a third time: each a hash of every file (optim.pt too), minutes for a large model."""
    from trimtab import checkpoint, checkpoint_load

    verify, calls = checkpoint.verify, []
    for module in (checkpoint, checkpoint_load):
        monkeypatch.setattr(module, "verify", lambda path: calls.append(path) or verify(path))
    _, _, _, step = api.load_run_at(trained)
    assert step == 3 and len(calls) == 1
