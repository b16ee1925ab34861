"""Rule rl_reward's test of a fall (orchestrator/rl_reward.py): the starting policy's mean group
score against the last window's, told from sampling noise honestly when the start is a few groups.

Welch's t over the windows' group means, its one-sided tail from Student's t with the
Welch-Satterthwaite degrees of freedom (Welch 1947), said as the normal z of the same tail, so
`sigmas` reads as before. The normal tail is too thin for a start of 4 groups: 4 right of 32
against 10 of 320 read z 2.6, an exact count ~1.8; and four equal group scores have a sample
variance of 0, which made any later fall look certain. For 0/1 rewards (a step's counts say so:
group_size) each window's variance of a group mean is bounded at the windows' pooled success rate
p, the rate the two share if nothing fell: at least p(1-p)/G, the binomial sampling variance of a
mean of G draws (prompts' differing difficulty only adds to it), and at most p(1-p), the largest
any score in [0, 1] can have at mean p (Bhatia & Davis 2000): a start of 18 groups at 0.056
against 300 groups of zeros is a collapse (Fisher's exact count: p ~1e-10), not the t of its own
spread (2.4 sigma at 17 degrees of freedom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

TINY = 1e-300
CERTAIN = -NormalDist().inv_cdf(TINY)  # the z of a fall with no noise seen (rewards not 0/1, every group alike)


@dataclass
class Fall:
    t: float  # Welch's t of the start's mean over the window's
    df: float  # Welch-Satterthwaite degrees of freedom
    z: float  # the normal z of t's one-sided tail (0 where no variance can be estimated)


def poisoned(rl: dict[str, Any] | None) -> bool:
    """Whether a step's rollouts came from non-finite weights: their sampled tokens' entropy reads
    NaN (or inf). Such a step is rule nonfinite's, which rolls the weights back; an RL rule must not
    read it: its groups are flat and its responses run on, and a knob turned on them outlives the
    rollback (weights_nan@17 at lr 1e-3: rl_length set the overlong penalty and rl_reward rolled
    back to step 1 with the LR x0.1 on steps 17-18 of NaN weights; rl_signal warmed the sampling)."""
    entropy = (rl or {}).get("entropy")
    return entropy is not None and not math.isfinite(entropy)


def nan_weights(view: Any) -> bool:
    """Whether the weights are not finite now (on every rank alike: every rank asks). An
    evaluation of them, between their going NaN and rule nonfinite's rollback, is no held-out reward of
    the policy: rule rl_hacking must not read it (`trimtab rl --inject weights_nan@10`, train.eval_every=5:
    step 10's evaluation, of NaN weights, read a held-out reward of 0 and went to the rule, a fall from
    any best; rule nonfinite rolled back at step 12). RunView.weights_finite, not probe_loss: the same answer
    (the probe is NaN exactly when they are not finite) without its held-out forward at every evaluation."""
    return not view.weights_finite()


def group_size(rl: dict[str, Any]) -> int:
    """Responses a group, where the step's counts are those of 0/1 rewards: every group's mean a
    count over G (the sums of G x mean and of (G x mean)^2 whole numbers), else 0 (unknown)."""
    verified = (rl.get("verifications") or (0,))[0]
    n, score, squares = rl["score_n"], rl["score"], rl["score_sq"]
    size = verified / n if n else 0.0
    if size < 1 or abs(size - round(size)) > 1e-9:
        return 0
    size = round(size)
    whole = all(abs(x - round(x)) < 1e-6 for x in (score * size, squares * size * size))
    return size if whole and 0 <= score <= n else 0


def starting_policys(own: int, steps: int, start_steps: int, step: int, first: int, staleness: float) -> bool:
    """Whether this step's rollouts are the starting policy's (`own` of the phase's `steps` seen so far were; `first`
    the phase's first step), as rule rl_reward takes its start (RewardFall._starting): synchronously the first step
    alone, rl.max_staleness eta: the first eta + 1, at most `start_steps`."""
    return own == steps < start_steps and step - staleness < first + 0.5


def start_splits(
    first: list[Any], last: list[Any], own: int, steps: int, window: int
) -> list[tuple[list[Any], list[Any]]]:
    """Starts and the steps after each (`first`: the phase's first steps' readings, `last`: its last `window`), parted
    at cuts fixed by the step count, never by the scores (which would pick the start that reads a fall): the starting
    policy's `own` steps (never a collapse's, but few), and the phase's steps before the last `window`, up to `window`
    of them (more, but a collapse inside them dilutes them). A start of the phase's first `window` steps alone made a
    collapse inside it its own baseline (rule rl_signal: 5 of 64 right a step, 0 from step 3: recognised at step 10
    at z 2.1, from step 2 never)."""
    own = max(own, 1)
    cuts = sorted({own, max(own, min(window, steps - window))})
    parts = [(first[: min(cut, len(first))], min(len(last), steps - cut)) for cut in cuts]
    return [(start, last[len(last) - after :]) for start, after in parts if start and after > 0]


def fall_test(start: list[list[float]], window: list[list[float]]) -> Fall:
    """Welch's t of the start's mean group score over the window's, steps of [groups, sum, sum of
    squares, reward, group size (0: not 0/1)]; the variances bounded at the pooled rate for 0/1 rewards."""
    (n1, m1, v1), (n2, m2, v2) = _moments(start), _moments(window)
    if n1 < 2 or n2 < 2:
        return Fall(0.0, 0.0, 0.0)
    (v1, df1), (v2, df2) = (v1, n1 - 1), (v2, n2 - 1)
    size = min((int(step[4]) if len(step) > 4 else 0) for step in start + window)
    if size:
        pooled = _moments(start + window)
        (v1, df1), (v2, df2) = (_bounded(v, df, pooled, size) for v, df in ((v1, df1), (v2, df2)))
    se1, se2 = v1 / n1, v2 / n2
    if se1 + se2 <= 0:
        return Fall(math.inf, math.inf, CERTAIN) if m1 > m2 else Fall(0.0, 0.0, 0.0)
    t = (m1 - m2) / math.sqrt(se1 + se2)
    df = (se1 + se2) ** 2 / (se1**2 / df1 + se2**2 / df2)
    tail = t_tail(t, df)
    return Fall(t, df, -NormalDist().inv_cdf(min(max(tail, TINY), 1 - 1e-16)))


def answered_groups(rl: dict[str, Any]) -> int:
    """A step's groups with a right response, for 0/1 rewards (-1: unknown): those not flat, and those all right.
    Flat is by the reward trained on, which an overlong penalty makes differ from the verifier's score."""
    if not group_size(rl) or rl.get("overlong_buffer", 0) or rl.get("solved_groups") is None:
        return -1
    return round(rl["score_n"] * (1 - rl["flat_groups"] + rl["solved_groups"]))


