"""Summed next-token cross entropy fused with the lm head: the [N, V] logits never kept.

Shapes: N tokens, D d_model, V vocab, C chunk.

A plain loss keeps the log-softmax of every token's logits for its backward, N x V x 4 bytes
(512 KB a token at Llama 3's 128K vocabulary, more than a 1B model's activations per token):
chunking the forward alone does not free it, autograd saves every chunk's. Here the loss runs
chunk by chunk in the forward and each chunk's gradient is taken there and then (d loss /
d logits = softmax - onehot), folded into the gradients of the hidden states [N, D] and of the
head [V, D] and the chunk freed; the backward only scales them by the incoming gradient. Peak
memory holds one [C, V] block, not N x V: the fused linear cross entropy of Liger-Kernel (Hsu
et al. 2024, arXiv 2410.10989) and Cut Cross-Entropy (Wijmans et al. 2024, arXiv 2411.09009).
The FLOPs are the plain loss's: the two backward matmuls move into the forward. Small chunks
also keep each logits block reusable from the heap: glibc maps every allocation above 32 MB
fresh from the kernel, and those page faults cost ~10% of a CPU step.

Without gradients (evaluation) it is the plain chunked loss. Under tensor parallelism `hidden`
is a replicated DTensor and the head's rows are sharded over the vocabulary
(distributed/tensor.py): that path keeps autograd's loss, each rank computing its [C, V/tp]
blocks while the cross entropy all-reduces the maxima, the sums of exponentials and the target
logits instead of gathering the logits (torch's loss_parallel; Megatron-LM's vocab-parallel
cross entropy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trimtab.model.layers import compute_dtype

IGNORE_INDEX = -100
CHUNK_TOKENS = 1024  # on a CPU, and the least anywhere
# On CUDA a chunk's fp32 logits may take this much: the fused loss at one 16,384-token
# micro-batch (d_model 2048, vocab 50,304, bf16 on an H200) ran at 0.60x the plain loss's speed
# in 1,024-token chunks, 0.74x in 4,096 and 0.76x in 8,192, its peak memory 1.3, 3.1 and 5.4 GB
# against the plain loss's 9.7 (BENCHMARKS.md, "Fused cross-entropy"): the kernels are larger
# and fewer, and the head's gradient is summed over fewer chunks.
CUDA_CHUNK_BYTES = 2**30


def chunk_tokens(head: torch.Tensor) -> int:
    """Tokens per chunk for a head [V, D]: CHUNK_TOKENS on a CPU; on CUDA as many as fit
    CUDA_CHUNK_BYTES of fp32 logits, in multiples of CHUNK_TOKENS."""
    if head.device.type != "cuda":
        return CHUNK_TOKENS
    return max(1, CUDA_CHUNK_BYTES // (4 * head.shape[0] * CHUNK_TOKENS)) * CHUNK_TOKENS


def cross_entropy_sum(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    chunk: int | None = None,
    token_losses: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [B, T, D], head weight [V, D], targets [B, T] (-100 ignored) -> summed loss (0-d,
    fp32); `chunk` tokens at a time (default: chunk_tokens(head)). `token_losses` (fp32 [B * T],
    optional) receives each token's loss (0 where ignored), without gradient: the per-row losses
    the orchestrator watches, read from the pass that trains (not under tensor parallelism)."""
    chunk = chunk or chunk_tokens(head)
    h, t = hidden.flatten(0, 1), targets.flatten()
    if h.shape[0] == 0:
        return hidden.new_zeros((), dtype=torch.float32)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or head.requires_grad)
    if wants_grad and not hasattr(head, "to_local"):  # a DTensor (tensor parallel) keeps autograd's loss
        return LinearCrossEntropy.apply(h, head, t, chunk, token_losses)
    if token_losses is not None and not wants_grad:  # scoring: the same loss, kept per token
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], head).float()
            token_losses[s : s + chunk] = F.cross_entropy(
                logits, t[s : s + chunk], ignore_index=IGNORE_INDEX, reduction="none"
            )
        return token_losses.sum()
    parts = [_chunk_loss(F.linear(h[s : s + chunk], head), t[s : s + chunk]) for s in range(0, h.shape[0], chunk)]
    total = parts[0]
    for part in parts[1:]:  # not sum(): 0 + a DTensor is not one
        total = total + part
    to_local = getattr(total, "to_local", None)  # a DTensor under tensor parallelism
    return to_local() if to_local else total  # (the same value on every rank)


