"""An emergency save: a DDP survivor keeps the last completed step when a peer dies mid-step, in its hooks
or after the interventions they asked for are applied (one lost inside an intervention leaves it half-applied:
no save, `applying`), in an evaluation, in a checkpoint's save or in the data's wait (docs/resilience.md,
"A survivor's emergency save"). A mixin of Checkpointing (training/checkpointing.py).

Under pure data parallelism (DDP: one whole replica a process) every rank holds the whole model and
optimizer. A peer lost inside a step's collectives (the OOM/signal agreement, the gradient
all-reduce, the clip's norm) fails the survivors' collective before their update runs: their
weights and optimizer are still those of the last completed step; so are they in the hooks (the orchestrator's
read of every rank's figures), the evaluation and the save after a step and in the next step's data wait. One
survivor writes them then, alone (no barrier, no gather: the peer is gone), as a one-process checkpoint
(checkpoint.save_checkpoint: atomic, with its manifest, read by any world size), with the data position and
RNG taken when the step began, so the restart loses no completed step instead of up to checkpoint.every (torchft and
OLMo-core keep progress the same way). Refused wherever a dead rank held state of its own: FSDP2,
tensor, expert or pipeline shards, replica groups (resilience.ft, which keep training instead), an RL
loader's rollouts. The writer is rank 0, or, rank 0 lost, the first other survivor to claim the step
(_claim: a file created exclusively in checkpoints/, which every rank shares as it shares the sharded
saves). What differs from a save of every rank: the row gate's reference is each rank's own
(distributed/checkpoint.py with_gates), and only the writer's is known here (the lost rank's went with it);
every rank resumes with it, as a resume on another world gives rank r saved rank r mod the saved world's,
and the restart says so (checkpointing.py). The best at hand without a per-step cost: the last cadence
checkpoint's own references lag by up to checkpoint.every steps, and an exact one would need every rank to
keep every rank's (docs/resilience.md). The RNG is exact: every DDP rank's stream is the writer's
(every_ranks_rng). The
evaluation a peer was lost in is not in the checkpoint (its step's figures are not in metrics.jsonl).
The save has torchrun's grace to finish in: the agent sends SIGTERM to the survivors as it sees a rank
gone, SIGKILL 30 s later (docs/resilience.md).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from trimtab.checkpoint import checkpoint_root, save_checkpoint
from trimtab.distributed.checkpoint import param_names
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairLoader
from trimtab.rundir import LOCK
from trimtab.runlock import exit_lost, lock_lost
from trimtab.storage import redact
from trimtab.training.runtime import rng_state
from trimtab.training.services.storage import RemoteCheckpoints

# gloo's and NCCL's words for a peer that went away (gloo raises a plain RuntimeError, NCCL a DistBackendError)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL")
# gloo's address of the pair's other end, an IP in brackets then its port ("Read error [127.0.0.1]:28559:"); the
# message's first bracket is gloo's source path and line ("[/.../pair.cc:537]"), not followed by a port
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
EMERGENCY = "emergency"  # state.json's key: why this checkpoint was written by one rank alone
# how long a survivor other than rank 0 leaves rank 0 to claim the step first: rank 0 saw the same
# failure at the same moment, and its claim is a file created in milliseconds
RANK_0_FIRST_S = 1.0
# set on a lost peer's exception once the survivor that claimed its step said the loss and where the restart
# resumes (the save's line, or why none): the CLI's exit line (cli_train.py) would say it a second time
SAID = "trimtab_said"
# how a survivor's line ends: what a person does next (cli_train.py ends a survivor's exit line with it too)
UPDATING = "the optimizer's update had begun: the weights are no completed step's"
NEXT = "torchrun restarts the job from {} (--max-restarts), or the same command resumes it"
# how long after the loss is caught a survivor with checkpoint.dir may spend on the emergency save, the upload in
# flight and the save's upload before it ends (the exit cuts an upload's thread): torchrun's agent SIGTERMs the
# survivors as it sees the rank gone and SIGKILLs them 30 s later, and 10 s are left for the agent's delay in
# seeing it (its monitor interval) and the process's exit (the process groups' teardown)
UPLOAD_BY_S = 20.0


def next_words(where: str) -> str:
    """NEXT, or where torchrun has no restart left (its workers' TORCHELASTIC_RESTART_COUNT has reached
    TORCHELASTIC_MAX_RESTARTS) that the same command resumes: the survivor said torchrun would restart a job
    whose restarts were spent."""
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if count is not None and most is not None and count.isdigit() and most.isdigit() and int(count) >= int(most):
        return f"torchrun has no restart left (--max-restarts {most}, all used): the same command resumes from {where}"
    return NEXT.format(where)


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because a peer process is gone."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in PEER_LOST)


def lost_words(exc: BaseException) -> str:
    """The failure in a few words: gloo's phrase for it (its message runs to 200 characters of source path), and
    the lost peer's address where gloo gives one ("Read error [10.0.0.7]:28559: ..."): its host, the only word a
    survivor has at once of which peer went, also one on another host (the watchdog's beats name this host's
    ranks only: resilience/watchdog.py gone_peers)."""
    said = next((words for words in PEER_LOST if words in str(exc)), None)
    words = f"{type(exc).__name__}: {said or (str(exc).splitlines() or [''])[0][:120]}"
    peer = PEER_ADDRESS.search(str(exc)) if said else None
    return f"{words}, the peer at {peer[1]}:{peer[2]}" if peer else words


def emergency_resume_line(state: dict[str, Any], world: int) -> str:
    """The restart's line for a resume from an emergency save (state.json `state`) on `world` ranks: who
    wrote it and why, and what is not as a save of every rank would have it: each rank's row gate
    reference is its own rows' (distributed/checkpoint.py with_gates), and only the writer's is saved."""
    writer, step = state[EMERGENCY]["rank"], state["train"]["step"]
    line = f"resuming from step {step}, an emergency save: rank {writer} wrote it alone when a peer was lost "
    line += f"({state[EMERGENCY]['error']})"
    if world > 1 and state.get("row_gate"):
        line += (
            f"; every rank resumes with rank {writer}'s row gate reference (a rank's own rows' is not in an emergency "
            "save): the other ranks' gating may differ from an uninterrupted run's"
        )
    return line


def every_ranks_rng(rng: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The writer's RNG (runtime.rng_state) as every rank's own, which the restart gives each rank. Its
    CPU stream is every DDP rank's: each is seeded alike (training/setup.py _join) and draws alike (a
    random change of the weights, e.g. a router reset's noise, must be the same on every replica; a
    2-rank run's cadence saves held equal rng_by_rank). But each rank draws on its own GPU, and
    set_rng_state_all sets every device's: rank r would get the writer's untouched copy of device r's
    state, so the writer's own device's state is written for every device."""
    cuda = rng.get("cuda")
    if not cuda or device.type != "cuda":
        return rng
    own = cuda[device.index if device.index is not None else torch.cuda.current_device()]
    return {**rng, "cuda": [own] * len(cuda)}


