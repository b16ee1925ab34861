"""The `distributed:` section: how the processes of a `torchrun` launch share the model.

One process (plain `trimtab train`) ignores it. Under torchrun the ranks form a (pp, dp, tp)
mesh: `pp` pipeline stages each hold a run of consecutive layers (distributed/pipeline.py), `tp`
ranks split each layer's weights (tensor + sequence parallelism), and the dp = world / (pp * tp)
data-parallel replicas each hold a disjoint share of each global batch; `ddp` keeps a full
replica per rank and all-reduces gradients, `fsdp` shards parameters, gradients and optimizer
state across replicas (FSDP2, `fully_shard`); `auto` is fsdp when tp, ep or pp split the
model (DDP cannot replicate sharded weights), else ddp. `ep` groups of data-parallel replicas split
each MoE layer's experts between them (expert parallelism, distributed/expert.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trimtab.config.checks import Section, _check
from trimtab.errors import ConfigError

if TYPE_CHECKING:
    from trimtab.config.model import ModelConfig

STRATEGIES = ("auto", "ddp", "fsdp")
BACKENDS = ("auto", "nccl", "gloo")
DTYPES = ("auto", "fp32", "bf16", "fp16")
PP_SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved")


@dataclass
class DistributedConfig(Section):
    strategy: str = "auto"  # auto | ddp | fsdp (auto: fsdp when tp, ep or pp > 1, else ddp)
    tp: int = 1  # tensor-parallel ranks per replica (neighbouring ranks: one node's GPUs)
    ep: int = 1  # data-parallel replicas sharing one copy of the experts (divides world / tp)
    pp: int = 1  # pipeline stages (ranks r // (world / pp)), each holding consecutive layers
    pp_schedule: str = "auto"  # auto | gpipe | 1f1b | interleaved (auto: interleaved if pp_stages_per_rank > 1)
    pp_stages_per_rank: int = 1  # virtual stages per rank (> 1: interleaved 1F1B, a smaller bubble)
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: int = 600  # a collective waiting longer fails the job (a rank died or hangs)
    # ddp: needed only if some parameter gets no gradient in a step; on with more than 2 replicas
    # whatever this says, so that a restarted run sums gradients in the same order (exact resume)
    find_unused_parameters: bool = False
    # fsdp only
    reshard_after_forward: bool = True  # free gathered weights after each block's forward (less memory)
    cpu_offload: bool = False  # parameters, gradients and optimizer state live in CPU memory
    param_dtype: str = "auto"  # dtype of the gathered weights; auto: the train.precision autocast dtype
    reduce_dtype: str = "fp32"  # dtype of the gradient reduce-scatter

    def validate(self) -> None:
        _check(self.strategy in STRATEGIES, "distributed.strategy", f"must be one of {', '.join(STRATEGIES)}")
        _check(self.backend in BACKENDS, "distributed.backend", f"must be one of {', '.join(BACKENDS)}")
        _check(self.timeout_s > 0, "distributed.timeout_s", f"must be > 0 (got {self.timeout_s})")
        _check(self.tp >= 1, "distributed.tp", f"must be >= 1 (got {self.tp})")
        _check(self.ep >= 1, "distributed.ep", f"must be >= 1 (got {self.ep})")
        self._validate_pipeline()
        _check(
            not (self.ep > 1 and self.strategy == "ddp"),
            "distributed.strategy",
            "is ddp, which cannot hold experts split by distributed.ep; use fsdp (or auto)",
        )
        for key in ("param_dtype", "reduce_dtype"):
            _check(getattr(self, key) in DTYPES, f"distributed.{key}", f"must be one of {', '.join(DTYPES)}")
        if self.data_parallel != "fsdp":
            for key, default in (
                ("cpu_offload", False),
                ("param_dtype", "auto"),
                ("reduce_dtype", "fp32"),
                ("reshard_after_forward", True),
            ):
                _check(
                    getattr(self, key) == default,
                    f"distributed.{key}",
                    f"applies to distributed.strategy=fsdp only (strategy is '{self.strategy}', here ddp)",
                )
        else:
            _check(
                not self.find_unused_parameters,
                "distributed.find_unused_parameters",
                "applies to distributed.strategy=ddp only (strategy is 'fsdp')",
            )

    def _validate_pipeline(self) -> None:
        _check(self.pp >= 1, "distributed.pp", f"must be >= 1 (got {self.pp})")
        _check(self.pp_schedule in PP_SCHEDULES, "distributed.pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}")
        v = self.pp_stages_per_rank
        _check(v >= 1, "distributed.pp_stages_per_rank", f"must be >= 1 (got {v})")
        _check(
            self.pp_schedule in ("auto", "interleaved") or v == 1,
            "distributed.pp_stages_per_rank",
            f"is {v}, but pp_schedule={self.pp_schedule} runs one stage per rank; use interleaved (or auto)",
        )
        _check(
            self.pp_schedule != "interleaved" or v > 1,
            "distributed.pp_schedule",
            "is interleaved, which needs distributed.pp_stages_per_rank >= 2 (stages per rank)",
        )
        if self.pp > 1:
            _check(
                self.strategy != "ddp",
                "distributed.strategy",
                "is ddp, which cannot wrap pipeline stages here; use fsdp (or auto) with distributed.pp",
            )

    @property
    def schedule(self) -> str:
        """The pipeline schedule (auto resolved)."""
        if self.pp_schedule == "auto":
            return "interleaved" if self.pp_stages_per_rank > 1 else "1f1b"
        return self.pp_schedule

    @property
    def data_parallel(self) -> str:
        """The strategy the replicas use: 'ddp' or 'fsdp' (auto resolved)."""
        if self.strategy == "auto":
            return "fsdp" if self.tp > 1 or self.ep > 1 or self.pp > 1 else "ddp"
        return self.strategy


def check_splits(cfg: DistributedConfig, model: ModelConfig) -> None:
    """The model's sizes split over distributed.tp / ep / pp, checked when the config loads: at the
    start of a launch these errors came only after every rank had prepared its data and built the
    whole model (which a large preset's fills the host's memory with first). The start of a run
    asks the tp / ep rules again (distributed/splits.py) with the tokenizer's vocabulary; a single
    process ignores the section, but a launch of this config would fail."""
    stages = cfg.pp * cfg.pp_stages_per_rank
    if stages > model.n_layers:
        raise ConfigError(
            f"distributed.pp={cfg.pp} x pp_stages_per_rank={cfg.pp_stages_per_rank} asks for {stages} pipeline "
            f"stages but the model has {model.n_layers} layers (model.n_layers); lower them to at most "
            f"{model.n_layers} stages"
        )
    check_dense_split(model, cfg.tp)
    check_moe_split(model, cfg.tp, cfg.ep)


def check_dense_split(model: ModelConfig, tp: int) -> None:
    """A ConfigError naming the size of every layer that `tp` tensor-parallel ranks do not divide
    (the vocabulary only once known: 0 is the tokenizer's, checked again at the start)."""
    sizes = {"model.n_kv_heads": model.n_kv_heads or model.n_heads, "model.ffn_hidden": model.ffn_hidden}
    if model.vocab_size:
        sizes["model.vocab_size"] = model.vocab_size
    _divides(tp, sizes)


def check_moe_split(model: ModelConfig, tp: int, ep: int) -> None:
    """A ConfigError naming the MoE setting that does not split over `tp` tensor-parallel ranks and
    `ep` expert groups (nothing for a model without MoE layers and ep 1)."""
    has_moe = any("moe" in kind for kind in model.layers)
    if ep > 1 and not has_moe:
        raise ConfigError(f"distributed.ep={ep}: the model has no MoE layers to split; use distributed.ep=1")
    if not has_moe:
        return
    if model.moe.n_experts % ep:
        raise ConfigError(
            f"distributed.ep={ep} must divide model.moe.n_experts ({model.moe.n_experts}); lower distributed.ep"
        )
    if tp > 1 and model.moe.router_jitter > 0:
        raise ConfigError(
            f"distributed.tp={tp}: model.moe.router_jitter draws noise on each rank, so the tensor-parallel "
            "ranks would route differently; set it to 0"
        )
    _divides(
        tp, {"model.moe.expert_hidden": model.moe.expert_hidden, "model.moe.shared_hidden": model.moe.shared_hidden}
    )


def _divides(tp: int, sizes: dict[str, int]) -> None:
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(f"distributed.tp={tp} must divide {key} ({size}); lower distributed.tp")
