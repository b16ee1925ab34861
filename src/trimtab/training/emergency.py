"""An emergency save: a DDP survivor keeps the last completed step when a peer dies mid-step
(docs/resilience.md, "A survivor's emergency save"). A mixin of Checkpointing (training/checkpointing.py).

Under pure data parallelism (DDP: one whole replica a process) every rank holds the whole model and
optimizer. A peer lost inside a step's collectives (the OOM/signal agreement, the gradient
all-reduce, the clip's norm) fails the survivors' collective before their update runs: their
weights and optimizer are still those of the last completed step. Rank 0 writes them then, alone
(no barrier, no gather: the peer is gone), as a one-process checkpoint (checkpoint.save_checkpoint:
atomic, with its manifest, read by any world size), with the data position and RNG taken when the
step began, so the restart loses no completed step instead of up to checkpoint.every (torchft and
OLMo-core keep progress the same way). Refused wherever a dead rank held state of its own: FSDP2,
tensor, expert or pipeline shards, replica groups (resilience.ft, which keep training instead), an RL
loader's rollouts. One thing differs from a save of every rank: the row gate's reference is each
rank's own rows' (distributed/checkpoint.py with_gates), and only rank 0's is known here; every rank
resumes with it, as a resume on another world gives rank r saved rank r mod the saved world's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trimtab.checkpoint import save_checkpoint
from trimtab.distributed.checkpoint import param_names
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairLoader
from trimtab.training.runtime import rng_state

# gloo's and NCCL's words for a peer that went away (gloo raises a plain RuntimeError, NCCL a DistBackendError)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL")
EMERGENCY = "emergency"  # state.json's key: why this checkpoint was written by one rank alone


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because a peer process is gone."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in PEER_LOST)


def lost_words(exc: BaseException) -> str:
    """The failure in a few words: gloo's phrase for it (its message runs to 200 characters of source path)."""
    said = next((words for words in PEER_LOST if words in str(exc)), None)
    return f"{type(exc).__name__}: {said or (str(exc).splitlines() or [''])[0][:120]}"


class EmergencySave:
    """Keeps what a save of the last completed step needs while a step is under way (`_step_start`:
    the step, the loader's position and the RNG as the step began; None once the update begins)."""

    _step_start: tuple[int, dict[str, Any], dict[str, Any], Any] | None = None

    def emergency_save_possible(self) -> str | None:
        """Why no emergency save can be sound for this run (None: it can)."""
        dist = self.dist
        if dist.world == 1:
            return "one process: no peer to lose"
        if dist.sharded or dist.pipeline is not None:
            return "FSDP2, tensor, expert or pipeline parallelism: the lost rank held shards of the state"
        if self.replicas is not None:
            return "resilience.ft: the other replica groups keep training"
        if isinstance(self.loader, (RolloutLoader, PairLoader)):
            return "an RL or preference loader: its rollouts are not in the data position"
        return None

    def mark_step_start(self) -> None:
        """Before the step's batch is read: its position and RNG are those a save now would write."""
        if self.dist.is_main and self.emergency_save_possible() is None:
            gate = self.row_gate
            # the row gate observes the step's rows in its forward: its reference as the step began (a
            # device copy of `window` floats, no host read)
            kept = (gate.recent.clone(), gate.written, gate.judged) if gate is not None else None
            self._step_start = (self.state.step, self.loader.state_dict(), rng_state(), kept)

    def update_begins(self) -> None:
        """The optimizer is about to change the weights: from here they are no completed step's."""
        self._step_start = None

    @contextmanager
    def saving_if_a_peer_is_lost(self) -> Iterator[None]:
        """The step's block: a peer lost in it before the update makes rank 0 save the step before it."""
        try:
            yield
        except RuntimeError as exc:
            if peer_lost(exc):
                self.emergency_save(exc)
            raise
        finally:
            self._step_start = None

    def emergency_save(self, exc: BaseException) -> bool:
        """Write the last completed step's checkpoint on this rank alone; whether one is on disk."""
        start, self._step_start = self._step_start, None
        if start is None or start[0] != self.state.step or self.dist.writing_in_background():
            return False  # not rank 0, the update began, or a background write's collectives wait on the lost peer
        step, data, rng, gate = start
        if step == self.last_saved:
            return True
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            return False  # as save(): never a checkpoint that resumes into NaN (a local check: no collective)
        # under the save's own timeout, as any save (a stuck disk is ended); at the step saved, so the exit
        # record names it the last completed one (resilience/incidents.py done_step), not the step that failed
        self.watchdog.beat("checkpoint", step)
        if gate is not None:  # the process ends after this save: its gate can go back to the step's start
            self.row_gate.recent.copy_(gate[0])
            self.row_gate.written, self.row_gate.judged = gate[1], gate[2]
        first = lost_words(exc)
        # never a rollback target: whether weights are good is the hooks' call, and the orchestrator's may
        # score a held-out probe averaged over the ranks (a collective: with NCCL it would wait for the dead
        # peer); as for any save judged not good, the held-out reference (on_save_prepare) stays the last good's
        state = {**self._checkpoint_state(False), "data": data, EMERGENCY: {"rank": 0, "error": first}}
        scaler = self.scaler.state_dict() if self.scaler else {}
        optim = {
            "optimizer": self.optimizer.state_dict(),
            "param_names": param_names(self.model, self.optimizer),
            "rng": rng,
            "scaler": scaler,
        }
        try:
            save_checkpoint(
                self.cfg.run_dir,
                step,
                self.model.state_dict(),
                optim,
                state,
                self.cfg.checkpoint.keep,
                self._protected(),
            )
        except OSError as err:
            self.say(f"step {step}: the emergency save failed ({err}); the restart resumes from step {self.last_saved}")
            return False
        self.say(f"step {step}: a peer was lost ({first}); rank 0 saved step {step} alone (an emergency save)")
        self.last_saved = step
        return True
