"""An update's gain: the share of the loss decrease its gradient promised that the update delivered.

Trust-region methods judge a step by rho = actual / predicted reduction (Nocedal & Wright,
Numerical Optimization, 2nd ed., section 4.1); stochastic line searches test the same on the
step's own mini-batch (Armijo's condition; Vaswani et al. 2019, arXiv 1905.09997). Here the
step's batch is scored again after the update and its loss change is set against the first-order
prediction g . (w1 - w0), g the clipped gradient the optimizer used. Along the update the loss is
near a parabola: a step well short of its minimum keeps rho near 1, one that overshoots it falls
towards 0 and below. Measured on the first 15 steps of the debug presets (dense, MoE, MoD, hybrid):
0.6-1.0 at the preset's LR, 0.1-0.25 at 30x it (orchestrator/trends.py AboveStart reads it).

g is the gradient the optimizer applied, after clipping: where clipping scaled it by c < 1 the gain
reads 1/c higher than the true first-order ratio. That is lenient on purpose: divided by c, sound
runs with noisy small batches read 0.34 (batch_tokens 1024: momentum's direction is less this
batch's gradient's), under the threshold; the cost is that a run clipped far below its gradient
norm (grad_clip 0.1) hides an LR 30x too high from the gain (its loss line still sees 100x).

The prediction needs no copy of the weights: g . w1 - g . w0, per-tensor dot products summed in
float64 (their difference is small beside each). The second scoring runs the model as training
does (train mode, no gradient), so MoE capacity, Mixture-of-Depths routing and the jitter are
those of the loss it is compared with; what that forward would leave behind is put back: the
MoE layers' routing load (update_bias reads it once a step) and the random stream (the jitter).

Measured on one process, DDP replicas (whole weights and all-reduced gradients on every rank) and
the sharded layouts whose ranks hold one model between them: FSDP2, tensor and expert parallelism
and their combinations. There each rank dots its own shards (a DTensor's local tensors, its
gradient laid out as its weight: FSDP2's reduce-scatter, Parallel.reduce_step), divided by how many
ranks hold the same elements, and one all-reduce over every rank sums the shares: the same dot
product, and so the same gain, on every rank. Pipeline stages, torchft's replica groups and fp16's
loss scaling are not measured (training/trainer.py `_gain_probe`).

Rows the row gate left out of the update (training/row_gate.py) are out of both losses: their
scores stand in the step's loss, but the gradient never promised them a change, and scored again
after the update they read whatever the update did to garbage (debug at 10x the LR, bad_rows@10:4,
seed 1234: steps 10-13 read -0.41, 0.02, -0.00, 0.04 with their gated rows in, 0.53, 0.46, 0.42,
0.23 on the rows trained; steps 3-9 0.27-0.56). Their verdicts are the row
losses' gated column, summed over the ranks by reduce_step: every rank leaves out its own gated
rows and the sum over ranks is the trained rows' alone, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from trimtab.data import IGNORE_INDEX, MicroBatch, StepBatch

if TYPE_CHECKING:
    from trimtab.training.runtime import RowLosses


def grad_dot_weights(params: Iterable[torch.nn.Parameter], world: int = 1) -> torch.Tensor:
    """sum over the parameters of grad . weight (0-d float64, on device; no host sync). Where the
    `world` ranks hold the model between them (sharded), this rank's share of it: summed over them,
    the whole model's."""
    total = None
    for p in params:
        if p.grad is not None:
            term = torch.dot(_local(p.grad).reshape(-1), _local(p.detach()).reshape(-1)).double()
            holders = _holders(p, world)
            term = term / holders if holders > 1 else term
            total = term if total is None else total + term
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (training/ imports nothing of torch.distributed), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _holders(p: torch.Tensor, world: int) -> int:
    """How many of the `world` ranks hold each element of `p`: a plain tensor is whole on every
    rank; a DTensor's mesh holds one copy, replicated on its Replicate dimensions (tensor
    parallelism's norms and routers), and the ranks outside the mesh hold copies of it (the
    data-parallel replicas of experts split by ep over their own group)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return world
    copies = world // mesh.size()
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


class GainProbe:
    """before() ahead of the optimizer step, after() behind it (gradients still in .grad).
    `sum_over_ranks` sums the ranks' shares of the loss (Parallel.sum_over_ranks); where the
    model is sharded over `world` ranks, `sum_over_world` sums their shares of the dot product."""

    def __init__(
        self,
        model: torch.nn.Module,
        score: Callable,
        sum_over_ranks: Callable,
        device: torch.device,
        world: int = 1,
        sum_over_world: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.model, self.score, self.sum_over_ranks, self.device = model, score, sum_over_ranks, device
        self.world, self.sum_over_world = world, sum_over_world
        self.before_dot: torch.Tensor | None = None

    def before(self) -> None:
        self.before_dot = grad_dot_weights(self.model.parameters(), self.world)

    def after(self, batch: StepBatch, loss: torch.Tensor, rows: RowLosses | None = None) -> torch.Tensor:
        """The update's gain on `batch`, whose loss before the update was `loss` (0-d float32 on
        device; inf or NaN when the update was withheld: nothing was predicted), on the rows the
        update trained: those `rows` marks gated are out of both losses, as of the gradient."""
        # dotted before the scoring forward: FSDP2 leaves the root's weights gathered after it
        predicted = grad_dot_weights(self.model.parameters(), self.world) - self.before_dot
        if self.sum_over_world is not None:  # one all-reduce of the difference: the sum is linear
            predicted = self.sum_over_world(predicted)
        loads = [(layer, layer.load.clone()) for _, layer in self.model.moe_layers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            summed = sum(self.score(self._trained(micro, rows)).double() for micro in batch.micro)
        for layer, load in loads:
            layer.load.copy_(load)
        after = self.sum_over_ranks(summed) / max(batch.n_targets, 1)
        before = loss.double()
        gated = rows.gated_loss() if rows is not None else None
        if gated is not None:  # their scores stand in the step's loss (training/row_gate.py): taken back out
            before = before - gated.double() / max(batch.n_targets, 1)
        return ((after - before) / predicted).float()

    def _trained(self, micro: MicroBatch, rows: RowLosses | None) -> MicroBatch:
        """`micro` with the targets of its rows the row gate left out ignored (on the device: the
        verdicts stay there), as the update's objective had them; itself without a gate."""
        left_out = rows.left_out(micro.rows) if rows is not None else None
        if left_out is None:
            return micro
        targets = micro.targets.to(self.device).masked_fill(left_out.unsqueeze(1), IGNORE_INDEX)
        return replace(micro, targets=targets)
