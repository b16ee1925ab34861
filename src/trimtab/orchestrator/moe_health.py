"""Mixture-of-Experts health: a monitor over each MoE layer's router load, and its remedies.

The monitor keeps, per layer, the mean share of assignments each expert got over the last
`window` steps and how long each expert has been starved. One finding per step at most, the most
serious first: collapse, a dead expert, saturation (when growing is allowed), imbalance, drops.
Remedies (policy): imbalance -> a larger balance coefficient (Switch / GShard auxiliary loss),
a dead expert -> re-initialised (pruned if it dies again and prune_dead is on), dropped tokens ->
a larger capacity factor, saturation -> a new expert split from the busiest.

Collapse climbs per layer: the first time, the balance coefficient x4; when the layer had a
balance finding (imbalance or collapse) in the last 4 windows already, that raise did not hold
and the router is reset (`reset_router`): the busiest expert's router row and selection bias go
to the others' mean. The balance loss acts on router probabilities only: a saturated softmax
passes it almost no gradient (d/dz ~ p(1 - p)) and the selection bias (expert_bias, DeepSeek-V3's
aux-loss-free balancing) none at all, so only re-centring the scores makes top-k spread again.
A recurrence after a finding is also what the journal judges "not recovered" (same family).
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.policy import Plan


class MoEHealth(Monitor):
    rule, family = "moe", "moe"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.moe
        self.loads: dict[str, list[list[float]]] = {}  # layer -> last `window` load shares
        self.drops: dict[str, list[float]] = {}
        self.starved: dict[str, list[int]] = {}  # layer -> consecutive starved steps per expert
        self.revived: dict[str, list[int]] = {}  # layer -> experts re-initialised once already
        self.strikes: dict[str, list[int]] = {}  # layer -> steps of its imbalance / collapse findings

    def observe(self, m: StepMetrics) -> Finding | None:
        findings = []
        for layer, share, dropped, top_k in m.moe or ():
            key = str(layer)
            if len(self.starved.get(key, [])) != len(share):  # first step, or surgery changed E
                self.loads[key], self.drops[key], self.starved[key] = [], [], [0] * len(share)
            self.loads[key] = (self.loads[key] + [share])[-self.cfg.window :]
            self.drops[key] = (self.drops[key] + [dropped])[-self.cfg.window :]
            fair = 1.0 / len(share)
            self.starved[key] = [
                n + 1 if s < self.cfg.dead_load * fair else 0 for n, s in zip(self.starved[key], share)
            ]
            if len(self.loads[key]) == self.cfg.window:
                findings.append(self._check(m, layer, top_k))
        found = sorted((f for f in findings if f), key=lambda f: -f.strength)
        if found:  # the other layers' windows keep sliding: they report on a later step
            self._commit(found[0])
        return found[0] if found else None

    def _recent(self, key: str, step: int) -> list[int]:
        return [s for s in self.strikes.get(key, []) if step - s <= 4 * self.cfg.window]

    def _commit(self, f: Finding) -> None:
        """State changes for the one finding reported (not for those dropped this step)."""
        key, kind = str(f.evidence["layer"]), f.evidence["kind"]
        self.loads[key], self.drops[key] = [], []  # a fresh window before this layer fires again
        if kind == "dead":
            self.starved[key][f.evidence["expert"]] = 0
            self.revived.setdefault(key, []).append(f.evidence["expert"])
        elif kind in ("imbalance", "collapse"):
            self.strikes[key] = self._recent(key, f.step) + [f.step]

    def _check(self, m: StepMetrics, layer: int, top_k: int) -> Finding | None:
        key, cfg = str(layer), self.cfg
        loads = self.loads[key]
        mean = [sum(col) / len(loads) for col in zip(*loads)]
        n, busiest = len(mean), max(range(len(mean)), key=lambda e: mean[e])
        ratio, drop = mean[busiest] * n, sum(self.drops[key]) / len(self.drops[key])
        dead = [e for e, c in enumerate(self.starved[key]) if c >= cfg.dead_patience]
        evidence = {
            "layer": layer,
            "busiest": busiest,
            "max_load": ratio,
            "dropped": drop,
            "shares": [round(s, 4) for s in mean],
        }
        if mean[busiest] >= cfg.collapse / top_k:
            kind, summary, strength = (
                "collapse",
                f"layer {layer}: expert {busiest} takes {mean[busiest]:.0%} "
                f"of assignments (at most {1 / top_k:.0%} possible)",
                1.0,
            )
            evidence["strikes"] = len(self._recent(key, m.step))  # earlier balance findings
        elif dead:
            kind, strength = "dead", 0.9
            summary = (
                f"layer {layer}: expert {dead[0]} got < {cfg.dead_load:.0%} of its fair share for "
                f"{cfg.dead_patience} steps"
            )
            evidence["expert"] = dead[0]
            evidence["revived_before"] = dead[0] in self.revived.get(key, [])
        elif cfg.add_experts and ratio > cfg.imbalance and drop > 0 and n < cfg.max_experts:
            kind, strength = "saturated", 0.7
            summary = f"layer {layer}: expert {busiest} at {ratio:.1f}x its fair share with {drop:.0%} dropped"
        elif ratio > cfg.imbalance:
            kind, strength = "imbalance", min(1.0, 0.5 + 0.5 * (ratio - cfg.imbalance) / cfg.imbalance)
            summary = f"layer {layer}: expert {busiest} at {ratio:.1f}x its fair share (> {cfg.imbalance:g})"
        elif drop > cfg.max_drop:
            kind, strength = "drop", min(1.0, 0.5 + drop)
            summary = f"layer {layer}: {drop:.0%} of assignments dropped (> {cfg.max_drop:.0%})"
        else:
            return None
        finding = self.finding(m, {"kind": kind, **evidence}, summary, strength)
        finding.family = f"moe/{layer}"  # outcomes are judged per layer
        return finding


def plan_moe(f: Finding, view: Any, cfg: OrchestratorConfig) -> Plan:
    """The remedy for a MoEHealth finding; `view` is the trainer's Control."""
    rule, layer, kind = cfg.moe, f.evidence["layer"], f.evidence["kind"]
    knobs = view.moe_knobs(layer)
    if kind == "dead":
        expert = f.evidence["expert"]
        if f.evidence["revived_before"] and rule.prune_dead and knobs["n_experts"] > knobs["top_k"]:
            return Plan(
                "prune_expert",
                {"layer": layer, "expert": expert},
                "the expert died again after a re-init: it only costs memory, so it goes",
            )
        return Plan(
            "reinit_expert",
            {"layer": layer, "expert": expert},
            "a dead expert is wasted capacity: fresh weights and a router row at the mean of the "
            "others give it traffic again (its optimizer moments restart from zero)",
        )
    if kind == "saturated":
        return Plan(
            "add_expert",
            {"layer": layer, "source": f.evidence["busiest"]},
            "the busiest expert is saturated and tokens are dropped: split it in two "
            "(orchestrator.moe.add_experts is on)",
        )
    if kind == "drop":
        if not knobs["capacity_factor"] or knobs["capacity_factor"] * 1.25 > rule.max_capacity:
            return Plan(
                "none",
                {},
                "tokens are dropped but the capacity factor is at its limit "
                "(orchestrator.moe.max_capacity); logged for a person",
            )
        return Plan(
            "adjust_capacity_factor",
            {"value": knobs["capacity_factor"] * 1.25, "layer": layer},
            "dropped tokens skip the expert layer: a larger capacity keeps them, at some compute",
        )
    coef = knobs["aux_loss_coef"]
    target = min(rule.max_balance_coef, max(coef * (4 if kind == "collapse" else 2), 1e-3))
    if kind == "collapse" and (f.evidence["strikes"] or target <= coef):
        expert = f.evidence["busiest"]
        return Plan(
            "reset_router",
            {"layer": layer, "expert": expert},
            f"the layer is collapsed onto expert {expert} after {f.evidence['strikes']} earlier balance "
            f"finding(s) in {4 * rule.window} steps (or the balance coefficient is at its limit): that "
            "loss moves router probabilities only, a saturated softmax passes it almost no gradient and "
            "the selection bias none, so re-centre the expert's router row and selection bias on the "
            "others' mean (its weights stay) and restart the row's AdamW moments",
        )
    if target <= coef:
        return Plan(
            "none",
            {},
            f"the load is {kind}d but the balance coefficient is at its limit "
            "(orchestrator.moe.max_balance_coef); logged for a person",
        )
    return Plan(
        "adjust_balance_coefficient",
        {"value": target, "layer": layer},
        "a stronger load-balancing loss pushes the router to spread tokens (Switch, GShard)"
        + ("; a collapse gets a 4x step" if kind == "collapse" else ""),
    )
