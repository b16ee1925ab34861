"""The Trainer's checkpoint half: save (synchronous or in the background), wait for a background
write, a failed save handed to the hooks, the run's last save, rollback and resume (docs/resilience.md,
"Asynchronous checkpoints"). A mixin of Trainer (training/trainer.py), whose state it reads and sets.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trimtab.checkpoint import cadence_kept, find_checkpoint, list_checkpoints, retire_after, set_aside_corrupt
from trimtab.checkpoint_load import apply_structure
from trimtab.config import RunConfig
from trimtab.data.position import data_position
from trimtab.distributed.ft import shard_like
from trimtab.errors import CheckpointError, ConfigError
from trimtab.rl.reference import resume_reference
from trimtab.snapshots import save_last_weights, save_snapshot
from trimtab.storage import step_of
from trimtab.training.changes import TRAINED, changes_line, changes_on_resume, trained_config
from trimtab.training.emergency import EMERGENCY, EmergencySave, emergency_resume_line
from trimtab.training.hooks import keyed
from trimtab.training.restore_point import RestorePoint, agreed, keep_router_knobs
from trimtab.training.resume import made_up_steps, set_aside_note
from trimtab.training.runtime import LogWindow, rng_state, set_rng_state
from trimtab.training.schedule import configured_lengths, reconcile
from trimtab.training.setup import prepare_run_dir
from trimtab.training.state import GAVE_UP, KEPT_ON_ROLLBACK, NO_CHECKPOINT, TrainState

log = logging.getLogger(__name__)


class Checkpointing(EmergencySave):
    """Checkpoints of the run a Trainer trains; `last_saved` is the resume point (a background
    write in flight included), `last_good` the newest checkpoint its hooks called healthy."""

    # A rollback restored the checkpoint of this step (last_saved), and what it decided since (its
    # journal line, the ladder, the knobs and rows it changed) is in no checkpoint until the next one
    # is on disk: a save at this step writes it again instead of taking the one on disk as current.
    _restored = False
    # where the disk rule's stop kept the weights alone (_keep_weights): the summary and the stop's journal line say so
    weights_kept: str | None = None

    def _final_save(self) -> None:
        """The run's last checkpoint, as the state it ends in deserves. Weights that are not
        finite are not saved, and the run is not "completed": it ends with exit code 3 and the
        newest checkpoint on disk as its resume point. A run that gave up (exit code 3) on weights
        a hook does not call healthy saves them for inspection in checkpoints/rolled_back/,
        never as the resume point: re-running starts from the last good state."""
        if not self.save(wait=True) and not self.dist.all_finite(self.model.parameters()):
            self.request_stop(
                f"the weights are not finite at step {self.state.step}; re-running resumes from the newest "
                f"checkpoint, step {self.last_saved}",
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
        if not self.dist.all_finite(self.model.parameters()):
            self.say(
                f"step {self.state.step}: the weights are not finite: no checkpoint written (the resume "
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
        self.last_good = self.state.step if good else self.last_good
        if background:
            self._writing = (self.state.step, before)
        else:
            self._restored = False
            self._call("on_checkpoint", path)
        return True

    def _protected(self) -> tuple[int, ...]:
        """The steps whose checkpoints pruning keeps besides the newest checkpoint.keep."""
        return (
            self.last_good,
            self.best_checkpoint,
            # step 0 is the KL term's and DPO's reference policy (rl/reference.py)
            0 if self.cfg.rl.kl_coef or (self.cfg.dpo.enabled and self.cfg.dpo.uses_reference) else -1,
            *self._hooks_kept(),
            *self._cadence_kept(),
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
        # as for a checkpoint: NaN weights exported are worse than none, and the retention would
        # delete the good snapshots before them to make room (the newest snapshot_keep are kept)
        if not self.dist.all_finite(self.model.parameters()):
            self.say(f"step {self.state.step}: the weights are not finite: no lean snapshot written")
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
                kept = f"not even its weights fit as a lean snapshot ({exc}): the steps since are lost"
            else:
                self.weights_kept = str(path)
                kept = (
                    f"its weights alone ({precision}; no optimizer state: not a resume point) are kept in {path}; to "
                    f"train on from them instead, a new run: --set train.init_from={path} --out NEW_DIR"
                )
        self.stop_reason += f"; step {step}: {kept}"
        self.say(f"step {step}: no checkpoint fits; {kept}")

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
        return self.last_saved == self.state.step  # a retry may have saved it

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
        step, experts = self.state.step, _expert_counts(self.model)
        before, failed = None, []
        while (found := self._rollback_target(to)) is not None:
            # the abandoned trajectory's checkpoints are retired before the load (seconds to minutes for
            # a large model), not after: a process killed in it resumed from the state it rolled back from
            self.dist.on_main(retire_after, self.cfg.run_dir, found[1]["step"], self.cfg.checkpoint.keep)
            before = before or RestorePoint(self)
            if not (error := self._load_whole(found[0], before)):
                break
            failed.append(f"{found[0]}: {error}")
            self.dist.on_main(set_aside_corrupt, self.cfg.run_dir, found[1]["step"] - 1)
            self.say(
                f"step {step}: the rollback could not load {found[0]} ({error}); set aside in checkpoints/corrupt/"
            )
        if found is None:
            what = "good checkpoint" if to == "last_good" else f"checkpoint at or before step {to}"
            if not failed:  # nothing changed: the caller says so and training goes on
                raise CheckpointError(f"no {what} to roll back to in {self.cfg.run_dir / 'checkpoints'}")
            reason = f"no {what} loads for a rollback ({'; '.join(failed)}); the weights of step {step} are kept"
            self.request_stop(reason, GAVE_UP)
            raise CheckpointError(reason)
        self._restored = True
        if self.last_eval.get("step", 0) > self.state.step:  # it judged the abandoned weights
            self.last_eval = {}
        # an expert added or pruned since the checkpoint is undone with its weights: said, not silent
        # (the journal showed "8 -> 9 experts" applied, and the rollback named no change)
        now = _expert_counts(self.model)
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

    def resume(self, path: Path, live_changes: dict[str, tuple[Any, Any]]) -> None:
        """Take the checkpoint at `path` as the run's state, with what a person changed in the
        config since it was saved: phase lengths (reconciled in _load: config_changes, journaled
        by the orchestrator) and live model knobs (setup.check_resume_compatible), the config's
        value over the checkpoint's. Only then config.yaml is written: a resume refused here
        (other data, a phase length it cannot take, a reference gone) leaves the run directory as it was."""
        self.reference = resume_reference(self.cfg, self.device)  # at the first step it was too late to refuse
        trained = self._load(path, rollback=False).get(TRAINED)  # the config it was trained with
        if live_changes:  # kept by a rollback, as every knob is
            apply_live_keys(self.model, self.cfg, list(live_changes))
        changes = self.dist.from_main(changes_on_resume, self.cfg, trained)  # else config.yaml, the last session's
        self.config_changes += changes  # after the phase lengths: the orchestrator journals each
        if changes:
            self.say(changes_line(changes, self.state.step))
        self.dist.on_main(prepare_run_dir, self.cfg, self.tok)
        where = data_position(self.loader.state_dict())  # on another world size the step alone does not say it
        where = f"; data at {where}" if where else ""
        aside = self.dist.from_main(set_aside_note, self.cfg.run_dir, self.state.step)  # one line says it all
        say = log.warning if aside else log.info
        say("resuming from %s (step %d of %d%s)%s", path, self.state.step, self.total_steps, where, aside)

    def _load(self, path: Path, rollback: bool) -> dict[str, Any]:
        """The checkpoint at `path` as the run's state (rollback: the knobs kept); returns its state.json."""
        weights, optim_state, state = self._read(path)
        knobs = (self.model.moe_state(), self.model.mod_state())  # the router's: a rollback keeps them
        experts = _expert_counts(self.model)
        self.dist.load_model(self.model, weights, state, path)  # any checkpoint format, any world size
        # a resume after surgery, a rollback across it: summary.json gave the config's (or the undone
        # surgery's) parameter count, and MFU its FLOPs. Every rank whose model counts whole: DDP's copy,
        # FSDP2's and tensor parallelism's DTensors (global sizes); not a pipeline stage's own layers nor
        # an expert-parallel rank's own experts
        if self.dist.mesh.pp == 1 and self.dist.mesh.ep == 1 and _expert_counts(self.model) != experts:
            self.control.recount()
        kept = {k: getattr(self.state, k) for k in KEPT_ON_ROLLBACK}
        skipped = self.loader.skipped
        self.state = TrainState(**{**state["train"], "made_up": made_up_steps(state)})  # older: its journal's
        self.state.phase_steps = self.state.phase_steps or configured_lengths(self.cfg)  # older checkpoints
        if rollback:
            self.state.__dict__.update(kept, rollbacks=kept["rollbacks"] + 1)
            keep_router_knobs(self.model, *knobs)
        else:  # before the phases are laid out: the config may add one or drop one (schedule.py)
            self.config_changes = reconcile(self.state, self.phases, configured_lengths(self.cfg))
        self.control.apply_lengths()
        self._enter_phase(self.state.phase)
        self.dist.load_optimizer(self.model, self.optimizer, optim_state, path)
        self.control.apply_knobs()  # load_state_dict brought back the saved weight decay
        if self.scaler and optim_state["scaler"]:
            self.scaler.load_state_dict(optim_state["scaler"])
        set_rng_state(optim_state["rng"])
        self.loader.load_state_dict(state["data"])
        self.last_saved = self.state.step
        self.last_good = self.state.step if state.get("good", True) else self._good_before()
        self._take_best(state, rollback)
        self._take_gate(state, optim_state)
        if rollback:  # its hooks are told once every rank loaded it (_load_whole)
            self.loader.skipped |= skipped
            self.window = LogWindow()
            return state
        if state.get(EMERGENCY):  # the restart's own line says how it came to be (training/emergency.py)
            self.say(emergency_resume_line(state, self.dist.world))
        self._resume_window_and_hooks(state)
        return state

    def _read(self, path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """read_checkpoint on every rank, each its own files' read: one failing (its disk) fails all here,
        before the loads' collectives, where the others would wait for it (a sharded read's failure is
        raised on every rank: _dcp_load)."""
        read, error = agreed(self.dist, "read of it", self.dist.read_checkpoint, path)
        if error:
            raise CheckpointError(error)
        return read

    def _good_before(self) -> int:
        """The newest good checkpoint on disk (-1: none), for a load of one that is not good: pruning
        spares last_good, and -1 let the first save after a resume delete the run's only rollback
        target (soak: a kill -9 during an escalation, then a fault with nothing to roll back to)."""
        found = self.dist.from_main(find_checkpoint, self.cfg.run_dir, "last_good")
        return found[1]["step"] if found is not None else -1

    def _gate_tables(self) -> dict[str, Any]:
        """optim.pt's share of the row gate's state: its token-frequency tables, a tensor (training/row_gate.py
        RowGate.tables; state.json keeps the rest), under data parallelism each rank's (row_gate_by_rank)."""
        return {"row_gate": self.row_gate.tables()} if self.row_gate is not None else {}

    def _take_gate(self, state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        """The row gate's reference as of the checkpoint (training/row_gate.py), its tables from optim.pt
        (this rank's: distributed/checkpoint.py load_optimizer); kept as it is when the checkpoint has none
        (older, or saved with the gate off)."""
        if self.row_gate is not None and state.get("row_gate"):
            self.row_gate.load_state_dict(state["row_gate"], optim_state.get("row_gate"))

    def _take_best(self, state: dict[str, Any], rollback: bool = False) -> None:
        """The best evaluation as of the checkpoint; none in a checkpoint from before it was kept. A
        rollback keeps this process's if it judged the kept trajectory (at or before the step rolled
        back to: the checkpoint may predate it, as step 0's predates step 0's evaluation); one found
        on the abandoned branch judged weights thrown away."""
        if rollback and self.best_eval is not None and self.best_eval[0] <= self.state.step:
            return
        best = state.get("best") or {}
        self.best_eval = tuple(best["eval"]) if best.get("eval") else None
        self.best_checkpoint = int(best.get("checkpoint", -1))

    def _resume_window_and_hooks(self, state: dict[str, Any]) -> None:
        window = state["log_window"]
        self.window = LogWindow(window["losses"], window["norms"], window["tokens"], window["seconds"])
        for key, hook in keyed(self.hooks):
            hook.load_state_dict(state["hooks"].get(key, {}))

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


def apply_live_keys(model: Any, cfg: RunConfig, keys: list[str]) -> None:
    """Set the live knobs `keys` (config/model.py LIVE_MODEL_KEYS) of the model's MoE and MoD layers to `cfg`'s
    values: a resume applies a person's changed ones over those its checkpoint restored."""
    for key in keys:
        section, name = key.split(".")[1:]
        if section == "moe":
            value = float(getattr(cfg.model.moe, name))
            for _, moe in model.moe_layers():
                setattr(moe, "jitter" if name == "router_jitter" else name, value)
        else:  # model.mod.capacity, layer_capacity: each MoD layer's target (set_step warms toward it)
            layers = [i for i, kind in enumerate(cfg.model.layers) if "mod" in kind]
            targets = dict(zip(layers, cfg.model.mod_capacities))  # by layer index, as mod_state keeps them
            for i, router in model.mod_layers():
                router.target = float(targets[i])


def _expert_counts(model: Any) -> dict[int, int]:
    """Each MoE layer's expert count, by block index."""
    return {i: layer.n_experts for i, layer in model.moe_layers()}


def _snapshot_args(trainer: Checkpointing) -> tuple[Any, ...]:
    """save_snapshot's arguments for the trainer's step: the weights and the little state a lean snapshot keeps
    (a cadence's snapshot and the disk rule's stop's alike)."""
    c, state, model = trainer.cfg.checkpoint, trainer.state, trainer.model
    kept = {"tokens": state.tokens, "moe": model.moe_state(), "mod": model.mod_state()}
    return trainer.cfg.run_dir, state.step, model.state_dict(), kept, c.snapshot_keep, c.snapshot_keep_every
