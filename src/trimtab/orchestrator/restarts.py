"""The hook that keeps the goodput ledger (resilience/goodput.py) and tells the orchestrator of a
restart: a session that begins where a lost one ended proposes a `restart` finding (rule
`restart`, family `cluster`) with what the lost session's files say (resilience/incidents.py),
journaled like any decision: which rank, the step, the world before and after, steps lost, the
time down.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.distributed import broadcast_object, is_main
from trimtab.orchestrator.fallbacks import fallback_finding
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import ranks
from trimtab.resilience.elastic import node_count
from trimtab.resilience.goodput import Ledger
from trimtab.resilience.incidents import last_life, last_logged_step, localize, reach_words
from trimtab.resilience.procs import process_start
from trimtab.training.hooks import Hook
from trimtab.training.resume import take_fallback

if TYPE_CHECKING:
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView


def process_started() -> float:
    """This process's start (wall time; now where /proc cannot say)."""
    return process_start(os.getpid()) or time.time()


def restart_count() -> int:
    """torchrun's count of this job's restarts (0: the first launch, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resized(previous: dict[str, Any], step: int, world: int) -> dict[str, Any]:
    """The evidence of a world change at a clean restart (not an incident: nothing was lost), e.g.
    torchrun's agent stopping the job to admit a node that came back (--nnodes MIN:MAX), or a person
    resuming a finished run on another world. The time since the previous session ended is `idle_s`,
    not `down_s`: that session ended cleanly (its summary written), so the gap was nobody's failure,
    and goodput.json counts no down time for it (resilience/goodput.py: Ledger.open): a finished run
    resumed on 2 ranks was journaled "413.4 s down", a person's wait between two launches."""
    return {
        "kind": "resized",
        "step": previous["step"],
        "resumed_step": step,
        "steps_lost": max(0, previous["step"] - step),  # none when it saved where it stopped
        "down_s": 0.0,
        "idle_s": round(max(0.0, process_started() - previous["beat"]), 3),
        "ended": str(previous.get("end"))[:80],  # its status: completed, stopped (SIGTERM), ...
        "restart": restart_count(),  # 0: a new launch, not torchrun's agent restarting the job
        "world_before": previous["world"],
        "world_after": world,
        "nodes_after": node_count(),
    }


class Resilience(Hook):
    def __init__(self, run_dir: str | Path, journal: bool = True):
        self.run_dir = Path(run_dir)
        self.journal = journal  # propose restarts to the orchestrator (off: it does not run)
        self.ledger: Ledger | None = None  # rank 0's: it writes goodput.json
        self.incident: dict[str, Any] | None = None  # this session's restart incident, until the first step
        self.last_end = 0.0  # wall time the previous step ended (the process start before the first)
        self.pending = {"checkpoint": 0.0, "evaluation": 0.0}  # between two steps
        self.steps = 0  # this session's
        self.reached = 0  # the furthest step an earlier session trained (rank 0: the ledger's)
        self.furthest = 0  # this session's furthest step, from its resumed one (a rollback before it: the trainer's)
        self.retrained = 0  # steps this session trained first at a position an earlier session reached
        # before the loggers drop the lines a lost session logged past its checkpoint (rank 0 reads)
        self.logged = last_logged_step(self.run_dir) if is_main() else 0

    def on_train_start(self, run: RunView) -> None:
        started = process_started()
        self.last_end = started
        self.furthest = run.step
        incident = None
        # read on every rank alike: an RL loader's state gathers its ranks' batches ahead (a collective), so
        # rank 0 reading it alone hung a 2-rank `trimtab rl` restart (rank 1 waiting in the broadcast below)
        position = run.data_position
        if run.is_main:
            self.ledger = Ledger(self.run_dir)
            previous = self.ledger.sessions[-1] if self.ledger.sessions else None
            life, step = last_life(self.run_dir, previous["started"]) if previous else (0.0, 0)
            step = max(step, self.logged)
            if previous is not None and previous.get("end") is None:
                previous["step"] = max(previous["step"], step)
                self.ledger.high = max(self.ledger.high, step)
            self.reached = self.ledger.high
            incident = self.ledger.open(started, run.step, run.world, restart_count(), life)
            if incident is not None:
                incident.update(
                    localize(self.run_dir, previous["started"], f"session{incident['session']}", previous["world"])
                )
                if incident["kind"] == "hang":  # its wait on the stalled rank: goodput's `hang`, not `other`
                    self.ledger.hung(incident)
                incident["nodes_after"] = node_count()
                self.ledger.write(force=True)
            elif previous is not None and previous["world"] != run.world:  # a clean stop, then another world
                incident = resized(previous, run.step, run.world)
            if incident is not None and position:  # the step alone does not say it on another world
                incident["data_at"] = position
        incident = broadcast_object(incident)  # every rank's orchestrator journals it alike
        if incident is not None:
            self.incident = incident
            self._tell(run, restart_finding(incident, run.step))
        self._fell_back(run)

    def _tell(self, run: RunView, finding: Finding) -> None:
        """The orchestrator's decision on `finding` is its one console line (`[orchestrator] step N rule:
        summary -> resume ...`); this hook's own line only where no orchestrator decides (mode off): both
        said the same event twice."""
        if self.journal:
            run.propose(finding)
        else:
            run.say(f"[resilience] {finding.summary}")

    def _fell_back(self, run: RunView) -> None:
        """Journal the corrupt checkpoints this session's resume passed over (orchestrator/fallbacks.py)."""
        record = broadcast_object(take_fallback(self.run_dir, run.step) if run.is_main else None)
        if record is not None:
            self._tell(run, fallback_finding(record, run.step, run.world))

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        if self.ledger is None:
            return
        now = time.time()
        between = max(0.0, now - out.seconds - self.last_end)  # since the previous step: saves, evaluations, hooks
        checkpoint, evaluation = self.pending["checkpoint"], self.pending["evaluation"]
        self.ledger.add("checkpoint", checkpoint)
        self.ledger.add("evaluation", evaluation)
        rest = max(0.0, between - checkpoint - evaluation)
        first, self.steps = not self.steps, self.steps + 1
        # a rollback's replays are the trainer's steps_replayed already: only this session's new furthest counts
        self.retrained += int(self.furthest < out.step <= self.reached)
        self.furthest = max(self.furthest, out.step)
        self.ledger.add("start_up" if first else "other", rest)
        if first and self.incident is not None and self.incident["kind"] != "resized":  # a ledger incident
            incident = self.ledger.incidents[-1]
            incident["recover_s"] = round(incident["down_s"] + rest + checkpoint, 3)
        self.ledger.step(out.step, out.seconds)
        self.pending = {"checkpoint": 0.0, "evaluation": 0.0}
        self.last_end = now
        self.ledger.write()

    def on_checkpoint(self, run: RunView, path: Path) -> None:
        self.pending["checkpoint"] += run.save_seconds

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._evaluated()

    def on_eval_error(self, run: RunView, step: int, error: str) -> None:
        self._evaluated()

    def _evaluated(self) -> None:
        """An evaluation just ended: it ran since the step before it (the loop evaluates first)."""
        self.pending["evaluation"] += max(0.0, time.time() - self.last_end)

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        if self.ledger is None:
            return
        self.ledger.add("checkpoint", self.pending["checkpoint"])  # the final save
        self.ledger.add("evaluation", self.pending["evaluation"])
        self.pending = {"checkpoint": 0.0, "evaluation": 0.0}
        self.ledger.close(summary["status"])
        summary["goodput"] = self.ledger.summary()
        self._retrained(summary)

    def _retrained(self, summary: dict[str, Any]) -> None:
        """The steps a restart trained again (from its checkpoint up to where the lost session got) are
        replayed steps as a rollback's are: summary.json said `steps_replayed: 0` after a kill at step 19
        resumed from step 15, its steps 16-18 trained twice (goodput.json counted them `redone`)."""
        if "steps_replayed" in summary:  # a start-up stop's summary has none
            summary["steps_replayed"] += self.retrained
            summary["steps_replayed_after_restart"] = self.retrained