def collapse_z(start: list[list[float]], now: list[list[float]]) -> float:
    """The z of a collapse (every response fails) from the start's steps to now's, steps as fall_test's with the
    groups with a right response after them. Where every step says that count, Fisher's exact test of it over the
    groups (a group answers one prompt: its responses are not independent draws), which resolves a few right answers
    at the start where the t of their spread cannot (3 of 8 groups against 0 of 32: exact z 2.5, Welch's t 1.7);
    else fall_test's."""
    if all(len(step) > 5 and step[5] >= 0 for step in start + now):
        (k1, n1), (k2, n2) = ([round(sum(step[i] for step in steps)) for i in (5, 0)] for steps in (start, now))
        return exact_fall(k1, n1, k2, n2)
    return fall_test(start, now).z


def prompts_to_decide(answered: int, groups: int, after: int, per_step: int, sigmas: float) -> int:
    """The prompts a step needs so that a total collapse (none of the groups after the start answered) reads `sigmas`
    on Fisher's exact test (collapse_z) at the start's rate, `answered` of `groups` groups with a right response, the
    start and the `after` groups each scaled with the prompts; 0 where `per_step` already does, or the start answered
    none (nothing to fall from), or 64x would not. At 8 prompts x 8 responses and a pass rate of 0.05 a start of one
    step holds ~2 answered groups: 2 of 8 against 0 of 32 reads z 1.8 (4 of 16 against 0 of 64: z 3.0)."""
    if answered <= 0 or exact_fall(answered, groups, 0, after) >= sigmas:
        return 0
    scale = next((f for f in range(2, 65) if exact_fall(f * answered, f * groups, 0, f * after) >= sigmas), 0)
    return scale * per_step


def exact_fall(k1: int, n1: int, k2: int, n2: int) -> float:
    """The z of a fall from k1 of n1 to k2 of n2: Fisher's exact test, one-sided (Agresti, Categorical Data Analysis,
    3.5.1): the chance that n1 of the n1 + n2 drawn without replacement hold k1 or more of the k1 + k2, said as the
    normal z of that tail. Exact where the counts are a few groups, which the normal score test is not: 2 of 8 groups
    against 0 of 16 read z 2.1 there, an exact p of 0.10 (z 1.3)."""
    total, hits = n1 + n2, k1 + k2
    ways = sum(math.comb(hits, k) * math.comb(total - hits, n1 - k) for k in range(k1, min(hits, n1) + 1))
    tail = ways / math.comb(total, n1)
    return -NormalDist().inv_cdf(min(max(tail, TINY), 1 - 1e-16))


