"""The README's Hugging Face / evaluation / merging walk-through, run as written (in a scratch
directory): if a command there breaks, this fails."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
pytest.importorskip("lm_eval", reason="the walk-through runs lm-eval tasks (the [eval] extra, in [dev])")


def walkthrough() -> list[str]:
    """The indented command block under the '## Hugging Face in and out' heading."""
    text = README.read_text()
    section = text[text.index("## Hugging Face in and out") :]
    lines = section.split("\n\n", 2)[1].splitlines()
    return [line.strip() for line in lines if line.startswith("    ")]


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    commands = walkthrough()
    assert any(c.startswith("trimtab export") for c in commands) and any(
        c.startswith("trimtab merge") for c in commands
    )
    (tmp_path / "README.md").write_text(README.read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.setdefault("OMP_NUM_THREADS", "1")
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "hf" / "base" / "config.json").is_file()
    assert (tmp_path / "runs" / "merged" / "checkpoints" / "step_000000").is_dir()
    assert list((tmp_path / "runs" / "ft1" / "eval").glob("*.json"))
