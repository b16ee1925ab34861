"""Mixture-of-Experts health: a monitor over each MoE layer's router load (its remedies are in
remedies.py).

The monitor keeps, per layer, the mean share of assignments each expert got over the last
`window` steps and how long each expert has been starved. One finding per step at most, the most
serious first: collapse, a dead expert, saturation (when growing is allowed), imbalance, drops.
Remedies (remedies.moe): imbalance -> a larger balance coefficient (Switch / GShard auxiliary loss),
a dead expert -> re-initialised (pruned if it dies again and prune_dead is on), dropped tokens ->
a larger capacity factor, saturation -> a new expert split from the busiest.

Imbalance within `grace_steps` is answered only when stuck (no lower than a window ago).
Collapse climbs per layer: the first time, the balance coefficient x4; when the layer had a balance
finding (imbalance or collapse) in the last 4 windows already, that raise did not hold (judged over
a full window after it: _total_collapse) and the router is reset (`reset_router`): the busiest
expert's router row and selection bias go to the others' mean. The balance loss acts on router
probabilities only: a saturated softmax passes it almost no gradient (d/dz ~ p(1 - p)) and the
selection bias (expert_bias, DeepSeek-V3's aux-loss-free balancing) none at all, so only re-centring
the scores makes top-k spread again.
A recurrence after a finding is also what the journal judges "not recovered" (same family).
"""

from __future__ import annotations

import math

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics

TOTAL = 3  # steps in a row one expert holds collapse / top_k of the assignments: a collapse before a window fills
# Before step `window` a forming router piles most tokens on one expert by itself: clean debug-moe (seeds
# 0-3, 20) held >= collapse (0.9) of the most possible for up to 10 steps in a row, >= 99% for up to 3, and
# spread by step ~40. Only EVERY of it (every token's pick but 1%) on EARLY steps in a row is a collapse then.
EVERY, EARLY = 0.99, 5


