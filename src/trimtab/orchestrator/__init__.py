"""The orchestrator: monitors -> policy -> actions (through Control) -> journal.

monitors.py  detectors over per-step metrics -> Finding: the kit, and one bad step's detectors
trends.py    detectors of the run's course (above the start; plateau: plateau.py; divergence: divergence.py)
lr_rule.py   an LR the schedule and the multiplier decisions do not explain
resources.py detectors of the machine (throughput, memory, fp16 overflow, OOM)
rules.py     every rule's monitor by name
readings.py  a step's values read off the device in one copy -> StepMetrics fields
policy.py    findings -> decisions: escalation ladder, cooldowns, confidence
remedies.py  the remedies of the one-answer families (memory, MoE, MoD, disk, run length, ...)
journal.py   decisions.jsonl: evidence, reasoning, confidence, outcome (read with trimtab.rundir)
core.py      the trainer hook that ties them together (update gate, OOM, save errors)
deciding.py  a decision taken, advised or demoted, and its announcement (core.py's mixin)
ctl.py       `trimtab ctl`: a person's commands to a running job
faults.py    fault injection for tests and the healing benchmark
fault_specs.py  the --inject syntax (KIND@STEP[:RANK]), parsed without torch
"""

from importlib import import_module

# Resolved on first use, so `trimtab ctl` (orchestrator.ctl) does not pay for importing torch.
_LAZY = {"Orchestrator": "trimtab.orchestrator.core"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trimtab.orchestrator' has no attribute '{name}'")
