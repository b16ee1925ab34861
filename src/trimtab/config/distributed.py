"""The `distributed:` section: how the processes of a `torchrun` launch share the model.

One process (plain `trimtab train`) ignores it. Under torchrun the ranks form a (dp, tp) mesh:
`tp` ranks split each layer's weights (tensor + sequence parallelism), and the dp = world / tp
data-parallel replicas each hold a disjoint share of each global batch; `ddp` keeps a full
replica per rank and all-reduces gradients, `fsdp` shards parameters, gradients and optimizer
state across replicas (FSDP2, `fully_shard`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trimtab.config.checks import _check

STRATEGIES = ("ddp", "fsdp")
BACKENDS = ("auto", "nccl", "gloo")
DTYPES = ("auto", "fp32", "bf16", "fp16")


@dataclass
class DistributedConfig:
    strategy: str = "ddp"  # ddp | fsdp
    tp: int = 1  # tensor-parallel ranks per replica (neighbouring ranks: one node's GPUs)
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: int = 600  # a collective waiting longer fails the job (a rank died or hangs)
    find_unused_parameters: bool = False  # ddp: needed only if some parameter gets no gradient in a step
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
        for key in ("param_dtype", "reduce_dtype"):
            _check(getattr(self, key) in DTYPES, f"distributed.{key}", f"must be one of {', '.join(DTYPES)}")
        if self.strategy != "fsdp":
            for key, default in (
                ("cpu_offload", False),
                ("param_dtype", "auto"),
                ("reduce_dtype", "fp32"),
                ("reshard_after_forward", True),
            ):
                _check(
                    getattr(self, key) == default,
                    f"distributed.{key}",
                    f"applies to distributed.strategy=fsdp only (strategy is '{self.strategy}')",
                )
        else:
            _check(
                not self.find_unused_parameters,
                "distributed.find_unused_parameters",
                "applies to distributed.strategy=ddp only (strategy is 'fsdp')",
            )
