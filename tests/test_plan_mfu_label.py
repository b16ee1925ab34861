"""The plan's MFU line names the model it plans by its own size and family, not the small preset
the MFU was measured on: it once said "a small moe model" of moe-2.4t and "small dense" of mod-1b."""

import pytest

from trimtab.config import load_config
from trimtab.plan import Hardware
from trimtab.plan.memory import CPU_MFU, MEASURED_MFU, assumed_mfu

CPU = Hardware(name="CPU", kind="cpu", precision="fp32", peak_flops=1e11, peak_source="test", memory_bytes=10**9)
GPU = Hardware(name="H100", kind="cuda", precision="bf16", peak_flops=1e15, peak_source="test", memory_bytes=8 * 10**10)


@pytest.mark.parametrize(
    ("preset", "hw", "mfu", "said"),
    [
        ("moe-2.4t", CPU, CPU_MFU["moe"], "debug-moe preset, taken for this 2.40T-parameter moe model"),
        ("mod-1b", CPU, CPU_MFU["dense"], "debug preset, taken for this 1.11B-parameter mod model"),
        ("mod-1b", GPU, MEASURED_MFU["dense", False], "eager dense, on an H100 (dense-1b), taken for this 1.11B"),
    ],
)
def test_the_mfu_source_names_the_planned_models_size_and_family(preset, hw, mfu, said):
    """Counted on the meta device: no memory for the 2.4T model's weights."""
    value, source = assumed_mfu(load_config(preset=preset), hw)
    assert value == mfu and said in source and "small" not in source, source
