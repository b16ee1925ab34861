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
compute x (pp - 1) / m for m micro-batches per replica (1F1B: Narayanan et al. 2021, section 2.2),
plus communication (plan/traffic.py: ring collectives at 80% of the link, tensor-parallel
groups inside a node, replicas and stages across nodes on a 400 Gb/s NIC per GPU).

A starting point, not a promise: smaller tensor-parallel matmuls run below that MFU, and a
network other than the reference changes the data-parallel terms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trimtab.config import CHECKPOINTING, RunConfig
from trimtab.distributed.splits import check_tensor_parallel
from trimtab.errors import ConfigError
from trimtab.hardware import gpu_named
from trimtab.plan.memory import (
    USABLE_FRACTION,
    Hardware,
    activation_width,
    assumed_mfu,
    kept_bytes_per_rank,
    weight_casts,
)
from trimtab.plan.shape import ModelShape
from trimtab.plan.traffic import NETWORK, comm_seconds, traffic_of

if TYPE_CHECKING:
    pass

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
    shape = ModelShape.of(cfg)
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


def _search(cfg: RunConfig, shape: ModelShape, hw: Hardware, gpus_per_node: int) -> tuple[list[Layout], list[str]]:
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


def _expert_sizes(model: ModelShape, dp: int) -> list[int]:
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
    model: ModelShape,
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
    traffic = traffic_of(cfg, model, (tp, ep, dp, pp), fsdp, ckpt, p)
    pp_comm, tp_comm, ep_comm, dp_comm = comm_seconds(traffic, links, fsdp, compute, accumulation)
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


def _held_bytes(model: ModelShape, mesh: tuple[int, int, int], dp: int, fsdp: bool, p: int) -> tuple[int, int]:
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


def _gpus_needed(cfg: RunConfig, shape: ModelShape, hw: Hardware, gpus_per_node: int) -> int | None:
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
