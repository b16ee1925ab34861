"""Transformer building blocks: RMSNorm, rotary embedding, grouped-query attention, SwiGLU FFN.

Shape legend:
    B batch, T time (tokens in this forward), S key length (cached + new), D d_model,
    H attention heads, K kv heads, G = H / K query heads per kv head, E head dim (D / H),
    F ffn hidden, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trimtab.config.model import ModelConfig, RopeScalingConfig
from trimtab.model.cache import KVCache
from trimtab.model.recompute import output_unread


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x runs in: autocast's where it is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class CastTwice(torch.autograd.Function):
    """x in a lower precision for two matmuls (SwiGLU's w1 and w3) as one tensor in memory:
    autocast casts x for each and each keeps its own copy for the backward. Two outputs (one a
    view of the other) keep the two gradients apart, summed in x's precision as autocast's two
    casts' would be (one low-precision tensor would sum them in its own): gradients unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return low, low.view_as(low)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        present = [g.to(ctx.dtype) for g in grads if g is not None]  # None: an output not used
        if not present:
            return None, None
        return (present[0] + present[1] if len(present) == 2 else present[0]), None


def cast_twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x for two matmuls: CastTwice in eager mode where autocast would cast it; x twice otherwise
    (under torch.compile the partitioner chooses what to keep)."""
    dtype = compute_dtype(x)
    if dtype == x.dtype or not x.is_floating_point() or torch.compiler.is_compiling():
        return x, x
    return CastTwice.apply(x, dtype)


class SiluMul(torch.autograd.Function):
    """silu(a) * b, SwiGLU's gate (Shazeer 2020), keeping a and b for the backward and computing
    silu(a) again there: autograd's two ops keep a, silu(a) and b, a third more. The backward is
    autograd's, op for op (the product's two products, silu's own backward kernel), so gradients
    are unchanged to the bit; recomputing silu is one elementwise pass, as Megatron-LM's and
    Liger-Kernel's fused SwiGLU do."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b: SiluMul in eager mode; the plain ops under torch.compile, whose partitioner
    chooses what to keep itself."""
    return F.silu(a) * b if torch.compiler.is_compiling() else SiluMul.apply(a, b)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019): LayerNorm without centring or bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding tables (Su et al. 2021, RoFormer), "rotate_half" convention.

    The head dim is split into halves (x1, x2) and the pair (x1[i], x2[i]) is rotated by the
    angle pos * theta^(-2i/E): the layout of Llama / transformers, so weights and logits carry
    over unchanged. Computed once for max_seq_len (in float64, then rounded), sliced per forward.
    `scaling` stretches the frequencies for long contexts (RopeScalingConfig).

    The tables span the whole head, the first half's sine negated, so a rotation is two
    elementwise products over whole heads: rotate(x) = x * cos + swap_halves(x) * sin.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScalingConfig | None = None):
        super().__init__()
        self.shape = (head_dim, max_seq_len, theta, scaling)  # what reset_buffers computes the tables from
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)  # [L, 1, E]
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_seq_len, theta, scaling = self.shape
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if scaling is not None and scaling.type != "none":
            inv_freq = scaled_frequencies(inv_freq, scaling)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # [L, E/2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1)[:, None].float(), torch.cat((-sin, sin), -1)[:, None].float()

    def reset_buffers(self, device: torch.device) -> None:
        """The tables again, on `device` (a model built on the meta device has none): computed on
        the CPU, as a CPU-built model's, so they are the same bits."""
        with torch.device("cpu"):
            cos, sin = self._tables()
        self.cos, self.sin = cos.to(device), sin.to(device)

    def table(self, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (signed) for positions [offset, offset + length), each [T, 1, E]."""
        end = offset + length
        return self.cos[offset:end], self.sin[offset:end]


def scaled_frequencies(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    """inv_freq [E/2] stretched for a longer context. linear: all divided by the factor (Chen et
    al. 2023). llama3 (Llama 3.1; transformers' _compute_llama3_parameters): wavelengths longer
    than original / low_freq_factor are divided by the factor, those shorter than original /
    high_freq_factor kept, and the band between blended linearly in original / wavelength."""
    if s.type == "linear":
        return inv_freq / s.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > s.original_max_seq_len / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= s.original_max_seq_len / s.high_freq_factor) & (
        wavelen <= s.original_max_seq_len / s.low_freq_factor
    )
    return torch.where(medium, blended, scaled)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x2, x1) over the last dim, a new tensor."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, sign: float = 1.0) -> None:
    """out = x [B, T, K, n, E] rotated by sign * its angle (cos, sin: Rotary's tables broadcast
    to x; out may be a strided view)."""
    torch.mul(x, cos, out=out).addcmul_(swap_halves(x), sin, value=sign)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """_rotate as one expression, for torch.compile: Dynamo cannot trace writes through out= into
    views, and inductor fuses this into one kernel anyway."""
    return x * cos + swap_halves(x) * sin


def head_tables(table: torch.Tensor, K: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A Rotary table [T, 1, E] copied out to [T, K, n, E]: a product with x [B, T, K, n, E] then
    broadcasts over B alone, in runs of n * E elements, where [T, 1, 1, E] cut it into runs of E
    (with whole-head tables: RotaryQKV's forward 1.6x, with its backward 1.5x faster at the debug
    preset's 24-dim heads, 64 x 28 tokens). A Mixture-of-Depths layer's per-token table [B, T, 1,
    E] -> [B, T, 1, 1, E], broadcast as it is."""
    table = table.unsqueeze(-2).to(dtype)
    return table.expand(-1, K, n, -1).contiguous() if table.dim() == 4 else table


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RotaryQKV.forward in differentiable ops: what the compiled model runs."""
    B, T, K, G2, E = qkv.shape
    G = G2 - 2
    cos, sin = cos.unsqueeze(-2).to(qkv.dtype), sin.unsqueeze(-2).to(qkv.dtype)
    q, k, v = qkv.split((G, 1, 1), dim=3)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    q, k = q.reshape(B, T, K * G, E), k.reshape(B, T, K, E)
    return q.transpose(1, 2), k.transpose(1, 2), v[:, :, :, 0].transpose(1, 2)


def group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Query, key and value rows (H*E, K*E, K*E; any trailing dims) in the grouped layout of the
    fused projection: for each kv head g, the rows of its G = H/K query heads, then k_g, then v_g.
    This is Megatron-LM's linear_qkv layout: tensor parallelism shards the fused weight in
    contiguous blocks of whole query groups, so every rank holds matching q, k and v heads."""
    K = n_kv_heads
    q, k, v = (t.reshape(K, -1, *t.shape[1:]) for t in (q, k, v))  # [K, G*E | E | E, ...]
    return torch.cat((q, k, v), dim=1).flatten(0, 1)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of group_qkv: grouped rows -> q [H*E, ...], k [K*E, ...], v [K*E, ...]."""
    G, K = n_heads // n_kv_heads, n_kv_heads
    grouped = qkv.reshape(K, G + 2, -1, *qkv.shape[1:])  # [K, G+2, E, ...]
    q, k, v = grouped.split((G, 1, 1), dim=1)
    return q.flatten(0, 2), k.flatten(0, 2), v.flatten(0, 2)


class RotaryQKV(torch.autograd.Function):
    """Fused projection [B, T, K, G+2, E] (grouped, see group_qkv) -> q [B, H, T, E], k, v
    [B, K, T, E], q and k rotated. K may be a tensor-parallel rank's share of the kv heads.

    Written by hand because the backward of a rotation is the inverse rotation, computed straight
    into one gradient buffer for the fused projection: autograd's version of slice / roll /
    concatenate allocates and zero-fills several activation-sized tensors per layer.
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, K, G2, E = qkv.shape
        G = G2 - 2
        # autocast: qkv may be lower precision
        tables = [head_tables(t, K, n, qkv.dtype) for n in (G, 1) for t in (cos, sin)]
        (cq, sq, ck, sk), xq, xk = tables, qkv[:, :, :, :G], qkv[:, :, :, G : G + 1]
        q = (xq * cq).addcmul_(swap_halves(xq), sq)  # [B, T, K, G, E]: _rotate's
        k = (xk * ck).addcmul_(swap_halves(xk), sk)
        ctx.save_for_backward(*tables)
        # v copied out: a view would keep the whole projection alive for SDPA's backward
        v = qkv[:, :, :, G + 1].clone()
        return q.view(B, T, K * G, E).transpose(1, 2), k.view(B, T, K, E).transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):
        cq, sq, ck, sk = ctx.saved_tensors
        B, K, T, E = gk.shape
        G = gq.shape[1] // K
        grad = gq.new_empty(B, T, K, G + 2, E)
        _rotate(gq.transpose(1, 2).unflatten(2, (K, G)), cq, sq, grad[:, :, :, :G], sign=-1.0)
        _rotate(gk.transpose(1, 2).unsqueeze(3), ck, sk, grad[:, :, :, G : G + 1], sign=-1.0)
        grad[:, :, :, G + 1].copy_(gv.transpose(1, 2))
        return grad, None, None


def decode_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache: KVCache, layer: int
) -> torch.Tensor:
    """One new token a row after the cache (generation on a CPU), without autograd: qkv [B, 1, K,
    G+2, E] -> the attention's output [B, K, G, E] (the heads in order), its key and value cached.
    mask [B, 1, 1, S] (True: seen) or None (every cached key).

    The same attention as Attention.forward's in fewer ops: at one query and a short cache the
    CPU's flash-attention kernel costs about twice its two products and a softmax (64 rows, 4
    heads: 114 against 53 us; 1.4-1.9x at 256-2048 keys of 64-128 dims, 0.9x at 16 rows x 1024
    keys), and the query and key rotated in one pass save RotaryQKV's second and its autograd
    wrapper. A decoding step of the debug preset: 1.1-1.14x faster.
    """
    B, _, K, G2, E = qkv.shape
    G = G2 - 2
    qk = qkv.new_empty(B, 1, K, G + 1, E)  # q's G heads, then k, per kv head: one rotation
    _rotate(qkv[:, :, :, : G + 1], cos.unsqueeze(-2).to(qkv.dtype), sin.unsqueeze(-2).to(qkv.dtype), qk)
    k, v = cache.update(layer, qk[:, :, :, G].transpose(1, 2), qkv[:, :, :, G + 1].transpose(1, 2))  # [B, K, S, E]
    scores = torch.matmul(qk[:, 0, :, :G], k.transpose(-1, -2)).mul_(E**-0.5)  # [B, K, G, S]
    if mask is not None:
        scores.masked_fill_(mask.view(B, 1, 1, -1).logical_not(), float("-inf"))
    return torch.matmul(scores.softmax(-1), v)  # [B, K, G, E]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (Ainslie et al. 2023).

    q, k, v come from one fused projection `qkv` in the grouped layout (group_qkv; with a bias
    when cfg.attn_bias, as Qwen2). K/V heads are shared by G = H/K query heads inside
    scaled_dot_product_attention (enable_gqa), never repeated in memory. cfg.qk_norm normalises
    each query and key head (RMSNorm over E) before the rotation, as Qwen3 (QK-norm: Dehghani et
    al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"). Head counts are read from
    the projection's output, so a tensor-parallel rank runs the same code on its own heads.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        self.group = self.n_heads // self.n_kv_heads
        self.qkv = nn.Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=cfg.attn_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. mask: None means causal from position 0 (or a single step)."""
        B, T, _ = x.shape
        G = self.group
        qkv = self.qkv(x).view(B, T, -1, G + 2, self.head_dim)  # [B, T, K, G+2, E]
        if self.q_norm is not None:
            q, k, v = qkv.split((G, 1, 1), dim=3)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=3)
        # generation on a CPU (no autograd, not traced): decode_attention's fewer ops
        if T == 1 and cache is not None and x.device.type == "cpu" and not qkv.requires_grad:
            if not torch.compiler.is_compiling():
                return self.wo(decode_attention(qkv, *rope, mask, cache, layer).view(B, 1, -1))
        rotary = rotary_qkv if torch.compiler.is_compiling() else RotaryQKV.apply
        q, k, v = rotary(qkv, *rope)  # [B, H, T, E], [B, K, T, E] x2
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, K, S, E]
        # No mask tensor in the common cases: is_causal when keys start at position 0 (S == T),
        # nothing when a single new token sees the whole cache; `mask` for chunked prefill.
        # S == T needs no comparison without a cache: under torch.compile with a dynamic T it
        # would be a SymBool, which SDPA's is_causal does not take (a graph break)
        causal = mask is None and (cache is None or k.shape[2] == T)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=G > 1
        )  # [B, H, T, E]
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020, "GLU Variants Improve Transformer"): a dense block's
    feed-forward, and a MoE layer's shared experts (model/moe.py).

    `local` is None unless expert parallelism shards the weights as DTensors (the shared experts,
    distributed/expert.py): it then reads each as this rank's shard and forward computes with
    those. Otherwise forward calls the Linear modules themselves, which tensor parallelism hooks
    (distributed/tensor.py)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.local: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor, residual: bool = False) -> torch.Tensor:
        """`residual`: the output is only added to the residual stream (model/recompute.py)."""
        x1, x3 = cast_twice(x)
        if self.local is None:
            h = silu_mul(self.w1(x1), self.w3(x3))
            with output_unread(residual):
                return self.w2(h)
        w1, w3, w2 = (self.local(m.weight) for m in (self.w1, self.w3, self.w2))
        h = silu_mul(F.linear(x1, w1), F.linear(x3, w3))
        with output_unread(residual):
            return F.linear(h, w2)
