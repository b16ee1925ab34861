"""The device mesh: how torchrun's ranks split into pipeline stages, data-parallel replicas,
expert-parallel groups and tensor-parallel groups (torch.distributed.device_mesh).

    ranks 0..world-1 as a (pp, edp, ep, tp) grid, row-major: rank r is tensor-parallel rank
    r % tp of data-parallel replica dp_rank = (r // tp) % dp of pipeline stage r // (dp * tp);
    replica dp_rank is expert-parallel rank dp_rank % ep of expert group dp_rank // ep. "dp"
    names the flattened (edp, ep): all replicas of one stage; "pdp" the flattened (pp, edp, ep).

Tensor-parallel groups are the innermost dimension, so on a multi-GPU node they are neighbouring
GPUs (NVLink), as torchtitan and Megatron-LM place them: TP communicates in every layer, DP once
per step. Expert parallelism is carved out of data parallelism (ep replicas, each with its own
rows, hold one copy of the experts between them and exchange tokens in every MoE layer), so it
sits next: the all-to-all stays within a node while ep * tp GPUs fit in one. Dense weights are
data-parallel over all dp replicas; expert weights over the edp = dp / ep expert groups. Pipeline
stages are outermost (torchtitan's order): a stage sends one activation per micro-batch to the
next, the least traffic of all, so it may cross nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trimtab.config.distributed import DistributedConfig
from trimtab.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Mesh:
    dp: int = 1  # data-parallel replicas (DDP / FSDP2 over them)
    tp: int = 1  # tensor-parallel ranks per replica
    ep: int = 1  # replicas sharing one copy of the experts (divides dp)
    pp: int = 1  # pipeline stages (each holds its own replicas)
    device_mesh: Any = None  # torch DeviceMesh ("pp", "edp", "ep", "tp") + flattened "dp", "pdp"; None in one process

    @classmethod
    def single(cls) -> Mesh:
        return cls()

    @classmethod
    def of(cls, cfg: DistributedConfig, world: int) -> Mesh:
        """The sizes for `world` processes; an error naming the key when they do not fit."""
        for key, size in (("tp", cfg.tp), ("pp", cfg.pp), ("pp x tp", cfg.pp * cfg.tp)):
            if world % size:
                raise ConfigError(
                    f"config key 'distributed.{key}' is {size}, which does not divide the {world} processes of "
                    "this launch; start a multiple of it (torchrun --nproc_per_node x --nnodes) or lower it"
                )
        mesh = cls(dp=world // (cfg.tp * cfg.pp), tp=cfg.tp, ep=cfg.ep, pp=cfg.pp)
        if mesh.dp % cfg.ep:
            raise ConfigError(
                f"config key 'distributed.ep' is {cfg.ep}, which does not divide the {mesh.dp} data-parallel "
                f"replicas ({world} processes / (tp={cfg.tp} x pp={cfg.pp})); choose a divisor of {mesh.dp}"
            )
        if mesh.tp > 1 and mesh.dp > 1 and cfg.data_parallel == "ddp":
            raise ConfigError(
                f"distributed.tp={cfg.tp} with {mesh.dp} data-parallel replicas needs distributed.strategy=fsdp "
                "(DDP cannot replicate tensor-parallel weights; FSDP2 shards them over the replicas)"
            )
        return mesh

    @property
    def edp(self) -> int:
        """Copies of the experts: the expert groups' count."""
        return self.dp // self.ep

    def build(self, device: torch.device) -> Mesh:
        """The same sizes with torch's DeviceMesh over the initialised process group."""
        from torch.distributed.device_mesh import init_device_mesh

        names = ("pp", "edp", "ep", "tp")
        grid = init_device_mesh(device.type, (self.pp, self.edp, self.ep, self.tp), mesh_dim_names=names)
        grid["edp", "ep"]._flatten("dp")  # named on the root mesh: grid["dp"] (torchtitan does the same)
        grid["pp", "edp", "ep"]._flatten("pdp")
        return dataclasses.replace(self, device_mesh=grid)

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (None: every rank, the default)."""
        alone = self.tp == 1 and self.pp == 1
        return None if alone or self.device_mesh is None else self.device_mesh["dp"].get_group()

    @property
    def step_group(self) -> Any:
        """The ranks whose shares make up a step's loss and router statistics: every replica of
        every pipeline stage (None: every rank)."""
        return None if self.tp == 1 or self.device_mesh is None else self.device_mesh["pdp"].get_group()

    def __getitem__(self, name: str) -> Any:
        return self.device_mesh[name]
