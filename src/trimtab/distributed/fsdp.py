"""FSDP2 (fully_shard) over the model, as `distributed.strategy: fsdp` applies it, and fp16's loss
scaler over sharded gradients (distributed/wrapping.py calls the one, `Parallel.grad_scaler` the other)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trimtab.config.loss_scale import LossScaleConfig
from trimtab.distributed.mesh import Mesh

if TYPE_CHECKING:
    from trimtab.distributed.parallel import Parallel
    from trimtab.hardware import Precision

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fully_shard_model(parallel: Parallel, model: nn.Module, compile: bool, precision: Precision) -> None:
    """FSDP2 over the model: one all-gather per block (a pipeline: this rank's blocks), the root
    (embedding, final norm, tied head) gathered through the step; experts split by ep sharded over
    their own copies; every unit reducing a plain sum (the loss is already global)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    cfg, mesh = parallel.cfg, parallel.mesh
    param_dtype = precision.autocast_dtype if cfg.param_dtype == "auto" else DTYPES[cfg.param_dtype]
    offload = CPUOffloadPolicy(pin_memory=parallel.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    kwargs = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype]),
        reshard_after_forward=cfg.reshard_after_forward,
        offload_policy=offload,
    )
    if parallel.experts:  # split by ep: FSDP2 shards them over their copies (edp), not every replica
        kwargs["shard_placement_fn"] = _expert_placement(parallel.experts, mesh)
    if mesh.tp > 1 or mesh.pp > 1:
        kwargs["mesh"] = mesh["dp"]  # 2D: FSDP2 shards over this stage's / TP rank's replicas
    # one all-gather per block, freed after it (a pipeline: this rank's blocks)
    units = parallel.pipeline.blocks() if parallel.pipeline else list(model.blocks)
    for block in units:
        if compile:
            block.compile()
        elif mesh.tp == 1 and mesh.ep == 1:  # its collectives are at its edges only
            block.forward = parallel.oom_guarded(block.forward)
        fully_shard(block, **kwargs)
    if parallel.pipeline is None and mesh.tp == 1 and mesh.ep == 1:  # a forward's collectives: the units' all-gathers
        parallel.completion = ForwardCompletion(model, units)
    # The rest (embedding, final norm, tied head) stays gathered after the root's forward: the
    # trainer calls model.hidden, then reads lm_head.weight for the loss outside any forward.
    roots = parallel.pipeline.modules if parallel.pipeline else [model]
    if parallel.pipeline is not None and param_dtype is not None:
        parallel.pipeline.dtype = param_dtype  # the stages exchange activations in the gathered weights' dtype
    for root in roots:
        fully_shard(root, **{**kwargs, "reshard_after_forward": False})
    if parallel.pipeline is None:
        register_fsdp_forward_method(model, "hidden")
    for unit in [*units, *roots]:
        unit.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is already global
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        unit.set_reduce_scatter_unused_params(True)  # a block skipped after an OOM still reduces (zeros)


class ForwardCompletion:
    """A forward that failed on this rank alone (an evaluation's: a record the model cannot take)
    is finished here, collectives-wise: the other ranks are inside the same forward, waiting in
    the next unit's all-gather, so this rank joins every all-gather they make (the root's, if it
    had not begun, then each block's it had not entered) before it says so at the evaluation's
    agreement (Parallel.first_error) instead of leaving them to the watchdog."""

    def __init__(self, root: nn.Module, units: list[nn.Module]) -> None:
        self.root, self.units = root, units
        self.entered: set[int] = set()  # the units whose all-gather this forward made
        for unit in units:  # after FSDP2's own pre-hook (prepended): its all-gather is done
            unit.register_forward_pre_hook(self._enter)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.entered.add(id(module))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self.entered.clear()
        try:
            yield
        except Exception:
            self._complete()
            raise

    def _complete(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.tensor import DTensor

        if isinstance(self.root.tok_emb.weight, DTensor):  # failed before the root's all-gather
            self.root.unshard()  # kept gathered after a forward, as on the others
        for unit in self.units:
            if id(unit) not in self.entered:
                unit.unshard()
            unit.reshard()
        # A forward cut short leaves FSDP2 mid-forward (its post-forward never ran): the next one
        # would skip the root's set-up (its stream waits) and its post-backward hooks. Idle, as after one that ended.
        for module in (self.root, *self.units):
            state = module._get_fsdp_state()
            state._training_state = TrainingState.IDLE
            state._state_ctx.iter_forward_root = None
            for group in state._fsdp_param_groups:
                group._training_state = TrainingState.IDLE


def _expert_placement(experts: list[nn.Parameter], mesh: Mesh) -> Callable[[nn.Parameter], Any]:
    """fully_shard's shard_placement_fn: the experts split by ep are sharded over the edp copies
    of each expert group (their own FSDP mesh), on the expert dimension when each copy gets
    whole experts, else on d_model (torchtitan does the same); None: the default for the rest."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    info = FSDPMeshInfo(mesh=mesh["edp"], shard_mesh_dim=0)
    ids = {id(p) for p in experts}

    def place(p: nn.Parameter) -> Any:
        if id(p) not in ids:
            return None
        whole = p.to_local().shape[0] % mesh.edp == 0
        return ShardPlacementResult(Shard(0) if whole else Shard(1), info)

    return place


class ShardedScaler(torch.amp.GradScaler):
    """GradScaler whose inf/NaN check covers every rank's shard. (torch's ShardedGradScaler
    does the same but keeps found_inf 1-element, which fused AdamW's 0-d step counts reject.)"""

    def __init__(self, device: torch.device, scale: LossScaleConfig) -> None:
        super().__init__(device.type, **scale.scaler_args())
        self.comm_device = device

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            agreed = found.to(self.comm_device)  # NCCL wants it on the GPU (CPU offload: it is not)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            found.copy_(agreed)
