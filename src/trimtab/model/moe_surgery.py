"""Expert surgery on a Mixture-of-Experts layer (model/moe.py), a base of MoE: an expert split in
two (add_expert), removed (prune_expert) or revived (reinit_expert), a collapsed router row reset
(reset_router). add, prune and reinit replace the parameters: rebuild or remap the optimizer
afterwards (training/surgery.py); reset_router works in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class ExpertSurgery:
    """MoE's surgery (it holds the parameters, buffers and settings named here)."""

    router: nn.Parameter  # [E, D]
    w1: nn.Parameter
    w3: nn.Parameter
    w2: nn.Parameter
    expert_bias: Tensor  # [E]
    load: Tensor  # [E]
    top_k: int
    init_std: float
    out_std: float
    aux_loss: Tensor | None
    stats: dict[str, Tensor]
    n_experts: int  # a property of MoE

    def _replace(self, f: Callable[[Tensor], Tensor]) -> None:
        """Apply f to every per-expert tensor (experts on dim 0): new router, w1, w3, w2
        Parameters, new expert_bias and load buffers."""
        for name in ("router", "w1", "w3", "w2"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(f(old.detach()), requires_grad=old.requires_grad))
        self.expert_bias = f(self.expert_bias)
        self.load = f(self.load)
        self.aux_loss, self.stats = None, {}

    @staticmethod
    def _noisy(t: torch.Tensor, noise: float) -> torch.Tensor:
        """t + Gaussian noise of std noise * rms(t)."""
        return t + noise * t.pow(2).mean().sqrt() * torch.randn_like(t) if noise > 0 else t.clone()

    @torch.no_grad()
    def add_expert(self, source: int | None = None, noise: float = 0.01) -> int:
        """Split `source` (default: the most loaded, by the load since update_bias, else by the
        last forward's counts): append a copy of its weights and router row, each plus noise of
        std noise * rms(tensor) (Net2Net's widening, Chen et al. 2016); the two then share the
        source's tokens. Returns the new index. top_k >= 2: only tokens whose first choice was the
        source change output (they pick source and copy, so get the source's output alone).
        top_k = 1: each of the source's tokens goes to one of the two; the gates (raw probs)
        shrink a little as the softmax gains a term.

        The copy's selection bias is the others' mean, not the source's: the bias is the
        aux-loss-free balancer's record of that expert's own load (Wang et al. 2024, Alg. 1;
        DeepSeek-V3 section 2.1.2: b_i moves by the sign of expert i's load error), and a new
        expert has none, so it starts where the centred updates keep every expert, mid-pack (as
        reset_router). A copied bias copied a collapse too: debug-moe with expert 0's bias +0.3,
        its copy took every token's second slot (50% of assignments, the 7 others none)."""
        if source is None:
            load = self.load if bool(self.load.sum() > 0) else self.stats.get("tokens_per_expert")
            source = int(load.argmax()) if load is not None else 0
        self._check_expert(source)

        def grow(t: Tensor) -> Tensor:
            row = t[source : source + 1]
            return torch.cat([t, self._noisy(row, noise) if t.dim() > 1 else row])

        half = self.load[source] / 2
        others = torch.cat([self.expert_bias[:source], self.expert_bias[source + 1 :]])
        self._replace(grow)
        self.load[source] = self.load[-1] = half
        if others.numel():  # one expert: no other to take the mean of, the copy keeps its bias
            self.expert_bias[-1] = others.mean()
        return self.n_experts - 1

    @torch.no_grad()
    def prune_expert(self, index: int) -> None:
        """Remove expert `index`; its tokens go to their next choices. Errors below top_k."""
        self._check_expert(index)
        if self.n_experts - 1 < self.top_k:
            raise ValueError(f"cannot prune: {self.n_experts - 1} experts would remain, fewer than top_k={self.top_k}")
        keep = [i for i in range(self.n_experts) if i != index]
        self._replace(lambda t: t[keep])

    def _check_expert(self, index: int) -> None:
        if not 0 <= index < self.n_experts:
            raise IndexError(f"expert {index} out of range (n_experts={self.n_experts})")

    def _centre_router_row(self, index: int) -> None:
        """Router row `index` = the mean of the other rows + noise of 0.1 x their std: its logit
        sits mid-pack for every token, so it gets traffic again (reinit_expert, reset_router)."""
        others = torch.cat([self.router[:index], self.router[index + 1 :]])
        mean = others.mean(0)
        self.router[index] = mean + 0.1 * others.std() * torch.randn_like(mean)

    @torch.no_grad()
    def reset_router(self, index: int) -> None:
        """Undo a routing collapse onto `index`, in place, keeping its expert weights: its router
        row = the mean of the others + noise and its selection bias = the others' mean, so its
        score sits mid-pack for every token. Reset the row's optimizer moments too."""
        self._check_expert(index)
        self._centre_router_row(index)
        self.expert_bias[index] = torch.cat([self.expert_bias[:index], self.expert_bias[index + 1 :]]).mean()

    @torch.no_grad()
    def reinit_expert(self, index: int) -> None:
        """Revive a dead expert: fresh weights (as reset_parameters), router row = the mean of
        the other rows + noise (so its logit sits mid-pack and it gets traffic), bias and load 0.
        Replaces the parameters like add / prune: the revived row must not keep the dead
        one's optimizer moments."""
        self._check_expert(index)
        self._replace(lambda t: t.clone())
        nn.init.normal_(self.w1[index], 0.0, self.init_std)
        nn.init.normal_(self.w3[index], 0.0, self.init_std)
        nn.init.normal_(self.w2[index], 0.0, self.out_std)
        self._centre_router_row(index)
        self.expert_bias[index] = 0.0
        self.load[index] = 0.0
