"""A model built on the meta device, to be sharded before it holds any memory, and given afterwards
exactly the weights a one-process build of the same seed draws (distributed/metainit.py does
the sharding part).

A CPU build draws twice from the global generator: each module's own initialiser in its
constructor (nn.Linear's kaiming_uniform_, nn.Embedding's normal_, MoE's normal_), then
Transformer.reset_parameters over named_parameters. The first draws are overwritten, yet they
move the generator, so the meta build replays each of them on a CPU tensor of the parameter's
shape (one at a time, then dropped): the generator ends where a CPU build's constructors leave
it, and `draw_parameters` then draws reset_parameters' values one whole parameter at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trimtab.config import ModelConfig
from trimtab.model.transformer import Transformer

# in-place initialisers (nn.init's and Tensor's) that draw from the generator / that do not
RANDOM = {
    "normal_",
    "uniform_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "trunc_normal_",
    "orthogonal_",
    "sparse_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "random_",
}
CONSTANT = {"fill_", "zero_", "ones_", "zeros_", "constant_", "eye_", "dirac_"}


class _Scratch:
    """One host buffer for each whole parameter drawn in turn, grown to the largest: a fresh
    tensor for each leaves the heap fragmented (the allocator keeps blocks it cannot return), and
    the process grew by 300 MB building a 388 MB model that way, where it was to hold none of it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def like(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        if self.buffer.numel() < size:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed before the new one is taken
            self.buffer = torch.empty(size, dtype=torch.uint8, device="cpu")
        return self.buffer[:size].view(dtype).view(shape)


class _Replay(TorchFunctionMode):
    """Initialisers on meta tensors: a random one runs on a CPU tensor of the same shape and
    dtype when `draw` (the generator moves as in a CPU build; the values are dropped), none runs
    on meta itself (each would cost ~1 ms in meta's Python decompositions, model/catalog.py)."""

    def __init__(self, draw: bool) -> None:
        super().__init__()
        self.draw = draw
        self.scratch = _Scratch()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")
        if name not in RANDOM | CONSTANT or not isinstance(target, torch.Tensor) or not target.is_meta:
            return func(*args, **kwargs)
        if name in RANDOM and self.draw:
            scratch = self.scratch.like(target.shape, target.dtype)
            if args:
                func(scratch, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": scratch})
        return target


def build_on_meta(cfg: ModelConfig, draw: bool = True) -> Transformer:
    """The Transformer cfg describes, every parameter and buffer on the meta device. `draw`: the
    global generator moved as a CPU build's constructors move it (draw_parameters follows);
    False where the weights will be loaded (a resume restores the generator too)."""
    with _Replay(draw), torch.device("meta"):
        return Transformer(cfg.resolved())


Layout = list[tuple[str, torch.Size, torch.dtype]]  # a model's parameters in named_parameters order


def layout(model: nn.Module) -> Layout:
    """Name, global shape and dtype of each of the model's parameters, in the order reset_parameters draws them."""
    return [(name, p.shape, p.dtype) for name, p in model.named_parameters()]


@torch.no_grad()
def draw_parameters(
    model: Transformer, keep: Callable[[nn.Parameter, torch.Tensor], None], whole: Layout | None = None
) -> None:
    """reset_parameters' values for a model whose parameters are sharded: each parameter drawn
    whole on the CPU (its global shape), in named_parameters order, and handed to `keep`, which
    copies this rank's part of it; the host holds one parameter at a time. `whole`: the one-process
    model's layout where this rank no longer registers all of it (a pipeline stage: the other
    stages' layers are hollowed, distributed/pipeline.py): those are drawn too, only to move the
    generator as a one-process build does, and dropped."""
    held = dict(model.named_parameters())
    order = whole if whole is not None else layout(model)
    undrawn = held.keys() - {name for name, _, _ in order}
    if undrawn:  # it would train on to_empty's uninitialised memory
        raise RuntimeError(
            f"parameter {sorted(undrawn)[0]} is not in the model as built on the meta device: it has no initial "
            "values to draw (model/meta.py draw_parameters); a wrapper renamed or added it before materialise"
        )
    scratch = _Scratch()
    for name, shape, dtype in order:
        full = scratch.like(shape, dtype)
        model.init_parameter(name, full)
        if name in held:
            keep(held[name], full)


def reset_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer computed again on `device` (a meta build, materialised with to_empty, holds
    uninitialised memory there). A module holding buffers without a reset_buffers(device) is
    refused, naming the buffer, rather than trained on garbage."""
    for prefix, module in model.named_modules():
        names = [name for name, _ in module.named_buffers(recurse=False)]
        if not names:
            continue
        reset = getattr(module, "reset_buffers", None)
        if reset is None:
            raise TypeError(
                f"buffer {prefix}.{names[0]} ({type(module).__name__}) has no reset_buffers(device): a model built "
                "on the meta device would keep uninitialised memory there; give the module one (model/meta.py)"
            )
        reset(device)
