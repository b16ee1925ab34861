"""Expert surgery on a live run: add, prune or re-initialise a MoE expert, or reset a collapsed
router row, keeping the optimizer consistent with the parameters it updates.

Adding or pruning an expert replaces the layer's parameter tensors (their first dimension is the
expert count), so the optimizer is rebuilt to hold exactly the live parameters: untouched experts
keep their AdamW moments, an added expert's weights start from its source's (its router row from
zero: the source's were built by the source's load, see expert_surgery), a re-initialised one (a
copy of the busiest, MoE.reinit_expert) from zero (optim.carry_state). A router reset works in
place and zeroes only that row's moments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trimtab.errors import ConfigError
from trimtab.model.moe import MoE
from trimtab.training.optim import carry_state

Optimizer = torch.optim.Optimizer


def moe_layer(model: torch.nn.Module, layer: int, world: int, ep: int = 1, tp: int = 1, pp: int = 1) -> MoE:
    """MoE layer `layer`, refused under torchrun (DDP buckets and FSDP shards are laid out for the
    old parameters, experts split by ep or tp would need re-sharding, and a reset's noise would
    differ between ranks)."""
    if world > 1:
        split = (
            f"the experts are split over distributed.ep={ep} ranks"
            if ep > 1
            else f"their weights are split by distributed.tp={tp}"
            if tp > 1
            else f"the layers are split over distributed.pp={pp} pipeline stages"
            if pp > 1
            else "DDP buckets and FSDP shards are laid out for the old parameters"
        )
        raise ConfigError(
            f"expert surgery is not supported across {world} processes yet ({split}); run it in one process"
        )
    moe = dict(model.moe_layers()).get(layer)
    if moe is None:
        layers = [i for i, _ in model.moe_layers()]
        raise ConfigError(f"layer {layer} is not a MoE layer (MoE layers: {layers or 'none'})")
    return moe


def expert_surgery(
    moe: MoE, optimizer: Optimizer, rebuild: Callable[[], Optimizer], op: str, expert: int | None
) -> tuple[Optimizer, str]:
    """`op` (add / prune / reinit) on `moe`; returns the rebuilt optimizer and what changed.

    An added expert's router row starts from zero moments, its weights from its source's: the
    source's router moments carry the push its own load gave it (an overloaded expert's row is
    pushed down by the balance loss), which is no record of the copy's (as reset_router). With
    them, a split collapsed expert's copy, its bias mid-pack (MoE.add_expert), took 1.2% of
    assignments over the next 29 steps (debug-moe, fair share 11%); without, 6%, at 7-12% from
    10 steps on."""
    if expert is not None and not 0 <= expert < moe.n_experts:
        raise ConfigError(f"the layer has experts 0..{moe.n_experts - 1}, not {expert}")
    before = {name: getattr(moe, name) for name in ("router", "w1", "w2", "w3")}
    n, router_rows, copied = moe.n_experts, None, ""  # the router's rows, where they are not the weights'
    if op == "add":
        expert = moe.add_expert(expert)
        rows, router_rows = [*range(n), _source_of(moe, before["router"])], [*range(n), None]
    elif op == "prune":
        if n - 1 < moe.top_k:
            raise ConfigError(f"pruning would leave fewer experts than top_k={moe.top_k}")
        moe.prune_expert(expert)
        rows = [i for i in range(n) if i != expert]
    else:
        copied = f" as a copy of expert {moe.reinit_expert(expert)}"
        rows = [None if i == expert else i for i in range(n)]
    rows_of = {name: router_rows if name == "router" and router_rows else rows for name in before}
    replaced = {id(old): (getattr(moe, name), rows_of[name]) for name, old in before.items()}
    new = rebuild()
    carry_state(optimizer, new, replaced)
    return new, f"{op} expert {expert}{copied} ({n} -> {moe.n_experts} experts)"


def reset_router(moe: MoE, optimizer: Optimizer, expert: int) -> str:
    """Re-centre a collapsed expert's router row and selection bias (MoE.reset_router), in place,
    and zero that row's AdamW moments: built while the layer was collapsed, they would push the
    row on as before."""
    if not 0 <= expert < moe.n_experts:
        raise ConfigError(f"reset_router: the layer has experts 0..{moe.n_experts - 1}, not {expert}")
    before = float(moe.expert_bias[expert])
    moe.reset_router(expert)
    state = optimizer.state.get(moe.router, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key][expert].zero_()
    return f"router reset for expert {expert} (bias {before:.3g} -> {float(moe.expert_bias[expert]):.3g})"


def _source_of(moe: MoE, old_router: torch.Tensor) -> int:
    """The expert an added one was copied from: the old router row nearest the new last row."""
    return int((old_router - moe.router[-1].detach()).norm(dim=1).argmin())
