"""The training sections of a run config: the optimizer (optim.*), the run's length, batch and
evaluation (train.*), checkpoints (checkpoint.*) and the optional finetuning phase (finetune.*)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check, _finite, _positive
from trimtab.config.data import DataConfig
from trimtab.config.loss_scale import LossScaleConfig

CHECKPOINTING = ("off", "selective", "full")  # train.activation_checkpointing
SCHEDULES = ("cosine", "wsd", "constant", "linear", "triangular", "triangular2", "exp_range")


@dataclass
class OptimConfig(Section):
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # floor of decaying schedules, as a fraction of lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured and logged)
    schedule: str = "cosine"
    warmup_steps: int = 50
    decay_fraction: float = 0.2  # WSD: share of the steps spent in the final decay
    cycle_steps: int = 200  # cyclic schedules: steps per half cycle
    gamma: float = 0.999  # exp_range: amplitude decay per step
    fused: str = "auto"  # auto | true | false: fused AdamW kernel

    def validate(self) -> None:
        _positive(self, "optim", "lr", "eps", "cycle_steps")
        _finite(self, "optim", "lr", "eps", "weight_decay")
        _check(self.schedule in SCHEDULES, "optim.schedule", f"must be one of {', '.join(SCHEDULES)}")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2", "must be in [0, 1)")
        for key in ("weight_decay", "grad_clip", "warmup_steps"):
            _check(getattr(self, key) >= 0, f"optim.{key}", f"must be >= 0 (got {getattr(self, key)})")
        _check(0 < self.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")
        _check(0 < self.gamma <= 1, "optim.gamma", "must be in (0, 1]")
        _check(self.fused in ("auto", "true", "false"), "optim.fused", "must be auto, true or false")


@dataclass
class TrainConfig(Section):
    # Pretraining steps; "auto": the Chinchilla budget (20 tokens per active parameter, Hoffmann
    # et al. 2022) from the planner. train.epochs, when set, wins over both.
    max_steps: int | str = 1000
    epochs: float = 0.0  # > 0: as many steps as this many passes over the training data
    batch_tokens: int = 16384  # target tokens per optimizer step
    # Token budget of one forward/backward (padding included). 0: auto, the largest that fits:
    # the first step runs as one micro-batch and the orchestrator's OOM path halves it until it fits.
    micro_batch_tokens: int = 4096
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda | mps
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 | fp8 (CUDA sm89+, torchao; docs/precision.md)
    # fp8's scaling: tensorwise (one scale per tensor, fastest) | rowwise (a scale per row, more accurate)
    fp8_recipe: str = "tensorwise"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16's (config/loss_scale.py)
    # auto | true | false. auto: torch.compile when the run is long enough to repay its compile
    # time (training/services/compiling.py); short and CPU-sized runs stay eager.
    compile: str = "auto"
    # off | selective | full (docs/planner.md, "Activation checkpointing"). full: each block keeps
    # only its input and runs its forward again in the backward (a third more compute); selective:
    # a block keeps its matmuls' and attention's outputs and recomputes only the cheap ops between
    # them (norms, rotations, activations, casts), 0.6-0.75x the memory of off at a few percent.
    activation_checkpointing: str = "off"
    eval_every: int = 200  # 0: only at the end
    eval_tokens: int = 65536  # cap on tokens per evaluation
    # Seconds an evaluation may run; past it, it is abandoned (journaled) and training goes on. 0: no limit
    eval_timeout: float = 1800.0
    log_every: int = 10
    init_from: str = ""  # run dir or checkpoint dir whose weights start this run (finetuning)

    @property
    def micro_budget(self) -> int:
        """The micro-batch budget to start with: micro_batch_tokens, or the whole step when auto."""
        return self.micro_batch_tokens or self.batch_tokens

    def validate(self) -> None:
        _positive(self, "train", "batch_tokens", "log_every", "eval_tokens")
        _check(
            self.max_steps == "auto" or (isinstance(self.max_steps, int) and self.max_steps > 0),
            "train.max_steps",
            f"must be a positive number of steps or auto, got {self.max_steps!r}",
        )
        _check(self.epochs >= 0, "train.epochs", "must be >= 0 (0: train.max_steps decides)")
        _check(
            0 <= self.micro_batch_tokens <= self.batch_tokens,
            "train.micro_batch_tokens",
            "must be between 0 (auto: the largest that fits) and train.batch_tokens",
        )
        _check(self.device in ("auto", "cpu", "cuda", "mps"), "train.device", "must be auto, cpu, cuda or mps")
        _check(
            self.precision in ("auto", "fp32", "bf16", "fp16", "fp8"),
            "train.precision",
            "must be auto, fp32, bf16, fp16 or fp8",
        )
        _check(self.fp8_recipe in ("tensorwise", "rowwise"), "train.fp8_recipe", "must be tensorwise or rowwise")
        self.loss_scale.validate()
        _check(self.compile in ("auto", "true", "false"), "train.compile", "must be auto, true or false")
        _check(
            self.activation_checkpointing in CHECKPOINTING,
            "train.activation_checkpointing",
            f"must be one of {', '.join(CHECKPOINTING)} (true reads as full, false as off)",
        )
        _check(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        _check(self.eval_timeout >= 0, "train.eval_timeout", "must be >= 0 (0: no limit)")


@dataclass
class CheckpointConfig(Section):
    every: int = 200  # steps between checkpoints (0: only at the end and on signals)
    keep: int = 3  # newest checkpoints kept (beside them: the last good one, the best evaluation's)
    # Written in the background: a save stalls training only while the state is copied to host
    # memory, once per save (DCP's async save; docs/resilience.md, "Asynchronous checkpoints")
    asynchronous: bool = False
    # Lean snapshots (snapshots.py): weights only, bf16, every N steps (0: none), for evaluation
    # and export; the newest snapshot_keep kept, and every snapshot_keep_every-th step's (0: none)
    snapshot_every: int = 0
    snapshot_keep: int = 3
    snapshot_keep_every: int = 0
    # Object storage for the checkpoints (docs/storage.md): "" keeps them in the run directory
    # alone; s3://bucket/prefix (any fsspec URL) also uploads each one there, manifest last, and a
    # run directory without a valid checkpoint resumes from the newest complete one there.
    # Credentials come from the standard AWS environment and files, never from here.
    dir: str = ""

    def validate(self) -> None:
        _check(self.every >= 0, "checkpoint.every", "must be >= 0")
        _check(
            not self.dir or "://" in self.dir,
            "checkpoint.dir",
            f"must be a storage URL (s3://bucket/prefix, any fsspec URL) or empty, got {self.dir!r}",
        )
        _check(
            "@" not in self.dir.split("://", 1)[-1].split("/", 1)[0],
            "checkpoint.dir",
            "must not hold credentials (user:password@); use the standard AWS environment or files",
        )
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1")
        _check(self.snapshot_every >= 0, "checkpoint.snapshot_every", "must be >= 0 (0: no snapshots)")
        _check(self.snapshot_keep >= 1, "checkpoint.snapshot_keep", "must be >= 1")
        _check(self.snapshot_keep_every >= 0, "checkpoint.snapshot_keep_every", "must be >= 0 (0: none)")


@dataclass
class FinetuneConfig(Section):
    """An optional second phase on its own data and schedule, run after max_steps of pretraining."""

    steps: int = 0  # 0: no finetuning phase
    # seq_len 0 (unset): the run's data.seq_len, filled by resolve(); the rows must fit the same model
    data: DataConfig = field(default_factory=lambda: DataConfig(source="", format="auto", seq_len=0))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=10))

    def validate(self) -> None:
        _check(self.steps >= 0, "finetune.steps", "must be >= 0")
        if self.steps:
            _check(
                bool(self.data.source), "finetune.data.source", "must name the finetuning data when finetune.steps > 0"
            )
            self.data.validate()
            self.optim.validate()
