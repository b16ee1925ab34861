"""The trainer's view of parallelism under torchrun: environment, process group and device
mesh, DDP / FSDP2 / tensor-parallel wrapping, and the collectives the step needs.

    torchrun --nproc_per_node 2 -m trimtab train --preset small --set distributed.strategy=fsdp
    torchrun --nproc_per_node 4 -m trimtab train --preset dense-1b --set distributed.tp=2
    torchrun --nproc_per_node 4 -m trimtab train --preset debug-moe --set distributed.tp=2 \
        --set distributed.ep=2

Model code stays single-device. The trainer talks to torch.distributed only through a `Parallel`
object, whose methods are no-ops (or the plain single-process thing) in one process, and hooks use
the module functions `is_main`, `all_max` and `broadcast_object`.

Every rank takes the same decisions because every decision is made from the same numbers: the
step's loss, gradient norm and router statistics are all-reduced on device (no host sync), step
times and memory are reduced to their maximum when the orchestrator reads them, and anything read
from outside (control commands, a checkpoint's validity, the CPU precision timing) is read by rank
0 and broadcast. Host-side agreement (out-of-memory flags, signals, errors) goes through a gloo
group, so NCCL runs add no device sync for it.

The mesh is (edp, ep, tp) (distributed/mesh.py): ranks r with the same r // tp form one
data-parallel replica split by tensor parallelism (distributed/tensor.py). They see the same rows
and compute the same loss, so "over the ranks" below means over the data-parallel replicas (the
dp group); agreement (OOM, signals, errors) is over every rank. Groups of ep replicas split the
MoE experts between them (distributed/expert.py); FSDP2 shards the experts over the edp groups
holding the same ones, everything else over all replicas.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trimtab.config.distributed import DistributedConfig
from trimtab.config.loss_scale import LossScaleConfig
from trimtab.distributed.checkpoint import Checkpoints
from trimtab.distributed.fsdp import ForwardCompletion, ShardedScaler
from trimtab.distributed.group import (
    PeerOutOfMemory,
    all_max,
    attempt_value,
    broadcast_object,
    cpu_group,
    restart_store,
    set_cpu_group,
)
from trimtab.distributed.mesh import Mesh
from trimtab.distributed.work_clock import WorkClock
from trimtab.distributed.wrapping import wrap_model
from trimtab.errors import ConfigError
from trimtab.hardware import is_oom

if TYPE_CHECKING:
    from trimtab.distributed.ft import ReplicaGroups
    from trimtab.distributed.pipeline import Pipeline
    from trimtab.hardware import Precision

# ------------------------------------------------------------------------------ the trainer's view


class Parallel(Checkpoints):
    """What the trainer needs from parallelism; single-process when world == 1."""

    def __init__(
        self,
        cfg: DistributedConfig,
        device: torch.device,
        world: int = 1,
        rank_: int = 0,
        owns_group: bool = False,
        mesh: Mesh | None = None,
    ) -> None:
        self.cfg, self.device, self.world, self.rank = cfg, device, world, rank_
        self.owns_group = owns_group
        self.mesh = mesh or Mesh.single()
        self.dp_world, self.dp_rank = self.mesh.dp, self.mesh.dp_rank(rank_)
        self.ddp: nn.Module | None = None
        # FSDP2 over the replicas: decided here, applied by wrap, so `sharded` holds before the
        # model is wrapped (setup refuses RL and DPO on a sharded model then). Auto with one
        # replica (tensor or pipeline parallelism alone) needs no data-parallel wrapper.
        self.single_replica = self.dp_world == 1 and cfg.strategy == "auto"
        self.fsdp = world > 1 and cfg.data_parallel == "fsdp" and not self.single_replica
        self.experts: list[nn.Parameter] = []  # routed experts split by ep: FSDP2 over edp only
        self.pipeline: Pipeline | None = None  # pp > 1: this rank's stages and their schedules
        self._contexts = ExitStack()  # held for the whole run (tensor parallelism's loss)
        self._signal = 0  # a signal this rank received, not yet agreed (signal number)
        self._agreed = False  # the ranks met before this step's communicating backward
        self.work = WorkClock(device)  # this rank's own work before the agreement points (the straggler rule)
        self._caught: BaseException | None = None  # an OOM a block swallowed this step (FSDP2), told at agree()
        self._told: BaseException | None = None  # the last OOM agree() announced
        self.completion: ForwardCompletion | None = None  # FSDP2: a forward failed on this rank finished for the others
        self.replicas: ReplicaGroups | None = None  # resilience.ft: the step averaged across replica groups
        self.local_sq: torch.Tensor | None = None  # DDP: this rank's own gradient's sum of squares (watch_local)

    @classmethod
    def start(cls, cfg: DistributedConfig, device: torch.device) -> Parallel:
        """Join torchrun's process group (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT in the
        environment) or one set up by the caller; one process otherwise."""
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        mesh = Mesh.of(cfg, world)
        if world == 1:
            return cls(cfg, device)
        if device.type == "mps":
            raise ConfigError("data-parallel training on Apple MPS is not supported; use one process")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        owns = not dist.is_initialized()
        if owns:
            backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
            if backend == "nccl" and device.type != "cuda":
                raise ConfigError(
                    "config key 'distributed.backend' is nccl but training runs on the CPU; use gloo or auto"
                )
            dist.init_process_group(
                backend,
                timeout=timedelta(seconds=cfg.timeout_s),
                device_id=device if backend == "nccl" else None,
                **restart_store(cfg.timeout_s),
            )
        set_cpu_group(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
        if dist.get_rank() != 0:
            logging.getLogger("trimtab").setLevel(logging.ERROR)  # rank 0 speaks for the job
        # DTensor warns on every step that the gradient norm of weights split over two mesh
        # dimensions takes two all-reduces: a few scalars, and every rank gets the same result
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        return cls(cfg, device, world, dist.get_rank(), owns, mesh.build(device))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def find_unused(self) -> bool:
        """DDP's find_unused_parameters: as configured, and always with more than two replicas,
        where DDP must not rebuild its buckets after a process's first step (it never does when
        it looks for unused parameters). A restarted session's first step would all-reduce in the
        initial layout where the undisturbed run used the rebuilt one, and an element's place in
        the buffer decides the order gloo's and NCCL's rings add the ranks' values: with three or
        more, a different rounding, and no exact resume (docs/resilience.md). The graph walk it
        costs measured within noise (debug-moe, 4 ranks: 108 vs 109 ms a step)."""
        return self.cfg.find_unused_parameters or self.dp_world > 2

    @property
    def sharded(self) -> bool:
        """Whether each rank holds part of the model (FSDP2, tensor, expert or pipeline parallelism)."""
        return self.fsdp or self.mesh.tp > 1 or self.mesh.ep > 1 or self.mesh.pp > 1

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            # Every rank reaches the teardown before any tears down: a gloo rank whose peers have
            # already closed their connections can abort in its transport threads ("terminate
            # called without an active exception", seen on 2-process CPU runs).
            dist.barrier(group=cpu_group())
            self._contexts.close()
            dist.destroy_process_group()
            set_cpu_group(None)  # NCCL runs' gloo side group: nothing keeps it past the run
            self.owns_group = False

    # -------------------------------------------------------------- setup: who reads, who writes

    def from_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on rank 0, its result (or its exception) on every rank."""
        if self.world == 1:
            return fn(*args)
        outcome = attempt_value(fn, *args) if self.is_main else None
        ok, value = broadcast_object(outcome)
        if not ok:
            raise value
        return value

    def on_main(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) on rank 0 only (it writes shared files); the others wait for it."""
        self.from_main(fn, *args)

    def main_first(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on rank 0, then on the others: they find rank 0's caches (the tokenizer,
        the tokenized corpus) instead of building them side by side."""
        if self.world == 1:
            return fn(*args)
        if self.is_main:
            ok, value = attempt_value(fn, *args)
            broadcast_object((ok, None if ok else value))  # the others wait here for rank 0
        else:
            ok, value = broadcast_object(None)
        if not ok:
            raise value
        return value if self.is_main else fn(*args)

    def same_precision(self, precision: Precision) -> Precision:
        """The CPU precision is chosen by timing a matmul, which can differ between ranks."""
        name, reason = broadcast_object((precision.name, precision.reason))
        return dataclasses.replace(precision, name=name, reason=reason)

    # -------------------------------------------------------------- wrapping

    def wrap(self, model: nn.Module, compile: bool, precision: Precision) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable the trainer runs forward through: model.hidden, compiled and wrapped for
        tensor and data parallelism. `model` keeps its own parameters' names (checkpoints do not
        change). Under pipeline parallelism the trainer runs self.pipeline instead."""
        return wrap_model(self, model, compile, precision)

    def oom_guarded(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A block's forward that, out of memory, returns its input unchanged and remembers the
        error: under FSDP2 the other ranks wait in the next block's all-gather, so this one goes
        on through every collective of the step (its gradients are garbage) and tells them at
        agree(), where all discard the step and retry it smaller."""

        def guarded(x: torch.Tensor, *args: Any) -> torch.Tensor:
            try:
                return forward(x, *args)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not (is_oom(exc) and torch.is_grad_enabled()):
                    raise
                self._caught = self._caught or exc
                return x.clone()

        return guarded

    def grad_scaler(self, precision: Precision, scale: LossScaleConfig) -> torch.amp.GradScaler | None:
        """fp16's loss scaler (train.loss_scale). Under FSDP each rank sees only its gradient
        shard, so an overflow must be all-reduced for every rank to skip the same steps
        (ShardedGradScaler does)."""
        scaler = precision.grad_scaler(**scale.scaler_args())
        return ShardedScaler(self.device, scale) if scaler is not None and self.sharded else scaler

    # -------------------------------------------------------------- the step

    def step_starts(self) -> None:
        """This rank's step begins: its own work until agree() (WorkClock) is what the straggler rule compares."""
        if self.world > 1:
            self.work.start()

    def step_retried(self) -> None:
        """The step runs again after an out-of-memory error: the retry's own work until its agree()
        counts too (a rank that raised before its agreement point: the failed attempt's as well)."""
        if self.world > 1:
            self.work.stop()
            self.work.start()

    def agree(self) -> str:
        """Every rank meets here before the backward that communicates (the step's last): if one
        ran out of memory earlier in the step, all raise so that all shrink together and retry the
        same rows. Returns the signal any rank received ('' if none), so all stop at one step.

        DDP: every forward runs as under no_sync() (gradients accumulate locally) and the gradient
        all-reduce of the last backward is armed here, after the agreement, as DDP's own forward
        would arm it (reducer.prepare_for_backward): armed in the forward, a rank whose peer ran
        out of memory would all-reduce alone in its next backward. FSDP reduce-scatters every
        micro-batch instead: whole gradients kept until the last one would cost a full copy."""
        if self.world == 1:
            return ""
        caught, self._caught = self._caught, None
        self.work.stop()  # what came before was this rank's own work; the waits start here
        oom, signum = all_max([int(caught is not None), self._signal])
        if caught is not None:
            self._told = caught  # announced here: announce_oom must not call the others again
            raise caught
        if oom:
            raise PeerOutOfMemory("out of memory on another rank; every rank retries with a smaller micro-batch")
        self._agreed, self._signal = True, 0
        if self.ddp is not None:
            from torch.nn.parallel.distributed import _find_tensors

            self.ddp.require_backward_grad_sync = True
            outputs = list(_find_tensors(self.ddp.module.output)) if self.find_unused else []
            self.ddp.reducer.prepare_for_backward(outputs)
        return signal.Signals(int(signum)).name if signum else ""

    def announce_oom(self, exc: BaseException) -> None:
        """This rank ran out of memory: the others wait in agree() to hear it."""
        if self.world == 1 or isinstance(exc, PeerOutOfMemory) or exc is self._told:
            return
        if self._agreed:  # the others are inside the gradient all-reduce and cannot join a retry
            raise RuntimeError(
                f"rank {self.rank} ran out of memory in the backward that synchronises "
                "gradients; lower train.micro_batch_tokens"
            ) from exc
        all_max([1, self._signal])

    def on_signal(self, name: str) -> str:
        """SIGTERM / SIGINT: stop now in one process; under torchrun the ranks see signals at
        different steps, so the stop waits for the next agree() (the returned reason is then '')."""
        self._signal = self._signal or signal.Signals[name].value  # an evaluation under way reads it (signalled)
        return name if self.world == 1 else ""

    def signalled(self) -> str:
        """The stop signal this rank received, not yet agreed ('' if none): an evaluation under way gives way
        to the stop's save (training/evaluation.py sharded_loss)."""
        return signal.Signals(self._signal).name if self._signal else ""

    def agree_signal(self) -> str:
        """The stop signal any rank received, not yet agreed ('' if none), every rank asking at once: after an
        evaluation that failed (its error agreed), so a stop it left off for is taken at this step on every rank,
        where a rank not signalled had tried the run's last evaluation again and journaled an eval_error."""
        if self.world == 1:
            return self.signalled()
        (signum,) = all_max([self._signal])
        self._signal = self._signal or int(signum)  # this rank's evaluations give way too from here
        return signal.Signals(int(signum)).name if signum else ""

    def reduce_step(
        self, loss: torch.Tensor, aux: torch.Tensor | None, routers: Any, model: nn.Module, rows: Any = None
    ) -> None:
        """Sum every replica's share of the step's loss, auxiliary loss, router statistics and
        per-row losses (training.runtime.RowLosses: each replica fills its own rows' places), in
        place and in one all-reduce on device (no host sync). Each share is already weighted by
        the global target count, so the sums are the single-process values."""
        self._agreed = False
        if self.mesh.tp > 1 and not self.fsdp:
            _replicate_grads(model)
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = False
            self.ddp.module.output = None
        loads = [layer.load for _, layer in model.moe_layers() if layer.load.device.type != "meta"]
        step = [loss] + ([aux] if aux is not None else []) + _router_tensors(routers)
        step += [rows.values] if rows is not None else []
        if self.pipeline is not None:  # each stage holds its own layers' telemetry, the last the loss
            self.pipeline.sum_tied_grads()
            _sum_in_place(step, self.mesh.step_group)
            step = []
        if self.dp_world > 1:
            _sum_in_place(step + loads, self.mesh.dp_group)
        if self.replicas is not None:  # and across torchft's replica groups (rank r with rank r)
            self.replicas.average(step + loads + [p.grad for p in model.parameters() if p.grad is not None])

    def watch_local(self) -> torch.Tensor | None:
        """Start measuring this rank's own gradient in the coming backward (DDP, where the
        gradient is all-reduced inside the backward and no rank's own survives it): its sum of
        squares, on device, filled by the all-reduce hook; None where nothing is all-reduced so."""
        if self.ddp is None:
            return None
        self.local_sq = torch.zeros((), device=self.device)
        return self.local_sq

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The replicas' mean of a 0-d device tensor. Every replica evaluates the same held-out
        rows, so this changes nothing, unless one replica's weights went bad alone (a fault in one
        GPU's memory): then all see the NaN and the orchestrator diagnoses it alike everywhere."""
        return self.sum_over_ranks(value) / self.dp_world

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The data-parallel replicas' sum of a device tensor (each one's share of something
        sharded); the tensor-parallel ranks of a replica hold the same value already."""
        if self.dp_world > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.mesh.dp_group)
        return value

    def sum_over_world(self, value: torch.Tensor) -> torch.Tensor:
        """Every rank's sum of a tensor (each rank's share of something the ranks hold between
        them: a sharded model's dot product, training/gain.py), on this rank's device."""
        value = value.to(self.device, copy=True)  # CPU offload dots on the CPU; NCCL reduces on the GPU
        if self.world > 1:
            dist.all_reduce(value)
        return value

    def completing_forward(self) -> AbstractContextManager[None]:
        """Around a forward that may fail on this rank alone (an evaluation's): under FSDP2 the
        failure first joins the all-gathers the other ranks' forward still makes, so that they
        reach the agreement after it (first_error) rather than wait for this rank until the watchdog."""
        return self.completion.guard() if self.completion is not None else nullcontext()

    def first_error(self, error: str, what: str = "evaluation") -> str:
        """`error`, or another rank's when this one has none: every rank learns that one failed
        (an all-reduce of a flag; the words are this rank's, or a note naming the other's `what`)."""
        if self.world == 1:
            return error
        flag = torch.tensor([float(bool(error))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return error or (f"another rank's {what} failed (its log says why)" if flag.item() else "")

    def clip_grad_norm(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Pre-clip global gradient norm, the same on every rank (DTensors: over all shards)."""
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        from torch.distributed.tensor import DTensor

        # DTensor ops take one mesh at a time: the experts (ep) apart from the rest (dp, tp)
        groups: dict[Any, list[nn.Parameter]] = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        norms = []
        for group in groups.values():
            counted = [p.grad for p in group if not (self.pipeline and self.pipeline.duplicate(p))]
            norm = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=self.device)
        if self.pipeline is not None:  # each stage's weights: the squares summed over the stages
            norm = norm.square()
            dist.all_reduce(norm, group=self.pipeline.group)
            norm = norm.sqrt()
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def all_finite(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether every weight is finite on every rank (a checkpoint's health; one read)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        finite = torch.stack([torch.isfinite(p).all() for p in local if p.numel()]).all()
        if self.world > 1:
            finite = finite.float().to(self.device)  # on the backend's device (CPU offload keeps weights on the CPU)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite)


def _replicate_grads(model: nn.Module) -> None:
    """Tensor parallelism leaves the gradient of a replicated weight that saw only this rank's
    part of the sequence (the sequence-parallel norms) as a partial sum: all-reduce it, so the
    optimizer and the gradient norm see the whole one (FSDP2 does this in its reduce-scatter)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


def _sum_in_place(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum each tensor over the ranks of `group`, in place, in one all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _router_tensors(routers: Any) -> list[torch.Tensor]:
    """The step's router telemetry (training.runtime.RouterStats): summed over ranks, with each
    MoE layer's load since the last bias update, so that the balancing bias and the
    orchestrator's MoE decisions are the same everywhere."""
    out: list[torch.Tensor] = []
    moe = getattr(routers, "moe", None)
    if moe is not None:
        out += [*moe.counts, moe.means]
    mod = getattr(routers, "mod", None)
    if isinstance(mod, torch.Tensor) and mod.numel():
        out.append(mod)
    return out
