"""RL's verifier watched (rule rl_verifier, docs/rl.md): verifications that time out, raise or
lose their process leave their responses without a reward (rl/step.py fill_failed). Timeouts from
a slow but sound verifier: a longer limit; from one that hangs on some responses (the verdicts
given came fast): the limit stays, said for a person; errors: a broken verifier, said, and the run
stopped where nearly every verification raised."""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.remedies import Remedy
from trimtab.orchestrator.rl_stats import poisoned
from trimtab.training.state import GAVE_UP

# verifications that finished all within this share of the limit while others ran past it: those
# hang, not a slow verifier (a sound one's times spread up to the limit: 0.25 s under 0.1 s, none finished)
HANG_SHARE = 0.25


class VerifierFailures(Monitor):
    """Verifications that fail (time out, raise, or lose their process) leave their responses
    without a reward (rl/step.py fill_failed: no advantage): past `threshold` of a window's
    verifications, much of the step teaches nothing for the verifier's fault. Evidence: the
    window's counts by kind, its last error (what the verifier raised, as the worker caught it)
    and the longest verification that gave its verdict, which tells a verifier too slow for its
    limit from one that hangs on some responses."""

    rule, family = "rl_verifier", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_verifier
        self.window: list[tuple[int, int, int]] = []
        self.slowest: list[float] = []  # each step's of the window (seconds)
        self.error = ""

    def observe(self, m: StepMetrics) -> Finding | None:
        if (counts := (m.rl or {}).get("verifications")) is None or poisoned(m.rl):
            return None
        self.window = [*self.window, counts][-self.cfg.window :]
        self.slowest = [*self.slowest, m.rl.get("slowest_verification", -1.0)][-self.cfg.window :]
        self.error = m.rl.get("verifier_error") or self.error
        scored, failed, timeouts = (sum(column) for column in zip(*self.window))
        share = failed / max(scored, 1)
        if len(self.window) < self.cfg.window or share < self.cfg.threshold:
            return None
        self.window, slowest, self.slowest = [], max(self.slowest), []  # a fresh window after the remedy
        evidence = {"failed": failed, "timeouts": timeouts, "scored": scored, "share": share, "window": self.cfg.window}
        if failed < scored and slowest >= 0:  # some gave their verdict (-1: an older checkpoint's batches)
            evidence["slowest_s"] = round(slowest, 4)
        if failed > timeouts:
            evidence["error"], self.error = self.error, ""
        summary = (
            f"{failed} of the {scored} verifications of the last {self.cfg.window} steps failed ({share:.0%}; "
            f"{timeouts} timed out; threshold {self.cfg.threshold:.0%}): each left without a reward (no advantage)"
        )
        strength = 0.5 + 0.5 * (share - self.cfg.threshold) / max(1 - self.cfg.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))


def verifier_remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Timeouts: the verifier needs longer (a slow check, a loaded machine), up to the ceiling.
    Errors: the verifier is broken, which no knob of the run mends: said for a person, and where
    nearly every verification raised (stop_share), the run stops: no response can earn a reward,
    and the steps would train on the verifier's zeros."""
    rule, now, e = cfg.rl_verifier, view.rl_verifier_timeout, f.evidence
    if e["timeouts"] * 2 < e["failed"]:
        errors, said = e["failed"] - e["timeouts"], f" (the last: {e['error']})" if e.get("error") else ""
        first = f.step - e["window"] + 1
        again = f"train on from a checkpoint before step {first}" if first > 1 else "start the run again"
        fix = f"fix rl.reward's verifier{said}, then {again}"
        if errors >= rule.stop_share * e["scored"]:
            return Remedy(
                action="stop",
                params={
                    "reason": f"rl.reward's verifier failed on {errors} of the {e['scored']} verifications of "
                    f"the last {e['window']} steps: {fix}",
                    "exit_code": GAVE_UP,
                },
                reasoning=f"the verifier raised (or its process died) on {errors / max(e['scored'], 1):.0%} of the "
                f"verifications (orchestrator.rl_verifier.stop_share {rule.stop_share:.0%}): no response "
                "earns a reward whatever it says, so the policy has nothing to learn",
            )
        return Remedy(
            action="none",
            reasoning=f"the verifier raised (or its process died) on most of the failures: their responses "
            f"teach nothing (no reward, no advantage) for the verifier's fault, not theirs; {fix}",
        )
    slowest = e.get("slowest_s")
    if slowest is not None and slowest < now * HANG_SHARE:
        return Remedy(
            action="none",
            reasoning=f"the verifications that gave their verdict took {slowest:.3g} s at most, under "
            f"{HANG_SHARE:.0%} of rl.verifier_timeout_s ({now:g} s): the ones past it hang on their responses (a "
            "loop, a blocking call), which a longer limit would only wait longer for; bound the verifier on such "
            "responses (rl.reward); the limit stays",
        )
    value = round(min(rule.max_timeout_s, now * rule.factor), 3)
    if value <= now:
        return Remedy(
            action="none",
            reasoning=f"verifications still time out at orchestrator.rl_verifier.max_timeout_s ({now:g} s): the "
            "verifier hangs on these responses (a loop, a blocking call); bound it, or raise the ceiling",
        )
    return Remedy(
        action="set_verifier_timeout",
        params={"value": value},
        reasoning=f"verifications ran past rl.verifier_timeout_s and taught nothing: allow longer ({now:g} -> "
        f"{value:g} s) so a slow but sound verification gives its verdict",
    )
