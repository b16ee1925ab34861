"""The trainer: setup() (training/setup.py) builds the run, fit() runs the step loop.

The loop reads top to bottom (see fit); logging, evaluation, checkpoints and signals hook around
the step, and everything stateful goes into the checkpoint so that resume is exact. Hooks see the
run through a read-only RunView and change it only through Control's requests, which the loop
applies at its points (training/view.py, training/control.py); a test instrument (fault injection)
writes through its own FaultHandle (training/instrument.py). Parts of the Trainer live in mixins of
their own: checkpoints (checkpointing.py), phases and evaluations (phases.py), RL's and DPO's
objectives (policy.py), and the retries after an out-of-memory error (oom.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from trimtab.data import MicroBatch, StepBatch
from trimtab.distributed.ft import ReplicaGroups, check_groups
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairBatch, PairMicroBatch
from trimtab.rl.replay import replaying
from trimtab.rl.step import PolicyMicroBatch, RolloutBatch
from trimtab.training.checkpointing import Checkpointing
from trimtab.training.control import Control
from trimtab.training.emergency import lost_words, peer_lost
from trimtab.training.gain import GainProbe
from trimtab.training.hooks import ConsoleLogger, Hook, JsonlLogger, TensorBoardLogger, call_sealed
from trimtab.training.instrument import FaultHandle, Instrument
from trimtab.training.loss import cross_entropy_sum, with_aux
from trimtab.training.metrics import run_summary, step_metrics
from trimtab.training.oom import OomRecovery
from trimtab.training.optim import set_lr
from trimtab.training.phases import Phases
from trimtab.training.policy import PolicyTraining
from trimtab.training.rerun import Gradients, compare, ranks_that_differ
from trimtab.training.resume import logged_eval
from trimtab.training.row_gate import mix_parts, row_gate
from trimtab.training.runtime import LogWindow, RouterStats, RowLosses
from trimtab.training.schedule import configured_lengths, note_withheld
from trimtab.training.services.compiling import StepTimes
from trimtab.training.services.signals import handle_signals, say_stopping
from trimtab.training.setup import BuiltRun
from trimtab.training.state import StepOutput, TrainState
from trimtab.training.view import RunView

log = logging.getLogger(__name__)


class Trainer(Checkpointing, Phases, PolicyTraining, OomRecovery):
    _lost_after_update: RuntimeError | None = None  # a peer lost in the gain probe, after the update (_update_gain)

    def __init__(self, run: BuiltRun, hooks: list[Hook] = ()):
        cfg = self.cfg = run.cfg
        self.dist, self.device, self.precision = run.dist, run.dist.device, run.precision
        self.tok, self.phases, self.model = run.tok, run.phases, run.model
        self.forward, self.scaler = run.forward, run.scaler  # forward: model.hidden, wrapped
        self.sizes = run.sizes  # counted before parallelism split the model
        self.flops_per_token = self.sizes["flops_per_token"]
        if self.dist.pipeline is not None:
            self.dist.pipeline.loss_sum = self._loss_sum
        self.peak_flops, self.peak_source = run.peak
        self.compile, self.step_times = run.compile, StepTimes()
        self.watchdog = run.watchdog  # beaten at each section of a step: a hung rank ends fast, its upload first
        self.watchdog.before_exit = self.upload_before_hang_exit
        # a flagged step computed again before it is judged (training/rerun.py); fp16's GradScaler
        # unscales once per update, and skips non-finite steps itself
        self.rerun = cfg.resilience.rerun and not self.scaler
        self.row_gate = row_gate(cfg, self.device)  # garbage rows left out before the update (training/row_gate.py)
        self.state = TrainState(phase_steps=configured_lengths(cfg))
        self.stop_reason = ""
        self.exit_code = 0  # the process's, for a scheduler: non-zero when the run gave up
        self.hooks = self._loggers() + list(hooks)
        self.window = LogWindow()
        self.control = Control(self, self.applying)
        self.view = RunView(self, self.control)  # what hooks see
        self.findings: list[Any] = []  # hooks' findings for the orchestrator (RunView.propose)
        for hook in self.hooks:
            if isinstance(hook, Instrument):  # fault injection: the one writer beside Control
                hook.attach(FaultHandle(self))
        self.data_shard = self._data_shard()
        self.control.apply_lengths()
        self._enter_phase(0)
        self.resumed_from = run.resume[0] if run.resume else None
        self.last_saved = self.last_good = -1
        # the best evaluation (step, score: higher is better) and the newest checkpoint at or
        # before it, kept from pruning: a rollback to the best policy (rule rl_hacking) finds it
        self.best_eval: tuple[int, float] | None = None
        self.best_checkpoint = -1
        self.reference: Any = None  # the frozen starting policy of rl.kl_coef and DPO (loaded at first use)
        self.behaviour: list[Any] = []  # asynchronous RL's generating copies of the policy (_policy_snapshot)
        # a test instrument's (FaultHandle.gate_rollouts): rows, the generating weights' step, an evaluation's
        self.rollout_gate: Callable[[int, int, bool], None] | None = None
        self.check_snapshots()
        self.save_seconds = 0.0  # what the newest save stalled training (goodput, the checkpoint interval)
        self.config_changes: list[dict[str, Any]] = []  # phase lengths a person changed on resume
        if run.resume:  # then config.yaml is written: a refused resume changes nothing
            self.resume(run.resume[0], run.live_changes)
        # resumed at its end (its summary not written): the final evaluation it logged, for the summary
        at_end = run.resume and self.state.step >= self.total_steps
        self.last_eval: dict[str, Any] = logged_eval(self.cfg.run_dir, self.state.step) if at_end else {}
        self.evaluating = False  # inside evaluate() (fault injection aims at it)
        self._saving_again = False  # applying the hooks' requests after a failed save
        self._writing: tuple[int, tuple[int, int]] | None = None  # a background save: step, resume point before
        self.replicas = self.dist.replicas = self._replica_groups()  # reduce_step averages across the groups

    def _replica_groups(self) -> ReplicaGroups | None:
        """resilience.ft: this process is one replica group (distributed/ft.py); None without it."""
        ft = self.cfg.resilience.ft
        if not ft.enabled:
            return None
        who = (self.dist.rank, self.dist.world)
        return ReplicaGroups(
            ft, who, self.device, self.cfg.run_dir, self.say, self._replica_state, self._take_replica_state
        )

    def _loggers(self) -> list[Hook]:
        """The console, metrics.jsonl and TensorBoard loggers: rank 0 alone writes logs and metrics."""
        if not self.dist.is_main:
            return []
        loggers: list[Hook] = [ConsoleLogger(self.cfg.log.progress), JsonlLogger(self.cfg.run_dir)]
        if self.cfg.log.tensorboard:
            loggers.append(TensorBoardLogger(self.cfg.run_dir / "tb"))
        return loggers

    def _data_shard(self) -> tuple[int, int]:
        """(index, count) of this process's share of each step's rows: its data-parallel rank's; with
        replica groups, each group's ranks a slice of the groups' (distributed/ft.py)."""
        ft = self.cfg.resilience.ft
        if not ft.enabled:
            return self.dist.dp_rank, self.dist.dp_world
        check_groups(self.dist.mesh)
        world = self.dist.dp_world
        return ft.replica_group * world + self.dist.dp_rank, ft.groups * world

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        start = (self.state.step, self.state.tokens, self.state.train_seconds, time.perf_counter())
        # From here a signal finishes the step, saves and returns (before, it ended start-up).
        with handle_signals(self), self.watchdog.watching():
            self._call("on_train_start")
            self._deliver_findings()  # a restart's or fallback's finding: journaled before the first step's
            self.control.apply()  # what hooks decided at the start (rows the data screen flagged) holds from step 1
            if self.resumed_from is None:
                self.save()  # the initial weights: a good state to return to before any other exists
            if self._baseline_owed():
                self.evaluate()  # the starting policy's held-out figures: what RL is measured against
            while self.state.step < self.total_steps and not self.stop_reason:
                self._maybe_next_phase()
                t0 = time.perf_counter()
                self.watchdog.beat("data", self.state.step + 1)
                if self.replicas is not None and self.replicas.quorum(lambda: self.state.step):  # resilience.ft
                    self.save()  # a state went to a replacement: sender and receiver save it alike
                self.dist.step_starts()  # the straggler rule's measure of this rank's own work
                self.mark_step_start()  # what an emergency save of the step before needs (training/emergency.py)
                with self.saving_if_a_peer_is_lost():  # from the data's wait on: a peer lost in it too
                    batch = self._next_batch()
                    if batch is not None:
                        self._call("on_step_start", batch)
                        out = self._step_with_oom_retry(batch, t0)
                if batch is None:  # out of memory generating, with nothing left to shrink: stop_reason says why
                    break
                self.watchdog.beat("hooks")
                if out is None:  # out of memory with nothing left to shrink: stop_reason says why
                    break
                # the hooks' collectives (the orchestrator's reads of every rank's figures) come after the update: a
                # peer lost in them leaves the step just updated, complete, to save (marked in _after_step); one lost
                # in an intervention's (a rollback's load) leaves none, once it is applied the step with it in
                with self.saving_if_a_peer_is_lost():
                    self._after_step(out)  # bookkeeping and hooks: the orchestrator decides here
                    self._deliver_findings()  # another hook's finding (the live planner's): decided now
                    self.control.apply()  # interventions take effect at this one point
                    self._call("on_applied")  # the run as the next step trains it (the console's step line)
                    if self.state.step == out.step and self._phase_ends():
                        self._call("on_phase_end")  # hooks check the state a phase ends in (a rollback trains on)
                        self.control.apply()
                if self.state.step == out.step:  # a rollback restores a step saved (and evaluated if due) before
                    self.mark_step_start()  # the step just completed: a peer lost in its evaluation or save
                    with self.saving_if_a_peer_is_lost():
                        self._maybe_eval()
                        self._maybe_checkpoint()
            self._final_save()
        summary = run_summary(self, *start)
        self._date_evaluation(summary)
        self._call("on_train_end", summary)
        if self.replicas is not None:
            self.replicas.close()
        if isinstance(self.loader, RolloutLoader):
            self.loader.close()  # its verifier processes
        self.dist.close()
        return summary

    def train_step(self, batch: StepBatch) -> StepOutput:
        """One optimizer step: forward/backward over the micro-batches, clip, update."""
        scheduled = self.scheduled_lr()
        set_lr(self.optimizer, scheduled * self.state.lr_scale)
        self.model.set_step(self.state.step)  # Mixture-of-Depths capacity warm-up
        self.model.train()
        clip = self.control.grad_clip() or math.inf  # inf: measure the norm, change nothing
        forced = self.control.skip_by if self.control.skip_next else ""  # a person's or hook's skip: no re-run
        grads = self._gradients(batch, clip)
        # Checked before the update, so a bad step is never applied (torchtitan#4226).
        skip = self._update_gate(grads)
        emptied = grads.rows.all_gated() if grads.rows is not None else None  # the row gate left nothing to train
        rerun, flagged, gated = None, None, False
        if self.rerun and skip is not None and not forced:
            # one host read a step, the row gate's verdict with it (the LR warm-up's hold-back uses them: _withheld):
            # bit 0 the update gate's flag, bit 1 a step the row gate left nothing of
            both = int(skip if emptied is None else skip.long() + 2 * emptied.long())
            # a step the row gate left nothing of is withheld, not re-run: its gradient is zero and its loss its
            # garbage's own, over the spike ceiling by design (bad_batch@18:4 on debug: 3 of 4 steps re-run)
            flagged, gated = bool(both == 1), bool(both & 2)
        if flagged:
            grads, skip, rerun = self._rerun(batch, clip, grads)
            emptied = grads.rows.all_gated() if grads.rows is not None else None  # the re-run's rows
        if emptied is not None:  # withheld like a skipped step (not re-run: the gate's decision, not a fault)
            skip = emptied if skip is None else skip | emptied
        lr = self.optimizer.param_groups[0]["lr"]  # what the update applies
        if self.replicas is not None and not self.replicas.commit(self.state.step + 1):  # a group failed in it
            skip, flagged = torch.ones((), dtype=torch.bool, device=self.device), None  # withheld on every group
        self.update_begins()  # from here the weights are no completed step's: no emergency save
        gain = self._gain_probe(batch)
        overflow = self._update(skip)
        update_gain = self._update_gain(gain, batch, grads)
        self.optimizer.zero_grad(set_to_none=True)
        for _, layer in self.model.moe_layers():
            layer.update_bias(skip)  # aux-loss-free balancing: once per optimizer step, withheld with it
        return StepOutput(
            step=self.state.step + 1,
            loss=grads.loss,
            grad_norm=grads.grad_norm,
            lr=lr,
            scheduled_lr=scheduled,
            lr_scale=self.state.lr_scale,
            batch=batch,
            micro_batch_tokens=self.loader.micro_batch_tokens,
            changes=self.control.applied,
            phase=self.state.phase,
            skipped=skip,
            skip_by=forced,
            overflow=overflow,
            aux_loss=grads.aux,
            moe=grads.routers.moe_dict(),
            mod=grads.routers.mod_dict(),
            row_losses=grads.rows.values if grads.rows is not None else None,
            rerun=rerun,
            update_gain=update_gain,
            withheld=gated if flagged is False else None,  # flagged: the re-run's gate decides afresh
        )

    def _gradients(self, batch: StepBatch, clip: float) -> Gradients:
        """The step's gradients in .grad, summed over the ranks, unscaled, clipped to `clip`."""
        routers = RouterStats(self.model, self.device)
        # per-row losses come out of the fused loss (not a pipeline's stages, not tensor parallelism's vocab-sharded
        # head); not whether the head's weight is a DTensor: FSDP2's root holds one while resharded (the first step,
        # and from some step on for good), and the gate judged no row then (bad_batch@6:3: 240 of 544 rows a rank)
        per_row = self.dist.pipeline is None and self.dist.mesh.tp == 1
        if isinstance(batch, (RolloutBatch, PairBatch)):  # RL, DPO: no likelihood per row; this computation's sums
            per_row = False
            batch.terms.clear()  # (a re-run or an OOM retry computes them again)
        rows = RowLosses(batch.rows, self.device, gated=self.row_gate is not None) if per_row else None
        self.watchdog.beat("forward_backward")
        local_sq = self.dist.watch_local() if self.rerun else None  # whose computation a re-run faults
        loss, aux_total = self._forward_backward(batch, routers, rows)
        self.watchdog.beat("sync")
        self.dist.reduce_step(loss, aux_total, routers, self.model, rows)  # sums over ranks, on device
        self.watchdog.beat("optimizer")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.dist.clip_grad_norm(self.model.parameters(), clip)
        if isinstance(batch, RolloutBatch):  # the objective's sums for the RL figures, every rank's
            batch.settle(self.dist.sum_over_ranks)
        return Gradients(loss, aux_total, routers, rows, grad_norm, local_sq)

    def _rerun(self, batch: StepBatch, clip: float, first: Gradients) -> tuple[Gradients, torch.Tensor | None, dict]:
        """A flagged step's gradients computed again from the same weights on the same rows
        (training/rerun.py): the re-run's stand, gated afresh; the verdict for the orchestrator."""
        self._discard_gradients()
        again = self._gradients(batch, clip)
        verdict = compare(first, again)
        if verdict["verdict"] == "transient":
            verdict["ranks"] = ranks_that_differ(first, again)
        return again, self._update_gate(again), verdict

    def _discard_gradients(self) -> None:
        """Forget a computation of this step's gradients, which a re-run or an out-of-memory retry
        computes again: the gradients, and the MoE layers' routing counts each computation adds to
        (the balancing bias reads them once a step)."""
        self.optimizer.zero_grad(set_to_none=True)
        for _, layer in self.model.moe_layers():
            layer.load.zero_()

    def _forward_backward(
        self, batch: StepBatch, routers: RouterStats, rows: RowLosses | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the step's objective over its micro-batches; returns this rank's share of
        the token-normalised loss and of the weighted auxiliary losses (0-d, on device); each
        row's loss goes to `rows`."""
        if self.dist.pipeline is not None:  # the schedule runs forwards and backwards interleaved
            scale = self.scaler._scale if self.scaler else None  # private, but get_scale() syncs
            with self.precision.autocast():
                loss, aux = self.dist.pipeline.step(batch.micro, batch.n_targets, routers, scale)
            self._agree()  # before the update: an OOM anywhere retries the step
            routed = self.model.moe_layers() or self.model.mod_layers()
            return loss, aux if routed else None  # every stage alike, whichever holds the layers
        loss, aux_total = torch.zeros((), device=self.device), None
        gating = self.row_gate is not None and rows is not None and all(h.gates_rows(self.view) for h in self.hooks)
        for micro in batch.micro:
            # RL on a MoE policy: the routing its generation chose, through the backward (rl/replay.py)
            depth = isinstance(micro, PolicyMicroBatch) and self.cfg.rl.routing_replay
            gate = self.row_gate if gating and type(micro) is MicroBatch else None
            picked = gate.candidates(micro.targets, mix_parts(self.loader, micro.rows), self.loader) if gate else []
            with replaying(self.model, getattr(micro, "experts", None), depth, getattr(micro, "depth", None)):
                inputs = micro.inputs.to(self.device, non_blocking=True)
                targets = micro.targets.to(self.device, non_blocking=True)
                share = micro.n_targets / batch.n_targets
                token_losses = rows.buffer(targets) if rows is not None else None
                with self.precision.autocast():
                    hidden = self.forward(inputs)
                    # Token-normalised loss: each micro-batch's summed loss over the step's total
                    # target count, so the gradient is that of one large batch however it is split
                    # ((x1+x2)/(n1+n2), not (x1/n1+x2/n2)/2; torchtune#1875, transformers#34242).
                    if isinstance(micro, PolicyMicroBatch):  # RL: the clipped policy objective (rl/loss.py)
                        summed = self._policy_sum(hidden, inputs, targets, micro, batch)
                    elif isinstance(micro, PairMicroBatch):  # DPO: the preference loss (rl/dpo.py)
                        summed = self._dpo_sum(hidden, inputs, targets, micro, batch)
                    else:
                        head = self.model.lm_head.weight
                        trained = gate.mask(hidden, head, targets, picked) if gate else targets
                        summed = cross_entropy_sum(hidden, head, trained, token_losses=token_losses)
                    micro_loss = summed / batch.n_targets
                    aux = self.model.aux_loss()  # MoE balance + z, MoD predictor: weighted like the tokens
                    objective = with_aux(micro_loss, aux, share)
                if micro is batch.micro[-1]:  # ranks agree on OOM / signals before gradients are synced
                    self._agree()
                (self.scaler.scale(objective) if self.scaler else objective).backward()
            loss += micro_loss.detach()
            if aux is not None:
                aux_total = share * aux.detach() + (0 if aux_total is None else aux_total)
            routers.add(share)
            if rows is not None:
                if gate:  # a gated row's loss, as scored, stands in the row losses and the step's loss
                    loss += gate.after(token_losses, targets, trained) / batch.n_targets
                rows.add(micro.rows, token_losses, targets, gate.flags(len(micro.rows)) if gate else None)
        return loss, aux_total

    def _loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss over the targets of hidden states [B, T, D] (logits never whole)."""
        return cross_entropy_sum(hidden, self.model.lm_head.weight, targets)

    def score(self, micro: MicroBatch) -> torch.Tensor:
        """A micro-batch's summed loss over its targets (0-d, on device; no gradient), the same
        on every pipeline stage."""
        inputs, targets = micro.inputs.to(self.device), micro.targets.to(self.device)
        with torch.no_grad(), self.precision.autocast():
            if self.dist.pipeline is not None:
                return self.dist.pipeline.score(inputs, targets)
            return self._loss_sum(self.forward(inputs), targets)

    def _update_gate(self, grads: Gradients) -> torch.Tensor | None:
        """OR of the hooks' skip flags (0-d bool tensors on device), or None when nobody gates; on the
        loss the update trains on (the row gate's rows out: RowLosses.trained), as the monitors read it."""
        loss = grads.rows.trained(grads.loss) if grads.rows is not None else grads.loss
        flags = [f for h in self.hooks if (f := h.update_gate(self.view, loss, grads.grad_norm)) is not None]
        if self.control.skip_next:
            self.control.skip_next = False
            flags.append(torch.ones((), dtype=torch.bool, device=self.device))
        return torch.stack(flags).any() if flags else None

    def _gain_probe(self, batch: StepBatch) -> GainProbe | None:
        """The update's gain is measured (training/gain.py) where a hook asks for it this step and
        it can be: a likelihood batch, no fp16 scaler, the ranks holding one model between them
        (whole on each, or sharded by FSDP2, tensor or expert parallelism), not pipeline stages
        (each holds other layers) nor torchft's replica groups (their losses averaged only in the step)."""
        measurable = not (self.scaler or self.dist.pipeline is not None or self.replicas is not None)
        if (
            not measurable
            or isinstance(batch, (RolloutBatch, PairBatch))
            or not any(h.measure_gain(self.view) for h in self.hooks)
        ):
            return None
        # sharded: each rank dots its shards and one all-reduce sums them; whole weights dot alone
        world, sum_over_world = (self.dist.world, self.dist.sum_over_world) if self.dist.sharded else (1, None)
        probe = GainProbe(self.model, self.score, self.dist.sum_over_ranks, self.device, world, sum_over_world)
        probe.before()
        return probe

    def _update_gain(self, gain: GainProbe | None, batch: StepBatch, grads: Gradients) -> torch.Tensor | None:
        """The gain probe's measure after the update (its scoring forward ends in an all-reduce). A peer lost
        there leaves this rank's update whole: the step completes unmeasured and _after_step raises the loss
        once the step is marked complete, so a survivor saves it (before: refused as "the optimizer's update had
        begun"; 2 ranks, kill -9 of rank 1 in step 15, within above_start's gain_steps: resumed at step 10)."""
        if gain is None:
            return None
        try:
            return gain.after(batch, grads.loss, grads.rows)
        except RuntimeError as exc:
            if not peer_lost(exc):
                raise
            self.peer_lost_as, self._lost_after_update = lost_words(exc), exc  # a SIGTERM meanwhile names it
            return None

    def _update(self, skip: torch.Tensor | None) -> torch.Tensor | None:
        """The optimizer step, withheld where `skip` is true; returns the fp16 overflow flag."""
        if self.scaler:
            before = self.scaler._scale.clone()  # private, but get_scale() would sync the host
            if skip is None or not bool(skip):  # fp16 only (pre-Ampere GPUs, MPS): one read
                self.scaler.step(self.optimizer)
            self.scaler.update()
            overflow = self.scaler._scale < before  # the scaler backs off only when it found inf/NaN
            self.scaler._scale.clamp_(min=self.cfg.train.loss_scale.floor)  # on device: no sync
            return overflow
        if skip is None:
            self.optimizer.step()
        elif self.optimizer.defaults.get("fused"):
            # Fused AdamW honours found_inf on device: the whole update (moments, decay, step
            # count) is skipped without a host-device sync (OLMo-core's skip-step idea).
            self.optimizer.found_inf = skip.float()
            self.optimizer.step()
            self.optimizer.found_inf = None
        elif not bool(skip):
            self.optimizer.step()
        return None

    # ------------------------------------------------------------------------------ around the step

    def _after_step(self, out: StepOutput) -> None:
        note_withheld(self.state, self.phases[self.state.phase], out)
        self.state.step = out.step
        self.state.tokens += out.batch.n_tokens
        self.state.train_seconds += out.seconds
        self.step_times.add(out.seconds)
        self.window.losses.append(out.loss)
        self.window.norms.append(out.grad_norm)
        self.window.skips.append(out.skipped if out.skipped is not None else False)
        if out.update_gain is not None:
            self.window.gains.append(out.update_gain)
        self.last_step_out = out  # the log line reports the latest step's MoE telemetry
        self.window.tokens += out.batch.n_tokens
        self.window.seconds += out.seconds
        self.mark_step_start()  # the step just updated, complete: what an emergency save in its hooks writes
        lost, self._lost_after_update = self._lost_after_update, None
        if lost is not None:  # in the gain probe after the update (_update_gain): this step is the one to save
            raise lost
        self._call("on_step_end", out)
        if self.state.step % self.cfg.train.log_every == 0 or self.state.step == self.total_steps:
            metrics = step_metrics(self, out.lr)
            self.window = LogWindow()  # before the hooks: a checkpoint they ask for saves the new one
            self._call("on_log", metrics)

    def _maybe_checkpoint(self) -> None:
        every = self.control.checkpoint_every()
        if (every and self.state.step % every == 0) or self._phase_ends() or self._save_owed():
            self.save()
        lean = self.cfg.checkpoint.snapshot_every
        if lean and self.state.step % lean == 0:
            self.snapshot()

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        """Stop after the current step, saving a checkpoint (signals and hooks use this); a
        non-zero `exit_code` says the run gave up (docs/orchestrator.md, exit codes)."""
        if not self.stop_reason:
            self.stop_reason, self.exit_code = reason, exit_code

    def _agree(self) -> None:
        """The ranks meet before the step's last backward (Parallel.agree): an OOM on any rank raises on
        all; a signal any rank took stops all after this step, its line said here, once they agreed (the
        handler under torchrun says none: a peer lost first fails this collective, and the survivor's
        line is the emergency save's, where the stop's promised a step that never came)."""
        reason = self.dist.agree()
        if reason and not self.stop_reason:
            say_stopping(reason)
        self.request_stop(reason)

    def say(self, line: str) -> None:
        """One line on the console, above the progress bar."""
        console = next((h for h in self.hooks if isinstance(h, ConsoleLogger)), None)
        console.write(line) if console else log.warning(line)

    # ------------------------------------------------------------------------------ helpers

    def _call(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            self._hook(hook, event, *args)

    def _hook(self, hook: Hook, event: str, *args: Any) -> Any:
        """hook.event(view, *args), sealed (hooks.call_sealed) unless it is a test instrument."""
        if isinstance(hook, Instrument):
            return getattr(hook, event)(self.view, *args)
        return call_sealed(hook, event, self.view, *args)

    def _deliver_findings(self) -> None:
        """The findings hooks proposed during this step (RunView.propose), to every hook's on_finding."""
        while self.findings:
            self._call("on_finding", self.findings.pop(0))
