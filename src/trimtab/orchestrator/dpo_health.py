"""DPO's held-out watch (rule dpo_held_out, docs/rl.md): the held-out preference loss rising over its best.

Under `trimtab dpo` the rules that judge a likelihood's course are off (the loss is a preference objective), and
an LR far too high went unanswered: DPO is LR-sensitive (Rafailov et al. 2023 train at 5e-7 to 1e-6), and at 30x
the healthy LR the held-out loss rose 0.69 -> 0.91 while the chosen response's implicit reward fell to -5.7,
both responses' likelihoods pushed down ("likelihood displacement": Razin et al. 2024, Pal et al. 2024). The
held-out pairs measure what the updates do to preferences the policy never trained on; their loss rising above
its best means the updates undo what was learnt. The remedy rolls back to the best evaluation's policy with the
LR cut (rl_reward's decade cut, as for an RL policy an LR too high collapsed)."""

from __future__ import annotations

from typing import Any

from trimtab.config.dpo import DPOConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.remedies import Remedy, lr_cut
from trimtab.orchestrator.rl_reward import gave_up, no_rollback


class PreferenceFall(Monitor):
    """At each DPO evaluation: the held-out preference loss against the lowest so far, and the chosen responses'
    log-ratio to the reference. The loss `rise` or more above its best, or the log-ratio `displacement` nats or
    more below 0 (likelihood displacement), for `patience` evaluations in a row, while the held-out accuracy is no
    higher than at that best or than chance (a loss that rises as more pairs are ranked rightly is a sharper
    policy, not a broken one), fires."""

    rule, family = "dpo_held_out", "rl"
    # the best reading is the rollback's target and is not taken again (the step-0 evaluation is not repeated):
    # kept over the checkpoint's on a rollback, so the replay is judged against it
    KEPT_ON_ROLLBACK = ("best", "fired")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.dpo_held_out
        self.best: list[float] = []  # [loss, accuracy, step] of the lowest held-out loss so far
        self.since, self.fired = 0, 0

    def observe(self, m: StepMetrics) -> Finding | None:
        return None  # judged at evaluations (observe_eval)

    def observe_eval(
        self,
        step: int,
        phase: int,
        loss: float,
        accuracy: float = 0.0,
        chosen: float = 0.0,
        displaced: float | None = None,
    ) -> Finding | None:
        """`loss`, `accuracy`, `chosen`: the held-out pairs' mean loss, preference accuracy and chosen reward;
        `displaced`: the chosen responses' mean log(pi / pi_ref) in nats (None: a loss with no reference)."""
        rule = self.cfg
        fell = displaced is not None and displaced <= -rule.displacement
        # a displaced policy is no rollback target, however low its loss (at 30x the LR, step 5 read 0.689 < log 2
        # with the chosen responses 8.5 nats below the reference's)
        if not self.best or (loss < self.best[0] and not fell):
            self.best, self.since = [loss, accuracy, step], 0
            return None
        best, best_accuracy, best_step = self.best
        risen = loss - best >= rule.rise
        # the reference's accuracy is 0 (every margin a tie, none counted right): chance is the bar there
        self.since = self.since + 1 if (risen or fell) and accuracy <= max(best_accuracy, 0.5) else 0
        if self.since < rule.patience:
            return None
        self.since, self.fired = 0, self.fired + 1
        evidence = {
            "held_out_loss": loss,
            "best_held_out_loss": best,
            "best_step": int(best_step),
            "held_out_accuracy": accuracy,
            "best_held_out_accuracy": best_accuracy,
            "held_out_chosen_reward": chosen,
            "held_out_chosen_logratio": displaced,
            "evaluations": rule.patience,
            "times": self.fired,
        }
        how = (
            f"the chosen responses' log-likelihood ratio fell to {displaced:.2f} nats (orchestrator.dpo_held_out."
            f"displacement={rule.displacement:g}), likelihood displacement"
            if fell
            else f"the preference loss rose to {loss:.3f} from its best {best:.3f} (step {int(best_step)}, "
            f"orchestrator.dpo_held_out.rise={rule.rise:g})"
        )
        summary = (
            f"on the held-out pairs {how}, {rule.patience} evaluations in a row, with the held-out accuracy "
            f"{accuracy:.3f} (at the best {best_accuracy:.3f}, chance 0.5) and the chosen reward {chosen:.3f}: the "
            "updates undo the preferences learnt"
        )
        strength = 1.0 if fell else min(1.0, 0.5 + 0.5 * (loss - best - rule.rise) / rule.rise)
        return Finding(
            rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=strength
        )


def preference_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """Back to the policy of the best held-out loss with the LR x rl_reward.lr_factor, up to max_rollbacks an
    incident; past them, at the LR's floor, or with no checkpoint that far back, stop: training on undoes more."""
    best, factor = f.evidence["best_step"], lr_cut(cfg.rl_reward.lr_factor, view, cfg)
    chosen = f.evidence["held_out_chosen_reward"]
    why = "an LR too high for DPO (its paper's is 5e-7 to 1e-6) moves the policy past the preferences it learnt" + (
        f", and pushes the chosen responses down with the rejected (their reward {chosen:.2f})" if chosen < 0 else ""
    )
    kept = view.has_checkpoint(best)
    if factor is not None and rollbacks < cfg.max_rollbacks and kept:
        return Remedy(
            action="rollback",
            params={"to": best, "skip_rows": [], "lr_factor": factor},
            reasoning=f"{why}: restore the policy of the best held-out loss (the newest checkpoint at or before step "
            f"{best}) and train on with the LR x{factor:g}",
        )
    reason = no_rollback(factor, rollbacks, cfg, best)
    return gave_up("the held-out preference loss keeps rising", why, best, reason, kept=kept)


def dpo_eval(metrics: dict[str, Any], dpo: DPOConfig) -> dict[str, float]:
    """A DPO evaluation's accuracy, chosen reward and (against a reference) the chosen responses' log-likelihood
    ratio, the reward / dpo.beta, for rule dpo_held_out ({} where absent)."""
    keys = {"accuracy": "dpo/held_out_accuracy", "chosen": "dpo/held_out_chosen_reward"}
    out = {k: float(metrics[key]) for k, key in keys.items() if key in metrics}
    if "chosen" in out and dpo.uses_reference:  # a reference-free reward is a mean log-probability, no ratio
        out["displaced"] = out["chosen"] / dpo.beta
    return out
