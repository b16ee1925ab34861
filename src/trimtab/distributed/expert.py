"""Mixture-of-Experts layers across ranks: expert parallelism (GShard, Lepikhin et al. 2020;
DeepSeek-V3, arXiv 2412.19437 section 3.2) and expert tensor parallelism (Megatron-LM's MoE),
applied from outside to the single-device MoE layer (model/moe.py).

Shape legend: M packed assignments this rank routes, R assignments it receives, D d_model,
E experts, E_l = E / ep experts per rank, H expert hidden width.

Expert parallelism, over the `ep` replicas of an expert group (mesh.py): replica j holds experts
j * E_l .. (j + 1) * E_l - 1. Each replica routes its own tokens as one process would (the same
top-k, capacity and drops: the drops are decided before anything moves), packs its kept
assignments by expert, and then

    counts [E] --all-to-all--> received [ep * E_l]     (who sends how many rows to my experts)
    xs [M, D]  --all-to-all--> [R, D], by source then expert --sort by expert--> grouped_mm
                                                                                  SwiGLU
    out [M, D] <--all-to-all-- [R, D] <--unsort--------------------------------------'

The row exchange is torch's differentiable all-to-all (functional collectives), so backward
sends the gradients the same way back. Split sizes are known on the host (one sync per layer,
as Megatron-LM's all-to-all dispatcher and torchtitan). An expert's gradient sums the rows of
its whole group; FSDP2 shards the experts over the edp groups holding the same ones and
reduce-scatters their gradients there (Parallel._fully_shard).

Tensor parallelism of a MoE layer: the sequence-parallel input [B, T/tp, D] is all-gathered,
every tensor-parallel rank routes the whole sequence alike (so the capacity, the drops, the
balance statistics and the aux losses are one process's), and each computes its H / tp slice of
every expert (w1, w3 split by columns, w2 by rows; the shared experts likewise): its output is a
partial sum, reduce-scattered back to [B, T/tp, D] (in a Mixture-of-Depths block, which runs
on the whole sequence, the input is whole already and the output is all-reduced). The router and the shared gate are
replicated; their gradients are partial sums (local_shard) reduced by the parallel code, and the
aux loss, computed alike on every rank, sends 1 / tp of its gradient from each.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from trimtab.config.distributed import check_moe_split
from trimtab.model.moe import MoE, grouped_swiglu

if TYPE_CHECKING:
    from trimtab.distributed.mesh import Mesh


def apply_moe_parallel(model: nn.Module, mesh: Mesh) -> list[nn.Parameter]:
    """Shard every MoE layer of `model` over the mesh's ep and tp dimensions in place (DTensor
    parameters under their own names, so checkpoints reshard between meshes). Returns the routed
    experts' parameters split by ep, in model order (the same on every rank): they are
    data-parallel over the expert groups, not over every replica."""
    check_moe_split(model.cfg, mesh.tp, mesh.ep)
    dims = [name for name, size in (("ep", mesh.ep), ("tp", mesh.tp)) if size > 1]
    experts: list[nn.Parameter] = []
    for i, moe in model.moe_layers():
        if "router" not in moe._parameters:  # hollow: held by another pipeline stage (a meta build's are meta too)
            continue
        moe.local = local_shard
        if moe.shared is not None:
            moe.shared.local = local_shard
        if dims:
            grid = mesh.device_mesh[tuple(dims)] if len(dims) > 1 else mesh.device_mesh[dims[0]]
            for name, hidden in (("w1", 2), ("w3", 2), ("w2", 1)):  # H is dim 2 of w1 / w3, 1 of w2
                placements = ([Shard(0)] if mesh.ep > 1 else []) + ([Shard(hidden)] if mesh.tp > 1 else [])
                _swap(moe, name, distribute_tensor(getattr(moe, name).data, grid, placements))
                if mesh.ep > 1:  # split over tp alone, FSDP2 shards them over dp like any weight
                    experts.append(getattr(moe, name))
        if mesh.tp > 1:
            _tensor_parallel(moe, mesh.device_mesh["tp"], sequence=model.blocks[i].depth is None)
        if mesh.ep > 1:
            moe.dispatch = AllToAll(mesh.device_mesh["ep"].get_group())
    return experts


def local_shard(w: Tensor) -> Tensor:
    """MoE.local under parallelism: this rank's shard of a DTensor weight as a plain tensor. Each
    rank's result is then its partial share wherever w is replicated (it saw its own slice of the
    hidden units), so a replicated weight's gradient is marked partial, to be summed over the
    ranks (_replicate_grads, FSDP2's reduce-scatter); a sharded weight's is its shard's."""
    if not isinstance(w, DTensor):
        return w
    return w.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in w.placements])


