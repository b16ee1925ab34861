"""RL's reward falling below where the policy started (rule rl_reward, `trimtab rl`, docs/rl.md),
and its remedy.

A policy trained to earn a reward that earns markedly less than it did at the start of the phase
is being made worse by its updates: RL's sign of a learning rate far too high (a pretraining LR
typed into an RL run: on the arithmetic task at lr 3e-3, 30x the README's, the training reward
went 0.066 -> 0.007 -> 0 in 15 steps, the entropy collapsed and then exploded, and the held-out
pass@1 fell from 0.14 to 0, while the other RL rules turned knobs that cannot undo it). It is
pretraining's `above_start` for a quantity that should rise.

The monitor compares the verifier's mean score (the reward without the overlong penalty, which
is shaping, not the task) of the last `window` steps with the start: the steps, at most
`start_steps`, whose rollouts the phase's starting policy generated (synchronously step 1 alone;
rl.max_staleness eta: steps 1 to eta + 1). An LR 100x too high wrecks the policy at its first
update: at lr 1e-2 from a 600-step arithmetic warm start the reward went 0.056 -> 0 at step 2, and
a start of the first 3 steps (0.016) held the collapse: found at step 30 (z 2.5), rolled back to
step 29, the collapsed policy (2026-11-30; before, 0.047 -> 0 by step 5 at 3e-3, and a start of
10 steps read 0.015). It fires when the fall is at least `drop`
of the start and stands `sigmas` standard errors clear of the two windows' sampling noise:
Welch's t over the groups' mean scores, since a group's responses answer one prompt and share
its difficulty (the responses one by one would count a window's few dozen prompts as hundreds of
independent draws, and understate the noise up to sqrt(group size) times), read with Student's
tail and bounded by the binomial noise of 0/1 rewards (rl_stats.py): a one-step start of 4 groups
(4 prompts a step) is too few for the normal tail. Where a start cannot resolve a fall of `drop`
at all, a note says so once a fall (a window back halfway to the start ends one). A rollback to
the start's own policy pools the replay's rollouts into the start (`origin`): a new one-step start
drew a lucky 0.125 against 0.06 and rolled back twice more. The sampling temperature is not a
reason to start again: rule rl_signal warms the sampling when groups go flat, which a collapsing
policy makes them (above, 1.0 -> 1.5 while the reward fell); the evidence
records both temperatures. The overlong penalty is: rule rl_length sets it to trade the verifier's
score of answers that run on for answers that end (a verifier that pays for length pays less by
design): a new penalty starts the line again (unless the score had already fallen below the line:
a collapsing policy runs on and gets one too), and the rule fires only
where the reward trained on (the penalty's included) fell too; it rises as a penalty does its work
(measured, tests/test_rl_train.py's overlong run: a verifier paying for length fell 0.31 -> 0.15 as
the penalty brought the responses cut from 98% to 6%, and the reward trained on rose -0.78 -> -0.02;
the rule, blind to that, rolled back three times and stopped the run). Without a penalty the two
are one. Remedy: back to the policy before the fall began (the one that generated the first
rollouts of the last window within `sigmas` standard errors of the start and above the line; the
starting policy where no window was), with the LR cut x `lr_factor`; when no
rollback is left (orchestrator.max_rollbacks, per incident: policy.py, RLIncident), the run
stops there (its better policy is in the checkpoints). Measured on the arithmetic run above
(lr 3e-3, 60 steps): the held-out pass@1 ended at 0.094 (0.14 at the start) where the same run
with the rule off ended at 0. The target is not the last step whose window
stood above the line: a window lags a gradual fall, that step's policy already earned below the
line, and each replay at the smaller LR found the same window again, rolling back until
orchestrator.max_rollbacks and stopping (tests/test_rl_reward.py: a fall of 0.02 a step from
0.4, that target step 19 at 0.12, against step 6 at 0.38, where the fall began).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.remedies import GAVE_UP, Remedy, lr_cut
from trimtab.orchestrator.rl_stats import fall_test, group_size, poisoned
from trimtab.training.actions import PUT_BACK

SCORE = ("score_n", "score", "score_sq")  # a step's groups drawn, their mean scores' sum and sum of squares


class RewardFall(Monitor):
    """The verifier's mean score of the last `window` steps against the starting policy's
    rollouts (at most `start_steps` steps): fallen by `drop` of the start or more, `sigmas`
    standard errors clear of the noise. Evidence: both means, the z, the start's steps, both
    temperatures, the policy from before the fall (the one that generated the first rollouts of
    the last window within the noise of the start and above the line) and its window's score."""

    rule, family = "rl_reward", "rl"
    # Orchestrator.on_rollback keeps these over the checkpoint's: a replay from the start's own policy pools into
    # `origin`; a note once said stays said (restored with a checkpoint from before it, rl_length's rollback in an
    # 8-prompt run at lr 1e-2 had the note journaled again at step 25 after step 11: its numbers differ, no fold)
    KEPT_ON_ROLLBACK = ("origin", "noted", "episodes")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_reward
        self.temperature: float | None = None  # the start's sampling temperature
        self.overlong_buffer = 0  # the soft overlong penalty the start was scored under (tokens)
        self.start: list[list[float]] = []  # the starting policy's steps' SCORE sums (at most `start_steps`)
        self.first: int | None = None  # the start's first step (its rollouts: the policy of the step before)
        self.penalised = False  # the start was taken again under a penalty set mid-phase: its first steps
        self.window: list[list[float]] = []  # the last steps'
        # the last step whose window was within the noise of the start (the fall not yet begun):
        # the rollback's target, and that window's mean score
        self.good_step, self.good_score = 0, 0.0
        self.fired = 0  # findings in this run (kept across a rollback)
        # [first, overlong buffer, temperature, steps]: the start as last taken (KEPT_ON_ROLLBACK). A
        # rollback to the policy that generated it (step first - 1) replays rollouts of that same policy:
        # they join it, more samples of one policy, not a new lucky draw (a replay's one-step start of 4
        # groups read 0.125 against 0.06 and rolled back twice more, then stopped the run)
        self.origin: list[Any] = []
        self.pooled = 0  # the start's steps an earlier pass of its policy drew (origin's, pooled)
        # said, for this episode of a fall, that the start cannot resolve it (KEPT_ON_ROLLBACK); `episodes`: the notes
        # said so far. A window back halfway from the line to the start ends the episode: the next fall is said again
        self.noted, self.episodes = False, 0
        self._fresh: bool | None = None  # the first step observed since a restore (load_state_dict)
        self.difficulty: int | None = None  # the built-in task's digits (rl/curriculum.py; None: not known)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A rollback restores the windows, not what was decided: a finding after one counts on."""
        fired = self.fired
        super().load_state_dict(state)
        self.fired = max(self.fired, fired)
        self._fresh = True

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        fresh, self._fresh = self._fresh, None  # any step seen since a restore ends its first
        if rl.get("score_n") is None or not rl["score_n"] or poisoned(rl):
            return None
        seen = [*(rl[k] for k in SCORE), rl["reward"], group_size(rl)]
        if rl.get("overlong_buffer", 0) != self.overlong_buffer:
            self._new_penalty(rl.get("overlong_buffer", 0))
        if (level := rl.get("difficulty")) is not None and level != (self.difficulty or level):
            # a curriculum step (rl/curriculum.py): a harder task scores lower by design, not a fall; its own start
            self.penalised = bool(self.start)
            self.start, self.window, self.first, self.pooled = [], [], None, 0
        self.difficulty = rl.get("difficulty", self.difficulty)
        # a replay restored to the start's policy draws from it as the start did: same step, penalty, temperature
        same = bool(fresh) and self.origin[:3] == [m.step, self.overlong_buffer, rl["temperature"]]
        if self._starting(m, rl.get("staleness", 0.0), same):
            self.start.append(seen)
            self.origin = [self.first, self.overlong_buffer, rl["temperature"], [list(step) for step in self.start]]
            self.temperature = rl["temperature"]
            # the policy that generated the start's rollouts: the step before the start's first
            self.good_step, self.good_score = self.first - 1, _mean(self.start)
            return None
        self.window = [*self.window, seen][-rule.window :]
        start, now = _mean(self.start), _mean(self.window)
        z = fall_test(self.start, self.window).z
        line = (1 - rule.drop) * start
        # the fall had not begun while the window stood within the noise of the start and above
        # the line; within the noise alone is too lenient where the start is one step's (at lr 1e-2
        # windows of zeros after a start of 0.056 stood within it, and the target was the collapse).
        # The target is the policy that generated the window's first rollouts, not its last step's:
        # a window lags a gradual fall, that step's policy already earned below the line, and each
        # replay at the smaller LR found the same window again until max_rollbacks
        if z < rule.sigmas and now > line:
            self.good_step = m.step - len(self.window) - round(rl.get("staleness", 0.0))
            self.good_score = now
        if len(self.window) >= rule.window and now >= (1 - rule.drop / 2) * start:
            self.noted = False  # recovered (halfway back to the start, not a hair over the line): the episode is over
        if len(self.window) < rule.window or now > line:
            return None
        if z < rule.sigmas:  # below the line, within the noise: said once where the start cannot resolve it
            return self._unresolved(m, start)
        if _reward(self.window) >= _reward(self.start):
            return None
        evidence = {
            "score": now,
            "start_score": start,
            "reward": _reward(self.window),  # the reward trained on, the overlong penalty included
            "start_reward": _reward(self.start),
            "z": z,
            "window": rule.window,
            "start_steps": len(self.start),
            "start_groups": int(sum(step[0] for step in self.start)),
            "start_temperature": self.temperature,
            "temperature": rl["temperature"],
            "good_step": self.good_step,
            "good_score": self.good_score,
            "times": self.fired + 1,
        }
        self.window, self.fired = [], self.fired + 1
        last = self.first + len(self.start) - self.pooled - 1
        steps = f"step {last}" if last == self.first else f"steps {self.first}-{last}"
        steps += f", its policy's rollouts drawn {len(self.start) - self.pooled} + {self.pooled}" if self.pooled else ""
        summary = (
            f"the verifier's mean score over the last {rule.window} steps fell to {now:.3f} from the {start:.3f} "
            f"the starting policy earned ({steps}; {z:.1f} standard errors, threshold {rule.sigmas:g}; a fall of "
            f"{rule.drop:.0%} or more): the updates make the policy worse"
        )
        return self.finding(m, evidence, summary, min(1.0, 0.5 + 0.5 * (1 - now / max(start, 1e-12))))

    def _new_penalty(self, buffer: int) -> None:
        """Another overlong penalty, another objective: its own start, unless the verifier's score
        had already fallen below the line before it. Rule rl_length sets a penalty on a collapsing
        policy too (its responses run on): at lr 3e-3 and 1e-2, 3 runs of 6 got one at step 10, and
        a start taken under it was the collapse itself (never found; held-out pass@1 0.09 -> 0).
        A start taken again is the penalty's first `start_steps` steps, not one: the reward trained
        on must have fallen below it too, and the first step under a penalty, its responses the
        longest, sets that line by a hair (the overlong run of tests/test_rl_train.py: -0.559,
        against -0.561 at the finding, a fall of the verifier's score the penalty paid for)."""
        fallen = bool(self.start and self.window)
        if fallen:
            fallen = _mean(self.window) <= (1 - self.cfg.drop) * _mean(self.start)
        if not fallen:
            self.penalised = bool(self.start)  # mid-phase; at the phase's start: the starting policy's
            self.start, self.window, self.first, self.pooled = [], [], None, 0
        self.overlong_buffer = buffer

    def _starting(self, m: StepMetrics, staleness: float, same: bool) -> bool:
        """Whether this step joins the start: up to `start_steps` steps whose rollouts the phase's
        starting policy generated (synchronously the first step alone; rl.max_staleness eta: the
        first eta + 1). Steps after it train on rollouts of updated policies, which an LR 100x too
        high has already wrecked: at lr 1e-2 the reward went 0.056 -> 0 at step 2, and a start of
        three steps (0.016) took the collapse as its own baseline (found at step 30, back to 29)."""
        own = len(self.start) - self.pooled  # this pass's steps
        if own >= self.cfg.start_steps:
            return False
        if self.first is None:  # this start's first step (an older state: counted back from its steps)
            self.first = m.step - own
            if same and not self.start:  # restored to the policy that generated the start: the replay's join it
                self.start, self.pooled = [list(step) for step in self.origin[3]], len(self.origin[3])
        return not own or self.penalised or m.step - staleness < self.first + 0.5

    def _unresolved(self, m: StepMetrics, start: float) -> Finding | None:
        """Once an episode, a note (no action) where even a window at the line, however long, could not stand
        `sigmas` clear of this start's own noise: its groups are too few to resolve a fall of `drop`
        (4 prompts a step on the arithmetic task, 0.06: one step's 4 groups), and only a deeper fall
        can be found. More prompts a step, or rl.max_staleness (a start of eta + 1 steps), resolve it."""
        if self.noted or start <= 0:
            return None
        now = _mean(self.window)
        line, many, size = (1 - self.cfg.drop) * start, 1e6, self.start[-1][4] if len(self.start[-1]) > 4 else 0
        fall = fall_test(self.start, [[many, many * line, many * line * line, line, size]])
        if fall.z >= self.cfg.sigmas:
            return None
        self.noted, self.episodes = True, self.episodes + 1
        groups = int(sum(step[0] for step in self.start))
        evidence = {"unresolved": True, "start_score": start, "start_groups": groups, "z": fall.z, "df": fall.df}
        evidence |= {"score": now, "window": self.cfg.window, "episode": self.episodes}
        # the step and score in the words: the journal folds a note repeated word for word into the first (deciding.py)
        again = f", again (fall {self.episodes}: a window recovered from the last)" if self.episodes > 1 else ""
        summary = (
            f"the verifier's mean score over the last {self.cfg.window} steps fell to {now:.3f} at step {m.step}"
            f"{again}; "
            f"the starting policy's {groups} groups ({start:.3f}) are too few to tell a fall of {self.cfg.drop:.0%} "
            f"from their own noise (at best {fall.z:.1f} standard errors, threshold {self.cfg.sigmas:g}): only a "
            "deeper fall can be found; more prompts a step (rl.prompts_per_step) resolve it"
        )
        return self.finding(m, evidence, summary, 0.0)


