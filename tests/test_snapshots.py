"""Lean snapshots (checkpoint.snapshot_every, snapshots.py): bf16 weights only beside the
checkpoints, their retention, their size, and `trimtab export --snapshot`."""

import pytest
import torch
from safetensors.torch import load_file

from trimtab import api
from trimtab.cli import main
from trimtab.config import load_config
from trimtab.errors import CheckpointError, ConfigError
from trimtab.hf import export_run

# one worker for the module (--dist loadgroup): its module-scoped run is made once, not on each worker
pytestmark = pytest.mark.xdist_group("test_snapshots")


def dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "r"
    checkpoint = {"every": 5, "snapshot_every": 2, "snapshot_keep": 2, "snapshot_keep_every": 4}
    log = {"progress": False, "tensorboard": False, "report": False}
    api.train(preset="debug", out=str(out), train={"max_steps": 10, "eval_every": 0}, data={"max_bytes": 150000},
              checkpoint=checkpoint, log=log)  # fmt: skip
    return out


def test_snapshots_are_bf16_weights_kept_by_their_retention_at_a_sixth_of_a_checkpoint(run):
    # every 2 steps: 2 .. 10; kept: the newest two (8, 10) and every 4th step's (4, 8)
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["step_000004", "step_000008", "step_000010"]
    lean = load_file(run / "snapshots/step_000010/model.safetensors")
    full = load_file(run / "checkpoints/step_000010/model.safetensors")
    assert lean.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(lean[key], value.to(torch.bfloat16) if value.is_floating_point() else value), key
    # fp32 weights and AdamW's two moments (12 bytes a parameter) against 2
    assert dir_bytes(run / "snapshots/step_000010") < 0.2 * dir_bytes(run / "checkpoints/step_000010")


def test_a_snapshot_exports_and_a_missing_or_corrupt_one_is_refused(run, tmp_path, capsys):
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--snapshot", "8", "--dtype", "bfloat16"]) == 0
    exported = load_file(tmp_path / "hf/model.safetensors")
    lean = load_file(run / "snapshots/step_000008/model.safetensors")
    assert torch.equal(exported["model.embed_tokens.weight"], lean["tok_emb.weight"])
    with pytest.raises(CheckpointError, match="no lean snapshot at step 6 \\(it has: 4, 8, 10\\)"):
        export_run(run, tmp_path / "none", snapshot=6)
    weights = run / "snapshots/step_000004/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # a truncated file: the manifest says so
    with pytest.raises(CheckpointError):
        export_run(run, tmp_path / "bad", snapshot=4)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_snapshot_settings_are_checked():
    with pytest.raises(ConfigError, match="checkpoint.snapshot_keep"):
        load_config(preset="debug", overrides={"checkpoint": {"snapshot_keep": 0}})
