"""The Trainer's checkpoint half: save (synchronous or in the background), wait for a background
write, a failed save handed to the hooks (and tried again at the next steps), the run's last save,
rollback (docs/resilience.md, "Asynchronous checkpoints"); the loads of a resume and a rollback are
training/loading.py's. A mixin of Trainer (training/trainer.py), whose state it reads and sets.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trimtab.checkpoint import (
    cadence_kept,
    find_checkpoint,
    list_checkpoints,
    put_back_retired,
    retire_after,
    set_aside_corrupt,
)
from trimtab.checkpoint_load import apply_structure
from trimtab.distributed.ft import shard_like
from trimtab.errors import CheckpointError, ConfigError
from trimtab.snapshots import newest_weights, save_last_weights, save_snapshot
from trimtab.storage import step_of
from trimtab.training.changes import TRAINED, trained_config
from trimtab.training.hooks import keyed
from trimtab.training.loading import Loading, expert_counts
from trimtab.training.optim import state_tensors
from trimtab.training.restore_point import RestorePoint, agreed
from trimtab.training.runtime import rng_state
from trimtab.training.state import GAVE_UP, NO_CHECKPOINT, TrainState

log = logging.getLogger(__name__)


class Checkpointing(Loading):
    """Checkpoints of the run a Trainer trains; `last_saved` is the resume point (a background
    write in flight included), `last_good` the newest checkpoint its hooks called healthy."""

    # A rollback restored the checkpoint of this step (last_saved), and what it decided since (its
    # journal line, the ladder, the knobs and rows it changed) is in no checkpoint until the next one
    # is on disk: a save at this step writes it again instead of taking the one on disk as current.
    _restored = False
    # where the disk rule's stop kept the weights alone (_keep_weights): the summary and the stop's journal line say so
    weights_kept: str | None = None
    # a save that failed, its retry by the hooks too (_save_failed): the step the save is tried again at,
    # and the wait that set it (doubling, _owe_save)
    _owed: tuple[int, int] | None = None

    def _final_save(self) -> None:
        """The run's last checkpoint, as the state it ends in deserves. Weights that are not
        finite are not saved, and the run is not "completed": it ends with exit code 3 and the
        newest checkpoint on disk as its resume point. A run that gave up (exit code 3) on weights
        a hook does not call healthy saves them for inspection in checkpoints/rolled_back/,
        never as the resume point: re-running starts from the last good state."""
        if not self.save(wait=True) and (broken := self._not_finite()):
            self.request_stop(
                f"{broken[0]} are not finite at step {self.state.step}{_nor(broken)}; re-running resumes from "
                f"the newest checkpoint, step {self.last_saved}",
                GAVE_UP,
            )
            return
        if self.exit_code == NO_CHECKPOINT and self.last_saved < self.state.step:
            self._keep_weights()
        if self.exit_code == GAVE_UP and self.last_saved == self.state.step and 0 <= self.last_good < self.state.step:
            self.dist.on_main(retire_after, self.cfg.run_dir, self.last_good, self.cfg.checkpoint.keep)
            self.say(
                f"step {self.state.step}: its weights are not a good state, kept in checkpoints/rolled_back/; "
                f"re-running resumes from step {self.last_good}, the last good checkpoint"
            )

    def save(self, wait: bool = False) -> bool:
        """Write a checkpoint of this step; whether one is on disk now (False: the save failed and
        a hook took the error, so training goes on, or the weights are not finite). A checkpoint
        with NaN/Inf weights is never written: it could only be a resume target that resumes
        into NaN; the newest one on disk stays the run's resume point. With
        checkpoint.asynchronous (and not `wait`) it is written in the background: "on disk" from
        the next save or finish_save on, and until then last_saved names it."""
        self.watchdog.beat("checkpoint")
        self.finish_save()
        if self.state.step == self.last_saved and not self._restored:
            return True
        if broken := self._not_finite():
            self.say(
                f"step {self.state.step}: {broken[0]} are not finite{_nor(broken)}: no checkpoint written (the resume "
                f"point stays step {self.last_saved})"
            )
            return False
        good = self._good()
        self._call("on_save_prepare", good)
        background = self.cfg.checkpoint.asynchronous and not wait
        started, before = time.perf_counter(), (self.last_saved, self.last_good)
        if not background:  # the run's last save under checkpoint.asynchronous too
            self._call("on_save_stall")
        if self.best_eval is not None and self.best_checkpoint < 0:  # evaluations come before saves
            self.best_checkpoint = self.state.step if self.state.step == self.best_eval[0] else self.last_saved
        self._make_room()
        try:
            path = self.dist.save(
                self.cfg.run_dir,
                self.state.step,
                self.model,
                self.optimizer,
                {"rng": rng_state(), "scaler": self.scaler.state_dict() if self.scaler else {}, **self._gate_tables()},
                self._checkpoint_state(good),
                keep=self.cfg.checkpoint.keep,
                protect=self._protected(),
                before=lambda: self._call("on_save_start"),
                background=background,
            )
        except OSError as exc:  # disk full, quota, a vanished mount: a hook may handle it
            return self._save_failed(exc)
        self.last_saved, self.save_seconds = self.state.step, time.perf_counter() - started
        self._owed = None
        self.last_good = self.state.step if good else self.last_good
        if background:
            self._writing = (self.state.step, before)
        else:
            self._restored = False
            self._call("on_checkpoint", path)
        return True

    def _make_room(self) -> None:
        """Room made before this save writes where a hook asks (a disk incident: orchestrator/saves.py
        room_for_save), whichever save it is: at the interval, a phase's last, a stop's. Not in the disk rule's
        retry, which freed already (Control._save_checkpoint). Every rank asks: room_for_save agrees over them."""
        if self._saving_again:
            return
        wanted = [keep for h in self.hooks if (keep := self._hook(h, "room_for_save")) is not None]
        if wanted:
            freed, line = self.control.free_room(min(wanted))
            self._call("on_room_made", freed, line)

    def _not_finite(self) -> list[str]:
        """What a checkpoint or a snapshot of this step would keep that is not finite (none: []): the parts of
        optim.state_tensors. One fused check of them all (view.weights_finite's), each part checked only once
        it failed; every rank asks."""
        parts = state_tensors(self.model, self.optimizer)
        if self.dist.all_finite([t for part in parts.values() for t in part]):
            return []
        # a finite 0-d tensor in each: a part empty on some ranks only (a pipeline stage without buffers) still
        # takes its turn in all_finite's all-reduce
        finite = torch.zeros((), device=parts["the weights"][0].device)
        return [name for name, part in parts.items() if not self.dist.all_finite([*part, finite])]

    def _protected(self) -> tuple[int, ...]:
        """The steps whose checkpoints pruning keeps besides the newest checkpoint.keep."""
        return (*self.essential_checkpoints(), *self._hooks_kept(), *self._cadence_kept())

    def essential_checkpoints(self) -> tuple[int, ...]:
        """The checkpoints kept even when a full disk's remedy frees room (Control._save_checkpoint): the last
        good, the best evaluation's and the reference policy's. The remedy kept the last good alone, and on a
        disk incident that makes room before each save (orchestrator/saves.py) the best would go first."""
        return (
            self.last_good,
            self.best_checkpoint,
            # step 0 is the KL term's and DPO's reference policy (rl/reference.py)
            0 if self.cfg.rl.kl_coef or (self.cfg.dpo.enabled and self.cfg.dpo.uses_reference) else -1,
        )

    def _hooks_kept(self) -> tuple[int, ...]:
        """The checkpoints a rollback to the steps the hooks may still want restores: at each, the
        newest on disk at or before it (find_checkpoint's choice). A rule's step is seldom a save's
        (rl_reward's good_step, the policy before its window: step 25 with checkpoint.every 10);
        kept as the step alone, the checkpoint serving it was pruned and the rollback landed on an
        older one, or found none and stopped the run."""
        wanted = [step for h in self.hooks for step in h.kept_checkpoints(self.view) if step >= 0]
        if not wanted:
            return ()
        saved = [step_of(path.name) for path in list_checkpoints(self.cfg.run_dir)]
        return tuple(max((s for s in saved if s <= step), default=-1) for step in wanted)

    def _cadence_kept(self) -> tuple[int, ...]:
        """While the checkpoint interval is a decision's (rule checkpoint_interval, a person's
        checkpoint-every), the configured cadence's checkpoints too (checkpoint.cadence_kept): the
        newest checkpoint.keep alone would span keep x the short interval. A run at its configured
        interval keeps what it kept."""
        c = self.cfg.checkpoint
        if self.state.checkpoint_every is None:
            return ()
        return cadence_kept(self.cfg.run_dir, self.state.step, c.every, c.keep)

    def _good(self) -> bool:
        """Whether this step's checkpoint is a rollback target (the weights are finite): the hooks'
        call, or, saving a restored step again, the restored checkpoint's own. Its weights are those;
        the hooks, just after the rollback, would call them unhealthy (an escalation under way) and
        take the run's last good checkpoint from it. Only that step's: the first save past it (none
        between) was given the restored step's verdict too, never good (debug, weights_nan at 25 and
        55: the second rolled back to step 20 again, read as the first breakage's, and cut the LR:
        +15.7%)."""
        if self._restored and self.state.step == self.last_saved:
            return self.last_good == self.state.step
        return all(h.healthy(self.view) for h in self.hooks)

    def snapshot(self) -> None:
        """A lean snapshot of this step (snapshots.py): bf16 weights only, by rank 0. A failed
        write is said and training goes on: the checkpoints are the run's record, a snapshot a copy."""
        # as for a checkpoint (the same check: a NaN buffer is written too, a NaN moment's step is broken):
        # NaN weights exported are worse than none, and the retention would delete the good snapshots
        # before them to make room (the newest snapshot_keep are kept)
        if broken := self._not_finite():
            self.say(f"step {self.state.step}: {broken[0]} are not finite{_nor(broken)}: no lean snapshot written")
            return
        try:
            self.dist.on_main(save_snapshot, *_snapshot_args(self))
        except OSError as exc:
            self.say(f"step {self.state.step}: the lean snapshot was not written ({exc}); training goes on")

    def _keep_weights(self) -> None:
        """No checkpoint fits (the disk rule's stop, exit code 4): the weights alone, as a lean snapshot
        (fp32 where it fits, else bf16: snapshots.save_last_weights), so the steps trained since the resume point
        are not all lost. Never the resume point: an exact resume needs the optimizer's moments, the data
        position and the RNG, which only a checkpoint holds; the snapshot starts a new run (train.init_from).
        Said in the stop reason (the exit line and summary.json): where the weights are, or that they did
        not fit either."""
        step = self.state.step
        if self.dist.sharded:  # check_snapshots' reason: gathering sharded weights is not built yet
            kept = "its weights were not kept either (a lean snapshot needs every weight on one rank)"
        else:
            try:
                path, precision = self.dist.from_main(save_last_weights, *_snapshot_args(self))
            except OSError as exc:
                kept = self._weights_not_kept(exc)
            else:
                self.weights_kept = str(path)
                kept = f"its weights alone ({precision}; no optimizer state: not a resume point) are kept in {path}"
                kept += _init_from(path)
        self.stop_reason += f"; step {step}: {kept}"
        self.say(f"step {step}: no checkpoint fits; {kept}")

    def _weights_not_kept(self, exc: OSError) -> str:
        """_keep_weights' words when this step's weights did not fit: the weights kept from before, and where.
        A snapshot of this step on disk (an earlier session's stop at it) holds them: its space was what the
        new copy needed (soak: "the steps since are lost", step 22's weights in snapshots/step_000022)."""
        step, resumes = self.state.step, self.last_saved
        path = self.dist.from_main(newest_weights, self.cfg.run_dir, step)
        if path is not None and step_of(path.name) == step:
            self.weights_kept = str(path)
            return (
                f"its weights were not written again ({exc}); this step's are in {path} already, from an earlier "
                f"stop or snapshot at it (no optimizer state: not a resume point)" + _init_from(path)
            )
        if path is None or step_of(path.name) <= resumes:
            return f"not even its weights fit as a lean snapshot ({exc}): steps {resumes + 1}-{step} are lost"
        return (
            f"not even its weights fit as a lean snapshot ({exc}): steps {step_of(path.name) + 1}-{step} are lost; "
            f"the newest weights kept are step {step_of(path.name)}'s, in {path}" + _init_from(path)
        )

    def check_snapshots(self) -> None:
        """Refused before training, not at the first snapshot: a snapshot needs every weight on
        one rank, and gathering sharded ones is not built yet."""
        if self.cfg.checkpoint.snapshot_every and self.dist.sharded:
            raise ConfigError(
                "checkpoint.snapshot_every: lean snapshots need every weight on one rank; not yet under FSDP2, "
                "tensor, expert or pipeline parallelism (set checkpoint.snapshot_every=0)"
            )

    def finish_save(self) -> None:
        """Wait for the checkpoint being written in the background (checkpoint.asynchronous): its
        hooks' on_checkpoint once it is on disk, the wait counted in its stall; a failed write
        makes the checkpoint before it the resume point again and is handled as a failed save. The
        upload of the checkpoint before it (checkpoint.dir) is waited for here too, in the stall."""
        if self._writing is None:
            return
        (step, before), self._writing = self._writing, None
        started = time.perf_counter()
        try:
            path = self.dist.finish_save()
        except OSError as exc:
            self.last_saved, self.last_good = before
            self.say(f"step {self.state.step}: the checkpoint of step {step}, written in the background, failed: {exc}")
            self._save_failed(exc)
            return
        self._call("on_save_stall")  # the upload before: this checkpoint's starts in on_checkpoint
        self.save_seconds += time.perf_counter() - started
        self._restored = False
        self._call("on_checkpoint", path)

    def _save_failed(self, exc: OSError) -> bool:
        """A hook may take a failed save's error (the orchestrator's disk rule); unhandled, it ends the run."""
        if self._saving_again:  # the hooks' remedy for a failed save failed too: Control's line says so
            return False
        if not any(h.on_save_error(self.view, exc) for h in self.hooks):
            raise exc
        # What the hooks requested about it (free space and save again, stop) is applied
        # now, before this save returns, as after an out-of-memory error.
        self._saving_again = True
        try:
            self.control.apply()
        finally:
            self._saving_again = False
        if self.last_saved == self.state.step:  # a retry saved it
            return True
        if not self.stop_reason:  # a stop's own final save: the resume point stays the one on disk
            self._owe_save()
        return False

    def _owe_save(self) -> None:
        """The save failed and so did the hooks' retry: tried again after 1, 2, 4... steps, at most a
        quarter of the checkpoint interval apart. Left to the next interval, a rollback soon after
        replayed everything since the checkpoint before (debug-mod, disk_full@20:2, weights_noise@36:
        36 steps); each retry that fails goes to the hooks again (the disk rule stops the run once the
        saves have failed for a whole interval)."""
        cap = max(1, self.control.checkpoint_every() // 4)
        wait = 1 if self._owed is None else min(2 * self._owed[1], cap)
        self._owed = (self.state.step + wait, wait)
        self.say(
            f"step {self.state.step}: no checkpoint since step {self.last_saved}; "
            f"the save is tried again at step {self.state.step + wait}"
        )

    def _save_owed(self) -> bool:
        """Whether a failed save is to be tried again at this step (_owe_save)."""
        return self._owed is not None and self.state.step >= self._owed[0]

    def _checkpoint_state(self, good: bool) -> dict[str, Any]:
        """state.json's content: everything a resume needs besides weights, optimizer and RNG."""
        losses, norms, _ = self.window.read()
        return {
            "train": vars(self.state).copy(),
            "data": self.loader.state_dict(),
            "good": good,
            "precision": self.precision.name,  # a resumed auto run keeps it (training/services/cpu_precision.py)
            "moe": self.model.moe_state(),
            "mod": self.model.mod_state(),
            "log_window": {
                "losses": losses,
                "norms": norms,
                "tokens": self.window.tokens,
                "seconds": self.window.seconds,
            },
            "hooks": {key: h.state_dict() for key, h in keyed(self.hooks)},
            # the best evaluation so far and its checkpoint (kept from pruning): a resume that began
            # it anew kept the best since the resume and pruned the run's best (soak, 5 kills)
            "best": {"eval": self.best_eval, "checkpoint": self.best_checkpoint},
            "row_gate": self.row_gate.state_dict() if self.row_gate is not None else None,
            TRAINED: trained_config(self.cfg),  # a resume names each edit of it (training/changes.py)
        }

    def rollback(self, to: str | int = "last_good") -> str:
        """Restore weights, optimizer, data position and RNG from a checkpoint; keep the knobs. A load
        that fails part-way puts the state from before it back (RestorePoint), sets that checkpoint aside
        in checkpoints/corrupt/ and tries the next older one; with none left the run stops (exit code 3)."""
        self.watchdog.beat("rollback")  # a load from disk: its own timeout, not the hooks' few milliseconds
        self.finish_save()
        step, experts = self.state.step, expert_counts(self.model)
        before, failed, retired = None, [], []
        while (found := self._rollback_target(to)) is not None:
            # the abandoned trajectory's checkpoints are retired before the load (seconds to minutes for
            # a large model), not after: a process killed in it resumed from the state it rolled back from
            retired += self.dist.from_main(retire_after, self.cfg.run_dir, found[1]["step"], self.cfg.checkpoint.keep)
            before = before or RestorePoint(self)
            if not (error := self._load_whole(found[0], before)):
                break
            failed.append(f"{found[0]}: {error}")
            self.dist.on_main(set_aside_corrupt, self.cfg.run_dir, found[1]["step"] - 1, self.cfg.checkpoint.keep)
            self.say(
                f"step {step}: the rollback could not load {found[0]} ({error}); set aside in checkpoints/corrupt/"
            )
        if found is None:
            what = "good checkpoint" if to == "last_good" else f"checkpoint at or before step {to}"
            if not failed:  # nothing changed: the caller says so and training goes on
                raise CheckpointError(f"no {what} to roll back to in {self.cfg.run_dir / 'checkpoints'}")
            self.dist.on_main(put_back_retired, self.cfg.run_dir, retired)  # the trajectory is kept, as they are
            reason = f"no {what} loads for a rollback ({'; '.join(failed)}); the weights of step {step} are kept"
            self.request_stop(reason, GAVE_UP)
            raise CheckpointError(reason)
        # a save owed since a failed one (_owe_save) was the abandoned trajectory's: the replay saves at its interval
        self._restored, self._owed = True, None
        if self.last_eval.get("step", 0) > self.state.step:  # it judged the abandoned weights
            self.last_eval = {}
        # an expert added or pruned since the checkpoint is undone with its weights: said, not silent
        # (the journal showed "8 -> 9 experts" applied, and the rollback named no change)
        now = expert_counts(self.model)
        undone = [f"layer {i}: {experts[i]} -> {m} experts" for i, m in now.items() if experts[i] != m]
        said = f" ({'; '.join(undone)}: the checkpoint's)" if undone else ""
        return f"rolled back from step {step} to step {self.state.step}{said}"

    def _rollback_target(self, to: str | int) -> tuple[Any, dict[str, Any]] | None:
        found = self.dist.from_main(find_checkpoint, self.cfg.run_dir, to)
        return self._common_checkpoint(found) if found is not None and self.replicas is not None else found

    def _load_whole(self, path: Path, before: RestorePoint) -> str:
        """'' once every rank loaded all of `path` for a rollback (then its hooks are told); else why
        not, and every rank is put back as it was (`before`): never a mix of the two states."""
        state, error = agreed(self.dist, "load of it", self._load, path, True)
        if error:
            before.put_back(self)
            return error
        for key, hook in keyed(self.hooks):
            hook.on_rollback(self.view, state["hooks"].get(key, {}))
        return ""

    def _common_checkpoint(self, newest: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]] | None:
        """The newest checkpoint at or before this group's `newest` that every replica group
        holds (resilience.ft); each candidate is found (and verified) once."""
        found = {newest[1]["step"]: newest}  # target step -> this group's newest at or before it

        def held(target: int) -> int:
            if target not in found:
                found[target] = self.dist.from_main(find_checkpoint, self.cfg.run_dir, target)
            return found[target][1]["step"] if found[target] is not None else -1

        step = self.replicas.common_step(newest[1]["step"], held)
        return found[step] if step >= 0 else None  # common_step ends on a step held() found here

    # ------------------------------------------------------------------ replica groups (resilience.ft)

    def _replica_state(self) -> dict[str, Any]:
        """What a replacement replica group receives live from this one (distributed/ft.py): a
        checkpoint's content, in memory (torchft copies it to host memory and serves it)."""
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "state": self._checkpoint_state(good=True),
            **self._gate_tables(),
        }

    def _take_replica_state(self, received: dict[str, Any]) -> None:
        """A healthy group's state (_replica_state), taken as a resume from it would take it."""
        state = received["state"]
        apply_structure(self.model, state)  # experts added or pruned there
        ours = self.model.state_dict()  # FSDP2: each shard comes as a local tensor; made a DTensor again
        self.model.load_state_dict({k: shard_like(v, ours.get(k)) for k, v in received["model"].items()})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, moments in received["optim"]["state"].items():
            moments.update({name: shard_like(v, params[index]) for name, v in moments.items()})
        self.state = TrainState(**state["train"])
        self.control.apply_lengths()
        self._enter_phase(self.state.phase)
        self.optimizer.load_state_dict(received["optim"])
        self.control.apply_knobs()
        if self.scaler and received["scaler"]:
            self.scaler.load_state_dict(received["scaler"])
        self.loader.load_state_dict(state["data"])
        self._take_best(state)
        self._take_gate(state, received)
        self._resume_window_and_hooks(state)


def _nor(broken: list[str]) -> str:
    """The parts not finite after the first, as the refusal says them: ", nor the optimizer's moments"."""
    return f", nor {' and '.join(broken[1:])}" if broken[1:] else ""


def _init_from(path: Path) -> str:
    return f"; to train on from them instead, a new run: --set train.init_from={path} --out NEW_DIR"


def _snapshot_args(trainer: Checkpointing) -> tuple[Any, ...]:
    """save_snapshot's arguments for the trainer's step: the weights and the little state a lean snapshot keeps
    (a cadence's snapshot and the disk rule's stop's alike)."""
    c, state, model = trainer.cfg.checkpoint, trainer.state, trainer.model
    kept = {"tokens": state.tokens, "moe": model.moe_state(), "mod": model.mod_state()}
    return trainer.cfg.run_dir, state.step, model.state_dict(), kept, c.snapshot_keep, c.snapshot_keep_every
