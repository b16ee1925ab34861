"""The checkpoint interval: as often as Young's optimum when failures are expected more often
than checkpoint.every allows for (Young 1974: sqrt(2 x C x M) for a save that stalls training C
seconds and a mean time between failures M). C is measured at every save (the slowest rank's
stall, agreed with the step times in Orchestrator._read), M is `mtbf_hours` or the world size at
Llama 3's failure rate (trimtab/plan/resilience.py). The interval is never longer than the
configured one: at small scale (M in thousands of hours) nothing changes; on thousands of GPUs
the rule shortens it, and journals why.

A rollback is a failure too: it throws away the steps since the checkpoint it restores, as a lost
node does. So with `rollbacks` on (the default) the run's own rollbacks count in M beside the
hardware's, 1/M = 1/M_hw + rollbacks / seconds trained (replays included), judged at once after
each. Measured (debug, 60 steps, checkpoint.every 50,
weights_nan@36): the rollback went to step 0 and replayed 38 steps of 0.83 s, a save stalled
0.08 s, and Young's interval became 2 steps (one decision); small, the same, replays 38 steps
against a 0.34 s save. A fault-free run has no rollback and keeps its interval.

The rollbacks' rate is not n / T, the maximum-likelihood estimate: from one event its spread is
as large as itself (one rollback in the first T seconds fits a rate of 0.1 / T as well as 3 / T),
and taken as the rate it made one injected weights_nan checkpoint the run every step. It is the
lower bound of the rate's one-sided 90% confidence interval for n Poisson events in T seconds
(Garwood 1936; chi2(0.1, 2n) / 2T, 0.105 / T for one event, 6.22 / T for ten, nearing n / T as
events come), the failures' rate the run has shown beyond doubt: Young's interval (Young 1974; Daly
2006 for its higher-order form, the same to first order) then shortens once evidence is strong,
and one fault shortens it only where saves are cheap beside the steps (sqrt(19 N C / step) steps
for one rollback in N steps: every step only for a save under 0.6% of a step at N = 36).

A rollback whose remedy took is no recurring failure: debug-hybrid at 30x its LR (100 steps) was
rolled back for an LR far too high (cut x0.1, "not recovered", x0.5, x0.5 "recovered") and saved
every 3 steps for the rest of the run where checkpoint.every is 20; `small`, one rollback, every
step. Once the outcome of the run's latest rollback is "recovered" (outcomes.py: no finding of its
trouble in orchestrator.outcome_after steps, the loss back) the rollbacks so far, that fault's
tries, leave the MTBF and the interval goes back to the hardware's. Another rollback after that
shows the run failing again, and all of them count again.

The rollbacks' rate comes from a few events in a short run, and it moved the interval both ways
within one checkpoint interval (debug-mod, checkpoint.every 20: 20 -> 8 -> 20 within 20 steps;
at 2-4 steps a good checkpoint came one step past each rollback). So it is held in bounds: the
rollbacks never shorten it below a quarter of checkpoint.every (ROLLBACK_FLOOR; the hardware's MTBF
alone may), and it is lengthened no sooner than checkpoint.every steps after it was shortened
(hysteresis: a remedy's "recovered" from its short outcome window is no proof that the fault is gone).

The interval is rounded to the nearest power of two steps (in log2): the save stall is measured,
so twin runs set 21 and 22 steps and kept different checkpoints (their losses the same, but a
later rollback restores different steps); a power of two moves only where stall x MTBF changes
4x, and costs at most 1.06x the optimum's overhead (stall / T + T / 2M at T = Young's x or / sqrt 2).

A person's interval (`trimtab ctl RUN checkpoint-every N`) takes checkpoint.every's place as the
bound: the rule never lengthens past it, nor moves it to the configured one. Before, the save after
a person set 3 (debug, checkpoint.every 4) set it back to 4, one step later.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Rolling
from trimtab.plan.resilience import FAILURES_PER_DEVICE_HOUR, RATE_SOURCE, young_interval

CONFIDENCE = 0.9  # the rollbacks' rate is at least the one Young's interval takes, at this confidence
ROLLBACK_FLOOR = 4  # the run's rollbacks shorten the interval to checkpoint.every / this at most (module docstring)


def poisson_rate_low(events: int, confidence: float = CONFIDENCE) -> float:
    """The lower confidence bound on the mean m of a Poisson count that came out `events` (Garwood
    1936): the m at which P(count >= events) = 1 - confidence; the rate's bound over T is this / T.
    Found by bisection, P rising with m; 0.105 for one event at 90%."""
    if events <= 0:
        return 0.0

    def at_least(m: float) -> float:  # P(count >= events) = 1 - P(count <= events - 1)
        term = total = math.exp(-m)
        for k in range(1, events):
            term *= m / k
            total += term
        return 1.0 - total

    low, high = 0.0, float(events)  # P(count >= n) at m = n is over one half: the bound lies below n
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if at_least(mid) < 1 - confidence else (low, mid)
    return (low + high) / 2


class CheckpointInterval:
    rule, family = "checkpoint_interval", "checkpoint"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.checkpoint_interval
        self.steps = Rolling(50)  # step seconds, the slowest rank's
        self.stalls = Rolling(5)  # save stalls, the slowest rank's
        self.due = False  # a save (or a rollback) not judged yet
        self.trained_s = 0.0  # wall seconds of the steps timed, replays included: the rollbacks' MTBF
        self.rollbacks = 0  # the run's rollbacks so far, failures in Young's M
        self.replayed = 0  # the steps they threw away
        self.healed = 0  # of them, those whose remedies took (outcome "recovered"): no longer failures
        self.latest: int | None = None  # the latest rollback's decision, until its outcome is judged
        self.trained = 0  # steps timed, replays included
        self.shortened_at = -1  # `trained` at its latest shortening: lengthened no sooner than an interval after
        self.person: int | None = None  # a person's interval (ctl checkpoint-every): the bound instead of the config's

    def person_set(self, steps: int) -> None:
        """A person set the interval to `steps`: the bound from now on (module docstring), their choice."""
        self.person = steps
        self.shortened_at = -1

    def rolled_back(self, replayed: int, decision: int | None = None) -> None:
        """A rollback (orchestrator decision `decision`) threw away `replayed` steps: a failure,
        judged at the next read. Rollbacks healed before count again: the run fails anew."""
        self.rollbacks += 1
        self.replayed += replayed
        self.healed = 0
        self.latest = decision
        self.due = self.due or self.cfg.rollbacks

    def judged(self, outcomes: dict[int, str]) -> None:
        """The journal's outcomes (decision id -> result): once the latest rollback's is "recovered",
        the run's rollbacks were remedied (an LR cut, data skipped), no rate of failures to expect; the
        interval is judged again, at the hardware's MTBF."""
        if self.latest is None or self.latest not in outcomes:
            return
        if outcomes[self.latest] == "recovered":
            self.healed = self.rollbacks
            self.due = self.due or self.cfg.rollbacks
        self.latest = None

    @property
    def failures(self) -> int:
        """The rollbacks that count in Young's M: none once all were healed."""
        return self.rollbacks - self.healed if self.cfg.rollbacks else 0

    def mtbf(self, world: int, hardware_only: bool = False) -> float:
        """Seconds between failures: the hardware's (mtbf_hours, or the world at Llama 3's rate) and
        the run's rollbacks over the seconds it trained, as failure rates that add."""
        hardware = self.cfg.mtbf_hours * 3600 or 3600 / (world * FAILURES_PER_DEVICE_HOUR)
        if hardware_only or not self.failures or self.trained_s <= 0:
            return hardware
        return 1 / (1 / hardware + poisson_rate_low(self.failures) / self.trained_s)

    def observe(
        self, step: int, seconds: list[float], stall_s: float, world: int, every: int, configured: int
    ) -> Finding | None:
        """Steps of `seconds` and, when one came, a save that stalled `stall_s`: the finding when
        Young's interval, in whole steps and at most `configured`, differs from the current
        `every` by more than the tolerance. Judged at each save (the first once 5 steps are timed), or
        at each rollback once the run has had one."""
        for s in seconds:
            self.steps.add(s)
            self.trained_s += s
        self.trained += len(seconds)
        configured = self.person or configured
        # once rollbacks count, judged at each rollback only: one rollback's rate falls with every second
        # trained, and judged at each save the interval crept back a step at a time (debug, weights_nan@15,
        # checkpoint.every 8: set to 2, 3, then 4 steps, three decisions in 10 steps)
        if stall_s > 0:
            self.stalls.add(stall_s)
            self.due = self.due or not (self.rollbacks and self.cfg.rollbacks)
        if not self.due or configured <= 0 or len(self.steps) < 5 or not len(self.stalls):
            return None
        self.due = False
        stall, step_s = statistics.median(self.stalls.values), statistics.median(self.steps.values)
        mtbf_s, optimum, steps = self._young(stall, step_s, world, configured)
        if abs(steps - every) <= self.cfg.tolerance * every:
            return None
        if steps > every and 0 <= self.shortened_at and self.trained - self.shortened_at < configured:
            self.due = True  # judged again at the next read, until the hysteresis passed
            return None
        self.shortened_at = self.trained if steps < every else self.shortened_at
        evidence: dict[str, Any] = {
            "save_stall_s": round(stall, 4),
            "mtbf_h": round(mtbf_s / 3600, 4),
            "mtbf_source": "orchestrator.checkpoint_interval.mtbf_hours" if self.cfg.mtbf_hours else RATE_SOURCE,
            "step_s": round(step_s, 4),
            "young_s": round(optimum, 2),
            "steps": steps,
            "was": every,
            "configured": configured,
        }
        summary = (
            f"Young's interval sqrt(2 x {stall:.3g} s save x {mtbf_s / 3600:.3g} h MTBF) = {optimum:.0f} s = "
            f"{steps} steps of {step_s:.3g} s (now every {every})"
        )
        summary += self._rollbacks_said(evidence)
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def _rollbacks_said(self, evidence: dict[str, Any]) -> str:
        """The run's rollbacks in a finding: added to its `evidence`, and the end of its summary returned."""
        if self.failures:
            trained = round(self.trained_s, 2)
            evidence |= {"rollbacks": self.rollbacks, "replayed_steps": self.replayed, "trained_s": trained}
            evidence["mtbf_source"] += " and this run's rollbacks"
            return (
                f"; the MTBF counts this run's {self.rollbacks} rollback(s) in {self.trained_s:.0f} s trained "
                f"({self.replayed} steps replayed) at their rate's {CONFIDENCE:.0%} lower confidence bound"
            )
        if self.healed:
            evidence["healed_rollbacks"] = self.healed
            # the incident's, not each one's: earlier rollbacks of it may read "not recovered", the last remedied it
            healed = f"{self.healed} rollback(s)" if self.healed > 1 else "rollback"
            return f"; this run's {healed} ended in a recovery (the last one's outcome): no failure to expect"
        return ""

    def _young(self, stall: float, step_s: float, world: int, configured: int) -> tuple[float, float, int]:
        """The MTBF, Young's interval in seconds, and in whole steps: no shorter for the rollbacks than
        ROLLBACK_FLOOR allows, unless the hardware's MTBF alone asks for less."""
        mtbf_s = self.mtbf(world)
        optimum = young_interval(stall, mtbf_s)
        steps = power_of_two(optimum / max(step_s, 1e-9), configured)
        if self.failures:
            alone = young_interval(stall, self.mtbf(world, hardware_only=True)) / max(step_s, 1e-9)
            steps = max(
                steps, min(power_of_two(alone, configured), power_of_two(configured / ROLLBACK_FLOOR, configured))
            )
        return mtbf_s, optimum, steps

    def state_dict(self) -> dict[str, Any]:
        """The rollbacks and the seconds trained: a resumed run keeps its failures' rate."""
        kept = {
            "healed": self.healed,
            "latest": self.latest,
            "shortened_at": self.shortened_at,
            "trained": self.trained,
            "person": self.person,
        }
        return {"trained_s": self.trained_s, "rollbacks": self.rollbacks, "replayed": self.replayed, **kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained_s, self.rollbacks, self.replayed = state["trained_s"], state["rollbacks"], state["replayed"]
        # checkpoints written before healed rollbacks were told apart hold neither: all their rollbacks count
        self.healed, self.latest = state.get("healed", 0), state.get("latest")
        self.shortened_at, self.trained = state.get("shortened_at", -1), state.get("trained", 0)
        self.person = state.get("person")


def power_of_two(steps: float, configured: int) -> int:
    """`steps` rounded to the nearest power of two in log2, at least 1 and at most `configured` (the
    module's docstring: a measured stall a little off does not move it)."""
    return min(configured, 2 ** max(0, round(math.log2(max(steps, 1.0)))))
