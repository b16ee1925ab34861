"""How to lay a run out over N GPUs: the mesh (pipeline stages, tensor-parallel size,
expert-parallel size, data-parallel strategy), the micro-batch and activation checkpointing, with the memory each GPU
holds and an estimated step time; `trimtab plan --gpu H100 --gpus 64` and `trimtab doctor` print
it (docs/distributed.md; as text: layout_text.py).

Every layout trimtab can run is tried (tp in 1, 2, 4, 8 within a node where the model splits;
pp in 1, 2, 4, 8, 16 up to the layer count; for MoE models ep in 1, 2, 4, ... dividing the
replicas and the experts; DDP or FSDP2 over the replicas; checkpointing off, selective or
full) and the fastest that fits is proposed. Per GPU, with P parameters of which P_e are routed experts and R
in the embedding, final norm and head, pp stages, tp tensor-parallel ranks, dp replicas per
stage, ep of them sharing one copy of the experts:

    model state   16 ((P - R) / pp + R) / tp (an end stage holds R), / dp under FSDP, but for
                  the weights every tp rank holds whole (the norms, MoE routers and shared gates,
                  Mixture-of-Depths routers and predictors: distributed/splits.py, rank_params)
                  (plan/memory.py: fp32 weights, gradients, moments;
                  experts split by ep are FSDP-sharded over their dp / ep copies, the rest
                  over all dp replicas: the same share); without FSDP, + 2 (P - R) / pp / tp
                  in bf16 (autocast's copies of the weights)
    FSDP buffers  the largest block gathered twice (this one and the prefetched next) in the
                  compute dtype plus its fp32 gradient (its experts: this rank's 1 / ep of
                  them), and the root (embedding, head) gathered; under pp a stage's whole
                  share instead (pipelining keeps it gathered, its gradients unsharded, from
                  the first backward to the last)
    activations   micro-batch tokens x plan/memory.py's bytes per token on a rank
                  (kept_bytes_per_rank: sequence parallelism splits the norms and the residual
                  stream, / tp, but every rank keeps the gathered inputs its matmuls read and,
                  under selective checkpointing, the row-parallel outputs whole: whole_bytes);
                  under 1F1B the first stage holds pp micro-batches of its L / pp layers: the same

Step time: compute = FLOPs per token x batch tokens / (N x peak x MFU), x RECOMPUTE (MFU: the
trainer's as measured, or plan.mfu: memory.py assumed_mfu)
(full checkpointing 4/3: a second forward; selective 1.05, assumed), plus the pipeline bubble,
compute x (pp - 1) / m for m micro-batches per replica (1F1B: Narayanan et al. 2021, section 2.2). Communication, ring
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

A starting point, not a promise: smaller tensor-parallel matmuls run below that MFU, and a
network other than the reference changes the data-parallel terms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trimtab.config import CHECKPOINTING, RunConfig
from trimtab.distributed.splits import check_tensor_parallel, routed_expert, whole_under_tp
from trimtab.errors import ConfigError
from trimtab.hardware import gpu_named
from trimtab.model.catalog import meta_model
from trimtab.plan.memory import (
    USABLE_FRACTION,
    Hardware,
    activation_width,
    assumed_mfu,
    kept_bytes_per_rank,
    weight_casts,
)

if TYPE_CHECKING:
    from torch import nn

NETWORK = 50e9  # bytes/s per GPU between nodes, each way: 400 Gb/s InfiniBand / RoCE per GPU
BUS_EFFICIENCY = 0.8  # share of the link a ring collective's bus bandwidth reaches
TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4, 8, 16)
# A step's compute under each train.activation_checkpointing, as a multiple of off's: full runs
# the forward again (a third more: forward 1, backward 2); selective runs again only the
# memory-bound ops between matmuls, assumed 5% (not a FLOP count: bandwidth; bench/recompute.py
# measures it, on a CPU so far, docs/planner.md)
RECOMPUTE = {"off": 1.0, "selective": 1.05, "full": 4 / 3}


@dataclass(kw_only=True)
class Layout:
    pp: int  # pipeline stages
    tp: int
    dp: int  # replicas per stage
    ep: int  # replicas sharing one copy of the experts (1: dense, or experts not split)
    strategy: str  # ddp | fsdp
    checkpointing: str  # off | selective | full
    micro_batch_tokens: int  # per rank; 0 when not even one row fits
    accumulation: int  # micro-batches per replica per step
    state_bytes: int  # per GPU
    buffer_bytes: int  # FSDP's gathered weights and gradients
    activation_bytes: int
    memory_bytes: int  # the three together
    compute_s: float
    bubble_s: float  # the pipeline's idle time (1F1B)
    pp_comm_s: float
    tp_comm_s: float
    ep_comm_s: float
    dp_comm_s: float  # exposed (not hidden behind compute)
    step_s: float
    mfu: float  # the estimated step's model FLOPs utilisation

    @property
    def fits(self) -> bool:
        return self.micro_batch_tokens > 0

    def settings(self) -> list[str]:
        """--set overrides that give a run this layout."""
        parallel = (
            [f"distributed.strategy={self.strategy}", f"distributed.tp={self.tp}"] if self.tp * self.dp > 1 else []
        )
        parallel += [f"distributed.pp={self.pp}"] if self.pp > 1 else []
        parallel += [f"distributed.ep={self.ep}"] if self.ep > 1 else []
        return parallel + [
            f"train.micro_batch_tokens={self.micro_batch_tokens}",
            f"train.activation_checkpointing={self.checkpointing}",
        ]


@dataclass(kw_only=True)
class LayoutPlan:
    gpus: int
    gpus_per_node: int
    gpu: str
    link: float  # bytes/s inside a node
    network: float  # bytes/s between nodes
    best: Layout | None
    candidates: list[Layout]  # every layout tried, fastest that fits first
    reasons: list[str] = field(default_factory=list)  # why the best, and what was ruled out
    gpus_needed: int | None = None  # when nothing fits: the fewest GPUs (a power of two) that would


def plan_layout(cfg: RunConfig, hw: Hardware, gpus_per_node: int = 8) -> LayoutPlan:
    """The layouts of `cfg` over hw.devices GPUs of hw's kind, best first."""
    found = gpu_named(hw.name)
    if found is None or hw.memory_bytes is None or not hw.peak_flops:
        raise ConfigError(f"{hw.name}: a parallel layout needs a GPU of hardware.GPUS (e.g. --gpu H100)")
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    _check_whole_nodes(hw.devices, gpus_per_node)
    shape = _Shape.of(cfg)
    candidates, reasons = _search(cfg, shape, hw, gpus_per_node)
    best = candidates[0] if candidates and candidates[0].fits else None
    per_node, link, network = _links(hw, gpus_per_node)
    plan = LayoutPlan(
        gpus=hw.devices,
        gpus_per_node=per_node,
        gpu=found[0],
        link=link,
        network=network,
        best=best,
        candidates=candidates,
        reasons=reasons,
    )
    if best is None:
        plan.gpus_needed = _gpus_needed(cfg, shape, hw, gpus_per_node)
    return plan


