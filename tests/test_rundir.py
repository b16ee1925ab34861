"""trimtab/rundir.py: the one reader and writer of a run's files (the loop's side: test_orchestrator_loop.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from trimtab.errors import ConfigError
from trimtab.rundir import (
    DECISIONS_FILE,
    append_lines,
    healed,
    json_text,
    json_value,
    read_decisions,
    read_json,
    read_jsonl,
    read_metrics,
    read_summary,
    rewrite_jsonl,
    write_json,
    write_jsonl,
    write_summary,
)
from trimtab.runlock import run_lock


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


def test_the_run_directory_module_needs_no_torch():
    """Report tools, tune and benchmarks read run directories without the training stack."""
    code = "import sys, trimtab.rundir; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decisions_kept_or_all_and_the_healed_count(tmp_path):
    assert read_decisions(tmp_path) == [] and healed([]) == 0
    ds = [
        {"id": 1, "step": 3, "outcome": {"result": "recovered"}, "abandoned": True},
        {"id": 2, "step": 5, "outcome": {"result": "recovered"}},
        {"id": 3, "step": 9, "outcome": None},
    ]
    write_jsonl(tmp_path / DECISIONS_FILE, ds)
    assert read_decisions(tmp_path) == ds[1:] and read_decisions(tmp_path, abandoned=True) == ds
    assert healed(read_decisions(tmp_path, abandoned=True)) == 1  # abandoned ones never count


def test_whole_files_and_appends_that_a_full_disk_cuts_back(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    write_json(path, {"a": 1})
    assert read_json(path) == {"a": 1} and read_json(tmp_path / "none.json") is None
    write_summary(tmp_path, {"status": "completed"})
    assert read_summary(tmp_path) == {"status": "completed"} and read_summary(tmp_path / "x") is None
    log = tmp_path / "log.jsonl"
    append_lines(log, '{"step": 1}\n')

    class Full:  # a file whose write fails half way, as on a full disk
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def tell(self):
            return self.fh.tell()

        def write(self, text):
            self.fh.write(text[:3])
            self.fh.flush()
            raise OSError(28, "No space left on device")

    real_open = open

    def full_open(p, mode="r", *args, **kwargs):
        return Full(real_open(p, mode)) if mode == "a" else real_open(p, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(OSError):
        append_lines(log, '{"step": 2}\n')
    monkeypatch.undo()
    assert read_jsonl(log) == [{"step": 1}] and log.read_text() == '{"step": 1}\n'
    rewrite_jsonl(log, lambda r: {**r, "abandoned": True})
    assert read_jsonl(log, abandoned=False) == [] and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_peak_rss_is_the_processs_own_not_a_large_parents():
    """Linux carries a parent's resident set into a child's ru_maxrss across fork and exec; the
    metrics' peak_rss_mb (and the benchmarks' children) read the child's own high-water mark."""
    import inspect

    from trimtab.training.runtime import peak_rss_mb

    held = bytearray(512 * 2**20)  # 0.5 GB resident in this process
    for i in range(0, len(held), 4096):
        held[i] = 1
    assert peak_rss_mb() > 512
    # the function's own code in a bare interpreter (~40 MB): its module imports torch, 3 s of CPU
    code = f"import resource, sys\n{inspect.getsource(peak_rss_mb)}\nprint(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del held
    assert 0 < child < 256, child  # the interpreter's own, not this process's 0.5 GB


def test_a_run_directory_that_is_a_file_is_refused_naming_out(tmp_path):
    """`trimtab train --out a.txt` ended in a FileExistsError traceback from the lock."""
    (tmp_path / "a.txt").write_text("notes")
    for path in (tmp_path / "a.txt", tmp_path / "a.txt" / "run"):
        with pytest.raises(ConfigError, match=r"^out '.*a.txt.*' \(--out\) is or lies under a file"):
            with run_lock(path):
                pass
    assert (tmp_path / "a.txt").read_text() == "notes"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")
