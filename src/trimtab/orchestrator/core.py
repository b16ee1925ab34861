"""The orchestrator: a trainer hook that detects (monitors), decides (policy), acts (Control) and
explains (journal).

Per step it adds a few device ops to the update gate (is the loss/grad norm finite, under the
spike and explosion ceilings) and no host sync; step metrics are read from the device once every
`read_every` steps (every step on CPU, where a read is free) and fed to the monitors in order.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trimtab.checkpoint import prune
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.distributed import all_max, broadcast_object, is_main
from trimtab.errors import TrimtabError
from trimtab.orchestrator import ctl
from trimtab.orchestrator.journal import Decision, Journal
from trimtab.orchestrator.mod_health import MoDQuality, plan_mod
from trimtab.orchestrator.moe_health import MoEHealth, plan_moe
from trimtab.orchestrator.monitors import Finding, Rolling, StepMetrics, build_monitors
from trimtab.orchestrator.policy import Plan, Policy
from trimtab.training.control import ACTIONS
from trimtab.training.hooks import Hook
from trimtab.training.runtime import read_scalars

if TYPE_CHECKING:
    from trimtab.data import StepBatch
    from trimtab.training.trainer import StepOutput, Trainer


class Orchestrator(Hook):
    def __init__(self, cfg: OrchestratorConfig, run_dir: Path):
        self.cfg = cfg
        self.mode = cfg.mode
        self.run_dir = Path(run_dir)
        self.monitors = build_monitors(cfg)
        if cfg.moe.enabled:
            self.monitors["moe"] = MoEHealth(cfg)
        if cfg.mod.enabled:
            self.monitors["mod"] = MoDQuality(cfg)
        self.policy = Policy(cfg)
        self.journal = Journal(self.run_dir / "decisions.jsonl")
        self.paused: set[str] = set()
        self.pending: list[StepOutput] = []
        self.tracking: dict[str, dict[str, Any]] = {}  # decision id -> what followed it
        self.recent_losses = Rolling(20)  # healthy losses: the "before" of an outcome
        self.read_every = cfg.read_every
        self.oom = {"retries": 0, "clean": 0, "configured": 0, "probe_after": cfg.oom.probe_after}
        self._saving_retry = False
        self.last_step = 0  # the newest step seen (a rollback moves the trainer's counter back)
        self.ceilings: dict[str, float] = {}  # the update gate's thresholds, refreshed at each read

    # ------------------------------------------------------------------ hook events

    def on_train_start(self, trainer: Trainer) -> None:
        if not self.read_every:
            self.read_every = 1 if trainer.device.type == "cpu" else 10
        self.oom["configured"] = self.oom["configured"] or trainer.cfg.train.micro_budget
        self.journal.write()

    def update_gate(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        if self.mode != "auto":
            return None
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if "lr" not in self.paused and trainer.scheduled_lr() > self.ceilings.get("lr", math.inf):
            bad = bad | True  # the schedule jumped: this step would apply it
        for name, value in (("spike", loss), ("grad", grad_norm)):
            ceiling = self.ceilings.get(name, math.inf)
            if name not in self.paused and math.isfinite(ceiling):
                bad = bad | (value > ceiling)
        return bad

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        self.oom["retries"] = 0
        self.last_step = out.step
        self.pending.append(out)
        if len(self.pending) >= self.read_every or out.step >= trainer.total_steps:
            self._read(trainer)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._read(trainer)
        for decision in self.journal.pending():  # judge what there is, rather than leave it open
            if decision.observed:
                self._judge(decision)
        self.journal.write()
        summary["decisions"] = len(self.journal.decisions)

    def on_oom(self, trainer: Trainer, exc: BaseException, batch: StepBatch) -> bool:
        if self.mode == "off" or not self.cfg.oom.enabled or "oom" in self.paused:
            return False
        self.oom["retries"] += 1
        self.oom["clean"] = 0
        view = trainer.control
        f = Finding(
            "oom",
            "memory",
            trainer.state.step + 1,
            {
                "micro_batch_tokens": view.micro_batch_tokens,
                "retry": self.oom["retries"],
                "error": str(exc).splitlines()[0][:200],
            },
            f"out of memory at a micro-batch of {view.micro_batch_tokens} tokens",
            1.0,
            batch.rows,
        )
        if self.oom["retries"] > self.cfg.oom.max_retries:
            plan = Plan(
                "stop",
                {"reason": f"out of memory after {self.cfg.oom.max_retries} retries"},
                "the retry budget for one step is spent (orchestrator.oom.max_retries)",
            )
        else:
            plan = self.policy.plan(f, view)
        decision = self._decide(trainer, f, plan)
        return decision.mode == "auto" and plan.action == "adjust_batch_size"

    def on_save_error(self, trainer: Trainer, exc: OSError) -> bool:
        if self.mode != "auto" or self._saving_retry:
            return self._saving_retry  # a failed retry: go on training, the next interval tries again
        f = Finding(
            "disk",
            "disk",
            trainer.state.step,
            {"error": str(exc)[:200], "errno": exc.errno},
            f"checkpoint save failed ({os.strerror(exc.errno) if exc.errno else exc})",
            1.0,
        )
        plan = Plan(
            "save_checkpoint",
            {},
            "keep training and keep what was trained: prune older "
            "checkpoints (never the last good one) to free space, then retry the save once",
        )
        prune(trainer.cfg.run_dir, keep=1, protect=(trainer.last_good,))
        self._saving_retry = True
        try:
            self._decide(trainer, f, plan)
            trainer.control.apply()
        finally:
            self._saving_retry = False
        return True

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if self.mode == "auto" and trainer.last_good == trainer.state.step:
            self.policy.probe_baseline = trainer.control.probe_loss()  # the reference for a diagnosis

    def healthy(self, trainer: Trainer) -> bool:
        """A good rollback target: no escalation under way and no instability in the last steps
        (a skipped step left the weights untouched, so one a few steps back does not count)."""
        ladder = self.policy.ladder
        return ladder.rung == 0 and (ladder.last_step < 0 or trainer.state.step - ladder.last_step > 5)

    def on_rollback(self, trainer: Trainer, saved_state: dict[str, Any]) -> None:
        """Monitors go back with the weights; decisions, ladder and knobs stay (they are the fix)."""
        self.pending = []
        self.policy.shift(self.last_step - trainer.state.step)
        if saved_state:
            self._load_monitors(saved_state)

    # ------------------------------------------------------------------ reading and deciding

    def _read(self, trainer: Trainer) -> None:
        outs, self.pending = self.pending, []
        if outs and self.mode != "off":
            n = len(outs)
            flat = read_scalars(
                [o.loss for o in outs]
                + [o.grad_norm for o in outs]
                + [o.skipped if o.skipped is not None else 0 for o in outs]
                + [o.overflow if o.overflow is not None else 0 for o in outs]
                + [o.mod["means"][:, 0].mean() if o.mod else 0 for o in outs]
            )
            memory = memory_fraction(trainer.device)
            # Data parallelism: the slowest rank's step times and the fullest device, so every
            # rank's monitors see the same numbers and decide alike.
            *seconds, memory = all_max([o.seconds for o in outs] + [-1.0 if memory is None else memory])
            memory = None if memory < 0 else memory
            moe = read_moe(outs, trainer) if "moe" in self.monitors else [None] * n
            for i, o in enumerate(outs):
                m = StepMetrics(
                    o.step,
                    flat[i],
                    flat[n + i],
                    bool(flat[2 * n + i]),
                    bool(flat[3 * n + i]),
                    o.batch.n_tokens / max(seconds[i], 1e-9),
                    o.lr,
                    o.lr_scale,
                    o.step / max(trainer.total_steps, 1),
                    memory,
                    o.batch.rows,
                    moe[i],
                    flat[4 * n + i] if o.mod else None,
                )
                self._observe(trainer, m)
            self._maybe_probe(trainer, n)
            self.ceilings = {k: m.ceiling() for k, m in self.monitors.items() if k in ("spike", "grad", "lr")}
        self._take_commands(trainer)

    def _observe(self, trainer: Trainer, m: StepMetrics) -> None:
        findings = [
            f for name, mon in self.monitors.items() if name not in self.paused and (f := mon.observe(m)) is not None
        ]
        for decision in self.journal.pending():
            track = self.tracking.setdefault(str(decision.id), {"losses": [], "findings": 0})
            track["losses"].append(m.loss)
            track["findings"] += any(f.family == decision.family for f in findings)
            decision.observed += 1
            if decision.observed >= self.cfg.outcome_after:
                self._judge(decision)
        if not findings and math.isfinite(m.loss):
            self.recent_losses.add(m.loss)
        restore = self.policy.quiet(m.step)
        if restore is not None and self.mode != "off":
            self._decide(
                trainer,
                Finding(
                    "lr_restore",
                    "instability",
                    m.step,
                    {"lr_scale": trainer.control.lr_scale},
                    "quiet since the LR cut",
                    0.8,
                ),
                restore,
            )
        unstable = [f for f in findings if f.family == "instability"]
        for f in unstable[:1] + [f for f in findings if f.family != "instability"]:  # one rung per step
            plan = (
                plan_moe(f, trainer.control, self.cfg)
                if f.rule == "moe"
                else plan_mod(f, trainer.control)
                if f.rule == "mod"
                else self.policy.plan(f, trainer.control)
            )
            self._decide(trainer, f, plan, withheld=m.skipped)

    def decide(self, trainer: Trainer, f: Finding, plan: Plan) -> Decision:
        """A decision another hook reached (the live planner's run length): journaled, and in
        auto mode requested through Control, like the orchestrator's own."""
        return self._decide(trainer, f, plan)

    def _decide(self, trainer: Trainer, f: Finding, plan: Plan, withheld: bool = False) -> Decision:
        """Journal a decision and, in auto mode, request its action; `withheld`: the update gate
        already skipped this step's update (a skip_step decision records what happened)."""
        confidence = Policy.confidence(f.strength, self.journal.track_record(f.rule, plan.action))
        mode, reasoning = self.mode, plan.reasoning
        acts = plan.action not in ("skip_step", "none", "stop")
        if mode == "auto" and acts and confidence < self.cfg.min_confidence:
            mode, reasoning = "advise", reasoning + " (confidence below orchestrator.min_confidence)"
        decision = Decision(
            self.journal.next_id(),
            f.step,
            f.rule,
            f.evidence,
            reasoning,
            plan.action,
            dict(plan.params),
            confidence,
            mode,
            f.family,
            f.summary,
            loss_before=self.recent_losses.mean() if len(self.recent_losses) else None,
        )
        if plan.action == "skip_step":
            decision.applied = ["update withheld before the optimizer step"] if withheld else []
        elif mode == "auto" and plan.action != "none":
            trainer.control.request(plan.action, on_done=lambda line, d=decision: self._applied(d, line), **plan.params)
        self.journal.add(decision)
        trainer.say(decision.console_line())
        return decision

    def _applied(self, decision: Decision, line: str) -> None:
        decision.applied.append(line)
        self.journal.write()

    def _judge(self, d: Decision) -> None:
        """Recovered: no finding of the same family since, finite losses, and the loss back near
        (instability) or below (plateau) where it was before."""
        track = self.tracking.pop(str(d.id), {"losses": [], "findings": 0})
        losses = [v for v in track["losses"] if math.isfinite(v)]
        after = sum(losses) / len(losses) if losses else float("nan")
        ok = track["findings"] == 0 and math.isfinite(after)
        if ok and d.loss_before is not None and d.family == "instability":
            ok = after <= d.loss_before * 1.05
        if ok and d.loss_before is not None and d.family == "plateau" and d.action != "none":
            ok = after < d.loss_before
        d.outcome = {
            "result": "recovered" if ok else "not recovered",
            "steps": len(track["losses"]),
            "loss_before": d.loss_before,
            "loss_after": after,
            "findings_after": track["findings"],
        }
        self.journal.write()

    def _maybe_probe(self, trainer: Trainer, steps: int) -> None:
        """After probe_after clean steps on a shrunken micro-batch, try twice the size again."""
        view, oom = trainer.control, self.oom
        if self.mode != "auto" or not oom["probe_after"] or view.micro_batch_tokens >= oom["configured"]:
            return
        oom["clean"] += steps
        if oom["clean"] < oom["probe_after"]:
            return
        oom["clean"], oom["probe_after"] = 0, oom["probe_after"] * 2  # back off if it fails again
        target = min(view.micro_batch_tokens * 2, oom["configured"])
        f = Finding(
            "oom",
            "memory",
            view.step,
            {"micro_batch_tokens": view.micro_batch_tokens, "clean_steps": oom["probe_after"] // 2},
            f"{oom['probe_after'] // 2} steps without running out of memory",
            0.6,
        )
        self._decide(
            trainer,
            f,
            Plan(
                "adjust_batch_size",
                {"micro_batch_tokens": target},
                "probe: a larger micro-batch is faster; if it runs out of memory "
                "it is halved again and the next probe waits twice as long",
            ),
        )

    # ------------------------------------------------------------------ a person's commands

    def _take_commands(self, trainer: Trainer) -> None:
        # Rank 0 takes the files and every rank applies the same commands.
        for name, command in broadcast_object(ctl.take_commands(self.run_dir) if is_main() else None):
            try:
                if command is None:
                    raise TrimtabError('not a command file (expected {"action": ..., "params": {...}})')
                params = command.get("params", {})
                if not isinstance(params, dict):
                    raise TrimtabError(f"'params' must be a mapping, got {params!r}")
                self._manual(trainer, command["action"], dict(params))
            except (TrimtabError, TypeError, ValueError) as exc:  # a person's file: answer, never crash
                if is_main():
                    ctl.answer(self.run_dir, name, str(exc))
                trainer.say(f"[orchestrator] rejected control/{name}: {exc}")

    def _manual(self, trainer: Trainer, action: str, params: dict[str, Any]) -> None:
        if action in ("pause_rule", "resume_rule") and params.get("rule") not in ctl.RULE_NAMES:
            raise TrimtabError(f"unknown rule {params.get('rule')!r}; one of {', '.join(ctl.RULE_NAMES)}")
        if action == "set_mode" and params.get("mode") not in ("auto", "advise", "off"):
            raise TrimtabError(f"unknown mode {params.get('mode')!r}; one of auto, advise, off")
        if action not in (*ACTIONS, "pause_rule", "resume_rule", "set_mode"):
            raise TrimtabError(f"unknown action '{action}'; one of {', '.join(ctl.VERBS)} (trimtab ctl)")
        summary = " ".join([action, *(str(v) for v in params.values())])
        decision = Decision(
            self.journal.next_id(),
            trainer.state.step,
            "manual",
            {"command": action, **params},
            "requested by a person (trimtab ctl)",
            action,
            params,
            1.0,
            "manual",
            "manual",
            summary,
            outcome={"result": "applied"},
        )
        if action in ACTIONS:  # checked here, so a bad value is answered before anything is journaled
            trainer.control.request(action, on_done=lambda line, d=decision: self._applied(d, line), **params)
        elif action == "set_mode":
            self.mode = params["mode"]
            decision.applied = [f"mode {self.mode}"]
        else:
            (self.paused.add if action == "pause_rule" else self.paused.discard)(params["rule"])
            decision.applied = [f"paused rules: {', '.join(sorted(self.paused)) or 'none'}"]
        self.journal.add(decision)
        trainer.say(decision.console_line())

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitors": {k: m.state_dict() for k, m in self.monitors.items()},
            "recent_losses": list(self.recent_losses.values),
            "policy": self.policy.state_dict(),
            "journal": self.journal.state_dict(),
            "tracking": self.tracking,
            "paused": sorted(self.paused),
            "mode": self.mode,
            "oom": dict(self.oom),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._load_monitors(state)
        self.policy.load_state_dict(state["policy"])
        self.journal.load_state_dict(state["journal"])
        self.tracking = state["tracking"]
        self.paused = set(state["paused"])
        self.mode = state["mode"] if self.cfg.mode == "auto" or state["mode"] == self.cfg.mode else self.cfg.mode
        self.oom = state["oom"]

    def _load_monitors(self, state: dict[str, Any]) -> None:
        for name, monitor in self.monitors.items():
            if name in state["monitors"]:
                monitor.load_state_dict(state["monitors"][name])
        self.recent_losses = Rolling(20, state["recent_losses"])
        self.ceilings = {k: m.ceiling() for k, m in self.monitors.items() if k in ("spike", "grad", "lr")}


def read_moe(outs: list[StepOutput], trainer: Trainer) -> list[list[tuple] | None]:
    """Per step, each MoE layer's (layer, load shares, dropped fraction, top_k): one device read."""
    steps = [o.moe for o in outs]
    parts = [t.float().flatten() for s in steps if s for t in [*s["counts"], s["means"]]]
    if not parts:
        return [None] * len(outs)
    flat, top_k = torch.cat(parts).tolist(), dict((i, m.top_k) for i, m in trainer.model.moe_layers())
    out, pos = [], 0
    for s in steps:
        if not s:
            out.append(None)
            continue
        rows = []
        for layer, counts in zip(s["layers"], s["counts"]):
            values, pos = flat[pos : pos + len(counts)], pos + len(counts)
            total = sum(values) or 1.0
            rows.append([layer, [v / total for v in values], 0.0, top_k.get(layer, 1)])
        for row in rows:  # means: [L, 3] = dropped, entropy, balance per layer
            row[2], pos = flat[pos], pos + 3
        out.append([tuple(r) for r in rows])
    return out


_MEM_TOTAL: list[int] = []


def memory_fraction(device: torch.device) -> float | None:
    """Share of device memory the allocator holds (CUDA), or of machine RAM this process uses
    (CPU, Linux); no device sync either way."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory
    try:
        if not _MEM_TOTAL:
            with open("/proc/meminfo") as fh:
                _MEM_TOTAL.append(int(fh.readline().split()[1]) * 1024)
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss / _MEM_TOTAL[0]
    except (OSError, ValueError, IndexError):
        return None
