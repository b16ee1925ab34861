"""The orchestrator: a trainer hook that detects (monitors), decides (policy), acts (through the
run's Control) and explains (journal).

It sees the run only through its read-only RunView (training/view.py) and changes it only by
requests through `run.control`, with the actions of the table in training/actions.py, which the
loop applies at its points. Per step it adds a few device
ops to the update gate (is the loss/grad norm finite, under the spike and explosion ceilings) and
no host sync; step metrics are read from the device once every `read_every` steps (every step on
CPU, where a read is free) and fed to the monitors in order. Three parts live apart: how a finding
becomes a journaled, requested decision (deciding.py), a person's commands (people.py) and checkpoints
(saves.py: a save's reference and failure, good and kept checkpoints).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.distributed import all_max
from trimtab.orchestrator import readings
from trimtab.orchestrator.deciding import Deciding
from trimtab.orchestrator.dpo_health import dpo_eval
from trimtab.orchestrator.evaluation import EarlyStop, eval_failure
from trimtab.orchestrator.interval import CheckpointInterval
from trimtab.orchestrator.journal import Decision, Journal
from trimtab.orchestrator.make_up import MakeUp
from trimtab.orchestrator.mod_health import MoDQuality
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import Finding, Rolling, StepMetrics
from trimtab.orchestrator.outcomes import Outcomes, _continued
from trimtab.orchestrator.outliers import OutlierRows, all_gated, gate_finding, left_out_once, merged_into
from trimtab.orchestrator.people import PersonCommands
from trimtab.orchestrator.policy import Policy, shifted
from trimtab.orchestrator.replicas import Replicas, unchecked
from trimtab.orchestrator.rl_held_out import held_out_counts
from trimtab.orchestrator.rl_stats import nan_weights
from trimtab.orchestrator.rules import MONITORS, build_monitors
from trimtab.orchestrator.saves import SaveGuard
from trimtab.orchestrator.screened import ScreenedRows
from trimtab.orchestrator.stragglers import Stragglers
from trimtab.orchestrator.transient import rerun_finding
from trimtab.orchestrator.withheld import person_lr
from trimtab.rundir import DECISIONS_FILE, is_note
from trimtab.training.hooks import Hook
from trimtab.training.runtime import to_host

if TYPE_CHECKING:
    from trimtab.data import StepBatch
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView

GATED = ("spike", "grad", "lr")  # rules whose ceilings the update gate checks before the optimizer step
# the optional parts (None where their rule is off), each saved under its attribute's name
PARTS = ("make_up", "stragglers", "replicas", "interval")
# windows a new phase starts afresh
PER_PHASE = ("spike", "grad", "divergence", "above_start", "plateau", "throughput", "rows")


class Orchestrator(Deciding, PersonCommands, SaveGuard, Hook):
    def __init__(self, cfg: OrchestratorConfig, run_dir: Path):
        self.cfg = cfg
        self.mode = cfg.mode
        self.run_dir = Path(run_dir)
        self.monitors = build_monitors(cfg)
        if cfg.moe.enabled:
            self.monitors["moe"] = MoEHealth(cfg)
        if cfg.mod.enabled:
            self.monitors["mod"] = MoDQuality(cfg)
        if cfg.rows.enabled:
            self.monitors["rows"] = OutlierRows(cfg)  # thinly spread bad data: rows far above the others
        self.monitors["early_stop"] = EarlyStop(cfg)  # off: a note instead of a stop (evaluation.early_stop)
        self.make_up = MakeUp(cfg.make_up) if cfg.make_up.enabled else None  # withheld updates owed
        self.stragglers = Stragglers(cfg) if cfg.straggler.enabled else None  # under torchrun: a slow rank
        self.interval = CheckpointInterval(cfg) if cfg.checkpoint_interval.enabled else None  # Young's
        self.replicas = Replicas(cfg) if cfg.replicas.enabled else None  # DDP replicas still agree
        self.screened = ScreenedRows()  # the data screen's flagged documents (data.garbage_filter=warn)
        self.save_stall = 0.0  # this rank's newest save, until _read agrees it over the ranks
        self.policy = Policy(cfg)
        self.journal = Journal(self.run_dir / DECISIONS_FILE)
        self.paused: set[str] = set()
        self.pending: list[StepOutput] = []
        self.reruns: dict[int, dict[str, Any]] = {}  # reproducible re-runs, until their step is read
        self.transient_faults: dict[str, int] = {}  # rank -> transient faults its gradient showed (re-runs)
        self.outcomes = Outcomes(self.journal, cfg)  # what followed each decision, judged
        self.rolling_back: int | None = None  # the decision whose rollback was requested, until applied
        self.emergency: Decision | None = None  # an instability rollback or stop requested (deciding.py)
        self.held: list[tuple[RunView, Finding]] = []  # findings that emergency's rollback holds (deciding.py)
        self.incident = [0, 0, -1]  # the ladder's incident: number, its last decision's step, closed_at (deciding.py)
        self.stood_at = -1  # the last step with an instability finding whose update was applied (healthy)
        self.recent_losses = Rolling(20)  # healthy losses: the "before" of an outcome
        self.read_every = cfg.read_every
        self.failed_saves = 0  # saves failed since the last that worked (a stretch of work at risk)
        self.phase = 0  # of the last step observed
        self.init_from = False  # the run starts from weights trained before (train.init_from): on_train_start
        self.last_step = 0  # the newest step seen (a rollback moves the run's counter back)
        self.ceilings: dict[str, float] = {}  # the update gate's thresholds, refreshed at each read
        self.demoted: set[str] = set()  # "rule:action" remedies that fell to advice (low confidence)
        # the references a save being written replaced (probe_baseline, start_probe)
        self._baseline_before: tuple[float | None, float | None] | None = None
        self.lost_commands: list[dict[str, Any]] = []  # a person's settings a resume lost, to apply again
        self._mode_kept = ""  # said at start: a resumed run kept a mode a person set over the config's

    # ------------------------------------------------------------------ hook events

    def on_train_start(self, run: RunView) -> None:
        self.journal.on_add = run.decided  # each new decision, to every hook (Hook.on_decision)
        if not self.read_every:
            self.read_every = 1 if run.device.type == "cpu" else 10
        if "oom" in self.monitors:
            oom = self.monitors["oom"]
            oom.configured = oom.configured or run.configured_micro_batch_tokens
            oom.configured_checkpointing = oom.person_checkpointing or run.cfg.train.activation_checkpointing
            self._configured_knobs(run, oom)
            if run.step:
                oom.resumed(readings.machine(run.world, run.device))
        self.init_from = bool(run.cfg.train.init_from)
        if self._mode_kept:
            run.say(self._mode_kept)
        if self.replicas is not None and self.mode != "off" and run.world > 1 and not run.replicated and run.is_main:
            run.say(unchecked(run.cfg.distributed, run.world))
        if (fp16 := self.monitors.get("fp16")) is not None:  # the scaler's growth costs overflows of its own
            fp16.growth_interval = run.cfg.train.loss_scale.growth_interval
        for change in run.config_changes:
            self._configured(run, change)
        if run.step:  # resumed: a person's commands the stopped process applied after its last checkpoint
            self._resumed_commands(run)
        if self.mode != "off":
            self.screened.check(self, run)
        self.journal.write()

    def on_step_start(self, run: RunView, batch: StepBatch) -> None:
        if self.mode != "off":
            self.screened.check(self, run)  # a new phase's data

    def update_gate(self, run: RunView, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        if self.mode != "auto":
            return None
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if "lr" not in self.paused and "lr" in self.ceilings:
            ratio = run.applied_lr / max(run.scheduled_lr * run.lr_scale, 1e-30)
            if ratio > self.ceilings["lr"]:  # host floats: this step would apply an unexplained LR
                bad = bad | True
        for name, value in (("spike", loss), ("grad", grad_norm)):
            ceiling = self.ceilings.get(name, math.inf) if run.phase == self.phase else math.inf  # a new phase
            # starts its windows afresh (_observe): the previous phase's ceilings say nothing of its data
            if name == "spike" and name in self.monitors and self.monitors[name].jumped(run.mod_layer_capacities):
                continue  # another model since the last read: the window starts again (LossSpike._follow_capacity)
            if name not in self.paused and math.isfinite(ceiling):
                bad = bad | (value > ceiling)
        return bad

    def measure_gain(self, run: RunView) -> bool:
        """The LR rule (above_start) judges the updates' gain over a phase's first steps."""
        if self.mode == "off" or "above_start" in self.paused or "above_start" not in self.monitors:
            return False
        return run.phase != self.phase or self.monitors["above_start"].wants_gain(run.step + 1)

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        """The step's own checks, then its read. A replica disagreement is decided first: its rollback
        (to when the replicas agreed, before the read's faults) is an emergency the read's decisions wait
        for (deciding.py emergency_at). A transient fault's and a straggler's are decided after the
        read, so an emergency of its steps holds them too: an exclude_node before the read's rollback
        saved the broken step and restarted the job from it (tests/test_deciding_emergency.py)."""
        self.last_step = out.step
        after_read: list[Finding] = []
        if out.rerun is not None and "rerun" not in self.paused:
            suspect_after = self.cfg.rerun.suspect_after
            if (f := rerun_finding(out.step, out.rerun, self.reruns, self.transient_faults, suspect_after)) is not None:
                after_read.append(f)
        if self.stragglers is not None and run.world > 1 and self.mode != "off" and "straggler" not in self.paused:
            if not run.replicated:  # the ranks split the model: their own work holds their waits (stragglers.py)
                if (line := self.stragglers.unjudged_once(run.cfg.distributed, run.world)) and run.is_main:
                    run.say(line)
            elif (f := self.stragglers.observe(out.step, run.work_s)) is not None:
                after_read.append(f)
        if self.replicas is not None and run.replicated and self.mode != "off" and "replicas" not in self.paused:
            if self.replicas.due(out.step) and (f := self.replicas.observe(out.step, run.weight_checksum())):
                self.decide(run, f)
        self.pending.append(out)
        if len(self.pending) >= self.read_every or out.step >= run.total_steps:
            self._read(run)
        for f in after_read:
            held = self.decide(run, f).outcome or {}
            if f.rule == "straggler" and "dropped_by" in held and self.stragglers is not None:
                self.stragglers.unname(f.evidence["ranks"])  # named again at its next slow window (the replay's)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        """Rules that judge evaluations: early stopping on the validation loss, reward hacking on
        an RL run's held-out reward. Neither reads an evaluation of NaN weights (taken between their
        going NaN and rule nonfinite's rollback): it measures no model (`trimtab train --inject
        weights_nan@10`, train.eval_every=5, early_stop on with patience 1: step 10's val_loss NaN "had
        not beaten the best" and the run stopped there, before nonfinite's rollback at step 12)."""
        if self.mode == "off":
            return
        rules = [
            (monitor, metrics[key])
            for rule, key in (
                ("early_stop", "val_loss"),
                ("rl_hacking", "rl/held_out_reward"),
                ("rl_signal", "rl/held_out_reward"),  # a collapse's sign (rl_health.py, NoLearningSignal)
                ("dpo_held_out", "dpo/held_out_loss"),
            )
            if (monitor := self.monitors.get(rule)) is not None and rule not in self.paused and key in metrics
        ]
        if not rules or nan_weights(run):  # asked once, and only when a rule would read it: a host read
            return
        for monitor, value in rules:
            if not math.isfinite(value):  # finite weights, a NaN score (an fp16 evaluation's overflow): no figure
                continue
            counts = held_out_counts(metrics) if monitor.rule in ("rl_hacking", "rl_signal") else {}
            counts = dpo_eval(metrics, run.cfg.dpo) if monitor.rule == "dpo_held_out" else counts
            if (f := monitor.observe_eval(metrics["step"], run.phase, value, **counts)) is not None:
                self.decide(run, f)

    def on_eval_error(self, run: RunView, step: int, error: str) -> None:
        if self.mode != "off" and not run.stopping:  # one left off for a stop's save is no fault
            self.decide(run, eval_failure(step, error))

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self._read(run, commands=False)  # nothing applies a request from here on
        self._answer_late_commands(run)
        completed = summary.get("status") == "completed"
        for decision in self.journal.pending():  # judge what there is ("too early" when too little)
            if decision.observed:
                self.outcomes.judge(decision, ended=True)
            else:  # taken at the last step: nothing followed it (it read "pending" in a finished run)
                decision.outcome = {"result": "too early", "steps": 0}
            if completed and decision.action == "resume" and decision.outcome["result"] == "too early":
                # a restart heals by the job coming back and training on, not by a loss: its session ending
                # the run completed is its recovery (an emergency save at step 19 of 20 left it 1 step, and
                # `trimtab runs` counted no fault healed); on fewer ranks "continued", as judged (outcomes.py)
                decision.outcome |= {"result": "recovered"} | _continued(decision, "recovered")
        self._weights_kept(summary.get("weights_kept"))
        self.journal.write()
        notes = sum(is_note({"action": d.action}) for d in self.journal.decisions)  # observations: no action taken
        summary["decisions"], summary["notes"] = len(self.journal.decisions) - notes, notes

    def _weights_kept(self, path: str | None) -> None:
        """Where the disk rule's stop (exit code 4) kept the weights alone (training/checkpointing.py
        _keep_weights), in the stop's outcome: `trimtab runs` and the report read the journal, and the path
        was only in the exit line and the summary's status."""
        stop = next((d for d in reversed(self.journal.decisions) if d.action == "stop"), None)
        if path is not None and stop is not None and stop.outcome is not None:
            stop.outcome["weights_kept"] = path

    def on_oom(self, run: RunView, exc: BaseException, batch: StepBatch) -> bool:
        if self.mode == "off" or "oom" not in self.monitors or "oom" in self.paused:
            return False
        message = str(exc).splitlines()[0][:200]
        self.monitors["oom"].ran_out(readings.machine(run.world, run.device))
        f = self.monitors["oom"].error(run.step + 1, run.micro_batch_tokens, message, batch.rows)
        self.outcomes.struck(f)  # raised inside the step: no step's read (Outcomes.follow) sees it
        decision = self.decide(run, f)
        return decision.mode == "auto" and decision.action in ("set_micro_batch_tokens", "set_activation_checkpointing")

    def on_rollout_oom(self, run: RunView, exc: BaseException) -> bool:
        if self.mode == "off" or "oom" not in self.monitors or "oom" in self.paused:
            return False
        message = str(exc).splitlines()[0][:200]
        self.monitors["oom"].ran_out(readings.machine(run.world, run.device))
        f = self.monitors["oom"].rollout_error(run.step + 1, run.rl_generation_rows, message)
        self.outcomes.struck(f)
        decision = self.decide(run, f)
        return decision.mode == "auto" and decision.action == "set_generation_rows"

    def on_finding(self, run: RunView, finding: Finding) -> None:
        """Another hook's finding (the live planner's run length), decided like the orchestrator's own."""
        self.decide(run, finding)

    def on_phase_end(self, run: RunView) -> None:
        """The end of a phase is guarded like its middle: a fault in its last steps leaves too few
        findings to climb the ladder, so the state it ends in is checked before it is saved as
        final (Policy.verify_end); broken, it is rolled back and the steps trained again."""
        self._read(run)
        if self.mode != "auto" or "end" in self.paused:
            return
        found = self.policy.verify_end(run)
        if found is not None:
            f, remedy = found
            self.stood_at = run.step  # the weights themselves were judged: no withheld update explains it
            self._decide(run, f, remedy)

    def gates_rows(self, run: RunView) -> bool:
        """The row gate acts while the orchestrator may: auto mode, rule row_gate not paused (`trimtab
        ctl RUN pause-rule row_gate`, `ctl RUN mode advise` turn it off mid-run, not only its journal)."""
        return self.mode == "auto" and "row_gate" not in self.paused

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        """Monitors go back with the weights, and so does the phase they were watching (a
        rollback to the last checkpoint of pretraining restores its windows: the finetuning
        phase replayed after it must start them afresh again, not be judged against them);
        decisions, ladder and knobs stay (they are the fix)."""
        self.pending, self.reruns = [], {}
        self.outcomes.rolled_back(run.step, self.rolling_back)
        # the orchestrator's own rollback is a fault's, a failure in Young's M (checkpoint_interval.rollbacks);
        # a person's (ctl rollback) is a choice, with no rate to expect of it
        if self.interval is not None and self.rolling_back is not None:
            self.interval.rolled_back(self.last_step - run.step, self.rolling_back)
        self.rolling_back = self.emergency = None
        self.policy.shift(self.last_step - run.step)
        self.policy.updated_at = min(self.policy.updated_at, run.step)  # the restored weights' last update
        self.stood_at = shifted(self.stood_at, self.last_step - run.step)  # as the ladder's steps (-1: none)
        self.incident[1] -= self.last_step - run.step  # its quiet window counts the steps trained, as the ladder's
        if self.make_up is not None:
            self.make_up.rolled_back(run.step)
        if saved_state:
            self._load_monitors(saved_state, rollback=True)
            self.phase = saved_state.get("phase", self.phase)
        self.decide_held()  # requested now, the loop applies them after the rollback (Control.apply)

    # ------------------------------------------------------------------ reading and deciding

    def _read(self, run: RunView, commands: bool = True) -> None:
        outs, self.pending = self.pending, []
        if outs and self.mode != "off":
            memory = readings.memory_fraction(run.device)
            # Data parallelism: the slowest rank's step times and the fullest device, so every
            # rank's monitors see the same numbers and decide alike.
            *seconds, memory, stall = all_max(
                [o.seconds for o in outs] + [-1.0 if memory is None else memory, self.save_stall]
            )
            self.save_stall = 0.0
            steps = to_host([readings.device_values(o, "moe" in self.monitors) for o in outs])
            moe = "moe" in self.monitors and any(o.moe for o in outs)  # a walk of the modules: only then
            top_k = run.moe_top_k() if moe else {}
            for o, values, s in zip(outs, steps, seconds):
                self._observe(run, readings.step_metrics(run, o, values, s, None if memory < 0 else memory, top_k))
            self._fresh_reference(run)
            self._checkpoint_interval(run, seconds, stall)
            self.ceilings = self._gate_ceilings()
        elif outs:  # off: nothing is withheld, nothing read (a non-finite update may have gone in: _nan_weights)
            self.policy.updated_at = outs[-1].step
        if commands:
            self._take_commands(run)

    def _observe(self, run: RunView, m: StepMetrics) -> None:
        if m.phase != self.phase:  # new data, a new schedule: the loss and its noise start over
            self.phase = m.phase
            fresh = {**MONITORS, "rows": OutlierRows}
            self.monitors.update({k: fresh[k](self.cfg) for k in PER_PHASE if k in self.monitors})
            self.policy.new_phase(m.step - 1, run.probe_loss())  # the probe scores the new phase's held-out rows
        if (lr_rule := self.monitors.get("above_start")) is not None and lr_rule.unigram is None:
            lr_rule.unigram = run.context_free_loss()  # the data's, read once per phase (None: RL, DPO)
        if (spike := self.monitors.get("spike")) is not None and self.init_from and m.rl is None:
            # weights trained before: their steady loss arms the early bar (LossSpike); a likelihood's only, not
            # an RL objective's or DPO's (context_free_loss: None there)
            spike.trained = run.context_free_loss() is not None
        self.policy.data.record(m.step, m.rows)
        m.unsettled = self.policy.unsettled(m.step)
        findings = [
            f for name, mon in self.monitors.items() if name not in self.paused and (f := mon.observe(m)) is not None
        ]
        rows = self.monitors.get("rows") if "rows" not in self.paused else None
        if rows is not None and (f := rows.confirm(run, m)) is not None:
            findings.append(f)  # suspects seen once, scored again on today's weights (outliers.py)
        if (gated := gate_finding(m, self.cfg.row_gate)) is not None:
            findings = all_gated(gated, m, findings) + [gated]  # the rows the row gate left out: one decision
        if (rerun := self.reruns.pop(m.step, None)) is not None:  # computed twice, the same: not a fault
            for f in findings:
                f.evidence["rerun"] = rerun
        if self.mode == "auto" and (watched := self.policy.data.watch(run, m, self.policy.updated_at)):
            # the steps after rows were left out: their bad rows go, whether or not the step also spiked
            # (a spike alone only withholds the update; the rows would come back in the next epoch). A
            # loss spike they explain is the data's: one decision, theirs, says the update was withheld,
            # and the spike does not climb the instability ladder (skipping is not what failed)
            if spikes := [f for f in findings if f.rule == "spike"]:
                watched.evidence["spike"] = {"summary": spikes[0].summary, "loss": spikes[0].evidence.get("loss")}
                findings = [f for f in findings if f.rule != "spike"]
            findings = merged_into(watched, findings) + [watched]  # the rows rule's rows too: one decision
        if self.mode == "auto" and (frozen := self.policy.withheld.observe(m)) is not None:
            findings.insert(0, person_lr(frozen, self.journal.decisions))  # first: the step's one rung
        self.outcomes.follow(m, findings)
        if not findings and math.isfinite(m.loss):
            self.recent_losses.add(m.loss)
        restore = self.policy.quiet(m.step, run)
        if restore is not None:
            f = Finding(
                rule="lr_restore",
                family="instability",
                step=m.step,
                evidence={"lr_scale": run.lr_scale},
                summary="quiet since the LR cut",
                strength=0.8,
            )
            self._decide(run, f, restore)
        if not m.skipped:  # the weights changed: a rollback to a checkpoint before this step replays anew
            self.policy.updated_at = m.step
        unstable = [f for f in findings if f.family == "instability"]
        if unstable and not m.skipped:  # the flagged step's update is in the weights (healthy)
            self.stood_at = m.step
        for f in unstable[:1] + [f for f in findings if f.family != "instability"]:  # one rung per step
            # the gate's last: rows another decision of the step leaves out are noted there, not left out twice
            if f.rule != "row_gate" or (f := left_out_once(f, self.journal)) is not None:
                ladder = self.ladder_now()  # put back if an emergency holds f (deciding.py)
                self._decide(run, f, self.policy.plan(f, run), withheld=m.skipped, ladder=ladder)
        emergency = self.emergency is not None  # requested, not applied yet: the steps it undoes (emergency_at)
        if self.make_up is not None and self.mode == "auto" and "make_up" not in self.paused and not emergency:
            asked = "" if unstable else m.skip_by  # a person's or a hook's skip, not the gate's as well
            owed = self.make_up.observe(m, self.policy.ladder.last_step, run.total_steps, run.pretrain["steps"], asked)
            if owed is not None:
                self.decide(run, owed)

    def _gate_ceilings(self) -> dict[str, float]:
        """The update gate's bars: each gated rule's ceiling, the loss's early one too (LossSpike.gate_ceiling)."""
        return {k: getattr(m, "gate_ceiling", m.ceiling)() for k, m in self.monitors.items() if k in GATED}

    def _checkpoint_interval(self, run: RunView, seconds: list[float], stall: float) -> None:
        """The steps' and a save's times (every rank's slowest) to the interval rule."""
        if self.interval is None or "checkpoint_interval" in self.paused or run.step >= run.total_steps:
            return  # at the run's last step no checkpoint is left to move
        every, configured = run.checkpoint_every, run.cfg.checkpoint.every
        # a rollback whose remedy took is no failure to expect again (interval.py); the journal read only
        # while a rollback awaits its outcome, not at every step
        if (latest := self.interval.latest) is not None:
            self.interval.judged(
                {d.id: d.outcome["result"] for d in self.journal.decisions if d.id == latest and d.outcome}
            )
        if (f := self.interval.observe(run.step, seconds, stall, run.world, every, configured)) is not None:
            self.decide(run, f)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitors": {k: m.state_dict() for k, m in self.monitors.items()},
            "recent_losses": list(self.recent_losses.values),
            "policy": self.policy.state_dict(),
            "journal": self.journal.state_dict(),
            **self.outcomes.state_dict(),
            "paused": sorted(self.paused),
            "mode": self.mode,
            "phase": self.phase,
            "stood_at": self.stood_at,
            **{name: part.state_dict() if (part := getattr(self, name)) is not None else None for name in PARTS},
            "transient_faults": dict(self.transient_faults),
            "incident": list(self.incident),
            "lost_commands": self.lost_commands,
            "configured_mode": self.cfg.mode,  # a saved mode other than it is a person's (trimtab ctl mode)
            **self.incident_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._load_monitors(state)
        self.policy.load_state_dict(state["policy"])
        self.journal.load_state_dict(state["journal"])
        self.outcomes.load_state_dict(state)
        self.paused = set(state["paused"])
        self.phase = state.get("phase", 0)
        self.stood_at = state.get("stood_at", self.policy.ladder.last_step)  # older: as if every update stood
        for name in PARTS:
            if (part := getattr(self, name)) is not None and state.get(name):
                part.load_state_dict(state[name])
        self.transient_faults = dict(state.get("transient_faults", {}))
        self.incident = list(state.get("incident", self.incident))  # older: numbered from this session on
        self.lost_commands = list(state.get("lost_commands", []))
        self.load_incident(state)
        self._take_mode(state)

    def _load_monitors(self, state: dict[str, Any], rollback: bool = False) -> None:
        """The monitors' saved state; a rollback keeps what a monitor accounts for in the knobs it
        keeps too (KEPT_ON_ROLLBACK: the lr rule's compensation, in the LR multiplier)."""
        for name, monitor in self.monitors.items():
            if name in state["monitors"]:
                kept = {k: getattr(monitor, k) for k in getattr(monitor, "KEPT_ON_ROLLBACK", ())} if rollback else {}
                monitor.load_state_dict(state["monitors"][name])
                for key, value in kept.items():
                    setattr(monitor, key, value)
        self.recent_losses = Rolling(20, state["recent_losses"])
        self.ceilings = self._gate_ceilings()
