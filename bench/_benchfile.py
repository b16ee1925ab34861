"""BENCHMARKS.md: each benchmark owns one '## ' section and rewrites only that one."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, heading: str, section: str) -> None:
    """Rewrite the section starting with `heading`, keeping the others (the file is read just
    before the write, since other scripts write other sections)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    path.write_text(text)
