"""A model FSDP2 shards is built on the meta device (distributed/metainit.py): no rank holds the
whole model, and the shards start from exactly the weights a one-process build draws.

The ranks here are one process playing each rank in turn over torch's fake process group (setup's
model half needs no collective but the precision's broadcast, stubbed); the torchrun runs of
tests/test_distributed.py (the `single` and `fsdp` fixtures) give the end-to-end check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from fake_rank import as_rank
from trimtab.checkpoint import list_checkpoints
from trimtab.checkpoint_load import read_sharded_weights
from trimtab.config import load_config
from trimtab.model import build_model
from trimtab.model.meta import build_on_meta, reset_buffers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
CPU = torch.device("cpu")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _as_rank(cfg, rank: int, world: int = 2) -> dict:
    """setup's model half (_make_model, Parallel.wrap, materialise) as `rank` of `world`: what the
    rank held before its weights were drawn, and its shards after."""
    built = []

    def count(model, meta) -> None:
        built.append(_bytes([*model.parameters(), *model.buffers()]))

    with as_rank(cfg, rank, world, count) as (_, model):
        shards = {name: p.to_local().clone() for name, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        return {"built": built[0], "shards": shards, "buffers": buffers, "rng": torch.get_rng_state()}


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_fsdp2_ranks_build_on_meta_and_start_from_the_one_process_weights(preset):
    cfg = load_config(preset=preset, overrides={"distributed": {"strategy": "fsdp"}, "train": {"precision": "fp32"}})
    # an odd vocabulary: FSDP2's shards of the embedding are uneven (151 and 150 rows)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=301))
    ranks = [_as_rank(cfg, rank) for rank in range(2)]
    torch.manual_seed(cfg.train.seed)
    whole = build_model(cfg.model)
    full = _bytes(whole.parameters())
    for rank in ranks:
        assert rank["built"] == 0  # every parameter and buffer on meta until sharded
        assert _bytes(rank["shards"].values()) <= full // 2 + 4 * cfg.model.d_model  # half, and one odd row
        for name, buffer in whole.named_buffers():
            assert torch.equal(rank["buffers"][name], buffer), name
        assert torch.equal(rank["rng"], torch.get_rng_state())  # the generator where a CPU build leaves it
    for name, p in whole.named_parameters():
        assert torch.equal(torch.cat([rank["shards"][name] for rank in ranks]), p), name


def test_a_buffer_without_reset_buffers_is_refused_by_name():
    cfg = load_config(preset="debug")
    model = build_on_meta(dataclasses.replace(cfg.model, vocab_size=64), draw=False)
    model.blocks[0].attn.register_buffer("scale", torch.ones(1, device="meta"))
    with pytest.raises(TypeError, match=r"blocks\.0\.attn\.scale \(Attention\) has no reset_buffers"):
        reset_buffers(model.to_empty(device=CPU), CPU)


@pytest.mark.distributed
@pytest.mark.xdist_group("process_groups")  # test_distributed.py's worker: its runs, not two more
def test_a_two_rank_fsdp2_run_starts_from_the_one_process_weights(single, fsdp):
    """End to end (tests/test_distributed.py's runs): the step-0 checkpoints, bit for bit."""
    first = [list_checkpoints(run)[0] for run in (single[0], fsdp[0])]
    assert [path.name for path in first] == ["step_000000"] * 2, first
    ours = read_sharded_weights(first[1])
    theirs = load_file(str(first[0] / "model.safetensors"))
    assert set(theirs) <= set(ours)  # one process stores the tied embedding once
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_the_cpu_precision_probe_times_a_real_model_for_a_meta_built_one(monkeypatch):
    """train.precision auto on a CPU times a training step of the model: a meta-built one (sharded
    later) has no values, so the probe builds its shape for real."""
    from trimtab.training.services import cpu_precision

    timed = []
    monkeypatch.setattr(cpu_precision, "_step_seconds", lambda model, tokens, dtype: timed.append(model) or 1.0)
    cfg = load_config(preset="debug")
    cpu_precision._probe(build_on_meta(dataclasses.replace(cfg.model, vocab_size=64), draw=False), 1, 16)
    assert timed and not any(p.is_meta for model in timed for p in model.parameters())
