"""Decoder-only Transformer (Llama architecture): pre-norm blocks, RoPE, GQA, SwiGLU; each
layer's feed-forward is dense or Mixture-of-Experts, and a layer may be Mixture-of-Depths, as
model.layer_pattern says.

Shape legend: B batch, T time, S key length (cached + new), D d_model, V vocab.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trimtab.config import CHECKPOINTING, ModelConfig
from trimtab.model.cache import KVCache
from trimtab.model.layers import Attention, RMSNorm, Rotary, SwiGLU, group_qkv
from trimtab.model.mod import DepthRouter
from trimtab.model.moe import MoE
from trimtab.model.recompute import selective_contexts


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)). The ffn is dense or
    MoE; a Mixture-of-Depths block ("mod" in its kind) runs both on only the tokens its router
    picks (model/mod.py)."""

    def __init__(self, cfg: ModelConfig, kind: str = "dense", capacity: float = 1.0):
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if "moe" in kind:
            out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
            self.ffn = MoE(cfg.d_model, cfg.moe.expert_hidden, cfg.moe, cfg.init_std, out_std)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)
        self.depth = (
            DepthRouter(cfg.d_model, capacity, cfg.mod.warmup_steps, cfg.mod.predictor_loss_coef)
            if "mod" in kind
            else None
        )
        self.checkpointing = "off"  # model/recompute.py's modes (Transformer.set_activation_checkpointing)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D], checkpointed as self.checkpointing says in training. The
        checkpoint is inside the forward so that train.compile, which compiles each block on its
        own, traces it with selective checkpointing's policy (a checkpoint around a compiled block
        sees no ops to keep and recomputes nearly all: 9.2 against 27-28.5 KB kept per token)."""
        if cache is not None:
            return self.decode(x, rope, mask, cache, layer)
        mode = self.checkpointing if self.training and torch.is_grad_enabled() else "off"
        if mode == "off":
            return self.compute(x, rope, mask, cache, layer)
        contexts = {"context_fn": selective_contexts} if mode == "selective" else {}
        return checkpoint(self.compute, x, rope, mask, cache, layer, use_reentrant=False, **contexts)

    @torch.compiler.disable
    def decode(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """Generation's forward (a KV cache), eager where the block is compiled: its shapes and
        cache position change every step, so compiled it recompiled until torch.compile's limit
        and fell back (41 recompiles and 14 s for 16 tokens of debug-hybrid)."""
        return self.compute(x, rope, mask, cache, layer)

    def compute(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        """The block's computation, what checkpointing runs again in the backward."""
        if self.depth is not None:
            idle = self.ffn.passed_over if isinstance(self.ffn, MoE) else None  # routing replay's record
            return self.depth(x, self.update, rope, cache, layer, idle)
        x = x + self.attn(self.attn_norm(x), rope, mask, cache, layer)
        return x + self.ffn(self.ffn_norm(x), residual=True)

    def update(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        """f(x) of block(x) = x + f(x): what a Mixture-of-Depths router gates."""
        h = self.attn(self.attn_norm(x), rope, mask, cache, layer)
        return h + self.ffn(self.ffn_norm(x + h))


def cache_mask(cache: KVCache, T: int) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask for T new tokens after a left-padded cache: each sees the real
    tokens up to itself, and itself (a pad position attends to itself alone, so no row of the
    attention is empty: an empty one is NaN, which a zero weight would not stop)."""
    q = torch.arange(cache.pos, cache.pos + T, device=cache.valid.device)[:, None]  # [T, 1]
    k = torch.arange(cache.pos + T, device=cache.valid.device)  # [S]
    seen = (k <= q) & cache.valid[:, None, : cache.pos + T]  # [B, T, S]
    return (seen | (k == q)).unsqueeze(1)


class Transformer(nn.Module):
    """Token embedding, n_layers pre-norm blocks, final RMSNorm, lm head (tied to the embedding
    when cfg.tie_embeddings). forward returns logits; the loss is the trainer's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(
                f"model vocab_size must be > 0 (got {cfg.vocab_size}); "
                "set it from the tokenizer before building the model"
            )
        self.cfg = cfg
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        capacities = iter(cfg.mod_capacities)
        self.blocks = nn.ModuleList(Block(cfg, kind, next(capacities) if "mod" in kind else 1.0) for kind in cfg.layers)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.rotary = Rotary(self.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.checkpointing = "off"  # model/recompute.py's modes
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, init_std) matrices, ones for norms, zeros for biases; residual output projections (attention wo,
        ffn w2) scaled by 1/sqrt(2 * n_layers) so the residual stream's variance does not grow
        with depth (GPT-2, Radford et al. 2019, section 2.3; Megatron-LM, Shoeybi et al. 2019)."""
        for name, p in self.named_parameters():  # tied weights are listed (and drawn) once
            if p.is_meta:  # no values to draw (a model built to be counted); grouping q, k, v on meta costs seconds
                continue
            self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """Fill `p`, the whole parameter `name` (or a CPU tensor of its shape), with its initial
        values, drawn from the global generator: reset_parameters does so in named_parameters
        order, and so does a model built on the meta device (model/meta.py), one at a time."""
        std = self.cfg.init_std
        if name.endswith(".bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:
            nn.init.ones_(p)
        elif name.endswith("attn.qkv.weight"):
            # Drawn in q, k, v order, then grouped: the same model as the same seed gave
            # before the fused layout was grouped (golden runs unchanged).
            heads = torch.empty_like(p).normal_(0.0, std)
            rows = [n * self.head_dim for n in (self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.n_kv_heads)]
            p.copy_(group_qkv(*heads.split(rows), self.cfg.n_kv_heads))
        else:
            residual = name.endswith(("wo.weight", "w2.weight", "ffn.w2"))  # ffn.w2: MoE experts
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers) if residual else std)

    def set_activation_checkpointing(self, mode: str) -> None:
        """off | selective | full (model/recompute.py): what of each block's activations its
        backward computes again instead of keeping them from the forward (in training only)."""
        if mode not in CHECKPOINTING:
            raise ValueError(f"activation checkpointing must be one of {', '.join(CHECKPOINTING)}, got {mode!r}")
        self.checkpointing = mode
        for block in self.blocks:
            block.checkpointing = mode

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """An empty KVCache matching this model's shape, dtype and device."""
        w = self.lm_head.weight
        return KVCache(
            self.cfg.n_layers,
            batch,
            self.cfg.n_kv_heads,
            max_len or self.cfg.max_seq_len,
            self.head_dim,
            w.dtype,
            w.device,
        )

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V]. With a cache, tokens continue at cache.pos."""
        return self.lm_head(self.hidden(tokens, cache))

    def next_logits(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, T] after the cache's -> the logits of the token after them [B, V]: the head
        on the last position only (a prompt's whole [B, T, V] would be most of a prefill's memory
        at a large vocabulary: 64 prompts of 2k tokens over 150k tokens, 78 GB in fp32)."""
        return self.lm_head(self.hidden(tokens, cache)[:, -1])

    def hidden(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens [B, T] -> final normalised hidden states [B, T, D] (the lm head's input)."""
        T = tokens.shape[1]
        offset = cache.pos if cache is not None else 0
        limit = min(self.cfg.max_seq_len, cache.max_len) if cache is not None else self.cfg.max_seq_len
        if offset + T > limit:
            raise ValueError(
                f"sequence of {offset + T} tokens (cache offset {offset} + {T} new) "
                f"exceeds the limit of {limit} (model.max_seq_len or the cache size)"
            )
        x = self.tok_emb(tokens)
        rope = self.rotary.table(offset, T)
        padded = cache is not None and cache.valid is not None  # a batch of prompts of different lengths
        mask = cache_mask(cache, T) if padded else self._chunk_mask(offset, T, tokens.device)
        x = self.run_blocks(x, range(len(self.blocks)), rope, mask, cache)
        if cache is not None:
            cache.advance(T)
        return self.norm(x)

    def run_blocks(
        self,
        x: torch.Tensor,
        layers: range,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] through the blocks at `layers` (a pipeline stage runs its own)."""
        for i in layers:
            x = self.blocks[i](x, rope, mask, cache, i)
        return x

    @staticmethod
    def _chunk_mask(offset: int, T: int, device: torch.device) -> torch.Tensor | None:
        """Boolean [T, S] mask for several new tokens after a non-empty cache: new token i (at
        position offset + i) sees keys 0..offset + i. None where is_causal / no mask suffices."""
        if offset == 0 or T == 1:
            return None
        return torch.ones(T, offset + T, dtype=torch.bool, device=device).tril(offset)

    def moe_layers(self) -> list[tuple[int, MoE]]:
        return [(i, b.ffn) for i, b in enumerate(self.blocks) if isinstance(b.ffn, MoE)]

    MOE_KNOBS = ("capacity_factor", "router_temperature", "balance_coef", "z_loss_coef", "bias_update_rate")
    RENAMED_KNOBS = {"temperature": "router_temperature", "aux_loss_coef": "balance_coef"}  # older checkpoints

    def moe_state(self) -> dict[str, dict[str, float]]:
        """Each MoE layer's expert count and live knobs, for the checkpoint (surgery and the
        orchestrator change them while training, so the config alone no longer describes them)."""
        return {
            str(i): {"n_experts": moe.n_experts, **{k: getattr(moe, k) for k in self.MOE_KNOBS}}
            for i, moe in self.moe_layers()
        }

    def load_moe_state(self, state: dict[str, dict[str, float]]) -> None:
        """Resize each MoE layer to its saved expert count (before its weights are loaded) and
        restore its knobs."""
        layers = dict(self.moe_layers())
        for key, saved in state.items():
            moe = layers[int(key)]
            while moe.n_experts < saved["n_experts"]:
                moe.add_expert(0)
            while moe.n_experts > saved["n_experts"]:
                moe.prune_expert(moe.n_experts - 1)
            saved = {self.RENAMED_KNOBS.get(k, k): v for k, v in saved.items()}
            for k in self.MOE_KNOBS:
                setattr(moe, k, saved[k])

    def mod_layers(self) -> list[tuple[int, DepthRouter]]:
        return [(i, b.depth) for i, b in enumerate(self.blocks) if b.depth is not None]

    def set_step(self, step: int) -> None:
        """Step-dependent model settings: the Mixture-of-Depths capacity warm-up."""
        for _, router in self.mod_layers():
            router.set_step(step)

    def mod_state(self) -> dict[str, float]:
        """Each Mixture-of-Depths layer's target capacity (the orchestrator may change it)."""
        return {str(i): router.target for i, router in self.mod_layers()}

    def load_mod_state(self, state: dict[str, float]) -> None:
        layers = dict(self.mod_layers())
        for key, target in state.items():
            layers[int(key)].target = target

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses of the last training forward (MoE balance and z losses,
        Mixture-of-Depths predictor BCE); None when there are none."""
        layers = [m for _, m in self.moe_layers()] + [r for _, r in self.mod_layers()]
        losses = [m.aux_loss for m in layers if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def num_params(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameter count, tied weights once; optionally without the embedding table and an
        untied lm head; `active`: only the top_k of each MoE layer's routed experts (the weights
        one token uses)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            n -= sum(_inactive(moe) for _, moe in self.moe_layers())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at context length seq_len:

            6 * (N_matmul + V * D) + 12 * n_layers * D * seq_len

        N_matmul counts the weights of the blocks' linear layers (norm gains and the embedding
        lookup do no matmul); V * D is the lm head, a real matmul even when tied. Each weight costs
        2 FLOPs per token forward and 4 backward. The attention term is QK^T and AV (2 * 2 * D *
        seq_len per layer forward, times 3), counted for full rather than causal attention.
        Kaplan et al. 2020 (table 1), PaLM (Chowdhery et al. 2022) appendix B, nanoGPT
        estimate_mfu. A MoE layer counts its router and the k experts a token goes through; a
        Mixture-of-Depths block at capacity c counts its router and predictor for every token,
        its other weights for a fraction c of them, and attention over c * seq_len keys for
        that fraction (c^2; Raposo et al. 2024 section 3.4).
        """
        cfg = self.cfg
        total = 6 * cfg.vocab_size * cfg.d_model
        for block in self.blocks:
            matmul = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
            attention = 12 * cfg.d_model * seq_len
            if isinstance(block.ffn, MoE):
                moe = block.ffn
                matmul += moe.router.numel() + moe.w1.numel() + moe.w2.numel() + moe.w3.numel() - _inactive(moe)
            if block.depth is not None:
                c = block.depth.target
                routing = sum(p.numel() for p in block.depth.parameters())
                matmul = routing + c * (matmul - routing)
                attention *= c * c
            total += 6 * matmul + attention
        return round(total)


def _inactive(moe: MoE) -> int:
    """Routed-expert weights a token does not use: (E - k) of E experts."""
    per_expert = (moe.w1.numel() + moe.w2.numel() + moe.w3.numel()) // moe.n_experts
    return (moe.n_experts - moe.top_k) * per_expert


def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> Transformer:
    """Validate cfg (ConfigError), build and initialise a Transformer (on CPU, so a seed gives
    the same weights on any device), then move it to `device`."""
    model = Transformer(cfg.resolved())
    return model.to(device) if device is not None else model