def _mean(steps: list[list[float]]) -> float:
    """The mean group score over the steps."""
    return sum(step[1] for step in steps) / max(sum(step[0] for step in steps), 1)


def _reward(steps: list[list[float]]) -> float:
    """The steps' mean reward trained on (older checkpoints' windows: their verifier score)."""
    return sum(step[3] if len(step) > 3 else step[1] / max(step[0], 1) for step in steps) / max(len(steps), 1)


def reward_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """Back to the last policy that earned its start's reward, with a smaller step; when no
    rollback is left (or none reaches that far back, or the LR is at its floor: a replay would repeat
    the same updates), stop: training on makes the policy worse.
    `rollbacks`: those the open incident spent (max_rollbacks bounds an incident's, not the run's)."""
    if f.evidence.get("unresolved"):
        return Remedy(action="none", reasoning=f"{f.summary}: a note, nothing to undo")
    before = f.evidence["good_step"]
    factor = lr_cut(cfg.rl_reward.lr_factor, view, cfg)
    why = (
        f"a policy trained to earn the reward earns {f.evidence['score']:.3f} where it started at "
        f"{f.evidence['start_score']:.3f}: each update moves it the wrong way, as an LR far too high for RL does "
        f"(RL's LRs are 10-100x below pretraining's)"
    )
    kept = view.has_checkpoint(before)
    if factor is not None and rollbacks < cfg.max_rollbacks and kept:
        good = f.evidence.get("good_score")
        scored = f" ({good:.3f})" if good is not None else ""
        return Remedy(
            action="rollback",
            params={"to": before, "skip_rows": [], "lr_factor": factor},
            reasoning=why + f"; restore the policy of step {before} or before (the last whose window{scored} stood "
            f"within the noise of the start: before the fall began) and train on with the LR x{factor:g}, never to "
            "be given back",
        )
    reason = no_rollback(factor, rollbacks, cfg, before)
    return gave_up("the RL reward keeps falling below its start", why, before, reason, kept=kept)


