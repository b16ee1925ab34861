"""Log-likelihoods of continuations under a trimtab model: the one scoring routine behind
`trimtab eval --data` (perplexity, bits per byte) and the lm-evaluation-harness adapter.

Shape legend: B requests in a forward, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from trimtab.model import Transformer

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids); the context is non-empty


def continuation_scores(
    model: Transformer, pairs: list[Pair], pad_id: int, batch_size: int = 8
) -> list[tuple[float, bool]]:
    """For each (context, continuation): (sum of log p(continuation token | everything before it),
    whether every continuation token is the argmax). The input is (context + continuation)
    without its last token, left-truncated to the model's context, as lm-evaluation-harness's
    causal backends do. Requests run longest first, right-padded (causal attention: a pad never
    changes the tokens before it), and come back in their order."""
    if not all(context and continuation for context, continuation in pairs):
        raise ValueError("each pair needs a context and a continuation token (an empty one would score 0)")
    limit = model.cfg.max_seq_len
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        inputs = [(pairs[i][0] + pairs[i][1])[-(limit + 1) :][:-1] for i in chunk]
        T = max(map(len, inputs))
        batch = torch.full((len(inputs), T), pad_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            logits = model(batch.to(device))  # [B, T, V]
        for row, i in enumerate(chunk):
            cont = pairs[i][1]
            n = len(inputs[row])
            logp = logits[row, n - len(cont) : n].float().log_softmax(-1)  # [len(cont), V]
            target = torch.tensor(cont, device=device)
            total = logp.gather(-1, target[:, None]).sum().item()
            out[i] = (total, bool((logp.argmax(-1) == target).all()))
    return out


def rolling_windows(ids: list[int], prefix: int, limit: int, stride: int) -> list[Pair]:
    """(context, continuation) pairs that score every token of `ids` once, the first one after
    `prefix` (the start token), each with as much context as a `limit`-token window holds when
    windows advance by `stride` (stride == limit: disjoint windows, lm-evaluation-harness's
    loglikelihood_rolling with context_len 1; smaller strides give each token more context,
    at more compute: the sliding window of transformers' perplexity guide)."""
    seq = [prefix, *ids]  # seq[j + 1] is ids[j]
    pairs, scored = [], 0
    while scored < len(ids):
        end = min(scored + stride if scored else limit, len(ids))
        begin = max(0, end - limit)
        pairs.append((seq[begin : scored + 1], seq[scored + 1 : end + 1]))
        scored = end
    return pairs
