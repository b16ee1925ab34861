"""Withheld updates made up (orchestrator.make_up).

The update gate withholds a bad step's update so it never touches the weights; the step still
counts toward the run's length, so a long bad stretch leaves the run that many updates short of
what train.max_steps promised. Measured on debug-hybrid (200 steps, 25 steps of garbage from step
25; BENCHMARKS.md, healing): 25 updates withheld end 3.2% above the clean run; the same run with 25
steps more ends 1.9% above it. So once a stretch is over (no instability for `quiet_steps`), the
pretraining phase grows by the updates withheld in it (set_total_steps: the LR schedule stretches
to the new end), at most `max_fraction` of the phase in all. A rollback that replays withheld steps
gives them back: the steps made up for them are credited against the replay's withheld updates,
and what the replay did not use is taken off the run once it trained `quiet_steps` past them (a
weights_nan rolled back over a made-up NaN step ended debug's 60-step run at 61 steps, every
update of its kept trajectory applied). A credit paid is a step granted already: its update counts as
made up, against the cap and for the next rollback's credit (debug, 60 steps, cap 3: a step made up, a
rollback replaying it, the replay withholding 3 and the credit paying one of them, then 4 more withheld,
ended at 64 when the paid one went uncounted; now 63). Withheld updates the cap refuses stay owed
in the checkpoint: a resume to a longer train.max_steps raises the cap, and they are made up then (debug, 34 steps, a
NaN at step 30 refused at step 35 with the cap spent; resumed to 60 steps it was never made up).
The steps made up stay on top of a resume's new train.max_steps, as on a fresh run of that length,
and count against its cap: its decisions say so (set_total_steps by="make_up", TrainState.made_up;
schedule.reconcile), where a resume used to drop them while `made` still counted them.
Pretraining's last step leaves no quiet steps to wait for: what is owed then is granted there when
that step is sound (no instability finding at it), and otherwise said in a note and kept owed for a
resume to a longer run (debug, 60 steps: bad_batch@58:4 ended with 57 updates and nan_loss@59 with 59,
nothing journaled; now 64 steps and 61, 60 updates each). A grant at an unstable end skipped the `end`
rule's check of the broken weights (weights_noise@24:3): a spike at the added step rolled back instead.
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import MakeUpRule, OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.remedies import Remedy

SHOWN = 20  # withheld steps listed in a finding's evidence


class MakeUp:
    rule, family = "make_up", "make_up"

    def __init__(self, cfg: MakeUpRule):
        self.cfg = cfg
        self.owed: list[int] = []  # steps whose update was withheld, not made up yet
        self.refused: list[int] = []  # withheld steps the cap left unmade: made up once a longer phase has room
        self.refused_len = -1  # the phase's length they were refused at, with what make_up added since
        self.made: list[int] = []  # withheld steps made up: a step granted for each, or a credit paid
        self.credit = 0  # steps granted for withheld updates that a rollback then replayed: unpaid
        self.credit_until = -1  # the last such step: past it (and quiet_steps), unused credit is given back
        self.persons: list[int] = []  # steps a person's `ctl skip-step` withheld: theirs, not made up, said once
        self.hooks: list[int] = []  # steps a hook's skip_step withheld (run.control): its own, as a person's

    def observe(
        self, m: StepMetrics, last_unstable: int, total: int, configured: int, asked: str = ""
    ) -> Finding | None:
        """After each step: a finding when updates were withheld and the stretch is over. total:
        the run's steps now; configured: the pretraining phase's length now (the cap's base); asked:
        who withheld the step's update alone by a skip_step, "person" (`trimtab ctl skip-step`) or "hook"
        (run.control.request), as the step itself says (StepMetrics.skip_by). Neither is made up: the
        docs promise the updates the gate withheld from bad steps; two skip-steps on debug lengthened
        the run 40 -> 42, journaled as "the update gate withheld 2 update(s)", and so did a hook's (20 -> 21).
        The step said, not the step after the command: a rollback between them withheld the replay's first
        step, made up (debug, a skip-step taken with weights_nan@10's rollback: 30 -> 31; a rollback now drops a
        skip still pending: training/control.py)."""
        if m.phase != 0:  # only pretraining's length can change (Control.set_total_steps)
            self.owed.clear()
            self.refused.clear()
            return None
        if m.skipped:
            {"person": self.persons, "hook": self.hooks}.get(asked, self.owed).append(m.step)
        cap = int(self.cfg.max_fraction * configured)
        # refused updates are owed again once another lengthened the phase (a resume to a longer max_steps)
        # and the cap rose with it; not for make_up's own steps, whose 10% would creep the cap up
        if self.refused and configured > self.refused_len and cap > len(self.made):
            self.owed, self.refused = sorted(self.refused + self.owed), []
        if not self.owed and self.credit and m.step - max(last_unstable, self.credit_until) >= self.cfg.quiet_steps:
            return self._give_back(m.step, total, configured)
        ends = m.step >= configured  # pretraining's last step: no quiet steps follow it
        if not self.owed or (not ends and m.step - max(last_unstable, self.owed[-1]) < self.cfg.quiet_steps):
            return None
        owed, self.owed, persons, self.persons, hooks, self.hooks = self.owed, [], self.persons, [], self.hooks, []
        skips = {"person_skips": persons[:SHOWN], "hook_skips": hooks[:SHOWN]}
        if ends and last_unstable >= m.step:  # the quiet window passed means last_unstable < m.step
            return self._unsound_end(m.step, owed, skips, last_unstable, total, configured)
        return self._grant(m.step, owed, skips, cap, total, configured)

    def _grant(
        self, step: int, owed: list[int], skips: dict[str, list[int]], cap: int, total: int, configured: int
    ) -> Finding | None:
        """The stretch over: the `owed` updates made up, as far as the cap (`cap` steps in all) leaves
        room, the rest refused until a longer phase; a finding saying so, None where nothing is added.
        skips: the steps withheld by a person's or a hook's skip_step, named in the evidence, not made up."""
        if cap == 0:  # a run this short has no step to spare: nothing to make up, nothing to say
            self.refused, self.refused_len = self.refused + owed, configured  # unless a resume lengthens it
            return None
        # the run has grown by len(made) + credit steps: a credit paid is a step granted already, so the
        # update it pays for is made up (in `made`, where a later rollback over it credits it again), and
        # the cap's room is what is left after it (each withheld update made up once, the growth <= cap)
        paid = min(self.credit, len(owed))
        self.credit -= paid
        room = max(0, cap - len(self.made) - paid)
        extend = min(len(owed) - paid, room)
        self.made += owed[: paid + extend]
        self.refused += owed[paid + extend :]
        if self.refused:  # the length this decision leaves: only a longer one makes them up
            self.refused_len = configured + extend
        if len(owed) == paid:  # a rollback replayed as many withheld steps as were made up for
            return None
        evidence = {
            "withheld": len(owed),
            "withheld_steps": owed[:SHOWN],
            "credit": paid,
            "made_up_before": len(self.made) - extend,
            "cap": cap,
            "extend": extend,
            "total_steps": total,
            "new_total": total + extend,
            **skips,  # withheld by a person's or a hook's skip_step: not made up
        }
        summary = _withheld(owed) + self._capped(len(owed), paid + extend)
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def _unsound_end(
        self, step: int, owed: list[int], skips: dict[str, list[int]], unstable: int, total: int, configured: int
    ) -> Finding:
        """Pretraining's last step is itself unstable: the `owed` updates are not made up here (steps
        added after broken weights skip the `end` rule's check of them, and train on from them), but said
        in a note, and kept owed as the cap's refusals are: made up if a resume lengthens the run."""
        self.refused, self.refused_len = sorted(self.refused + owed), configured
        evidence = {
            "withheld": len(owed),
            "withheld_steps": owed[:SHOWN],
            "credit": 0,
            "made_up_before": len(self.made),
            "cap": int(self.cfg.max_fraction * configured),
            "extend": 0,
            "total_steps": total,
            "new_total": total,
            "unstable_end": unstable,
            **skips,
        }
        summary = _withheld(owed) + ", not made up: the last step is unstable"
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def _capped(self, withheld: int, made: int) -> str:
        """What the cap left unmade, for the console line: "4 updates withheld -> run length 33 steps"
        read as all 4 made up when max_fraction allowed 3 (the action says the length, not the count)."""
        if made >= withheld:
            return ""
        return (
            f", {made} made up, {withheld - made} stay owed "
            f"(orchestrator.make_up.max_fraction={self.cfg.max_fraction:g} reached)"
        )

    def _give_back(self, step: int, total: int, configured: int) -> Finding | None:
        """The replay trained past the withheld steps a rollback took back without withholding as
        many again: the steps granted for them and not used lengthen the run for nothing."""
        unused, self.credit, self.credit_until = self.credit, 0, -1
        new_total = max(total - unused, step)  # never before the step trained
        if new_total >= total:  # the run's last step: nothing left to take off
            return None
        evidence = {
            "withheld": 0,
            "credit": unused,
            "made_up_before": len(self.made),
            "cap": int(self.cfg.max_fraction * configured),
            "extend": new_total - total,
            "total_steps": total,
            "new_total": new_total,
        }
        summary = f"{unused} step{'s' if unused > 1 else ''} granted for withheld updates a rollback replayed, not used"
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def rolled_back(self, step: int) -> None:
        """A rollback to `step`: withheld steps after it are trained again, so they are owed no
        longer, and the steps already made up for such steps are a credit."""
        self.owed = [s for s in self.owed if s <= step]
        self.refused = [s for s in self.refused if s <= step]
        replayed = [s for s in self.made if s > step]
        self.credit += len(replayed)
        self.credit_until = max([self.credit_until, *replayed]) if self.credit else -1
        self.made = [s for s in self.made if s <= step]
        self.persons = [s for s in self.persons if s <= step]
        self.hooks = [s for s in self.hooks if s <= step]

    def state_dict(self) -> dict[str, Any]:
        return {
            "owed": list(self.owed),
            "made": list(self.made),
            "credit": self.credit,
            "until": self.credit_until,
            "refused": list(self.refused),
            "refused_len": self.refused_len,
            "persons": list(self.persons),
            "hooks": list(self.hooks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.owed, self.made, self.credit = list(state["owed"]), list(state["made"]), int(state["credit"])
        self.credit_until = int(state.get("until", -1))  # older checkpoints: given back at the next quiet step
        self.refused = list(state.get("refused", []))  # older checkpoints: the cap's refusals were dropped
        self.refused_len = int(state.get("refused_len", -1))
        self.persons = list(state.get("persons", []))
        self.hooks = list(state.get("hooks", []))


def _withheld(owed: list[int]) -> str:
    """The console line's start: "3 updates withheld (steps 58-60)"."""
    where = f"step {owed[0]}" if len(owed) == 1 else f"steps {owed[0]}-{owed[-1]}"
    return f"{len(owed)} update{'s' if len(owed) > 1 else ''} withheld ({where})"


def remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    e = f.evidence
    if e["extend"] < 0:  # _give_back
        return Remedy(
            action="set_total_steps",
            params={"steps": e["new_total"], "by": "make_up"},
            reasoning=f"a rollback replayed {e['credit']} withheld step(s) that steps had been added for, and the "
            f"replay did not withhold them again: {-e['extend']} step(s) come off pretraining, which would otherwise "
            "make more updates than its length promised (orchestrator.make_up)",
        )
    if "unstable_end" in e:  # MakeUp._unsound_end
        return Remedy(
            action="none",
            reasoning=f"the orchestrator withheld the update(s) of step(s) {', '.join(map(str, e['withheld_steps']))} "
            f"in pretraining's last steps, which leave no quiet steps to wait for, and its last step (step "
            f"{e['unstable_end']}) is itself unstable: steps added now would train on from weights the end check "
            "has yet to judge, so they are not made up; they stay owed, made up if a resume lengthens the run "
            "(orchestrator.make_up)",
        )
    if e["extend"] <= 0:
        return Remedy(
            action="none",
            reasoning=f"{e['made_up_before']} withheld updates are made up already, "
            f"orchestrator.make_up.max_fraction={cfg.make_up.max_fraction:g} of the phase: the run is not "
            "lengthened further (a stretch this long is the data's or the run's problem, not one more steps fix); "
            "they stay owed, made up if a resume lengthens the run",
        )
    left = e["withheld"] - e["extend"] - e["credit"]
    short = f" ({left} not: the cap is reached; they stay owed)" if left > 0 else ""
    credit = f", less {e['credit']} granted before for steps a rollback replayed" if e["credit"] else ""
    persons, hooks = e.get("person_skips"), e.get("hook_skips")
    theirs = (
        f"; the update(s) of step(s) {', '.join(map(str, persons))} a person withheld (`trimtab ctl skip-step`) are "
        "theirs, not made up (`trimtab ctl total-steps` lengthens the run)"
        if persons
        else ""
    )
    if hooks:
        theirs += f"; those of step(s) {', '.join(map(str, hooks))} a hook withheld (skip_step) are its, not made up"
    return Remedy(
        action="set_total_steps",
        params={"steps": e["new_total"], "by": "make_up"},
        reasoning=f"the update gate withheld {e['withheld']} update(s) of bad steps (the orchestrator's){credit}: the "
        f"run would make that many fewer updates on good data than its length promised; {e['extend']} step(s) are "
        f"added to pretraining{short}, its LR schedule stretched to the new end (orchestrator.make_up: off with "
        f"enabled=false){theirs}",
    )
