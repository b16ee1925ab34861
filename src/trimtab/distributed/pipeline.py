"""Pipeline parallelism (distributed.pp): each rank holds a run of consecutive layers and the
micro-batches of a step flow through the ranks under torch.distributed.pipelining's schedules
(GPipe, 1F1B; interleaved 1F1B with several stages per rank, Narayanan et al. 2021).

    S = pp * v stages (v = distributed.pp_stages_per_rank); stage s runs blocks cuts[s]:cuts[s+1]
    pipeline rank p holds stages p, p + pp, ..., p + (v - 1) * pp (the interleaved loop order)
    stage 0 embeds the tokens; stage S - 1 applies the final norm, and the loss (the vocabulary
    projection, fused and chunked: training/loss.py) is the schedule's loss_fn on its output

The model object keeps its whole structure on every rank: the blocks of other ranks' stages are
hollowed (their tensors moved to the meta device and unregistered), so parameter names and
checkpoints (DCP reshards by name), layer indices and every MoE / MoD layer's knobs read by the
orchestrator are those of one process, while memory holds only this rank's layers.

Micro-batches: a schedule sizes its send/receive buffers once, so a step's micro-batches are
padded to one shape (extra rows and columns carry ignored targets) and a schedule is kept per
shape. Auxiliary losses (MoE balance and z, MoD predictor) arise inside a stage, far from the
loss: each stage attaches its own to its output with their weight in the objective (Megatron-LM's
MoEAuxLossAutoScaler), so the backward through the output reaches them. With tied embeddings the
first and last stage each hold the shared matrix and sum its gradient between them before the
update (Megatron-LM's embedding group), so both copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trimtab.config.distributed import DistributedConfig
from trimtab.data import IGNORE_INDEX
from trimtab.distributed.mesh import Mesh
from trimtab.errors import ConfigError
from trimtab.hardware import is_oom

KEPT_SCHEDULES = 8  # schedules (with their buffers) kept per shape
LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # hidden [B, T, D], targets [B, T] -> summed loss


class Pipeline:
    """This rank's stages of the model and the schedules that run them."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: DistributedConfig, device: torch.device) -> None:
        self.model, self.device, self.cfg = model, device, cfg
        self.loss_sum: LossSum | None = None  # the trainer's loss (summed over targets), set before the first step
        self.dtype = model.tok_emb.weight.dtype  # of the activations between stages (FSDP2 may gather in bf16)
        n_stages, n_layers = mesh.pp * cfg.pp_stages_per_rank, len(model.blocks)
        if n_layers < n_stages:
            raise ConfigError(
                f"distributed.pp={mesh.pp} x pp_stages_per_rank={cfg.pp_stages_per_rank} asks for {n_stages} "
                f"pipeline stages but the model has {n_layers} layers; lower them to at most {n_layers} stages"
            )
        self.pp, self.n_stages = mesh.pp, n_stages
        rank = mesh.pp_rank(dist.get_rank())
        self.ids = [rank + k * mesh.pp for k in range(cfg.pp_stages_per_rank)]
        cuts = stage_cuts([_cost(block) for block in model.blocks], _head_cost(model), n_stages)
        self.tp = mesh.tp
        self.stages = [_Stage(model, range(cuts[s], cuts[s + 1]), s, n_stages, mesh.tp) for s in self.ids]
        self.tied = model.lm_head.weight is model.tok_emb.weight
        self.holds_embedding = self.ids[0] == 0 or (self.tied and self.ids[-1] == n_stages - 1)
        self.hollow_others()
        self.group = mesh["pp"].get_group()
        self.tied_group = _end_stage_group(mesh) if self.tied else None
        self.modules: list[nn.Module] = list(self.stages)  # what the schedules run: stages, FSDP-wrapped or not
        self._schedules: dict[tuple, Any] = {}
        self._step: dict[str, Any] = {}  # the running step: shares, loss scale, routers, losses
        self.oom: BaseException | None = None  # an out-of-memory error a stage of this step caught

    # ------------------------------------------------------------------------------ layout

    def hollow_others(self) -> None:
        """Move every tensor this rank does not run to the meta device, unregistered (again after
        a checkpoint's structure resized a layer)."""
        held = {i for stage in self.stages for i in stage.layers}
        for i, block in enumerate(self.model.blocks):
            if i not in held:
                _hollow(block)
        if not self.holds_embedding:
            _hollow(self.model.tok_emb)
        if self.ids[-1] != self.n_stages - 1:
            _hollow(self.model.norm)
            if not (self.tied and self.holds_embedding):
                _hollow(self.model.lm_head)

    def blocks(self) -> list[nn.Module]:
        """This rank's blocks, in layer order."""
        return [block for stage in self.stages for block in stage.blocks]

    def duplicate(self, p: nn.Parameter) -> bool:
        """Whether `p` is the tied embedding's copy on the last stage (counted once, on the first)."""
        return self.tied and p is self.model.tok_emb.weight and self.ids[0] != 0

    def sum_tied_grads(self) -> None:
        """First and last stage: the shared embedding's gradient summed between them (lookup +
        projection), so both copies take the same update."""
        if self.tied_group is None or not self.holds_embedding:
            return
        grad = self.model.tok_emb.weight.grad
        if grad is None:
            grad = self.model.tok_emb.weight.grad = torch.zeros_like(self.model.tok_emb.weight)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.tied_group)

    # ------------------------------------------------------------------------------ running

    def step(self, micro: list, n_targets: int, routers: Any, loss_scale: torch.Tensor | None) -> tuple:
        """Forward and backward of a step's micro-batches through the pipeline; returns (loss,
        aux): this rank's share of the token-normalised loss (the last stage's, else 0) and of
        the weighted auxiliary losses (its stages' layers), to be summed over ranks."""
        inputs, targets = _stacked(micro, self.device)
        shares = [m.n_targets / n_targets for m in micro]
        loss = torch.zeros((), device=self.device)
        aux = torch.zeros((), device=self.device)
        scale = loss_scale if loss_scale is not None else torch.ones((), device=self.device)
        self._step = {"shares": shares, "scale": scale, "routers": routers, "n": n_targets, "loss": loss, "aux": aux}
        schedule = self._schedule(len(micro), tuple(inputs.shape), train=True)
        try:
            for stage in self.stages:
                stage.calls, stage.step, stage.pipeline = 0, self._step, self
            self._run(schedule, inputs, targets)
        finally:
            for stage in self.stages:
                stage.step = {}
        if self.oom is not None:  # the schedule ran to its end on stand-ins: now this rank says so
            exc, self.oom = self.oom, None
            raise exc
        return loss, aux

    @torch.no_grad()
    def score(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of one micro-batch's targets (0-d), the same on every stage."""
        schedule = self._schedule(1, tuple(inputs.shape), train=False)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.ids[0] == 0 else ()
        last = self.ids[-1] == self.n_stages - 1
        schedule.eval(*args, target=targets if last else None, losses=losses)
        total = losses[0].detach().float() if last else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.group)
        return total

    def _run(self, schedule: Any, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        args = (inputs,) if self.ids[0] == 0 else ()
        last = self.ids[-1] == self.n_stages - 1
        schedule.step(*args, target=targets if last else None, return_outputs=False)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: a micro-batch's summed loss over the step's
        target count (token-normalised, as in one process), times the fp16 loss scale."""
        step = self._step
        try:
            loss = self.loss_sum(hidden, targets) / step["n"]
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            self.oom = self.oom or exc
            return hidden.sum() * 0
        step["loss"] += loss.detach()
        return loss * step["scale"]

    def _eval_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(hidden, targets)

    def _schedule(self, n: int, shape: tuple, train: bool) -> Any:
        """A schedule for n micro-batches of `shape`, built once (its stages infer the activation
        shapes they exchange on first use)."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        key = (n, shape, train)
        if key not in self._schedules and len(self._schedules) >= KEPT_SCHEDULES:
            self._schedules.pop(next(iter(self._schedules)))  # the oldest: variable-length data makes many shapes
        if key not in self._schedules:
            # Shapes given, not inferred: inference would run an extra forward (and count it in
            # the MoE load) when the schedule is built.
            B, T = shape[0] // n, shape[1]
            hidden = torch.empty(
                B, T // self.tp, self.model.cfg.d_model, dtype=self.dtype, device="meta", requires_grad=train
            )
            tokens = torch.empty(B, T, dtype=torch.long, device="meta")
            stages = [
                PipelineStage(m, s, self.n_stages, self.device, tokens if s == 0 else hidden, hidden, group=self.group)
                for s, m in zip(self.ids, self.modules)
            ]
            loss_fn = self._loss if train else self._eval_loss
            kwargs = {"loss_fn": loss_fn, "scale_grads": False}
            if len(stages) > 1:  # interleaved 1F1B needs n a multiple of its rounds (max(1, n // pp))
                rounds = max(1, n // self.pp)
                kind = ScheduleInterleaved1F1B if train and n % rounds == 0 else ScheduleLoopedBFS
                self._schedules[key] = kind(stages, n, **kwargs)
            else:  # 1F1B needs at least one micro-batch per stage; GPipe runs any count
                kind = Schedule1F1B if train and self.cfg.schedule == "1f1b" and n >= self.pp else ScheduleGPipe
                self._schedules[key] = kind(stages[0], n, **kwargs)
        return self._schedules[key]


class _Stage(nn.Module):
    """One pipeline stage: blocks `layers` of the model, with the embedding on the first stage and
    the final norm on the last. Registers the model's own modules, so their parameters are the
    model's (names in checkpoints do not change)."""

    def __init__(self, model: nn.Module, layers: range, index: int, n_stages: int, tp: int) -> None:
        super().__init__()
        self.layers, self.first, self.last = layers, index == 0, index == n_stages - 1
        self.tp = tp  # between stages a tensor-parallel rank holds T / tp positions (sequence parallel)
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        # A tied embedding is registered under both names wherever it is held, so that FSDP2
        # swaps both for its sharded parameter and checkpoints name it as one process does.
        tied = model.lm_head.weight is model.tok_emb.weight
        self.tok_emb = model.tok_emb if self.first or (self.last and tied) else None
        self.norm = model.norm if self.last else None
        self.lm_head = model.lm_head if self.last or (self.first and tied) else None  # the loss reads its weight
        self._model = [model]  # not registered: run_blocks and the RoPE table, not its parameters
        self.calls, self.step, self.pipeline = 0, {}, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (first stage) or hidden [B, T, D] -> hidden [B, T, D]. Out of memory in
        training, it returns zeros and the step goes on: the other stages wait on this one's
        activations and gradients, so the error is raised once the schedule ends, where every
        rank agrees to retry the step with smaller micro-batches (Parallel.agree)."""
        index, self.calls = self.calls, self.calls + 1  # the micro-batch (a stage sees them in order)
        try:
            return self._forward(x, index)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not (self.step and is_oom(exc)):
                raise
            self.pipeline.oom = self.pipeline.oom or exc
            if self.first:  # a leaf that takes the backward
                shape, dtype = (*x.shape, self.tok_emb.embedding_dim), self.pipeline.dtype
                return torch.zeros(shape, dtype=dtype, device=x.device, requires_grad=True)
            return x * 0  # zero gradients flow back to the previous stage

    def _forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        model = self._model[0]
        T = x.shape[1] if self.first else x.shape[1] * self.tp
        if self.first:
            x = self.tok_emb(x)
        x = model.run_blocks(x, self.layers, model.rotary.table(0, T))
        if self.step:  # training: this micro-batch's router statistics and auxiliary losses
            share = self.step["shares"][index]
            self.step["routers"].add(share, only=self.layers)
            routed = [m for b in self.blocks for m in (b.ffn, b.depth)]
            aux = [m.aux_loss for m in routed if getattr(m, "aux_loss", None) is not None]
            if aux:
                total = torch.stack(aux).sum()
                self.step["aux"] += share * total.detach().float()
                x = _AttachAux.apply(x, total, share * self.step["scale"])
        return self.norm(x) if self.last else x


class _AttachAux(torch.autograd.Function):
    """x unchanged, with `aux` joined to its graph: the backward through x also gives aux the
    gradient `weight` (d objective / d aux), as if it were added to the loss (Megatron-LM's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.weight = weight
        return x.clone()  # not a view: FSDP2 hooks its backward on the stage output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux) * ctx.weight, None


def stage_cuts(costs: list[float], head: float, n_stages: int) -> list[int]:
    """Layer boundaries [0, c1, ..., n] cutting the blocks (each `costs[i]`) into `n_stages`
    consecutive runs of about equal cost, the last also paying `head` (the vocabulary
    projection); every stage gets at least one block."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    total, n = prefix[-1] + head, len(costs)
    cuts = [0]
    for s in range(1, n_stages):
        lo, hi = cuts[-1] + 1, n - (n_stages - s)
        cuts.append(min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - total * s / n_stages)))
    return cuts + [n]


def _cost(block: nn.Module) -> float:
    """A block's training FLOPs per token, up to a constant: its matrices' weights, a MoE layer's
    routed experts counted for the top_k a token uses."""
    cost = float(sum(p.numel() for p in block.parameters() if p.dim() >= 2))
    ffn = block.ffn
    if hasattr(ffn, "top_k"):
        routed = sum(w.numel() for w in (ffn.w1, ffn.w2, ffn.w3))
        cost -= routed * (1 - ffn.top_k / ffn.n_experts)
    return cost


def _head_cost(model: nn.Module) -> float:
    return float(model.lm_head.weight.numel())


def _hollow(module: nn.Module) -> None:
    """Every parameter and buffer of `module` replaced by an unregistered meta tensor of its
    shape: no memory, no name in state_dict(), parameters() or the optimizer, but attributes
    (shapes, expert counts) still answer."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name in list(table):
                t = table.pop(name)
                m._non_persistent_buffers_set.discard(name)
                if t is not None:
                    object.__setattr__(m, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))


def _stacked(micro: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches padded to one shape [B, T] and stacked along the rows: [n * B, T]
    inputs and targets (pad: token 0, ignored target), so the schedule cuts them back apart."""
    rows = max(m.inputs.shape[0] for m in micro)
    width = max(m.inputs.shape[1] for m in micro)
    inputs = torch.zeros(len(micro) * rows, width, dtype=torch.long)
    targets = torch.full((len(micro) * rows, width), IGNORE_INDEX, dtype=torch.long)
    for j, m in enumerate(micro):
        b, t = m.inputs.shape
        inputs[j * rows : j * rows + b, :t] = m.inputs
        targets[j * rows : j * rows + b, :t] = m.targets
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def _end_stage_group(mesh: Mesh) -> Any:
    """This rank's group with its peer on the other end of the pipeline (same replica and
    tensor-parallel rank), for the tied embedding; every rank creates every group."""
    per_stage = mesh.dp * mesh.tp
    last = (mesh.pp - 1) * per_stage
    group, _ = dist.new_subgroups_by_enumeration([[r, last + r] for r in range(per_stage)])
    return group
