"""Per-step fault tolerance across replica groups, through torchft (resilience.ft; docs/resilience.md).

Each replica group is one `trimtab train` process with its own run directory; they find each other
through a torchft Lighthouse (`torchft_lighthouse --min_replicas 1`, installed with torchft).
Every step begins with a quorum (Manager.start_quorum): the groups alive that step. Their gradients
and the step's telemetry (loss, router statistics, per-row losses) are averaged across them, and
the update is applied only where every one of them reached the end of the step (should_commit). A
group that dies is dropped from the next quorum while the others keep stepping (no restart, no
rollback); its replacement, the same command run again, joins a later quorum and receives the
state of a healthy group live (torchft's checkpoint transport): weights, optimizer moments, the
step, the data position and the hooks' state. A step some group did not finish is withheld on all
of them, like a skipped step.

Each group trains its share of each step's rows (group g of G: as data-parallel rank g of G), so
the global batch is the groups' together. The step's values are scaled by G / participants before
the average: with every group present they are the sums a single process computes; with fewer,
the unbiased estimate from the rows that were trained (the missing group's rows are not trained
that step). The quorum is synchronous (use_async_quorum=False): a replacement loads the state it
receives before its first forward.
"""

from __future__ import annotations

import json
import logging
import os
import re
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


class ReplicaGroups:
    """This process as one replica group of a torchft job: the quorum, the average and the commit."""

    def __init__(
        self,
        cfg: FtConfig,
        device: torch.device,
        run_dir: Path,
        say: Callable[[str], None],
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict], None],
    ) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Manager logs each quorum and commit at info
        require("torchft", "resilience.ft")
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        # a state received live is read from an HTTP response's bytes, which torch warns of once
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

        # A peer's death reaches its Python loggers as a traceback; the trainer says it in one
        # line (the quorum's size, a withheld step with its error: `error`)
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.cfg, self.device, self.journal, self.say = cfg, device, Path(run_dir) / "quorum.jsonl", say
        timeout = timedelta(seconds=cfg.timeout_s)
        # The group's own store (one process per group here: its rank 0 is this process)
        self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            # the step's tensors stay where they are: NCCL between GPUs (not yet run on GPUs here)
            pg=ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout),
            min_replica_size=cfg.min_replicas,
            load_state_dict=self._healed(load_state_dict),
            state_dict=self._sending(state_dict),
            use_async_quorum=False,
            replica_id=f"trimtab_group{cfg.replica_group}",
            store_addr="localhost",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse_address(cfg),
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self.participants = 0  # in the newest quorum
        self.healed = False  # this step's quorum brought the state of another group
        self.sent = False  # this step's quorum sent this group's state to a replacement

    def _sending(self, state_dict: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def wrapped() -> dict[str, Any]:
            self.sent = True
            return state_dict()

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

    def average(self, tensors: list[torch.Tensor]) -> None:
        """The participants' sum-equivalent of each tensor, in place, in one all-reduce: each
        scaled by groups / participants, averaged (see the module docstring)."""
        if not tensors:
            return
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
        append_lines(self.journal, json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
