"""How the Orchestrator turns a finding into a decision: the policy's remedy weighed by its rule's
track record (confidence), fallen to advice below orchestrator.min_confidence (said when it
falls and when it comes back), journaled, and in auto mode requested through the run's Control;
then what Control did, written into the decision (a failed action journaled as failed at once).
A part of the Orchestrator (core.py), apart from the hook events that find what it decides.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.distributed import is_main
from trimtab.errors import ConfigError
from trimtab.orchestrator import ctl
from trimtab.orchestrator.journal import Decision, Journal
from trimtab.orchestrator.ladder import Ladder
from trimtab.orchestrator.monitors import Finding, Rolling
from trimtab.orchestrator.outcomes import Outcomes
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.remedies import Remedy, ranks
from trimtab.rundir import NOT_FAULTS

if TYPE_CHECKING:
    from trimtab.training.view import RunView

RECORDED = ("resume", "rerun_step")  # done before they are decided (a restart, a re-run), whatever the mode
# what may go with an emergency at its step: what records the step (a skip, a note, a restart), another stop
WITH_EMERGENCY = ("none", "skip_step", "stop", *RECORDED)
# whose rollback or stop is an emergency: the instability rules', and the replicas rule's (its rollback goes back
# to when the replicas agreed, before the faults the step's read finds: core.py on_step_end decides it first)
EMERGENCIES = ("instability", "replicas")
# findings of the device, not of the weights or the data: an emergency rollback's replay does not meet them again
# (a transient fault's rank keeps its count), so they are decided again once the rollback is applied
HELD_FOR_REPLAY = ("rerun",)


def _gated_rows(decision: Decision) -> bool:
    """The row gate's rows left out of the data (outliers.py gate_finding): out of their step's update already,
    they change nothing a rollback restores, and go with an emergency. Held back, the replay met them again and
    gated them again (debug at 10x the LR, bad_rows@10:4: the 8 rows gated at the rollback's step 12 journaled
    in 3 decisions over two rollbacks, 8 + 8 + 4 rows)."""
    return decision.rule == "row_gate" and decision.action == "skip_data"


class Deciding:
    """The Orchestrator's decisions (it holds the state named here)."""

    cfg: OrchestratorConfig
    mode: str
    run_dir: Path
    policy: Policy
    journal: Journal
    outcomes: Outcomes
    recent_losses: Rolling  # healthy losses: a decision's "before"
    demoted: set[str]  # "rule:action" remedies that fell to advice (low confidence)
    monitors: dict[str, Any]
    rolling_back: int | None  # the decision whose rollback was requested, until the loop applies it
    emergency: Decision | None  # an instability rollback or stop requested, until applied: its step is its own
    held: list[tuple[RunView, Finding]]  # HELD_FOR_REPLAY's findings an emergency rollback holds, until applied
    incident: list[int]  # the ladder's incident: [its number, the step of its last decision, ladder closed_at then]

    def decide(self, run: RunView, f: Finding) -> Decision:
        """The policy's decision on finding f (the orchestrator's own, or another hook's such as
        the live planner's run length): journaled, and in auto mode requested through Control."""
        ladder = self.ladder_now()
        return self._decide(run, f, self.policy.plan(f, run), ladder=ladder)

    def ladder_now(self) -> Ladder | None:
        """A copy of the ladder while an emergency waits to be applied (None otherwise): a finding it holds is
        planned, and its count must not stay in the ladder (_wait_for)."""
        return copy.deepcopy(self.policy.ladder) if self.emergency is not None else None

    def _decide(
        self, run: RunView, f: Finding, remedy: Remedy, withheld: bool = False, ladder: Ladder | None = None
    ) -> Decision:
        """Journal a decision and, in auto mode, request its action; `withheld`: the update gate
        already skipped this step's update (a skip_step decision records what happened); `ladder`: the
        ladder before f was planned (ladder_now), put back if an emergency holds f. Only an
        applied remedy changes the policy (Remedy.applied) and is judged: advice is journaled with
        the outcome "not applied", and the same advice again is counted on it, not journaled anew."""
        if remedy.action == "none" and (again := self.journal.repeat_of(f.rule, "none", remedy.reasoning)):
            return self._seen_again(again, f)  # the same finding, the same word for a person
        record = self.journal.track_record(f.rule, remedy.action)
        confidence = Policy.confidence(f.strength, record)
        mode, reasoning = self.mode, remedy.reasoning
        # a spike's rows left out (spikes.py; the watch's: core.py): the gate's skip happened as well, said first
        spiked = remedy.action == "skip_data" and withheld and (f.family == "instability" or "spike" in f.evidence)
        gated = remedy.action == "skip_step" or spiked
        if gated:
            reasoning = _skip_wording(mode, withheld) + (f"; {remedy.reasoning}" if remedy.reasoning else "")
        acts = remedy.action not in ("skip_step", "none", "stop", "resume")  # resume: done before (a restart)
        demoted = mode == "auto" and acts and confidence < self.cfg.min_confidence
        if demoted:
            mode, reasoning = "advise", reasoning + " (confidence below orchestrator.min_confidence)"
        if acts and self.mode == "auto":
            self._announce_demotion(run, f.rule, remedy.action, demoted, confidence, record)
        window = self.cfg.escalation_window  # advice repeated within it is one advice (it folds until quiet)
        if mode == "advise" and (
            again := self.journal.advised_again(f.rule, remedy.action, remedy.params, f.step, window)
        ):
            return self._seen_again(again, f)
        decision = Decision(
            id=self.journal.next_id(),
            step=f.step,
            rule=f.rule,
            evidence={**f.evidence, **remedy.evidence},
            reasoning=reasoning,
            action=remedy.action,
            params=dict(remedy.params),
            confidence=confidence,
            mode=mode,
            family=f.family,
            summary=f.summary,
            loss_before=self.recent_losses.mean() if len(self.recent_losses) else None,
        )
        if f.family == "instability" and f.rule not in NOT_FAULTS:
            decision.evidence["incident"] = self._ladder_incident(f.step)
        dropped = ""
        if (rollback := self._rolled_back_with(decision)) is not None:
            self._drop_with_rollback(decision, rollback)
            dropped = " [dropped: this step's rollback restores the LR before it]"
        elif (emergency := self.emergency_at(decision)) is not None:
            self._wait_for(decision, emergency, (run, f) if f.rule in HELD_FOR_REPLAY else None)
            if ladder is not None and f.family == "instability":
                self.policy.ladder = ladder  # judged again on the replay, from the count before it
            dropped = f" [not applied: the {emergency.action} of decision {emergency.id} comes first]"
        else:
            self._carry_out(run, decision, remedy, withheld, gated)
        self.journal.add(decision)
        run.say(decision.console_line() + dropped)
        return decision

    def emergency_at(self, decision: Decision) -> Decision | None:
        """The emergency `decision` must wait for, if any: an instability rollback or stop (the
        ladder's, the withheld guard's, the end check's) or the replicas rule's rollback, requested and
        not applied yet, is the step's one set of actions. Another rule's change requested with it
        outlived it: on the withheld guard's step (withheld.py) the rollback restored the checkpoint and
        a knob turned at the same step stayed on the replay, or make_up lengthened a run that was
        stopping. Until the loop applies it, not only at its own step: a read of several steps (read_every)
        decides the later steps' findings in the same hook call. Advice and notes do not wait."""
        emergency = self.emergency
        if emergency is None or decision.mode != "auto" or _gated_rows(decision):
            return None
        return None if decision.action in WITH_EMERGENCY else emergency

    def _wait_for(self, decision: Decision, emergency: Decision, held: tuple[RunView, Finding] | None) -> None:
        """Not requested: its finding comes back on the replay if it still holds (a stop ends the run); `held`,
        a HELD_FOR_REPLAY finding, is decided again once the rollback is applied (decide_held). Not kept pending
        for after the rollback either: the rollback restores a step before it (the replicas rule's, when the
        replicas last agreed), so the replay meets the fault again if it was not the emergency's own, and a
        finding kept would be counted twice; the ladder goes back to its count before the finding (_decide), so
        a recurrence climbs as it would have (an LR cut earned at step 12, held by the replicas rollback, came
        back on the replay as a skip: planning it had spent the ladder's count)."""
        then = "judged again on the replay if it still holds" if emergency.action == "rollback" else "the run stops"
        if held is not None and emergency.action == "rollback":
            self.held.append(held)
            then = "decided again once it is applied: the replay does not meet a device's fault again"
        at = "this step" if emergency.step == decision.step else f"step {emergency.step}"  # a read of several steps
        decision.applied = [
            f"not applied: the {emergency.rule} rule's {emergency.action} decided at {at} (decision "
            f"{emergency.id}) is an emergency, and no other change goes with it ({then})"
        ]
        decision.outcome = {"result": "cut short", "steps": 0, "dropped_by": emergency.id}

    def _ladder_incident(self, step: int) -> int:
        """The number of the ladder's incident a decision at `step` answers (evidence `incident`: rundir.incidents
        groups by it, where it saw the ladder close an incident only at the rollback that followed, its
        incident_rollback 1). A new one once the ladder closed the last (ladder.py _clear: its closed_at moves),
        or escalation_window steps after it with no rollback of it open (the ladder's window: its climb over)."""
        number, last, closed = self.incident
        quiet = self.policy.rollbacks == 0 and step - last >= self.cfg.escalation_window
        if not number or self.policy.closed_at != closed or quiet:
            number += 1
        self.incident = [number, step, self.policy.closed_at]
        return number

    def decide_held(self) -> None:
        """The findings an emergency rollback held (HELD_FOR_REPLAY), decided at the step it restored once it is
        applied or failed: a transient fault's exclude_node waited, and came back only if the fault recurred
        (tests/test_deciding_emergency.py)."""
        held, self.held = self.held, []
        for run, f in held:
            summary = f"{f.summary} (found at step {f.step}, held by the rollback decided then)"
            self.decide(run, replace(f, step=run.step, evidence={**f.evidence, "found_at": f.step}, summary=summary))

    def _rolled_back_with(self, decision: Decision) -> int | None:
        """The rollback decided at this step that `decision` goes with, if it is the lr rule's
        compensation: it answers the live LR of the step the rollback abandons. Applied, it survived
        the restore (knobs do) and the replay trained at a fraction of the schedule from before the
        raise, until the rule withdrew it as a fault (fuzzer: lr_spike@12 + weights_nan@10)."""
        if decision.mode != "auto" or decision.rule != "lr" or decision.action != "scale_lr":
            return None
        rollback = next((d for d in self.journal.decisions if d.id == self.rolling_back), None)
        return rollback.id if rollback is not None and rollback.step == decision.step else None

    def _drop_with_rollback(self, decision: Decision, rollback: int) -> None:
        """Not requested: the replay starts at the checkpoint's LR, and meets the raise again (a new
        finding, a new compensation) only if it comes back. The rule's account goes back with it."""
        self.monitors["lr"].explained = decision.evidence["explained"]
        decision.applied = [f"not applied: dropped with the rollback decided at this step (decision {rollback})"]
        decision.outcome = {"result": "cut short", "steps": 0, "rolled_back": True, "dropped_by": rollback}

    def _carry_out(self, run: RunView, decision: Decision, remedy: Remedy, withheld: bool, gated: bool) -> None:
        """What `decision` did: in auto mode the remedy's commit, and its action requested through
        Control (its result journaled when the loop applies it); advice and notes get their outcome now."""
        if decision.mode == "auto":
            remedy.applied()
        elif remedy.action not in RECORDED:  # advice: nothing to judge (a track record is the applied ones')
            decision.outcome = {"result": "not applied", "steps": 0}
        if remedy.action == "none":  # a note (a slower machine logged) heals nothing: judged on the loss
            decision.outcome = {"result": "noted", "steps": 0}  # that followed, it read "recovered"
        if remedy.action == "skip_step":
            decision.applied = ["update withheld before the optimizer step"] if withheld else []
        elif remedy.action == "rerun_step":
            decision.applied = ["the re-run's update applied; the first computation's discarded"]
        elif remedy.action == "resume":
            data = decision.evidence.get("data_at")  # where the data resumes, as the finding's summary says it
            where = f" (data at {data})" if data else ""
            decision.applied = [f"resumed at step {remedy.params['step']}{where} on {ranks(remedy.params['world'])}"]
        elif decision.mode == "auto" and remedy.action != "none":
            if gated:
                decision.applied = ["update withheld before the optimizer step"]
            if remedy.action == "rollback":  # on_rollback judges the branch it abandons, but this decision
                self.rolling_back = decision.id
            if remedy.action in ("rollback", "stop") and decision.family in EMERGENCIES:
                self.emergency = decision
            on_done = lambda line, d=decision: self._applied(d, line, console=run)  # noqa: E731
            try:
                run.control.request(remedy.action, on_done=on_done, **remedy.params)
            except ConfigError as exc:  # a rule's remedy whose parameters the action refuses (a rollback's
                on_done(f"failed: {exc}")  # lr_factor 1.0 ended a run with exit 2): journaled failed, the run goes on

    def _seen_again(self, decision: Decision, f: Finding) -> Decision:
        """Finding f came back to `decision`'s answer: counted on it (a count, not a list: a long
        run's journal is rewritten whole at every decision)."""
        decision.evidence["seen_again"] = decision.evidence.get("seen_again", 0) + 1
        decision.evidence["last_seen_at"] = f.step
        self.journal.write()
        return decision

    def _announce_demotion(
        self, run: RunView, rule: str, action: str, demoted: bool, confidence: float, record: tuple[int, int]
    ) -> None:
        """One line whenever a remedy falls to advice for lack of confidence, or comes back: the
        mode a person set must never change in silence."""
        key = f"{rule}:{action}"
        if demoted == (key in self.demoted):
            return
        if demoted:
            self.demoted.add(key)
            run.say(
                f"[orchestrator] {rule} -> {action} is advice only from now on: its confidence {confidence:.2f} is "
                f"below orchestrator.min_confidence {self.cfg.min_confidence:g} ({record[0]} of {record[1]} such "
                "decisions recovered in this run); they are journaled, not applied, until the record improves"
            )
        else:
            self.demoted.discard(key)
            run.say(f"[orchestrator] {rule} -> {action} is applied again (confidence {confidence:.2f})")

    def _applied(
        self, decision: Decision, line: str, run: RunView | None = None, name: str = "", console: Any = None
    ) -> None:
        """What Control did; an action that failed is journaled as failed at once (its track
        record falls), never as done. `run` is given for a person's command, and `name`, its
        control file's, which a failure answers (as one refused when it was read); `console`, a rule's
        decision's run: its failure said there too (the console said only the decision, as if applied)."""
        decision.applied.append(line)
        if line.startswith("failed: "):
            error = line.removeprefix("failed: ")
            decision.outcome = {"result": "failed", "error": error, "steps": 0}
            self.outcomes.drop(decision)
            if decision.id == self.rolling_back:  # no rollback comes (on_rollback would clear it)
                self.rolling_back = None
            if decision is self.emergency:
                self.emergency = None
                self.decide_held()  # the run goes on from the state it left
            if run is not None:
                if name and is_main():
                    ctl.answer(self.run_dir, name, error)
                said = f"[orchestrator] step {decision.step} manual: {decision.summary} failed, nothing changed"
                run.say(f"{said}: {error}")
            elif console is not None:
                # a disk retry's freeing stands though its save failed (Control._save_checkpoint's line names it
                # first): it read "failed, nothing changed: deleted 3 older checkpoints; ..." (disk_full@40:2)
                changed = "" if error.startswith("deleted ") else ", nothing changed"
                said = f"[orchestrator] step {decision.step} {decision.rule}: {decision.action} failed{changed}"
                console.say(f"{said}: {error}")
        elif decision.action == "stop":  # the run ends here: steps after a resume judge nothing of it
            decision.outcome = {"result": "stopped", "steps": 0}
            self.outcomes.drop(decision)
        elif decision.rule == "checkpoint_interval":  # a knob, no heal: judged on the loss, it read "recovered"
            decision.outcome = {"result": "applied", "steps": 0}  # (debug-mod at step 1: 5.51 -> 5.44)
            self.outcomes.drop(decision)
        elif run is not None and "oom" in self.monitors:  # a person's setting: what the probe returns to
            if decision.action == "set_micro_batch_tokens":
                self.monitors["oom"].set_by_person(micro_batch_tokens=run.micro_batch_tokens)
            elif decision.action == "set_activation_checkpointing":
                self.monitors["oom"].set_by_person(checkpointing=run.activation_checkpointing)
        self.journal.write()


def _skip_wording(mode: str, withheld: bool) -> str:
    """A skip_step decision's reasoning, from what the update gate did (not what it would do)."""
    if withheld:
        return "the update was withheld before the optimizer step: this step did not change the weights"
    if mode == "auto":
        return (
            "the update gate did not withhold it (its ceiling when the step ran was higher, or not set yet): "
            "the update stands"
        )
    return f"in {mode} mode nothing is withheld: the update was applied; auto mode would have withheld it"
