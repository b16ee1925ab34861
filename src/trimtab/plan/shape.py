"""A model's parameter counts as the planner sees them (plan/layout.py, plan/traffic.py): built on
the meta device (nothing allocated), each block's parameters split into what tensor parallelism
splits, what every tp rank holds whole and the routed experts (distributed/splits.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trimtab.distributed.splits import routed_expert, whole_under_tp
from trimtab.model.catalog import meta_model

if TYPE_CHECKING:
    from torch import nn

    from trimtab.config import RunConfig


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts of a model as the planner sees them (meta device: nothing allocated)."""

    params: int
    experts: int  # routed experts' parameters (P_e)
    blocks: tuple[tuple[int, int, int], ...]  # each block's parameters, those every tp rank holds whole, its experts
    root: int  # embedding, final norm, head
    root_whole: int  # of them, what every tp rank holds whole (the final norm)
    flops_per_token: int
    d_model: int
    n_layers: int
    moe_layers: int
    n_experts: int
    top_k: int

    @classmethod
    def of(cls, cfg: RunConfig) -> ModelShape:
        model = meta_model(cfg)
        blocks = [_block_counts(block) for block in model.blocks]
        experts = [sum(w.numel() for w in (m.w1, m.w3, m.w2)) for _, m in model.moe_layers()]
        total = model.num_params()
        in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
        root_whole = sum(p.numel() for n, p in model.named_parameters() if id(p) not in in_blocks and whole_under_tp(n))
        return cls(
            params=total,
            experts=sum(experts),
            blocks=tuple(blocks),
            root=total - sum(b[0] for b in blocks),
            root_whole=root_whole,
            flops_per_token=model.flops_per_token(cfg.data.seq_len),
            d_model=cfg.model.d_model,
            n_layers=cfg.model.n_layers,
            moe_layers=len(experts),
            n_experts=cfg.model.moe.n_experts if experts else 0,
            top_k=cfg.model.moe.top_k if experts else 0,
        )

    def root_share(self, tp: int) -> float:
        """The embedding, final norm and head on one tensor-parallel rank."""
        return (self.root - self.root_whole) / tp + self.root_whole

    def block_share(self, block: tuple[int, int, int], tp: int, ep: int) -> float:
        """A block's parameters on one rank of tp x ep (distributed/splits.py: what is split)."""
        total, whole, experts = block
        return whole + (total - whole - experts) / tp + experts / (tp * ep)

    def rank_params(self, tp: int, ep: int = 1, pp: int = 1) -> float:
        """Parameters one rank of an end stage holds under tp x ep, before FSDP shards them: its
        1 / pp of the blocks and the root."""
        return sum(self.block_share(b, tp, ep) for b in self.blocks) / pp + self.root_share(tp)


def _block_counts(block: nn.Module) -> tuple[int, int, int]:
    """A block's parameters: all, those tensor parallelism leaves whole, its routed experts."""
    named = list(block.named_parameters())
    whole = sum(p.numel() for n, p in named if whole_under_tp(n))
    return sum(p.numel() for _, p in named), whole, sum(p.numel() for n, p in named if routed_expert(n))


def rank_params(cfg: RunConfig, tp: int = 1, ep: int = 1, pp: int = 1) -> int:
    """The parameters the planner counts on one rank of `cfg`'s model under tp x ep (x pp: an end
    stage's), before FSDP shards them over the replicas: what each rank's model holds after
    distributed/tensor.py and expert.py split it."""
    return round(ModelShape.of(cfg).rank_params(tp, ep, pp))
