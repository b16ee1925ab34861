"""trimtab report (report.html) and trimtab runs (the table of runs), on tiny real runs: a dense one
(its report written by the run itself), a hybrid one (MoE + MoD layers) and one rolled back, and
the page loaded in a real headless browser (the system's chromium) when there is one."""

import base64
import gzip
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

import trimtab.report
from trimtab.cli import main
from trimtab.errors import TrimtabError
from trimtab.report import NotARunError, figures, markers, write_report
from trimtab.report.run import read_run
from trimtab.report.runs import RunsError, format_table, list_runs
from trimtab.runlock import run_lock
from trimtab.training.hooks import ReportWriter

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = {"data": {"max_bytes": 150_000}, "log": {"progress": False, "tensorboard": False}}


def _train(out: Path, preset: str, steps: int, **sections) -> Path:
    from trimtab.api import train

    for name, values in {**QUICK, "train": {"max_steps": steps, "log_every": 1}}.items():
        sections[name] = {**values, **sections.get(name, {})}
    train(preset=preset, out=str(out), **sections)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def dense(root) -> Path:
    """Writes its own report.html at the end (log.report defaults on); a live Chinchilla status."""
    return _train(root / "dense", "debug", 8, train={"eval_every": 4}, plan={"status_every": 4})


@pytest.fixture(scope="module")
def hybrid(root) -> Path:
    """Dense, MoE, MoD and MoE+MoD layers: every sparse plot has data."""
    return _train(root / "sweep" / "hybrid", "debug-hybrid", 4, log={"report": False})


@pytest.fixture(scope="module")
def rolled(root) -> Path:
    """Broken weights at step 7: the held-out check rolls back to step 4, steps 5-7 are abandoned."""
    return _train(root / "rolled", "debug", 9, checkpoint={"every": 4}, faults=["weights_nan@7"])


@pytest.fixture(scope="module")
def rl_run(root, dense) -> Path:
    """RL from the dense run on the built-in arithmetic task, whose exact answers a model of 8
    steps never gives: every group is flat, so rule rl_signal acts (a decision to mark)."""
    rl = {"enabled": True, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 2, "held_out": 8}
    train = {"init_from": str(dense), "eval_every": 3}
    return _train(root / "rl", "debug", 6, rl=rl, train=train, log={"report": False})


# ---------------------------------------------------------------------------- report


def test_the_run_writes_its_report_at_the_end(dense):
    page = (dense / "report.html").read_text()
    assert (dense / "summary.json").is_file()
    # plotly.js embedded once, gzipped: the 4.6 MiB bundle made a debug run's page 4.6 MiB, now 1.9 MiB; no CDN
    packed = re.findall(r"<script id='plotly-js-gz' type='application/gzip;base64'>([^<]*)</script>", page)
    assert len(packed) == 1 and gzip.decompress(base64.b64decode(packed[0])).decode() == get_plotlyjs()
    assert "<script src=" not in page and "cdn.plot.ly" not in page
    assert len(page) < len(packed[0]) + 200_000 < 2_200_000
    for key in ("loss", "lr", "grad_norm", "throughput", "memory", "chinchilla"):
        assert f'id="fig-{key}"' in page, key
    for key in ("moe_load", "moe_balance", "mod"):  # a dense run has none: no empty plot
        assert f"fig-{key}" not in page
    assert ">completed<" in page and ">debug<" in page  # the summary table (summary.json came later)
    assert "<h2>Goodput</h2>" in page and re.search(r"<td class=num>\d+\.\d%</td>", page)  # ETTR, every session


def test_validation_loss_is_placed_at_its_tokens(dense):
    run = read_run(dense)
    fig = figures.loss([run])
    val = next(t for t in fig.data if t.name == "dense validation")
    tokens = {m["step"]: m["tokens"] for m in run.train}
    assert list(val.x) == [tokens[4], tokens[8]] and all(v is not None for v in val.y)


