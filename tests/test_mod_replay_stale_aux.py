"""A replayed (RL routing replay) training forward of a Mixture-of-Depths block that processes
no token sets its aux_loss and stats too: before, it returned early and left the previous
forward's aux_loss, whose graph that step's backward had freed, for the trainer to add."""

import torch

from trimtab.model.mod import DepthRouter


def block(x, rope, mask, cache, layer):
    return x * 2.0


def test_a_replayed_forward_that_processes_nothing_leaves_no_stale_aux_loss():
    torch.manual_seed(0)
    router = DepthRouter(16, capacity=0.5, warmup_steps=0, predictor_loss_coef=0.01).train()
    x = torch.randn(2, 8, 16)
    rope = (torch.ones(8, 1, 4), torch.zeros(8, 1, 4))
    router(x, block, rope, None, 0).sum().backward()  # a top-k step: its aux_loss, then its backward
    assert router.aux_loss is not None
    with torch.no_grad():  # the predictor now skips every token
        router.predictor[-1].weight.zero_()
    router.replay = True
    out = router(x, block, rope, None, 0)
    assert torch.equal(out, x)
    assert router.aux_loss is None  # nothing stale for model.aux_loss() to add
    assert router.stats["capacity"].item() == 0.0 and router.stats["gate"].item() == 0.0
