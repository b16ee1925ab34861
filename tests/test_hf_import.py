"""Importing a Hugging Face directory: what a config.json leaves out is its class's default (as
transformers reads it), and a tied config with a different head in the file is refused."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_helpers import TOL, hf_load, max_diff
from trimtab.errors import CheckpointError
from trimtab.hf import importer
from trimtab.hf.architectures import MODEL_TYPES, to_model_config
from trimtab.hf.importer import import_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def saved(path, cls, **fields):
    """A tiny random transformers model of class `cls` saved into path; returns it."""
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**SMALL, num_key_value_heads=2, max_position_embeddings=64, **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(path)
    return model


def edit_config(path, drop=(), **change):
    config = json.loads((path / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in drop} | change
    (path / "config.json").write_text(json.dumps(config))


def test_a_mixtral_without_rope_theta_or_eps_imports_with_mixtrals_defaults(tmp_path):
    """MixtralConfig's defaults are rope_theta 1e6 and rms_norm_eps 1e-5, not Llama's 1e4, 1e-6."""
    saved(tmp_path, "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    edit_config(tmp_path, drop=("rope_parameters", "rope_theta", "rope_scaling", "rms_norm_eps"))
    theirs = hf_load(tmp_path)
    assert theirs.config.rms_norm_eps == 1e-5
    ours, _ = import_model(tmp_path)
    assert (ours.cfg.rope_theta, ours.cfg.norm_eps) == (1e6, 1e-5)
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_each_omitted_field_reads_as_transformers_reads_it(arch):
    """A config.json with the sizes only: every other value trimtab uses is the one transformers'
    config class gives it (derived ones included: kv heads, head dim, the sliding window)."""
    given = dict(SMALL, num_attention_heads=32, hidden_size=64, max_position_embeddings=8192)
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **given}
    cfg = to_model_config(hf, "config.json")
    theirs = transformers.AutoConfig.for_model(MODEL_TYPES[arch], **given)
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    window = getattr(theirs, "sliding_window", None) if getattr(theirs, "use_sliding_window", True) else None
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert cfg.n_kv_heads == theirs.num_key_value_heads and cfg.head_dim == head_dim
    assert (cfg.rope_theta, cfg.norm_eps) == (rope["rope_theta"], theirs.rms_norm_eps)
    assert cfg.tie_embeddings == theirs.tie_word_embeddings
    assert cfg.max_seq_len == min(8192, window or 8192)
    if arch == "MixtralForCausalLM":
        assert (cfg.moe.n_experts, cfg.moe.top_k) == (theirs.num_local_experts, theirs.num_experts_per_tok)
        assert cfg.moe.balance_coef == theirs.router_aux_loss_coef
    if arch == "Qwen2MoeForCausalLM":
        assert (cfg.moe.n_experts, cfg.moe.top_k) == (theirs.num_experts, theirs.num_experts_per_tok)
        assert (cfg.moe.expert_hidden, cfg.moe.shared_hidden) == (
            theirs.moe_intermediate_size,
            theirs.shared_expert_intermediate_size,
        )
        assert cfg.moe.renormalize == theirs.norm_topk_prob and cfg.attn_bias == theirs.qkv_bias


def test_a_tied_config_whose_file_holds_another_head_is_refused_naming_the_tensor(tmp_path):
    saved(tmp_path, "Qwen2Config", tie_word_embeddings=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embedding.clone()}, str(tmp_path / "model.safetensors"))
    import_model(tmp_path)  # the same head saved twice: fine
    save_file({**weights, "lm_head.weight": embedding + 0.01}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        import_model(tmp_path)


def test_a_tied_head_saved_too_is_compared_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """The head a tied file holds besides its embedding is compared with it TIE_CHUNK elements of
    each at a time (before: both read whole at once), every block: a difference in any row refused."""
    saved(tmp_path, "Qwen2Config", tie_word_embeddings=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]  # [320, 32]: 40 blocks of 8 rows
    monkeypatch.setattr(importer, "TIE_CHUNK", 8 * 32)
    reads, read = [], importer.SafetensorsDir._read

    def counted(self, name, take):
        found = read(self, name, take)
        if name == "lm_head.weight" and isinstance(found, torch.Tensor):
            reads.append(found.numel())
        return found

    monkeypatch.setattr(importer.SafetensorsDir, "_read", counted)
    save_file({**weights, "lm_head.weight": embedding.clone()}, str(tmp_path / "model.safetensors"))
    import_model(tmp_path)  # the same head saved twice: fine
    # all of it, a block at a time (+ one element: the file's dtype, read from its first tensor)
    assert max(reads) <= 8 * 32 and sum(reads) == embedding.numel() + 1
    for row in (0, 163, 319):  # the first, a middle and the last block
        head = embedding.clone()
        head[row, 5] += 0.01
        save_file({**weights, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
            import_model(tmp_path)


def file_maps(file):
    """The address ranges where this process maps `file` (Linux's /proc/self/maps)."""
    lines = open("/proc/self/maps").read().splitlines()  # noqa: SIM115
    ranges = [line.split()[0].split("-") for line in lines if line.endswith(str(file))]
    return [(int(lo, 16), int(hi, 16)) for lo, hi in ranges]


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_an_fp32_import_holds_the_files_memory_map_not_a_second_copy(tmp_path):
    """As transformers loads: a tensor that needs no conversion is the file's mapped memory itself
    (nothing copied); a converted one (the grouped q/k/v, a bf16 file's fp32) is new memory."""
    theirs = saved(tmp_path / "fp32", "LlamaConfig", tie_word_embeddings=True)
    ours, _ = import_model(tmp_path / "fp32")
    maps = file_maps((tmp_path / "fp32" / "model.safetensors").resolve())

    def mapped(t):
        return any(lo <= t.data_ptr() < hi for lo, hi in maps)

    assert mapped(ours.tok_emb.weight) and mapped(ours.norm.weight) and mapped(ours.blocks[1].attn.wo.weight)
    assert ours.lm_head.weight is ours.tok_emb.weight  # still tied: one Parameter
    assert not mapped(ours.blocks[0].attn.qkv.weight)  # q, k, v grouped: a new tensor
    assert all(p.requires_grad for p in ours.parameters())
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ours16, dtype = import_model(tmp_path / "bf16")
    assert dtype == torch.bfloat16 and ours16.norm.weight.dtype == torch.float32
    assert torch.equal(ours16.norm.weight, theirs.model.norm.weight.float())
    assert not mapped(ours16.norm.weight)


def test_model_settings_a_hugging_face_model_overrides_are_refused_and_its_live_knobs_kept(tmp_path):
    """train.init_from a Hugging Face directory: config.json is the model. A model.* key the run's
    config sets otherwise (a width) was replaced without a word: it is refused, named with the
    model's value; a live knob it sets (the MoE balance coefficient) is the run's, over the file's
    router_aux_loss_coef."""
    from trimtab.config import load_config
    from trimtab.errors import ConfigError
    from trimtab.training.hf_model import adopt_hf_model

    saved(tmp_path / "hf", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    run = {"out": str(tmp_path / "run"), "train": {"init_from": str(tmp_path / "hf")}}
    plain = adopt_hf_model(load_config(preset="debug", overrides=run))
    assert plain.model.d_model == 32 and plain.model.moe.balance_coef == 0.02
    with pytest.raises(ConfigError, match=r"model.d_model=64 \(the model's: 32\).*Drop those model"):
        adopt_hf_model(load_config(preset="debug", overrides={**run, "model": {"d_model": 64}}))
    knob = adopt_hf_model(load_config(preset="debug", overrides={**run, "model": {"moe": {"balance_coef": 0.005}}}))
    assert knob.model.moe.balance_coef == 0.005 and knob.model.d_model == 32


def test_a_run_initialised_from_a_run_of_a_hugging_face_model_exports_as_that_model(tmp_path, tokenizer):
    """A second stage (train.init_from a run that was itself initialised from a Hugging Face model)
    had no hf_source.json: its export lost the original's bos id, generation settings and dtype."""
    from hf_helpers import write_run
    from trimtab.config import load_config
    from trimtab.hf import export_run
    from trimtab.hf.importer import source_record
    from trimtab.training.init_from import init_weights_from
    from trimtab.training.setup import prepare_run_dir

    saved(tmp_path / "hf", "LlamaConfig", bos_token_id=7, eos_token_id=8).to(torch.bfloat16).save_pretrained(
        tmp_path / "hf"
    )
    model, dtype = import_model(tmp_path / "hf")
    first = write_run(tmp_path / "first", model, tokenizer)
    (first / "hf_source.json").write_text(json.dumps(source_record(tmp_path / "hf", dtype)))
    cfg = load_config(
        first / "config.yaml", overrides={"out": str(tmp_path / "second"), "train": {"init_from": str(first)}}
    )
    _, record = init_weights_from(cfg, model)
    assert record is not None and record["config"]["bos_token_id"] == 7 and record["dtype"] == "bfloat16"
    second = write_run(tmp_path / "second", model, tokenizer)
    prepare_run_dir(cfg, tokenizer, record)  # what setup does with it
    exported = export_run(second, tmp_path / "export")
    config = json.loads((exported / "config.json").read_text())
    assert (config["bos_token_id"], config["torch_dtype"]) == (7, "bfloat16")
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == 8
