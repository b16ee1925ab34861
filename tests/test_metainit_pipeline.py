"""A pipeline stage's rank builds the model on the meta device (distributed/metainit.py) and
materialises its own layers only, with exactly the weights a one-process build draws for them.

As tests/test_metainit_fsdp.py: one process plays each rank in turn over torch's fake process
group; tests/test_pipeline_parallel.py's torchrun runs give the end-to-end check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from fake_rank import as_rank
from trimtab.config import load_config
from trimtab.model import build_model
from trimtab.model.meta import build_on_meta, draw_parameters, layout

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
CPU = torch.device("cpu")


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model object holds in memory, registered or not (a hollowed layer's
    unregistered attributes included), by name."""
    held = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not value.is_meta:
                held[f"{prefix}.{name}"] = value
        for table in (module._parameters, module._buffers):
            held.update({f"{prefix}.{n}": t for n, t in table.items() if t is not None and not t.is_meta})
    return held


def _as_stage(cfg, rank: int, world: int) -> dict:
    """setup's model half (_make_model, Parallel.wrap, materialise) as pipeline rank `rank`."""

    def nothing_held(model, meta) -> None:  # on meta: nothing materialised before the stages are cut
        assert meta is not None and not _held(model)

    with as_rank(cfg, rank, world, nothing_held) as (parallel, model):
        layers = {i for stage in parallel.pipeline.stages for i in stage.layers}
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return {"held": _held(model), "params": params, "layers": layers, "rng": torch.get_rng_state()}


def test_a_pipeline_stage_materialises_only_its_own_layers_with_the_one_process_weights():
    # debug-hybrid: tied embedding (first and last stage each hold it), MoE and MoD layers
    cfg = load_config(preset="debug-hybrid", overrides={"distributed": {"pp": 2}, "train": {"precision": "fp32"}})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=301))
    stages = [_as_stage(cfg, rank, 2) for rank in range(2)]
    torch.manual_seed(cfg.train.seed)
    whole = build_model(cfg.model)
    params = dict(whole.named_parameters())
    assert stages[0]["layers"] and stages[1]["layers"] and not stages[0]["layers"] & stages[1]["layers"]
    for stage in stages:
        for name in stage["held"]:  # the other stage's layers never allocated
            if name.startswith("blocks."):
                assert int(name.split(".")[1]) in stage["layers"], name
        for name, tensor in stage["params"].items():
            assert torch.equal(tensor, params[name]), name
        assert torch.equal(stage["rng"], torch.get_rng_state())  # the generator where a CPU build leaves it
    assert set(stages[0]["params"]) | set(stages[1]["params"]) == set(params)


def test_a_parameter_missing_from_the_built_layout_is_refused_by_name():
    """A parameter the meta build did not list has no values to draw: refused, not left as to_empty's garbage."""
    cfg = load_config(preset="debug")
    model = build_on_meta(dataclasses.replace(cfg.model, vocab_size=64), draw=False).to_empty(device=CPU)
    whole = [entry for entry in layout(model) if entry[0] != "norm.weight"]
    with pytest.raises(RuntimeError, match=r"parameter norm\.weight is not in the model as built"):
        draw_parameters(model, lambda p, full: p.copy_(full), whole)
