"""bench/_measure.py and bench/_benchfile.py: the verdicts every benchmark's claims go through,
and the one section of BENCHMARKS.md each rewrites."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import pytest  # noqa: E402

from _benchfile import DRY_RUN, HEADER, precisions, publish, replace_section  # noqa: E402
from _measure import Ratio, median_ratio, paired_ratio, run_child, run_python, step_rate  # noqa: E402


def test_a_claim_is_met_only_when_the_whole_interval_clears_its_target():
    assert Ratio(1.2, 1.1, 1.3, 5).verdict(1.05) == "met"
    assert Ratio(0.9, 0.8, 0.95, 5).verdict(1.0) == "not met"
    assert Ratio(1.02, 0.97, 1.08, 5).verdict(1.0).startswith("not resolved")
    assert Ratio(0.6, 0.55, 0.65, 5).at_most(0.7) == "met"
    assert Ratio(0.72, 0.69, 0.75, 5).at_most(0.7).startswith("not resolved")


def test_parity_is_resolved_only_inside_the_tolerance():
    assert Ratio(1.01, 0.97, 1.04, 7).within(0.05) == "the same within 5%"
    assert Ratio(1.2, 1.1, 1.3, 7).within(0.05) == "different by more than 5%"
    assert Ratio(1.02, 0.93, 1.08, 7).within(0.05) == "not resolved to 5%"


def test_paired_ratios_cancel_drift_that_moves_both_variants():
    drift = [1.0, 0.7, 1.3, 0.9, 1.1]  # the machine's speed per repetition
    r = paired_ratio([1.25 * d for d in drift], drift)
    assert abs(r.value - 1.25) < 1e-9 and abs(r.low - 1.25) < 1e-9 and abs(r.high - 1.25) < 1e-9


def test_one_pair_gives_no_interval_and_resolves_no_claim():
    """A GPU session's one repetition of each: the step spreads may resolve it, its one ratio does not."""
    r = paired_ratio([75306.0], [64770.0])
    assert str(r) == "1.163x (one pair: no interval)"
    assert r.verdict(1.3).startswith("not resolved") and r.within(0.05).startswith("not resolved")


def test_step_rate_takes_the_median_step_so_one_slow_step_moves_it_little():
    t, marks = 0.0, [(0.0, 0)]
    for i, seconds in enumerate([5.0, 1.0, 1.0, 9.0, 1.0]):  # a warm-up step, then one stall
        t += seconds
        marks.append((t, 100 * (i + 1)))
    rate = step_rate(marks, warmup=1)
    assert rate["tokens_per_s"] == 100.0 and rate["ms_per_step"] == 1000.0 and rate["warmup_s"] == 5.0


def test_a_benchmark_rewrites_only_its_own_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## A (x)\n\nold\n## A (x) --more\n\nkept\n")
    replace_section(path, "## A (x)", "## A (x)\n\nnew\n")  # a heading that begins another's
    replace_section(path, "## B", "## B\n\nb\n")
    assert path.read_text() == "# Benchmarks\n\n## A (x)\n\nnew\n\n## A (x) --more\n\nkept\n\n## B\n\nb\n"


def test_a_published_section_opens_with_the_header_and_a_dry_run_writes_nothing(tmp_path, capsys):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## X (bench/x.py)\n\nold\n")
    section = publish("## X (bench/x.py)", "body\n", precision="bf16", other_cpu=[0.1, 0.3, 0.2], markdown=path)
    heading, blank, header, blank2, body = section.splitlines()
    assert (heading, blank, blank2, body) == ("## X (bench/x.py)", "", "", "body")
    assert HEADER.fullmatch(header), header
    assert "; precision bf16; other processes' CPU share median 20% (max 30%) over 3 runs." in header
    assert path.read_text() == "# Benchmarks\n\n" + section and section in capsys.readouterr().out
    publish("## X (bench/x.py)", "new", precision="fp32", other_cpu=0.0, markdown=path, dry_run=True)
    assert path.read_text() == "# Benchmarks\n\n" + section and capsys.readouterr().out.endswith(DRY_RUN + "\n")
    saved = publish("## Y", "b", precision="bf16 autocast", other_cpu=None, markdown="-", date="2026-01-02", on="H200",
                    torch_version="2.9")  # fmt: skip
    assert "Measured 2026-01-02 on H200; torch 2.9; precision bf16 autocast; other processes' CPU share not " in saved
    assert (
        precisions({"a": "bf16", "b": "bf16"}) == "bf16" and precisions({"a": "bf16", "b": "fp32"}) == "a bf16, b fp32"
    )


def test_a_child_hands_back_json_and_a_failure_stops_the_benchmark_with_its_stderr(tmp_path):
    ok = run_python("from _measure import emit\nprint('noise')\nemit({'x': 1.5})", "ok")
    assert ok["x"] == 1.5 and 0.0 <= ok["other_cpu"]
    child = [sys.executable, "-c", "import sys; sys.exit('out of memory: no')"]
    assert run_child(child, "oom", tmp_path, tolerate="Out of Memory")["failed"] is True
    with pytest.raises(SystemExit, match="boom failed \\(exit 1\\)"):
        run_child([sys.executable, "-c", "import sys; sys.exit('no result')"], "boom")


def test_ratios_a_child_paired_get_the_same_interval_as_paired_ones():
    assert median_ratio([1.0, 2.0, 4.0]) == paired_ratio([1.0, 2.0, 4.0], [1.0, 1.0, 1.0])