def restart_finding(incident: dict[str, Any], step: int) -> Finding:
    kind = incident.get("kind", "lost_rank")
    blamed = incident.get("ranks_to_blame") or []
    who = f"rank {', '.join(map(str, blamed))}" if blamed else "the job"
    nodes = ", ".join(map(str, incident.get("nodes_to_blame", [])))
    what = {
        "hang": f"{who} stopped in {incident.get('section')} and did not answer the alarm (frozen or gone; its "
        f"last beat {incident.get('beat_age_s', 0):.0f} s before the alarm)"
        if incident.get("silent")
        else f"{who} stopped in {incident.get('section')} for {incident.get('stalled_s', 0):.0f} s "
        f"(timeout {incident.get('timeout_s') or 0:.0f} s)",
        "lost_rank": f"{who} lost without a word",
        "lost_unknown": f"the session of {incident.get('world_before', 'several')} ranks ended with no record of "
        "what ended it (resilience.watchdog off: no beats, no exit records; a rank lost or failed, or the whole job)",
        "lost_elsewhere": f"the session of {ranks(incident.get('world_before', 1))} ended in another run directory, "
        f"with no record of what ended it here (this one was restored from {incident.get('restored_from')}, which "
        "holds no rank records)",
        "lost_job": f"every rank ({len(incident.get('ranks', {}))}, host {', '.join(incident.get('hosts', []))}) "
        "went silent at once, none with an exit record: not one rank's fault but the whole job's (its node or "
        "network, the run directory's storage, or a kill from outside)",
        "lost_process": "the process ended without a word (SIGKILL, the OOM killer, its machine)",
        "lost_node": f"node {nodes} ({who}, host {', '.join(incident.get('hosts_to_blame', []))}) lost without a word",
        "crash": f"{who} failed: {str(incident.get('error'))[:120]}",
        "resized": f"the previous session ended cleanly ({incident.get('ended') or 'its summary written'}) and the "
        "job came back on another world (a node joined or left, or another launch)",
        "excluded": f"node {nodes} ({who}) excluded by the orchestrator (a straggler or a suspect device)",
    }[kind]
    before, after = incident["world_before"], incident["world_after"]
    world = ranks(after) + (f" (was {before})" if before != after else "")
    at, lost = reach_words(incident)
    # after a clean end the gap is idle time, not time lost (resized)
    gap = f"{incident['idle_s']:.1f} s idle" if "idle_s" in incident else f"{incident['down_s']:.1f} s down"
    if "hang_s" in incident:  # the lost session's wait on the stalled rank (goodput's `hang`)
        gap += f", {incident['hang_s']:.1f} s waiting on the hang"
    data = f" (data at {incident['data_at']})" if incident.get("data_at") else ""
    return Finding(
        rule="restart",
        family="cluster",
        step=step,
        evidence=incident,
        summary=f"{what} {at}; resumed at step {incident['resumed_step']}{data} on {world} ({lost} lost, {gap})",
        strength=1.0,
    )
