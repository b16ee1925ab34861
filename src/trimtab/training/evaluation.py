"""A run's held-out figures: its loss, each rank scoring its share of the evaluation
micro-batches, or an RL / DPO phase's (its loader's), with a timeout and errors agreed by all
ranks (Trainer.evaluate journals what went wrong through its hooks, and training goes on)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from trimtab.data import MicroBatch
from trimtab.data.held_out import HeldOut, mean_losses
from trimtab.hardware import is_oom

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer


class LeftOff(Exception):
    """An RL or DPO evaluation's generation or scoring left off for a stop's save (Trainer._left_off): its
    message is the evaluation's error, the words a held-out loss's (sharded_loss) says."""


def error_line(exc: BaseException) -> str:
    """An evaluation's failure in one line for the journal: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def held_out(t: Trainer) -> HeldOut | None:
    """The phase's held-out rows in micro-batches of the budget training runs at now (the
    loader's: an out-of-memory heal lowers it, a resume restores the lowered one), so no read of
    them runs out of memory where training no longer does; None in an RL or DPO phase, whose
    held-out figures are its loader's."""
    rows: HeldOut | None = getattr(t.phases[t.state.phase], "eval_rows", None)
    return rows.at(t.loader.micro_batch_tokens) if rows is not None else None


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
            with t.dist.completing_forward():  # FSDP2: the others' all-gathers joined before this rank says it failed
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
        if not error and (stop := t.dist.signalled()):  # a preemption's grace is for the save, not the evaluation
            error = f"{stop}: left off for the stop's save"
        if error := t.dist.first_error(error):
            return [], f"{error} after {i + 1} of {rounds} micro-batches"
    return t.dist.sum_over_ranks(sums).T.tolist(), ""


def held_out_figures(t: Trainer) -> tuple[dict[str, Any], str]:
    """(val_loss, val_ppl and each mixture source's loss; "") or ({}, what went wrong); ({}, "")
    without eval data."""
    rows = held_out(t)
    if rows is None or not rows.micro:
        return {}, ""
    t.watchdog.beat("evaluation")
    t.evaluating = True
    try:
        sums, error = sharded_loss(t, rows.micro, t.cfg.train.eval_timeout)
    finally:
        t.evaluating = False
    if error:
        return {}, error
    losses = mean_losses(sums, rows.sources)
    return {
        "val_loss": losses["val_loss"],
        "val_ppl": math.exp(min(losses["val_loss"], 50.0)),
        **{k: v for k, v in losses.items() if k != "val_loss"},  # each source of a mixture
    }, ""


def policy_figures(t: Trainer) -> tuple[dict[str, Any], str]:
    """An RL or DPO phase's held-out figures (its loader's), or ({}, what went wrong): an error
    abandons this evaluation, not the run (an out-of-memory error generating the held-out
    answers, a response the verifier cannot take), as for a held-out loss. The ranks agree after
    it; neither evaluation has a collective inside (every rank answers every held-out prompt and
    scores every held-out pair), so a rank that failed alone keeps none waiting; a stop signal
    leaves the generation or the pair scoring off before its next forward, the verifier's scoring
    before its next round, each rank at its own (torchrun's agent signals every one), and the
    ranks agree after it as after an error."""
    t.watchdog.beat("evaluation")
    t.evaluating, error, figures = True, "", {}
    try:
        figures = t.loader.evaluate()
    except LeftOff as exc:  # a preemption's grace is for the save, not the evaluation
        error = str(exc)
    except Exception as exc:  # this evaluation's failure, told to the hooks
        error = error_line(exc)
    finally:
        t.evaluating = False
    if error := t.dist.first_error(error):
        return {}, error
    return figures, ""
