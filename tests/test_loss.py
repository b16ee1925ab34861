import torch
import torch.nn.functional as F

from trimtab.training.loss import cross_entropy_sum


def test_chunked_loss_and_grads_equal_the_plain_loss():
    torch.manual_seed(0)
    hidden = torch.randn(3, 50, 16, requires_grad=True)
    head = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 37, (3, 50))
    targets[0, :7] = -100  # masked prompt side
    plain = F.cross_entropy((hidden @ head.T).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    grads = torch.autograd.grad(plain, (hidden, head))
    chunked = cross_entropy_sum(hidden, head, targets, chunk=16)  # 150 tokens: 10 chunks, last partial
    assert torch.allclose(chunked, plain, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(chunked, (hidden, head)), grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