@pytest.mark.parametrize(
    "argv",
    [["train", "--preset", "debug"], ["data", "prepare", __file__]],
    ids=["train", "data-prepare"],
)
def test_an_out_that_cannot_be_made_is_said_naming_it_for_every_command(argv, capsys):
    """`--out /proc/x` ended every command that makes its --out (train, rl, dpo, plan, data prepare,
    export, tune) in a FileNotFoundError traceback from mkdir; an error on a file inside out is not this."""
    from trimtab.cli import main
    from trimtab.write_errors import out_error

    assert main([*argv, "--out", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert "--out '/proc/x' cannot be made or written ('/proc' lets no directory be made in it" in err
    assert out_error(FileNotFoundError(2, "No such file", "/proc/x/metrics.jsonl"), "/proc/x") is None


def test_a_read_only_run_directory_is_refused_naming_out_and_the_fix(tmp_path, monkeypatch):
    """A resume on a read-only mount (`mount -o remount,ro`) ended in an OSError traceback from the lock.
    EROFS is raised for the lock file alone, as that filesystem does (root ignores chmod: no real one here)."""
    import errno
    import os

    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    (tmp_path / "run").mkdir()
    with pytest.raises(
        ConfigError, match=r"^out '.*run' \(--out\) cannot be written \(Read-only file system: .*\.lock\)"
    ):
        with run_lock(tmp_path / "run"):
            pass
    assert list((tmp_path / "run").iterdir()) == []


def test_a_run_directory_that_is_a_dangling_link_is_refused_naming_its_target(tmp_path):
    """`ln -s /scratch/r1 runs/r1` before /scratch/r1 exists: the refusal called the link a file."""
    (tmp_path / "r1").symlink_to(tmp_path / "scratch" / "r1")
    with pytest.raises(ConfigError, match=r"is a symbolic link to '.*scratch/r1', which does not exist; make that"):
        with run_lock(tmp_path / "r1"):
            pass
    assert (tmp_path / "r1").is_symlink() and not (tmp_path / "scratch").exists()


def _strict(text: str) -> object:
    """JSON as jq or a browser's JSON.parse reads it: Python's json.loads takes a bare NaN, they refuse it."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_nan_in_a_decision_or_summary_is_written_as_json_and_read_back_as_nan(tmp_path):
    """A NaN loss's decision held `"loss": NaN` in decisions.jsonl, which jq and JSON.parse refuse;
    its trackers' tables the same."""
    from trimtab.training.services.tracking import decision_table

    nan, inf = float("nan"), float("inf")
    evidence = {"loss": nan, "grad_norm": inf, "rerun": {"loss": [nan, -inf]}}
    d = {"id": 1, "step": 3, "rule": "nonfinite", "action": "skip_step", "evidence": evidence, "confidence": nan}
    write_jsonl(tmp_path / DECISIONS_FILE, [d])
    write_summary(tmp_path, {"final_loss": nan})
    for line in (tmp_path / DECISIONS_FILE).read_text().splitlines() + [(tmp_path / "summary.json").read_text()]:
        _strict(line)
    back = read_decisions(tmp_path)[0]
    assert back["evidence"]["grad_norm"] == inf and back["evidence"]["rerun"]["loss"][1] == -inf
    assert back["evidence"]["loss"] != back["evidence"]["loss"] and math.isnan(read_summary(tmp_path)["final_loss"])
    _strict(json.dumps(decision_table(tmp_path)))


def test_a_string_that_reads_as_nan_stays_a_string_and_only_floats_round_trip(tmp_path):
    """json_value read every "NaN" / "Infinity" string back as a float: a source named "NaN", a reason
    "Infinity" came back as nan and inf. Only what was a float is; the record has no extra key on read."""
    nan, inf = float("nan"), float("inf")
    record = {"step": 1, "source": "NaN", "loss": nan, "evidence": {"why": ["Infinity", -inf], "1": "-Infinity"}}
    write_jsonl(tmp_path / "r.jsonl", [record, {"step": 2, "loss": nan}])
    first, second = read_jsonl(tmp_path / "r.jsonl")
    assert (first["source"], first["evidence"]) == ("NaN", {"why": ["Infinity", -inf], "1": "-Infinity"})
    assert math.isnan(first["loss"]) and math.isnan(second["loss"]) and set(first) == set(record)
    assert "'" not in (tmp_path / "r.jsonl").read_text().splitlines()[1]  # a record without one: as before
    rewrite_jsonl(tmp_path / "r.jsonl", lambda r: r)  # read and written again: still a string
    assert read_jsonl(tmp_path / "r.jsonl")[0]["source"] == "NaN"
    write_json(tmp_path / "s.json", {"reason": "NaN", "x": inf})
    assert read_json(tmp_path / "s.json") == {"reason": "NaN", "x": inf}


def test_a_nan_string_round_trips_in_a_top_level_list_and_adds_no_key_a_reader_sees():
    """A top-level list had no place for json_text's `_strings`: its "NaN" string read back as nan; and a
    record with one carried a `_strings` key that jq and every other reader saw. A string that reads as
    a float is now marked in place ("'NaN", a spreadsheet's text mark), at any depth, marks and all."""
    nan, inf = float("nan"), float("inf")
    value = ["NaN", nan, ["Infinity", -inf, "'NaN", "''-Infinity", "'x", "'"], {"a": "NaN"}]
    text = json_text(value)
    assert json.loads(text)[0] == "'NaN" and "_strings" not in text
    back = json_value(text)
    assert (
        back[0] == "NaN"
        and math.isnan(back[1])
        and back[2:] == [["Infinity", -inf, "'NaN", "''-Infinity", "'x", "'"], {"a": "NaN"}]
    )
    assert set(json.loads(json_text({"source": "NaN", "loss": nan}))) == {"source", "loss"}
