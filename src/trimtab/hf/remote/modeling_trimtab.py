"""TrimtabForCausalLM: trimtab's decoder in inference, for `trust_remote_code=True`.

Self-contained (torch + transformers, no trimtab): it travels with the weights of a model no
standard class computes. Parameter names are trimtab's own, so the weights are the checkpoint's
tensors (each MoE router divided by its live temperature at export). The function is trimtab's
eval mode (src/trimtab/model/ of trimtab):

    block        x + attn(norm(x)), then x + ffn(norm(x)); RMSNorm; rotate-half RoPE; GQA
    MoE ffn      fp32 router softmax; experts chosen by probs + expert_bias (selection only);
                 gates = the chosen probs, renormalised when norm_topk_prob; dropless; shared
                 experts added (times sigmoid(x . g) when gated)
    MoD block    the causal predictor decides: token t is processed iff predictor(x_t) > 0; a
                 processed token gets x + sigmoid(router(x)) * f(x), attending to processed keys
                 (and itself); skipped tokens ride the residual (Raposo et al. 2024)

Shape legend: B batch, T time, D hidden, H heads, K kv heads, E head dim, V vocab.
Generation recomputes the whole sequence each step (no KV cache): correct for every layer kind.
Padding (attention_mask 0, left or right) changes nothing for the real tokens: positions count
real tokens only, pad keys are hidden, and every routing decision is a token's own (MoD predictor,
MoE router), so a pad's never reaches another token.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_trimtab import TrimtabConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(cfg, positions):
    """cos, sin [..., T, 1, E/2] for positions [..., T] (float64 angles, then float32, as trimtab),
    scaled per trimtab_rope. Computed per forward, not kept in a buffer: transformers builds the
    model on the meta device, where a buffer computed at construction would be lost."""
    E = cfg.head_dim
    inv_freq = cfg.rope_theta ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    s = cfg.trimtab_rope
    if s["type"] == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s["type"] == "llama3":  # transformers' _compute_llama3_parameters
        old, low, high = s["original_max_seq_len"], s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / s["factor"], inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        inv_freq = torch.where((wavelen >= old / high) & (wavelen <= old / low), blended, scaled)
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    return angles.cos().unsqueeze(-2).float(), angles.sin().unsqueeze(-2).float()


def visibility(attention_mask, T, device):
    """What each query sees, bool [B, 1, T, T] (True: visible): causal, pad keys hidden; None when
    nothing is padded (plain causal attention). A pad query sees itself, so that its softmax is
    not over nothing (NaN); no real token sees it."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    pos = torch.arange(T, device=device)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    real = attention_mask.to(device=device, dtype=torch.bool)
    return ((causal & real[:, None, :]) | (pos[None, :] == pos[:, None])).unsqueeze(1)


