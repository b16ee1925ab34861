"""Rollouts: a batch of responses generated at once on the KV cache, with the log-probability the
generating policy gave each token (the behaviour policy of the PPO-family objectives).

Prompts of different lengths are left-padded into one batch (model/cache.py: `pad`), so one
prefill forward and then one forward per new token serve every row; a row that drew end-of-text
stops (its later positions are padding, never trained) and the batch stops when all rows have.
With greedy decoding each row's tokens are those of `sampling.generate` on that prompt alone.

The behaviour log-probability of a token is log softmax(logits / temperature) at it: the
distribution the trainer's objective evaluates (rl/loss.py), whatever nucleus (top-p) filter
restricted the draw. This is the engine's whole interface to the trainer (`generate` with the
policy's weights, its version recorded); a serving engine (vLLM, SGLang) in its place returns
the same fields, and receives new weights where this one reads the trainer's model.

Shape legend: B rows (prompts x samples per prompt), P the longest prompt, N new tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from trimtab.model import Transformer
from trimtab.rl.replay import recording
from trimtab.sampling import sample_next


@dataclass
class Rollout:
    prompt: list[int]
    tokens: list[int]  # the response, ending with end-of-text when it was drawn
    logprobs: list[float]  # the behaviour policy's log-probability of each response token
    truncated: bool  # the budget ran out before end-of-text
    version: int = 0  # the policy version (optimizer steps) that generated it
    # the mean entropy (nats) of the distribution each response token was drawn from (at the
    # rollout's temperature): a policy collapsing onto one answer shows here first (rl/entropy)
    entropy: float = 0.0
    # int16 [MoE layers, input positions, k]: the experts chosen at each of its input positions
    # (prompt + response less the last token), for routing replay (rl/replay.py); None without
    experts: np.ndarray | None = None
    temperature: float = 1.0  # the one it was sampled at (<= 0: greedy)
    # bool [Mixture-of-Depths layers, input positions]: whether each block processed each position, for
    # routing replay as `experts`; None without (a checkpoint's batch queued before they were recorded)
    depth: np.ndarray | None = None

    def state_dict(self) -> dict:
        """As JSON holds it (a checkpoint's queued rollouts, rl/engine.py)."""
        state = dict(vars(self))
        state["experts"] = None if self.experts is None else self.experts.tolist()
        state["depth"] = None if self.depth is None else self.depth.astype(np.uint8).tolist()
        return state

    @classmethod
    def from_state(cls, state: dict) -> Rollout:
        experts, depth = state["experts"], state.get("depth")
        return cls(
            **{
                **state,
                "experts": None if experts is None else np.asarray(experts, dtype=np.int16),
                "depth": None if depth is None else np.asarray(depth, dtype=bool),
            }
        )


def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    version: int = 0,
    record_routing: bool = False,
    interrupt: Callable[[], None] | None = None,
) -> list[Rollout]:
    """One response per prompt (repeat a prompt for a group of samples). temperature <= 0 is
    greedy (its log-probabilities: at temperature 1). `record_routing`: each rollout keeps its
    MoE layers' choices and Mixture-of-Depths layers' decisions (Rollout.experts, .depth; rl/replay.py).
    `interrupt`, called before each forward, raises to leave the generation off (a held-out evaluation's
    stop signal, training/policy.py)."""
    longest, limit = max(len(p) for p in prompts), model.cfg.max_seq_len
    if min(len(p) for p in prompts) == 0 or longest >= limit:
        raise ValueError(f"every prompt needs 1 to {limit - 1} tokens (model.max_seq_len={limit}); got {longest}")
    budget = min(max_new_tokens, limit - longest)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), recording(model, len(prompts), record_routing) as routes:
            tokens, logprobs, entropies = _decode(
                model, prompts, budget, eos_id, temperature, top_p, generator, interrupt or _go_on
            )
            rows = zip(prompts, tokens.tolist(), logprobs.tolist(), entropies.tolist())
            rollouts = [_rollout(p, t, lp, h, eos_id, version, temperature) for p, t, lp, h in rows]
            for row, r in enumerate(rollouts if routes else []):
                at = (row, longest - len(r.prompt), len(r.prompt) + len(r.tokens) - 1)
                r.experts, r.depth = routes.sequence(*at), routes.decisions(*at)
    finally:
        model.train(was_training)
    return rollouts


def _decode(
    model: Transformer,
    prompts: list[list[int]],
    budget: int,
    eos_id: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    interrupt: Callable[[], None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new tokens [B, n], their behaviour log-probabilities [B, n] and the entropies of the
    distributions they were drawn from [B, n], n <= budget (a row done early holds end-of-text
    after its end)."""
    device = model.lm_head.weight.device
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    batch = torch.tensor([[eos_id] * pad + p for pad, p in zip(pads, prompts)], device=device)  # [B, P]
    cache = model.new_cache(batch=len(prompts), max_len=longest + budget)
    cache.pad(pads)
    interrupt()
    logits = model.next_logits(batch, cache)  # [B, V]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    tokens, logprobs, entropies = [], [], []
    for _ in range(budget):
        token = sample_next(logits, temperature, 0, top_p, generator)  # [B]
        scaled = logits.float() / temperature if temperature > 0 else logits.float()
        logp = torch.log_softmax(scaled, dim=-1)  # [B, V]
        logprobs.append(logp.gather(1, token[:, None]).squeeze(1))
        entropies.append(-(logp.exp() * logp).sum(-1))
        tokens.append(torch.where(done, eos_id, token))
        done |= token == eos_id
        if bool(done.all()):  # one host read a token: the batch ends with its longest response
            break
        interrupt()
        logits = model.next_logits(tokens[-1][:, None], cache)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(entropies, 1)


def _go_on() -> None:
    """No interruption: the generation runs to its end."""


def _rollout(
    prompt: list[int],
    tokens: list[int],
    logprobs: list[float],
    entropies: list[float],
    eos_id: int,
    version: int,
    temperature: float,
) -> Rollout:
    end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    entropy = sum(entropies[:end]) / end
    return Rollout(prompt, tokens[:end], logprobs[:end], eos_id not in tokens, version, entropy, None, temperature)