def test_sparse_runs_get_the_moe_heatmap_and_mod_plots(hybrid):
    run = read_run(hybrid)
    heat = figures.moe_load([run])
    assert heat is not None and all(t.type == "heatmap" for t in heat.data)
    z = heat.data[0].z
    experts = run.config["model"]["moe"]["n_experts"]
    assert len(z) == experts and len(z[0]) == len(run.train)
    # each column: every expert's load over the fair share, so they sum to the number of experts
    assert sum(row[0] for row in z) == pytest.approx(experts)
    mod = figures.mod([run])
    assert mod is not None and {t.name.split()[-1] for t in mod.data} == {"capacity", "predictor_acc"}
    page = write_report([hybrid]).read_text()
    assert all(f"fig-{key}" in page for key in ("moe_load", "moe_balance", "mod"))


def test_a_rollback_is_drawn_apart_and_the_decisions_marked(rolled):
    run = read_run(rolled)
    assert any(m.get("abandoned") for m in run.lines)
    fig = figures.loss([run])
    kept = next(t for t in fig.data if t.name == "rolled train")
    assert list(kept.x) == sorted(set(kept.x))  # each step once, in order: no zig-zag
    gone = next(t for t in fig.data if t.name == f"rolled train {figures.ABANDONED_LABEL}")
    assert gone.line.dash == "dash" and gone.opacity < 1
    abandoned_steps = [m["step"] for m in run.lines if m.get("abandoned") and "loss" in m]
    assert len(gone.x) == len(abandoned_steps) + 1  # from the kept point it branched off
    marks = {t.name: t for t in fig.data if t.name.startswith("decision: ")}
    assert "decision: rollback" in marks
    hover = marks["decision: rollback"].hovertext[0]
    for part in ("reasoning:", "evidence:", "confidence: ", "outcome: ", "rolled back"):
        assert part in hover
    rollback = next(d for d in run.decisions if d["action"] == "rollback")
    tokens = {m["step"]: m["tokens"] for m in run.train}
    assert marks["decision: rollback"].x[0] == tokens[rollback["step"]]


def test_several_runs_overlay(dense, rolled, tmp_path):
    out = write_report([dense, rolled], tmp_path / "both.html")
    page = out.read_text()
    assert "<td>dense</td>" in page and "<td>rolled</td>" in page
    loss = figures.loss([read_run(dense, "dense"), read_run(rolled, "rolled")])
    colours = {t.name: t.line.color for t in loss.data if t.name in ("dense train", "rolled train")}
    assert len(set(colours.values())) == 2
    twice = write_report([dense, rolled, dense / ".." / dense.name], tmp_path / "twice.html").read_text()
    assert twice.count("<td>dense</td>") == page.count("<td>dense</td>")  # one run named twice: drawn once
    # two runs with the same directory name are told apart by their parents
    assert trimtab.report._names([Path("/a/x/run"), Path("/a/y/run")]) == ["x/run", "y/run"]


def test_a_healing_benchmark_renders_as_its_table_and_curves(dense, rolled, tmp_path):
    result = {
        "date": "2026-01-01",
        "preset": "debug",
        "runs": {
            "weights_nan/off": {"mode": "off", "faults": ["weights_nan@7"], "outcome": "ruined (eval loss NaN)",
                                "val_loss": None, "decisions": [], "wall_s": 3.0, "run_dir": str(dense)},
            "weights_nan/auto": {"mode": "auto", "faults": ["weights_nan@7"], "outcome": "ok", "val_loss": 5.1,
                                 "decisions": [{"action": "rollback"}], "steps_redone": 3, "wall_s": 4.0,
                                 "run_dir": str(rolled)},
            "lr_too_high/auto": {"mode": "auto", "faults": [], "kind": "real", "setup": "optim.lr=0.3 (100x)",
                                 "outcome": "ok", "val_loss": 5.2, "decisions": [], "wall_s": 4.0},
        },
        "verdicts": ["1/1 scenarios healed"],
    }  # fmt: skip
    (tmp_path / "healing.json").write_text(json.dumps(result))
    page = write_report([tmp_path]).read_text()  # the directory holding healing.json
    assert (tmp_path / "report.html").is_file()
    assert "<td>weights_nan</td>" in page and "ruined (eval loss NaN)" in page and "1/1 scenarios healed" in page
    assert "<td>optim.lr=0.3 (100x)</td>" in page  # a real scenario shows its setup where faults go
    assert 'id="fig-healing-0"' in page


