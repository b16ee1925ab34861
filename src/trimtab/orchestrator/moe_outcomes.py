"""A Mixture-of-Experts decision's outcome read on its layer's load (outcomes.py judges the rest).

The moe rule clears its windows when it fires, so its trouble cannot come back as a finding within
`outcome_after` steps: the load of the layer a decision acted on says whether it healed (healed),
against the bar its finding crossed. A balance coefficient raise whose layer's load is still falling
toward the bar is judged later (settling), on the load of its latest `outcome_after` steps, and so is a
router reset whose layer is out of its collapse, its load falling.
"""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import MoERule
from trimtab.orchestrator.journal import Decision
from trimtab.orchestrator.monitors import Finding, StepMetrics


class MoELoad:
    """The bars a MoE layer's load is judged by (orchestrator.moe), over a decision's latest
    `outcome_after` steps."""

    def __init__(self, moe: MoERule, outcome_after: int) -> None:
        self.moe, self.outcome_after = moe, outcome_after

    def healed(self, d: Decision, load: list[list[float]] | None) -> dict[str, Any]:
        """A MoE layer's load after a decision on it, against the bar its finding crossed: the mean
        busiest-expert load (x fair share) and dropped fraction of the steps since, and whether they
        are back under it ("healed"); a re-initialised expert's load, back over `dead_load`. The rule
        clears its windows when it fires, so an imbalance or drop finding cannot come back within
        `outcome_after` steps (a dead one within `dead_patience`): "no finding since" alone judged a
        balance raise that left layer 3 at 3.1-3.3x its fair share (~50% dropped) "recovered"
        (debug-moe, 4 experts top-1, balance_coef 0, router_temperature 0.1, step 100)."""
        kind = d.evidence.get("kind") if d.family.startswith("moe/") else None
        if kind == "dead" and d.action != "reinit_expert":  # pruned: no expert left to measure
            return {}
        if not load or kind not in ("collapse", "imbalance", "saturated", "drop", "dead"):
            return {}
        load = load[-self.outcome_after :]  # the latest steps: a balance raise judged later (settling) on where it got
        ratio = sum(row[0] for row in load) / len(load)
        dropped = sum(row[1] for row in load) / len(load)
        n_over_k = load[-1][2]  # the most one expert can take, x fair share (n_experts / top_k)
        if kind == "dead":  # dead_patience (30) > outcome_after: only its load says it took traffic again
            revived = sum(row[3] for row in load) / len(load)
            return {"expert_load_after": round(revived, 4), "healed": revived >= self.moe.dead_load}
        healed = dropped <= self.moe.max_drop if kind == "drop" else ratio <= self._bar(n_over_k)
        found = {"max_load_after": round(ratio, 4), "dropped_after": round(dropped, 4), "healed": healed}
        if d.action == "reset_router":  # what the collapse was, and where the layer's load is going (settling)
            slope = _slope(tuple(row[0] for row in load))
            found |= {"max_load_before": d.evidence.get("max_load")}
            found |= {} if slope is None else {"load_per_step": round(slope[0], 4)}
        return found

    def _bar(self, n_over_k: float) -> float:
        """The busiest expert's load (x fair share) a balance finding's layer is healed under: the
        lowest the rule answers, its imbalance bar (a layer's own collapse bar, 0.9 x n_experts /
        top_k, where that is lower). A collapse judged at its own bar, 3.6x on debug-moe, had its
        reset_router "recovered" at 3.0-3.2x, an imbalance to the rule (expert_collapse@6, seeds 3, 20)."""
        return min(self.moe.imbalance, self.moe.collapse * n_over_k)

    def settling(self, d: Decision, track: dict[str, Any], healed: bool) -> bool:
        """Whether a balance raise's verdict waits: its layer's load not yet back under the bar but
        falling toward it fast enough to get there within 4 of the rule's windows of the decision (the
        span in which moe_health counts an earlier balance finding as a raise that did not hold). The
        balance loss moves the router by gradient, over tens of steps: judged after 20, a raise whose
        layer went 3.1x -> 2.3x over them (mean 2.9x) was "not recovered", and the layer settled at
        ~1.6x later (debug-moe, 4 experts top-1, balance_coef 0, router_temperature 0.1, step 40);
        that verdict lowered the raise's track record for the decisions after it. A router reset's verdict
        waits while its layer is out of the collapse it answered (under the collapse bar) and its load
        falls at all: the reset re-centres the scores at once, and the balance loss spreads them over tens of steps.
        Judged after 20, debug-moe's resets (expert_collapse@6, seed 0) read "not recovered" at 3.0x and
        3.3x (one layer's fall 1.3 standard errors of its slope, its steps 4.0x to 2.6x), both layers at
        ~2x 20 steps later and val 4.67 at step 60 against 4.89 advised (collapsed at 4.0x to the end)."""
        if healed or track["findings"] or len(track["losses"]) >= 4 * self.moe.window:
            return False
        if d.action not in ("set_balance_coef", "reset_router"):
            return False
        load = track["load"][-self.outcome_after :]  # not healed: a load was tracked (healed)
        ratios, n_over_k = tuple(row[0] for row in load), load[-1][2]
        if d.action == "reset_router":
            slope = _slope(ratios)
            return sum(ratios) / len(ratios) < self.moe.collapse * n_over_k and slope is not None and slope[0] < 0
        return _reaches(ratios, self._bar(n_over_k), 4 * self.moe.window - len(track["losses"]))