def rotate(x, cos, sin):
    """x [B, T, n, E]: each pair (x1[i], x2[i]) rotated by its angle (rotate-half layout). The
    float32 tables are cast to x's dtype, as trimtab's rotary_qkv does: in a bfloat16 or float16
    model they would otherwise promote q and k to float32 beside a half-precision v, which
    scaled_dot_product_attention refuses."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.H, self.K, self.E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.K) * self.E, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.H * self.E, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.E, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.E, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask):
        """x [B, T, D] -> [B, T, D]; mask None (causal) or boolean [B, 1, T, T] (True: visible)."""
        B, T, _ = x.shape
        # rows grouped per kv head: G = H / K query heads, then its key, then its value
        G = self.H // self.K
        q, k, v = self.qkv(x).view(B, T, self.K, G + 2, self.E).split((G, 1, 1), 3)
        q, k, v = q.reshape(B, T, self.H, self.E), k.squeeze(3), v.squeeze(3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, n, T, E]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.H != self.K
        )
        return self.wo(out.transpose(1, 2).reshape(B, T, self.H * self.E))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, cfg, n_experts):
        super().__init__()
        D, Hd = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Parameter(torch.empty(n_experts, D))
        self.w1 = nn.Parameter(torch.empty(n_experts, D, Hd))
        self.w3 = nn.Parameter(torch.empty(n_experts, D, Hd))
        self.w2 = nn.Parameter(torch.empty(n_experts, Hd, D))
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared = SwiGLU(D, shared) if shared else None
        self.shared_gate = nn.Linear(D, 1, bias=False) if shared and cfg.shared_expert_gate else None

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        probs = F.linear(xf.float(), self.router.float()).softmax(-1)  # [N, n_experts]
        experts = (probs + self.expert_bias).topk(self.top_k, -1).indices  # [N, k]
        gates = probs.gather(-1, experts)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        y = torch.zeros_like(xf)
        for e in experts.unique().tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = F.silu(xf[token] @ self.w1[e]) * (xf[token] @ self.w3[e])
            y.index_add_(0, token, (h @ self.w2[e]) * gates[token, slot, None].to(x.dtype))
        if self.shared is not None:
            shared = self.shared(xf)
            y = y + (shared * torch.sigmoid(self.shared_gate(xf)) if self.shared_gate is not None else shared)
        return y.view(B, T, D)


class DepthRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.router = nn.Linear(D, 1, bias=False)
        hidden = cfg.mod_predictor_hidden
        self.predictor = nn.Sequential(nn.Linear(D, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, 1, bias=False))


class Block(nn.Module):
    def __init__(self, cfg, kind, n_experts):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, n_experts) if "moe" in kind else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.depth = DepthRouter(cfg) if "mod" in kind else None

    def update(self, x, cos, sin, mask):
        h = self.attn(self.attn_norm(x), cos, sin, mask)
        return h + self.ffn(self.ffn_norm(x + h))

    def forward(self, x, cos, sin, mask):
        """mask: visibility() of the batch (None: causal, nothing padded)."""
        if self.depth is None:
            x = x + self.attn(self.attn_norm(x), cos, sin, mask)
            return x + self.ffn(self.ffn_norm(x))
        chosen = self.depth.predictor(x).squeeze(-1) > 0  # [B, T], from x_t alone: causal
        if not bool(chosen.any()):
            return x
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        seen = mask[:, 0] if mask is not None else pos[None, :] <= pos[:, None]  # [B or 1, T, T]
        # processed keys (and itself) among those the batch's mask shows
        visible = (seen & chosen[:, None, :]) | (pos[None, :] == pos[:, None])  # [B, T, T]
        gate = torch.sigmoid(self.depth.router(x).squeeze(-1).float()).unsqueeze(-1).to(x.dtype)
        update = gate * self.update(x, cos, sin, visible.unsqueeze(1))
        return x + torch.where(chosen.unsqueeze(-1), update, torch.zeros((), dtype=x.dtype, device=x.device))


class TrimtabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TrimtabConfig
    base_model_prefix = ""
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "tok_emb.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(
            Block(config, kind, n) for kind, n in zip(config.layer_kinds, config.experts_per_layer)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_emb

    def set_input_embeddings(self, value):
        self.tok_emb = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        """input_ids [B, T] -> logits [B, T, V]. attention_mask [B, T] (1: token, 0: pad, left or
        right): each real token's logits are those of its sequence alone, unpadded."""
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(f"{T} tokens exceed max_position_embeddings={self.config.max_position_embeddings}")
        mask = visibility(attention_mask, T, input_ids.device)
        if mask is None:
            positions = torch.arange(T, device=input_ids.device)
        else:  # a token's position counts the real tokens before it: left padding shifts nothing
            positions = (attention_mask.to(input_ids.device).long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        cos, sin = rope_tables(self.config, positions)
        x = self.tok_emb(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # no KV cache: the whole sequence every step, with its padding mask (batched prompts)
        return {"input_ids": input_ids, "attention_mask": attention_mask}
