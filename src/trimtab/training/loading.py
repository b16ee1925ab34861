"""The Trainer's load half: a resume from a checkpoint and the load a rollback does (its state, the
knobs a rollback keeps, the best evaluation, the row gate, the hooks' state). A mixin of Checkpointing
(training/checkpointing.py), whose rollback and replica state call it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trimtab.checkpoint import find_checkpoint
from trimtab.config import RunConfig
from trimtab.data.position import data_position
from trimtab.errors import CheckpointError
from trimtab.rl.reference import resume_reference
from trimtab.training.changes import TRAINED, changes_line, changes_on_resume
from trimtab.training.emergency import EMERGENCY, EmergencySave, emergency_resume_line
from trimtab.training.hooks import keyed
from trimtab.training.restore_point import agreed, keep_router_knobs
from trimtab.training.resume import made_up_steps, set_aside_note
from trimtab.training.runtime import LogWindow, set_rng_state
from trimtab.training.schedule import configured_lengths, reconcile
from trimtab.training.setup import prepare_run_dir
from trimtab.training.state import KEPT_ON_ROLLBACK, TrainState

log = logging.getLogger(__name__)


class Loading(EmergencySave):
    """Loads a checkpoint into the Trainer's state: `resume` at start-up, `_load` for a rollback too."""

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
        experts = expert_counts(self.model)
        self.dist.load_model(self.model, weights, state, path)  # any checkpoint format, any world size
        # a resume after surgery, a rollback across it: summary.json gave the config's (or the undone
        # surgery's) parameter count, and MFU its FLOPs. Every rank whose model counts whole: DDP's copy,
        # FSDP2's and tensor parallelism's DTensors (global sizes); not a pipeline stage's own layers nor
        # an expert-parallel rank's own experts
        if self.dist.mesh.pp == 1 and self.dist.mesh.ep == 1 and expert_counts(self.model) != experts:
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


def expert_counts(model: Any) -> dict[int, int]:
    """Each MoE layer's expert count, by block index."""
    return {i: layer.n_experts for i, layer in model.moe_layers()}
