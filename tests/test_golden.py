"""Golden numbers: a fixed-seed `debug` run's first 20 losses and its step-20 checkpoint's tensor
checksums, checked in under tests/golden/. A refactor must not move them; a change that does must
say why in its commit and regenerate them:

    TRIMTAB_UPDATE_GOLDEN=1 pytest tests/test_golden.py

One torch thread (a fixed reduction order); the tolerances absorb BLAS differences between CPUs,
not behaviour changes (a changed init, data order or loss moves them by far more).
"""

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

import trimtab
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config
from trimtab.training.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")
GOLDEN = Path(__file__).with_name("golden") / "debug_seed1234.json"
# A frozen copy of text (trimtab's own sources at the commit that added it), not the builtin corpus,
# which is this Python's standard library and differs between Python versions.
CORPUS = GOLDEN.with_name("corpus.jsonl")
STEPS = 20


class Losses(Hook):
    def __init__(self):
        self.losses = []

    def on_step_end(self, run, out):
        self.losses.append(out.loss.item())


def checksums(path: Path) -> dict[str, list[float]]:
    """Per tensor: sum and sum of absolute values, in float64."""
    weights = load_file(str(path / "model.safetensors"))
    return {k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in sorted(weights.items())}


def test_debug_run_matches_its_golden_numbers(tmp_path):
    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(tmp_path / "g"),
            "train": {
                "max_steps": STEPS,
                "eval_every": 0,
                "log_every": 5,
                "precision": "fp32",
            },  # fp32: bf16 autocast on CPU rounds differently on CPUs with and without AVX512-bf16
            "data": {"source": str(CORPUS), "max_bytes": 0},
            "checkpoint": {"every": STEPS},
            "log": {"progress": False, "tensorboard": False},
        },
    )
    hook = Losses()
    trimtab.train(cfg, hooks=[hook])
    found = {"losses": hook.losses, "checksums": checksums(list_checkpoints(cfg.run_dir)[-1])}
    if os.environ.get("TRIMTAB_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(found, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert found["losses"] == pytest.approx(golden["losses"], rel=5e-5, abs=1e-6)  # 1.4e-5 at step 20 on an AMD EPYC
    assert found["checksums"].keys() == golden["checksums"].keys()
    for key, (total, absolute) in golden["checksums"].items():
        assert found["checksums"][key][1] == pytest.approx(absolute, rel=1e-3), key  # 1.9e-4 on an AMD EPYC
        assert found["checksums"][key][0] == pytest.approx(total, rel=1e-3, abs=1e-3 * absolute), key
