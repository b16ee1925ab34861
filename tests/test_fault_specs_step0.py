"""A fault at step 0: training's steps count from 1, so a training step's fault there is refused
(it would fire at step 1, which the spec does not say); a checkpoint's fault there is the initial
checkpoint's."""

from __future__ import annotations

import pytest

from trimtab.errors import ConfigError
from trimtab.orchestrator.fault_specs import parse_fault, parse_faults


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ("nan_loss@0", "nan_loss@1"),
        ("lr_spike@0:5", "lr_spike@1:5"),
        ("nan_loss@00:2@rank1", "nan_loss@1:2@rank1"),
        ("kill_rank@0:1", "kill_rank@1:1"),
        ("eval_error@0", "eval_error@1"),
    ],
)
def test_a_training_steps_fault_at_step_0_is_refused_with_the_fix(spec, fix):
    with pytest.raises(ConfigError) as raised:
        parse_faults(["nan_loss@3", spec])
    message = str(raised.value)
    assert message.startswith(f"faults[1]: '{spec}'") and "steps count from 1" in message and f"give {fix}" in message


@pytest.mark.parametrize("kind", ["corrupt_checkpoint", "kill_in_save", "disk_full"])
def test_a_checkpoints_fault_at_step_0_is_the_initial_checkpoints(kind):
    assert parse_fault(f"{kind}@0", "--inject").step == 0


def test_step_1_is_the_first_step():
    assert parse_fault("nan_loss@1", "--inject").step == 1
