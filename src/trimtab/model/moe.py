"""Mixture-of-Experts feed-forward layer: top-k router, SwiGLU experts, balancing (surgery: moe_surgery.py).

Shape legend:
    B batch, T time, N tokens (B * T), D d_model, H expert hidden width, E experts,
    k experts per token (top_k), A assignments (N * k), C capacity (token slots per expert).

Routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): fp32
logits = x W_r^T / temperature, probs = softmax(logits), each token picks the k experts with the
highest probs + expert_bias, and its output is the gate-weighted sum of those experts' SwiGLU
outputs. expert_bias steers selection only, never the gates: auxiliary-loss-free balancing
(Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3, arXiv 2412.19437 section 2.1.2).

Compute, no Python loop over tokens or experts: assignments are sorted by expert (stable, so
token order is kept within an expert) and ranked within it. Ranks >= C = ceil(capacity_factor *
N * k / E) are dropped (Switch section 2.2; the token keeps its residual); capacity_factor 0 is
dropless. Two layouts give the same result:
    grouped  the kept assignments packed by expert, three torch grouped_mm with per-expert
             offsets: no padding, no host sync (default on CPU, and on CUDA in bf16 on sm80+,
             the kernel's requirement; under torch.compile in bf16)
    padded   a slot (expert, rank) per assignment in an [E, C, D] buffer, three bmm: computes
             the padding, static shapes when compiled with a capacity (default elsewhere)
Measured on a quiet 2-core CPU (bench/moe.py: N 4096, D 256, H 352, top-2, E 8-32, fwd + bwd):
grouped ties one matmul per expert and beats padded by up to 1.25x (2 threads) / 1.5x (1 thread)
at E = 32, where the largest load is 1.35x the mean at init (padding grows with imbalance). With
other processes holding half the CPU and 2 torch threads, padded (fewest parallel regions) was
2.4-3.8x faster than grouped instead: contention, not the layout, dominates there.

Parallelism is applied from outside (distributed/expert.py): the weights may then be DTensors,
which the layer reads through `local` (installed with them: this rank's shard as a plain tensor,
since token groups have data-dependent sizes DTensor cannot express), and `dispatch` (the
grouped expert compute) may be replaced by one that exchanges the packed rows with the ranks
owning the experts (expert parallelism, all-to-all).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from trimtab.config.sparse import MoEConfig
from trimtab.model.layers import SwiGLU, compute_dtype, silu_mul
from trimtab.model.moe_surgery import ExpertSurgery
from trimtab.model.recompute import in_recompute, output_unread


class Routing(NamedTuple):
    logits: torch.Tensor  # [N, E] fp32, temperature applied
    probs: torch.Tensor  # [N, E] fp32 softmax
    experts: torch.Tensor  # [N, k] long, chosen with probs + expert_bias
    gates: torch.Tensor  # [N, k] fp32, gate weight of each chosen expert (no bias)
    counts: torch.Tensor  # [E] fp32, assignments per expert before capacity


def _same(w: Tensor) -> Tensor:
    return w


# torch.nn.functional.grouped_mm; older torch (2.8-2.9) has only the private op it wraps
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_swiglu(xs: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """xs [M, D] packed by expert, counts [E] rows per expert (sum M) -> [M, D]: each expert's
    SwiGLU on its rows, three grouped_mm with per-expert offsets, no padding."""
    offs = counts.cumsum(0).to(torch.int32)
    h = silu_mul(_grouped_mm(xs, w1, offs=offs), _grouped_mm(xs, w3, offs=offs))
    return _grouped_mm(h, w2, offs=offs)


class Unpermute(torch.autograd.Function):
    """out [M, D], the kept assignments' rows packed by expert -> [A, D] in assignment order,
    zeros where dropped: index_copy, whose backward keeps its source only to read its shape
    (torch's derivatives.yaml), a copy of every routed row for nothing. This one keeps the index;
    its backward is index_copy's (a gather of the gradient rows, exact)."""

    @staticmethod
    def forward(ctx, out: Tensor, order: Tensor, A: int) -> Tensor:
        ctx.save_for_backward(order)
        return out.new_zeros(A, out.shape[1]).index_copy_(0, order, out)  # unique rows: deterministic

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def unpermute(out: Tensor, order: Tensor, A: int) -> Tensor:
    """Unpermute in eager mode; index_copy under torch.compile, whose partitioner keeps what it needs."""
    if torch.compiler.is_compiling():
        return out.new_zeros(A, out.shape[1]).index_copy(0, order, out)
    return Unpermute.apply(out, order, A)


def _grouped_mm_runs_on(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether grouped_mm has a kernel for x's device in `dtype`: any CPU dtype; CUDA bf16 on
    compute capability 8.0 or newer (torch's documented requirement)."""
    if _grouped_mm is None:
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)


def _label(name: str) -> AbstractContextManager:
    """A named torch.profiler range over a part of forward ("moe.route", ...; bench/gpu.py
    --profile), only while a profiler runs: nothing otherwise (record_function costs a few
    microseconds even then) and nothing under torch.compile (which ignores it, with a warning)."""
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return record_function(name)
    return nullcontext()


class MoE(ExpertSurgery, nn.Module):
    """Routed SwiGLU experts (+ optional shared experts): x [B, T, D] -> [B, T, D].

    Parameters: router [E, D], w1 / w3 [E, D, H], w2 [E, H, D], shared (a SwiGLU of width
    shared_hidden, DeepSeekMoE, Dai et al. 2024) or None, shared_gate [1, D] (Qwen2-MoE's sigmoid
    gate on the shared output) or None. Buffers: expert_bias [E]
    (checkpointed), load [E] (training assignments since the last update_bias; not saved).

    After each forward: `stats` (detached, no host sync) and, in training, `aux_loss`
    (balance_coef * balance + z_loss_coef * z, or None when both are 0) for the trainer to add
    to its loss. `capacity_factor`, `router_temperature`, `balance_coef` and `z_loss_coef` are plain
    attributes that may be changed between steps. Capacity applies in training only; eval is
    dropless so outputs do not depend on what else is in the batch (prefill vs cached decode).
    """

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig, init_std: float = 0.02, out_std: float = 0.02):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={cfg.n_experts}] (got {cfg.top_k})")
        E, D, H = cfg.n_experts, d_model, hidden
        self.d_model, self.hidden, self.top_k = D, H, cfg.top_k
        self.init_std, self.out_std = init_std, out_std
        self.capacity_factor = float(cfg.capacity_factor)
        self.router_temperature = float(cfg.router_temperature)
        self.jitter = float(cfg.router_jitter)
        self.balance_coef, self.z_loss_coef = float(cfg.balance_coef), float(cfg.z_loss_coef)
        self.bias_update_rate = float(cfg.bias_update_rate)
        self.impl = "auto"  # expert layout: auto | grouped (grouped_mm) | padded (bmm)
        # (xs, counts, w1, w3, w2) -> out: the grouped layout's expert compute, and a weight as
        # computed with (module docstring)
        self.dispatch: Callable[..., Tensor] = grouped_swiglu
        self.local: Callable[[Tensor], Tensor] = _same
        # Rollout routing replay (rl/replay.py): `recorded` collects each forward's choices [N, k]
        # while a policy generates; `replay` [N, k] imposes them on the training forward
        self.recorded: list[Tensor] | None = None
        self.replay: Tensor | None = None
        self.router = nn.Parameter(torch.empty(E, D))  # nn.Linear(D, E) weight layout
        self.w1 = nn.Parameter(torch.empty(E, D, H))  # gate
        self.w3 = nn.Parameter(torch.empty(E, D, H))  # up
        self.w2 = nn.Parameter(torch.empty(E, H, D))  # down
        self.renormalize = cfg.renormalize
        self.shared = SwiGLU(D, cfg.shared_hidden or cfg.n_shared_experts * H) if cfg.n_shared_experts > 0 else None
        self.shared_gate = nn.Linear(D, 1, bias=False) if cfg.shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(E))  # checkpointed: selection only
        self.register_buffer("load", torch.zeros(E), persistent=False)  # since update_bias
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]

    def passed_over(self, tokens: int) -> None:
        """A Mixture-of-Depths block ran this layer on none of `tokens` tokens (a decode step whose token its
        predictor sent past the block: model/mod.py): while recording (routing replay), their choices are
        placeholders 0 .. k-1, as collate's padding, so each forward keeps its record and the sequences line up
        (a missing one failed every debug-hybrid RL run at its first rollouts: 'all input arrays must have the
        same shape'). Replayed, the block drops those tokens' outputs, so their experts change no result. In a
        training forward (a replayed micro-batch none of whose tokens the predictor sends through) no aux_loss:
        the last forward's, its graph freed by that micro-batch's backward, failed the next backward."""
        self.aux_loss = None
        if self.recorded is not None:
            k = self.top_k
            self.recorded.append(torch.arange(k, device=self.router.device).expand(tokens, k))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, init_std) for router, w1, w3; normal(0, out_std) for the residual
        projections w2 (as the dense model's ffn w2); zero bias and load."""
        for p in (self.router, self.w1, self.w3):
            nn.init.normal_(p, 0.0, self.init_std)
        nn.init.normal_(self.w2, 0.0, self.out_std)
        if self.shared is not None:
            nn.init.normal_(self.shared.w1.weight, 0.0, self.init_std)
            nn.init.normal_(self.shared.w3.weight, 0.0, self.init_std)
            nn.init.normal_(self.shared.w2.weight, 0.0, self.out_std)
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, 0.0, self.init_std)
        self.expert_bias.zero_()
        self.load.zero_()

    def reset_buffers(self, device: torch.device) -> None:
        """Zero bias and load on `device` (a model built on the meta device has none)."""
        self.expert_bias = torch.zeros(self.n_experts, device=device)
        self.load = torch.zeros(self.n_experts, device=device)

    # ---- routing -------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """x [N, D] -> Routing. The router runs in fp32 even under autocast ("selective
        precision", Switch section 2.4): bf16 logits make the softmax and top-k unstable. With
        `replay` set the experts are those given (the gates still the router's probabilities of
        them, so the router learns as it would have)."""
        if self.training and self.jitter > 0:  # multiplicative input jitter (Switch section 2.4)
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.local(self.router).float()) / self.router_temperature  # [N, E]
        probs = logits.softmax(-1)
        if self.replay is not None:  # the choices generation made for these tokens (routing replay)
            experts = self.replay  # [N, k]
        else:
            experts = (probs.detach() + self.expert_bias).topk(self.top_k, -1).indices  # [N, k]
        if self.recorded is not None:
            self.recorded.append(experts)
        gates = probs.gather(-1, experts)
        if self.renormalize:  # over the chosen k (Mixtral; DeepSeek-V3 eq. 13).
            gates = gates / gates.sum(-1, keepdim=True)
        # By default top-1 keeps the raw prob (Switch eq. 2): renormalised it would be 1, and the
        # router would get no gradient from the model's loss (Mixtral does it all the same).
        counts = torch.zeros(self.n_experts, device=x.device).scatter_add_(
            0, experts.flatten(), torch.ones(experts.numel(), device=x.device)
        )
        return Routing(logits, probs, experts, gates, counts)

    def capacity(self, n_tokens: int) -> int:
        """Token slots per expert in training, 0 for dropless: ceil(cf * N * k / E), at most N
        (a token is routed to an expert at most once)."""
        if self.capacity_factor <= 0:
            return 0
        per_expert = self.capacity_factor * n_tokens * self.top_k / self.n_experts
        return min(n_tokens, math.ceil(per_expert))

    def experts(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's expert weights w1, w3, w2 as plain tensors ([E, D, H], [E, D, H],
        [E, H, D] in one process; fewer experts or hidden units when parallel)."""
        return self.local(self.w1), self.local(self.w3), self.local(self.w2)

    @staticmethod
    def expert_ffn(h: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """h [E, C, D] -> [E, C, D]: every expert's SwiGLU on its slots, three bmm."""
        return torch.bmm(silu_mul(torch.bmm(h, w1), torch.bmm(h, w3)), w2)

    def grouped_layout(self, x: torch.Tensor, hidden: int | None = None) -> bool:
        """Whether forward uses grouped_mm for x: always under expert parallelism (it exchanges
        packed rows), else impl "grouped", or "auto" in eager mode where grouped_mm has a kernel
        (CPU; CUDA in bf16 on sm80+) with rows of a multiple of 16 bytes (a kernel requirement;
        `hidden`: this rank's expert width). Measured faster than padded on both (bench/moe.py
        on CPU; bench/gpu.py's moe-7b layers on an H200). Under torch.compile, grouped in bf16,
        compiled whole with or without a capacity (padded's largest-load read when dropless is a
        host sync that broke the graph at every MoE layer, which ran eager); padded in fp32:
        grouped_mm's fake-tensor kernel rejects it (torch 2.13)."""
        if self.dispatch is not grouped_swiglu:
            return True
        if self.impl != "auto":
            return self.impl == "grouped"
        dtype = compute_dtype(x)
        if not _grouped_mm_runs_on(x, dtype):
            return False
        if torch.compiler.is_compiling() and dtype != torch.bfloat16:
            return False
        return self.d_model * dtype.itemsize % 16 == 0 and (hidden or self.hidden) * dtype.itemsize % 16 == 0

    # ---- forward -------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, residual: bool = False) -> torch.Tensor:
        """`residual`: the output is only added to the residual stream (model/recompute.py)."""
        B, T, D = x.shape
        xf = x.reshape(B * T, D)  # [N, D]
        N, k = xf.shape[0], self.top_k
        with _label("moe.route"):
            r = self.route(xf)
        A = N * k
        with _label("moe.sort"):
            flat_e = r.experts.flatten()  # [A], assignment a = token a // k, choice a % k
            order = flat_e.argsort(stable=True)  # grouped by expert, token order within each
            counts = r.counts.long()
            sorted_e = flat_e[order]
            rank = torch.arange(A, device=x.device) - (counts.cumsum(0) - counts)[sorted_e]
        # replayed routing is generation's, which is dropless (eval): so is its training forward
        cap = self.capacity(N) if self.training and self.replay is None else 0
        weights = self.experts()
        layout = self._grouped if self.grouped_layout(xf, weights[0].shape[-1]) else self._padded
        out, dropped = layout(xf, order, sorted_e, rank, counts, cap, weights)  # [A, D], 0 if dropped
        # Selective checkpointing's re-run stops once it has what the backward needs: the stats
        # (the auxiliary losses' graph) come before the shared experts, whose w2 ends the forward.
        with _label("moe.stats"):
            self._record(r, dropped)
        with _label("moe.combine"), output_unread(residual):
            y = torch.bmm(r.gates.to(out.dtype).unsqueeze(1), out.view(N, k, D)).squeeze(1)
        if self.shared is not None:
            with _label("moe.shared"):
                shared = self.shared(xf, residual and self.shared_gate is None)  # the gate's backward reads it
                if self.shared_gate is not None:  # in fp32, as the router: it reads the router's input
                    with torch.autocast(xf.device.type, enabled=False):  # (autocast would keep a cast copy)
                        gate = F.linear(xf.float(), self.local(self.shared_gate.weight).float())  # [N, 1]
                    shared = shared * torch.sigmoid(gate).to(shared.dtype)
                y = y + shared
        return y.view(B, T, D)

    def _grouped(
        self,
        xf: torch.Tensor,
        order: torch.Tensor,
        sorted_e: torch.Tensor,
        rank: torch.Tensor,
        counts: torch.Tensor,
        cap: int,
        weights: tuple[Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Kept assignments packed by expert, no padding: [M, D] through `dispatch` (three
        grouped_mm with per-expert offsets, or their expert-parallel exchange), no host sync.
        With a capacity, the dropped assignments go after the kept ones, all A rows go in, and
        the rows past the last offset (which grouped_mm leaves uninitialised, in the forward
        and in the input's gradient) are zeroed at both ends: a static shape, where taking the
        M kept rows would read M on the host. The expert-parallel exchange reads its row counts
        anyway: it is sent only the kept rows."""
        A, kept = order.numel(), None
        if cap:
            counts, kept = counts.clamp(max=cap), rank < cap  # kept: in expert-sorted order
            if self.dispatch is grouped_swiglu:
                last = (~kept).to(torch.uint8).argsort(stable=True)  # dropped last, kept ones still by expert
                order, kept = order[last], kept[last].unsqueeze(-1)  # [A], [A, 1]
            else:
                order, kept = order[kept], None
        dt = compute_dtype(xf)  # grouped_mm is not on autocast's list: cast as mm would be
        with _label("moe.permute"):
            xs = xf[order // self.top_k].to(dt)  # [M, D] (capacity, one process: [A, D])
            if kept is not None:
                xs = torch.where(kept, xs, 0.0)  # its backward zeroes the dropped rows' gradient
        with _label("moe.experts"):
            out = self.dispatch(xs, counts, *(w.to(dt) for w in weights))
            if kept is not None:
                out = torch.where(kept, out, 0.0)
        with _label("moe.unpermute"):
            full = unpermute(out, order, A)
        return full, 1.0 - counts.sum() / A

    def _padded(
        self,
        xf: torch.Tensor,
        order: torch.Tensor,
        sorted_e: torch.Tensor,
        rank: torch.Tensor,
        counts: torch.Tensor,
        cap: int,
        weights: tuple[Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Each assignment gets a slot (expert, rank) in an [E, C, D] buffer, then three bmm.
        Static shapes when compiled in capacity mode (C = capacity); otherwise C is the largest
        expert's count capped at the capacity (one host sync; the same assignments drop)."""
        (N, D), E, k, A = xf.shape, self.n_experts, self.top_k, order.numel()
        C = cap
        if cap == 0 or not torch.compiler.is_compiling():
            C = max(1, min(cap or N, int(counts.max())))
        # Slot of each assignment in the [E * C] buffer; E * C (a zero row) when dropped.
        slot_sorted = torch.where(rank < C, sorted_e * C + rank, E * C)
        slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)  # [A]
        # Token feeding each slot; N (a zero row) for empty slots. Dropped ones all write the
        # sacrificial entry E * C, which is cut off.
        src = torch.full((E * C + 1,), N, dtype=torch.long, device=xf.device)
        src = src.scatter_(0, slot, torch.arange(A, device=xf.device) // k)[: E * C]
        with _label("moe.permute"):
            h = F.pad(xf, (0, 0, 0, 1))[src].view(E, C, D)  # gather, not scatter: no atomics
        with _label("moe.experts"):
            out = F.pad(self.expert_ffn(h, *weights).view(E * C, D), (0, 0, 0, 1))  # [E * C + 1, D]
        with _label("moe.unpermute"):
            return out[slot], (slot == E * C).sum() / A

    def _record(self, r: Routing, dropped: torch.Tensor) -> None:
        """Losses, stats and the load for update_bias; all on device, no host sync.

        balance = E * sum_e f_e P_e (Switch eq. 4; GShard): f_e the fraction of assignments to
        e before capacity (counted after dropping it under-states imbalance, Megatron-LM #1513),
        P_e the mean router prob; 1 when uniform. z = mean(logsumexp(logits)^2) (ST-MoE, Zoph
        et al. 2022, eq. 5): keeps logits small so the fp32 softmax stays well conditioned.
        """
        E = self.n_experts
        balance = E * ((r.counts / r.experts.numel()) * r.probs.mean(0)).sum()
        z = torch.logsumexp(r.logits, -1).square().mean()
        if in_recompute():  # computed again for what their backward saves; the forward's are kept
            return
        if self.training and (self.balance_coef > 0 or self.z_loss_coef > 0):
            self.aux_loss = self.balance_coef * balance + self.z_loss_coef * z
        else:
            self.aux_loss = None
        if self.training and self.bias_update_rate > 0:
            self.load += r.counts
        self.stats = {
            "tokens_per_expert": r.counts,
            "dropped": dropped.detach(),
            "entropy": torch.special.entr(r.probs.detach()).sum(-1).mean(),
            "balance_loss": balance.detach(),
            "z_loss": z.detach(),
        }

    @torch.no_grad()
    def update_bias(self, skip: Tensor | None = None) -> None:
        """Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3): bias_e += rate *
        sign(mean load - load_e), centred (as torchtitan), over the load accumulated by
        training forwards since the last call; then the load restarts. Call once per optimizer
        step; with data parallelism all-reduce `load` first. No-op when bias_update_rate is 0.
        `skip` (0-d bool, on device): the step's update was withheld, and so is this one: a bad
        batch's routing must not steer the bias any more than its gradient steers the weights."""
        if self.bias_update_rate <= 0:
            return
        delta = self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        delta = delta - delta.mean()
        if skip is not None:
            delta = torch.where(skip, torch.zeros_like(delta), delta)  # no host sync
        self.expert_bias += delta
        self.load.zero_()
