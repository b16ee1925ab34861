"""Stragglers: one slow rank slows every rank (they wait for it at each collective), and nobody
is told. Every `window` steps each rank's compute over the window (its own work before the steps'
agreement points, distributed/work_clock.py: no wait for the others in it) is gathered; a rank whose speed is below
`threshold` of the fastest rank's for `patience` windows in a row is named with the evidence
(NVIDIA's resiliency extension scores ranks the same way: the best rank's time over this rank's,
0.75 its threshold). Its score against its own best window says whether it slowed down or was
always slow. Logged for a person; with `straggler.exclude` in an elastic job of several nodes,
the job restarts without the slow rank's node (remedies.straggler, action exclude_node).

A rank is named once a slow stretch, and again within it only once its score has fallen under
RENAME x the score it was named at: a first reading on a loaded host (0.71 for a rank 10x slower,
its finding's confidence 0.29 under orchestrator.min_confidence: advice only) must not be the
stretch's only finding when the next windows read it as it is.

Only where every rank holds the whole model (RunView.replicated: DDP). Under FSDP2, tensor, expert
or pipeline parallelism the forwards and backwards hold the model's own collectives (all-gathers,
reduce-scatters, all-reduces, all-to-alls, stage sends), so a fast rank's work before the agreement
point holds its waits for the slow one: measured with slow_rank@3:1:10 on 2 CPU ranks, DDP read
rank 1 at 0.13x, tp=2 read both ranks within 1% of each other, FSDP2 with 4 micro-batches at 0.78x
(over the threshold: nothing named); FSDP2 with one micro-batch named rank 1 only because the fault
sleeps after the forward's last all-gather. Timing the waits inside torch's collectives needs hooks
torch does not give, so there rank 0 says at the first step that the rule does not run (unjudged)
rather than judge ranks it cannot tell apart.
"""

from __future__ import annotations

from typing import Any

from trimtab.config.distributed import DistributedConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.distributed import all_gather_floats
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.replicas import splits

RENAME = 0.5


def unjudged(dist: DistributedConfig, world: int) -> str:
    """The console line of a run whose ranks split the model, where no rank's own work can be told
    from its waits for the others (the module's docstring): said once a session, not a silent skip."""
    ways = ", ".join(splits(dist, world)) or "sharded"
    return (
        f"orchestrator.straggler does not run: the {world} ranks split the model ({ways}), so each step's "
        "forwards and backwards hold its collectives and a fast rank's compute holds its waits for a slow one: "
        "every rank would read alike. A slow rank shows only in the job's speed (tok/s, MFU); compare the "
        "ranks' devices by hand. Set orchestrator.straggler.enabled=false not to be told (docs/resilience.md)"
    )


class Stragglers:
    rule, family = "straggler", "straggler"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.straggler
        self.steps = 0
        self.work = 0.0  # RunView.work_s at the window's start
        self.strikes: dict[int, int] = {}  # rank -> windows in a row below the threshold
        self.named: dict[int, float] = {}  # rank -> its score when named in this slow stretch
        self.best: list[float] = []  # each rank's fastest window (seconds of compute per step)
        self.said = False  # this session said that the rule does not run (unjudged)

    def unjudged_once(self, dist: DistributedConfig, world: int) -> str:
        """unjudged's line the first time a session asks, '' after (said at the first step)."""
        said, self.said = self.said, True
        return "" if said else unjudged(dist, world)

    def observe(self, step: int, work_s: float) -> Finding | None:
        """A step done, this rank's own work `work_s` seconds so far (RunView.work_s); every
        `window` steps (on every rank alike: a collective), the finding when a rank has been slow
        for `patience` windows."""
        self.steps += 1
        if self.steps < self.cfg.window:
            return None
        mine = (work_s - self.work) / self.steps
        self.steps, self.work = 0, work_s
        compute = [max(row[0], 1e-9) for row in all_gather_floats([mine])]
        self.best = [min(b, c) for b, c in zip(self.best, compute)] if self.best else list(compute)
        fastest = min(compute)
        scores = [fastest / c for c in compute]
        for rank, score in enumerate(scores):
            slow = score < self.cfg.threshold
            self.strikes[rank] = self.strikes.get(rank, 0) + 1 if slow else 0
            if not slow:
                self.named.pop(rank, None)
        due = [
            r
            for r, n in self.strikes.items()
            if n >= self.cfg.patience and (r not in self.named or scores[r] < RENAME * self.named[r])
        ]
        if not due:
            return None
        self.named |= {r: scores[r] for r in due}
        return self._finding(step, due, compute, scores)

    def unname(self, ranks: list[int]) -> None:
        """Ranks whose finding was not acted on (an emergency at its step: deciding.py emergency_at):
        named again at their next slow window, not left unnamed until they slow down by RENAME."""
        for rank in ranks:
            self.named.pop(rank, None)

    def _finding(self, step: int, ranks: list[int], compute: list[float], scores: list[float]) -> Finding:
        own = {r: self.best[r] / compute[r] for r in ranks}
        evidence: dict[str, Any] = {
            "ranks": ranks,
            "compute_s_per_step": [round(c, 6) for c in compute],
            "scores": [round(s, 3) for s in scores],
            "own_scores": {str(r): round(v, 3) for r, v in own.items()},
            "threshold": self.cfg.threshold,
            "windows": self.cfg.patience,
            "window": self.cfg.window,
        }
        worst = min(ranks, key=lambda r: scores[r])
        history = "slower than its own best" if own[worst] < self.cfg.threshold else "as slow as ever"
        summary = (
            f"rank {', '.join(map(str, ranks))} computes at {scores[worst]:.2f}x the fastest rank's speed "
            f"({compute[worst] * 1e3:.1f} vs {min(compute) * 1e3:.1f} ms a step) for {self.cfg.patience} "
            f"windows of {self.cfg.window} steps ({history}); every rank waits for it"
        )
        return Finding(
            rule=self.rule,
            family=self.family,
            step=step,
            evidence=evidence,
            summary=summary,
            strength=1 - scores[worst],
        )

    def state_dict(self) -> dict[str, Any]:
        named = {str(k): v for k, v in self.named.items()}
        return {"strikes": {str(k): v for k, v in self.strikes.items()}, "named": named, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strikes = {int(k): v for k, v in state.get("strikes", {}).items()}
        named = state.get("named", {})  # a list of ranks before their scores were kept: as if named at the threshold
        self.named = (
            {int(k): v for k, v in named.items()}
            if isinstance(named, dict)
            else dict.fromkeys(named, self.cfg.threshold)
        )
        self.best = list(state.get("best", []))