def with_aux(loss: torch.Tensor, aux: torch.Tensor | None, share: float = 1.0) -> torch.Tensor:
    """A micro-batch's training objective: its token-normalised loss (summed over its targets,
    divided by the step's target count) plus the layers' auxiliary losses (MoE balance and z,
    Mixture-of-Depths predictor: per-token means over this micro-batch) weighted by `share`, the
    micro-batch's part of the step's targets, so they add up over the step as the tokens do. The
    trainer's (Trainer._forward_backward) and model_loss's, one formula: model_loss once added
    the aux to the summed loss, weighing it 1 / tokens of what training does."""
    return loss if aux is None else loss + share * aux


def model_loss(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A whole row batch's training objective outside the trainer (the CPU precision probe,
    benches), as the trainer computes it for the batch in one micro-batch (with_aux): the mean
    next-token loss of tokens [B, T] plus the layers' auxiliary losses, under autocast to `dtype`
    (None: in the weights' precision)."""
    with torch.autocast(tokens.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        targets = tokens[:, 1:]
        summed = cross_entropy_sum(model.hidden(tokens[:, :-1]), model.lm_head.weight, targets)
        aux = model.aux_loss()
    return with_aux(summed / (targets != IGNORE_INDEX).sum().clamp(min=1), aux)


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(h @ head.T, t), gradients taken in the forward."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, head: torch.Tensor, t: torch.Tensor, chunk: int, token_losses: torch.Tensor | None
    ) -> torch.Tensor:
        # h [N, D], head [V, D], t [N]; under autocast the matmuls run in its dtype, as F.linear's would
        want_h, want_head = ctx.needs_input_grad[:2]
        mm_dtype = compute_dtype(h)  # the two gradient matmuls': cast [C, V] once, not per matmul
        grad_h = torch.empty_like(h) if want_h else None
        grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if want_head else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, tc = h[s : s + chunk], t[s : s + chunk]
            logits = F.linear(hc, head).float()  # [C, V]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C, 1]
            valid, index = tc != IGNORE_INDEX, tc.clamp(min=0).unsqueeze(1)  # index [C, 1]: ignored rows read class 0
            picked = logits.gather(1, index)  # [C, 1]
            losses = (lse - picked).squeeze(1) * valid  # [C]
            total += losses.sum()
            if token_losses is not None:
                token_losses[s : s + chunk] = losses
            # d (chunk's summed loss) / d logits = softmax - onehot. An ignored row's gradient is
            # zeroed on the [C, D] side, in its hidden state's gradient and its input to the head's:
            # one pass over the [C, V] block fewer than masking the block
            grad = logits.sub_(lse).exp_()
            grad.scatter_add_(1, index, -torch.ones_like(picked))
            grad = grad.to(mm_dtype)
            mask = valid.unsqueeze(1).to(hc.dtype)  # [C, 1]
            if grad_h is not None:
                grad_h[s : s + chunk] = (grad @ head) * mask  # [C, D]
            if grad_head is not None:
                if grad.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type):
                    grad_head.addmm_(grad.T, hc * mask)  # in place: no [V, D] temporary per chunk
                else:
                    grad_head += grad.T @ (hc * mask)  # a lower-precision product, summed in fp32
        ctx.save_for_backward(grad_h, grad_head)
        ctx.head_dtype = head.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_head = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_head * grad_out).to(ctx.head_dtype) if grad_head is not None else None
        return gh, gw, None, None, None
