"""Run by tests/test_distributed.py, alone or under torchrun: train the debug preset (or the
config's "preset"), then write
what this rank saw (per-step loss, the orchestrator's decisions, knobs, a weight digest) to
RECORD with {rank} filled in ({world} and {first}, the session's first step, where it names them).

    python tests/dist_worker.py '{"out": ...}' RECORD                     (one process)
    torchrun --standalone --nproc_per_node 2 tests/dist_worker.py '{...}' RECORD
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trimtab.api import built_in_hooks
from trimtab.config import load_config
from trimtab.orchestrator import Orchestrator
from trimtab.runlock import run_lock
from trimtab.training.instrument import Instrument
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer

DECISION_KEYS = ("step", "rule", "action", "params", "mode", "applied", "confidence")


class Recorder(Instrument):
    """What one rank saw; every value is rank-independent when the ranks agree. A test
    instrument: it reads the final weights through its FaultHandle (a hook's view has no model)."""

    def __init__(self, gain: bool = False) -> None:
        self.steps: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {}
        self.gain = gain  # ask for the update gain every step and record it (tests/test_gain_sharded.py)

    def measure_gain(self, run) -> bool:
        return self.gain

    def on_step_end(self, trainer, out) -> None:
        self.steps.append(
            {
                "step": out.step,
                "loss": out.loss.item(),
                "grad_norm": out.grad_norm.item(),
                "skipped": bool(out.skipped) if out.skipped is not None else False,
                "micro_batches": len(out.batch.micro),
                "aux": out.aux_loss.item() if out.aux_loss is not None else None,
                "moe": [c.tolist() for c in out.moe["counts"]] if out.moe else None,
                "mod": out.mod["means"].tolist() if out.mod else None,
                "rows": sorted(self._mine(out.batch)),  # this rank's
            }
            | ({"gain": None if out.update_gain is None else float(out.update_gain)} if self.gain else {})
        )

    def _mine(self, batch) -> list[int]:
        """This rank's rows of the step: its share (the trainer's data shard), or all in one process."""
        return batch.rows if batch.shares is None else batch.shares[self.handle._trainer.data_shard[0]]

    def on_train_end(self, trainer, summary) -> None:
        decisions = [{k: d[k] for k in DECISION_KEYS} for d in map(asdict, self.orchestrator.journal.decisions)]
        # FSDP holds a shard per rank: gather each weight whole (a collective, on every rank).
        weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.handle.model.parameters()]
        self.result = {
            "rank": trainer.rank,
            "world": trainer.world,
            "steps": self.steps,
            "decisions": decisions,
            "state": trainer.train_state,
            "weights": [float(w.detach().double().abs().sum()) for w in weights],
            "summary": {k: summary[k] for k in ("status", "step", "tokens", "params")},
        }


def main() -> str:
    """Train; write this rank's record; return the run's status."""
    torch.set_num_threads(1)
    overrides = json.loads(sys.argv[1])
    gain = overrides.pop("measure_gain", False)  # not a config key: the recorder's
    cfg = load_config(preset=overrides.pop("preset", "debug"), overrides=overrides)
    recorder = Recorder(gain)
    hooks = built_in_hooks(cfg)
    recorder.orchestrator = next(h for h in hooks if isinstance(h, Orchestrator))
    with run_lock(cfg.run_dir):  # as `trimtab train` holds it: one job per run directory
        Trainer(setup(cfg), hooks=[*hooks, recorder]).fit()
    first = recorder.steps[0]["step"] if recorder.steps else None  # this session's first step
    record = sys.argv[2].format(rank=recorder.result["rank"], world=recorder.result["world"], first=first)
    Path(record).write_text(json.dumps(recorder.result))
    return recorder.result["summary"]["status"]


if __name__ == "__main__":
    status = main()
    # A worker forked by torchrun's agent (tests/helpers.py TORCHRUN) that returns waits for the
    # agent's word that every worker has; an agent stopping its workers (SIGTERM: a node joined the
    # job) never gives it, and kills them 30 s later. A rank stopped leaves, as a process would.
    if status.startswith("stopped") and multiprocessing.parent_process() is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