def _check_whole_nodes(gpus: int, per_node: int) -> None:
    """A job over several nodes fills each: torchrun starts --nproc_per_node processes on every node,
    so 12 GPUs on nodes of 8 would launch 16 ranks, not the 12 the layout was planned for."""
    if gpus <= per_node or gpus % per_node == 0:
        return
    divisor = max(n for n in range(1, per_node + 1) if gpus % n == 0)
    raise ConfigError(
        f"--gpus {gpus} spans nodes of --gpus-per-node {per_node} unevenly ({gpus // per_node} full, one of "
        f"{gpus % per_node}), and torchrun starts the same number of processes on every node: pass --gpus "
        f"{gpus - gpus % per_node} or {gpus - gpus % per_node + per_node}, or --gpus-per-node {divisor}"
    )


def _links(hw: Hardware, gpus_per_node: int) -> tuple[int, float, float]:
    """GPUs in a node, the link inside it and the one data-parallel traffic crosses: the network
    when the job spans nodes, else the same link."""
    per_node, link = min(gpus_per_node, hw.devices), gpu_named(hw.name)[1].link
    return per_node, link, NETWORK if hw.devices > per_node else link


def _search(cfg: RunConfig, shape: _Shape, hw: Hardware, gpus_per_node: int) -> tuple[list[Layout], list[str]]:
    """Every layout over hw.devices GPUs, the fastest that fits first; and why sizes were ruled out."""
    per_node, link, network = _links(hw, gpus_per_node)
    candidates, reasons = [], []
    for tp in TP_SIZES:
        why, larger_too = _tp_problem(cfg, tp, hw.devices, per_node)
        reasons += [why] if why else []
        if larger_too:
            break
        if why:
            continue
        for pp in _pipeline_sizes(cfg, shape.n_layers, hw.devices, tp):
            dp = hw.devices // (tp * pp)
            for ep in _expert_sizes(shape, dp):
                for strategy, ckpt in _choices(tp, dp, ep, pp):
                    ep_link = link if ep * tp <= per_node else network
                    mesh = (tp, ep, pp)
                    candidates.append(_layout(cfg, shape, hw, mesh, strategy, ckpt, (link, ep_link, network)))
    candidates.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory_bytes))
    return candidates, reasons


