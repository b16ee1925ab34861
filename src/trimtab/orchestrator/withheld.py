"""The withheld-updates guard: training that no longer trains is an instability, whatever rule withheld it.

Each rule that withholds an update (the update gate's spike, the data watch, a skip) answers its own
step, and no rule sees that together they stopped training. Debug-moe, a person's `ctl scale-lr 30`
at step 13: the raised LR damaged the weights, every later step's loss stood over the spike ceiling,
and the data watch claimed each spike as its rows' (attribution.py), so the ladder never climbed:
86 of 100 updates withheld, the weights frozen (val_loss 6.17 at steps 50 and 100; a clean twin
4.44 at 50), summary.json "completed". So when more than half of the last
orchestrator.withheld_window steps had their updates withheld, the guard finds an instability of its
own: the last good checkpoint is restored with the LR cut (x above_start.lr_factor, under the
schedule's: a raise above it, a person's too, is taken back, and a person's is named loudly, since an
LR that lets no update through is not beyond question); with no good checkpoint, this incident's
rollbacks spent, or the LR at orchestrator.min_lr_scale, the run saves and stops with exit 3 and the
reason, never "completed" with frozen weights. The window starts over after a rollback. The cut is
given back as the ladder's are (ladder.py quiet: x2 at a time after a quiet window, up to the
schedule's, a person's raise not included; trouble after a second give-back keeps the cut): what withheld
the updates may have been a fault or a stretch of data, not the LR.

A step whose every row the row gate left out (training/row_gate.py: targets that look like random
tokens, a model-free test, and score far above the recent rows) is not counted: it had nothing to
train on, its rows are left out for the run already, and the weights are those that scored the clean
steps before it, so a rollback replays nothing better and the cut only slows the clean steps after
(outliers.py all_gated answers its spike the same way). Debug, 120 steps, `bad_batch@15:15` (every
row of steps 15-29 gated): the guard rolled back at step 25 with the LR x0.1, given back x2 every 20
steps, val 4.438 against 4.171 clean (+6.4%; seeds 1, 2: +10.2%, +11.1%); not counted, 4.236 (+1.5%;
seeds 1, 2: +1.3%, +1.5%; 12 of the 15 updates made up, `make_up.max_fraction`). Such steps are
journaled one by one (rule row_gate, skip_data) and made up; a stretch of 8 or more, once it ends, is
replayed on clean rows instead (stretch_replay.py: 200 steps, `bad_batch@25:25`, +2.1% -> +1.6%). Past two
windows of them in a row they count again (where they are not the data's, below): a run that does not
train, not one that "completed" with frozen weights. Past one window, a 25-step stretch (200 steps,
`bad_batch@25:25`: 5 counted) and the spike rule's 5 withheld steps after it (the first clean losses over a
trend extrapolated across the frozen steps) made 11 of 20: the guard's rollback with the LR x0.1, val 4.252
against 3.841 past two (3.834 clean).

A stream that stays garbage is the data's, not an LR's: past two windows of steps none of which
trained on mostly clean rows (each withheld, or most of its rows gated), with at least 90% of their rows
gated, the guard stops the run (exit 3, as any stop the orchestrator cannot heal) with a `data` finding
that names the steps, the rows gated, a sample of them with their source files (and mixture sources), the
loader's position and what to check; no rollback (it would replay the same stream) and no LR cut (the LR
was never in question). Debug, 120 steps, `bad_batch@15:106` (garbage to the end): the gate let a step's
rows through now and then (steps 37, 41, 80, 83: a spike or the data watch withheld them), which reset
the count of fully gated steps in a row, so the guard never answered; the grad rule's window filled with
the gated steps' 0.0 norms and its ceiling of 0 raised ZeroDivisionError at step 97 (exit 1, monitors.py);
with the grad rule fixed alone the run "completed" at step 133 with frozen weights (val 5.311, 106 updates
withheld); now it stops at step 55 (1,310 of the 1,312 rows of steps 15-55 gated) with the data named. The
loader draws each epoch's rows shuffled over the whole corpus (a mixture: each step from every source, so
one source's garbage leaves the others' rows to train on and no stretch forms), so 40 steps of garbage are
the corpus's or its pipeline's, not one shard's that skipping ahead would leave behind: a person's to fix.

Such a stretch with under 90% of its rows gated, once it runs two windows past the guard's last answer, is
the instability answer (_untrained): its fully gated steps are not counted, so half of them among steps a
spike or the grad rule withheld (clean rows to train, none gated) counted 10 of 20, under the data's 90%
too (50%), and the run trained on with frozen weights (120 such steps: no finding). A tenth or more of the
rows clean but withheld is the loss's or the gradient's doing, which a rollback with the LR cut can heal
(the data's stop would end a run with clean rows to train); should the stream still not train, the
incident's rollbacks run out and the run stops with exit 3. Debug, `bad_batch` at every odd step from 15,
`grad_spike` at every even one, a window of 6: the first answer came at step 37 (a step the gate let a row
through), now at 27 (224 of the 416 rows of steps 15-27 gated).
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.remedies import Remedy, lr_cut
from trimtab.orchestrator.stretch_replay import replay_finding, replay_remedy
from trimtab.training.state import GAVE_UP

WITHHELD_RULE = "withheld"
PERSON_LR = ("scale_lr", "set_lr")  # a person's LR commands (trimtab ctl)
STRENGTH = 0.9  # a count, not a threshold on noise: the updates were withheld or not
GARBAGE_SHARE = 0.9  # of a stretch's rows gated: the data's (debug, garbage to the end: 1,310 of 1,312 at 41 steps)
SAMPLE = 16  # rows of the stretch's first and last steps kept to name (their sources: RunView.row_sources)


class WithheldUpdates:
    """The last `withheld_window` steps' withheld flags; its state is the policy's (checkpointed)."""

    def __init__(self, cfg: OrchestratorConfig):
        self.window = cfg.withheld_window
        self.steps: dict[str, bool] = {}  # step (a string: JSON keys) -> its update withheld
        self.gated = 0  # steps in a row whose every row the row gate left out
        self.stretch: dict[str, Any] = {}  # steps in a row that trained on no clean rows (_extend)
        self.replayed = -1  # the step a stretch's replay was decided at (stretch_replay.py): once per stretch

    def observe(self, m: StepMetrics) -> Finding | None:
        """A finding when most of the window's updates were withheld."""
        self.steps = {s: w for s, w in self.steps.items() if m.step - self.window < int(s) < m.step}
        self.gated = self.gated + 1 if all_rows_gated(m) else 0
        if (garbage := self._extend(m)) is not None:
            return garbage
        if 0 < self.gated <= 2 * self.window:  # the data's, left out already: not training that fails to train
            return None
        self.steps[str(m.step)] = m.skipped
        withheld = sum(self.steps.values())
        if 2 * withheld <= self.window:
            return None
        self.steps = {}  # answered: the next finding needs a window of its own
        if self.stretch:  # the stretch's own answer (_untrained) waits two windows from this one
            self.stretch["unanswered"] = 0
        return Finding(
            rule=WITHHELD_RULE,
            family="instability",
            step=m.step,
            evidence={"withheld": withheld, "window": self.window},
            summary=f"{withheld} of the last {self.window} updates withheld: training does not train",
            strength=STRENGTH,
        )

    def _extend(self, m: StepMetrics) -> Finding | None:
        """The stretch of steps that trained on no clean rows, `m` added (a step that trained on mostly
        clean rows ends it); a `data` finding once it passes two windows with GARBAGE_SHARE of its rows gated."""
        mostly = bool(m.rows) and 2 * len(m.gated_rows) > len(m.rows)
        if not (mostly or (m.skipped and self.stretch)):
            ended, self.stretch = self.stretch, {}
            return self._replay(ended, m.step) if ended and ended["first"] > self.replayed else None
        s = self.stretch or {"first": m.step, "steps": 0, "rows": 0, "gated": 0, "sample": m.gated_rows[:SAMPLE]}
        s.update(last=m.step, steps=s["steps"] + 1, rows=s["rows"] + len(m.rows))
        s.update(unanswered=s.get("unanswered", 0) + 1, withheld=s.get("withheld", 0) + m.skipped)
        s["gated"] += len(m.gated_rows)
        if all_rows_gated(m):  # the rows a replay leaves out (stretch_replay.py)
            s.update(full=s.get("full", 0) + 1, out=s.get("out", []) + list(m.gated_rows))
        self.stretch = s
        if s["gated"] < GARBAGE_SHARE * s["rows"]:
            return self._untrained(s, m.step)
        if s["steps"] <= 2 * self.window:
            return None
        self.stretch, self.steps, self.gated = {}, {}, 0  # answered: a run the stop did not end starts over
        steps, sample = f"{s['first']}-{s['last']}", sorted(set(s["sample"]) | set(m.gated_rows[:SAMPLE]))
        evidence = {
            "steps": steps,
            "stretch": s["steps"],
            "rows_seen": s["rows"],
            "rows_gated": s["gated"],
            "sample": sample,
        }
        return Finding(
            rule=WITHHELD_RULE,
            family="data",
            step=m.step,
            evidence=evidence | {"window": self.window},
            summary=f"the data has been garbage for {s['steps']} steps: {s['gated']:,} of the {s['rows']:,} rows "
            f"of steps {steps} left out by the row gate",
            strength=STRENGTH,
        )

    def _replay(self, s: dict[str, Any], step: int) -> Finding | None:
        """The ended stretch `s` replayed on clean rows when long enough (stretch_replay.py)."""
        found = replay_finding(s, step, self.window, WITHHELD_RULE)
        if found is not None:
            self.replayed, self.steps, self.gated = step, {}, 0
        return found

    def _untrained(self, s: dict[str, Any], step: int) -> Finding | None:
        """The guard's instability finding for a stretch past two windows since the guard last answered that
        trained on no clean rows but was mostly withheld with rows to train (a spike's, the grad rule's), not
        gated: the fully gated steps in it are not counted (observe), so half of them among spike-withheld ones
        kept the count at 10 of 20 and the run "completed" with frozen weights."""
        if s["unanswered"] <= 2 * self.window:
            return None
        self.stretch, self.steps, self.gated = {}, {}, 0  # answered: as observe's finding
        summary = (
            f"{s['withheld']} of the last {s['steps']} updates withheld and none trained on clean rows (steps "
            f"{s['first']}-{s['last']}: {s['gated']:,} of their {s['rows']:,} rows gated, the rest's updates "
            "withheld): training does not train"
        )
        evidence = {"withheld": s["withheld"], "window": s["steps"], "steps": f"{s['first']}-{s['last']}"}
        evidence |= {"rows_seen": s["rows"], "rows_gated": s["gated"]}
        return Finding(
            rule=WITHHELD_RULE, family="instability", step=step, evidence=evidence, summary=summary, strength=STRENGTH
        )

    def shift(self) -> None:
        """A rollback: the steps counted from here are new ones."""
        self.steps, self.gated, self.stretch = {}, 0, {}

    def state_dict(self) -> dict[str, Any]:
        state = {"steps": dict(self.steps), "gated": self.gated, "stretch": dict(self.stretch)}
        return state | {"replayed": self.replayed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.gated = dict(state.get("steps", {})), int(state.get("gated", 0))
        self.stretch, self.replayed = dict(state.get("stretch", {})), int(state.get("replayed", -1))


def all_rows_gated(m: StepMetrics) -> bool:
    """The row gate left out every row of the step: its update had nothing to train on."""
    return bool(m.rows) and not set(m.rows) - set(m.gated_rows)


def person_lr(f: Finding, decisions: list[Any]) -> Finding:
    """`f`, naming the last LR a person set (trimtab ctl: a journaled "manual" decision), if any."""
    person = next((d for d in reversed(decisions) if d.rule == "manual" and d.action in PERSON_LR), None)
    if person is not None and f.family != "data":  # a stream of garbage is no LR's
        f.evidence["person_lr"] = {"step": person.step, "action": person.action, "params": dict(person.params)}
        f.summary += f" (the LR a person set at step {person.step} included)"
    return f


def answer_withheld(policy: Any, f: Finding, view: Any) -> Remedy:
    """The guard's finding: roll back with the LR cut under the schedule's; else stop (exit 3); a stream
    of garbage: stop naming the data (garbage_stop); a stretch of it that ended: its replay (stretch_replay.py).
    `policy`: the InstabilityLadder (its rollback count, _rolled_back and _give_up)."""
    if f.family == "data":
        return replay_remedy(policy, f, view) if "replay" in f.evidence else garbage_stop(f, view)
    cfg, ev = policy.cfg, f.evidence
    frozen = f"{ev['withheld']} of the last {ev['window']} updates were withheld: the weights hardly moved"
    person = ev.get("person_lr")
    loud = (
        f"; the LR is a person's (trimtab ctl {person['action']} at step {person['step']}), cut all the same: "
        "an LR at which no update gets through is not beyond question"
        if person
        else ""
    )
    cut = lr_cut(cfg.above_start.lr_factor / max(view.lr_scale, 1.0), view, cfg)
    if cut is None:
        return policy._give_up(view, f"{frozen}, and the LR is at orchestrator.min_lr_scale already{loud}")
    if policy.rollbacks >= cfg.max_rollbacks or not view.has_good_checkpoint:
        return policy._give_up(view, f"{frozen}{loud}")
    step, target, lr_scale = f.step, view.last_good, view.lr_scale

    def commit() -> None:
        policy._rolled_back(step, target, broken=False)
        policy.lr_too_high_at = step  # rows' high losses are the model's for a while
        policy.ladder.last_step = step  # the quiet window before a give-back counts from here, as its probation
        policy._owe(cut, lr_scale, ceiling=1.0)  # given back once quiet, never past the schedule's

    return Remedy(
        action="rollback",
        params={"to": "last_good", "skip_rows": [], "lr_factor": cut},
        reasoning=f"{frozen}, whatever rule withheld them, so the run is not training: restore the last good "
        f"checkpoint with the LR x{cut:.3g} (under the schedule's x{cfg.above_start.lr_factor:g}; given back x2 "
        f"at a time after orchestrator.lr_restore_after quiet steps, up to the schedule's){loud}",
        commit=commit,
    )


def garbage_stop(f: Finding, view: Any) -> Remedy:
    """The guard's `data` finding: save and stop (exit 3), the reason naming the steps, the rows gated,
    where they came from as far as the view knows, and what to check; no rollback and no LR cut."""
    ev, sample = f.evidence, f.evidence["sample"]
    sources = dict(list(view.row_sources(sample).items())[:5]) if sample else {}
    parts = sorted(set((view.row_parts(sample) or {}).values()))  # a mixture's sources by name
    position = getattr(view, "data_position", "")
    found = {"sources": sources} | ({"parts": parts} if parts else {}) | ({"data_at": position} if position else {})
    rows = ", ".join(str(r) for r in sample[:8]) + (", ..." if len(sample) > 8 else "")
    named = f"; their files: {', '.join(sources)}" if sources else ""
    named += f"; mixture sources: {', '.join(parts)}" if parts else ""
    named += f"; the loader is at {position}" if position else ""
    what = (
        f"the data stream has been garbage for {ev['stretch']} steps: {ev['rows_gated']:,} of the {ev['rows_seen']:,} "
        f"rows of steps {ev['steps']} were left out by the row gate, so no update "
        f"trained on anything (rows {rows}{named})"
    )
    fix = (
        "check the corpus at those rows (decisions.jsonl: the row_gate decisions list every row), replace or clean "
        "it (`trimtab data prepare` screens documents for garbage: data.garbage_filter), then train on from this "
        f"run's weights: a new --out with --set train.init_from={getattr(view, 'run_dir', None) or 'RUN'} (the same "
        "--out resumes only on the same data)"
    )
    return Remedy(
        action="stop",
        params={"reason": f"{what}: {fix}", "exit_code": GAVE_UP},
        reasoning=f"{what}; a rollback would replay the same stream and an LR cut answers an instability this is "
        "not, so the run saves and stops (exit 3) for a person to fix the data",
        evidence=found,
    )
