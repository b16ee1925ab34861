"""train.init_from under FSDP2: the model is built on the meta device, sharded, and each rank fills
its own shards from the source (training/init_from.py sharded_init_from), never building or reading
it whole: its shards hold exactly the one-process init_from's weights (a sharded source is read
through the resume path, Parallel.load_model, tested there)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from fake_rank import as_rank
from trimtab.checkpoint import save_checkpoint
from trimtab.config import load_config, resolve
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.training.hf_model import adopt_hf_model
from trimtab.training.init_from import init_weights_from

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
FSDP = {"strategy": "fsdp"}


def _trimtab_run(path, cfg) -> None:
    """A one-process run's checkpoint of cfg's model (random weights, another seed than the run's)."""
    torch.manual_seed(123)
    model = build_model(cfg.model)
    save_checkpoint(path, 0, model.state_dict(), {}, {"moe": model.moe_state(), "mod": model.mod_state()}, keep=1)


def _hf_llama(path) -> None:
    """A tiny random Llama (odd vocabulary: uneven FSDP2 shards) and its tokenizer, built offline."""
    pytest.importorskip("transformers", reason="transformers is a dev dependency (builds the model)")
    from hf_helpers import llama_style_tokenizer, tiny_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_llama(vocab_size=301).save_pretrained(path)
    llama_style_tokenizer().save_pretrained(path)


def _shards(cfg, rank: int) -> tuple[int, dict[str, torch.Tensor]]:
    """What `rank` of 2 allocated before the wrap (bytes), and its shards after setup's model half."""
    built = []

    def count(model, meta) -> None:
        built.append(sum(t.numel() * t.element_size() for t in [*model.parameters()] if not t.is_meta))

    with as_rank(cfg, rank, 2, count) as (_, model):
        return built[0], {name: p.to_local().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("source", ["run", "hf"])
def test_fsdp2_ranks_read_their_shards_of_the_init_from_weights(source, tmp_path):
    cfg = load_config(preset="debug", overrides={"distributed": FSDP, "train": {"precision": "fp32"}})
    if source == "run":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=301))
        _trimtab_run(tmp_path / "src", cfg)
    else:
        _hf_llama(tmp_path / "src")
    cfg = adopt_hf_model(
        resolve(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "src"))))
    )
    ranks = [_shards(cfg, rank) for rank in range(2)]
    whole = build_model(cfg.model)
    init_weights_from(cfg, whole)  # the one-process init_from
    assert [built for built, _ in ranks] == [0, 0]  # no rank built the model whole
    for name, p in whole.named_parameters():
        assert torch.equal(torch.cat([shards[name] for _, shards in ranks]), p), name


def test_a_sharded_init_from_of_another_model_is_refused_naming_the_tensor(tmp_path):
    cfg = load_config(preset="debug", overrides={"distributed": FSDP, "train": {"precision": "fp32"}})
    _trimtab_run(tmp_path / "src", dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=301)))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=300))
    cfg = resolve(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "src"))))
    with pytest.raises(ConfigError, match=r"train.init_from.*shape mismatch \['tok_emb.weight'.*same model settings"):
        _shards(cfg, 0)
