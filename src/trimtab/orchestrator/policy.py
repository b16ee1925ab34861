"""Policy: findings -> decisions, along an escalation ladder with cooldowns and bounded retries.

Instability (non-finite values, loss spikes, gradient explosions, divergence) climbs one ladder:

    rung 0  skip the step (the update gate already withheld it on device)
    rung 1  cut the LR (x lr_cut)
    rung 2  roll back to the last good checkpoint, skip the rows behind the incident, cut the LR
    rung 3  save and stop with a clear message (max_rollbacks used up, or nothing to roll back to)

It climbs when `escalate_after` instability findings fall within `escalation_window` steps of
each other (skipping did not help), and falls back to rung 0 after a quiet window. Other families
have one remedy each: plateau -> raise the LR within limits, memory -> halve the micro-batch,
throughput -> log, fp16 overflow storm -> cut the LR. Confidence = evidence strength x this
rule's track record in this run (a Beta(3, 1) prior on "recovered", updated by outcomes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding


@dataclass
class Plan:
    action: str
    params: dict[str, Any]
    reasoning: str


@dataclass
class Ladder:
    rung: int = 0
    recent: list[int] = field(default_factory=list)  # steps of findings since the last climb
    last_step: int = -1  # last finding
    rows: list[int] = field(default_factory=list)  # rows of the incident's flagged steps


class Policy:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.ladder = Ladder()
        self.last_lr_change = -(10**9)  # step of the last LR decision (cooldown / grace period)
        self.lr_debt = 1.0  # product of the ladder's LR cuts not yet given back
        self.last_restore = -1  # step of a give-back still on probation
        self.restore_failed = False
        self.probe_baseline: float | None = None  # held-out loss at the last good checkpoint

    # ------------------------------------------------------------------ decisions

    def plan(self, f: Finding, view: Any) -> Plan:
        """What to do about finding f; `view` is the trainer's Control (read-only use here)."""
        if f.family == "instability":
            return self._instability(f, view)
        if f.rule == "plateau":
            return self._plateau(f, view)
        if f.rule == "lr":
            self.last_lr_change = f.step
            ratio = f.evidence["previous"] / f.evidence["scheduled_lr"]
            return Plan(
                "scale_lr",
                {"factor": ratio},
                "an LR that jumps in one step is a configuration or schedule error, not a "
                "decision: the step was skipped and the multiplier brings the LR back to its "
                "previous level (`trimtab ctl RUN scale-lr` overrides this)",
            )
        if f.rule in ("memory", "oom"):
            return self._memory(f, view)
        if f.rule == "fp16":
            self.last_lr_change = f.step
            return Plan(
                "scale_lr",
                {"factor": self.cfg.fp16.lr_factor},
                "fp16 gradients overflow again and again; a lower LR keeps activations and "
                "gradients in range (bf16, where the hardware has it, avoids this entirely)",
            )
        return Plan(
            "none",
            {},
            "throughput fell well below its recent median; logged for a person "
            "(a slower node, thermal throttling, I/O stalls or memory swapping)",
        )

    def _instability(self, f: Finding, view: Any) -> Plan:
        ladder, cfg = self.ladder, self.cfg
        ladder.recent = [s for s in ladder.recent if f.step - s < cfg.escalation_window] + [f.step]
        ladder.last_step = f.step
        ladder.rows = sorted(set(ladder.rows) | set(f.rows))
        climb = len(ladder.recent) >= cfg.escalate_after
        if f.rule == "divergence" and ladder.rung == 0:
            climb = True  # a trend is not a one-off: skipping cannot fix it
        verdict = self._diagnose(view) if climb and ladder.rung == 0 and f.rule != "divergence" else None
        if verdict and verdict[0] == "data":
            rows, ladder.rows, ladder.recent = ladder.rows, [], []
            return Plan(
                "skip_data",
                {"rows": rows},
                f"the model still scores {verdict[1]:.3f} on held-out data (last good checkpoint "
                f"{self.probe_baseline:.3f}), so the bad steps came from the data: leave out "
                f"their {len(rows)} rows; the LR stays",
            )
        if verdict and verdict[0] == "broken":
            ladder.rung = 1  # an LR cut cannot repair broken weights: straight to the rollback
        if not climb:
            return Plan(
                "skip_step", {}, "the update was withheld before the optimizer step, so the weights are untouched"
            )
        ladder.rung, ladder.recent = ladder.rung + 1, []
        if ladder.rung == 1 and view.lr_scale * cfg.lr_cut < cfg.min_lr_scale:
            ladder.rung = 2  # the LR is already at its floor
        if ladder.rung == 2 and (view.rollbacks >= cfg.max_rollbacks or not view.has_good_checkpoint):
            ladder.rung = 3
        if ladder.rung == 1:
            self.last_lr_change = f.step
            factor = cfg.divergence.lr_factor if f.rule == "divergence" else cfg.lr_cut
            self.lr_debt *= factor
            return Plan(
                "scale_lr",
                {"factor": factor},
                f"{cfg.escalate_after} instability findings within {cfg.escalation_window} steps: "
                "skipping alone does not help, so the LR comes down"
                if f.rule != "divergence"
                else "the loss trends upward: a lower LR is the standard remedy for divergence",
            )
        if ladder.rung == 2:
            rows, ladder.rows = ladder.rows, []
            ladder.rung = 0  # after a rollback the ladder starts over; rollbacks stay counted
            self.last_lr_change = f.step
            return Plan(
                "rollback",
                {"to": "last_good", "skip_rows": rows},
                "instability persists after skipping and an LR cut: restore the last good "
                f"checkpoint (the LR stays cut) and leave out the {len(rows)} rows seen in the bad steps",
            )
        reason = (
            "no good checkpoint to roll back to"
            if not view.has_good_checkpoint
            else f"{view.rollbacks} rollbacks used (orchestrator.max_rollbacks={cfg.max_rollbacks})"
        )
        return Plan(
            "stop",
            {
                "reason": f"training is unstable and cannot be healed: {reason}; "
                "see decisions.jsonl, lower optim.lr or check the data"
            },
            f"every rung of the ladder was tried ({reason}); saving and stopping is safer than training on",
        )

    def _diagnose(self, view: Any) -> tuple[str, float] | None:
        """Bad data or a bad model? Megatron reruns the step; here the model is scored on a
        held-out batch and compared with its score at the last good checkpoint."""
        if self.probe_baseline is None:
            return None
        probe = view.probe_loss()
        if probe is None:
            return None
        if not math.isfinite(probe):
            return "broken", probe
        if probe <= self.probe_baseline + max(0.1, 0.05 * self.probe_baseline):
            return "data", probe
        return None

    def _plateau(self, f: Finding, view: Any) -> Plan:
        cfg = self.cfg.plateau
        target = view.lr_scale * cfg.lr_factor
        if f.step - self.last_lr_change < 2 * cfg.window:
            return Plan("none", {}, "the LR changed recently; give it time before raising it")
        if self.ladder.last_step >= 0 and f.step - self.ladder.last_step < 2 * cfg.window:
            return Plan("none", {}, "instability was seen recently; a higher LR would be risky")
        if target > cfg.max_lr_scale:
            return Plan(
                "none",
                {},
                f"the LR multiplier would pass orchestrator.plateau.max_lr_scale="
                f"{cfg.max_lr_scale:g}; a person should look at the schedule",
            )
        self.last_lr_change = f.step
        return Plan(
            "scale_lr",
            {"factor": cfg.lr_factor},
            "the loss has stopped moving long before the planned end: a larger LR may "
            "get it out of the flat region (bounded by orchestrator.plateau.max_lr_scale)",
        )

    def _memory(self, f: Finding, view: Any) -> Plan:
        half = view.micro_batch_tokens // 2
        if half < view.min_micro_batch_tokens and f.rule == "memory":
            return Plan(
                "none",
                {},
                "memory is nearly full but the micro-batch is already one row; "
                "logged for a person (an out-of-memory error would stop the run)",
            )
        if half < view.min_micro_batch_tokens:
            return Plan(
                "stop",
                {
                    "reason": f"out of memory with a micro-batch of one row "
                    f"({view.micro_batch_tokens} tokens); lower data.seq_len or "
                    "the model size, or use a device with more memory"
                },
                "the micro-batch cannot be split further",
            )
        why = (
            "out of memory: half the micro-batch with twice the accumulation keeps the "
            "optimization batch identical; the same rows are retried"
            if f.rule == "oom"
            else "memory is nearly full: a smaller micro-batch now avoids an out-of-memory crash later"
        )
        return Plan("adjust_batch_size", {"micro_batch_tokens": half}, why)

    def quiet(self, step: int) -> Plan | None:
        """Called every step: after a quiet window the ladder falls back to rung 0; after
        lr_restore_after quiet steps the LR the ladder cut is given back, x2 at a time, unless a
        restore was followed by new instability once already (then the cut was needed)."""
        if self.ladder.rung and step - self.ladder.last_step >= self.cfg.escalation_window:
            self.ladder = Ladder(last_step=self.ladder.last_step, rows=[])
        wait = self.cfg.lr_restore_after
        if self.last_restore >= 0 and self.ladder.last_step > self.last_restore:
            self.restore_failed, self.last_restore = True, -1
        if (
            self.lr_debt >= 1
            or not wait
            or self.restore_failed
            or step - self.ladder.last_step < wait
            or step - self.last_lr_change < wait
        ):
            return None
        factor = min(2.0, 1 / self.lr_debt)
        self.lr_debt *= factor
        self.last_lr_change = self.last_restore = step
        return Plan(
            "scale_lr",
            {"factor": factor},
            f"{wait} steps without instability since the LR was cut: give part of it back "
            "(if instability returns, the cut stays for the rest of the run)",
        )

    def shift(self, steps: int) -> None:
        """A rollback moved the step counter back by `steps`: move remembered steps with it, so
        cooldowns and quiet windows count the steps actually trained."""
        ladder = self.ladder
        ladder.recent = [s - steps for s in ladder.recent]
        ladder.last_step -= steps if ladder.last_step >= 0 else 0
        self.last_lr_change -= steps
        self.last_restore -= steps if self.last_restore >= 0 else 0

    # ------------------------------------------------------------------ confidence

    @staticmethod
    def confidence(strength: float, record: tuple[int, int]) -> float:
        recovered, judged = record
        return round(strength * (recovered + 3) / (judged + 4), 3)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ladder": vars(self.ladder).copy(),
            "last_lr_change": self.last_lr_change,
            "lr_debt": self.lr_debt,
            "last_restore": self.last_restore,
            "restore_failed": self.restore_failed,
            "probe_baseline": self.probe_baseline,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ladder = Ladder(**state["ladder"])
        for key in ("last_lr_change", "lr_debt", "last_restore", "restore_failed", "probe_baseline"):
            setattr(self, key, state[key])
