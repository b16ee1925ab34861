"""What a training step reads back on the host. On a GPU such a read (`.item()`, `bool(t)`, a
shape that depends on values: nonzero, boolean indexing) waits for every queued kernel, so the
CPU stops running ahead and the GPU idles while it launches the next ones. The step's "no host
sync" (docs/orchestrator.md: metrics are read every `orchestrator.read_every` steps) is checked
here on the CPU, where the same aten ops run: a dispatch mode counts each one that reads a
device value, with the trimtab line that asked for it."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trimtab.api import built_in_hooks
from trimtab.config import load_config
from trimtab.config.sparse import MoEConfig
from trimtab.model.moe import MoE
from trimtab.training.hooks import Hook
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# aten ops whose CUDA kernels copy a value (or a value-dependent size) to the host
READS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "equal",
    "is_nonzero",
    "allclose",
    "masked_scatter",
    "histc",
}


class HostReads(TorchDispatchMode):
    """Counts host reads by (label, op, trimtab line); `label` is set by the caller (a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.label: object = None
        self.reads: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        sized = name == "repeat_interleave" and not kwargs.get("output_size")  # its output size: a sum
        if name in READS or sized or _bool_indexed(name, args):
            self.reads[(self.label, name, _caller())] += 1
        return func(*args, **kwargs)

    def at(self, label: object) -> dict[tuple[str, str], int]:
        return {(op, line): n for (lab, op, line), n in self.reads.items() if lab == label}


def _bool_indexed(name: str, args: tuple) -> bool:
    if name not in ("index", "index_put", "index_put_"):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/trimtab/" in frame.filename:
            return f"{frame.filename.rsplit('/trimtab/', 1)[1]}:{frame.name}"
    return "?"


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_a_moe_layer_with_a_capacity_reads_nothing_back_in_the_grouped_layout(impl):
    """Dropping above capacity took the kept rows by a boolean mask, a read per layer and a
    data-dependent shape torch.compile could not trace; padded sizes its buffer to the most
    loaded expert in eager mode (one read, documented in MoE._padded)."""
    torch.manual_seed(0)
    m = MoE(16, 24, MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0))
    m.impl = impl
    x = torch.randn(4, 9, 16, requires_grad=True)
    with HostReads() as reads:
        m(x).sum().backward()
    assert m.stats["dropped"] > 0
    expected = {} if impl == "grouped" else {("_local_scalar_dense", "model/moe.py:_padded"): 1}
    assert reads.at(None) == expected


class _Steps(Hook):
    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def on_step_start(self, run, batch) -> None:
        self.reads.label = run.step + 1


@pytest.mark.parametrize(
    "preset,sets",
    [
        ("debug", []),
        ("debug-moe", ["resilience.rerun=false"]),  # a capacity of 1.25
        ("debug-moe", ["model.moe.capacity_factor=0", "model.moe.n_shared_experts=1", "train.micro_batch_tokens=256"]),
        ("debug-hybrid", ["resilience.rerun=false"]),  # dense, MoE, MoD and MoE+MoD layers
    ],
)
def test_between_metric_reads_a_step_reads_back_only_the_rerun_flag(tmp_path, preset, sets):
    """The whole loop (forward, backward, clip, the orchestrator's gate, the update, every
    built-in hook) between two metric reads reads back one value: whether the gate flagged the
    step, for a flagged step is computed again before it is judged (resilience.rerun; one read
    per step, so that a bad step is never applied); none without the re-run, but in the LR's
    warm-up, which a withheld update holds back (training/schedule.py note_withheld: the same flag,
    read there; with the re-run, its read is used)."""
    sets = [
        "train.max_steps=5",
        "optim.warmup_steps=3",  # steps 1-3
        "train.eval_every=0",
        "train.log_every=100",
        "orchestrator.read_every=100",
        "checkpoint.every=0",
        "log.progress=false",
        "log.tensorboard=false",
        "data.max_bytes=100000",
        *sets,
    ]
    cfg = load_config(preset=preset, overrides={"out": str(tmp_path / "run")}, sets=sets)
    reads = HostReads()
    trainer = Trainer(setup(cfg), hooks=[_Steps(reads), *built_in_hooks(cfg)])
    with reads:
        trainer.fit()
    rerun = {("_local_scalar_dense", "training/trainer.py:train_step"): 1} if cfg.resilience.rerun else {}
    warming = rerun or {("_local_scalar_dense", "training/schedule.py:_withheld"): 1}
    for step in (2, 3, 4):  # step 1 runs start-up work, step 5 is the last (metrics read, final save)
        assert reads.at(step) == (warming if step <= 3 else rerun), f"step {step}"