def test_bad_input_names_the_path_and_what_is_missing(tmp_path, capsys):
    with pytest.raises(NotARunError, match="no such directory"):
        write_report([tmp_path / "nowhere"])
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("preset: debug\n")
    with pytest.raises(TrimtabError, match=r"half is not a run directory: it has no metrics.jsonl"):
        write_report([tmp_path / "half"])
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(NotARunError, match="not a healing benchmark result"):
        write_report([tmp_path / "x.json"])
    assert main(["report", str(tmp_path / "half")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_a_file_given_for_a_run_directory_is_called_a_file_not_missing(tmp_path, capsys):
    """`trimtab runs FILE` and `trimtab report FILE` said "FILE: no such directory" of a file that exists."""
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["runs", str(tmp_path / "notes.txt")]) == 2 and main(["report", str(tmp_path / "notes.txt")]) == 2
    said = capsys.readouterr().err.splitlines()
    file = f"trimtab: error: {tmp_path / 'notes.txt'}: a file, not a directory"
    assert said == [
        f"{file} (trimtab runs DIR lists the run directories under DIR)",
        f"{file} (expected a run directory with config.yaml and metrics.jsonl)",
    ]


def test_a_report_that_fails_warns_and_spares_the_run(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(trimtab.report, "write_report", broken)

    class View:
        def say(self, line):
            raise AssertionError("no report, nothing to announce")

    ReportWriter(tmp_path).on_train_end(View(), {"status": "completed"})
    assert "report.html not written (OSError: No space left on device)" in caplog.text


# ---------------------------------------------------------------------------- trimtab runs


def test_runs_lists_the_runs_under_a_directory(root, dense, hybrid, rolled, capsys):
    rows = list_runs(root, "tokens")
    assert [r["run"] for r in rows] == ["sweep/hybrid", "dense", "rolled"]
    assert {r["status"] for r in rows} == {"completed"}
    by_name = {r["run"]: r for r in rows}
    assert by_name["rolled"]["decisions"] >= 1 and by_name["rolled"]["healed"] == 0  # its rollback at the end
    assert by_name["dense"]["steps"] == 8 and by_name["sweep/hybrid"]["preset"] == "debug-hybrid"
    assert all(0 < r["ettr"] < 1 for r in rows)  # productive / wall, from goodput.json (docs/resilience.md)
    assert [r["run"] for r in list_runs(root, "tokens", reverse=True)][0] == "rolled"
    assert main(["runs", str(root), "--json", "--sort", "run"]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)] == ["dense", "rolled", "sweep/hybrid"]
    assert main(["runs", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "preset", "status"] and len(table) == 4
    assert table[0].split()[-1] == "ETTR" and table[1].endswith("%")
    with pytest.raises(RunsError, match="unknown column 'loss'.*val_loss"):
        list_runs(root, "loss")


def test_runs_show_an_rl_or_dpo_runs_held_out_figure(tmp_path):
    """RL and DPO runs have no validation loss: their last held-out pass@1 / accuracy (from
    summary.json) is the column to compare them by."""
    for name, key, value in (("rl", "rl/held_out_pass@1", 0.25), ("dpo", "dpo/held_out_accuracy", 0.75)):
        run = _fake_run(tmp_path / name, 1e-4)
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps(summary | {key: value}))
    rows = list_runs(tmp_path, "held_out", reverse=True)
    assert [(r["run"], r["held_out"], r["val_loss"]) for r in rows] == [("dpo", 0.75, None), ("rl", 0.25, None)]
    assert "held-out" in format_table(rows).splitlines()[0] and "0.750" in format_table(rows)


def test_runs_tells_running_from_crashed(dense, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):  # no summary.json: running or dead
        shutil.copy(dense / name, live / name)
    with run_lock(live):
        assert [r["status"] for r in list_runs(tmp_path)] == ["running"]
    assert [r["status"] for r in list_runs(tmp_path)] == ["failed"]


def test_runs_and_report_list_a_run_whose_files_a_disk_fault_damaged(tmp_path):
    """One run's config.yaml and summary.json garbled: the table still lists it and the others
    (it stopped the whole listing with a traceback), the report still draws it."""
    _fake_run(tmp_path / "good", 1e-3)
    bad = _fake_run(tmp_path / "bad", 2e-3)
    (bad / "config.yaml").write_text("optim: [\n")
    (bad / "summary.json").write_text('{"status": "compl')
    rows = {r["run"]: r for r in list_runs(tmp_path, "run")}
    assert rows["good"]["status"] == "completed" and rows["good"]["preset"] == "debug"
    assert rows["bad"]["status"] == "failed" and rows["bad"]["detail"].startswith("failed: summary.json unreadable")
    assert rows["bad"]["steps"] == 2  # from its metrics
    write_report([bad], tmp_path / "bad.html")
    assert (tmp_path / "bad.html").stat().st_size > 0
    # lines of metrics.jsonl and decisions.jsonl that are JSON but not a record, or not UTF-8
    with open(bad / "metrics.jsonl", "ab") as fh:
        fh.write(b"[1, 2]\n" + b'{"step": 3, "loss": 1.5, "tokens": 300, "tokens_per_s": 1000.0}\n' + b"\xff\xfe\n")
    (bad / "decisions.jsonl").write_text("[1, 2]\n")
    rows = {r["run"]: r for r in list_runs(tmp_path, "run")}
    assert rows["bad"]["steps"] == 3 and rows["good"]["status"] == "completed"
    assert write_report([bad], tmp_path) == tmp_path / "report.html"  # --out a directory: its report.html
    for new in (f"{tmp_path / 'new'}/", tmp_path / "fresh"):  # a new one too, with or without its slash
        assert write_report([bad], new) == Path(new) / "report.html" and (Path(new) / "report.html").is_file()


def _fake_run(path: Path, lr: float) -> Path:
    """A finished run's files, written by hand: enough for the runs table."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.yaml").write_text(f"preset: debug\nout: {path}\noptim: {{lr: {lr}}}\n")
    lines = [{"step": s, "loss": 5.0 - s, "tokens": 100 * s, "tokens_per_s": 1000.0 + lr} for s in (1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (path / "summary.json").write_text(json.dumps({"status": "completed", "step": 2, "tokens": 200, "seconds": 1.0}))
    return path


def test_a_plot_no_run_has_data_for_is_not_built(tmp_path, monkeypatch):
    """A dense run's page builds no RL, DPO, MoE, MoD or planner figure to drop it empty: plotly's
    figure objects were half the end-of-run report's time (a debug run's page: 1.0-1.2 s, then 0.5-0.6 s)."""
    run = read_run(_fake_run(tmp_path / "dense", 1e-3))

    def built(*args, **kwargs):
        raise AssertionError("a figure was built for data no run has")

    monkeypatch.setattr(figures, "make_subplots", built)
    monkeypatch.setattr(figures, "_fig", built)
    for build in (figures.rl_reward, figures.rl_signals, figures.dpo_preference, figures.moe_balance, figures.mod):
        assert build([run]) is None, build.__name__
    assert figures.chinchilla([run]) is None


def _artifact_copy(run: Path, dest: Path) -> Path:
    """What MLflow keeps of a run: its files, no checkpoints/ (MlflowTracker.end)."""
    dest.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy(run / name, dest / name)
    return dest


def test_runs_lists_a_tune_trial_once_not_its_tracking_copies(tmp_path):
    """Issue #30: configs/tune-debug.yaml logs to MLflow next to the trials, and `trimtab runs`
    listed every trial twice, the second time from mlartifacts/."""
    trials = tmp_path / "tune" / "trials"
    for i, lr in enumerate((0.001, 0.002)):
        trial = _fake_run(trials / f"trial-{i:04d}", lr)
        _artifact_copy(trial, trials / "mlartifacts" / "1" / f"runid{i}" / "artifacts")
        _artifact_copy(trial, trials / "mlruns" / "1" / f"runid{i}" / "artifacts")
    _artifact_copy(trials / "trial-0000", tmp_path / "backup" / "trial-0000")  # a copy anywhere else
    rows = list_runs(tmp_path, "run")
    assert [r["run"] for r in rows] == ["tune/trials/trial-0000", "tune/trials/trial-0001"]
    assert [r["run"] for r in list_runs(tmp_path / "backup", "run")] == ["trial-0000"]  # alone: listed


# ---------------------------------------------------------------------------- in a real browser


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (apt-get install chromium): the page is not loaded in a browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    return chromium, sync_playwright


GRAPHS = """() => [...document.querySelectorAll('.plotly-graph-div')].map(el => ({
    id: el.id,
    traces: (el.data || []).length,
    points: (el.data || []).reduce((n, t) => n + [t.y, t.z].filter(Boolean).flat(2).filter(v => v !== null).length, 0),
}))"""


def test_the_page_loads_in_a_browser_with_every_plot_drawn(dense, hybrid, rolled, tmp_path):
    chromium, sync_playwright = _browser()
    out = write_report([dense, hybrid, rolled], tmp_path / "all.html")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.route(
                "**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_()
            )
            page.goto(out.as_uri(), wait_until="load")
            # the figures are drawn once the page has unpacked plotly.js (report/plotlyjs.py), after "load"
            page.wait_for_function("[...document.querySelectorAll('.plotly-graph-div')].every(el => el.data)")
            graphs = page.evaluate(GRAPHS)
        finally:
            browser.close()
    assert errors == []
    ids = {g["id"] for g in graphs}
    assert {"fig-loss", "fig-moe_load", "fig-mod", "fig-chinchilla"} <= ids
    assert all(g["traces"] > 0 and g["points"] > 0 for g in graphs), graphs


def test_the_report_needs_no_torch(dense, tmp_path):
    """Run directories are read anywhere they are copied to: making a page and a table loads no torch."""
    code = (
        "import sys; from trimtab.report import write_report; from trimtab.report.runs import list_runs; "
        f"write_report([{str(dense)!r}], {str(tmp_path / 'r.html')!r}); list_runs({str(dense.parent)!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_rl_run_gets_its_reward_and_what_its_rules_read_with_the_decisions_marked(rl_run, dense):
    run = read_run(rl_run)
    reward = figures.rl_reward([run])
    names = {t.name for t in reward.data}
    assert {"rl train reward", "rl held-out reward", "rl held-out pass@1"} <= names, names
    assert "decision: set_dynamic_sampling" in names  # rl_signal's, on the reward curve
    signals = figures.rl_signals([run])
    assert {"rl flat groups", "rl solved (flat at rl.full_reward)", "rl cut at the budget", "rl entropy"} <= {
        t.name for t in signals.data
    }
    assert figures.rl_reward([read_run(dense)]) is None and figures.rl_signals([read_run(dense)]) is None
    page = write_report([rl_run]).read_text()
    assert "fig-rl_reward" in page and "fig-rl_signals" in page


def test_abandoned_decisions_are_drawn_apart_and_counted_apart(tmp_path):
    """decisions.jsonl with a set_total_steps a resume abandoned and its re-applied twin at the same
    step: one live marker, the abandoned one in its faded trace, the same count in the runs table,
    and the decision table marks it."""
    from trimtab.report.page import summary_row

    run_dir = _fake_run(tmp_path / "run", 1e-3)
    taken = {"step": 2, "rule": "planner", "action": "set_total_steps", "params": {"steps": 9}, "mode": "auto"}
    journal = [{**taken, "abandoned": True}, taken, {**taken, "step": 1, "action": "scale_lr"}]
    (run_dir / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in journal))
    run = read_run(run_dir)
    traces = {t.name: t for t in figures.loss([run]).data}
    assert len(traces["decision: set_total_steps"].x) == 1 and len(traces["decision: scale_lr"].x) == 1
    gone = traces[markers.ABANDONED_DECISIONS]
    assert list(gone.x) == [200] and gone.opacity < 1 and "not in effect" in gone.hovertext[0]
    assert summary_row(run)[7] == "2 (0), 1 abandoned"
    assert list_runs(tmp_path)[0]["decisions"] == 2
    page = write_report([run_dir], tmp_path / "r.html").read_text()
    assert page.count("set_total_steps (abandoned)") == 1 and "1 of 3 marked (abandoned)" in page


def test_a_run_resumed_after_its_summary_is_running_then_failed_not_completed(tmp_path):
    """summary.json stays from the session that wrote it while a later one trains: the run listed
    as completed at the old step. Resumed: running (the lock), its step from the files; that
    session killed after training past the summary, or before it logged a step (goodput.json):
    failed. A run whose last session ended stays completed."""
    import os
    import time

    run = _fake_run(tmp_path / "r", 1e-3)
    ledger = {"sessions": [{"started": time.time() - 60, "end": "completed", "step": 2, "seconds": {}}]}
    (run / "goodput.json").write_text(json.dumps(ledger))
    assert list_runs(tmp_path)[0]["status"] == "completed"
    os.utime(run / "summary.json", (time.time() - 30, time.time() - 30))
    ledger["sessions"].append({"started": time.time() - 10, "end": None, "step": 2, "seconds": {}})
    (run / "goodput.json").write_text(json.dumps(ledger))
    with run_lock(run):
        row = list_runs(tmp_path)[0]
        assert (row["status"], row["detail"].startswith("running")) == ("running", True)
    row = list_runs(tmp_path)[0]
    assert (row["status"], row["steps"]) == ("failed", 2)
    assert row["detail"].startswith("failed: resumed after summary.json, the session ended without one")
    with open(run / "metrics.jsonl", "a") as fh:  # the later session trained to step 4
        fh.writelines(json.dumps({"step": s, "loss": 1.0, "tokens": 100 * s}) + "\n" for s in (3, 4))
    row = list_runs(tmp_path)[0]
    assert (row["status"], row["steps"], row["tokens"]) == ("failed", 4, 400)
    assert "summary.json's step 2, trained to step 4" in row["detail"]


def test_a_wrong_shaped_goodput_ledger_is_left_out_naming_it_and_the_tree_still_lists(tmp_path, caplog):
    """goodput.json that parses but is no ledger (`{"sessions": 5}`, a session's seconds null) ended
    `trimtab runs` over the whole tree, and the run's report, with a TypeError / AttributeError."""
    from trimtab.resilience.goodput import add_after_end, read_goodput

    damaged = {"count": {"sessions": 5}, "null": {"sessions": [{"step": 2, "end": "completed", "seconds": None}]}}
    for i, (name, ledger) in enumerate(damaged.items()):
        (_fake_run(tmp_path / name, 1e-3 * (i + 1)) / "goodput.json").write_text(json.dumps(ledger))
    ledger = {"sessions": [{"step": 2, "end": "completed", "seconds": {"productive": 3.0, "other": 1.0}}]}
    (_fake_run(tmp_path / "fine", 1e-2) / "goodput.json").write_text(json.dumps(ledger))
    rows = {r["run"]: r for r in list_runs(tmp_path)}
    assert set(rows) == {"count", "null", "fine"} and rows["fine"]["ettr"] == 0.75
    assert rows["count"]["ettr"] is None and rows["null"]["ettr"] is None
    assert f"{tmp_path / 'null' / 'goodput.json'} is not a goodput ledger" in caplog.text
    assert read_run(tmp_path / "count").goodput is None and read_goodput(tmp_path / "fine")["wall_s"] == 4.0
    assert add_after_end(tmp_path / "null", "checkpoint", 1.0) is None  # the end of a run is not broken either


def test_the_runs_wall_column_is_the_whole_runs_time_the_ettr_is_over(tmp_path):
    """A resumed run's wall column showed summary.json's seconds, its last session's alone (47 s), beside
    an ETTR over every session (101 s): the wall is the run's total, restarts and downs included."""
    sessions = [
        {"step": 2, "end": "killed", "seconds": {"productive": 2.0, "start_up": 3.0}, "down_s": 1.0},
        {"step": 4, "end": "completed", "seconds": {"productive": 4.0, "other": 2.0}},
    ]
    (_fake_run(tmp_path / "resumed", 1e-3) / "goodput.json").write_text(json.dumps({"sessions": sessions}))
    _fake_run(tmp_path / "no_ledger", 2e-3)  # an older trimtab's run: its summary's seconds, as before
    rows = {r["run"]: r for r in list_runs(tmp_path)}
    assert rows["resumed"]["wall_s"] == 12.0 and rows["resumed"]["ettr"] == 0.5
    assert rows["no_ledger"]["wall_s"] == 1.0


def test_the_reports_wall_column_is_the_whole_runs_time_as_the_runs_table(tmp_path):
    """`trimtab report` on a run a torchrun restart resumed (kill_rank under FSDP2) showed "12 s", the
    last session's seconds, beside an ETTR of 18.3% over both sessions (61 s) that `trimtab runs` showed
    as 62 s: the report's wall is the runs table's."""
    from trimtab.report.page import SUMMARY, summary_row

    sessions = [
        {"step": 2, "end": None, "seconds": {"productive": 2.0, "start_up": 3.0}},
        {"step": 4, "end": "completed", "seconds": {"productive": 4.0, "other": 2.0}, "down_s": 1.0},
    ]
    (_fake_run(tmp_path / "resumed", 1e-3) / "goodput.json").write_text(json.dumps({"sessions": sessions}))
    row = dict(zip(SUMMARY, summary_row(read_run(tmp_path / "resumed"))))
    assert (row["wall"], row["ETTR"]) == ("12 s", "50.0%") and list_runs(tmp_path)[0]["wall_s"] == 12.0
    _fake_run(tmp_path / "no_ledger", 2e-3)  # an older trimtab's run: its summary's seconds, as before
    assert dict(zip(SUMMARY, summary_row(read_run(tmp_path / "no_ledger"))))["wall"] == "1 s"


def test_a_damaged_goodput_ledger_is_started_anew_by_the_resumed_session(tmp_path, caplog):
    """A resume read goodput.json's sessions as they were: `{"sessions": 5}` or a session without
    its step ended the run's start with a TypeError / KeyError (Ledger.__init__, Ledger.open)."""
    from trimtab.resilience.goodput import Ledger

    for i, ledger in enumerate(({"sessions": 5}, {"sessions": [{"end": None, "seconds": {}}]})):
        run = tmp_path / str(i)
        run.mkdir()
        (run / "goodput.json").write_text(json.dumps(ledger))
        book = Ledger(run)
        assert book.sessions == [] and book.open(time.time(), 4, 1, 0, 0.0) is None  # no incident made up
    assert "this session starts a new ledger" in caplog.text


def test_a_run_directory_on_a_read_only_mount_is_refused_naming_the_page_and_out(tmp_path, monkeypatch, capsys):
    """`trimtab report RUN` on a read-only mount ended in a traceback (EROFS from the write, then again
    from the temp file's cleanup). EROFS is raised as that filesystem does: root ignores chmod here."""
    import errno
    import os

    import trimtab.rundir

    run = _fake_run(tmp_path / "run", 1e-3)

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_unlink = os.unlink
    monkeypatch.setattr(trimtab.rundir, "open", read_only, raising=False)  # the builtin, as write_atomic calls it
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: read_only(p) if str(run) in str(p) else real_unlink(p))
    assert main(["report", str(run)]) == 2
    said = capsys.readouterr().err
    assert f"the report cannot be written to {run / 'report.html'} (Read-only file system" in said
    assert "give --out" in said and not (run / "report.html").exists()


