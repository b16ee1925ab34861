"""setup's model half (_make_model, Parallel.wrap, materialise) played as one rank of a job over
torch's fake process group, in this process (tests/test_metainit_*.py): setup's model half needs
no collective but the precision's broadcast, stubbed here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from trimtab.distributed import Parallel
from trimtab.distributed.mesh import Mesh
from trimtab.distributed.metainit import materialise
from trimtab.hardware import choose_precision
from trimtab.training.setup import _make_model

CPU = torch.device("cpu")


@contextmanager
def as_rank(cfg: Any, rank: int, world: int, before: Callable[[torch.nn.Module, Any], None]) -> Iterator[Parallel]:
    """Builds cfg's model as `rank` of `world` (seeded as setup seeds it), calls `before(model, meta)`
    on what was built before the wrap, wraps and materialises it, and yields (parallel, model) inside
    the fake group, destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel = Parallel(cfg.distributed, CPU, world, rank, False, Mesh.of(cfg.distributed, world).build(CPU))
        parallel.same_precision = lambda precision: precision  # a broadcast: the fake group carries no data
        torch.manual_seed(cfg.train.seed)
        model, precision, _, meta = _make_model(cfg, parallel, choose_precision(CPU, "fp32"), None, check_fit=False)
        before(model, meta)
        parallel.wrap(model, False, precision)
        materialise(model, meta)
        if meta.weights is not None:  # train.init_from: this rank's shards read from it
            meta.weights(model)
        yield parallel, model
    finally:
        dist.destroy_process_group()