# What the reasoning calls the knobs a rollback of this rule puts back (actions.PUT_BACK)
NAMES = {
    "set_rl_temperature": "the sampling temperature",
    "set_entropy_bonus": "the entropy bonus",
    "set_overlong_penalty": "the overlong penalty (tokens)",
    "set_overlong_filter": "the overlong filter",
    "set_rl_difficulty": "the task's difficulty (digits)",
}
assert set(NAMES) == set(PUT_BACK), "rl_reward.NAMES names the knobs actions.PUT_BACK reads"


@dataclass
class KnobTurns:
    """The knobs RL's rules turned (the Policy's record, kept across rollbacks and in checkpoints):
    [the run's step when decided, action, value before, value set] in the order turned. A rollback of this rule
    puts back those turned after the step it restores (Control._put_back): rule rl_signal warms
    the sampling of a collapsing policy (its groups go flat: 1.0 -> 1.5 by step 10 at lr 1e-2),
    rl_length puts a penalty on its runaway responses, and the replay at the smaller LR, sampled
    warmer than the policy it restored ever was, started weaker and its fall was not found again
    (2026-11-30: 2 of 3 runs at lr 1e-2, pass@1 0.01-0.02). Only turns whose value still stands go
    back: a knob a person set since (`trimtab ctl`) is theirs, and a rollback keeps it."""

    turns: list[list[Any]] = field(default_factory=list)
    seen: int = 0  # the newest step observed: where a rollback moves back from (shift)

    def turning(self, remedy: Remedy, view: Any) -> Callable[[], None]:
        """The commit of a remedy that turns a knob: it records the turn (a penalty turns the
        overlong filter off too: Control._set_overlong_penalty) at the run's step, after which
        Control applies it (the finding's may be older: the orchestrator reads steps in batches)."""
        name, (value,), step = remedy.action, remedy.params.values(), view.step
        turns = [[step, name, PUT_BACK[name](view), value]]
        if name == "set_overlong_penalty" and value and view.rl_overlong[0]:
            turns.append([step, "set_overlong_filter", "on", "off"])

        def commit() -> None:
            for turn in turns:
                last = next((t for t in reversed(self.turns) if t[1] == turn[1]), None)
                if last is not None and last[3] != turn[2]:  # set otherwise since (put back, a person's):
                    self.turns = [t for t in self.turns if t[1] != turn[1]]  # no walk back passes that
                self.turns.append(turn)
            del self.turns[:-64]  # the rules' ladders are short: older turns than these are long undone

        return commit

    def shift(self, steps: int) -> None:
        """A rollback moved the step counter back by `steps`, the knobs kept: a turn after the
        step restored is in force from the step after it on, and not in its checkpoint."""
        self.seen -= steps
        for turn in self.turns:
            turn[0] = min(turn[0], self.seen + 1)


