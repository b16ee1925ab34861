"""A Hugging Face train.init_from under FSDP2, tensor or pipeline parallelism: the model is built on
the meta device and each rank asks the safetensors files for its own part of each tensor only
(get_slice; the grouped attention projection included: hf/tensors.py Part; a pipeline stage, its own
layers' tensors only), and its shards hold exactly the one-process import's."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from fake_rank import as_rank
from trimtab.config import load_config, resolve
from trimtab.distributed.metainit import local_box
from trimtab.hf import importer
from trimtab.hf.tensors import Part, _grouped_part
from trimtab.model import build_model
from trimtab.model.layers import group_qkv
from trimtab.training.hf_model import adopt_hf_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


class _Counted:
    """A safe_open handle that counts the bytes of the tensors it hands out (whole or sliced)."""

    def __init__(self, handle, counter: list[int]):
        self.handle, self.counter = handle, counter

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(self.handle.get_tensor(name))

    def get_slice(self, name: str):
        whole = self.handle.get_slice(name)
        return type(
            "Slice", (), {"get_shape": whole.get_shape, "__getitem__": lambda _, box: self._count(whole[box])}
        )()

    def keys(self):
        return self.handle.keys()


@pytest.mark.parametrize(
    ("parallel", "vocab"),
    [({"strategy": "fsdp"}, 301), ({"strategy": "fsdp", "tp": 2}, 302), ({"pp": 2}, 301)],
    ids=["fsdp2", "tp", "pp"],
)
def test_each_rank_reads_only_its_shards_of_a_hugging_face_model(parallel, vocab, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="transformers is a dev dependency (builds the model)")
    from hf_helpers import llama_style_tokenizer, tiny_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_llama(vocab_size=vocab).save_pretrained(tmp_path)  # fp32, as the shards; 301: uneven FSDP2 shards
    llama_style_tokenizer().save_pretrained(tmp_path)
    cfg = load_config(preset="debug", overrides={"distributed": parallel, "train": {"precision": "fp32"}})
    cfg = resolve(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path))))
    cfg = adopt_hf_model(cfg)
    whole = build_model(cfg.model)
    importer.import_weights(whole, tmp_path)  # the one-process import
    read = [0]
    opened = importer.safe_open
    monkeypatch.setattr(importer, "safe_open", lambda file, framework: _Counted(opened(file, framework), read))
    built = []
    with as_rank(cfg, 1, 2, lambda model, meta: built.append(meta is not None)) as (_, model):
        held = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            expected = whole.state_dict()[name]
            box = local_box(p, expected.shape)
            assert torch.equal(held[name], expected if box is None else expected[box]), name
    shard = sum(p.numel() * 4 for p in held.values())
    assert built == [True]  # built on the meta device, not whole (a pipeline stage's was, before)
    assert 0 < read[0] <= shard + 4  # + one element, read for the file's dtype (before: every tensor whole)


def test_a_grouped_projection_part_reads_any_rows_as_the_whole_holds_them():
    q, k, v = torch.randn(12, 3), torch.randn(4, 3), torch.randn(4, 3)  # 2 kv groups of 3 query heads, E = 2
    grouped = _grouped_part(*(Part(t.shape, t.__getitem__) for t in (q, k, v)), n_kv_heads=2)
    full = group_qkv(q, k, v, 2)
    assert grouped.shape == full.shape
    for start, stop in [(0, 20), (3, 13), (9, 11), (10, 10), (19, 20)]:  # across, within and between groups
        box = (slice(start, stop), slice(1, 3))
        assert torch.equal(grouped[box], full[box]), (start, stop)


def _moe_model(path, kind):
    """A tiny random Mixtral of 8 experts saved per expert, or test_hf_fused's Qwen2-MoE (4 experts,
    layer 0 dense, a shared expert) in transformers 5's fused layout."""
    from safetensors.torch import load_file

    from hf_helpers import llama_style_tokenizer, transformers
    from test_hf_fused import fused, saved, write

    if kind == "mixtral":
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        saved(path.parent / "per_expert", kind)
        write(
            path,
            fused(load_file(str(path.parent / "per_expert" / "model.safetensors")), kind),
            path.parent / "per_expert",
        )
    llama_style_tokenizer().save_pretrained(path)


@pytest.mark.parametrize(
    ("kind", "parallel"),
    [("mixtral", {"strategy": "fsdp", "ep": 2}), ("mixtral", {"pp": 2}), ("qwen2_moe", {"strategy": "fsdp", "ep": 2})],
    ids=["ep2", "pp", "fused-ep2"],
)
def test_each_rank_reads_only_its_own_experts_of_a_hugging_face_moe(kind, parallel, tmp_path, monkeypatch):
    """The experts (one tensor per expert, or fused [E, ...]) are read per rank: an expert-parallel
    rank's own experts, a pipeline stage's own layers' (before: every layer's stacked whole)."""
    pytest.importorskip("transformers", reason="transformers is a dev dependency (builds the model)")
    _moe_model(tmp_path / "hf", kind)
    cfg = load_config(preset="debug-moe", overrides={"distributed": parallel, "train": {"precision": "fp32"}})
    cfg = resolve(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "hf"))))
    cfg = adopt_hf_model(cfg)
    whole = build_model(cfg.model)
    importer.import_weights(whole, tmp_path / "hf")  # the one-process import
    read = [0]
    opened = importer.safe_open
    monkeypatch.setattr(importer, "safe_open", lambda file, framework: _Counted(opened(file, framework), read))
    with as_rank(cfg, 1, 2, lambda model, meta: None) as (_, model):
        held = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            expected = whole.state_dict()[name]
            box = local_box(p, expected.shape)
            assert torch.equal(held[name], expected if box is None else expected[box]), name
    assert any(".ffn.w1" in name for name in held)
    assert 0 < read[0] <= sum(p.numel() * 4 for p in held.values()) + 4  # + the file's dtype (one element)
