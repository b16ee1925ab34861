"""The one place a model is parallelised (`Parallel.wrap` calls it): pipeline stages
(distributed/pipeline.py), tensor / sequence parallelism (distributed/tensor.py), expert
parallelism (distributed/expert.py), then DDP with its summing all-reduce hook, or FSDP2
(distributed/fsdp.py). What it builds is kept on the `Parallel` (its ddp, pipeline, experts),
whose step collectives use it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trimtab.distributed.fsdp import fully_shard_model

if TYPE_CHECKING:
    from trimtab.distributed.parallel import Parallel
    from trimtab.hardware import Precision


def wrap_model(
    parallel: Parallel, model: nn.Module, compile: bool, precision: Precision
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Parallel.wrap's callable: model.hidden, compiled and wrapped for `parallel`'s mesh, which
    keeps what it built (ddp, pipeline, experts, the loss_parallel context)."""
    if compile:
        prepare_block_compile(model)
    if parallel.mesh.pp > 1:
        from trimtab.distributed.pipeline import Pipeline

        parallel.pipeline = Pipeline(model, parallel.mesh, parallel.cfg, parallel.device)
    if parallel.mesh.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        from trimtab.distributed.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, parallel.mesh["tp"])
        # loss_parallel swaps DTensor's cross-entropy ops for vocabulary-parallel ones, which
        # the backward needs too: on for the whole run (only the loss has sharded logits)
        parallel._contexts.enter_context(loss_parallel())
    if parallel.mesh.ep > 1:  # from the config: a pipeline stage may hold none of the model's MoE layers
        from trimtab.config.distributed import check_moe_split

        check_moe_split(model.cfg, parallel.mesh.tp, parallel.mesh.ep)  # a dense model's ep ran as plain FSDP, silently
    if (parallel.mesh.tp > 1 or parallel.mesh.ep > 1) and model.moe_layers():
        from trimtab.distributed.expert import apply_moe_parallel

        parallel.experts = apply_moe_parallel(model, parallel.mesh)
    if parallel.pipeline is not None and (parallel.single_replica or parallel.world == 1):
        for block in parallel.pipeline.blocks() if compile else []:
            block.compile()
        return model.hidden
    if not parallel.fsdp:
        # Each block compiled on its own, as under FSDP and pipelines (and torchtitan): blocks of
        # one kind share their compiled code, so a deep model compiles in the time of a shallow
        # one (22 layers of dense-1b's shape on a CPU: 16 s against 47 s for the whole stack) and
        # steps as fast; the embedding and final norm stay eager.
        for block in model.blocks if compile else []:
            block.compile()
        fn = model.hidden
        if parallel.dp_world == 1:
            return fn
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP hooks gradients only through forward(): _Forward's forward is model.hidden. Buffers
        # are synced once at start, not per forward: MoE load is all-reduced in reduce_step.
        parallel.ddp = DDP(
            _Forward(model, fn),
            device_ids=[parallel.device.index] if parallel.device.type == "cuda" else None,
            forward_sync_buffers=False,
            find_unused_parameters=parallel.find_unused,
        )
        # the hook's state is a weak proxy: the reducer (C++) holding this object would close a cycle
        # Parallel -> DDP -> reducer -> Parallel that the garbage collector cannot see, and every
        # process group (each with its gloo threads) would outlive the run into the process's exit
        parallel.ddp.register_comm_hook(weakref.proxy(parallel), _sum_hook)
        parallel.ddp.require_backward_grad_sync = False  # forwards never arm the all-reduce: agree() does
        return parallel.ddp
    fully_shard_model(parallel, model, compile, precision)
    return model.hidden


def prepare_block_compile(model: nn.Module) -> None:
    """torch.compile's settings for compiling `model`'s blocks one by one (process-wide):
    - every block's forward is one function: each kind of block (dense, MoE, MoD, both) holds its
      own compiled entries (training, evaluation's no-grad, each checkpointing mode an OOM may set),
      so the limit of entries per function grows with the kinds (8 by default: debug-hybrid's four
      kinds reached it in training and evaluation alone, and its blocks fell back to eager);
    - a checkpointed MoE or Mixture-of-Depths block records its auxiliary loss and statistics on
      itself: once, in the forward, as eager checkpointing does (model/recompute.py in_recompute),
      not again in the backward's recompute. Without the switch such a block breaks the graph at
      its checkpoint and runs eager (as it does where torch lacks it)."""
    config = torch._dynamo.config
    kinds = len({block.kind for block in model.blocks})
    config.recompile_limit = max(config.recompile_limit, 8 * kinds)
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


class _Forward(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.fn = model, fn
        self.output: torch.Tensor | None = None  # the last forward's, for find_unused_parameters

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.fn(tokens)
        self.output = out if torch.is_grad_enabled() else None  # evaluation keeps nothing alive
        return out


def _sum_hook(parallel, bucket):  # unannotated: DDP checks annotations, which are strings here
    """DDP averages gradients by default; each rank's loss is already its share of the global
    token-normalised loss, so the global gradient is the plain sum (a dist.GradBucket -> Future).
    With `parallel.local_sq` set, this rank's own gradient's sum of squares is added to it first
    (on device): what tells which rank computed a step wrong (training/rerun.py)."""
    if parallel.local_sq is not None:
        parallel.local_sq += torch.linalg.vector_norm(bucket.buffer().detach(), dtype=torch.float32).square()
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