def _tensor_parallel(moe: MoE, tp: Any, sequence: bool) -> None:
    """The router, shared experts and input/output layouts of one MoE layer under tensor
    parallelism (module docstring); `sequence`: its input and output are sharded over the
    sequence (else whole on every rank)."""
    replicated = [(moe, "router")] + ([(moe.shared_gate, "weight")] if moe.shared_gate is not None else [])
    for owner, name in replicated:
        _swap(owner, name, distribute_tensor(getattr(owner, name).data, tp, [Replicate()]))
    if moe.shared is not None:  # nn.Linear weights: w1, w3 [H, D] by rows, w2 [D, H] by columns
        for layer, dim in ((moe.shared.w1, 0), (moe.shared.w3, 0), (moe.shared.w2, 1)):
            _swap(layer, "weight", distribute_tensor(layer.weight.data, tp, [Shard(dim)]))
    layout = [Shard(1)] if sequence else [Replicate()]
    moe.register_forward_pre_hook(partial(_gather_input, tp, layout))
    moe.register_forward_hook(partial(_reduce_output, tp, layout))


def _swap(owner: nn.Module, name: str, value: Tensor) -> None:
    old = getattr(owner, name)
    setattr(owner, name, nn.Parameter(value, requires_grad=old.requires_grad))


def _gather_input(tp: Any, layout: list, _module: nn.Module, args: tuple) -> tuple:
    """The input in `layout` ([B, T/tp, D] or [B, T, D] on each rank) -> the whole [B, T, D] on
    each, whose gradient is a partial sum."""
    x = args[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, tp, layout, run_check=False)
    return (x.redistribute(tp, [Replicate()]).to_local(grad_placements=[Partial()]),)


def _reduce_output(tp: Any, layout: list, module: MoE, _args: tuple, y: Tensor) -> Tensor:
    """This rank's partial [B, T, D] -> the sum in `layout` (reduce-scatter or all-reduce); the
    aux loss, computed alike on every rank, keeps its value and sends 1 / tp of its gradient."""
    if module.aux_loss is not None:
        module.aux_loss = _ScaleGrad.apply(module.aux_loss, 1.0 / tp.size())
    return DTensor.from_local(y, tp, [Partial()], run_check=False).redistribute(tp, layout).to_local()


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class AllToAll:
    """MoE.dispatch under expert parallelism: (xs [M, D], counts [E], local w1, w3, w2) -> [M, D],
    the rows' outputs from the ranks that own their experts (module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, xs: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        ep, local = self.size, w1.shape[0]
        received = torch.empty_like(counts)  # [ep * E_l]: rows from source s for my expert e at s * E_l + e
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.view(ep, local).sum(1).tolist()
        rows = all_to_all_single_autograd(xs, recv, send, self.group)  # [R, D] by source, then expert
        expert = torch.arange(local, device=xs.device).repeat(ep).repeat_interleave(received)
        order = expert.argsort(stable=True)  # by expert, sources in rank order within one
        out = grouped_swiglu(rows[order], received.view(ep, local).sum(0), w1, w3, w2)
        back = out[order.argsort()]  # the received order again
        return all_to_all_single_autograd(back, send, recv, self.group)
