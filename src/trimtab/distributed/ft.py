"""Per-step fault tolerance across replica groups, through torchft (resilience.ft; docs/resilience.md).

Each replica group is one `trimtab train` job (one process, or torchrun's ranks training
data-parallel inside the group: DDP or FSDP2, torchft's HSDP) with its own run directory; the groups
find each other through a torchft Lighthouse (`torchft_lighthouse --min_replicas 1`, installed with
torchft). Every step begins with a quorum (Manager.start_quorum): the groups alive that step. Their
gradients and the step's telemetry (loss, router statistics, per-row losses) are averaged across
them, rank r of a group with rank r of every other (each holds the same shard of each gradient),
and the update is applied only where every rank of every one of them reached the end of the step
(should_commit). A group that dies (any of its ranks) is dropped from the next quorum while the
others keep stepping (no restart, no rollback); its replacement, the same command run again, joins
a later quorum and receives the state of a healthy group live, each rank its own shard from the
same rank there (torchft's checkpoint transport): weights, optimizer moments, the step, the data
position and the hooks' state. A step some group did not finish is withheld on all of them, like a
skipped step.

Each rank trains its share of each step's rows (rank r of group g of G, with W ranks a group: as
data-parallel rank g * W + r of G * W), so the global batch is the groups' together. The step's
values are scaled by G / participants before the average: with every group present they are the
sums a single process computes; with fewer, the unbiased estimate from the rows that were trained
(the missing group's rows are not trained that step). The quorum is synchronous
(use_async_quorum=False): a replacement loads the state it receives before its first forward.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from trimtab.config.resilience import FtConfig
from trimtab.errors import ConfigError
from trimtab.extras import require
from trimtab.rundir import append_lines


def lighthouse_address(cfg: FtConfig) -> str:
    address = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError(
            "resilience.ft.enabled is true but no Lighthouse is named: set resilience.ft.lighthouse "
            "(http://HOST:PORT) or TORCHFT_LIGHTHOUSE, after starting one (torchft_lighthouse --min_replicas 1 "
            "--join_timeout_ms 1000)"
        )
    return address


def check_groups(mesh: Any) -> None:
    """A replica group's ranks are data-parallel replicas (DDP or FSDP2): torchft pairs rank r of
    each group with rank r of the others, and only the data-parallel reduction of the step
    (distributed/parallel.py: reduce_step) is extended across groups so far."""
    split = {name: getattr(mesh, name) for name in ("tp", "pp", "ep") if getattr(mesh, name) > 1}
    if split:
        said = ", ".join(f"distributed.{k}={v}" for k, v in split.items())
        raise ConfigError(
            f"resilience.ft with {said}: a replica group's ranks must be data-parallel replicas (DDP or FSDP2) "
            "for now; set those to 1, or resilience.ft.enabled=false"
        )


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard, a view of its storage)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_shards(state: Any) -> Any:
    """A state with every DTensor replaced by this rank's shard: what travels to the same rank
    of a replacement group (the groups are alike, so it holds the same shard there)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, local, state)