def _bounded(variance: float, df: float, pooled: tuple[float, float, float], size: int) -> tuple[float, float]:
    """A window's variance of a group mean of `size` 0/1 rewards between p(1-p)/size and p(1-p) at
    the pooled rate p, with its degrees of freedom. At the ceiling it is no longer the window's own
    estimate but p's: its degrees of freedom are those of p(1-p), 2 / CV^2 (Satterthwaite 1946, the
    CV by the delta method from p's standard error over every group), which rewards bunched in a few
    groups keep few (4 lucky groups of 44 are not 352 draws)."""
    n, p, spread = pooled
    ceiling = p * (1 - p)
    if variance <= ceiling:
        return max(variance, ceiling / size), df
    cv = math.sqrt(spread / n) * abs(1 - 2 * p) / max(ceiling, TINY)
    return ceiling, min(max(2 / max(cv * cv, TINY), 1.0), n - 1)


def _moments(steps: list[list[float]]) -> tuple[float, float, float]:
    """Groups, mean group score and its unbiased sample variance."""
    n, total, squares = (sum(step[k] for step in steps) for k in range(3))
    mean = total / max(n, 1)
    return n, mean, max(squares - n * mean * mean, 0.0) / max(n - 1, 1)


def t_tail(t: float, df: float) -> float:
    """P(T >= t) for Student's t with `df` degrees of freedom: I_x(df/2, 1/2) / 2 at x = df/(df + t^2)."""
    half = 0.5 * _beta_regularized(df / 2, 0.5, df / (df + t * t))
    return half if t >= 0 else 1 - half


def _beta_regularized(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function (Numerical Recipes 6.4)."""
    if x <= 0 or x >= 1:
        return max(min(x, 1.0), 0.0)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The incomplete beta's continued fraction by the modified Lentz method (Numerical Recipes 6.4)."""
    c, d = 1.0, 1 / _away(1 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 300):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for coefficient in (even, odd):
            d, c = 1 / _away(1 + coefficient * d), _away(1 + coefficient / c)
            h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return h


def _away(value: float) -> float:
    """Lentz's guard against a zero denominator."""
    return value if abs(value) > TINY else TINY


def count_fall(k1: int, n1: int, k2: int, n2: int) -> float:
    """The z of a fall from k1 of n1 to k2 of n2 solved: the two-proportion score test, its standard error at
    the pooled rate (the rate the two share if nothing fell; Agresti, Categorical Data Analysis, 3.1.3);
    0 where the pooled rate is 0 or 1 (no variance: nothing solved, or everything, in both)."""
    pooled = (k1 + k2) / (n1 + n2)
    if pooled <= 0 or pooled >= 1:
        return 0.0
    return (k1 / n1 - k2 / n2) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))


def track_curriculum(track: dict[str, Any], decision: Any, m: Any) -> None:
    """A curriculum step's (rule rl_signal's set_rl_difficulty, rl/curriculum.py) following steps: each one's flat and
    solved shares of its groups, which curriculum_outcome judges it on."""
    if decision.action == "set_rl_difficulty" and m.rl and m.rl.get("flat_groups") is not None:
        track.setdefault("curriculum", []).append([m.rl["flat_groups"], m.rl.get("solved_groups", 0.0)])


def curriculum_outcome(decision: Any, track: dict[str, Any]) -> dict[str, Any] | None:
    """A curriculum step judged on what it was for (None for any other decision): the steps after it held groups with
    a signal again (their flat share under the finding's) and solved fewer (the task is harder), whatever rule
    rl_signal said later: once the policy learns the new difficulty its groups are flat and solved again, a note or
    the next step of the curriculum, not this one's failure. `healed` and the shares before and after."""
    if decision.action != "set_rl_difficulty":
        return None
    seen, ev = track.get("curriculum") or [], decision.evidence
    if not seen:
        return {"healed": False}
    flat, solved = (sum(column) / len(seen) for column in zip(*seen))
    healed = flat < ev.get("flat_groups", 1.0) and solved < ev.get("solved_groups", 1.0)
    return {
        "healed": healed,
        "flat_groups": [ev.get("flat_groups"), flat],
        "solved_groups": [ev.get("solved_groups"), solved],
    }