def track_load(track: dict[str, Any], decision: Decision, m: StepMetrics) -> None:
    """The load of the MoE layer a decision of the `moe` rule acted on, at this step:
    [busiest expert's load x fair share, dropped fraction, n_experts / top_k, a re-initialised
    expert's load x fair share]."""
    if decision.rule != "moe" or not m.moe or m.skipped:  # a withheld step says nothing of the router (moe_health)
        return
    for layer, share, dropped, top_k in m.moe:
        if layer == decision.evidence.get("layer") and share:
            expert = decision.params.get("expert") if decision.action == "reinit_expert" else None
            revived = share[expert] * len(share) if expert is not None and expert < len(share) else 0.0
            track.setdefault("load", []).append([max(share) * len(share), dropped, len(share) / top_k, revived])


def _reaches(ratios: tuple[float, ...], bar: float, left: int) -> bool:
    """Whether the least-squares line through `ratios` (one a step) falls, by more than 2 standard
    errors of its slope, and reaches `bar` within `left` more steps: a load's per-step noise (a
    busiest expert's share moves +-0.2x step to step) is no trend to wait for."""
    fit = _slope(ratios)
    if fit is None or fit[0] >= -2 * fit[1]:
        return False
    slope, mean = fit[0], sum(ratios) / len(ratios)
    now = mean + slope * (len(ratios) - 1) / 2  # the line at the newest step
    return (now - bar) / -slope <= left


def _slope(ratios: tuple[float, ...]) -> tuple[float, float] | None:
    """The least-squares slope of `ratios` (one a step) and its standard error (None: under 3 points)."""
    n = len(ratios)
    if n < 3:
        return None
    mid, mean = (n - 1) / 2, sum(ratios) / n
    sxx = sum((x - mid) ** 2 for x in range(n))
    slope = sum((x - mid) * (y - mean) for x, y in enumerate(ratios)) / sxx
    residual = sum((y - mean - slope * (x - mid)) ** 2 for x, y in enumerate(ratios)) / (n - 2)
    return slope, math.sqrt(residual / sxx)


def older(f: Finding, followed: int) -> bool:
    """Whether finding f names a dead expert that was starving already when the decision was taken,
    `followed` steps ago: trouble from before it is no evidence it failed (the dead-expert rule answers
    it, with its own decision). A collapse's balance raise at step 20 was "not recovered" for expert 2
    found dead at 40, starved since step 10, its layer's load back under the bar (debug-moe, 4 experts
    top-1, balance_coef 0, router_temperature 0.1, seed 1). A withheld step is no starved step
    (moe_health), so the count errs toward the decision's failure."""
    return f.evidence.get("kind") == "dead" and f.evidence.get("starved_steps", 0) > followed