@dataclass(frozen=True)
class _Shape:
    params: int
    experts: int  # routed experts' parameters (P_e)
    blocks: tuple[tuple[int, int, int], ...]  # each block's parameters, those every tp rank holds whole, its experts
    root: int  # embedding, final norm, head
    root_whole: int  # of them, what every tp rank holds whole (the final norm)
    flops_per_token: int
    d_model: int
    n_layers: int
    moe_layers: int
    n_experts: int
    top_k: int

    @classmethod
    def of(cls, cfg: RunConfig) -> _Shape:
        model = meta_model(cfg)
        blocks = [_block_counts(block) for block in model.blocks]
        experts = [sum(w.numel() for w in (m.w1, m.w3, m.w2)) for _, m in model.moe_layers()]
        total = model.num_params()
        in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
        root_whole = sum(p.numel() for n, p in model.named_parameters() if id(p) not in in_blocks and whole_under_tp(n))
        return cls(
            params=total,
            experts=sum(experts),
            blocks=tuple(blocks),
            root=total - sum(b[0] for b in blocks),
            root_whole=root_whole,
            flops_per_token=model.flops_per_token(cfg.data.seq_len),
            d_model=cfg.model.d_model,
            n_layers=cfg.model.n_layers,
            moe_layers=len(experts),
            n_experts=cfg.model.moe.n_experts if experts else 0,
            top_k=cfg.model.moe.top_k if experts else 0,
        )

    def root_share(self, tp: int) -> float:
        """The embedding, final norm and head on one tensor-parallel rank."""
        return (self.root - self.root_whole) / tp + self.root_whole

    def block_share(self, block: tuple[int, int, int], tp: int, ep: int) -> float:
        """A block's parameters on one rank of tp x ep (distributed/splits.py: what is split)."""
        total, whole, experts = block
        return whole + (total - whole - experts) / tp + experts / (tp * ep)

    def rank_params(self, tp: int, ep: int = 1, pp: int = 1) -> float:
        """Parameters one rank of an end stage holds under tp x ep, before FSDP shards them: its
        1 / pp of the blocks and the root."""
        return sum(self.block_share(b, tp, ep) for b in self.blocks) / pp + self.root_share(tp)


def _block_counts(block: nn.Module) -> tuple[int, int, int]:
    """A block's parameters: all, those tensor parallelism leaves whole, its routed experts."""
    named = list(block.named_parameters())
    whole = sum(p.numel() for n, p in named if whole_under_tp(n))
    return sum(p.numel() for _, p in named), whole, sum(p.numel() for n, p in named if routed_expert(n))


def rank_params(cfg: RunConfig, tp: int = 1, ep: int = 1, pp: int = 1) -> int:
    """The parameters the planner counts on one rank of `cfg`'s model under tp x ep (x pp: an end
    stage's), before FSDP shards them over the replicas: what each rank's model holds after
    distributed/tensor.py and expert.py split it."""
    return round(_Shape.of(cfg).rank_params(tp, ep, pp))


