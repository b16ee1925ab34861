"""The bytes one GPU sends in a step over each dimension of its mesh, and the seconds they add
(plan/layout.py ranks layouts with them; bench/comm.py measures them on CPU): ring
collectives at 80% of the link (what NCCL's bus bandwidth reaches), tensor-parallel groups
inside a node (NVLink), replicas and stages across nodes when the job spans several (the
network: one 400 Gb/s NIC per GPU, the DGX/HGX H100 reference):

    tensor parallel  per layer and micro-batch 4 all-gathers / reduce-scatters of the
                     [tokens, d_model] activations forward and 4 backward (3 more with
                     checkpointing, full or selective: a block's re-run repeats all but the
                     last), each moving (tp-1)/tp of them, and 4 more a step for the
                     embedding's output and the final norm's; on the critical path (measured on
                     CPU to the byte: bench/comm.py)
    expert parallel  per MoE layer and micro-batch 2 all-to-alls forward (dispatch, combine) and
                     2 backward (3 forward with checkpointing) of the replica's tokens x top_k
                     rows of d_model, each sending (ep-1)/ep of them; inside a node when ep x tp
                     GPUs fit in one, else over the network; on the critical path
    pipeline         per micro-batch a stage sends its [tokens / tp, d_model] activations forward
                     and their gradients back, point to point; stages are the outermost
                     dimension, over the network when the job spans nodes; on the critical path
    DDP              one all-reduce of the fp32 gradients, 2 (dp-1)/dp x 4 P / tp bytes, hidden
                     behind the last micro-batch's backward where it can be
    FSDP2            per micro-batch the weights gathered forward and backward in the compute dtype
                     and the fp32 gradients reduce-scattered, (dp-1)/dp x (2 + 2 + 4) P / tp
                     bytes (with ep > 1: P - P_e over the dp replicas, and P_e / ep over the
                     edp = dp / ep copies of the experts, (edp-1)/edp of it), hidden behind
                     compute where it can be; every term over a stage's share of the layers;
                     under pp the backward gather and the reduce-scatter once a step (above).
                     A tied embedding's gradient, 4 R / (tp dp), is summed between the end stages
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trimtab.config import RunConfig
from trimtab.plan.memory import activation_width
from trimtab.plan.shape import ModelShape

NETWORK = 50e9  # bytes/s per GPU between nodes, each way: 400 Gb/s InfiniBand / RoCE per GPU
BUS_EFFICIENCY = 0.8  # share of the link a ring collective's bus bandwidth reaches


def comm_seconds(
    traffic: Traffic, links: tuple[float, float, float], fsdp: bool, compute: float, accumulation: int
) -> tuple[float, float, float, float]:
    """The seconds a step's pipeline, tensor-, expert- and data-parallel traffic adds to `compute`:
    ring collectives at BUS_EFFICIENCY of links (module docstring), the data-parallel
    share only where it is not hidden behind the accumulation micro-batches' compute."""
    link, ep_link, network = links
    pp_comm = (traffic.pp + traffic.tied) / (network * BUS_EFFICIENCY)
    tp_comm = traffic.tp / (link * BUS_EFFICIENCY)
    ep_comm = traffic.ep / (ep_link * BUS_EFFICIENCY)
    dp_bus = network * BUS_EFFICIENCY
    if fsdp:  # hidden behind each micro-batch's compute where it can be
        per_micro = traffic.dp_per_micro / dp_bus
        dp_comm = max(0.0, per_micro - compute / max(accumulation, 1)) * max(accumulation, 1)
        dp_comm += traffic.dp_once / dp_bus
    else:  # once: the last backward's all-reduce, overlapped with that backward (2/3 of it)
        dp_comm = max(0.0, traffic.dp_once / dp_bus - compute / max(accumulation, 1) * 2 / 3)
    return pp_comm, tp_comm, ep_comm, dp_comm


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends in a step over each dimension's ring collectives (module docstring)."""

    pp: float  # a middle stage's activations to the next stage and gradients to the previous one
    tied: float  # an end stage's share of the tied embedding's gradient, summed with the other end
    tp: float  # sequence-parallel all-gathers and reduce-scatters, every layer
    ep: float  # all-to-all dispatch and combine, every MoE layer
    dp_per_micro: float  # FSDP2: weights gathered forward and backward, gradients reduce-scattered
    dp_once: float  # DDP's gradient all-reduce; under pp FSDP2's backward gather and reduce-scatter


