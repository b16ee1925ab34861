"""Every orchestrator rule's monitor by name (the names of OrchestratorConfig's sections and of the
journal's `rule`); the policy handles their findings by family (policy.py)."""

from __future__ import annotations

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.divergence import Divergence
from trimtab.orchestrator.dpo_health import PreferenceFall
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.lr_rule import UnexplainedLR
from trimtab.orchestrator.monitors import GradExplosion, Monitor, NonFinite
from trimtab.orchestrator.plateau import Plateau
from trimtab.orchestrator.resources import Fp16Overflow, MemoryPressure, OutOfMemory, Throughput
from trimtab.orchestrator.rl_health import EntropyCollapse, NoLearningSignal
from trimtab.orchestrator.rl_held_out import RewardHacking
from trimtab.orchestrator.rl_reward import RewardFall
from trimtab.orchestrator.rl_rollouts import LengthRunaway, OffPolicy
from trimtab.orchestrator.rl_verifier import VerifierFailures
from trimtab.orchestrator.trends import AboveStart

MONITORS = {
    "nonfinite": NonFinite,
    "spike": LossSpike,
    "grad": GradExplosion,
    "divergence": Divergence,
    "above_start": AboveStart,
    "plateau": Plateau,
    "throughput": Throughput,
    "memory": MemoryPressure,
    "fp16": Fp16Overflow,
    "lr": UnexplainedLR,
    "oom": OutOfMemory,
    "rl_signal": NoLearningSignal,
    "rl_verifier": VerifierFailures,
    "rl_entropy": EntropyCollapse,
    "rl_length": LengthRunaway,
    "rl_hacking": RewardHacking,
    "rl_ratio": OffPolicy,
    "rl_reward": RewardFall,
    "dpo_held_out": PreferenceFall,
}


def build_monitors(cfg: OrchestratorConfig) -> dict[str, Monitor]:
    """Every enabled rule's monitor; non-finite values are always watched."""
    return {name: cls(cfg) for name, cls in MONITORS.items() if name == "nonfinite" or getattr(cfg, name).enabled}
