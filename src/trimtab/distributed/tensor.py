"""Tensor parallelism with sequence parallelism (Megatron-LM: Shoeybi et al. 2019; Korthikanti et
al. 2022), applied from outside to the single-device Transformer with torch's DTensor plans.

Per block, on a tensor-parallel group of tp ranks (layouts of the activations):

    x [B, T/tp, D] --attn_norm--> all-gather T --qkv (columns: whole kv groups)--> local heads
        --attention--> wo (rows) --reduce-scatter T--> + x       (the same for the SwiGLU FFN:
                                                                  w1, w3 columns, w2 rows)

Between blocks the residual stream is sharded over the sequence (each rank T/tp tokens), so
norms and the residual add run on 1/tp of the activations and store 1/tp of them. The embedding
is sharded over the vocabulary (its output reduce-scattered over the sequence); the head's rows
are the same shards, and the loss is computed on them without gathering the logits
(training/loss.py: vocabulary-parallel cross entropy, loss_parallel). qk_norm's gains are
replicated and normalise each rank's own heads (their gradients summed over the ranks).

A Mixture-of-Depths block picks its tokens by a top-k over the whole sequence, so it runs without
sequence parallelism (Megatron's plain tensor parallelism): its input is all-gathered, every rank
routes and gathers alike, the norms and the depth router compute on the whole (replicated)
activations, wo and w2 all-reduce instead of reduce-scatter, and its output is cut back to this
rank's T/tp tokens. Any capacity works (no k divisible by tp needed).

Requirements, checked with a clear error: n_kv_heads, ffn_hidden and vocab_size divisible by tp
(the fused projection is grouped per kv head: model.layers.group_qkv). Mixture-of-Experts layers
are split by distributed/expert.py (every rank routes the whole sequence, each computes a slice
of every expert).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trimtab.distributed.splits import check_tensor_parallel

if TYPE_CHECKING:
    pass


def apply_tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """Shard `model`'s weights over the 1-D tensor-parallel `mesh` in place (DTensor parameters
    under their own names, so checkpoints reshard between meshes), all but the MoE layers'
    (distributed/expert.py)."""
    check_tensor_parallel(model.cfg, mesh.size())
    tied = model.cfg.tie_embeddings
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # the final norm's output is gathered over the sequence (a replicated DTensor): the
        # loss multiplies every token by this rank's vocabulary rows of the head
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, {name: style for name, style in plan.items() if _held(getattr(model, name))})
    if _held(model.norm):
        gather = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
        )
        parallelize_module(model.norm, mesh, gather)
    if tied and _held(model.tok_emb):  # the head and the embedding are one DTensor, as they were one tensor
        model.lm_head.weight = model.tok_emb.weight
    for block in filter(_held, model.blocks):
        if block.depth is None:
            parallelize_module(block, mesh, _sequence_plan(block))
        else:
            parallelize_module(block, mesh, _replicated_plan(block))
            # on the router the whole block runs through, inside the block's activation checkpoint
            # (Block.forward): the checkpoint keeps this rank's shard and gathers it again
            block.depth.register_forward_pre_hook(partial(_gather_sequence, mesh))
            block.depth.register_forward_hook(partial(_cut_sequence, mesh))


def _held(module: nn.Module) -> bool:
    """Whether this rank holds `module`'s weights (not hollowed for another pipeline stage)."""
    return any(True for _ in module.parameters())


def _qk_norm(block: nn.Module) -> dict[str, ParallelStyle]:
    """qk_norm's gains on this rank's heads ([B, T, kv heads, group, head_dim]: heads on dim 2)."""
    if block.attn.q_norm is None:
        return {}
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {"attn.q_norm": heads, "attn.k_norm": heads}


def _sequence_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """A block whose residual stream stays sharded over the sequence (module docstring)."""
    sequence = (Shard(1),)  # the residual stream's layout between blocks: [B, T/tp, D] on each rank
    others = (None, None, None, None)  # attention's rope, mask, cache, layer
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(*sequence, *others), desired_input_layouts=(Replicate(), *others)),
        "attn.qkv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        **_qk_norm(block),
    }
    if "moe" in block.kind:  # distributed/expert.py
        return plan
    return {
        **plan,
        "ffn": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "ffn.w1": ColwiseParallel(),
        "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _replicated_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """A Mixture-of-Depths block, on the whole sequence on every rank (module docstring)."""
    plan = {
        "attn_norm": _Replicated(),
        "attn.qkv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "ffn_norm": _Replicated(),
        "depth.router": _Replicated(),
        "depth.predictor": _Replicated(),
        **_qk_norm(block),
    }
    if "moe" in block.kind:
        return plan
    return {**plan, "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(), "ffn.w2": RowwiseParallel()}


class _Replicated(ParallelStyle):
    """Replicated weights computing on activations every rank holds whole (torchtitan's
    NoParallel): their gradients are whole on every rank too."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_as_replicated, output_fn=_to_local)


def _as_replicated(_module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    return tuple(
        DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if isinstance(t, Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def _to_local(_module: nn.Module, output: Tensor, _mesh: Any) -> Tensor:
    return output.to_local() if isinstance(output, DTensor) else output


def _gather_sequence(mesh: Any, _block: nn.Module, args: tuple) -> tuple:
    """A replicated block's input: this rank's [B, T/tp, D] -> the whole [B, T, D] on each rank."""
    x = DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False)
    return (x.redistribute(mesh, [Replicate()]).to_local(), *args[1:])


def _cut_sequence(mesh: Any, _block: nn.Module, _args: tuple, y: Tensor) -> Tensor:
    """A replicated block's output [B, T, D] -> this rank's [B, T/tp, D] (no communication)."""
    return DTensor.from_local(y, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()