def shard_like(t: Any, template: Any) -> Any:
    """A shard received (local_shards) as the DTensor `template` is on this rank; anything else
    as it came (a scalar such as the optimizer's step count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor) or not isinstance(t, torch.Tensor) or t.shape != local(template).shape:
        return t
    mine, shape = local(template), dict(shape=template.shape, stride=template.stride())
    return DTensor.from_local(t.to(mine.device, mine.dtype), template.device_mesh, template.placements, **shape)


class ReplicaGroups:
    """This process as one replica group of a torchft job: the quorum, the average and the commit."""

    def __init__(
        self,
        cfg: FtConfig,
        group: tuple[int, int],
        device: torch.device,
        run_dir: Path,
        say: Callable[[str], None],
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict], None],
    ) -> None:
        """`group`: this process's rank in its replica group and the group's size (torchrun's)."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Manager logs each quorum and commit at info
        require("torchft", "resilience.ft")
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        # a state received live is read from an HTTP response's bytes, which torch warns of once
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

        # A peer's death reaches its Python loggers as a traceback; the trainer says it in one
        # line (the quorum's size, a withheld step with its error: `error`)
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.cfg, self.device, self.say = cfg, device, say
        self.rank, world = group
        self.journal = Path(run_dir) / "quorum.jsonl" if self.rank == 0 else None  # the group's rank 0 writes it
        timeout = timedelta(seconds=cfg.timeout_s)
        host, port = self._group_store(world)
        self.manager = Manager(
            # the step's tensors stay where they are: NCCL between GPUs (not yet run on GPUs here)
            pg=ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout),
            min_replica_size=cfg.min_replicas,
            load_state_dict=self._healed(load_state_dict),
            state_dict=self._sending(state_dict),
            use_async_quorum=False,
            replica_id=f"trimtab_group{cfg.replica_group}",
            store_addr=host,
            store_port=port,
            rank=self.rank,
            world_size=world,
            lighthouse_addr=lighthouse_address(cfg),
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self.participants = 0  # in the newest quorum
        self.healed = False  # this step's quorum brought the state of another group
        self.sent = False  # this step's quorum sent this group's state to a replacement

    def _group_store(self, world: int) -> tuple[str, int]:
        """A store of this session's own for the group's Manager (its rank 0 publishes its server's
        address there): made by rank 0, its address sent to the others. Not torchrun's store,
        which outlives a restart of the ranks and would hand a restarted rank the address of the
        server that died with the last session."""
        import torch.distributed as dist

        host = socket.gethostname() if world > 1 else "localhost"
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if self.rank == 0 else None
        address: list[Any] = [(host, self._store.port) if self._store is not None else None]
        if world > 1:
            dist.broadcast_object_list(address, src=0)
        return address[0]

    def _sending(self, state_dict: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def wrapped() -> dict[str, Any]:
            self.sent = True
            return local_shards(state_dict())

        return wrapped

    def _healed(self, load: Callable[[dict], None]) -> Callable[[dict], None]:
        def wrapped(state: dict) -> None:
            load(state)
            self.healed = True

        return wrapped

    def quorum(self, step: Callable[[], int]) -> bool:
        """Start a step: the groups alive now; whether a state went from one group to another
        (this one received it, or sent it): then both save a checkpoint of that same state, so
        their checkpoints, and a rollback's targets, stay alike. A change is said and recorded in
        quorum.jsonl at `step()`, the step trained last."""
        self.healed = self.sent = False
        self.manager.start_quorum()
        before, self.participants = self.participants, self.manager.num_participants()
        if self.participants != before or self.healed:
            step = step()
            self._record(step=step, participants=self.participants, before=before, healed=self.healed)
            healed = " (this group received a healthy group's state)" if self.healed else ""
            self.say(f"step {step}: {self.participants} of {self.cfg.groups} replica groups{healed}")
        return self.healed or self.sent

    def agree_min(self, value: int) -> int:
        """The smallest of the participants' `value`s (a rollback's target step, so that every
        group loads the same checkpoint)."""
        from torch.distributed import ReduceOp

        t = torch.tensor([float(value)], device=self.device)
        self.manager.allreduce(t, reduce_op=ReduceOp.MIN).wait()
        return int(t.item())

    def common_step(self, step: int, held: Callable[[int], int]) -> int:
        """The newest step at or before `step` of which every participant holds a checkpoint
        (`held(s)`: this group's newest at or before s, -1 for none); -1 if there is none. The
        groups hold the same state at each step, but not always checkpoints of the same steps (a
        group's own saves: a heal, `ctl save`, its own checkpoint interval), and a rollback must
        load the same one everywhere: the smallest is agreed on until every group names it."""
        target = self.agree_min(step)
        while target >= 0:
            least = self.agree_min(held(target))
            if least == target:
                return target
            target = least
        return -1

    def average(self, tensors: list[torch.Tensor]) -> None:
        """The participants' sum-equivalent of each tensor, in place, in one all-reduce: each
        scaled by groups / participants, averaged (see the module docstring)."""
        if not tensors:
            return
        tensors = [local(t) for t in tensors]  # FSDP2's gradients: this rank's shard, as its peers'
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        flat *= self.cfg.groups
        self.manager.allreduce(flat).wait()
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def commit(self, step: int) -> bool:
        """Whether every participant finished step `step` (the update may be applied); a step
        withheld is said and recorded with the error this group met, if any."""
        if self.manager.should_commit():
            return True
        failed = self.manager.errored()
        why = "another group failed"
        if failed is not None:  # gloo's source location first, then its words
            why = re.sub(r"^\[[^\]]*\]\s*", "", str(failed.original_exception).splitlines()[0]).split(". ")[0]
        self._record(step=step, withheld=True, error=why)
        self.say(f"step {step}: withheld on every replica group: {why}")
        return False

    def _record(self, **record: Any) -> None:
        if self.journal is not None:
            append_lines(self.journal, json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
