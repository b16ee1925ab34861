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


def test_peak_rss_is_the_processs_own_not_a_large_parents():
    """Linux carries a parent's resident set into a child's ru_maxrss across fork and exec; the
    metrics' peak_rss_mb (and the benchmarks' children) read the child's own high-water mark."""
    from pathlib import Path

    from trimtab.training.runtime import peak_rss_mb

    held = bytearray(1500 * 2**20)  # 1.5 GB resident in this process
    for i in range(0, len(held), 4096):
        held[i] = 1
    assert peak_rss_mb() > 1500
    src = str(Path(__file__).resolve().parent.parent / "src")
    code = f"import sys; sys.path.insert(0, {src!r}); import trimtab.training.runtime as r; print(r.peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del held
    assert 0 < child < 1000, child  # the imports (torch), not this process's 1.5 GB
