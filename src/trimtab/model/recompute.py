"""Activation checkpointing of a block: which tensors a training forward keeps for its backward.

    off        autograd keeps every tensor the backward needs (plan/memory.py counts them)
    full       a block keeps its input alone and runs its whole forward again in the backward
               (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): the least
               memory, a second forward of compute (a third more a step)
    selective  a block keeps the outputs of its expensive ops (matmuls, grouped matmuls,
               attention, the routers' top-k and sort) and the backward's re-run computes only
               the cheap ones between them: norms, rotations, SwiGLU's activation and product,
               autocast's casts, the MoE permutation (Korthikanti et al. 2022, "Reducing
               Activation Recomputation in Large Transformer Models", section 5, selected by op
               as torchtitan's "op" policy; torch.utils.checkpoint's selective contexts)

A matmul whose output nothing in the backward reads is run under `output_unread()` and not kept:
a block's last projection (the dense FFN's w2, the MoE combine and shared expert), whose output
is only added to the residual stream (the add's backward reads neither side), p*h bytes a token
a block for nothing; the re-run stops once the backward has what it needs, before it. Not inside a
Mixture-of-Depths block, whose router gate multiplies the update (its backward reads it). The
model says so because the policy sees an op, not who reads its output.

The top-k and sort outputs (MoE and Mixture-of-Depths routing) are kept for correctness as well
as time: the re-run must route every token as the forward did, which a tie broken otherwise on a
re-run would not.
"""

from __future__ import annotations

import gc
import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts


def _ops(*names: str) -> frozenset:
    """The aten overloads named, those this build of torch has (cuDNN attention is CUDA's)."""
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            found.add(getattr(op, overload or "default"))
    return frozenset(found)


KEPT = _ops(
    "mm",
    "addmm",
    "bmm",
    "_grouped_mm",
    "_scaled_mm",  # float8 linear layers (training/services/float8.py)
    "_scaled_grouped_mm",
    "max",  # float8's tensorwise absmax: a whole-tensor reduction, one number kept
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "topk",
    "sort",
    "sort.stable",
)


def in_recompute() -> bool:
    """True while checkpointing runs a block's forward again inside the backward: a layer's side
    effects (its auxiliary loss, statistics, expert load) are the first forward's alone, and a
    recomputed loss left on the layer would keep its graph alive to the next forward. The re-run
    must still compute what the forward saved for the backward (checkpoint counts the tensors)
    and meet every op of KEPT in order (it takes their saved outputs op by op)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


MATMULS = _ops("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm")
_UNREAD = threading.local()  # per thread: a CUDA backward re-runs a block on autograd's own thread


@contextmanager
def output_unread(unread: bool = True) -> Iterator[None]:
    """The matmuls inside compute an output no backward reads (module docstring): selective
    checkpointing does not keep it. Eager only: under torch.compile the partitioner chooses."""
    if not unread or torch.compiler.is_compiling():
        yield
        return
    before = getattr(_UNREAD, "on", False)
    _UNREAD.on = True
    try:
        yield
    finally:
        _UNREAD.on = before


def _policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op not in KEPT or (op in MATMULS and getattr(_UNREAD, "on", False)):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_contexts() -> tuple[Any, Any]:
    """torch.utils.checkpoint's context_fn for `selective`: a new pair per checkpointed call."""
    return create_selective_checkpoint_contexts(_policy)


def measure_kept_bytes(model: nn.Module, loss: Callable[[Tensor], Tensor], tokens: Callable[[int], Tensor]) -> float:
    """What a training forward leaves allocated for its backward, per token, measured: `loss`
    runs the forward of a batch of `tokens(rows)` ([rows, T]) to a scalar, at 4 and at 8 rows, and
    the slope is taken, so per-forward constants (weight casts, RoPE tables) drop out. On CUDA the
    caching allocator's count; on a CPU torch's profiler's (its memory events). Each size runs once
    first, and what a layer holds from one forward to the next (its auxiliary loss and statistics)
    is let go, so the measured forward frees nothing older. plan/memory.py's estimate is held to
    it (tests/test_plan.py) and bench/recompute.py reports it."""
    totals, sizes = [], (4, 8)
    for rows in sizes:
        batch = tokens(rows)
        _let_go(model)
        loss(batch).backward()  # the size's first run: one-time allocations
        _let_go(model)
        with _Allocated(batch.device) as counter:
            out = loss(batch)
            counter.mark()
        out.backward()
        del out
        totals.append(counter.bytes)
    return (totals[1] - totals[0]) / ((sizes[1] - sizes[0]) * batch.shape[1])


def _let_go(model: nn.Module) -> None:
    """Free what the layers keep from the last forward (auxiliary losses, statistics)."""
    for layer in model.modules():
        if "aux_loss" in vars(layer):  # MoE and Mixture-of-Depths layers (not the model's aux_loss())
            layer.aux_loss, layer.stats = None, {}
    gc.collect()


class _Allocated:
    """Bytes allocated on `device` between entering and mark()."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bytes = 0

    def __enter__(self) -> _Allocated:
        if self.cuda:
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            self.profiler = torch.profiler.profile(activities=activities, profile_memory=True).__enter__()
        return self

    def mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.memory_allocated() - self.start
        else:
            with torch.profiler.record_function(_MARK):
                pass

    def __exit__(self, *exc: object) -> None:
        if not self.cuda:
            self.profiler.__exit__(*exc)
            self.bytes = _profiled_bytes(self.profiler)


_MARK = "trimtab.recompute.mark"


def _profiled_bytes(profiler: torch.profiler.profile) -> int:
    """Bytes allocated under the profiler and not freed when the range _MARK began, from its trace,
    block by block (the allocator's running total would also drop for blocks allocated before the
    profiler started and freed under it: a previous step's buffers, a collective's)."""
    with tempfile.TemporaryDirectory() as tmp:
        profiler.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    end = next(e["ts"] for e in events if e.get("name") == _MARK)
    live: dict[int, int] = {}
    for e in sorted((e for e in events if e.get("name") == "[memory]" and e["ts"] <= end), key=lambda e: e["ts"]):
        address, size = e["args"]["Addr"], e["args"]["Bytes"]
        if size > 0:
            live[address] = size
        else:
            live.pop(address, None)
    return sum(live.values())
