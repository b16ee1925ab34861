"""The parallel layout of presets whose batch has fewer rows than the GPUs have replicas
(plan/layout.py): pipeline stages divide the replicas too, so tensor parallelism is not ruled out
while some pp size leaves every replica a row, and too many GPUs are said as such, not as memory."""

from trimtab.cli import main
from trimtab.config import load_config
from trimtab.plan.layout import plan_layout
from trimtab.plan.layout_text import format_layout
from trimtab.plan.memory import named_gpu


def test_tp_1_with_pipeline_stages_is_tried_when_the_batch_has_a_row_for_each_stage_replica():
    """small on 64 GPUs: 32 rows a step, 64 replicas at tp=1 alone but 16 under pp=4: a layout
    (ruled out before, its reason saying 64 replicas as if pp did not exist)."""
    plan = plan_layout(load_config(preset="small"), named_gpu("H100", 64))
    assert not any(r.startswith("tp=1:") for r in plan.reasons)
    assert any(c.tp == 1 and c.pp == 4 and c.dp == 16 and c.fits for c in plan.candidates)


def test_a_preset_on_more_gpus_than_its_batch_has_rows_gets_a_layout_with_pipeline_and_tensor_parallel():
    """small on 512 GPUs: pp 4 x tp 4 leaves 32 replicas of one row each (said 'no number of
    H100s would hold it' before)."""
    plan = plan_layout(load_config(preset="small"), named_gpu("H100", 512))
    assert plan.best is not None and plan.best.pp * plan.best.tp * plan.best.dp == 512
    assert plan.best.dp <= 32


def test_too_many_gpus_for_the_batch_says_so_not_that_no_number_would_hold_it():
    plan = plan_layout(load_config(preset="small"), named_gpu("H100", 4096))
    text = "\n".join(format_layout(plan, "trimtab train --preset small"))
    assert plan.best is None and "no number of" not in text
    assert "4096 GPUs are more than train.batch_tokens has rows for" in text
    assert "use fewer GPUs or raise train.batch_tokens" in text


def test_the_slurm_script_signals_the_ranks_before_the_time_limit_not_only_its_shell(tmp_path):
    """sbatch --signal=B:... signals the batch shell alone (none of srun's tasks), so no rank saved
    before the time limit's SIGKILL; without B: every job step's tasks get it."""
    args = ["plan", "--preset", "small", "--gpu", "H100", "--gpus", "8", "--out", str(tmp_path), "--emit", "slurm"]
    assert main(args) == 0
    directives = [line for line in (tmp_path / "launch.sbatch").read_text().splitlines() if "--signal" in line]
    assert directives == ["#SBATCH --signal=TERM@120"]