class EmergencySave:
    """Keeps what a save of the last completed step needs while a step is under way (`_step_start`:
    the step, the loader's position and the RNG as the step began; None once the update begins)."""

    _step_start: tuple[int, dict[str, Any], dict[str, Any], Any] | None = None
    # when this session first marked a step (this node's clock): a claim older than that is an earlier
    # session's (_claim). Not the module's import: torchrun's --start-method fork workers inherit the agent's modules
    _began = 0.0
    # a lost peer's failure in a few words (lost_words) once this rank's collective failed for it: the SIGTERM
    # torchrun's agent then sends the survivors is its consequence (training/services/signals.py says so)
    peer_lost_as: str | None = None
    _said = False  # this survivor claimed the step and said a line for it (_say)
    _written: Path | None = None  # the emergency save this rank wrote (_upload_before_exit uploads it)
    # rank 0 lost with no emergency save to write (the step saved already), this survivor's claim won: it uploads the
    # newest checkpoint where the store lacks it (rank 0, its uploader, lost in its upload or before it)
    _saved_to_upload = False
    _unmarked = UPDATING  # why no step is marked (_step_start None) where one was: said by _refuse

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
        """Before the step's batch is read, or its evaluation and save begin: the position and RNG a
        save now would write. On every rank: any survivor may be the one that writes them."""
        self._began = self._began or time.time()  # also where no save can be made: _refuse claims too
        if self.emergency_save_possible() is None:
            gate = self.row_gate
            # the row gate observes the step's rows in its forward: its reference as the step began (a
            # device copy of `window` floats, no host read) and its unigram frequencies (a host copy)
            kept = gate.snapshot() if gate is not None else None
            self._step_start = (self.state.step, self.loader.state_dict(), rng_state(), kept)

    def peer_loss(self, handled: BaseException | None) -> str | None:
        """A lost peer's failure in a few words, if one is known: this rank's collective failed for it, or
        `handled`, the exception in flight where a signal handler ran (sys.exc_info), is one. torchrun's agent
        SIGTERMs the survivors as it sees the rank gone, which a survivor takes while gloo's error unwinds,
        before saving_if_a_peer_is_lost catches it, or before its own collective failed at all (it was computing):
        then a rank of this host whose process ended (the watchdog's beats) names the loss."""
        if self.peer_lost_as is None and handled is not None and peer_lost(handled):
            self.peer_lost_as = lost_words(handled)
        if self.peer_lost_as is None:  # the SIGTERM came first: a peer's process on this host may have ended
            gone = self.watchdog.gone_peers()
            return f"rank {', '.join(map(str, gone))}'s process ended" if gone else None
        return self.peer_lost_as

    def update_begins(self) -> None:
        """The optimizer is about to change the weights: from here they are no completed step's."""
        self._step_start, self._unmarked = None, UPDATING

    @contextmanager
    def applying(self, name: str, mid_step: bool) -> Iterator[None]:
        """Control applies intervention `name` (training/control.py): a peer lost in it (a rollback's load, a
        save's collectives) leaves it half-applied, no whole state to save. Applied, the state is whole again:
        between steps (`mid_step` False), the completed step with the intervention in it (its knobs are in the
        train state; a rollback's step, data position and RNG are the checkpoint's, marked anew); in a step (an
        out-of-memory retry), the step's start as marked, the batch read since left out."""
        kept, self._step_start = self._step_start, None
        self._unmarked = f"{name} was being applied: a half-applied intervention is no whole state"
        lost = False
        try:
            yield
        except RuntimeError as exc:
            lost = peer_lost(exc)
            raise
        finally:  # also refused (Control says "failed"): the run goes on from the state it left
            if kept is not None and not lost:
                self._unmarked = UPDATING
                if mid_step:
                    self._step_start = kept
                else:
                    self.mark_step_start()

    @contextmanager
    def saving_if_a_peer_is_lost(self) -> Iterator[None]:
        """A block from mark_step_start on: a peer lost in it before an update makes one survivor save the
        step marked."""
        try:
            yield
        except RuntimeError as exc:
            if peer_lost(exc):
                began = time.monotonic()
                self.peer_lost_as = lost_words(exc)
                self.watchdog.loss_known = True  # its heartbeat must not end the save below for the same loss
                self.emergency_save(exc)
                self._upload_before_exit(began)
                if self._said:
                    setattr(exc, SAID, True)
            raise
        finally:
            self._step_start = None

    def emergency_save(self, exc: BaseException) -> bool:
        """Write the last completed step's checkpoint on this rank alone; whether one is on disk."""
        if lock_lost(self.cfg.run_dir):  # rank 0 ended at once for it (runlock): nothing more is written there
            exit_lost(self.cfg.run_dir / LOCK)
        why = self.emergency_save_possible()
        if why is not None:
            self._refuse(exc, why)
            return False
        start, self._step_start = self._step_start, None
        why = self._unsaved(start)
        if why is not None:
            self._refuse(exc, why)
            return False
        step, data, rng, gate = start
        # a rollback's restored step is saved again: what it decided since (rows left out, knobs) is in no checkpoint
        if step == self.last_saved and not self._restored:
            # one survivor (rank 0, else the first to claim) sees that the store holds it: rank 0 lost in its
            # upload left the store a checkpoint.every behind (2 ranks, kill_rank@4:0, step 3's upload taking 3 s)
            with suppress(OSError):  # no claim made, no upload: the loss's own error is what is raised
                self._saved_to_upload = bool(self.cfg.checkpoint.dir) and self._claim(step) and not self.dist.is_main
            return True
        if not self._claim(step):
            return False  # another survivor writes it
        # under the save's own timeout, as any save (a stuck disk is ended); at the step saved, so the exit
        # record names it the last completed one (resilience/incidents.py done_step), not the step that failed
        self.watchdog.beat("checkpoint", step)
        if gate is not None:  # the process ends after this save: its gate can go back to the step's start
            self.row_gate.restore(gate)
        first = lost_words(exc)
        started = time.perf_counter()
        try:
            self._written = self._write_emergency(step, data, rng, first)
        except OSError as err:
            self._say(
                f"step {step}: a peer was lost ({first}); the emergency save failed ({err}): the restart resumes "
                f"from step {self.last_saved}"
            )
            return False
        rank, seconds = self.dist.rank, time.perf_counter() - started
        self._say(
            f"step {step}: a peer was lost ({first}); rank {rank} saved step {step} alone in {seconds:.1f} s (an "
            "emergency save; torchrun's SIGKILL comes 30 s after the loss: a longer save is cut, and the restart "
            f"resumes from the checkpoint before); {next_words(f'step {step}')}"
        )
        self.last_saved = step
        return True

    def _write_emergency(self, step: int, data: dict[str, Any], rng: dict[str, Any], first: str) -> Path:
        """Save `step`'s checkpoint from this rank alone: the step's start, held by mark_step_start."""
        # never a rollback target: whether weights are good is the hooks' call, and the orchestrator's may
        # score a held-out probe averaged over the ranks (a collective: with NCCL it would wait for the dead
        # peer); as for any save judged not good, the held-out reference (on_save_prepare) stays the last good's
        # a restored good step's weights are that checkpoint's: still good (only its knobs and rows changed)
        good = self._restored and step == self.last_saved == self.last_good
        state = {**self._checkpoint_state(good), "data": data, EMERGENCY: {"rank": self.dist.rank, "error": first}}
        optim = {
            "optimizer": self.optimizer.state_dict(),
            "param_names": param_names(self.model, self.optimizer),
            "rng": every_ranks_rng(rng, self.dist.device),
            "scaler": self.scaler.state_dict() if self.scaler else {},
            **self._gate_tables(),  # the row gate's tables, restored to the step's start (emergency_save)
        }
        keep, protected = self.cfg.checkpoint.keep, self._protected()
        return save_checkpoint(self.cfg.run_dir, step, self.model.state_dict(), optim, state, keep, protected)

    def _upload_before_exit(self, began: float) -> None:
        """checkpoint.dir: the uploader (_exit_store) finishes the upload in flight and uploads the emergency save
        written here, within UPLOAD_BY_S of `began` (the loss caught), and says what the store holds. Before, the
        exit (the CLI's, or the watchdog's os._exit) cut the one in flight and the save was never uploaded: a
        restart on a fresh machine resumed up to checkpoint.every steps before it."""
        store = self._exit_store()
        if store is None:
            return
        # the exit record names the last completed step; the wait, a save's, is under the checkpoint section's timeout
        self.watchdog.beat("checkpoint", self.state.step)
        saved = self._saved_to_upload and self._written is None
        path = checkpoint_root(self.cfg.run_dir) / f"step_{self.last_saved:06d}" if saved else self._written
        line = store.upload_before_exit(path, began, UPLOAD_BY_S, saved=saved)
        if line:
            self._say_store(line)

    def _exit_store(self) -> RemoteCheckpoints | None:
        """Who uploads at this rank's exit: rank 0's RemoteCheckpoints hook; on another rank, one opened now where
        this rank wrote the emergency save, or won the claim of a step saved already (_saved_to_upload; rank 0 lost:
        it claims the step first, _claim), so one survivor of several uploads, the one whose claim won. Before, only
        rank 0 uploaded: 2 ranks, checkpoint.every=3, rank 0 killed at step 5, rank 1 saved step 4 and the store's
        newest stayed step 3."""
        store = next((h for h in self.hooks if isinstance(h, RemoteCheckpoints)), None)
        url = self.cfg.checkpoint.dir
        if store is not None or (self._written is None and not self._saved_to_upload) or not url:
            return store
        try:
            return RemoteCheckpoints(url, self.cfg.run_dir, self.cfg.checkpoint.keep, rank=self.dist.rank)
        except Exception as exc:  # the store's client (fsspec, s3fs): the save stays in the run directory
            what = f"{self._written.name} (the emergency save)" if self._written else f"step {self.last_saved}"
            self._say_store(
                f"{what} not uploaded to {url} ({type(exc).__name__}: {redact(exc)}); the restart resumes from the "
                "run directory's copy"
            )
            return None

    def upload_before_hang_exit(self, began: float) -> None:
        """The watchdog ends this process now (os._exit: a hang, no emergency save; resilience/watchdog.py
        before_exit, from its thread): rank 0's upload in flight to checkpoint.dir finished first, and the record
        with the step mark, within UPLOAD_BY_S of `began`. Before, the exit cut it: the store's newest stayed the
        checkpoint before (debug, step 3's upload taking 2 s, a hang at step 4: step 0)."""
        store = next((h for h in self.hooks if isinstance(h, RemoteCheckpoints)), None)
        line = store.upload_before_exit(None, began, UPLOAD_BY_S, "the hang was found") if store else ""
        if line:  # the loop's thread may hold the console's lock in its hang: straight to stderr, as the watchdog
            print(f"trimtab: rank {self.dist.rank}: {line}", file=sys.stderr, flush=True)

    def _say_store(self, line: str) -> None:
        """A line of what checkpoint.dir holds at a survivor's exit: rank 0's console, else this rank's stderr. Not
        the loss's one line (_say): the CLI's exit line still comes where no save's line was said."""
        if self.dist.is_main:
            self.say(line)
        else:
            print(f"trimtab: rank {self.dist.rank}: {line}", file=sys.stderr, flush=True)

    def _unsaved(self, start: tuple[int, dict[str, Any], dict[str, Any], Any] | None) -> str | None:
        """Why the state at hand is no completed step's to save now (None: it is `start`'s). Said by _refuse: a
        survivor that ended with only the CLI's "the newest checkpoint is step N" left a person to guess."""
        if start is None:
            return self._unmarked
        if start[0] != self.state.step:
            return f"a rollback restored step {self.state.step}, not the step marked ({start[0]})"
        if self.dist.writing_in_background():
            return "a checkpoint's background write was under way: its collectives wait on the lost peer"
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            return "the weights are not finite"  # as save(): never a checkpoint that resumes into NaN (no collective)
        return None

    def _refuse(self, exc: BaseException, why: str) -> None:
        """Say once (the survivor that claims the step, as a save's writer would) why no emergency save is
        written and where the restart resumes: without it an FSDP2 run's restart went back silently."""
        step = self.state.step
        if self._claim(step):
            self._say(
                f"step {step}: a peer was lost ({lost_words(exc)}); no emergency save ({why}): the restart "
                f"resumes from {self._newest_finished()}"
            )

    def _newest_finished(self) -> str:
        """The newest checkpoint on disk, in words: last_saved names a background write from its start, and
        one still under way when a peer is lost never finishes (its collectives wait on the peer): 2 ranks,
        checkpoint.every=5 asynchronous, kill_rank@21:1 said "resumes from ... step 20" with step 20 left a
        .tmp_ directory and step 15 the newest on disk."""
        if self._writing is not None and self.dist.writing_in_background():
            writing, (before, _) = self._writing
            return f"the last finished checkpoint, step {before} (step {writing}'s, written in the background, is not)"
        return f"the last checkpoint, step {self.last_saved}"

    def _say(self, line: str) -> None:
        """A line from the survivor that claimed the step: rank 0's console, or, rank 0 lost, this rank's
        stderr (a rank's other lines are silenced, distributed/parallel.py: rank 0 speaks for the job). Its one
        line for the loss: the CLI's exit line is left out after it (SAID)."""
        self._said = True
        if self.dist.is_main:
            self.say(line)
        else:
            print(f"trimtab: rank {self.dist.rank}: {line}", file=sys.stderr, flush=True)

    def _began_on_disk(self, root: Path) -> float:
        """This session's start by the clock that stamps the claims' mtimes (a shared file system's: its
        server's, or the writing node's), not this node's: the mtime of a file created in `root` now,
        less this node's now, is that clock's skew from this one (a claim rank 0 made on a node 60 s
        behind this one read as an earlier session's here, and two survivors wrote the same step)."""
        probe = root / f".emergency_clock_rank{self.dist.rank}"
        probe.touch()
        try:
            skew = probe.stat().st_mtime - time.time()
        finally:
            probe.unlink(missing_ok=True)
        return self._began + skew

    def _claim(self, step: int) -> bool:
        """Whether this survivor writes step `step`: the first to create checkpoints/.emergency_step_N does
        (rank 0 at once, the others RANK_0_FIRST_S later). Claims older than this session's first step are
        earlier sessions' (done, or killed in their save): removed, so taken over."""
        claim = checkpoint_root(self.cfg.run_dir) / f".emergency_step_{step:06d}"
        if not self.dist.is_main:
            time.sleep(RANK_0_FIRST_S)
        claim.parent.mkdir(parents=True, exist_ok=True)
        began = self._began_on_disk(claim.parent)
        for old in claim.parent.glob(".emergency_step_*"):
            if _stale(old, began):
                old.unlink(missing_ok=True)
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False  # another survivor claimed it first (rank 0 later than RANK_0_FIRST_S)
        return True


def _stale(claim: Path, began: float) -> bool:
    """Whether an emergency save's claim was made before this session began (`began`: by the claims' clock,
    _began_on_disk): another session's."""
    try:
        return claim.stat().st_mtime < began
    except FileNotFoundError:
        return False