def put_back(remedy: Remedy, turns: list[list[Any]], good_step: int) -> None:
    """A rollback of this rule that puts back the knobs RL's rules turned after the step it
    restores (Control._put_back resolves which, once it knows that step): the policy before the
    fall is replayed as it ran, not sampled warmer."""
    if remedy.action != "rollback" or not turns:
        return
    remedy.params["knobs"] = [list(turn) for turn in turns]
    knobs: dict[str, list[list[Any]]] = {}
    for turn in turns:
        if turn[0] > good_step:
            knobs.setdefault(turn[1], []).append(turn)
    said = "; ".join(f"{NAMES[knob]} {_span(knob_turns)}" for knob, knob_turns in knobs.items())
    remedy.reasoning += (
        "; the knobs RL's rules turned after the step restored go back to what its policy ran with (a person's "
        f"setting stays){f' ({said})' if said else ''}: sampled warmer than it ever was (rule rl_signal warms a "
        "collapsing policy's flat groups), the replay starts weaker and its fall at the smaller LR goes unfound"
    )


def _span(turns: list[list[Any]]) -> str:
    """A knob's turns as the reasoning says them: `1 -> 1.5 (steps 4-6)`."""
    (first, _, before, _), (last, _, _, after) = turns[0], turns[-1]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"{before:g} -> {after:g} ({steps})" if not isinstance(after, str) else f"{before} -> {after} ({steps})"


