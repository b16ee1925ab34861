"""trimtab/metrics.py: the one reader of metrics.jsonl (the loop's side: test_orchestrator_loop.py)."""

import json
import subprocess
import sys

from trimtab.metrics import read_metrics


def test_read_metrics_gives_the_kept_trajectory_or_every_line(tmp_path):
    assert read_metrics(tmp_path) == []
    lines = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": float("nan"), "abandoned": True},
        {"step": 2, "val_loss": 9.0, "abandoned": True},
        {"step": 2, "loss": 2.5},
    ]
    text = "".join(json.dumps(m) + "\n" for m in lines)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 3, "lo')  # a line still being written
    assert read_metrics(tmp_path) == [lines[0], lines[3]]
    every = read_metrics(tmp_path, abandoned=True)
    assert [m["step"] for m in every] == [1, 2, 2, 2] and every[2] == lines[2]


def test_read_metrics_needs_no_torch():
    """Report tools read run directories without the training stack."""
    code = "import sys, trimtab.metrics; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
