"""Sampling from a trained model: temperature, top-k and nucleus (top-p) filtering, KV-cached
decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trimtab.model import Transformer

if TYPE_CHECKING:
    from trimtab.data import TextTokenizer


def prompt_ids(tok: TextTokenizer, prompt: str, limit: int) -> list[int]:
    """A prompt's ids as transformers' tokenizer(prompt) gives them: with what the tokenizer adds
    around a text (a Hugging Face model's start token; trimtab's own adds nothing), at most
    `limit`, the end kept (and the start token, first, where the model always saw it). An empty
    prompt without a start token starts from end-of-text."""
    ids = tok.encode(prompt, specials=True)
    if len(ids) > limit:
        keep = 1 if tok.bos_id is not None and ids[0] == tok.bos_id else 0
        ids = ids[:keep] + ids[len(ids) - (limit - keep) :]
    return ids or [tok.eos_id]


def fit_prompt(tok: TextTokenizer, prompt: str, context: int, max_new_tokens: int) -> tuple[list[int], str]:
    """The prompt's ids (prompt_ids) cut to leave room for max_new_tokens in the model's `context`
    positions (at least one of the prompt's kept), and what that gives up, in words ('' if nothing)."""
    room = min(max_new_tokens, context - 1)
    whole = len(tok.encode(prompt, specials=True))
    ids = prompt_ids(tok, prompt, context - room)
    said = []
    if len(ids) < whole:
        said.append(
            f"the prompt's {whole} tokens and the {max_new_tokens} new ones asked for pass the model's {context} "
            f"positions: the prompt is cut to its last {len(ids)} tokens"
        )
    if room < max_new_tokens:
        said.append(f"at most {context - len(ids)} new tokens of the {max_new_tokens} asked for fit")
    return ids, "; ".join(said)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from logits [B, V] -> LongTensor [B].

    temperature <= 0 is greedy (argmax). top_k > 0 keeps the k most likely tokens; top_p < 1 keeps
    the smallest set of most likely tokens whose probability reaches top_p (Holtzman et al. 2019),
    always at least the most likely one.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = _nucleus(logits, top_p)
    return draw(logits.softmax(dim=-1), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of probs [B, V] (each row's sum > 0) -> LongTensor [B], by inverse
    transform sampling: one uniform a row, against the running sum. torch.multinomial draws one
    exponential per entry instead (0.7 ms for 64 x 512 on a CPU core, 14x this: a tenth of an
    RL step's generation). In float64, so the running sum over a large vocabulary keeps the
    smallest probabilities."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # the first token whose sum passes u
    # u rounds up to the total with probability ~2^-53: then the last token with any probability
    # (the first to reach the total), never one a filter removed; found by a search as well (the
    # running sum never falls), not cdf.argmax: 2 against 56 us at 64 x 512 on a CPU core. NaN
    # probabilities (a policy whose weights went NaN, for the orchestrator to find) search past
    # the end: a valid index still.
    last = torch.searchsorted(cdf, total).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return torch.minimum(index, last)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask every token outside the top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all more likely tokens
    drop = mass_before >= top_p
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    eos_id: int | None = None,
    seed: int = 0,
    vocab: int | None = None,
) -> list[int]:
    """Continue prompt_ids; return the new tokens only (ending with eos_id when it was drawn).

    One prefill forward over the prompt, then one-token steps on the KV cache. Stops after
    max_new_tokens, at eos_id, or when prompt + output would exceed model.cfg.max_seq_len.
    Runs in eval mode under inference_mode and restores the model's previous mode. `vocab`: the
    tokenizer's size (tok.vocab_size); ids from it up to model.cfg.vocab_size are never drawn
    (decodable_limit).
    """
    limit = model.cfg.max_seq_len
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    if len(prompt_ids) > limit:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds model.max_seq_len={limit}")
    budget = min(max_new_tokens, limit - len(prompt_ids))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            padded = decodable_limit(model.cfg.vocab_size, vocab)
            return _decode(model, prompt_ids, budget, (temperature, top_k, top_p), eos_id, seed, padded)
    finally:
        model.train(was_training)


def decodable_limit(model_vocab: int, tok_vocab: int | None) -> int | None:
    """The first id generation must not draw, or None when every row of the model's head is a
    token. A model's vocabulary is often padded past its tokenizer's (Qwen's to a multiple of 128,
    a trimtab run's model.vocab_size set above the tokenizer's): those rows have logits (never
    trained toward, yet not -inf) but no text, so an id drawn there prints as nothing."""
    return tok_vocab if tok_vocab is not None and 0 < tok_vocab < model_vocab else None


def mask_undecodable(logits: torch.Tensor, limit: int | None) -> torch.Tensor:
    """logits [B, V] with every id from `limit` on at -inf (decodable_limit), in place."""
    if limit is not None:
        logits[..., limit:] = float("-inf")
    return logits


def _decode(
    model: Transformer,
    prompt_ids: list[int],
    budget: int,
    filters: tuple[float, int, float],
    eos_id: int | None,
    seed: int,
    padded: int | None,
) -> list[int]:
    device = model.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(batch=1, max_len=len(prompt_ids) + budget)
    inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(budget):
        logits = mask_undecodable(model.next_logits(inputs, cache), padded)
        token = sample_next(logits, *filters, generator)
        out.append(int(token))
        if out[-1] == eos_id:
            break
        inputs = token.view(1, 1)
    return out
