from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trimtab.training.loss import CHUNK_TOKENS, CUDA_CHUNK_BYTES, chunk_tokens, cross_entropy_sum


def plain_and_grads(hidden, head, targets):
    plain = F.cross_entropy((hidden @ head.T).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return plain, torch.autograd.grad(plain, (hidden, head))


def case(dtype=torch.float32):
    torch.manual_seed(0)
    hidden = torch.randn(3, 50, 16, dtype=dtype, requires_grad=True)
    head = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 37, (3, 50))
    targets[0, :7] = -100  # masked prompt side
    return hidden, head, targets


def test_fused_loss_and_grads_equal_the_plain_loss():
    hidden, head, targets = case()
    plain, grads = plain_and_grads(hidden, head, targets)
    fused = cross_entropy_sum(hidden, head, targets, chunk=16)  # 150 tokens: 10 chunks, last partial
    assert fused.grad_fn is not None and "LinearCrossEntropy" in type(fused.grad_fn).__name__
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    for a, b in zip(torch.autograd.grad(fused * 3.0, (hidden, head)), grads):  # the incoming gradient scales
        torch.testing.assert_close(a, 3.0 * b, rtol=1e-5, atol=1e-5)


def test_without_gradients_it_is_the_plain_chunked_loss():
    hidden, head, targets = case()
    plain, _ = plain_and_grads(hidden, head, targets)
    with torch.no_grad():
        got = cross_entropy_sum(hidden, head, targets, chunk=16)
    assert got.grad_fn is None
    torch.testing.assert_close(got, plain.detach(), rtol=1e-6, atol=1e-5)


def test_only_the_needed_gradient_is_built_and_a_frozen_head_gets_none():
    hidden, head, targets = case()
    head.requires_grad_(False)
    _, (g_hidden, _) = plain_and_grads(hidden, head.requires_grad_(True), targets)
    head.requires_grad_(False)
    fused = cross_entropy_sum(hidden, head, targets, chunk=16)
    (got,) = torch.autograd.grad(fused, (hidden,))
    torch.testing.assert_close(got, g_hidden, rtol=1e-5, atol=1e-5)


def test_every_target_ignored_gives_zero_loss_and_zero_gradients():
    hidden, head, targets = case()
    fused = cross_entropy_sum(hidden, head, torch.full_like(targets, -100), chunk=16)
    g_hidden, g_head = torch.autograd.grad(fused, (hidden, head))
    assert fused.item() == 0.0 and not g_hidden.any() and not g_head.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_under_autocast_the_gradients_match_autograds_to_its_precision(dtype):
    hidden, head, targets = case()
    with torch.autocast("cpu", dtype=dtype):
        plain = F.cross_entropy(
            F.linear(hidden, head).float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        fused = cross_entropy_sum(hidden, head, targets, chunk=16)
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=1e-1)
    for a, b in zip(torch.autograd.grad(fused, (hidden, head)), torch.autograd.grad(plain, (hidden, head))):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_the_logits_are_not_kept_for_the_backward():
    """What autograd saves: the fused loss keeps [N, D] + [V, D] gradients, never [N, V]."""
    N, D, V = 512, 8, 4096  # a wide vocabulary, a narrow model: logits dominate
    hidden = torch.randn(1, N, D, requires_grad=True)
    head = torch.randn(V, D, requires_grad=True)
    targets = torch.randint(0, V, (1, N))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        cross_entropy_sum(hidden, head, targets, chunk=128)
    assert sum(saved) == N * D + V * D, saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        plain_and_grads(hidden, head, targets)
    assert sum(saved) >= N * V  # autograd's loss keeps at least the log-softmax


def test_chunks_are_1024_tokens_on_a_cpu_and_fill_a_gib_of_logits_on_cuda():
    def head(device, vocab):
        return SimpleNamespace(device=torch.device(device), shape=(vocab, 2048))

    assert chunk_tokens(head("cpu", 128_256)) == CHUNK_TOKENS == 1024
    assert CUDA_CHUNK_BYTES == 2**30
    # vocab 32,000 (dense-1b), 50,304 (moe-7b), 128,256 (Llama 3), 10M (never below one CPU chunk)
    assert [chunk_tokens(head("cuda", v)) for v in (32_000, 50_304, 128_256, 10**7)] == [8192, 5120, 2048, 1024]


def test_model_loss_is_the_trainers_objective_on_a_moe_model(tmp_path):
    """model_loss (the CPU precision probe's, the benches') weighs the MoE balance and z losses as
    a training step does (with_aux): against the step's loss + aux and its gradients, the
    router's included. It added them to the summed token loss: the aux at 1 / tokens its weight."""
    import copy

    from trimtab.config import load_config
    from trimtab.training.loss import model_loss
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    overrides = {
        "out": str(tmp_path / "r"),
        "train": {"max_steps": 1, "eval_every": 0, "precision": "fp32", "batch_tokens": 512, "micro_batch_tokens": 512},
        "data": {"max_bytes": 150_000},  # the suite's other debug runs': their tokenizer, cached
        "optim": {"grad_clip": 0},  # the gradients compared as the backward left them
        "log": {"progress": False, "tensorboard": False, "report": False},
    }
    trainer = Trainer(setup(load_config(preset="debug-moe", overrides=overrides)))
    before, grads = copy.deepcopy(trainer.model), {}
    trainer.optimizer.step = lambda *a, **k: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    )
    batch = trainer.loader.next_batch()
    [micro] = batch.micro
    assert torch.equal(micro.inputs[:, 1:], micro.targets[:, :-1]) and (micro.targets != -100).all()  # whole rows
    out = trainer.train_step(batch)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    probe = model_loss(before, torch.cat([micro.inputs, micro.targets[:, -1:]], dim=1), None)
    assert probe.item() == pytest.approx(out.loss.item() + out.aux_loss.item(), rel=1e-5)
    probe.backward()
    for name, p in before.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-7, msg=name)