def traffic_of(
    cfg: RunConfig, model: ModelShape, mesh: tuple[int, int, int, int], fsdp: bool, ckpt: str, p: int
) -> Traffic:
    """mesh: (tp, ep, dp, pp); p: bytes per activation (and FSDP-gathered weight) element. A
    GPU of a stage moves its 1 / pp of the layers' traffic."""
    tp, ep, dp, pp = mesh
    replica_tokens = cfg.train.batch_tokens // dp
    # A block's re-run (either checkpointing) gathers and exchanges again up to the last tensor its
    # backward needs: 3 of its 4 tensor-parallel collectives (not the reduce-scatter after w2) and
    # both all-to-alls (the combine's output is what the gates' gradient needs); bench/comm.py
    again = ckpt != "off"
    collectives = model.n_layers / pp * (11 if again else 8) + 4  # + embedding and final norm, fwd and bwd
    tp_bytes = (tp - 1) / tp * replica_tokens * model.d_model * p * collectives
    exchanged = replica_tokens * model.top_k * model.d_model * p * model.moe_layers / pp * (6 if again else 4)
    sends = 2 * replica_tokens * model.d_model * p / tp if pp > 1 else 0.0
    tied = 4 * model.root / (tp * dp) if pp > 1 and cfg.model.tie_embeddings else 0.0  # fp32, shard of dp
    stages = {"pp": sends, "tied": tied, "tp": tp_bytes, "ep": (ep - 1) / ep * exchanged}
    if dp == 1:
        return Traffic(**stages, dp_per_micro=0.0, dp_once=0.0)
    if fsdp:  # experts split by ep: FSDP over their edp copies only
        split, edp = (model.experts / pp, dp // ep) if ep > 1 else (0, 1)
        dense = (dp - 1) / dp * (model.params / pp - split) / tp
        shard = dense + (edp - 1) / edp * split / (tp * ep)
        if pp == 1:
            return Traffic(**stages, dp_per_micro=shard * (2 * p + 4), dp_once=0.0)
        # torch.distributed.pipelining keeps a stage's weights gathered from its first backward
        # and reduce-scatters the gradients once, after the last (set_requires_gradient_sync)
        return Traffic(**stages, dp_per_micro=shard * p, dp_once=shard * (p + 4))
    return Traffic(**stages, dp_per_micro=0.0, dp_once=2 * (dp - 1) / dp * 4 * model.params / (tp * pp))


def step_traffic(cfg: RunConfig, world: int, precision: str = "bf16") -> dict[str, float]:
    """The bytes one GPU sends in a step of `cfg` as configured (its distributed section, micro-
    batch and checkpointing) on `world` processes, per dimension: what bench/comm.py measures."""
    tp, ep, pp = cfg.distributed.tp, cfg.distributed.ep, cfg.distributed.pp
    dp = world // (tp * pp)
    fsdp = cfg.distributed.data_parallel == "fsdp" and dp > 1
    ckpt = cfg.train.activation_checkpointing
    traffic = traffic_of(cfg, ModelShape.of(cfg), (tp, ep, dp, pp), fsdp, ckpt, activation_width(precision))
    micro_batches = math.ceil(cfg.train.batch_tokens // dp / cfg.train.micro_budget)
    return {
        "pp": traffic.pp / 2,  # rank 0, the first stage, sends activations only
        "tp": traffic.tp,
        "ep": traffic.ep,
        "dp": traffic.dp_per_micro * micro_batches + traffic.dp_once + traffic.tied,
    }
