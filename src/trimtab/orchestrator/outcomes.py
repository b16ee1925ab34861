"""A decision's measured outcome: the steps that followed it, judged after `outcome_after` of them.

Recovered means no finding of the same trouble since, finite losses, and the loss back near
(instability: within 5%, and a replay's excess over the same steps before within
orchestrator.divergence.sigma standard errors of their differences) or below (plateau: by more than
a flat stretch's noise) what it is compared with (not under RL: a policy objective is no likelihood
to come back near, so only the trouble's return and finite losses judge). That is the healthy
losses' mean before the decision, for steps the run had not trained before; a step a rollback
replays is compared with the loss the run had at that same step before (the same rows, at the same
point of the schedule): a rollback to an early checkpoint replays steps whose loss was higher than
the one just before the fault, and a faithful replay of them is a recovery, not a failure. Yet a
replay that is still the run before, bit for bit, has only restored the state: a rollback is not
judged on it alone (_unchanged), and the trouble back right after it is reproducible
("reproduced_at": the data or the schedule).

A skipped step answers that step alone, and rows left out those rows: once SETTLED healthy steps
followed it, a later finding is another fault, not the skip's failure. So does a rollback answer its
incident, once the replay trained past the step it was decided at and SETTLED healthy steps followed: a checkpoint saved
then is good, which ends the ladder's incident (ladder.py: _clear), and a fault after it is a new
incident with its own rollbacks (debug, weights_nan at 12 and 22: the rollback at 14 was judged
"not recovered" for the second fault's NaNs). A decision taken in a branch a rollback then abandoned
is judged at the rollback on the steps that branch had (the replay that follows repeats steps from
before its trouble, which would compare the run with itself), but for the rollback itself, whose
effect the replay is. Advice is never judged (deciding.py: "not applied"), nor a note (action
"none": nothing was done, so nothing healed; deciding.py: "noted"), and a knob that heals nothing
is judged on what it set, not on a loss any training run lowers: make_up's added steps ran or not
(_made_up), a checkpoint interval was applied (deciding.py: "applied"), and a failed save's retry on
the saves after it, at the run's end (_saved). A decision the run's end
comes to before `outcome_after` steps followed it is "too early" (_too_early), never "recovered".
A MoE decision is judged on its layer's load too, and may wait while that load settles; a dead
expert that was starving already when a decision was taken is no return of its trouble (both:
moe_outcomes.py). A restart on fewer ranks "continued" (_continued).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.journal import Decision, Journal
from trimtab.orchestrator.moe_outcomes import MoELoad, older, track_load
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.rl_stats import curriculum_outcome, track_curriculum

KEEP = 4096  # healthy losses kept by step: a rollback goes back a checkpoint interval or a few
# Healthy steps after which a skipped step's (a rollback's, past its step) trouble is over: the 5
# quiet steps that make a checkpoint good (core.py: healthy) and withheld updates owed
# (orchestrator.make_up.quiet_steps)
SETTLED = 5
# answers of one step's trouble: a skipped update, and rows left out for good (skip_data: only those
# rows back are its trouble, same_trouble; a spike's skip_data 16-19 steps before the end was "too early")
SKIPS = ("skip_step", "skip_data")
# rules that read their trouble at every step, answered as a skipped step is: the lr rule compares the LR
# the optimizer applies with the schedule's at each step, so its multiplier shows within a step whether it
# brought the LR back. Held to `outcome_after`, its decision at step 12 of a 31-step run (debug,
# lr_spike@12:10) was "too early" after 19 steps at the schedule's LR.
ONE_STEP = ("lr",)
FOUND = 5  # the findings an outcome names ("found_after": rule@step), the first few


class Outcomes:
    def __init__(self, journal: Journal, cfg: OrchestratorConfig) -> None:
        self.journal, self.outcome_after = journal, cfg.outcome_after
        # A plateau's LR raise helped when the loss fell by more than the noise a flat stretch
        # has: the standard deviation of orchestrator.plateau.variance, the flatness it fired at
        # (a fall of 0.007 nats at an LR of 1e-6, the loss still at ln(vocab), was "recovered").
        self.plateau_fall = math.sqrt(cfg.plateau.variance)
        self.moe_load = MoELoad(cfg.moe, cfg.outcome_after)  # a MoE decision's layer load (moe_outcomes.py)
        # An instability decision's loss back within 5% of its reference is recovered only if what is
        # left above it is within this many standard errors of the steps' differences from it: the
        # divergence rule's test of a rise (orchestrator.divergence.sigma; 0: the 5% alone).
        self.sigma = cfg.divergence.sigma
        self.tracking: dict[str, dict[str, Any]] = {}  # decision id -> what followed it
        self.healthy: OrderedDict[int, float] = OrderedDict()  # step -> its loss, steps without findings
        # step -> its loss, steps with findings: the loss a replay of the faulty step itself is compared with
        # (a rollback to the step just before the fault replays no healthy step first: _reproduced)
        self.troubled: OrderedDict[int, float] = OrderedDict()
        self.last_step = 0  # the newest step read: where a make_up decision's run got to (_made_up)

    def follow(self, m: StepMetrics, findings: list[Finding]) -> None:
        """A step read: each pending decision's record grows, and is judged once long enough."""
        reference = self.healthy.get(m.step)  # the loss this step had before a rollback replayed it
        earlier = self.troubled.get(m.step)  # the loss it had before, when that was a fault's step
        self.last_step = m.step
        for decision in self.journal.pending():
            if decision.rule == "make_up":  # no heal: done once the run trained the steps it added
                decision.observed += 1
                if m.step >= decision.params.get("steps", math.inf):
                    self.judge(decision)
                continue
            if _saves(decision):  # heals the saves, not the loss: judged on them at the run's end (_saved)
                decision.observed += 1
                continue
            if str(decision.id) not in self.tracking:  # before a replay's losses replace the branch's
                self.tracking[str(decision.id)] = {"losses": [], "findings": 0, "claim": self._claim(decision)}
            track = self.tracking[str(decision.id)]
            track["losses"].append(m.loss)
            track["withheld"] = track.get("withheld", 0) + m.skipped  # a frozen run's data decision: _frozen
            if m.rl is not None:  # RL's step: its loss is a clipped policy objective, not a likelihood
                track["objective"] = True
            paired = None if _fault_span(decision, m.step) else reference  # the cut LR's steps: no pairs
            track.setdefault("references", [None] * (len(track["losses"]) - 1)).append(paired)
            track_load(track, decision, m)
            track_curriculum(track, decision, m)
            back = [f.rule for f in findings if same_trouble(decision, f) and not older(f, len(track["losses"]))]
            same = bool(back)
            answered = decision.action in SKIPS or decision.rule in ONE_STEP
            # an LR cut's trouble is the LR, at every step: the rule again past its step is the cut falling short
            # (debug at 30x: the x0.1 at step 7 read "recovered" with the gain too low again at 15, cut x0.5 twice)
            past = decision.action == "rollback" and m.step > decision.step and track.get("claim") is None
            if answered or past:
                same = _answered_trouble(track, same, m.loss)
            if same:
                if decision.action == "rollback" and _reproduced(track, m.loss, earlier):
                    track["reproduced_at"] = m.step  # the trouble again, right after the same steps
                _back(track, back[0], m.step)
            decision.observed += 1
            if decision.observed < self.outcome_after or (decision.action == "rollback" and _unchanged(track)):
                continue
            self.judge(decision, wait=True)
        _remember(self.healthy if not findings and math.isfinite(m.loss) else self.troubled, m.step, m.loss)

    def struck(self, f: Finding) -> None:
        """A finding no step read brings (an out-of-memory error, raised inside the step before its
        metrics exist): the pending decisions whose trouble it is count it, as follow counts a
        step's. Unseen, a probe of a larger micro-batch that ran out of memory at once was judged
        "recovered" (debug, oom@20 then a resume: the probe at 50 failed at 51)."""
        for decision in self.journal.pending():
            if not same_trouble(decision, f):
                continue
            _back(self.tracking.setdefault(str(decision.id), {"losses": [], "findings": 0}), f.rule, f.step)

    def drop(self, decision: Decision) -> None:
        """No outcome to measure (it failed, or it stopped the run)."""
        self.tracking.pop(str(decision.id), None)

    def rolled_back(self, to: int, rollback: int | None) -> None:
        """A rollback restored step `to`: the pending decisions taken after it were taken in the
        branch it abandoned, judged now on what that branch had; `rollback`, the decision whose
        rollback this is, is judged on the replay (its effect)."""
        for d in self.journal.pending():
            if d.step <= to or d.id == rollback or d.rule == "make_up":  # a run's length survives a rollback
                continue
            if d.observed:
                self.judge(d)
                d.outcome["rolled_back"] = True
            else:  # nothing followed it before the rollback: nothing to judge
                self.tracking.pop(str(d.id), None)
                d.outcome = {"result": "cut short", "steps": 0, "rolled_back": True}
        self.journal.write()

    def judge(self, d: Decision, ended: bool = False, wait: bool = False) -> None:
        """Fill in d's outcome from what followed it; `ended`: the run ends here (core.py:
        on_train_end), maybe before `outcome_after` steps followed it (_too_early); `wait`: not while
        its layer's load is settling (moe_outcomes.py: MoELoad.settling)."""
        if d.rule == "make_up":
            return self._made_up(d)
        if _saves(d):
            return self._saved(d) if ended else None
        track = self.tracking.get(str(d.id), {"losses": [], "findings": 0})
        load = self.moe_load.healed(d, track.get("load"))
        healed = load.pop("healed", True)  # popped whatever `ok` is: only the numbers go in the outcome
        settling = self.moe_load.settling(d, track, healed)
        if wait and settling:
            return
        self.tracking.pop(str(d.id), None)
        references = track.get("references") or [None] * len(track["losses"])
        pairs = [(v, r) for v, r in zip(track["losses"], references, strict=True) if math.isfinite(v)]
        after = sum(v for v, _ in pairs) / len(pairs) if pairs else float("nan")
        claim = track.get("claim") or self._claim(d)  # a state from before the key: the evidence's
        before = d.loss_before if claim is None else claim[0]
        if pairs and before is not None and claim is None:
            before = sum(before if r is None else r for _, r in pairs) / len(pairs)
        end = sum(v for v, _ in pairs[-SETTLED:]) / len(pairs[-SETTLED:]) if pairs else float("nan")
        ok = track["findings"] == 0 and math.isfinite(after)
        ok = ok and self._loss_healed(d, track, pairs, (before, after, end), claim)
        ok = ok and healed and not _frozen(d, track, before, after)
        if (curriculum := curriculum_outcome(d, track)) is not None:  # judged on the signal's return (rl_stats.py)
            ok = curriculum.pop("healed") and math.isfinite(after)
            load |= curriculum
        result = "recovered" if ok else "not recovered"
        unchanged = d.action == "rollback" and _unchanged(track)
        early = _too_early(track, self.outcome_after, math.isfinite(after)) or settling
        if unchanged or (ended and early):
            result = "too early"  # a replay still the run before, bit for bit, has not yet met the fault
        d.outcome = {
            "result": result,
            "steps": len(track["losses"]),
            "loss_before": before,
            "loss_after": after,
            "findings_after": track["findings"],
        }
        if claim is not None:
            d.outcome |= {"loss_end": end, "compared_with": claim[1]}
        d.outcome |= _continued(d, result)
        d.outcome.update(load)
        if track.get("found"):  # which findings said the trouble was back: a person tells a recurrence from a new fault
            d.outcome["found_after"] = track["found"]
        replayed = sum(r is not None for _, r in pairs)
        if replayed:  # compared step by step with the run before the rollback
            d.outcome["replayed_steps"] = replayed
            d.outcome["identical_steps"] = sum(v == r for v, r in pairs)
        if "reproduced_at" in track:  # a deterministic fault: another rollback would meet it again
            d.outcome["reproduced_at"] = track["reproduced_at"]
        self.journal.write()

    def _loss_healed(
        self,
        d: Decision,
        track: dict[str, Any],
        pairs: list[tuple[float, float | None]],
        losses: tuple[float | None, float, float],
        claim: tuple[float, str] | None,
    ) -> bool:
        """Whether the finite losses that followed d, with no finding of its trouble since, say it
        healed: `losses` is (before: what they are compared with, after: their mean, end: the mean of
        the last SETTLED), `pairs` each step's loss and the loss it had before a rollback replayed it."""
        # RL's loss is an advantage-weighted objective near 0 of either sign, not a likelihood: a
        # skip of a NaN step read "recovered" or "not recovered" by the sign of the steps after it
        # (the same run, sync and async), so there only the trouble's return and finite losses judge
        if track.get("objective"):
            return True
        before, after, end = losses
        ok = True
        if claim is not None:  # an LR cut's: by the window's end, under the trouble
            ok = end < claim[0]
        elif before is not None and d.family == "instability":
            ok = after <= before * 1.05 and self._within_noise(pairs, after - before)
        if ok and before is not None and d.family == "plateau" and d.action != "none":
            ok = after < before - self.plateau_fall
        return ok

    def _claim(self, d: Decision) -> tuple[float, str] | None:
        """What an LR-cut rollback for an LR far too high (_fault_span) claims to heal, as (loss, what it
        is): the replay's loss at the end of its window (its last SETTLED steps) under the lowest of
        where the phase started (evidence["start"]), the abandoned branch's loss at the step the rule
        said the trouble began (evidence["since"], read before the replay replaces it), the level a
        stall sat at (evidence["level"]: the unigram entropy's, the model predicting token frequencies
        alone) and a gradient-norm collapse's loss (it fires only on a stalled loss). A low update gain's
        cut is judged by the rule finding it again (a quiet replay past its step does not settle it).
        The replay's mean under the start was the claim, and every run trains below its start: debug-moe
        at 30x (the gain rule off, 80 steps) read "recovered" for the LR cut to x0.316 at a stall at 5.01
        (loss 5.19 by the window's end, the branch collapsed at 5.06) and to x0.1 at a collapse at 5.02
        (5.08; collapsed again at 5.06, the cut to x0.0316 after it trained to 3.7)."""
        if d.rule != "above_start" or "lr_factor" not in d.params:
            return None
        since, e = d.evidence.get("since"), d.evidence
        branch = self.healthy.get(since, self.troubled.get(since)) if isinstance(since, int) else None
        bars = {"start": e.get("start"), f"the loss at step {since}": branch, "stall": e.get("level")}
        if "collapse" in e:  # a gain finding's loss is one step's on the way down: 5.133 against 5.131 (debug, 30x)
            bars[f"the loss at step {d.step}"] = e.get("loss")
        known = [(float(v), k) for k, v in bars.items() if isinstance(v, (int, float)) and math.isfinite(v)]
        return min(known) if known else None

    def _made_up(self, d: Decision) -> None:
        """make_up's set_total_steps heals nothing: it gives back updates the gate withheld, by adding
        steps to the run (make_up.py). It is "done" once the run trained to the total it set (the
        steps made up ran), "not done" where the run ended short of it (stopped, or a later make_up
        took the steps back: a rollback replayed the withheld ones). Judged on the loss, it read
        "recovered" (debug, bad_batch@20: 5.31 -> 4.56) for steps that had not run yet."""
        self.tracking.pop(str(d.id), None)
        total = d.params.get("steps")
        done = isinstance(total, int) and self.last_step >= total
        d.outcome = {"result": "done" if done else "not done", "steps": d.observed}
        d.outcome |= {"made_up": d.evidence.get("extend"), "total_steps": total, "trained_to": self.last_step}
        self.journal.write()

    def _saved(self, d: Decision) -> None:
        """A failed save's retry (the disk rule's save_checkpoint) heals the saves: "recovered" when the run's
        last failed save of the incident (the decision's step, or the failure counted on it again: seen_again,
        last_seen_at) was followed by one written (saved_at: SaveGuard.on_checkpoint), "not recovered" when the
        run ended with the saves failing. Judged on the loss, a 23-step debug run on a 16 MiB tmpfs whose every
        save after the first failure was written read "too early", and `trimtab runs` counted no fault healed."""
        self.tracking.pop(str(d.id), None)
        failed, saved = d.evidence.get("last_seen_at", d.step), d.evidence.get("saved_at")
        healed = isinstance(saved, int) and saved >= failed
        d.outcome = {"result": "recovered" if healed else "not recovered", "steps": d.observed}
        d.outcome |= {"saves_after": d.evidence.get("saves_after", 0), "last_failed": failed}
        self.journal.write()

    def _within_noise(self, pairs: list[tuple[float, float | None]], excess: float) -> bool:
        """Whether a replay's mean `excess` over the losses the run had at the same steps before is
        within `sigma` standard errors of their step-by-step differences. A replay is paired step
        by step (the same rows, the same point of the schedule), so its noise is small: a rollback
        with an LR cut x0.316 (debug, bad_batch every 10 steps), its replay at 5.88 against 5.64 for
        the same steps before (+4.4%, every step higher), was "recovered" within the 5%. Steps not
        trained before compare with a mean of earlier steps on a falling curve: the 5% alone, so the
        replayed steps' own excess is what their noise judges (a DPO rollback at ln 2, its replay the
        run before bit for bit, its new steps 1e-5 nats over the loss before, read "not recovered")."""
        replayed = [(v, r) for v, r in pairs if r is not None]
        if excess <= 0 or not self.sigma or len(replayed) < 2:
            return True
        diffs = [v - r for v, r in replayed]
        mean = sum(diffs) / len(diffs)
        error = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
        return mean <= self.sigma * error

    def state_dict(self) -> dict[str, Any]:
        """Its part of the orchestrator's state (keys of its own there)."""
        return {
            "tracking": self.tracking,
            "healthy_losses": [[s, v] for s, v in self.healthy.items()],
            "troubled_losses": [[s, v] for s, v in self.troubled.items()],
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracking = state["tracking"]
        self.healthy = OrderedDict((int(s), float(v)) for s, v in state.get("healthy_losses", []))  # older: none
        self.troubled = OrderedDict((int(s), float(v)) for s, v in state.get("troubled_losses", []))  # older: none
        self.last_step = int(state.get("last_step", 0))  # a session resumed at its end still knows where it got


def _continued(d: Decision, result: str) -> dict[str, Any]:
    """A restart on fewer ranks than the session it lost (a node gone, torchrun --nnodes MIN:MAX) healed
    no fault: the job goes on without the rank, each step slower, so its outcome says that ("continued",
    the worlds, the steps and seconds lost) where "recovered" said the lost rank was back, and
    `trimtab runs` counted it among the faults healed. Its trouble back is "not recovered" still."""
    e = d.evidence
    before, after = e.get("world_before"), e.get("world_after")
    if d.rule != "restart" or not isinstance(before, int) or not isinstance(after, int) or after >= before:
        return {}
    lost = {"world_before": before, "world_after": after, "steps_lost": e.get("steps_lost"), "down_s": e.get("down_s")}
    return lost | ({} if result == "not recovered" else {"result": "continued"})


def _fault_span(d: Decision, step: int) -> bool:
    """Whether `step` is one an LR-cut rollback for an LR far too high replays from the trouble's span:
    above_start found every step since evidence["since"] trained at that LR, so the run's loss there
    before is the fault's own, no reference. A too-high LR drops the loss fast at first: debug-moe at 30x
    (the gain rule off), rolled back to 0 at step 27 and cut x0.316, read "not recovered" paired with the
    abandoned branch's steps 1-20 (5.53 against 5.42), no finding since, and the run ended at val 4.31."""
    return d.rule == "above_start" and "lr_factor" in d.params and step >= d.evidence.get("since", math.inf)


def _remember(losses: OrderedDict[int, float], step: int, loss: float) -> None:
    """Step's loss, the newest of at most KEEP."""
    losses[step] = loss
    losses.move_to_end(step)
    while len(losses) > KEEP:
        losses.popitem(last=False)


def _frozen(d: Decision, track: dict[str, Any], before: float | None, after: float) -> bool:
    """Rows left out while most of the updates after them were withheld and the loss rose: the run
    did not train, whatever the rows were. Judged on the rows' return alone, a data watch that
    withheld 81 updates of a run frozen by a person's 30x LR was "recovered" 77 times (its loss
    6.2 against 5.3 before) and its confidence climbed 0.75 -> 0.98 (debug-moe: withheld.py)."""
    most = 2 * track.get("withheld", 0) > len(track["losses"])
    return d.action == "skip_data" and most and before is not None and not after <= before


def _saves(d: Decision) -> bool:
    """Whether `d` is a failed save's retry, judged on the saves that followed (Outcomes._saved)."""
    return d.rule == "disk" and d.action == "save_checkpoint"


def _too_early(track: dict[str, Any], outcome_after: int, finite: bool) -> bool:
    """Whether a decision the run's end judges rests on too few steps to say it healed anything:
    fewer than `outcome_after` followed it (an RL rule's decision 1 step before the end was
    "recovered" with every group still flat, and rundir.healed counted it). Not when the trouble
    came back or the losses were not finite (a failure shows in any number of steps), nor for a
    skipped step (a rollback past its step) SETTLED healthy steps answered: a later finding is
    another fault, so nothing more could undo it."""
    if len(track["losses"]) >= outcome_after or track.get("healthy", 0) >= SETTLED:
        return False
    return track["findings"] == 0 and finite


def _unchanged(track: dict[str, Any], last: bool = True) -> bool:
    """Whether every step a rollback's replay trained so far (but the newest, unless `last`) is the
    run before it bit for bit: the same loss at the same step, no trouble back. Such a replay has
    only restored the state, not yet met the fault, so it is no evidence of a recovery: with
    checkpoint.every 20 and orchestrator.outcome_after 10, weights_nan@38's rollback at 40 was
    "recovered" on steps 21-30, loss_before == loss_after, before the replay reached step 38. A fault
    back right after such a replay is reproducible (`reproduced_at`): its cause is in the data or the
    schedule, not transient, and the same rollback would meet it again."""
    losses = track["losses"]
    references = track.get("references") or [None] * len(losses)  # a state from before the key: none
    if not last:
        losses, references = losses[:-1], references[:-1]
    same = all(r is not None and v == r for v, r in zip(losses, references, strict=True))
    return bool(losses) and not track["findings"] and same


def _reproduced(track: dict[str, Any], loss: float, earlier: float | None) -> bool:
    """Whether a rollback's trouble, back at this step (the newest of track's losses), is the run
    before again: every step the replay trained before it was (_unchanged), or, where it trained
    none (a rollback to the step just before the fault: the fault's own step is the replay's first,
    and a step with findings has no healthy loss to compare with), this step's loss is the one it
    had `earlier`, bit for bit: the same weights met the same rows at the same point of the
    schedule, so the data or the schedule brings the fault, and the same rollback would meet it
    again. A NaN loss both times is the same loss."""
    if len(track["losses"]) > 1:
        return _unchanged(track, last=False)
    return earlier is not None and (loss == earlier or (math.isnan(loss) and math.isnan(earlier)))


def _back(track: dict[str, Any], rule: str, step: int) -> None:
    """A finding said the decision's trouble is back: counted, and the first FOUND named in the
    outcome (which rule, when)."""
    track["findings"] += 1
    if len(track.setdefault("found", [])) < FOUND:
        track["found"].append(f"{rule}@{step}")


def _answered_trouble(track: dict[str, Any], same: bool, loss: float) -> bool:
    """Whether a skipped step's trouble (a rollback's, past the step it was decided at) is back:
    not once SETTLED healthy steps followed (a finding then is another fault), counted in
    track["healthy"]."""
    healthy = track.get("healthy", 0)
    if healthy >= SETTLED:
        return False
    track["healthy"] = 0 if same or not math.isfinite(loss) else healthy + 1
    return same


def same_trouble(decision: Decision, f: Finding) -> bool:
    """Whether finding f says decision's trouble is back: the same family, and for rows left out
    the same rows (other rows found later are other data, not a failed remedy: the watch's steps
    through a long bad stretch, each judged "not recovered" by the next one's rows, took the
    track record below orchestrator.min_confidence and the stretch's last rows were only advised
    out; healing benchmark, bad_batch@15:15). Not the
    out-of-memory rule's probe of a larger micro-batch, nor its failure above the size the
    decision set: that size held (a resumed run probes 10 steps in, within the outcome's window)."""
    if f.family != decision.family:
        return False
    if decision.rule == "oom" and f.rule == "oom":
        kind, tokens = f.evidence.get("kind"), f.evidence.get("micro_batch_tokens", 0)
        if kind == "rollout_oom" or decision.action == "set_generation_rows":  # RL's generation: its own size
            rows = f.evidence.get("generation_rows", 0)
            return kind == decision.evidence.get("kind") and not rows > decision.params.get("at_once", math.inf)
        return kind != "probe" and not tokens > decision.params.get("tokens", math.inf)
    if decision.action != "skip_data":
        return True
    return bool(set(decision.params.get("rows", ())) & set(f.evidence.get("rows", f.rows or ())))
