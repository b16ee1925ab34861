"""`trimtab bench`: list the benchmarks, or run one.

The benchmarks are scripts in the source checkout's bench/ folder, not library code: they compare
against references the library does not depend on and write BENCHMARKS.md. This finds that folder
from the package's own location (src/trimtab/../../bench), so an install without the checkout
says where they live instead.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from trimtab.errors import TrimtabError

SRC = Path(__file__).resolve().parent.parent  # src/ in a source checkout, site-packages/ otherwise


def bench_dir() -> Path:
    folder = SRC.parent / "bench"
    if SRC.name != "src" or not folder.is_dir():
        raise TrimtabError(
            f"benchmarks live in the bench/ folder of trimtab's source checkout; this trimtab ({SRC / 'trimtab'}) "
            "is installed without one: clone the repository, `pip install -e` it and run `trimtab bench` there"
        )
    return folder


def available() -> dict[str, str]:
    """Benchmark name -> the first line of its script's docstring (bench/_*.py are shared helpers)."""
    scripts = sorted(p for p in bench_dir().glob("*.py") if not p.name.startswith("_"))
    return {p.stem: _first_line(p) for p in scripts}


def _first_line(script: Path) -> str:
    doc = ast.get_docstring(ast.parse(script.read_text()))  # read, not imported: no torch, no side effects
    return doc.splitlines()[0] if doc else ""


def listing() -> str:
    names = available()
    width = max(map(len, names), default=0)
    rows = [f"  {name:{width}}  {line}" for name, line in names.items()]
    return "\n".join(["benchmarks (`trimtab bench NAME --help` shows one's options):", *rows])


def run(name: str, args: list[str]) -> int:
    """bench/NAME.py with args under this Python; its exit code."""
    names = available()
    if name not in names:
        raise TrimtabError(f"unknown benchmark '{name}'; one of {', '.join(names)}")
    # the script, and the `trimtab train` runs it starts, import this trimtab, not another install
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, str(bench_dir() / f"{name}.py"), *args], env={**os.environ, "PYTHONPATH": path}
        )
    except KeyboardInterrupt:  # Ctrl-C reached the script too, and it has said where it stopped
        return 130
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # a signal: as a shell says it
