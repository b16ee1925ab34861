"""`trimtab plan --gpus N --gpus-per-node G` over several nodes: torchrun starts G processes on
every node, so N must fill whole nodes. 12 GPUs on nodes of 8 had a layout planned for 12 ranks
and a launch file (`torchrun --nnodes 2 --nproc_per_node 8`) that starts 16."""

from __future__ import annotations

import pytest

from trimtab.cli import main
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.plan.layout import plan_layout
from trimtab.plan.memory import named_gpu


def test_gpus_that_fill_nodes_unevenly_are_refused_naming_counts_that_fit():
    cfg = load_config(preset="dense-7b")
    with pytest.raises(
        ConfigError, match="--gpus 12 spans nodes of --gpus-per-node 8 unevenly.*--gpus 8 or 16, or --gpus-per-node 6"
    ):
        plan_layout(cfg, named_gpu("H100", 12))
    for gpus, per_node in ((12, 6), (4, 8), (16, 8)):  # whole nodes, or one node not full
        layout = plan_layout(cfg, named_gpu("H100", gpus), per_node)
        assert layout.best is not None and layout.best.pp * layout.best.tp * layout.best.dp == gpus


def test_no_launch_file_for_uneven_nodes(tmp_path, capsys):
    args = ["plan", "--preset", "dense-7b", "--gpu", "H100", "--gpus", "12", "--out", str(tmp_path), "--emit", "slurm"]
    assert main(args) == 2
    assert "unevenly" in capsys.readouterr().err and not (tmp_path / "launch.sbatch").exists()


def test_the_gpus_a_model_needs_are_whole_nodes():
    """dense-30b does not fit on 3 H100s; doubling gave 6, then 12: a count the planner refuses."""
    layout = plan_layout(load_config(preset="dense-30b"), named_gpu("H100", 3))
    assert layout.best is None and layout.gpus_needed is not None and layout.gpus_needed % 8 == 0
    assert plan_layout(load_config(preset="dense-30b"), named_gpu("H100", layout.gpus_needed)).best is not None


def test_the_steps_line_is_a_true_product_when_whole_steps_round_the_tokens_up():
    """Bounded to 16 epochs of 4,000 tokens, the plan's 64,000 tokens take 32 steps of 2,048: the line
    read '32 x 2,048 = 64,000 tokens' (32 x 2,048 = 65,536)."""
    from trimtab.plan import Hardware, make_plan
    from trimtab.plan.report import format_plan

    hw = Hardware(name="t", kind="cuda", precision="bf16", peak_flops=1e12, peak_source="t", memory_bytes=10**9)
    plan = make_plan(load_config(preset="debug"), dataset_tokens=4000, hardware=hw)
    assert plan.tokens == 64_000 and plan.steps == 32
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("  steps "))
    assert line.endswith(
        "32 x train.batch_tokens 2,048 = 65,536 tokens (the 64,000 planned, rounded up to whole steps)"
    )
