"""A person's hand on the orchestrator: `trimtab ctl` commands taken from the run's control/
directory, applied through the run's Control and journaled as manual decisions; configuration
changes found on resume; and the commands a killed process applied after its last checkpoint,
applied again when the run resumes. A part of the Orchestrator (core.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.provenance import by_command
from trimtab.distributed import broadcast_object, is_main
from trimtab.errors import TrimtabError
from trimtab.orchestrator import ctl
from trimtab.orchestrator.journal import Decision, Journal, person_decision
from trimtab.training.actions import ACTIONS, COMMANDS, VERBS
from trimtab.training.changes import journal_text, show
from trimtab.training.schedule import KEYS

if TYPE_CHECKING:
    from trimtab.training.view import RunView


class PersonCommands:
    """The Orchestrator's handling of a person's commands (it holds the state named here)."""

    journal: Journal
    run_dir: Path
    mode: str
    _mode_kept: str  # said at start: a resumed run kept a mode a person set over the config's
    paused: set[str]
    cfg: OrchestratorConfig
    lost_commands: list[dict[str, Any]]  # a person's settings a resume lost, to apply again at their steps
    _applied: Callable[..., None]  # what Control did with a decision (deciding.py)
    policy: Any  # policy.py Policy: a person's LR raise is its to undo (raised.py)
    interval: Any  # interval.py CheckpointInterval or None: a person's checkpoint interval is its bound

    def _configured(self, run: RunView, change: dict[str, Any]) -> None:
        """A person's configuration change found on resume (a phase's length, any other key the
        trainer said in one line: training/changes.py): journaled as theirs."""
        if change["key"] not in KEYS:
            summary, reasoning = journal_text(change, run.step)
            moot = change["effect"].startswith("no effect")  # a dpo.* key on an RL run: nothing was applied
            applied = [] if moot else [f"{change['key']} = {show(change['new'])}"]
            decision = person_decision(
                self.journal.next_id(), run.step, "config", change, reasoning, "none", {}, summary, applied
            )
            if moot:
                decision.outcome = {"result": "no effect"}
            elif change["key"] == PHASE_LR[min(run.phase, 1)] and _positive(change["old"]):
                # the LR of the phase the run resumes in (finetune.optim.lr counted as none: raised x100 in
                # the finetune phase, the first rollback kept it and the replay broke again; optim.lr there
                # changes no LR the run trains at)
                self.policy.person_raised(run.step, change["new"] / change["old"], f"{summary}: {change['effect']}")
            if change.get("default"):  # no person set it in this session's config: not theirs (changes._mark_origins)
                decision.mode = "default"
            elif by_command(change.get("by", "")):  # `trimtab rl`'s own setting: the command's, not a person's
                decision.mode = "command"
            self.journal.add(decision)
            return
        summary = f"{change['key']} {change['old']} -> {change['new']} on resume at step {run.step}"
        reasoning = f"changed in the config by a person: {change['effect']}"
        params, applied = {"steps": run.total_steps}, [f"total steps {run.total_steps}"]
        decision = person_decision(
            self.journal.next_id(), run.step, "config", change, reasoning, "set_total_steps", params, summary, applied
        )
        self.journal.add(decision)
        run.say(decision.console_line())

    def _take_mode(self, state: dict[str, Any]) -> None:
        """The mode a resumed run takes, and the line that says so when it is not the config's."""
        self.mode, self._mode_kept = self._mode_after(state), ""
        if self.mode != self.cfg.mode:
            self._mode_kept = (
                f"[orchestrator] mode {self.mode}, as `trimtab ctl mode` set it (the config says {self.cfg.mode}): "
                f"`trimtab ctl RUN mode {self.cfg.mode}` gives it back while the run trains; once it has stopped, "
                f"`trimtab ctl --queue RUN mode {self.cfg.mode}` does at its next launch"
            )

    def _mode_after(self, state: dict[str, Any]) -> str:
        """The mode a resumed run takes: the config's when it changed since the checkpoint (a person
        edited it); else the saved one, which a person's `ctl mode` may have set. An older
        checkpoint, which kept no configured mode: the saved one unless the config turns it down."""
        configured = state.get("configured_mode")
        if configured is None:
            return state["mode"] if self.cfg.mode == "auto" or state["mode"] == self.cfg.mode else self.cfg.mode
        return state["mode"] if configured == self.cfg.mode else self.cfg.mode

    def _configured_knobs(self, run: RunView, oom: Any) -> None:
        """train.micro_batch_tokens or activation_checkpointing edited in the config between
        sessions: the new value is the run's setting from now on, journaled as the person's (the
        value saved with the checkpoint, an out-of-memory remedy's, was kept over it, and the
        probe grew a micro-batch they had lowered back to the old one)."""
        now = {
            "micro_batch_tokens": run.configured_micro_batch_tokens,
            "activation_checkpointing": run.cfg.train.activation_checkpointing,
        }
        saved, oom.config_seen = oom.config_seen, now
        for key, value in now.items():
            if key not in saved or saved[key] == value:
                continue
            if key == "micro_batch_tokens":
                oom.configured, action, params = value, "set_micro_batch_tokens", {"tokens": value}
            else:
                oom.configured_checkpointing, oom.person_checkpointing = value, ""
                action, params = "set_activation_checkpointing", {"mode": value}
            change = {"key": f"train.{key}", "old": saved[key], "new": value}
            summary = f"train.{key} {saved[key]} -> {value} on resume at step {run.step}"
            reasoning = "changed in the config by a person between sessions: the run's setting from now on"
            decision = person_decision(
                self.journal.next_id(), run.step, "config", change, reasoning, action, params, summary
            )
            run.control.request(action, on_done=lambda line, d=decision: self._applied(d, line, run), **params)
            self.journal.add(decision)
            run.say(decision.console_line())

    def _resumed_commands(self, run: RunView) -> None:
        """A person's commands the stopped process applied after its last checkpoint (the journal
        holds them, the checkpoint does not): settings apply again at their steps (_take_commands),
        a one-time command is said, not redone."""
        again, once = ctl.lost_commands(self.journal.dropped)
        self.lost_commands += again
        for d in once:
            run.say(
                f"[orchestrator] a person's {d['summary']} (step {d['step']}) went with the process before a "
                "checkpoint kept it; a one-time command is not applied again: send it again if still wanted"
            )

    def _take_commands(self, run: RunView) -> None:
        while self.lost_commands and self.lost_commands[0]["step"] <= run.step:  # as the lost process did
            lost = self.lost_commands.pop(0)
            self._manual(run, lost["action"], dict(lost["params"]), again=lost)
        # Rank 0 takes the files and every rank applies the same commands.
        for name, command in broadcast_object(self._for_this_session(run) if is_main() else None):
            try:
                if command is None:
                    raise TrimtabError('not a command file (expected {"action": ..., "params": {...}})')
                params = command.get("params", {})
                if not isinstance(params, dict):
                    raise TrimtabError(f"'params' must be a mapping, got {params!r}")
                self._manual(run, command["action"], dict(params), name)
            except (TrimtabError, TypeError, ValueError) as exc:  # a person's file: answer, never crash
                if is_main():
                    ctl.answer(self.run_dir, name, str(exc))
                run.say(f"[orchestrator] rejected control/{name}: {exc}")

    def _for_this_session(self, run: RunView) -> list[tuple[str, dict[str, Any] | None]]:
        """The commands in control/, less those sent to a session after its last step (between its
        _answer_late_commands and the release of its lock): answered, never applied by a later one."""
        taken = []
        for name, command in ctl.take_commands(self.run_dir):
            if (late := ctl.too_late(self.run_dir, command)) is not None:
                self._answer_late(run, name, late["step"])
            else:
                taken.append((name, command))
        return taken

    def _answer_late_commands(self, run: RunView) -> None:
        """Commands that came after the run's last point to apply one (its last step's hooks; the
        final evaluation and save come after): answered in control/*.error, not journaled as
        applied (they were, with nothing done, and their files gone), nor left to fire unnoticed
        whenever the run next resumes. The inbox is closed first: `trimtab ctl` refuses from now on,
        and a command that slips in anyway is answered by the next session (_for_this_session)."""
        if not is_main():
            return
        ctl.close_inbox(self.run_dir, run.step)
        for name, _ in ctl.take_commands(self.run_dir):
            self._answer_late(run, name, run.step)

    def _answer_late(self, run: RunView, name: str, step: int) -> None:
        ctl.answer(
            self.run_dir,
            name,
            f"the run ended at step {step} before it could apply this command; nothing was applied. Send "
            "it again if still wanted (`trimtab ctl --queue` applies it when the run next resumes)",
        )
        run.say(f"[orchestrator] control/{name} came after the run's last step ({step}): not applied (control/*.error)")

    def _own_command(self, action: str, params: dict[str, Any], decision: Any) -> None:
        """ctl mode / pause-rule / resume-rule, the orchestrator's own state; one that finds the state
        already as asked changed nothing, and the journal says so (a person who resumed a rule
        that was not paused, a typo for the one that was, read "applied")."""
        if action == "set_mode":
            same, self.mode = self.mode == params["mode"], params["mode"]
            decision.applied = [f"mode {self.mode}" + (" (it was already)" if same else "")]
        else:
            rule, pause = params["rule"], action == "pause_rule"
            same = (rule in self.paused) == pause
            (self.paused.add if pause else self.paused.discard)(rule)
            paused = f"paused rules: {', '.join(sorted(self.paused)) or 'none'}"
            decision.applied = [f"{rule} was {'already' if pause else 'not'} paused; {paused}" if same else paused]
        if same:
            decision.outcome = {"result": "no effect"}

    def _manual(
        self, run: RunView, action: str, params: dict[str, Any], name: str = "", again: dict[str, Any] | None = None
    ) -> None:
        """A person's command, applied and journaled; `again`: the decision a resume lost it with."""
        if action not in ACTIONS and action not in COMMANDS:
            raise TrimtabError(f"unknown action '{action}'; one of {', '.join(VERBS)} (trimtab ctl)")
        if action in COMMANDS:
            params = COMMANDS[action].check(params)
        summary = " ".join([action, *(str(v) for v in params.values())])
        evidence, reasoning = {"command": action, **params}, "requested by a person (trimtab ctl)"
        if again is not None:
            evidence["again"] = again["id"]
            reasoning += (
                f" as decision {again['id']}; the process stopped before a checkpoint kept it: applied again on "
                "resume, at the step it was applied at"
            )
        if action == "skip_step":  # the next step's update gate withholds it, and says whose it is (StepOutput.skip_by)
            params["by"] = "person"
            if self.cfg.make_up.enabled:
                reasoning += (
                    "; not made up: orchestrator.make_up makes up the updates the update gate withheld from bad "
                    "steps, a person's skip is theirs (`trimtab ctl total-steps` lengthens the run)"
                )
        decision = person_decision(
            self.journal.next_id(), run.step, "manual", evidence, reasoning, action, params, summary
        )
        if action in ACTIONS:  # checked here, so a bad value is answered before anything is journaled
            factor = _lr_factor(run, action, params)
            run.control.request(
                action, on_done=lambda line, d=decision: self._person_applied(run, d, line, name, factor), **params
            )
            on_add, self.journal.on_add = self.journal.on_add, None  # the hooks are told once it is applied
            try:
                self.journal.add(decision)
            finally:
                self.journal.on_add = on_add
            return
        self._own_command(action, params, decision)
        self.journal.add(decision)
        run.say(decision.console_line())

    def _person_applied(self, run: RunView, decision: Decision, line: str, name: str, factor: float | None) -> None:
        """What Control did with a person's command, said once it is done. One it refused becomes the refusal
        alone: journaled as the change, then as failed, `ctl rollback 500` at step 21 read in decisions.jsonl
        and the report's markers as a rollback, and on the console as "-> roll back to 500" first. `factor`:
        an LR command's multiplier, whose instability after a raise is blamed on it (raised.py)."""
        if not line.startswith("failed: "):
            self._applied(decision, line, run, name)
            if factor is not None:
                self.policy.person_raised(decision.step, factor, f"trimtab ctl {decision.summary}")
            if decision.action == "set_checkpoint_every" and self.interval is not None:
                self.interval.person_set(decision.params["steps"])
            said = decision.console_line()
        else:
            error, asked = line.removeprefix("failed: "), decision.summary
            decision.action, decision.params, decision.applied = "none", {}, []
            decision.summary, decision.reasoning = f"{asked} (refused)", f"{decision.reasoning}; refused: {error}"
            decision.outcome = {"result": "failed", "error": error, "steps": 0}
            self.journal.write()
            if name and is_main():
                ctl.answer(self.run_dir, name, error)
            said = f"[orchestrator] step {decision.step} manual: {asked} refused, nothing changed: {error}"
        if self.journal.on_add is not None:  # the trackers' and /metrics' decision, as journaled now
            self.journal.on_add(asdict(decision))
        run.say(said)


# the key of each phase's LR, pretraining's (or RL's, DPO's: their one phase) and finetuning's (phase_data.py)
PHASE_LR = ("optim.lr", "finetune.optim.lr")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def _lr_factor(run: RunView, action: str, params: dict[str, Any]) -> float | None:
    """The LR multiplier a person's LR command makes (None for any other command): set_lr's from the LR the
    next step would train at, in a warm-up the LR it rises to, as Control._set_lr reckons it (a set-lr above
    it went uncounted as a raise: debug at x7 from step 21 replayed steps 21-25 at that LR before the second
    rollback cut it; one at step 2 of a warm-up counted x500 for a value under the configured LR)."""
    if action == "set_lr":
        now = run.set_lr_level * run.lr_scale
        return params["value"] / now if now > 0 else None
    if action in ("scale_lr", "emergency_lr_reduction"):
        return float(ACTIONS[action].check(dict(params))["factor"])
    return None
