"""Replica agreement: silent data corruption that stays finite (a bit flipped in a weight by a
faulty device or memory) makes one data-parallel replica's weights differ from the others', and
DDP, which averages gradients, never notices: the replicas drift apart for good. Every `every`
steps each rank's exact checksum of its weights (RunView.weight_checksum) is gathered; the ranks
that differ from the majority are named and the run rolls back to the newest checkpoint from when
the replicas last agreed (so a checkpoint written from a corrupted copy is never the target).
Only where every rank holds the whole model (RunView.replicated: DDP); elsewhere (FSDP2, tensor,
expert or pipeline parallelism) the run says at its start that the rule does not run (unchecked).
"""

from __future__ import annotations

from collections import Counter

from trimtab.config.distributed import DistributedConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.distributed import all_gather_floats
from trimtab.orchestrator.monitors import Finding

HALF = 1 << 31  # a 64-bit checksum crosses the gather as two exact float64 halves


def splits(dist: DistributedConfig, world: int) -> list[str]:
    """How the ranks split the model ('FSDP2 shards them', 'tensor parallelism (distributed.tp=2)
    splits them'): none where each holds the whole model (DDP). Parallel.sharded, from the config."""
    fsdp = dist.data_parallel == "fsdp" and (world > dist.tp * dist.pp or dist.strategy == "fsdp")  # Parallel.fsdp
    ways = ["FSDP2 shards them"] if fsdp else []
    for key, name in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        if getattr(dist, key) > 1:
            ways.append(f"{name} parallelism (distributed.{key}={getattr(dist, key)}) splits them")
    return ways


def unchecked(dist: DistributedConfig, world: int) -> str:
    """The console line of a run of several ranks where no two hold the same whole model, so the
    rule on (its default) has nothing to compare: said once a session, not skipped without a word."""
    ways = splits(dist, world)
    return (
        f"orchestrator.replicas does not run: no two of the {world} ranks hold the same whole copy of the weights "
        f"({', '.join(ways) or 'sharded'}), so no rank's checksum has a replica's to agree with: a bit flipped in a "
        "weight that stays finite (silent data corruption) is caught only if the loss rules see what it does. Set "
        "orchestrator.replicas.enabled=false not to be told (docs/resilience.md)"
    )


class Replicas:
    rule, family = "replicas", "replicas"

    def __init__(self, cfg: OrchestratorConfig):
        self.every = cfg.replicas.every
        self.agreed = 0  # the last step all replicas held the same weights (0: the start)

    def due(self, step: int) -> bool:
        """A check at this step (every rank alike): only then is a checksum worth computing."""
        return step % self.every == 0

    def observe(self, step: int, checksum: int) -> Finding | None:
        """A due step's check (a collective on every rank): the finding when replicas disagree."""
        value = checksum & ((1 << 62) - 1)
        gathered = all_gather_floats([float(value // HALF), float(value % HALF)])
        sums = [int(hi) * HALF + int(lo) for hi, lo in gathered]
        majority, count = Counter(sums).most_common(1)[0]
        if count == len(sums):
            self.agreed = step
            return None
        odd = (
            [rank for rank, s in enumerate(sums) if s != majority] if count > len(sums) / 2 else list(range(len(sums)))
        )
        evidence = {
            "ranks": odd,
            "checksums": [f"{s:016x}" for s in sums],
            "agreed_step": self.agreed,
            "every": self.every,
        }
        who = f"rank {', '.join(map(str, odd))}" if len(odd) < len(sums) else "every rank (no majority)"
        summary = f"{who} holds weights unlike the other replicas' (exact checksums); they agreed at step {self.agreed}"
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def state_dict(self) -> dict[str, int]:
        return {"agreed": self.agreed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.agreed = state.get("agreed", 0)
