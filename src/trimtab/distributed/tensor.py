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
(training/loss.py: vocabulary-parallel cross entropy, loss_parallel).

Requirements, checked with a clear error: n_kv_heads, ffn_hidden and vocab_size divisible by tp
(the fused projection is grouped per kv head: model.layers.group_qkv). Mixture-of-Experts layers
are split by distributed/expert.py (every rank routes the whole sequence, each computes a slice
of every expert). Mixture-of-Depths layers are not tensor-parallel yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from trimtab.distributed.expert import check_moe_parallel
from trimtab.errors import ConfigError

if TYPE_CHECKING:
    from trimtab.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """A ConfigError naming the setting of the (resolved) model config that does not split over
    `tp` ranks. The planner asks the same question (plan/layout.py)."""
    sizes = {"model.n_kv_heads": cfg.n_kv_heads, "model.ffn_hidden": cfg.ffn_hidden, "model.vocab_size": cfg.vocab_size}
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(f"distributed.tp={tp} must divide {key} ({size}); lower distributed.tp")
    if cfg.qk_norm:
        raise ConfigError(
            f"distributed.tp={tp}: model.qk_norm is not tensor-parallel yet (its norms see each rank's "
            "heads); use distributed.tp=1"
        )
    check_moe_parallel(cfg, tp, 1)
    kinds = sorted({kind for kind in cfg.layers if "mod" in kind})
    if kinds:
        raise ConfigError(
            f"distributed.tp={tp}: the model has {', '.join(kinds)} layers, which are not tensor-parallel "
            "yet; train it with data parallelism (distributed.strategy=fsdp) and distributed.tp=1"
        )


def apply_tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """Shard `model`'s weights over the 1-D tensor-parallel `mesh` in place (DTensor parameters
    under their own names, so checkpoints reshard between meshes), all but the MoE layers'
    (distributed/expert.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tensor_parallel(model.cfg, mesh.size())
    tied = model.cfg.tie_embeddings
    sequence = (Shard(1),)  # the residual stream's layout between blocks: [B, T/tp, D] on each rank
    parallelize_module(
        model,
        mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            # the final norm's output is gathered over the sequence (a replicated DTensor): the
            # loss multiplies every token by this rank's vocabulary rows of the head
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False)
    parallelize_module(model.norm, mesh, gather)
    if tied:  # the head and the embedding are one DTensor, as they were one tensor
        model.lm_head.weight = model.tok_emb.weight
    others = (None, None, None, None)  # attention's rope, mask, cache, layer
    dense = {
        "ffn": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "ffn.w1": ColwiseParallel(),
        "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        plan = {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(
                input_layouts=(*sequence, *others), desired_input_layouts=(Replicate(), *others)
            ),
            "attn.qkv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        parallelize_module(block, mesh, plan if "moe" in block.kind else {**plan, **dense})
