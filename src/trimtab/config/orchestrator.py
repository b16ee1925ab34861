"""The `orchestrator:` section: mode, escalation ladder, and one sub-section per rule.

Defaults follow what other trainers use and what the healing benchmark measured (see
docs/orchestrator.md): OLMo-core skips at 6 sigma over 128 steps, LuminaAI flags a spike at
mean + 2 sigma with a 0.1 rise and a gradient norm above 100 or 10x its mean, Composer halves the
micro-batch on OOM. Every rule has `enabled`, so a person can switch one off without the others.
The rules of an RL run (orchestrator.rl_*) are config/rl_rules.py's, those on the loss and the gradient
(spike, grad, above_start, divergence) config/loss_rules.py's, those on bad rows (data, rows, row_gate)
config/row_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check, _positive
from trimtab.config.loss_rules import AboveStartRule, DivergenceRule, GradRule, SpikeRule, check_loss_rules
from trimtab.config.rl_rules import (
    DPOHeldOutRule,
    RLEntropyRule,
    RLHackingRule,
    RLLengthRule,
    RLRatioRule,
    RLRewardRule,
    RLSignalRule,
    RLVerifierRule,
    check_rl_rules,
)
from trimtab.config.row_rules import DataRule, RowGateRule, RowsRule, check_row_rules

MODES = ("auto", "advise", "off")


@dataclass
class PlateauRule(Section):
    """Loss variance below `variance` for `window` steps while far from the planned end."""

    enabled: bool = True
    window: int = 50
    variance: float = 1e-3
    max_progress: float = 0.8  # only before this fraction of the run: a late plateau is convergence
    lr_factor: float = 1.5
    max_lr_scale: float = 2.0  # the LR is never raised above this multiple of the schedule


@dataclass
class OomRule(Section):
    """Out of memory: halve the micro-batch (more accumulation), retry the same batch; at one row,
    recompute more activations (train.activation_checkpointing off -> selective -> full)."""

    enabled: bool = True
    max_retries: int = 8  # retries within one step (halvings, then more recompute) before giving up
    recompute: bool = True  # at one row: checkpoint more before giving up (steps run slower)
    probe_after: int = 200  # clean steps before trying lighter checkpointing or a doubled micro-batch (0: never)


@dataclass
class MemoryRule(Section):
    """Memory in use above `threshold` of the device (or the machine, on CPU)."""

    enabled: bool = True
    threshold: float = 0.92
    patience: int = 3  # consecutive readings above the threshold


@dataclass
class ThroughputRule(Section):
    """Tokens/s below `factor` x its rolling median for `patience` steps. Logged for a person,
    never acted on: after a finding the rule is quiet for `cooldown` steps unless the rate falls
    below half of what it reported (a loaded machine would fill the journal)."""

    enabled: bool = True
    window: int = 50
    min_samples: int = 10
    factor: float = 0.5
    patience: int = 5
    cooldown: int = 200


@dataclass
class StragglerRule(Section):
    """Under torchrun, a rank whose compute per step (its own work from the step's start to its
    agreement point, no wait for the others in it: distributed/work_clock.py) is below `threshold`
    of the fastest rank's speed for `patience` windows of `window` steps is named (NVRx's straggler
    score and threshold; logged for a person)."""

    enabled: bool = True
    window: int = 20
    threshold: float = 0.75
    patience: int = 3
    # restart without the straggler's node when the job is elastic (torchrun --nnodes MIN:MAX,
    # several nodes): save, end that node's agent and ranks, resume on the others. Off: logged only
    exclude: bool = False


@dataclass
class RerunRule(Section):
    """A step the update gate flagged is computed again (resilience.rerun; training/rerun.py); a
    different result is a transient fault, and under DDP the rank whose own gradient differed is
    named. A rank named `suspect_after` times is a suspect device (Megatron-LM counts them too)."""

    suspect_after: int = 2
    # restart without the suspect's node when the job is elastic (as straggler.exclude). Off: named
    exclude: bool = False


@dataclass
class ReplicasRule(Section):
    """Data-parallel replicas (every rank holding the whole model: DDP) agree: every `every` steps
    each rank's exact checksum of its weights (their bits summed as integers) is gathered; a rank
    that differs from the others holds silently corrupted weights (a bit flip that stays finite)
    and the run rolls back to the last checkpoint from when they agreed."""

    enabled: bool = True
    every: int = 50


@dataclass
class CheckpointIntervalRule(Section):
    """Checkpoints as often as Young's optimum, sqrt(2 x save stall x MTBF) (Young 1974), when that
    is more often than checkpoint.every: the save stall measured (the slowest rank's), the MTBF
    `mtbf_hours` or, at 0, the world size at Llama 3's failure rate (trimtab/plan/resilience.py).
    Changes the interval when it moves by more than `tolerance` of it."""

    enabled: bool = True
    mtbf_hours: float = 0.0
    tolerance: float = 0.2
    # the run's own rollbacks count as failures in the MTBF (orchestrator/interval.py): after a rollback
    # the checkpoints come closer, and so do the later rollbacks' targets (fewer steps replayed)
    rollbacks: bool = True


@dataclass
class Fp16Rule(Section):
    """GradScaler overflow storm: at least `max_overflows` skipped steps within `window`, beyond the
    one each train.loss_scale.growth_interval steps the scaler's own growth costs."""

    enabled: bool = True
    window: int = 20
    max_overflows: int = 5
    lr_factor: float = 0.5


@dataclass
class LRRule(Section):
    """The LR the optimizer applies is more than `factor` above what the config's schedule and the
    journaled multiplier explain: a stray writer of the optimizer's LR or a schedule bug, not a
    decision. The step is skipped and the multiplier brings the LR back to the explained level.
    Schedules the config asks for (warm-up, cycles, restarts) and length changes are explained."""

    enabled: bool = True
    factor: float = 3.0


@dataclass
class MoERule(Section):
    """Mixture-of-Experts health, per MoE layer, over the mean load of the last `window` steps."""

    enabled: bool = True
    window: int = 20
    imbalance: float = 2.5  # busiest expert's load / fair share -> raise the balance coefficient
    collapse: float = 0.9  # busiest share >= this x the most one expert can take (1 / top_k)
    dead_load: float = 0.02  # an expert below this x fair share ...
    dead_patience: int = 30  # ... for this many steps is dead -> re-initialised
    prune_dead: bool = False  # an expert dead again after its re-init is pruned
    max_drop: float = 0.15  # mean dropped fraction -> capacity factor x1.25
    # imbalance and drops that shrank to this fraction of a window ago are healing by themselves
    improving: float = 0.8
    # before this step imbalance, drops and saturation are left to the balance loss: a fresh router
    # (random init) takes tens of steps to spread its tokens (clean debug-moe: 20-40% dropped until
    # step ~45); collapse and dead experts, which do not heal by themselves, are answered from the start,
    # and so is an imbalance no lower than a full window ago (a router that is not spreading: MoEHealth._stuck)
    grace_steps: int = 100
    max_capacity: float = 4.0
    max_balance_coef: float = 0.1
    add_experts: bool = False  # a saturated layer (busiest > imbalance x fair, tokens dropped) grows
    max_experts: int = 64


@dataclass
class MoDRule(Section):
    """Mixture-of-Depths quality: the loss of the last `recent` steps is above the mean of the
    `window` steps before them by `tolerance` (a fraction) while the capacity fell by at least
    `min_drop` between the two -> the capacity goes back to where it was before the fall."""

    enabled: bool = True
    window: int = 10
    recent: int = 3
    tolerance: float = 0.05
    min_drop: float = 0.1


@dataclass
class MakeUpRule(Section):
    """Updates withheld by the update gate are made up: once a bad stretch is over (no instability
    for `quiet_steps`), the pretraining phase grows by as many steps, so the run makes the updates
    on good data its length promised (its LR schedule stretches to the new end). At most
    `max_fraction` of the phase's configured steps in all: past that the data or the run has a
    problem more steps do not fix."""

    enabled: bool = True
    quiet_steps: int = 5  # steps without an instability finding before the withheld steps are made up
    max_fraction: float = 0.1


@dataclass
class EarlyStopRule(Section):
    """Stop when the validation loss has not improved on its best by `min_delta` for `patience`
    evaluations in a row (per phase; off by default: a run's length is the user's choice)."""

    enabled: bool = False
    patience: int = 3  # evaluations without improvement
    min_delta: float = 0.0  # nats: a smaller improvement does not count


@dataclass
class OrchestratorConfig(Section):
    mode: str = "auto"  # auto: act | advise: journal what it would do | off: no monitoring
    read_every: int = 0  # steps between device reads of step metrics; 0: 1 on CPU, 10 on GPU
    outcome_after: int = 20  # steps after a decision when its outcome is judged
    min_confidence: float = 0.3  # below this an auto decision is journaled but not acted on
    escalate_after: int = 3  # instability findings within escalation_window that climb one rung
    escalation_window: int = 50
    lr_cut: float = 0.5  # the ladder's LR rung
    # rollbacks one incident may spend, then save and stop (not a run's: an incident closes once the replay
    # got past it and stayed quiet; orchestrator/ladder.py _clear, RL's rules: policy.py RLIncident)
    max_rollbacks: int = 3
    min_lr_scale: float = 0.01  # LR cuts never go below this multiple of the schedule
    # quiet steps before the ladder's LR cut is given back x2 (0: never; at most run/8, at least outcome_after)
    lr_restore_after: int = 100
    # more than half of this many steps' updates withheld, by any rule: an instability (orchestrator/withheld.py)
    withheld_window: int = 20
    spike: SpikeRule = field(default_factory=SpikeRule)
    grad: GradRule = field(default_factory=GradRule)
    divergence: DivergenceRule = field(default_factory=DivergenceRule)
    above_start: AboveStartRule = field(default_factory=AboveStartRule)
    plateau: PlateauRule = field(default_factory=PlateauRule)
    oom: OomRule = field(default_factory=OomRule)
    memory: MemoryRule = field(default_factory=MemoryRule)
    throughput: ThroughputRule = field(default_factory=ThroughputRule)
    straggler: StragglerRule = field(default_factory=StragglerRule)
    rerun: RerunRule = field(default_factory=RerunRule)
    checkpoint_interval: CheckpointIntervalRule = field(default_factory=CheckpointIntervalRule)
    replicas: ReplicasRule = field(default_factory=ReplicasRule)
    fp16: Fp16Rule = field(default_factory=Fp16Rule)
    moe: MoERule = field(default_factory=MoERule)
    mod: MoDRule = field(default_factory=MoDRule)
    rl_signal: RLSignalRule = field(default_factory=RLSignalRule)
    rl_verifier: RLVerifierRule = field(default_factory=RLVerifierRule)
    rl_entropy: RLEntropyRule = field(default_factory=RLEntropyRule)
    rl_length: RLLengthRule = field(default_factory=RLLengthRule)
    rl_hacking: RLHackingRule = field(default_factory=RLHackingRule)
    rl_ratio: RLRatioRule = field(default_factory=RLRatioRule)
    rl_reward: RLRewardRule = field(default_factory=RLRewardRule)
    dpo_held_out: DPOHeldOutRule = field(default_factory=DPOHeldOutRule)
    lr: LRRule = field(default_factory=LRRule)
    data: DataRule = field(default_factory=DataRule)
    rows: RowsRule = field(default_factory=RowsRule)
    row_gate: RowGateRule = field(default_factory=RowGateRule)
    make_up: MakeUpRule = field(default_factory=MakeUpRule)
    early_stop: EarlyStopRule = field(default_factory=EarlyStopRule)

    RULES = (
        "spike",
        "grad",
        "divergence",
        "above_start",
        "plateau",
        "oom",
        "memory",
        "throughput",
        "straggler",
        "rerun",
        "checkpoint_interval",
        "replicas",
        "fp16",
        "moe",
        "mod",
        "rl_signal",
        "rl_verifier",
        "rl_entropy",
        "rl_length",
        "rl_hacking",
        "rl_ratio",
        "rl_reward",
        "dpo_held_out",
        "lr",
        "rows",
        "make_up",
        "early_stop",
    )

    def validate(self) -> None:
        _check(self.mode in MODES, "orchestrator.mode", f"must be one of {', '.join(MODES)}")
        _check(self.read_every >= 0, "orchestrator.read_every", "must be >= 0")
        _positive(self, "orchestrator", "outcome_after", "escalate_after", "escalation_window", "withheld_window")
        _check(0 <= self.min_confidence <= 1, "orchestrator.min_confidence", "must be in [0, 1]")
        _check(0 < self.lr_cut < 1, "orchestrator.lr_cut", "must be in (0, 1): it is a reduction")
        _check(self.lr_restore_after >= 0, "orchestrator.lr_restore_after", "must be >= 0")
        _check(self.max_rollbacks >= 0, "orchestrator.max_rollbacks", "must be >= 0")
        _check(0 < self.min_lr_scale <= 1, "orchestrator.min_lr_scale", "must be in (0, 1]")
        for name in ("spike", "grad", "divergence", "plateau", "throughput", "straggler", "fp16", "moe", "mod"):
            _positive(getattr(self, name), f"orchestrator.{name}", "window")
        check_loss_rules(self)
        check_rl_rules(self)
        _positive(self.make_up, "orchestrator.make_up", "quiet_steps")
        _check(0 <= self.make_up.max_fraction <= 1, "orchestrator.make_up.max_fraction", "must be in [0, 1]")
        _check(self.plateau.lr_factor >= 1, "orchestrator.plateau.lr_factor", "must be >= 1 (a raise)")
        _check(self.plateau.max_lr_scale >= 1, "orchestrator.plateau.max_lr_scale", "must be >= 1")
        _check(0 < self.memory.threshold <= 1, "orchestrator.memory.threshold", "must be in (0, 1]")
        _check(0 < self.throughput.factor < 1, "orchestrator.throughput.factor", "must be in (0, 1)")
        _check(0 < self.straggler.threshold < 1, "orchestrator.straggler.threshold", "must be in (0, 1)")
        _positive(self.straggler, "orchestrator.straggler", "patience")
        _positive(self.rerun, "orchestrator.rerun", "suspect_after")
        _check(self.checkpoint_interval.mtbf_hours >= 0, "orchestrator.checkpoint_interval.mtbf_hours", "must be >= 0")
        _check(
            0 < self.checkpoint_interval.tolerance < 1,
            "orchestrator.checkpoint_interval.tolerance",
            "must be in (0, 1)",
        )
        _check(
            self.moe.imbalance > 1 and 0 < self.moe.collapse <= 1 and 0 < self.moe.improving <= 1,
            "orchestrator.moe",
            "imbalance must be > 1, collapse and improving in (0, 1]",
        )
        _check(self.moe.grace_steps >= 0, "orchestrator.moe.grace_steps", "must be >= 0")
        _positive(self.mod, "orchestrator.mod", "recent", "tolerance", "min_drop")
        check_row_rules(self)
        _check(self.lr.factor > 2, "orchestrator.lr.factor", "must be > 2 (warm-up doubles the LR once)")
        _check(self.oom.max_retries >= 1, "orchestrator.oom.max_retries", "must be >= 1")
        _positive(self.early_stop, "orchestrator.early_stop", "patience")
        _check(self.early_stop.min_delta >= 0, "orchestrator.early_stop.min_delta", "must be >= 0")
