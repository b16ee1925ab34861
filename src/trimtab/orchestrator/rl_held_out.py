"""RL's held-out watch (rule rl_hacking, docs/rl.md): the training reward parting from the held-out one
(reward hacking, or overfitting to the training prompts), and the held-out reward's own fall; its remedies
are rl_remedies.py's. The other RL monitors: rl_health.py."""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.rl_stats import count_fall, poisoned


class RewardHacking(Monitor):
    """At each RL evaluation: the held-out reward against its best so far, and the training
    reward of the last `window` steps against its level at that best. Fallen by `drop` or more
    while the training reward rose by `rise` or more, for `patience` evaluations in a row: the
    policy learns what the verifier pays for on the training prompts, not the task (reward
    hacking; or overfitting to the training prompts, which the same sign shows). A drop under the
    held-out set's own noise is not counted: with n prompts, pass@1's standard error is
    sqrt(p (1 - p) / n), so `drop` should stand well above it (0.1: two errors at n = 100).

    The held-out reward's own fall is judged too, whatever the training reward did (_fall): an LR far
    too high collapses both, and a training reward too low to resolve its fall (rule rl_reward) left
    held-out pass@1 to go 14/100 -> 0/100 unanswered. Its reference is the pooled count of the evaluations
    before the fall (the baseline: the last `baseline_readings` in control), not the best one: the best of many
    noisy readings stands above the policy's rate, and two readings in a row 3 errors under it fired in 33% of
    simulated flat runs of 200 evaluations (n = 100, p = 0.14). The fall is sequential (_falling, a CUSUM): its
    readings are pooled, and a pool of `patience` or more readings `min_fall` and `sigmas` standard
    errors below the baseline fires, so a fall whose single readings straddle the bar is caught (14 -> 4, 4, 2 of 100:
    2.5, 2.5, 3.1 errors each, never two in a row at 3; pooled, 3.9 at the third)."""

    rule, family = "rl_hacking", "rl"
    # Orchestrator.on_rollback keeps the best count over the checkpoint's: the rollback's target is that reading's
    # policy, and the step-0 evaluation is not taken again (restored without it, the replay at half the LR read
    # 4/100 as its best, and 1/100 and 2/100 after it as within the noise, on the arithmetic run of _falling). A
    # fall's readings (run, pending, cusum) are the checkpoint's: those since were of weights the rollback threw
    # away, and kept they were pooled with the replay's first reading (x30 the LR: 1/200, then 17/200 at the cut
    # LR) as a fall of 2 evaluations, which stopped a replay on one reading of its own (50/200 would have too).
    # The hacking test's best is kept as `top` is: restored without step 0's, the replay's first reading became the
    # best, and a replay that read 0/16 from its first evaluation (10/16 at step 0) hacked on to a training reward of
    # 1.0 through step 48 unfound (starts_with_space against no_space, tests/test_rl_train.py's run)
    KEPT_ON_ROLLBACK = ("top", "base", "readings", "best", "best_step", "train_at_best")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_hacking
        self.recent: list[float] = []  # the training reward of the last steps
        self.best: float | None = None
        # the training reward at the best evaluation: the `window` steps before it, or where it had none (the
        # starting policy's evaluation at step 0) the `window` steps after it (`after`), never a 0 it did not earn
        self.train_at_best: float | None = None
        self.after: list[float] = []
        self.best_step, self.since, self.fired = 0, 0, 0
        # the held-out reading of the most problems solved so far, [solved, of n, step] (the rollback's target); the
        # pooled count of the readings before the fall, [solved, of n] (its baseline); and the fall's readings in a
        # row, pooled, [solved, of n, readings] (_falling)
        self.top: list[int] = []
        self.base: list[int] = []
        self.run: list[int] = [0, 0, 0]
        # the baseline's readings, [solved, of n] each, and the fall's (pending: they join it if it does not go on);
        # Page's CUSUM of the readings' z below the baseline (_falling)
        self.readings: list[list[int]] = []
        self.pending: list[list[int]] = []
        self.cusum = 0.0
        # the fall pooled at this pass's last finding, [solved, of n]; and the fall a rollback threw away (a fall in
        # progress, else that finding's): the held-out count at the LR before the rollback's cut, which the next
        # finding's decision sets against its own (rl_remedies._fall_again)
        self.found: list[int] = []
        self.undone: list[int] = []

    def observe(self, m: StepMetrics) -> Finding | None:
        if (reward := (m.rl or {}).get("reward")) is not None and not poisoned(m.rl):
            self.recent = [*self.recent, reward][-self.cfg.window :]
            if self.best is not None and self.train_at_best is None:
                self.after = [*self.after, reward][: self.cfg.window]
        return None  # judged at evaluations (observe_eval)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A rollback restores the windows, not what was decided (`fired`: the findings' count goes on), and keeps
        the fall it threw away (`undone`)."""
        fired, undone = self.fired, self.run[:2] if self.run[2] else self.found
        super().load_state_dict(state)
        self.fired = max(self.fired, fired)
        # a rollback threw away a fall's weights (a fresh monitor, resumed, has none: the checkpoint's stands)
        self.undone, self.found = list(undone or self.undone), []

    def observe_eval(self, step: int, phase: int, held_out: float, solved: int = 0, n: int = 0) -> Finding | None:
        """`solved` of `n` held-out problems at full reward (pass@1's count; n 0: unknown, no count judged)."""
        train = _mean(self.recent)
        z = self._falling(step, solved, n)
        # both at once: the training reward rising is the finer diagnosis (hacking), the remedy the same
        if (hacked := self._hacking(step, held_out, train)) is not None:
            self.run, self.pending, self.cusum = [0, 0, 0], [], 0.0
            return hacked
        return None if z is None else self._fall(step, held_out, solved, n, train, z)

    def _hacking(self, step: int, held_out: float, train: float | None) -> Finding | None:
        """The held-out reward fallen `drop` from its best as the training reward rose `rise`, `patience` in a row.
        A best with no training reward before it (step 0's) is measured by the steps after it: read as 0, any
        collapse whose training reward stayed at 0.05 or more read as a rise, hacking (a rollback at x0.5, not x0.1)."""
        rule = self.cfg
        if self.best is None or held_out > self.best:
            self.best, self.best_step, self.train_at_best, self.after, self.since = held_out, step, train, [], 0
            return None
        if self.train_at_best is None:
            self.train_at_best = _mean(self.after)
        if self.train_at_best is None or train is None:
            return None
        fallen, rose = self.best - held_out, train - self.train_at_best
        self.since = self.since + 1 if fallen >= rule.drop and rose >= rule.rise else 0
        if self.since < rule.patience:
            return None
        self.since, self.fired = 0, self.fired + 1
        evidence = {
            "held_out_reward": held_out,
            "best_held_out_reward": self.best,
            "best_step": self.best_step,
            "train_reward": train,
            "train_reward_at_best": self.train_at_best,
            "evaluations": rule.patience,
            "times": self.fired,
        }
        summary = (
            f"the held-out reward fell from {self.best:.3f} (step {self.best_step}) to {held_out:.3f} while the "
            f"training reward rose from {self.train_at_best:.3f} to {train:.3f}, {rule.patience} evaluations in "
            "a row: the policy learns what the verifier pays for on the training prompts, not the task"
        )
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def _falling(self, step: int, solved: int, n: int) -> float | None:
        """The held-out count's own fall (docs/rl.md), whatever the training reward did; its z, else None. An LR far
        too high collapses both, and the training reward's fall alone can be too small to resolve: at lr 1e-3 on
        the arithmetic task it went 0.043 -> 0.01 (rule rl_reward: the start's 23 groups "too few to tell") while
        held-out pass@1 went 14/100 -> 0/100. Each reading's z below the baseline (count_fall) feeds Page's one-sided
        CUSUM (Biometrika 1954), S = max(0, S + z - `start_sigmas`): the readings while S > 0 are the fall's, kept
        out of the baseline and pooled, and a pool of `patience` or more readings `min_fall` and `sigmas` standard
        errors below the baseline fires. The baseline is the last `baseline_readings` readings in control, so it
        follows a policy that improved (a fall 0.6 -> 0.45 after a gain 0.3 -> 0.6 was judged against both levels
        pooled, 0.45, and never fired); where a reading had to stand `start_sigmas` (2) below it to start a fall,
        the first readings of a slow decline joined it, which sank with the decline (docs/rl.md: the delays)."""
        rule = self.cfg
        if n <= 0:  # an older caller's reading, without its count
            return None
        if not self.top or solved * self.top[1] > self.top[0] * n:
            self.top = [solved, n, step]
        if self.base:
            z = count_fall(self.base[0], self.base[1], solved, n)
            self.cusum = max(0.0, self.cusum + z - rule.start_sigmas)
            if self.cusum > 0:
                self.pending = [*self.pending, [solved, n]]
                self.run = [self.run[0] + solved, self.run[1] + n, self.run[2] + 1]
                z = count_fall(self.base[0], self.base[1], self.run[0], self.run[1])
                fallen = self.base[0] / self.base[1] - self.run[0] / self.run[1] >= rule.min_fall and z >= rule.sigmas
                return z if fallen and self.run[2] >= rule.patience else None
        # in control: the readings of a fall that did not go on measured the policy's rate too
        kept = self.readings or ([self.base] if self.base else [])  # an older state's baseline: its readings pooled
        readings = [*kept, *self.pending, [solved, n]][-rule.baseline_readings :]
        self.readings, self.pending, self.run = readings, [], [0, 0, 0]
        self.base = [sum(r[0] for r in readings), sum(r[1] for r in readings)]
        return None

    def _fall(self, step: int, held_out: float, solved: int, n: int, train: float | None, z: float) -> Finding:
        """The finding of the held-out count's fall (_falling), its evidence the two counts and the z."""
        rule, (best, of, at), (k, m), (pooled, pooled_n, readings) = self.cfg, self.top, self.base, self.run
        self.run, self.pending, self.since, self.fired, self.cusum = [0, 0, 0], [], 0, self.fired + 1, 0.0
        self.found = [pooled, pooled_n]
        evidence = {
            "kind": "held_out_fall",
            "held_out_solved": solved,
            "held_out_n": n,
            "fall_solved": pooled,  # the fall's readings pooled (_falling), against the baseline's
            "fall_n": pooled_n,
            "baseline_solved": k,
            "baseline_n": m,
            "best_solved": best,
            "best_n": of,
            "best_step": at,  # the rollback's target (_hacking_remedy)
            "z": z,
            "held_out_reward": held_out,
            "train_reward": train,
            "evaluations": readings,
            "times": self.fired,
        }
        if self.undone:  # the fall the last rollback threw away, at the LR before its cut: did the cut help?
            evidence |= {"undone_solved": self.undone[0], "undone_n": self.undone[1]}
        summary = (
            f"held-out pass@1 fell to {pooled}/{pooled_n} over the last {readings} evaluations (the latest "
            f"{solved}/{n}) from {k}/{m} before them (best {best}/{of} at step {at}), {z:.1f} standard errors "
            f"(threshold {rule.sigmas:g}), with the training reward at {'?' if train is None else f'{train:.3f}'}: "
            "the updates make the policy worse at the task"
        )
        strength = min(1.0, 0.5 + 0.5 * (z - rule.sigmas) / rule.sigmas)
        return Finding(
            rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=strength
        )


def _mean(rewards: list[float]) -> float | None:
    """The rewards' mean (None: none measured)."""
    return sum(rewards) / len(rewards) if rewards else None


def held_out_counts(metrics: dict[str, Any]) -> dict[str, int]:
    """An RL evaluation's problems solved and its problems (rl/batches.py, evaluate), for rule rl_hacking's
    test of a fall; {} where the evaluation has no count (an older run's figures)."""
    n = int(metrics.get("rl/held_out_n", 0))
    if n <= 0 or "rl/held_out_pass@1" not in metrics:
        return {}
    return {"solved": round(metrics["rl/held_out_pass@1"] * n), "n": n}
