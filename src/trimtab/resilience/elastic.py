"""Where this rank sits in torchrun's elastic job: its node (GROUP_RANK), the nodes the rendezvous
admitted (GROUP_WORLD_SIZE), and leaving it. torchrun numbers ranks node by node (global rank =
node rank x LOCAL_WORLD_SIZE + local rank), so a rank's node follows from its number. Torch-free.
"""

from __future__ import annotations

import os
import signal

# One name for the ranks of this session (training/setup.py agrees on it, rank 0's, once the process
# group is up): a restart's ranks beat (resilience/watchdog.py) while rank 0 reads the lost
# session's beats (resilience/incidents.py), and time cannot tell them apart
SESSION_ENV = "TRIMTAB_SESSION"


def session() -> str:
    """This session's name ("" before setup named it)."""
    return os.environ.get(SESSION_ENV, "")


def name_session(name: str) -> None:
    """Take `name` (rank 0's, the same on every rank) as this session's."""
    os.environ[SESSION_ENV] = name


def node_rank() -> int:
    """This rank's node in the job (0 without torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0") or 0)


def node_count() -> int:
    """The nodes torchrun's rendezvous admitted (1 without torchrun)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)


def node_of(rank: int) -> int:
    """The node of global rank `rank` (torchrun's numbering, the same number of ranks a node)."""
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def leave_job() -> None:
    """End this node's part of the job: torchrun's agent (the ranks' parent) and this rank, by
    SIGKILL, as a lost node goes. The other nodes' ranks fail in their next collective and their
    agents restart them on the nodes left (--nnodes MIN:MAX)."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
