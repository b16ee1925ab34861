"""BENCHMARKS.md: each benchmark owns one '## ' section and rewrites only that one."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def replace_section(path: Path, heading: str, section: str) -> None:
    """Rewrite the section starting with `heading`, keeping the others (the file is read just
    before the write, since other scripts write other sections)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    section = section.rstrip("\n") + "\n"
    start = text.find(heading + "\n")  # the whole heading line: one heading may begin another
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.write_text(text)


@contextmanager
def scratch(work: str | None, prefix: str) -> Iterator[Path]:
    """A benchmark's working directory: `work` if given (kept, for a look afterwards), else a
    temporary one removed at the end, whatever happens."""
    path = Path(work or tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not work:
            shutil.rmtree(path, ignore_errors=True)


def publish(heading: str, section: str, dry_run: bool = False) -> None:
    """Print a benchmark's section and write it into BENCHMARKS.md, unless this is a dry run."""
    print(section)
    if dry_run:
        print("dry run: BENCHMARKS.md not written")
    else:
        replace_section(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", heading, section)