def _tp_problem(cfg: RunConfig, tp: int, gpus: int, per_node: int) -> tuple[str, bool]:
    """Why `tp` cannot be used here ('' when it can), and whether every larger size is ruled out too."""
    if tp > gpus:
        return "", True  # not a choice on this many GPUs: nothing to explain
    if tp > per_node or gpus % tp:
        return f"tp={tp} and more: tensor-parallel groups stay inside a node of {per_node} GPUs", True
    # pipeline stages divide the replicas further: only when no pp size leaves each a row is tp out
    if not _pipeline_sizes(cfg, cfg.model.n_layers, gpus, tp):
        return (
            f"tp={tp}: {gpus // tp} replicas would share train.batch_tokens={cfg.train.batch_tokens:,}, "
            f"less than one row of {cfg.data.seq_len:,} tokens each (with every pipeline size up to "
            f"{_largest_pp(cfg.model.n_layers)} stages too)"
        ), False
    if tp == 1:
        return "", False
    resolved = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.data.bpe_vocab_size)
    try:
        check_tensor_parallel(resolved, tp)
    except ConfigError as exc:  # layer kinds and qk_norm rule out every size; a divisor only this one
        return str(exc), "must divide" not in str(exc)
    return "", False


def _expert_sizes(model: _Shape, dp: int) -> list[int]:
    """ep sizes to try: 1, and for a MoE model the powers of two dividing the replicas and the
    experts."""
    sizes, ep = [1], 2
    while model.moe_layers and ep <= dp and dp % ep == 0 and model.n_experts % ep == 0:
        sizes.append(ep)
        ep *= 2
    return sizes


def _largest_pp(n_layers: int) -> int:
    """The most pipeline stages tried for a model of n_layers (one stage a layer at most)."""
    return max(pp for pp in PP_SIZES if pp <= n_layers)


def _pipeline_sizes(cfg: RunConfig, n_layers: int, gpus: int, tp: int) -> list[int]:
    """pp sizes to try: dividing the GPUs left after tp, at most one stage a layer, and each
    stage's replicas still holding a row of the batch."""
    return [
        pp
        for pp in PP_SIZES
        if pp <= n_layers and gpus % (tp * pp) == 0 and gpus * cfg.data.seq_len <= cfg.train.batch_tokens * tp * pp
    ]


def _choices(tp: int, dp: int, ep: int, pp: int) -> list[tuple[str, str]]:
    """(strategy, checkpointing) pairs: one replica needs no data parallelism (ddp stands for
    none, fsdp under pipeline stages), and tensor, expert or pipeline parallelism with several
    replicas runs under FSDP2 only (distributed/mesh.py)."""
    strategies = ["fsdp"] if pp > 1 else ["ddp"] if dp == 1 else ["fsdp"] if tp > 1 or ep > 1 else ["ddp", "fsdp"]
    return [(s, ckpt) for s in strategies for ckpt in CHECKPOINTING]


def _layout(
    cfg: RunConfig,
    model: _Shape,
    hw: Hardware,
    mesh: tuple[int, int, int],
    strategy: str,
    ckpt: str,
    links: tuple[float, float, float],
) -> Layout:
    """One layout's memory and step time (module docstring). mesh: (tp, ep, pp); links: bytes/s
    of the tensor-parallel group, the expert-parallel group and the data-parallel traffic (the
    pipeline's too)."""
    tp, ep, pp = mesh
    dp, p = hw.devices // (tp * pp), activation_width(hw.precision)
    fsdp = strategy == "fsdp" and dp > 1
    state, buffer = _held_bytes(model, mesh, dp, fsdp, p)
    per_token = sum(kept_bytes_per_rank(cfg, p, ckpt, tp))
    micro, accumulation = _micro_batch(cfg, hw, dp, state, buffer, per_token)
    flops = model.flops_per_token * cfg.train.batch_tokens
    compute = flops / (hw.devices * hw.peak_flops * assumed_mfu(cfg, hw)[0]) * RECOMPUTE[ckpt]
    bubble = compute * (pp - 1) / max(accumulation, 1)
    traffic = _traffic(cfg, model, (tp, ep, dp, pp), fsdp, ckpt, p)
    pp_comm, tp_comm, ep_comm, dp_comm = _comm_s(traffic, links, fsdp, compute, accumulation)
    step = compute + bubble + pp_comm + tp_comm + ep_comm + dp_comm
    activations = round((micro or cfg.data.seq_len) * per_token)  # what one row would need when none fits
    return Layout(
        pp=pp,
        tp=tp,
        dp=dp,
        ep=ep,
        strategy=strategy,
        checkpointing=ckpt,
        micro_batch_tokens=micro,
        accumulation=accumulation,
        state_bytes=state,
        buffer_bytes=buffer,
        activation_bytes=activations,
        memory_bytes=state + buffer + activations,
        compute_s=compute,
        bubble_s=bubble,
        pp_comm_s=pp_comm,
        tp_comm_s=tp_comm,
        ep_comm_s=ep_comm,
        dp_comm_s=dp_comm,
        step_s=step,
        mfu=flops / (hw.devices * hw.peak_flops * step),
    )


