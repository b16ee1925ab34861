"""The orchestrator's side of checkpoints: the held-out reference a good save carries (measured before its
state is taken), a failed save's decision (rule disk), and which checkpoints are good rollback targets
(healthy) or kept past pruning (kept_checkpoints). A part of the Orchestrator (core.py)."""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.checkpoint import checkpoint_root, list_checkpoints
from trimtab.distributed import all_max
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.outcomes import SETTLED
from trimtab.orchestrator.policy import Policy

if TYPE_CHECKING:
    from trimtab.training.view import RunView

FRESH_EVERY = 10  # steps between held-out probes before a phase's first good checkpoint (_fresh_reference)
# room to spare beyond a checkpoint's bytes (room_keep): the metrics, the journal and the logs written meanwhile
ROOM_MARGIN = 1 << 20


class SaveGuard:
    """The Orchestrator's handling of checkpoints (it holds the state named here)."""

    mode: str
    paused: set[str]
    monitors: dict[str, Any]
    policy: Policy
    save_stall: float  # this rank's newest save, until _read agrees it over the ranks
    failed_saves: int  # saves failed since the last that worked (a stretch of work at risk)
    failing_since = -1  # the step of the first of them (-1: none): the disk rule stops an interval after it
    stood_at: int  # the last step with an instability finding whose update was applied (healthy)
    # the references a save being written replaced (probe_baseline, start_probe)
    _baseline_before: tuple[float | None, float | None] | None
    decide: Callable[..., Any]  # a finding, decided and journaled (deciding.py)
    journal: Any  # the decisions journal (journal.py)
    _seen_again: Callable[..., Any]  # a finding counted on the decision it came back to (deciding.py)
    # the session's disk decision whose freeing worked: the same lack of space again is the same incident
    _disk_incident: Any = None

    def on_save_error(self, run: RunView, exc: OSError) -> bool:
        """A failed save: the disk rule's remedy is requested; the trainer applies it before the
        save returns (a failure of that retry does not come back here: training goes on, and the
        trainer tries again at the next steps, checkpointing.py _owe_save, each failure back here)."""
        if self._baseline_before is not None:  # the checkpoint measured is not on disk: nor its reference
            (self.policy.probe_baseline, self.policy.start_probe), self._baseline_before = self._baseline_before, None
        if self.mode != "auto":
            return False
        if run.stopping:
            return True  # the final save of a stop already decided: the resume point stays on disk
        self.failed_saves += 1
        self.failing_since = self.failing_since if self.failed_saves > 1 else run.step
        f = self._save_finding(run, exc)
        if self.failed_saves == 1 and self._again(run, f):
            return True
        decision = self.decide(run, f)
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self._disk_incident = decision if full and decision.action == "save_checkpoint" else None
        return True

    def _again(self, run: RunView, f: Finding) -> bool:
        """A save out of space again after this session's disk decision freed room and its save was written:
        the same incident, not a new decision at each save (a debug run on a tmpfs holding two checkpoints
        journaled one at every save, 10 in 60 steps). Its remedy is requested again and the recurrence
        counted on that decision (seen_again, last_seen_at); a retry that fails ends the incident (the next
        failure is decided anew, and a whole interval of them stops the run: remedies.disk)."""
        first = self._disk_incident
        if first is None or f.evidence["errno"] not in (errno.ENOSPC, errno.EDQUOT):
            return False
        if first.mode != "auto" or (first.outcome or {}).get("result") == "failed":
            self._disk_incident = None
            return False

        self._seen_again(first, f)
        run.control.request(first.action, on_done=self._incident_done(first, f.step), **first.params)
        return True

    def _incident_done(self, first: Any, step: int) -> Callable[[str], None]:
        """What the incident's freeing and save at `step` did, on its decision: a failure ends the incident."""

        def done(line: str) -> None:
            failed = line.startswith("failed: ")
            if failed or "snapshot" in line:  # a retry that failed, or a stop's snapshot freed: said on it
                first.applied.append(f"step {step}: {line}")
            if failed and self._disk_incident is first:  # this time freeing did not make room: the incident is over
                self._disk_incident = None
            self.journal.write()

        return done

    def room_for_save(self, run: RunView) -> int | None:
        """While a disk incident lasts, a save about to write that would not fit in the space left is made room
        for first: how many of the newest checkpoints may stay (room_keep; the trainer keeps the essential ones
        besides, Checkpointing.essential_checkpoints); None: it fits, or no incident. Asked by every save the
        run makes (Checkpointing.save), not only those due at checkpoint.every: on a 16 MiB tmpfs (debug, every
        5, 23 steps) the final save at step 23 failed once before its retry was written; now none after the
        first. Every rank asks (all_max agrees). Once space is freed (a person's cleanup) the saves keep
        checkpoint.keep again."""
        first = self._disk_incident
        if first is None or first.mode != "auto" or self.mode != "auto":
            return None
        return _agreed(room_keep(run.run_dir, first.params.get("keep", 1)))

    def on_room_made(self, run: RunView, freed: int, line: str) -> None:
        """The freeing room_for_save asked for, done: counted on the incident's decision (made_room, and the
        checkpoints it deleted: freed), a stop's snapshot it deleted said in its applied lines."""
        first = self._disk_incident
        if first is None:
            return
        first.evidence["made_room"] = first.evidence.get("made_room", 0) + 1
        first.evidence["freed"] = first.evidence.get("freed", 0) + freed
        if "snapshot" in line:
            first.applied.append(f"step {run.step}: {line.removesuffix('; ')}")
        self.journal.write()

    def incident_state(self) -> dict[str, Any]:
        """The disk incident under way, by its decision's id, in the checkpoint: a resumed session on the same
        full disk carries on with it (before: its first failed save journaled a new decision)."""
        return {"disk_incident": None if self._disk_incident is None else self._disk_incident.id}

    def load_incident(self, state: dict[str, Any]) -> None:
        wanted = state.get("disk_incident")  # older checkpoints: none
        self._disk_incident = next((d for d in self.journal.decisions if d.id == wanted), None)

    def _save_finding(self, run: RunView, exc: OSError) -> Finding:
        """The disk rule's finding for failed save `exc`."""
        return Finding(
            rule="disk",
            family="disk",
            step=run.step,
            evidence={
                "error": str(exc)[:200],
                "errno": exc.errno,
                "failures": self.failed_saves,
                "last_saved": run.last_saved,
                "failing_since": self.failing_since,
                "every": run.checkpoint_every,
            },
            summary=f"checkpoint save failed ({os.strerror(exc.errno) if exc.errno else exc})",
            strength=1.0,
        )

    def on_save_prepare(self, run: RunView, good: bool) -> None:
        """A good checkpoint's held-out loss, the reference a diagnosis and the end check compare
        with, measured before its state is taken: in that checkpoint, so a resume from it judges
        against it (measured once the save was done, each checkpoint held the one before's, and a
        background save's never matched its step: the end check was never armed). In advise mode
        too: a person's `ctl mode auto` later diagnoses against it."""
        if self.mode != "off" and good:
            self._baseline_before = (self.policy.probe_baseline, self.policy.start_probe)
            self.policy.measured(run.probe_loss(), run.step)

    def _fresh_reference(self, run: RunView) -> None:
        """Until a good checkpoint of the phase is measured, the reference a diagnosis compares the
        held-out probe with is its untouched weights' score, and weights wrecked a few dozen steps
        in score no worse (debug: 6.27 against 6.25 at step 0): a diagnosis took them for sound and
        blamed the data, and the ladder cut the LR for nothing (weights_noise at step 19, before the
        first checkpoint at 20: +2.2%). So meanwhile the probe is also read every FRESH_EVERY steps
        while the run is calm (one held-out micro-batch's forward); the lower of the two is the
        reference (Policy.reference)."""
        p = self.policy
        if self.mode == "off" or run.last_good > p.phase_start or run.step % FRESH_EVERY or not self._calm(run):
            return
        p.fresh_probe = run.probe_loss()

    def on_checkpoint(self, run: RunView, path: Path) -> None:
        self.save_stall = run.save_seconds  # the stall the save cost training (the interval rule's C)
        self.failed_saves = 0
        self._baseline_before = None  # the checkpoint measured is on disk
        for d in self.journal.pending():  # a failed save's retry is judged on the saves after it (outcomes.py)
            if d.rule == "disk":
                d.evidence["saves_after"] = d.evidence.get("saves_after", 0) + 1
                d.evidence["saved_at"] = run.step

    def healthy(self, run: RunView) -> bool:
        """A good rollback target: no escalation under way, and no instability in the last SETTLED
        steps, or only findings whose updates the gate withheld (they never touched the weights)
        and a held-out probe of the weights as sound as a diagnosis asks (Policy.learned). A save
        falls on a withheld step's own step as often as not: debug, a NaN every 10 steps with
        checkpoint.every 10, had no good checkpoint after step 0 and the rollback at step 60 lost
        every step. The probe keeps out weights that an applied update broke before the flagged
        step (a spike shows on the step after the update that caused it)."""
        if self._calm(run):
            return True
        withheld_only = self.stood_at < 0 or run.step - self.stood_at > SETTLED
        if self.mode != "auto" or self.policy.ladder.rung or not withheld_only:
            return False
        return self.policy.learned(run.probe_loss())

    def _calm(self, run: RunView) -> bool:
        """No escalation under way and no instability finding in the last SETTLED steps."""
        ladder = self.policy.ladder
        return ladder.rung == 0 and (ladder.last_step < 0 or run.step - ladder.last_step > SETTLED)

    def kept_checkpoints(self, run: RunView) -> tuple[int, ...]:
        """The phase's first checkpoint while the LR rule may still restore it (AboveStart.keeps_start),
        the policy rl_reward would restore (its good_step: the last before the fall began), the one
        rl_length would while the share cut is risen (its short_step: the last whose responses still ended), and
        rl_hacking's and dpo_held_out's best (their held-out readings', not always the trainer's best evaluation:
        pruned, the rollback landed on an older checkpoint, or found none and the run stopped)."""
        if self.mode != "auto":
            return ()
        kept: tuple[int, ...] = ()
        lr_rule, reward = self.monitors.get("above_start"), self.monitors.get("rl_reward")
        if "above_start" not in self.paused and lr_rule is not None and lr_rule.keeps_start(run.step):
            kept = (lr_rule.first_step - 1,)
        if "rl_reward" not in self.paused and reward is not None and reward.first is not None:
            kept = (*kept, reward.good_step)
        length = self.monitors.get("rl_length")
        if "rl_length" not in self.paused and length is not None and length.rising:
            kept = (*kept, length.short_step)
        hacking, dpo = self.monitors.get("rl_hacking"), self.monitors.get("dpo_held_out")
        if "rl_hacking" not in self.paused and hacking is not None and hacking.best is not None:
            kept = (*kept, hacking.best_step, *hacking.top[2:])  # the best reward's step; the best count's
        if "dpo_held_out" not in self.paused and dpo is not None and dpo.best:
            kept = (*kept, int(dpo.best[2]))
        return kept


def room_keep(run_dir: Path, floor: int) -> int | None:
    """How many of the newest checkpoints may stay for one more of the newest's bytes to fit in the space left,
    with ROOM_MARGIN (at least `floor`, the disk rule's keep); None: it fits beside them all."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    size = sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file())
    short = size + ROOM_MARGIN - shutil.disk_usage(checkpoint_root(run_dir)).free
    if short <= 0:
        return None
    return max(floor, len(found) - math.ceil(short / max(size, 1)))


def _agreed(keep: int | None) -> int | None:
    """The fewest checkpoints any rank's room_keep leaves (None: the save fits on every rank)."""
    (lowest,) = all_max([-math.inf if keep is None else -float(keep)])
    return None if lowest == -math.inf else int(-lowest)
