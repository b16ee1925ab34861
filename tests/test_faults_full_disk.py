"""faults.json on a full disk: the injector's bookkeeping never ends the run. A write that fails
(ENOSPC) is said once; the record stays whole in memory and the next firing writes all of it, so
a resume still knows every fault that fired."""

import errno
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from trimtab.orchestrator import faults
from trimtab.orchestrator.faults import FaultInjector

SPECS = ["nan_loss@2", "nan_loss@3", "nan_loss@5"]


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs of its own (root only: skipped where mounting is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"mount not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Fill `disk` until it takes no more bytes; the filler file, to delete for space again."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as fh, pytest.raises(OSError) as full:
        while True:
            fh.write(b"\0" * 512)
    assert full.value.errno == errno.ENOSPC
    return filler


def fire(injector: FaultInjector, step: int) -> None:
    """The injector at the start of `step` (the loop's on_step_start)."""
    injector.on_step_start(SimpleNamespace(step=step - 1), SimpleNamespace(rows=[]))


def check_full_then_freed(injector: FaultInjector, said: list[str], free) -> None:
    """Two firings on a full disk go on (said once); space freed, the next firing records all three."""
    fire(injector, 2)
    fire(injector, 3)
    assert injector._fire_nan.spec == "nan_loss@3" and injector.record["fired"] == {"nan_loss@2": 1, "nan_loss@3": 1}
    assert len(said) == 1 and str(injector.path) in said[0] and "free space" in said[0], said
    assert not injector.path.exists()
    free()
    fire(injector, 4)
    fire(injector, 5)
    fired = {"nan_loss@2": 1, "nan_loss@3": 1, "nan_loss@5": 1}
    assert json.loads(injector.path.read_text())["fired"] == fired and len(said) == 1
    resumed = FaultInjector(SPECS, injector.path.parent)  # a restart reads the record: nothing fires again
    resumed.record = json.loads(injector.path.read_text())
    assert not any(resumed._due(f) for f in resumed.faults for resumed.step in (2, 3, 5))
    assert [p.name for p in injector.path.parent.iterdir() if p.name.endswith(".tmp")] == []  # no temp file left


def test_faults_fired_on_a_full_filesystem_are_recorded_once_it_has_room(small_disk):
    filler = fill(small_disk)
    injector = FaultInjector(SPECS, small_disk)
    said: list[str] = []
    injector.run = SimpleNamespace(say=said.append)
    check_full_then_freed(injector, said, filler.unlink)
    assert "No space left on device" in said[0]


def test_a_write_refused_with_enospc_does_not_end_the_run(tmp_path, monkeypatch):
    """The same without a mount (any user): the rename that would install faults.json fails."""
    real = os.replace
    full = {"on": True}

    def replace(src, dst):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(faults.os, "replace", replace)  # rundir.write_atomic's os is the same module
    injector = FaultInjector(SPECS, tmp_path)
    said: list[str] = []
    injector.run = SimpleNamespace(say=said.append)
    check_full_then_freed(injector, said, lambda: full.update(on=False))
