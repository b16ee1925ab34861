"""Detectors of the machine (monitors.py has the kit): slowdowns (Throughput), memory close to
the limit (MemoryPressure), fp16 overflow (Fp16Overflow) and out-of-memory errors (OutOfMemory)."""

from __future__ import annotations

from typing import Any

from trimtab.config import CHECKPOINTING
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics


class Throughput(Monitor):
    """Tokens/s below factor x its rolling median for `patience` consecutive steps. An action
    applied to the run (a smaller micro-batch, a new expert, a rollback: the orchestrator's own or
    a person's) starts a fresh baseline, so the rule reports a slower machine, not those changes;
    so does a resume on another number of processes (the job's tokens/s scale with it: a 2-rank
    run resumed on 1 was logged "3,081 tokens/s < 0.5 x median 8,777", a slower node, which it was not)."""

    rule, family = "throughput", "throughput"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.throughput
        self.window = Rolling(self.cfg.window)
        self.slow = 0
        self.changes = 0
        self.world = 1  # the processes the window's rates were measured on (checkpointed)
        self.reported: list[float] = []  # [step, tokens/s] of the last finding

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.changes != self.changes or m.world != self.world:
            self.changes, self.world, self.window, self.slow = m.changes, m.world, Rolling(self.cfg.window), 0
        if len(self.window) < self.cfg.min_samples or m.tokens_per_s >= self.cfg.factor * self.window.median():
            self.window.add(m.tokens_per_s)
            self.slow = 0
            return None
        self.slow += 1
        if self.slow < self.cfg.patience:
            return None
        self.slow = 0
        # Logged, never acted on: one line per slow stretch, another only after the cooldown or
        # when the rate halves again (a loaded machine filled the journal with dozens a run)
        quiet = m.step - self.reported[0] < self.cfg.cooldown if self.reported else False
        if quiet and m.tokens_per_s >= 0.5 * self.reported[1]:
            return None
        self.reported = [m.step, m.tokens_per_s]
        median = self.window.median()
        return self.finding(
            m,
            {"tokens_per_s": m.tokens_per_s, "median": median, "patience": self.cfg.patience},
            f"{m.tokens_per_s:,.0f} tokens/s < {self.cfg.factor:g} x median {median:,.0f} "
            f"for {self.cfg.patience} steps",
            1 - m.tokens_per_s / median,
        )


class MemoryPressure(Monitor):
    """Memory in use above the threshold for `patience` consecutive readings."""

    rule, family = "memory", "memory"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.memory
        self.high = 0

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.memory_frac is None or m.memory_frac <= self.cfg.threshold:
            self.high = 0
            return None
        self.high += 1
        if self.high < self.cfg.patience:
            return None
        self.high = 0
        return self.finding(
            m,
            {"memory_frac": m.memory_frac, "threshold": self.cfg.threshold},
            f"memory {m.memory_frac:.0%} in use > {self.cfg.threshold:.0%}",
            0.6 + 0.4 * (m.memory_frac - self.cfg.threshold) / (1 - self.cfg.threshold + 1e-9),
        )


class Fp16Overflow(Monitor):
    """An overflow storm: the GradScaler skipped at least max_overflows of the last `window` steps
    beyond the ones its own growth costs. The scaler grows the scale after every
    train.loss_scale.growth_interval clean steps and backs off at the overflow a too-large scale
    causes, so one overflow each growth_interval steps is the scaler working, not a storm: with a
    short interval (say 2) those would otherwise read as one."""

    rule, family = "fp16", "fp16"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.fp16
        self.window = Rolling(self.cfg.window)
        self.growth_interval = 2000  # train.loss_scale.growth_interval (the orchestrator sets it)

    def observe(self, m: StepMetrics) -> Finding | None:
        self.window.add(float(m.overflow))
        count = int(sum(self.window.values))
        probes = self.cfg.window // self.growth_interval  # the growth overflows the window holds
        if count < self.cfg.max_overflows + probes:
            return None
        self.window = Rolling(self.cfg.window)
        evidence = {"overflows": count, "window": self.cfg.window, "growth_interval": self.growth_interval}
        return self.finding(
            m,
            {**evidence, "growth_overflows": probes},
            f"{count} fp16 overflows in {self.cfg.window} steps (the scaler's own growth costs {probes}: one every "
            f"train.loss_scale.growth_interval = {self.growth_interval} steps)",
            count / self.cfg.window + 0.5,
        )


RESUME_PROBE = 10  # steps after a resume before a shrunk micro-batch is probed at twice the size


