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
        source = self._busiest() if source is None else source
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

    def _busiest(self, exclude: int | None = None) -> int:
        """The most loaded expert other than `exclude`: by the load since update_bias, else by the
        last forward's counts (0, or 1 when 0 is excluded, before any forward)."""
        load = self.load if bool(self.load.sum() > 0) else self.stats.get("tokens_per_expert")
        if load is None:
            return int(exclude == 0)
        load = load.clone().float()
        if exclude is not None:
            load[exclude] = -1.0
        return int(load.argmax())

    def _check_expert(self, index: int) -> None:
        if not 0 <= index < self.n_experts:
            raise IndexError(f"expert {index} out of range (n_experts={self.n_experts})")

    def _centre_router_row(self, index: int) -> None:
        """Router row `index` = the mean of the other rows + noise of 0.1 x their std: its logit
        sits mid-pack for every token, so it gets traffic again (reset_router)."""
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
    def reinit_expert(self, index: int, noise: float = 0.01) -> int:
        """Revive a dead expert as a split of the busiest one (add_expert's copy, in place): its
        router row, weights and selection bias = the busiest's, the tensors plus noise of std
        noise * rms(tensor); the two share the busiest's tokens (and its load). Returns the source.

        Not fresh weights and a row at the others' mean: under a sharp router a mid-pack row is
        nobody's first choice. debug-moe, 4 experts, top-1, router_temperature 0.1, no balance or
        z-loss: revived that way the expert got 0% of assignments the step after and 4-8% over the
        next 40 (fair share 25%; in another run it died again); as the busiest's copy, 48% the
        step after and 26-31% later, and its tokens meet trained weights, not random ones.
        The bias is the busiest's (unlike add_expert's copy): on the same row, a
        higher bias would take every one of the busiest's tokens, a lower one none.
        Replaces the parameters like add / prune: the revived row must not keep the dead
        one's optimizer moments (training/surgery.py zeroes them). One expert: fresh weights."""
        self._check_expert(index)
        source = self._busiest(exclude=index)  # before _replace, which clears the last forward's counts
        self._replace(lambda t: t.clone())
        if self.n_experts == 1:
            nn.init.normal_(self.w1[index], 0.0, self.init_std)
            nn.init.normal_(self.w3[index], 0.0, self.init_std)
            nn.init.normal_(self.w2[index], 0.0, self.out_std)
            self.expert_bias[index], self.load[index] = 0.0, 0.0
            return index
        for name in ("router", "w1", "w3", "w2"):
            t = getattr(self, name)
            t[index] = self._noisy(t[source], noise)
        self.expert_bias[index] = self.expert_bias[source]
        self.load[source] = self.load[index] = self.load[source] / 2
        return source
