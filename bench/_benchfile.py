"""BENCHMARKS.md: each benchmark owns one '## ' section and rewrites only that one, through
`publish`, which opens every section with the same header line (`header`): the date, the machine
(CPU model, cores, GPU), torch's version, the precision measured in and other processes' share of
the CPUs meanwhile (`_measure.Contention`), so a figure says where and how it was taken."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
DRY_RUN = "dry run: BENCHMARKS.md not written"
HEADER = re.compile(  # what `header` writes, for tests and readers
    r"Measured \d{4}-\d\d-\d\d on .+; torch \S+; precision .+; other processes' CPU share .+\."
)


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


def machine() -> str:
    """This machine in words: CPU model, cores, and the GPU where one is visible."""
    import torch

    from trimtab.hardware import cpu_model

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu_model()}, {os.cpu_count()} cores{gpu}"


def contention(other_cpu: float | Sequence[float] | None) -> str:
    """Other processes' CPU share, one figure (the whole measurement) or one per run."""
    if other_cpu is None:
        return "not measured"
    if isinstance(other_cpu, int | float):
        return f"{other_cpu:.0%}"
    values = list(other_cpu)
    if not values:
        return "not measured"
    if len(values) == 1:
        return f"{values[0]:.0%}"
    return f"median {statistics.median(values):.0%} (max {max(values):.0%}) over {len(values)} runs"


def precisions(by_variant: dict[str, str]) -> str:
    """The header's precision for variants that may differ: one name if they agree."""
    names = set(by_variant.values())
    return names.pop() if len(names) == 1 else ", ".join(f"{v} {p}" for v, p in by_variant.items())


def header(
    precision: str,
    other_cpu: float | Sequence[float] | None,
    *,
    date: str | None = None,
    on: str | None = None,
    torch_version: str | None = None,
) -> str:
    """A section's first line. date, on (the machine) and torch_version default to now and here;
    a report of saved runs passes theirs."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    return (
        f"Measured {date or time.strftime('%Y-%m-%d')} on {on or machine()}; torch {torch_version}; "
        f"precision {precision}; other processes' CPU share {contention(other_cpu)}."
    )


def publish(
    heading: str,
    body: str,
    *,
    precision: str,
    other_cpu: float | Sequence[float] | None,
    dry_run: bool = False,
    markdown: Path | str | None = None,
    **header_fields: str | None,
) -> str:
    """The section `heading`, the header line, `body`: printed, and written into BENCHMARKS.md
    (or `markdown`; '-' for none) unless this is a dry run. Returns the section."""
    section = f"{heading}\n\n{header(precision, other_cpu, **header_fields)}\n\n{body.strip()}\n"
    print(section)
    if dry_run:
        print(DRY_RUN)
    elif markdown == "-":
        print("BENCHMARKS.md not written")
    else:
        replace_section(Path(markdown or BENCHMARKS), heading, section)
    return section