def gave_up(what: str, why: str, step: int, reason: str, fix: str = "lower optim.lr", kept: bool = True) -> Remedy:
    """The stop of an RL or DPO rule that rolls back to a better policy with the LR cut, when it cannot (exit 3): `what`
    keeps happening, `why` it does, the `reason` no rollback is left (no_rollback's, or a cut that did not help), the
    `fix` for a person, and the better policy, the checkpoint at or before `step` (rl_reward, rl_hacking, rl_length,
    dpo_held_out); `kept` False: no checkpoint that far back is left, and the reason names none (it named one pruned).
    The reason goes to summary.json and the run's last line: a stop without one read "stopped (stop requested)"."""
    policy = "the better policy is the checkpoint at or before" if kept else "no checkpoint holds the policy of"
    keeps = "keeps the better policy in the checkpoints, training on would not" if kept else "ends updates that harm"
    return Remedy(
        action="stop",
        params={"reason": f"{what} and {reason}: {fix}; {policy} step {step}", "exit_code": GAVE_UP},
        reasoning=f"{why}; {reason}: stopping {keeps}",
    )


def no_rollback(factor: float | None, rollbacks: int, cfg: OrchestratorConfig, step: int) -> str:
    """Why an RL or DPO rule's rollback to `step` with the LR x`factor` (None: at its floor) cannot be taken,
    for its stop's reason: the LR's floor, the incident's rollbacks spent, or no checkpoint that far back."""
    if factor is None:
        return (
            f"the LR is at its floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g}), where a rollback would "
            "replay the same updates at the same LR"
        )
    if rollbacks >= cfg.max_rollbacks:
        most = cfg.max_rollbacks
        return f"{rollbacks} rollbacks used on this incident (orchestrator.max_rollbacks={most} per incident)"
    # pruned (checkpoint.keep) or never written (checkpoint.every): a rollback there would fail ("failed: ...")
    return f"no checkpoint at or before step {step} is left (a larger checkpoint.keep or a shorter checkpoint.every)"
