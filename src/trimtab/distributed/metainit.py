"""A sharded model built on the meta device (as torchtitan builds one): no rank ever holds the
whole model (a pipeline stage's rank allocates its own layers only). setup builds it with
`model.meta.build_on_meta`, Parallel.wrap shards it (and cuts the pipeline stages), and
`materialise` then allocates each rank's shards on its device (to_empty) and fills them with
exactly the values a one-process build of the same seed holds: each parameter is drawn whole on
the host, in the order a CPU build draws them, and this rank keeps its part (docs/distributed.md,
"Building a sharded model").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trimtab.model.meta import Layout, draw_parameters, layout, reset_buffers


@dataclass
class MetaInit:
    """A meta-built model's pending initialisation: the generator's state after its constructors
    (None: no weights to draw, a resume loads them), where to allocate its shards and its buffers."""

    rng: torch.Tensor | None
    device: torch.device  # where the shards live (the CPU under distributed.cpu_offload)
    buffers: torch.device  # where the forward runs
    whole: Layout  # every parameter as built, in draw order: a pipeline stage then unregisters the others'
    # train.init_from: fills this rank's shards once allocated (instead of drawing them) and returns
    # where its weights came from and the Hugging Face record (training/init_from.py sharded_init_from)
    weights: Callable[[nn.Module], tuple[Path, dict | None]] | None = None


def meta_reason(parallel) -> str:
    """Why this run builds its whole model on every rank ('' when it builds it on the meta device,
    to be sharded first (FSDP2, tensor, expert and pipeline parallelism: a stage materialises only
    its own layers)): one every rank holds whole (one process, DDP). A sharded train.init_from fills
    each rank's shards after materialise (training/init_from.py), a pipeline stage's its own layers."""
    return "" if parallel.sharded else "every rank holds the whole model (one process or DDP)"


def pending(parallel, model: nn.Module, draw: bool) -> MetaInit:
    """What materialise needs, taken right after the meta build: the generator as a CPU build's
    constructors leave it, so that nothing drawn before materialise changes the weights, and
    the whole model's parameters, in the order a one-process build draws them."""
    offload = parallel.cfg.cpu_offload
    return MetaInit(
        rng=torch.get_rng_state() if draw else None,
        device=torch.device("cpu") if offload else parallel.device,
        buffers=parallel.device,
        whole=layout(model),
    )


def materialise(model: nn.Module, init: MetaInit) -> None:
    """Allocate a meta-built, sharded model's shards (to_empty), draw its weights as a
    one-process build does (keeping this rank's part of each), and compute its buffers. A
    pipeline stage's rank allocates its own layers only: the others' were unregistered (hollowed)."""
    model.to_empty(device=init.device)
    held = "weight" in model.tok_emb._parameters and "weight" in model.lm_head._parameters
    if model.cfg.tie_embeddings and held and model.lm_head.weight is not model.tok_emb.weight:
        model.lm_head.weight = model.tok_emb.weight  # to_empty made each module its own copy
    if init.rng is not None:  # the generator left where a CPU build leaves it, whatever drew meanwhile
        torch.set_rng_state(init.rng)
        draw_parameters(model, keep_shard, init.whole)
    reset_buffers(model, init.buffers)


def keep_shard(p: nn.Parameter, full: torch.Tensor | Any) -> None:
    """Copy this rank's part of `full` (the whole parameter, on the host, or a Hugging Face import's
    hf.tensors.Part, of which only that part is read) into `p`."""
    box = local_box(p, full.shape)
    if box is None:
        p.copy_(full[tuple(slice(0, n) for n in full.shape)])  # all of it (a view of a tensor)
    else:
        p.to_local().copy_(full[box])


def local_box(p: torch.Tensor, shape: torch.Size) -> tuple[slice, ...] | None:
    """The slices of a whole tensor of `shape` that this rank holds of the DTensor `p` (None: `p`
    is no DTensor, the rank holds it whole): what a reader that can read part of a tensor reads."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return None
    mesh, local = p.device_mesh, p.to_local()
    # this rank's place on the mesh read from its process groups (as FSDP2 reads it to shard)
    where = [mesh.get_local_rank(dim) for dim in range(mesh.ndim)]
    held, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, where, p.placements)
    if tuple(held) != tuple(local.shape):
        raise RuntimeError(
            f"a parameter of shape {tuple(shape)} placed {p.placements} holds {tuple(local.shape)} on this "
            f"rank, not the {tuple(held)} its placement gives: the meta build cannot initialise it "
            "(distributed/metainit.py keep_shard)"
        )
    return tuple(slice(o, o + n) for o, n in zip(offset, held, strict=True))