def test_a_report_on_a_full_disk_names_no_none_file_and_says_free_space(tmp_path, monkeypatch, capsys):
    """At the end of a finetuning run on a full tmpfs the report's error read "(No space left on device:
    None); give --out ...": a full disk's write names no file, and another --out there fails alike."""
    import errno
    import os

    import trimtab.rundir

    run = _fake_run(tmp_path / "run", 1e-3)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() raises it: no filename

    monkeypatch.setattr(trimtab.rundir, "open", full, raising=False)  # the builtin, as write_atomic calls it
    assert main(["report", str(run)]) == 2
    said = capsys.readouterr().err
    assert f"the report cannot be written to {run / 'report.html'} (No space left on device); free space" in said
    assert "None" not in said


def test_several_runs_with_one_no_run_report_the_others_and_name_the_skipped(tmp_path, capsys, caplog):
    """`trimtab report A B NOTARUN` aborted the whole comparison over one stray path; now it reports
    A and B, names the one skipped and why, and fails (exit 2) only when none is a run."""
    a, b, stray = _fake_run(tmp_path / "a", 1e-3), _fake_run(tmp_path / "b", 2e-3), tmp_path / "notes"
    stray.mkdir()
    assert main(["report", str(a), str(b), str(stray), "--out", str(tmp_path / "cmp.html")]) == 0
    page = (tmp_path / "cmp.html").read_text()
    assert "<td>a</td>" in page and "<td>b</td>" in page
    assert f"skipped {stray} is not a run directory: it has no config.yaml" in caplog.text
    assert main(["report", str(stray), str(tmp_path / "nowhere"), "--out", str(tmp_path / "none.html")]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 paths given is a run directory" in err and "nowhere: no such directory" in err
    assert not (tmp_path / "none.html").exists()
