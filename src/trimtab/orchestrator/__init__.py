"""The orchestrator: monitors -> policy -> actions (through Control) -> journal.

monitors.py  detectors over per-step metrics -> Finding
policy.py    findings -> decisions: escalation ladder, cooldowns, confidence
journal.py   decisions.jsonl: evidence, reasoning, confidence, outcome
core.py      the trainer hook that ties them together (update gate, OOM, save errors)
ctl.py       `trimtab ctl`: a person's commands to a running job
faults.py    fault injection for tests and the healing benchmark
"""

from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.journal import read_decisions

__all__ = ["Orchestrator", "read_decisions"]
