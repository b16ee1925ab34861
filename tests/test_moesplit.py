"""A split expert does not inherit its source's collapse: its selection bias starts mid-pack and its
router row's AdamW moments from zero (debug-moe, expert 0's bias +0.3 then `ctl add-expert 1 0`:
the copy took 50% of the assignments, the 7 others none). Checkpoints whose Mixture-of-Depths
capacity differs are not averaged."""

import pytest
import torch

from trimtab.checkpoint import save_checkpoint
from trimtab.config import load_config
from trimtab.config.sparse import MoEConfig
from trimtab.errors import CheckpointError
from trimtab.merge import average
from trimtab.model import build_model
from trimtab.model.moe import MoE
from trimtab.training.surgery import expert_surgery

pytestmark = pytest.mark.usefixtures("one_thread")


def collapsed(n_experts: int = 4) -> MoE:
    """A top-2 MoE whose expert 0 every token picks: its selection bias +1 (fault expert_collapse)."""
    torch.manual_seed(0)
    moe = MoE(16, 24, MoEConfig(n_experts=n_experts, top_k=2, balance_coef=0.01), init_std=0.3, out_std=0.3)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([1.0, 0.1, -0.1, 0.3]))
    return moe


def test_a_split_collapsed_expert_does_not_pass_its_selection_bias_on():
    moe = collapsed()
    x = torch.randn(4, 16, 16)
    new = moe.add_expert(source=0)
    assert moe.expert_bias[new] == pytest.approx(0.1)  # the others' mean (0.1 - 0.1 + 0.3) / 3, not 1
    moe(x)
    counts = moe.stats["tokens_per_expert"]
    assert counts[0] == 64  # the source keeps its bias: still every token's
    assert counts[new] < 32, counts  # a copied bias made the copy every token's second choice: 64


def test_a_split_experts_router_row_starts_from_zero_moments_its_weights_from_the_sources():
    moe = collapsed()
    optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    for p in moe.parameters():  # a step's moments, set (a first optimizer step imports torch._dynamo: 4 s)
        moments = {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        optimizer.state[p] = {"step": torch.tensor(1.0), **moments}
    source_router = optimizer.state[moe.router]["exp_avg"].clone()
    source_w1 = optimizer.state[moe.w1]["exp_avg"][0].clone()
    new, said = expert_surgery(moe, optimizer, lambda: torch.optim.AdamW(moe.parameters(), lr=1e-2), "add", 0)
    assert said == "add expert 4 (4 -> 5 experts)"
    router, w1 = new.state[moe.router], new.state[moe.w1]
    assert router["exp_avg"][4].abs().sum() == 0 and router["exp_avg_sq"][4].abs().sum() == 0
    torch.testing.assert_close(router["exp_avg"][:4], source_router)  # the others keep theirs
    torch.testing.assert_close(w1["exp_avg"][4], source_w1)


def test_averaging_across_a_mixture_of_depths_capacity_change_is_refused(tmp_path, tokenizer):
    """`ctl mod-capacity 0.25` between checkpoints 40 and 60 of a debug-mod run: `trimtab merge
    --method average --last 3` averaged 40, 60 and 80 and gave the output 0.25, in silence."""
    from hf_helpers import write_run

    cfg = load_config(preset="debug-mod", sets=[f"model.vocab_size={tokenizer.vocab_size}"])
    model = build_model(cfg.model)
    run = write_run(tmp_path / "run", model, tokenizer)
    for step, capacity in ((2, 0.5), (4, 0.5), (6, 0.25)):
        state = {"moe": {}, "mod": {"1": capacity, "3": capacity}, "tokens": step, "good": True}
        save_checkpoint(run, step, model.state_dict(), {}, state, keep=9)
        if step == 4:
            average(run, 2, tmp_path / "before")  # 2 and 4: one capacity
    with pytest.raises(CheckpointError, match=r"step_000006: its Mixture-of-Depths layers' target capacity .*0\.25"):
        average(run, 2, tmp_path / "across")
    assert not (tmp_path / "across").exists()
