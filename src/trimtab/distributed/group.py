"""Process-group helpers every module may use (rank 0 speaks for the job; host numbers agreed
through a gloo group, so NCCL runs add no device sync for them)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_CPU_GROUP: Any = None  # gloo group for host-side agreement; None: the default group (gloo runs)


def cpu_group() -> Any:
    return _CPU_GROUP


def set_cpu_group(group: Any) -> None:
    global _CPU_GROUP
    _CPU_GROUP = group


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0 writes the run directory's logs, metrics, journal and console output."""
    return rank() == 0


def all_max(values: list[float]) -> list[float]:
    """Elementwise maximum over ranks of host numbers (step times, memory, flags)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return t.tolist()


def highest_scores(values: list[float]) -> list[float]:
    """Each row's highest loss over the ranks (NaN counted as +inf), the same list on every rank.
    Ranks that did not score a row give -inf (RunView.row_losses: each rank scores the rows it
    trained); rows every rank scores (the held-out reference) come out as the highest of their
    copies: one rank's weights gone bad would otherwise read its rows as bad data, and ranks that
    decide apart hang the job (one leaves rows out and watches the next steps, collectives, while
    the others train on)."""
    if not active() or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64).nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return t.tolist()


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (host numbers), rank order; [values] in one process."""
    if not active():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=cpu_group())
    return [t.tolist() for t in out]


def side_sum() -> Callable[[list[float]], list[float]]:
    """A sum over the ranks of host numbers on a gloo group of its own, for a background thread
    (asynchronous RL's rollout thread): its collectives on the trainer's group would interleave
    with the trainer's in an order the ranks do not share. Every rank calls this at the same
    point (a new group is made by all of them)."""
    if not active():
        return list
    group = dist.new_group(backend="gloo")

    def summed(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return t.tolist()

    return summed


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), rank order; [obj] in one process."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (what rank 0 read from disk)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory: this rank shrinks its micro-batch with it."""


def attempt(fn: Callable[..., Any], *args: Any) -> OSError | None:
    """fn(*args); the OSError it raised (disk full, ...) instead of raising it, None if it worked."""
    try:
        fn(*args)
    except OSError as exc:
        return exc
    return None


def attempt_value(fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception as exc:  # sent to the other ranks, which raise it too
        return False, exc


def heartbeat_store(timeout_s: float) -> Any:
    """A client of its own on the store torchrun's ranks share (MASTER_ADDR:MASTER_PORT: the agent's or rank 0's)
    for the ranks' heartbeats (resilience/heartbeat.py): the process group's calls never queue behind one of
    its calls, which blocks where the store's host is frozen."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def restart_store(timeout_s: float) -> dict[str, Any]:
    """init_process_group's store for a one-node job torchrun restarted: the agent's store, with
    this attempt's own key prefix. torchrun (>= 2.5) hands its workers the store its rendezvous
    keeps (TORCHELASTIC_USE_AGENT_STORE) and the keys a group writes there outlive a failed
    attempt: a restarted rank may read a peer's address from the attempt before and fail to
    connect (pytorch/pytorch#135712; measured here: 4 of 6 restarts of 2 gloo ranks failed so, 0 of
    10 with the prefix). The restart count is each agent's own, so the prefix is used on one node
    only; across nodes `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a fresh store
    (docs/resilience.md). Empty (torch's own env:// init) otherwise."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if (
        shared
        and os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    ):
        logging.getLogger("trimtab").warning(
            "torchrun restarts across nodes with its shared store may fail to reconnect "
            "(pytorch/pytorch#135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"
        )
    if not attempt or not shared or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return {}
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return {"store": dist.PrefixStore(f"trimtab/attempt_{attempt}", agent), "rank": rank, "world_size": world}
