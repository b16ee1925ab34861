"""The state a rollback's load replaces, copied to host memory before it (RestorePoint): a load that fails
half-way (a checkpoint file unreadable after it verified, a disk error, a sharded read that fails
after the weights came in) puts it back, so training never goes on from a mix of two states
(docs/resilience.md, "A rollback whose load fails")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from trimtab.errors import TrimtabError
from trimtab.rl.batches import RolloutLoader
from trimtab.training.runtime import rng_state, set_rng_state

if TYPE_CHECKING:
    from trimtab.training.checkpointing import Checkpointing

log = logging.getLogger(__name__)

# the Trainer's attributes a load rebinds (never mutates): the objects themselves are kept
REBOUND = ("optimizer", "loader", "window", "total_steps", "last_saved", "last_good", "best_eval", "best_checkpoint")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a DTensor's shard under FSDP2 and tensor parallelism)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class RestorePoint:
    """What a rollback's load changes in place (the weights, the MoE/MoD knobs and expert counts,
    the RNG, the loss scaler, the row gate) copied to host memory, and what it rebinds (the
    optimizer and loader objects, which _enter_phase builds anew, the TrainState) kept as they are.
    Host memory for one copy of this rank's weights; the optimizer's moments cost nothing (its
    object is kept whole, the load fills a new one)."""

    def __init__(self, trainer: Checkpointing) -> None:
        model = trainer.model
        self.state = replace(trainer.state)
        self.rebound = {name: getattr(trainer, name) for name in REBOUND}
        self.structure = (model.moe_state(), model.mod_state())
        # the tensors themselves too: a load across expert surgery replaces an MoE layer's, while the
        # optimizer kept here holds these
        self.tensors = _tensors(model)
        with torch.no_grad():
            self.weights = {name: _local(t).detach().to("cpu", copy=True) for name, t in _tensors(model).items()}
        self.rng = rng_state()
        self.scaler = trainer.scaler.state_dict() if trainer.scaler else None
        gate = trainer.row_gate
        self.gate = (gate.state_dict(), gate.tables()) if gate is not None else None
        # RL's rollout loader is closed by the load's _enter_phase: a new one takes its position
        self.data = trainer.loader.state_dict() if isinstance(trainer.loader, RolloutLoader) else None

    def put_back(self, trainer: Checkpointing) -> None:
        """The trainer as it was when this was taken."""
        model = trainer.model
        counts = [layer.n_experts for _, layer in model.moe_layers()]
        model.load_moe_state(self.structure[0])  # the expert counts and knobs, then their tensors back in
        model.load_mod_state(self.structure[1])
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                _reinstate(model, name, tensor)
                _local(tensor).copy_(self.weights[name])
        mesh = trainer.dist.mesh  # as _load counts: the whole model's, not a stage's or an expert rank's
        if counts != [layer.n_experts for _, layer in model.moe_layers()] and mesh.pp == 1 and mesh.ep == 1:
            trainer.control.recount()
        trainer.state = replace(self.state)  # a copy: the next attempt may be put back too
        trainer.control.apply_lengths()
        if self.data is not None:
            trainer._enter_phase(self.state.phase)
            trainer.loader.load_state_dict(self.data)
            self.rebound["loader"] = trainer.loader
        for name, value in self.rebound.items():
            setattr(trainer, name, value)
        trainer.control.apply_knobs()
        set_rng_state(self.rng)
        if self.scaler is not None:
            trainer.scaler.load_state_dict(self.scaler)
        if self.gate is not None:
            trainer.row_gate.load_state_dict(*self.gate)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name (the tensors themselves: a copy into them is a restore)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _reinstate(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`tensor` as the model's `name` again, where a resize (load_moe_state) put a new one in its place."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    kind = module._parameters if attr in module._parameters else module._buffers
    if kind.get(attr) is not tensor:
        kind[attr] = tensor


def keep_router_knobs(model: Any, moe: dict[str, dict[str, float]], mod: dict[str, float]) -> None:
    """The MoE and MoD layers' knobs as they were before a rollback restored the checkpoint's (its
    expert counts stay the checkpoint's): like the TrainState knobs (KEPT_ON_ROLLBACK) they are
    the correction, an orchestrator's, a person's or a resume's, not the trouble rolled back from."""
    layers = dict(model.moe_layers())
    for key, knobs in moe.items():
        for name in model.MOE_KNOBS:
            setattr(layers[int(key)], name, knobs[name])
    model.load_mod_state(mod)


def agreed(dist: Any, what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str]:
    """fn(*args) on every rank: (its result, '') where it succeeded on all, else (None or this rank's
    result, why: this rank's error, or a line naming another's `what`). A checkpoint's file unreadable or
    gone, a disk error: TrimtabError (checkpoint_load.py, _dcp_load) or OSError."""
    try:
        result, error = fn(*args), ""
    except (TrimtabError, OSError) as exc:
        result, error = None, str(exc) or type(exc).__name__
        if dist.rank:  # rank 0's own is in the caller's line; another's is an error: the level its log keeps
            log.error("rank %d: %s", dist.rank, error)
    return result, dist.first_error(error, what)