def _held_bytes(model: _Shape, mesh: tuple[int, int, int], dp: int, fsdp: bool, p: int) -> tuple[int, int]:
    """Per GPU of mesh (tp, ep, pp) with dp replicas: the model state and FSDP's gathered weights
    and gradients (0 without FSDP); p: bytes per compute-dtype element (module docstring)."""
    tp, ep, pp = mesh
    # experts split by ep are FSDP-sharded over their dp / ep copies: the same share as / dp
    held, root, shards = model.rank_params(tp, 1, pp), model.root_share(tp), dp if fsdp else 1
    state = round(16 * held / shards) + weight_casts(round(held - root), p, shards)
    gathered = max(model.block_share(b, tp, ep) for b in model.blocks)
    if pp > 1:  # pipelining keeps a stage gathered, gradients unsharded, from its first backward on
        gathered = model.rank_params(tp, ep, pp) - root
    return state, round(gathered * (2 * p + 4) + root * p) if fsdp else 0


def _micro_batch(cfg: RunConfig, hw: Hardware, dp: int, state: int, buffer: int, per_token: float) -> tuple[int, int]:
    """Micro-batch tokens per rank, whole rows of data.seq_len: as many as fit in the GPU's usable
    memory beside state and buffer at per_token bytes each, at most a replica's share of the batch
    (0 when not one fits); and the micro-batches a replica accumulates a step."""
    seq, replica_tokens = cfg.data.seq_len, cfg.train.batch_tokens // dp
    rows = int((hw.memory_bytes * USABLE_FRACTION - state - buffer) // (per_token * seq))
    rows = max(0, min(rows, replica_tokens // seq))
    micro = rows * seq
    return micro, math.ceil(replica_tokens / micro) if micro else 0


def _comm_s(
    traffic: Traffic, links: tuple[float, float, float], fsdp: bool, compute: float, accumulation: int
) -> tuple[float, float, float, float]:
    """The seconds a step's pipeline, tensor-, expert- and data-parallel traffic adds to `compute`:
    ring collectives at BUS_EFFICIENCY of links (as _layout's; module docstring), the data-parallel
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


def _traffic(cfg: RunConfig, model: _Shape, mesh: tuple[int, int, int, int], fsdp: bool, ckpt: str, p: int) -> Traffic:
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
    traffic = _traffic(cfg, _Shape.of(cfg), (tp, ep, dp, pp), fsdp, ckpt, activation_width(precision))
    micro_batches = math.ceil(cfg.train.batch_tokens // dp / cfg.train.micro_budget)
    return {
        "pp": traffic.pp / 2,  # rank 0, the first stage, sends activations only
        "tp": traffic.tp,
        "ep": traffic.ep,
        "dp": traffic.dp_per_micro * micro_batches + traffic.dp_once + traffic.tied,
    }


def _gpus_needed(cfg: RunConfig, shape: _Shape, hw: Hardware, gpus_per_node: int) -> int | None:
    """The fewest GPUs, doubling (up to whole nodes: _check_whole_nodes), that some layout fits on
    (None: none up to what the batch's rows can spread over)."""
    n = hw.devices * 2
    while n * cfg.data.seq_len <= cfg.train.batch_tokens * max(TP_SIZES) * max(PP_SIZES):
        whole = -(-n // gpus_per_node) * gpus_per_node if n > gpus_per_node else n
        candidates, _ = _search(cfg, shape, dataclasses.replace(hw, devices=whole), gpus_per_node)
        if candidates and candidates[0].fits:
            return whole
        n *= 2
    return None
