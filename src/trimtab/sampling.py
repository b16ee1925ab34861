"""Sampling with a KV cache: one prefill forward over the prompt, then one token per forward.

Shape legend: B batch, V vocab.
"""

from __future__ import annotations

import torch

from trimtab.model import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]. temperature 0 is greedy; top_k 0 / top_p 1 disable."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Nucleus sampling (Holtzman et al. 2020): keep the smallest set of tokens whose
        # probability reaches top_p; the most likely token always stays.
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 50, top_p: float = 0.95, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """New token ids after `prompt_ids`; stops at eos_id or at the model's max_seq_len."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    limit = model.cfg.max_seq_len
    prompt = prompt_ids[-(limit - 1):] if prompt_ids else [eos_id if eos_id is not None else 0]
    out: list[int] = []
    try:
        with torch.inference_mode():
            cache = model.new_cache(batch=1)
            logits = model(torch.tensor([prompt], device=device), cache=cache)[:, -1]
            while len(out) < max_new_tokens:
                token = sample_next(logits, temperature, top_k, top_p, generator)
                out.append(int(token))
                if out[-1] == eos_id or cache.pos >= limit:
                    break
                logits = model(token[:, None], cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return out
