"""The remedies of RL's rules (rule detectors: rl_health.py, rl_verifier.py, rl_reward.py): each finding's
action, gentlest first, and a word for a person at a ceiling.

The rules whose remedy rolls back (rl_length, rl_hacking, rl_reward) spend the rollbacks of the
open incident, not the run's (orchestrator.max_rollbacks per incident; the Policy counts them:
policy.py, RLIncident): a fall healed long ago does not take a later one's rollback.
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.dpo_health import preference_remedy
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import GAVE_UP, Remedy, lr_cut
from trimtab.orchestrator.rl_health import NO_SIGNAL_FIXES
from trimtab.orchestrator.rl_reward import gave_up, no_rollback, reward_remedy
from trimtab.orchestrator.rl_verifier import verifier_remedy

# rules whose remedy may roll back: their findings keep RL's incident open (policy.py: RLIncident)
ROLLING_BACK = ("rl_length", "rl_hacking", "rl_reward", "dpo_held_out")


def remedy(f: Finding, view: Any, cfg: OrchestratorConfig, *, rollbacks: int = 0, incident: str = "") -> Remedy:
    """rl_signal: dynamic sampling, then a higher sampling temperature, then a stop; rl_verifier: a longer
    verifier timeout; rl_entropy: an entropy bonus, then a lower LR; rl_length: the soft
    overlong penalty, then a wider one; rl_hacking: back to the best policy, then stop (the held-out count's
    own fall: cut again, _fall_again); rl_reward: back
    to the policy before the fall began with a smaller LR (orchestrator/rl_reward.py); at a
    ceiling (or a verifier that raises), a word for a person; a verifier that raises on nearly
    every response stops the run. `rollbacks`: those the open incident spent (ROLLING_BACK's); `incident`: the
    rule of its last rollback ('' where not known)."""
    if f.rule == "rl_verifier":
        return verifier_remedy(f, view, cfg)
    if f.rule == "rl_entropy":
        return _entropy_remedy(view, cfg)
    if f.rule == "rl_length":
        return _length_remedy(f, view, cfg, rollbacks)
    if f.rule == "rl_hacking":
        return _hacking_remedy(f, view, cfg, rollbacks)
    if f.rule == "rl_ratio":
        return _ratio_remedy(view, cfg)
    if f.rule == "rl_reward":
        return reward_remedy(f, view, cfg, rollbacks)
    if f.rule == "dpo_held_out":
        return preference_remedy(f, view, cfg, rollbacks)
    return _signal_remedy(f, view, cfg, rollbacks, incident)


def _signal_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int = 0, incident: str = "") -> Remedy:
    """Dynamic sampling on; then, for groups flat but not solved, warmer sampling to the ceiling;
    there, once dynamic sampling drew a whole window without one group with a signal, the run stops
    (_no_signal); with the groups mostly solved, the task is learned: the built-in task a digit harder (_harder, a
    curriculum step), else a stop with exit 0 (_learned); partly solved, the stuck part's ladder (_partly's words).
    Turned off after it drew flat groups, it stays off and a barren window walks the same ladder. Flat because the
    policy collapsed (the monitor's evidence, or a rollback's incident open), neither: _collapsed. The starting policy's
    first rollouts flat at no reward or a partial credit: a note (_NO_REWARD), or a stop where they prove it."""
    rule = cfg.rl_signal
    if f.evidence.get("kind") in ("no_reward", "partial_credit"):  # the first rollouts (rl_health, _first_rollouts)
        return _first_stop(f) if f.evidence.get("proven") else Remedy(action="none", reasoning=_NO_REWARD)
    if f.evidence.get("collapsed") or rollbacks:
        return _collapsed(f.evidence.get("collapsed", {}), rollbacks, incident)
    # off after it drew flat groups (the rule's or a person's `ctl dynamic-sampling off`): not turned on again, but a
    # window with no group with a signal still walks the rest of the ladder (warmer, then the stop)
    off = f.evidence.get("sampling_off", False)
    # every group of a window dynamic sampling drew alone (or drawn with it off as above) was flat: more draws will
    # not find a signal
    barren = f.evidence["flat_groups"] >= 1.0 and (off or f.evidence.get("dynamic_sampling", 0.0) >= 1.0)
    if not view.rl_dynamic_sampling and barren and not off:  # turned off since these steps were drawn
        return Remedy(
            action="none",
            reasoning="dynamic sampling drew these flat groups and has been turned off since: nothing to add",
        )
    if not view.rl_dynamic_sampling and not off:
        return Remedy(
            action="set_dynamic_sampling",
            params={"value": "on"},
            reasoning="groups whose responses all earn one reward teach nothing: drop them and draw more prompts "
            "until groups with a signal fill the step (DAPO's dynamic sampling; the policy's samples unchanged)",
        )
    solved = f.evidence.get("solved_groups", 0.0)
    stuck = f.evidence["flat_groups"] - solved
    # learned: mostly solved (`threshold` of the groups, as the flat share the rule acts at). Half solved and half
    # flat at 0 was read as learned too (the stuck share under `threshold`): exit 0 naming harder prompts, which the
    # stuck half needs least; it walks the stuck groups' ladder instead (warmer, then the stop, exit 3)
    if barren and solved >= rule.threshold:
        return _harder(f, rule.max_difficulty) or _learned(f, rule.max_difficulty)
    if stuck < rule.threshold and not barren:  # mostly learnt: warmer sampling would only unlearn them
        return Remedy(action="none", reasoning=_MOSTLY_SOLVED)
    now = view.rl_temperature
    value = round(min(rule.max_temperature, now * rule.factor), 4)
    if value <= now and barren:
        return _no_signal(f, now)
    if value <= now:
        return Remedy(
            action="none",
            reasoning=f"the sampling temperature is at orchestrator.rl_signal.max_temperature ({now:g}): the groups "
            "still agree, so the prompts are too hard (or too easy) for this policy: more samples per prompt "
            "(rl.group_size), easier prompts, rl.dynamic_sampling, or a supervised warm start",
        )
    return Remedy(
        action="set_rl_temperature",
        params={"value": value},
        reasoning=f"groups stay flat with dynamic sampling {'off (turned off after it drew them)' if off else 'on'}: "
        f"sample warmer ({now:g} -> {value:g}) so a group's "
        "answers spread and some differ; the objective follows the same temperature",
    )


# rl_signal's word on flat groups mostly solved, dynamic sampling on: the words stay the same while the answer does
# (the shares are the finding's evidence): a note with each window's shares in it was a new one every window
# (Deciding folds a repeat by its words)
_MOSTLY_SOLVED = (
    "the flat groups are mostly solved (every response earned rl.full_reward; those stuck are under "
    "orchestrator.rl_signal.threshold): the policy has learnt these prompts, and dynamic sampling already "
    "looks for the others; harder prompts (rl.prompts), or the run has done its work"
)


def _collapsed(signs: dict[str, Any], rollbacks: int, incident: str = "") -> Remedy:
    """Stand down: the groups are flat because every response of a broken policy fails, and warmer sampling
    does not mend it (at lr 1e-2 on the arithmetic task it warmed 1 -> 1.5 while held-out pass@1 went 14/100 -> 0/100,
    and rule rl_reward's rollback had to put it back, docs/rl.md). An incident rl_length opened is another cause: the
    responses run to the token budget and are graded unfinished. The words name the signs and the incident's rule,
    not their numbers (the finding's evidence): a repeat folds into one decision."""
    if rollbacks and incident == "rl_length" and not signs:
        return Remedy(action="none", reasoning=_LENGTH_INCIDENT)
    why = f"the policy reads collapsed (its signs: {', '.join(signs)})" if signs else ""
    if rollbacks:
        rule = f"rule {incident}'s" if incident else "an RL rollback's (rl_reward, rl_hacking or rl_length)"
        why += (" and " if why else "") + f"{rule} incident is open"
    return Remedy(
        action="none",
        reasoning=f"{why}: the groups are flat because the policy fails every prompt, not because they are uniform at "
        "a sound policy; warmer sampling or more draws do not mend a broken policy: rules rl_reward and rl_hacking "
        "answer the fall (back to a better policy at a lower LR); a lower optim.lr is the fix",
    )


# rl_signal's stand-down while rule rl_length's rollback incident is open: its flat groups are cut responses
_LENGTH_INCIDENT = (
    "rule rl_length's incident is open (responses ran to the token budget, rl.max_new_tokens, and were rolled back "
    "with the soft overlong penalty kept): the groups are flat because cut-off responses are graded unfinished and "
    "earn no reward, not because they are uniform at a sound policy; warmer sampling draws more varied tokens, not "
    "shorter answers, so it would not lift them (and more draws meet the same budget): rule rl_length answers it "
    "(the penalty teaches ending; else raise rl.max_new_tokens)"
)


# rl_signal's word on a starting policy that earns no reward in its first rollouts: the remedies come a window later
_NO_REWARD = (
    "the run trains on: each window of flat groups turns dynamic sampling on, then samples warmer up to "
    "orchestrator.rl_signal.max_temperature; where a whole window at the ceiling still finds no group with a "
    "signal, the run stops (exit 3). A policy that never answers right rarely starts to by sampling: begin RL from "
    "a model trained on the task (trimtab train on its data, then train.init_from), or give it prompts it can solve"
)


def _no_signal(f: Finding, temperature: float) -> Remedy:
    """The remedies spent (a whole window at the ceiling temperature, drawn by dynamic sampling or with it turned off
    after it drew flat groups, and no group had a signal): a stop, like the other RL rules' (gave_up's exit 3), not
    training on with no gradient. The sampling went off and the run trained on before: from a 10-step text model on
    the arithmetic task, every group flat at reward 0 through step 40 (loss 0) and exit 0, nothing saying the starting
    model had no signal (2026-12-02)."""
    drawn, window = f.evidence.get("groups_drawn", 0.0), f.evidence["window"]
    how = "with dynamic sampling off (turned off after it drew flat groups)" if f.evidence.get("sampling_off") else ""
    why = (
        f"{'the steps drew' if how else 'dynamic sampling drew'} {drawn:.0f} groups a step for the last {window} steps"
        f"{' ' + how if how else ''}, sampled at "
        f"{temperature:g} (orchestrator.rl_signal.max_temperature), and not one had a signal: the rollouts carry no "
        "advantage (GRPO's is 0 where a group's responses all earn one reward), so no step has a gradient"
        + _partly(f.evidence)
    )
    return _signal_stop(why, "the remedies are spent (dynamic sampling, sampling up to the ceiling)")


def _partly(ev: dict[str, Any]) -> str:
    """A barren window partly solved, in words ('' where none is): the task partly learned, no signal in either
    part; harder prompts are for the solved part, the stuck part needs the no-signal fixes."""
    solved = ev.get("solved_groups", 0.0)
    if solved <= 0:
        return ""
    return (
        f"; {solved:.0%} of the groups solved (every response at rl.full_reward) and {1 - solved:.0%} stuck below it: "
        "the task partly learned, with no signal in either part (harder prompts are for the solved part; the stuck "
        "part is out of this policy's reach)"
    )


def _harder(f: Finding, most: int) -> Remedy | None:
    """The built-in task learned at a difficulty under orchestrator.rl_signal.max_difficulty: a curriculum step,
    its problems drawn at a digit more (rl/curriculum.py), instead of the stop; None for a file's task (no
    difficulty) or at the ceiling. Its outcome is the signal's return (outcomes.py: no rl_signal finding since)."""
    digits = f.evidence.get("difficulty", 0)
    if not digits or digits >= most or digits == f.evidence.get("top_difficulty"):  # the last: it did not fit
        return None
    ev = f.evidence
    return Remedy(
        action="set_rl_difficulty",
        params={"digits": digits + 1},
        reasoning=f"every group of the last {ev['window']} steps earned one reward for all its responses, "
        f"{ev['solved_groups']:.0%} all at rl.full_reward: the policy has learnt the built-in task at {digits} digits "
        f"and it teaches nothing more; draw its problems at {digits + 1} (a curriculum step, up to "
        f"orchestrator.rl_signal.max_difficulty={most}): groups it does not solve every time, and their advantage, "
        "come back",
    )


def _first_stop(f: Finding) -> Remedy:
    """The first rollouts prove the task gives this policy no signal (rl_health.py, _first_rollouts: so many responses
    alike that under 1 - threshold of the groups could have a signal): the stop at step 1, not after the three
    windows the remedies take (a 10-step text model on the arithmetic task stopped at step 20)."""
    ev = f.evidence
    credit = "no reward" if ev["kind"] == "no_reward" else "one partial credit"
    why = (
        f"every one of the {ev['groups'] * ev['group_size']} responses of the starting policy's first rollouts earned "
        f"{credit}"
        + (f", and held-out pass@1 at step 0 is 0/{ev['held_out_n']}" if "held_out_n" in ev else "")
        + f": under {ev['signal_bound']:.0%} of the groups could have a signal (95%), under the rule's threshold, so "
        "dynamic sampling and warmer sampling would search for what the policy does not answer (or the verifier, "
        "rl.reward, pays every answer alike: check that a right one earns rl.full_reward)"
    )
    return _signal_stop(why, "proven at the first rollouts")


def _signal_stop(why: str, spent: str) -> Remedy:
    """rl_signal's stop (exit 3): the policy earns no learning signal, `why`, and what was `spent` or proved it."""
    return Remedy(
        action="stop",
        params={
            "reason": f"the policy earns no learning signal: {why}; fixes: {NO_SIGNAL_FIXES}",
            "exit_code": GAVE_UP,
        },
        reasoning=f"{why}; {spent}: stopping, as training on would only spend the steps",
    )


def _learned(f: Finding, most: int) -> Remedy:
    """Every group of a window flat and mostly solved, drawn by dynamic sampling (or with it off after it drew them):
    the policy has learnt these prompts (the rest, flat below the full reward, are out of its reach), and training on
    them has no gradient. It turned dynamic sampling off and trained on before: from a 10-step text model, reward
    format:.* (every response right), on at step 5, off at 10, then 30 steps at loss 0, every group solved, exit 0 at
    step 40; now a stop at step 10 with exit 0, as early_stop's, the run having done its work."""
    ev = f.evidence
    rest = "" if ev["solved_groups"] >= 1.0 else ", the rest flat below it: out of this policy's reach"
    if ev.get("difficulty") and ev["difficulty"] == ev.get("top_difficulty"):  # a raise did not fit (_harder)
        rest += (
            f"; the built-in task at {ev['difficulty']} digits, whose next difficulty's prompts and rl.max_new_tokens "
            "would not fit model.max_seq_len"
        )
    elif ev.get("difficulty", 0) > most:  # configured past the ceiling: it read as if the ceiling were the config's
        rest += (
            f"; the built-in task at {ev['difficulty']} digits as rl.prompts configured it, above the curriculum's "
            f"ceiling orchestrator.rl_signal.max_difficulty={most} (raised no further)"
        )
    elif ev.get("difficulty"):  # the built-in task at the curriculum's ceiling (_harder)
        rest += f"; the built-in task at {ev['difficulty']} digits, orchestrator.rl_signal.max_difficulty={most}"
    why = (
        f"every group of the last {ev['window']} steps earned one reward for all its responses, "
        f"{ev['solved_groups']:.0%} all at rl.full_reward{rest} ({ev.get('groups_drawn', 0.0):.0f} groups a step "
        "drawn): the policy has learnt these prompts, and they teach it nothing more (no advantage, no gradient)"
    )
    return Remedy(
        action="stop",
        params={"reason": f"the task is learned: {why}; harder prompts (rl.prompts) to train on", "exit_code": 0},
        reasoning=f"{why}; stopping: the data needs changing (harder prompts in rl.prompts), not the optimiser",
    )


def _ratio_remedy(view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Stale rollouts first (the cheap cause to remove: generate from a newer policy); on-policy
    already, the step moves the policy too far: a lower LR."""
    eta = view.rl_max_staleness
    if eta > 0:
        return Remedy(
            action="set_max_staleness",
            params={"steps": eta // 2},
            reasoning=f"the rollouts, generated up to {_steps(eta)} behind, are too far from the policy trained: the "
            "clip and the importance-weight cap discard most of their tokens' gradient; generate them from a "
            f"newer policy ({eta} -> {_steps(eta // 2)} behind)",
        )
    why = (
        "on-policy rollouts are off the clip range: each update moves the policy further than the trust region "
        "allows (or the generation engine disagrees with the trainer: compare rl/kl at a tiny LR)"
    )
    return _lower_lr(why, view, cfg)


def _steps(n: int) -> str:
    """`n` steps in words, the count agreeing ("1 step", "0 steps"): eta 1 read "1 steps behind"."""
    return f"{n} step" if n == 1 else f"{n} steps"


def _entropy_remedy(view: Any, cfg: OrchestratorConfig) -> Remedy:
    """A bonus for entropy in the objective holds the distribution open; doubled while the
    collapse recurs, to the ceiling; then the LR halves (RL collapses fastest at a high LR)."""
    rule, now = cfg.rl_entropy, view.rl_entropy_coef
    value = round(min(rule.max_coef, now * rule.factor if now else rule.coef), 6)
    if value > now:
        return Remedy(
            action="set_entropy_bonus",
            params={"value": value},
            reasoning=f"reward the policy's entropy in the objective ({now:g} -> {value:g} x nats a token) so "
            "it keeps sampling answers it has not settled on; it costs nothing where the entropy is already high",
        )
    why = (
        f"the entropy collapses with the bonus at orchestrator.rl_entropy.max_coef ({now:g}): each update moves "
        "the policy too far onto the answers it already prefers"
    )
    return _lower_lr(why, view, cfg)


def _lower_lr(why: str, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """The LR x orchestrator.lr_cut, down to min_lr_scale; at that floor a word for a person: a cut
    under it is one the run was configured never to take (these rules' x0.5 went on under it before)."""
    factor = lr_cut(cfg.lr_cut, view, cfg)
    if factor is None:
        floor = f"the LR is at its floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g})"
        return Remedy(action="none", reasoning=f"{why}; {floor}: lower optim.lr")
    return Remedy(action="scale_lr", params={"factor": factor}, reasoning=f"{why}; a lower learning rate")


def _length_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """DAPO's soft overlong punishment over the budget's last `buffer` share, then over twice
    that; then, once an incident, back to the last checkpoint before the runaway (the policy that drew the last
    rollouts whose share cut stood within `rise` of the start's) with the penalty kept; where the replay runs
    away again, back there again with a lower LR (orchestrator.lr_cut, up to max_rollbacks and the LR's floor):
    smaller steps leave some responses ending while the penalty teaches; then the run stops (exit 3, gave_up).
    The penalty grades every cut response alike, so it teaches ending only
    while some responses still end: measured (tests/test_rl_train.py's task, seeds 0-3), two runs
    whose responses had all run to the budget stayed there through step 48 with it; with it on
    from a policy that still ended, none ran away. Not the overlong filter: it leaves the cut
    responses out of the loss, and with them the only gradient that shortens them (measured: a
    runaway from 2% to 97% cut stayed at 95% with the filter on, penalty or not)."""
    _, buffer = view.rl_overlong
    budget = view.rl_max_new_tokens
    for share in (cfg.rl_length.buffer, min(2 * cfg.rl_length.buffer, 0.75)):
        tokens = min(budget - 1, max(1, round(budget * share)))
        if buffer < tokens:
            return Remedy(
                action="set_overlong_penalty",
                params={"tokens": tokens},
                reasoning=f"responses grow into the budget and are graded unfinished: a reward penalty growing over "
                f"the budget's last {tokens} of {budget} tokens (DAPO's soft overlong punishment) brings their "
                "lengths back under it (the overlong filter goes off: the penalty needs the cut responses trained)",
            )
    before, kept = f.evidence["short_step"], view.has_checkpoint(f.evidence["short_step"])
    if rollbacks < min(1, cfg.max_rollbacks) and kept:
        return Remedy(
            action="rollback",
            params={"to": before},
            reasoning=f"the responses still run to the budget with the penalty over {buffer} of {budget} tokens: "
            "once every response is cut, the penalty grades them all alike and nothing teaches ending. Back to "
            f"the policy of step {before} or before, whose responses still ended as at the start, with the "
            "penalty kept from the start",
        )
    factor = lr_cut(cfg.lr_cut, view, cfg)
    if rollbacks < cfg.max_rollbacks and factor is not None and kept:
        return Remedy(
            action="rollback",
            params={"to": before, "lr_factor": factor},
            reasoning=f"the responses ran to the budget again after a rollback in this incident, the penalty over "
            f"{buffer} of {budget} tokens kept: the updates carry every response past the budget before the "
            f"penalty can teach ending. Back to the policy of step {before} or before, with the LR x{factor:g}",
        )
    return _length_gave_up(f, cfg, rollbacks, factor, kept, buffer, budget)


def _length_gave_up(
    f: Finding, cfg: OrchestratorConfig, rollbacks: int, factor: float | None, kept: bool, buffer: int, budget: int
) -> Remedy:
    """No rollback left: a stop, like rl_reward's, once the runaway was found `patience` windows in a row; before,
    a note. Trained on, every response is cut and graded unfinished, no group has a signal and nothing is learnt
    (the rule noted it and the run ended with exit 0 at 100% cut, 2026-12-02); yet at lr 3e-2 the last replay at x0.25
    ran to the budget for 8 steps (88-100% cut) and ended again at step 10 (0-14% cut through step 40): one window
    is too soon to stop."""
    why = (
        f"responses still run to the budget with the soft overlong penalty over {buffer} of {budget} tokens"
        + (", after a rollback in this incident" if rollbacks else "")
        + ": the task needs longer answers than the budget, or the policy repeats itself"
    )
    reason = no_rollback(factor if rollbacks else 1.0, rollbacks, cfg, f.evidence["short_step"])  # the first: any LR
    if f.evidence.get("times", cfg.rl_length.patience) < cfg.rl_length.patience:
        return Remedy(
            action="none",
            reasoning=f"{why}; {reason}: the penalty may yet teach ending at this LR; the run stops once the runaway "
            "has been found orchestrator.rl_length.patience windows in a row",
        )
    fix = f"raise rl.max_new_tokens ({budget}) if the answers need it, else a lower optim.lr or a stronger warm start"
    return gave_up("the responses keep running to rl.max_new_tokens", why, f.evidence["short_step"], reason, fix, kept)


def _hacking_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """Back to the policy of the best held-out reward with a smaller step, once an incident; again
    within it, or with the LR at its floor (a replay at the same LR repeats the same updates), the
    run stops there: its best policy is in that checkpoint, and more of the same training hacks on.
    The held-out count's own fall is an LR too high: cut again down to the floor (_fall_again)."""
    fell = f.evidence.get("kind") == "held_out_fall"  # the held-out count's own fall, the training reward aside
    # a policy collapsing on its held-out task with a flat training reward had an LR far too high: a replay at
    # half of it (orchestrator.lr_cut) collapsed again (14/100 -> 2/100 solved); rl_reward's decade cut, as a fall
    best, factor = f.evidence["best_step"], lr_cut(cfg.rl_reward.lr_factor if fell else cfg.lr_cut, view, cfg)
    # the newest checkpoint at or before the best is as sound a target as the best's (a policy before the fall); none
    # left (never saved that far back, or pruned): a stop that says so, not a rollback that fails and trains on
    kept = view.has_checkpoint(best)
    if fell and rollbacks:
        return _fall_again(f, cfg, rollbacks, factor, kept)
    if rollbacks < min(1, cfg.max_rollbacks) and factor is not None and kept:
        why = (
            "the updates make the policy worse at the task (an LR too high for RL)"
            if fell
            else "the training reward is no longer the task's"
        )
        return Remedy(
            action="rollback",
            params={"to": best, "lr_factor": factor},
            reasoning=f"{why}: restore the policy of the best held-out reward (the newest checkpoint at or before "
            f"step {best}) and train on with a smaller learning rate, which moves the policy less far"
            + ("" if fell else " towards what the verifier pays for"),
        )
    # a stop, like rl_reward's (gave_up): exit 3 and its reason in summary.json (without them: exit 0, "stop requested")
    again = "a rollback at a lower LR in this incident did not stop it"
    reason = again if rollbacks else no_rollback(factor, rollbacks, cfg, best)
    if fell:
        why = "more training makes the policy worse at the task"
        fix = "lower optim.lr, or a stronger warm start"
        return gave_up("the held-out reward keeps falling", why, best, reason, fix, kept)
    return gave_up(
        "the held-out reward keeps falling while the training reward rises",
        "more training hacks the verifier: the training reward is no longer the task's",
        best,
        reason,
        "a stricter verifier (rl.reward), or rl.held_out_reward measuring the task",
        kept,
    )


def _fall_again(f: Finding, cfg: OrchestratorConfig, rollbacks: int, factor: float | None, kept: bool) -> Remedy:
    """The held-out count falls again after a rollback of its incident: the LR is still too high, and it is cut
    again (x rl_reward.lr_factor, back to the best policy), as pretraining's rule above_start cuts again while the
    loss does not come down (too_high.py), until orchestrator.max_rollbacks or the LR's floor (min_lr_scale) stop
    it. At x30 the documented LR, rl_reward's x0.1 lifted held-out pass@1 from 1/200 to 17-19/200, under the
    healthy twin's 59-60, and this second finding stopped the run there. A cut that did not lift the count is no
    reason to stop short of the floor: at x100 (lr 1e-2, 2026-12-02) the replay at 1e-3 collapsed as far (0/400 ->
    1/400) and the next, at 1e-4, read 19/200 ten steps on (15/200 at the start)."""
    ev, best = f.evidence, f.evidence["best_step"]
    why = (
        f"held-out pass@1 falls again after a rollback in this incident ({ev['fall_solved']}/{ev['fall_n']} against "
        f"{ev['baseline_solved']}/{ev['baseline_n']} before the fall): the LR is still too high for RL"
    )
    if factor is not None and rollbacks < cfg.max_rollbacks and kept:
        measured = (
            f"the last cut took it from {ev['undone_solved']}/{ev['undone_n']} to {ev['fall_solved']}/{ev['fall_n']}"
            if "undone_n" in ev
            else "the weights the last rollback threw away were never evaluated"
        )
        return Remedy(
            action="rollback",
            params={"to": best, "lr_factor": factor},
            reasoning=f"{why}; {measured}: cut the LR again, x{factor:g}, from the policy of the best held-out reward "
            f"(the newest checkpoint at or before step {best})",
        )
    return gave_up("held-out pass@1 keeps falling", why, best, no_rollback(factor, rollbacks, cfg, best), kept=kept)
