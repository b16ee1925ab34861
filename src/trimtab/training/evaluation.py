"""The held-out loss of a run, each rank scoring its share of the evaluation micro-batches, with
a timeout and errors agreed by all ranks (Trainer.evaluate journals what went wrong through its
hooks, and training goes on)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from trimtab.data import MicroBatch
from trimtab.hardware import is_oom

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer


def error_line(exc: BaseException) -> str:
    """An evaluation's failure in one line for the journal: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


@torch.no_grad()
def sharded_loss(t: Trainer, micro_batches: list[MicroBatch], timeout: float) -> tuple[list[list[float]], str]:
    """([summed loss, targets] of each micro-batch, "") with data-parallel replica r scoring
    micro_batches[r::replicas] (its tensor-parallel ranks together); or ([], what went wrong).
    Ranks agree after every micro-batch, so an error or a timeout on one rank ends the
    evaluation on all of them instead of leaving them waiting."""
    t.model.eval()
    n, rank, world = len(micro_batches), t.dist.dp_rank, t.dist.dp_world
    rounds = -(-n // world)  # FSDP: every rank runs as many forwards
    # [2, n]: each micro-batch's summed loss and target count, filled by the rank that scores
    # it; summed over ranks and then in order, so the figure does not depend on the world size
    sums = torch.zeros(2, n, dtype=torch.float64, device=t.device)
    start, error = time.monotonic(), ""
    for i in range(rounds):
        j = rank + i * world  # the micro-batch this rank scores in this round (>= n: a padding forward)
        micro = micro_batches[min(j, n - 1)]
        try:
            loss = t.score(micro)
            if j < n:
                sums[0, j] = loss.double()
                sums[1, j] = micro.n_targets
        except Exception as exc:  # a bad record, a kernel error: this evaluation, not the run
            if is_oom(exc) and t.device.type == "cuda":
                torch.cuda.empty_cache()
            error = error_line(exc)
        if timeout and not error and time.monotonic() - start > timeout:
            error = f"timed out after {time.monotonic() - start:.0f}s (train.eval_timeout={timeout:g})"
        if error := t.dist.first_error(error):
            return [], f"{error} after {i + 1} of {rounds} micro-batches"
    return t.dist.sum_over_ranks(sums).T.tolist(), ""


def mean_losses(sums: list[list[float]], sources: list[str]) -> dict[str, float]:
    """val_loss over all micro-batches, and val_loss/NAME over each source's when there are
    several (a mixture's held-out sets). Added in micro-batch order: the same for any world size."""
    groups: dict[str, list[float]] = {"val_loss": [0.0, 0.0]}
    for (loss, count), name in zip(sums, sources if len(set(sources)) > 1 else [""] * len(sums)):
        for key in ["val_loss"] + ([f"val_loss/{name}"] if name else []):
            total = groups.setdefault(key, [0.0, 0.0])
            total[0], total[1] = total[0] + loss, total[1] + count
    return {key: loss / max(count, 1) for key, (loss, count) in groups.items()}