class MoEHealth(Monitor):
    rule, family = "moe", "moe"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.moe
        self.loads: dict[str, list[list[float]]] = {}  # layer -> last `window` load shares
        self.drops: dict[str, list[float]] = {}
        self.starved: dict[str, list[int]] = {}  # layer -> consecutive starved steps per expert
        self.revived: dict[str, list[int]] = {}  # layer -> experts re-initialised once already
        self.strikes: dict[str, list[int]] = {}  # layer -> steps of its imbalance / collapse findings
        self.history: dict[str, list[list[float]]] = {}  # layer -> [max load, dropped] of recent windows
        self.pruning: dict[str, int] = {}  # layer -> the expert a finding proposed to prune (prune_dead)
        self.answered: dict[str, int] = {}  # layer -> step of its collapse's remedy (applied: a raise, a reset)

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.skipped:  # a withheld step's routing is a bad batch's: it says nothing of the router's health
            return None
        # a non-finite loss: NaN weights route every token alike (weights_nan in advise mode: a collapse, its
        # balance raise and router reset advised); that step is the nonfinite rule's, and its shares no router's
        if not math.isfinite(m.loss):
            return None
        findings = []
        for layer, share, dropped, top_k in m.moe or ():
            key = str(layer)
            if len(self.starved.get(key, [])) != len(share):  # first step, or surgery changed E
                self._renumber(key, len(self.starved.get(key, [])), len(share))
                self.loads[key], self.drops[key], self.starved[key] = [], [], [0] * len(share)
            self.loads[key] = (self.loads[key] + [share])[-self.cfg.window :]
            self.drops[key] = (self.drops[key] + [dropped])[-self.cfg.window :]
            fair = 1.0 / len(share)
            self.starved[key] = [
                n + 1 if s < self.cfg.dead_load * fair else 0 for n, s in zip(self.starved[key], share)
            ]
            found = self._total_collapse(m, layer, top_k)
            if found is None and len(self.loads[key]) == self.cfg.window:
                found = self._check(m, layer, top_k)
            findings.append(found)
        found = sorted((f for f in findings if f), key=lambda f: -f.strength)
        if found:  # the other layers' windows keep sliding: they report on a later step
            self._commit(found[0])
        return found[0] if found else None

    def _renumber(self, key: str, old: int, new: int) -> None:
        """Keep `revived` on the same experts after surgery changed the layer's count: an added
        expert is appended (indices stay); the prune this rule proposed shifts those above it down.
        Any other shrink (a person's `prune-expert`) leaves no way to tell which index is whom:
        forget them, so a dying expert is re-initialised once more rather than another pruned."""
        gone = self.pruning.pop(key, None)
        revived = self.revived.get(key, [])
        if not old or new > old or not revived:
            return
        if new == old - 1 and gone is not None:
            self.revived[key] = [e - (e > gone) for e in revived if e != gone]
        else:
            self.revived[key] = []

    def _recent(self, key: str, step: int) -> list[int]:
        return [s for s in self.strikes.get(key, []) if step - s <= 4 * self.cfg.window]

    def _commit(self, f: Finding) -> None:
        """State changes for the one finding reported (not for those dropped this step)."""
        key, kind = str(f.evidence["layer"]), f.evidence["kind"]
        self.loads[key], self.drops[key], self.history[key] = [], [], []  # fresh windows before it fires again
        if kind == "dead":
            expert = f.evidence["expert"]
            self.starved[key][expert] = 0
            prune = f.evidence["revived_before"] and self.cfg.prune_dead and f.evidence["prunable"]  # remedies.moe's
            f.commit = lambda: self._remedied(key, expert, prune)
        elif kind in ("imbalance", "collapse"):
            self.strikes[key] = self._recent(key, f.step) + [f.step]
            if kind == "collapse":  # remedies._balance passes it on to a raise and a reset, not a note
                f.commit = lambda: self.answered.update({key: f.step})

    def _remedied(self, key: str, expert: int, prune: bool) -> None:
        """A dead expert's remedy was applied (Remedy.commit): it was re-initialised, or pruned. Advice
        (advise mode, confidence too low) changed nothing: its expert, dead again, was never revived, and
        calling it so proposed pruning an expert that had had no re-init (soak, advise mode)."""
        if prune:
            self.pruning[key] = expert
        elif expert not in self.revived.get(key, []):
            self.revived.setdefault(key, []).append(expert)

    def _total_collapse(self, m: StepMetrics, layer: int, top_k: int) -> Finding | None:
        """A collapse before the window fills: one expert at collapse / top_k of the assignments on
        each of the last TOTAL steps (before step `window`, at EVERY / top_k on EARLY steps).
        expert_collapse@30 on debug-moe (every token's first choice on expert 0) was found only once
        the 20-step window's mean passed the bar, at steps 45-48; it is found at step 32 now, and the
        reset comes at once (remedies._balance: the bias leads); expert_collapse@6 at step 10, not 20.
        Not within a window of the layer's collapse remedy (applied): the balance loss moves the
        router by gradient, over tens of steps, and 3 steps after a raise the same collapse, still
        there, was its failure (a reset at once, the raise "not recovered"); after expert_collapse@6's
        reset at 10 a forming router's own collapse was reset again at 21 and 24 (seed 20). The full
        window (_check) judges them."""
        key, window = str(layer), self.cfg.window
        steps, bar = (EARLY, EVERY) if m.step < window else (TOTAL, self.cfg.collapse)
        recent = self.loads[key][-steps:]
        settling = m.step - self.answered.get(key, -window) < window
        if len(recent) < steps or len(recent[-1]) <= top_k or settling:
            return None
        busiest = max(range(len(recent[-1])), key=lambda e: recent[-1][e])
        if any(share[busiest] < bar / top_k for share in recent):
            return None
        mean = [sum(col) / steps for col in zip(*recent)]
        drop = sum(self.drops[key][-steps:]) / steps
        return self._collapse(m, (layer, top_k, steps), mean, busiest, drop)

    def _collapse(
        self, m: StepMetrics, where: tuple[int, int, int], mean: list[float], busiest: int, drop: float
    ) -> Finding:
        """The collapse finding; `where`: the layer, its top_k and the steps `mean` averages."""
        layer, top_k, steps = where
        evidence = {
            "kind": "collapse",
            "layer": layer,
            "busiest": busiest,
            "max_load": mean[busiest] * len(mean),
            "dropped": drop,
            "shares": [round(s, 4) for s in mean],
            "steps": steps,
            "strikes": len(self._recent(str(layer), m.step)),  # earlier balance findings
        }
        summary = (
            f"layer {layer}: expert {busiest} takes {mean[busiest]:.0%} of assignments (at most {1 / top_k:.0%} "
            f"possible) over the last {evidence['steps']} steps"
        )
        finding = self.finding(m, evidence, summary, 1.0)
        finding.family = f"moe/{layer}"  # outcomes are judged per layer
        return finding

    def _check(self, m: StepMetrics, layer: int, top_k: int) -> Finding | None:
        key, cfg = str(layer), self.cfg
        loads = self.loads[key]
        mean = [sum(col) / len(loads) for col in zip(*loads)]
        n, busiest = len(mean), max(range(len(mean)), key=lambda e: mean[e])
        ratio, drop = mean[busiest] * n, sum(self.drops[key]) / len(self.drops[key])
        dead = [e for e, c in enumerate(self.starved[key]) if c >= cfg.dead_patience]
        balancing, draining = self._healing(key, ratio, drop)
        if m.step < cfg.grace_steps:  # the router is still forming: only a stuck imbalance is answered
            balancing, draining = not self._stuck(key), True
        evidence = {
            "layer": layer,
            "busiest": busiest,
            "max_load": ratio,
            "dropped": drop,
            "shares": [round(s, 4) for s in mean],
        }
        # n_experts == top_k: every token goes to every expert, so each takes 1 / top_k, "at most
        # possible", by construction; no routing choice is there to collapse, nor an expert to prune
        if n > top_k and mean[busiest] >= cfg.collapse / top_k:
            return self._collapse(m, (layer, top_k, len(loads)), mean, busiest, drop)
        if dead:
            kind, strength = "dead", 0.9
            summary = (
                f"layer {layer}: expert {dead[0]} got < {cfg.dead_load:.0%} of its fair share for "
                f"{cfg.dead_patience} steps"
            )
            evidence["expert"] = dead[0]
            # how long it has starved: a decision taken since did not starve it (moe_outcomes.py: older)
            evidence["starved_steps"] = self.starved[key][dead[0]]
            evidence["revived_before"] = dead[0] in self.revived.get(key, [])
            evidence["prunable"] = n > top_k  # surgery keeps at least top_k experts (remedies.moe re-inits)
            if evidence["revived_before"] and cfg.prune_dead and not evidence["prunable"]:
                summary += f", again after its re-init; not pruned: the layer has only top_k={top_k} experts"
        elif cfg.add_experts and ratio > cfg.imbalance and drop > 0 and n < cfg.max_experts and not balancing:
            kind, strength = "saturated", 0.7
            summary = f"layer {layer}: expert {busiest} at {ratio:.1f}x its fair share with {drop:.0%} dropped"
        elif ratio > cfg.imbalance and not balancing:
            kind, strength = "imbalance", min(1.0, 0.5 + 0.5 * (ratio - cfg.imbalance) / cfg.imbalance)
            evidence["strikes"] = len(self._recent(key, m.step))  # earlier raises that did not hold
            summary = f"layer {layer}: expert {busiest} at {ratio:.1f}x its fair share (> {cfg.imbalance:g})"
        elif drop > cfg.max_drop and not draining:
            kind, strength = "drop", min(1.0, 0.5 + drop)
            summary = f"layer {layer}: {drop:.0%} of assignments dropped (> {cfg.max_drop:.0%})"
        else:
            return None
        finding = self.finding(m, {"kind": kind, **evidence}, summary, strength)
        finding.family = f"moe/{layer}"  # outcomes are judged per layer
        return finding

    def _healing(self, key: str, ratio: float, drop: float) -> tuple[bool, bool]:
        """Whether this layer's imbalance, and its dropped fraction, are getting better by
        themselves: now against a window ago. A fresh router (random init) starts
        imbalanced and drops tokens while the balance loss spreads them within a few dozen steps;
        acting on that costs capacity (or balance pressure) for nothing (the clean debug-moe and
        debug-hybrid runs raised the capacity factor 2-3 times). Imbalance and drops are answered
        only after `grace_steps`, and once a full window shows they are not shrinking by
        `improving` or more; collapse and dead experts, which do not heal by themselves, are
        answered at once."""
        past = self.history.setdefault(key, [])
        past.append([ratio, drop])
        del past[: -(self.cfg.window + 1)]
        if len(past) <= self.cfg.window:
            return True, True  # no window to compare with yet
        (then_ratio, then_drop), shrink = past[0], self.cfg.improving
        return ratio - 1 <= shrink * (then_ratio - 1), drop <= shrink * then_drop

    def _stuck(self, key: str) -> bool:
        """In `grace_steps`: the layer's imbalance is no lower than a full window ago, so the router
        is not spreading its tokens and the grace meant for one that is would only wait. The soak
        (debug-moe, 4 experts top-1, balance and z-loss off, temperature 0.1): layer 3 at 3.0-3.5x
        fair share with ~50% dropped from step 10 on, answered only at step 100; a fresh router's
        imbalance falls window on window (clean debug-moe seeds 0-2: no finding before step 100)."""
        past = self.history.get(key, [])
        return len(past) > self.cfg.window and past[-1][0] >= past[0][0]