class OutOfMemory(Monitor):
    """Out-of-memory errors, reported by the trainer's retry path (error()), counted per step; and,
    after `probe_after` clean steps on a lighter setting than configured, a probe, waiting twice as
    long before the next one (back-off): first checkpointing one step lighter where an error had
    made it heavier (its speed is the larger), then a micro-batch of twice the size."""

    rule, family = "oom", "memory"
    # What the errors taught of the machine goes with the micro-batch and checkpointing they set, knobs
    # a rollback keeps: restored to a checkpoint from before the error, a rollback forgot it (and where)
    # while the shrunk micro-batch stayed (fuzzer: oom@11, then weights_nan@13's rollback)
    KEPT_ON_ROLLBACK = ("last", "retries", "clean", "probe_after", "ran_out_on")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.oom
        self.configured = 0  # the micro-batch the run started with (set by the orchestrator), or a person's since
        self.configured_checkpointing = "off"  # train.activation_checkpointing (set by the orchestrator)
        self.person_checkpointing = ""  # a person's `trimtab ctl RUN checkpointing MODE`, kept over a resume
        self.last = -1  # step of the last out-of-memory error
        self.retries = 0  # errors in that step
        self.clean = 0  # steps since, below the configured micro-batch
        self.probe_after = cfg.oom.probe_after  # clean steps before the next probe: the config's, doubled by back-off
        self.probe_configured = cfg.oom.probe_after  # the config's value probe_after was doubled from (checkpointed)
        self.since_resume: int | None = None  # clean steps in this process, when it resumed shrunk
        self.config_seen: dict[str, object] = {}  # train.micro_batch_tokens and activation_checkpointing, configured
        self.ran_out_on: list[int | None] = []  # [world, memory per device] where the last error happened

    def ran_out(self, machine: list[int | None]) -> None:
        """The machine ([world, memory per device]) the error about to be reported happened on."""
        self.ran_out_on = list(machine)

    def error(self, step: int, micro_batch_tokens: int, message: str, rows: list[int]) -> Finding:
        self.retries = self.retries + 1 if step == self.last else 1
        self.last, self.clean = step, 0
        self.since_resume = None  # the count toward the next probe starts at this error, not at the resume
        return Finding(
            rule=self.rule,
            family=self.family,
            step=step,
            evidence={"kind": "oom", "micro_batch_tokens": micro_batch_tokens, "retry": self.retries, "error": message},
            summary=f"out of memory at a micro-batch of {micro_batch_tokens} tokens",
            strength=1.0,
            rows=list(rows),
        )

    def rollout_error(self, step: int, rows: int, message: str) -> Finding:
        """Out of memory generating RL's rollouts `rows` at a time (before the step's update)."""
        self.retries = self.retries + 1 if step == self.last else 1
        self.last = step
        return Finding(
            rule=self.rule,
            family=self.family,
            step=step,
            evidence={"kind": "rollout_oom", "generation_rows": rows, "retry": self.retries, "error": message},
            summary=f"out of memory generating rollouts {rows} rows at a time",
            strength=1.0,
        )

    def set_by_person(self, micro_batch_tokens: int = 0, checkpointing: str = "") -> None:
        """A person's micro-batch or checkpointing (`trimtab ctl`), as applied, is the run's setting
        from now on: the probe returns to it after an error, never past it (it used to probe a
        person's smaller micro-batch or heavier checkpointing back to the config's)."""
        self.configured = micro_batch_tokens or self.configured
        if checkpointing:
            self.configured_checkpointing = self.person_checkpointing = checkpointing
        self.clean = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's state, with orchestrator.oom.probe_after the config's: a person's edit between
        sessions takes effect (journaled as their change: training/changes.py), the back-off the failed
        probes learned kept over it (x2 a failure); the checkpointed count alone won, the edit said to be
        in effect was ignored. A checkpoint from before probe_configured: its probe_after as configured."""
        super().load_state_dict(state)
        saved = state.get("probe_configured", self.probe_after)
        if saved != self.cfg.probe_after:
            backoff = self.probe_after // saved if saved else 1
            self.probe_after = self.cfg.probe_after * max(backoff, 1)
        self.probe_configured = self.cfg.probe_after

    def resumed(self, machine: list[int | None]) -> None:
        """A resumed run is a new process: the fragmentation and the other tenants that made the larger
        micro-batch fail are gone with the old one, so probe it after RESUME_PROBE steps (a run resumed
        after shrinking otherwise waited out probe_after steps at the smaller size, 200 by default, where a
        failed probe costs one step's retry). On the same machine (`machine`: [world, memory per device],
        as the last error's) the back-off goes on: a probe that failed there doubles the wait after this
        one. On another machine, or an unknown one (a checkpoint from before it was recorded), it restarts
        from the config's (a run resumed after shrinking otherwise kept its smallest micro-batch to the end)."""
        if not self.cfg.probe_after:
            return
        if machine != self.ran_out_on:
            self.probe_after = self.cfg.probe_after
        if self.clean < self.probe_after - RESUME_PROBE:  # else the steps before count: the probe is due anyway
            self.clean, self.since_resume = self.probe_after - RESUME_PROBE, 0

    def observe(self, m: StepMetrics) -> Finding | None:
        heavier = CHECKPOINTING.index(m.checkpointing) > CHECKPOINTING.index(self.configured_checkpointing)
        smaller = self.configured and m.micro_batch_tokens < self.configured
        if not self.probe_after or not (heavier or smaller):
            return None
        self.clean += 1
        self.since_resume = None if self.since_resume is None else self.since_resume + 1
        if self.clean < self.probe_after:
            return None
        clean, self.clean, self.probe_after = self.clean, 0, self.probe_after * 2  # back off if it fails again
        evidence = {"kind": "probe", "micro_batch_tokens": m.micro_batch_tokens, "clean_steps": clean}
        summary = f"{clean} steps without running out of memory"
        if self.since_resume is not None:  # what counted was the new process, not the steps before it
            evidence["clean_steps"], self.since_resume = self.since_resume, None
            summary = (
                f"{evidence['clean_steps']} steps without running out of memory since the run resumed (a new process)"
            )
        if heavier:
            lighter = CHECKPOINTING[CHECKPOINTING.index(m.checkpointing) - 1]
            evidence |= {"checkpointing": m.checkpointing, "target_checkpointing": lighter}
        else:
            evidence["target"] = min(m.micro_batch_tokens * 2, self.configured)
        return Finding(
            rule=self.rule,
            family=self.family,
            step=m.step,
            evidence=evidence,
            summary=summary,
            strength=0.6,
        )
