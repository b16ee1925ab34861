"""The bench/ scripts' dry runs: each runs end to end, tiny, and writes nothing (BENCHMARKS.md
is written only by a real run)."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _benchfile import HEADER  # noqa: E402  bench/_benchfile.py: what every section's header line holds
from helpers import trimtab_cli  # noqa: E402


def dry_run(name: str, *args: str) -> str:
    """`trimtab bench NAME --dry-run`'s output, after checking it succeeded, wrote nothing and
    printed its section through the harness: the heading, then the header line (date, machine,
    torch, precision, other processes' CPU share)."""
    before = (BENCH.parent / "BENCHMARKS.md").read_bytes()
    # forked by the fork server: `trimtab bench` starts the script's own interpreter anyway, so a
    # fresh one for the command itself only spent its start-up (~0.4 s of CPU a dry run)
    run = trimtab_cli(["bench", name, "--dry-run", *args], Path.cwd())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dry run: BENCHMARKS.md not written" in run.stdout.rstrip().splitlines()[-2:]
    assert (BENCH.parent / "BENCHMARKS.md").read_bytes() == before
    lines = run.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert len(starts) == 1, starts  # one section
    assert lines[starts[0] + 1] == "" and HEADER.fullmatch(lines[starts[0] + 2]), lines[starts[0] : starts[0] + 3]
    return run.stdout


def header(out: str) -> str:
    """The header line of the one section in `out`."""
    lines = out.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("## ")) + 2]


@pytest.mark.slow  # one process with the four variants, then one per variant for its peak RSS: a minute or two
def test_moe_step_dry_run_prints_every_variant_and_the_ratios():
    out = dry_run("moe_step")
    assert "## MoE training step (bench/moe_step.py --preset debug-moe)\n" in out
    for variant in ("trimtab", "trimtab-loop", "hf-grouped_mm", "hf-eager"):
        assert f"\n| {variant} | " in out, variant
    trainer = "trimtab (Trainer at the preset's defaults)"
    for ratio in (
        "trimtab-loop / hf-grouped_mm",
        "trimtab-loop / hf-eager",
        f"{trainer} / hf-grouped_mm",
        f"{trainer} / hf-eager",
    ):
        assert f"- {ratio}" in out and "target >= " in out, ratio
    assert "as parity: " in out and "> 1 in every repetition: " in out
    assert "a step of each in turn" in out  # the variants interleaved in one process per repetition


@pytest.mark.slow  # seven variants, each a subprocess that builds a model and trains 2 tiny steps: a minute or two
def test_mod_dry_run_prints_every_variant_the_ratios_and_peak_memory():
    out = dry_run("mod")
    assert "## Mixture-of-Depths and hybrid step time (bench/mod.py)\n" in out
    assert "| 2 | dense | " in out and "| 1 (reference) |" in out
    for variant in ("**mod 0.5**", "mod 0.25", "mod 0.125", "dense+mod 0.125", "moe", "hybrid"):
        row = next((ln for ln in out.splitlines() if ln.startswith(f"| 2 | {variant} | ")), None)
        assert row is not None, variant
        assert row.count("x (") == 1 and " MB" not in row, row  # the ratio's interval; RSS as a number
    assert "peak RSS MB" in out
    assert "- mod 0.5 / dense step time, 2 torch threads: **" in out and "target <= 0.7x: " in out


@pytest.mark.slow  # five subprocesses (four variants and a repeat), each building a model and training 2 steps
def test_memory_dry_run_prints_every_variant_and_the_ratios():
    out = dry_run("memory")
    assert "## Activation memory: largest batch under a cap (bench/memory.py --preset debug)\n" in out
    for variant in ("trimtab", "trimtab+ckpt", "transformers", "transformers+ckpt"):
        assert f"\n| {variant} | >= 1 | 64 | " in out, variant  # --max-rows 1 in a dry run; debug's seq_len 64
    for ratio in ("trimtab / transformers", "trimtab+ckpt / transformers+ckpt", "trimtab+ckpt / trimtab"):
        assert f"- largest batch, {ratio}: **" in out, ratio
    assert "- repeatability: trimtab at 1 rows measured twice, " in out
    assert "micro-batch auto-sizing: " in out  # skipped with its reason on CPU, measured on CUDA


@pytest.mark.slow  # builds debug and times a few steps in fp32 and bf16: under a minute where bf16 is native
def test_precision_dry_run_prints_the_speedup_and_what_auto_chose():
    from trimtab.hardware import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        pytest.skip("no native bf16 on this CPU: the benchmark refuses (bf16 is emulated, minutes a step)")
    out = dry_run("precision")
    assert "## bf16 autocast on this CPU (bench/precision.py)\n" in out
    assert "\n| debug | " in out and "(>= 1.1x: " in out


def test_gpu_dry_run_trains_trimtab_and_the_plain_loop_on_cpu():
    out = dry_run("gpu")
    assert "## GPU training step (`bench/gpu.py --preset debug`)" in out
    assert "\n| trimtab | " in out and "\n| plain | " in out and "- trimtab / plain, tokens/s: **" in out
    assert "; precision fp32 (a CPU dry run); other processes' CPU share " in header(out)


def test_gpu_dry_run_runs_its_variants_in_its_own_process(monkeypatch):
    """A dry run checks that each variant runs, not what it measures: a fresh interpreter per variant spent ~2.5 s
    of CPU on imports. The variant gets the child's settings, its --profile path included, and the CPU share."""
    import gpu

    seen = []
    monkeypatch.setattr(gpu, "run_child", lambda *a, **k: pytest.fail("a dry run started a child process"))
    monkeypatch.setattr(gpu, "_variant", lambda ns: seen.append((ns.variant, ns.profile, ns.preset)) or {"ok": 1})
    args = argparse.Namespace(dry_run=True, preset="debug", profile="prof.txt", variant=None)
    result = gpu._run_child(args, "trimtab", ["--profile=/abs/prof.txt"])
    assert seen == [("trimtab", "/abs/prof.txt", "debug")] and result["ok"] == 1 and result["other_cpu"] >= 0


def test_gpu_reports_saved_repetitions_without_running(tmp_path):
    """--load: the repetitions of earlier invocations (--save, e.g. from a lent GPU) in one table."""
    rep = {"date": "2026-11-25", "tokens_per_s": 100.0, "step_s": [0.5, 0.6], "warmup_s": 2.0, "mfu": 0.4}
    rep |= {"peak_mem_gb": 1.0, "device": "NVIDIA H200", "torch": "2.11.0"}
    (tmp_path / "a.json").write_text(json.dumps({"trimtab": [rep | {"cold_start_s": 1.0}], "plain": [rep]}))
    (tmp_path / "b.json").write_text(json.dumps({"trimtab-compile": [rep | {"tokens_per_s": 120.0}]}))
    args = ["--preset", "moe-7b", "--moe-impl", "padded", "--dry-run", "--load", "a.json", "b.json"]
    run = subprocess.run([sys.executable, str(BENCH / "gpu.py"), *args], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "## GPU training step (`bench/gpu.py --preset moe-7b --moe-impl padded`)" in run.stdout
    assert "| trimtab | 100 | 100 | 0.500-0.600 | 40.0% | 2.0 | 1.0 | 1.0 |" in run.stdout
    assert "- trimtab-compile / trimtab, tokens/s: **1.200x (one pair: no interval)**" in run.stdout
    assert (
        "Measured 2026-11-25 on NVIDIA H200 (" in run.stdout
        and "; torch 2.11.0; precision bf16 autocast;" in run.stdout
    )


def test_gpu_profile_dry_run_writes_the_table_and_the_top_ops(tmp_path):
    """--profile: trimtab's timed step under torch.profiler (CPU here, debug-moe), its table and
    JSON, with the MoE layers' named ranges, the fused loss and the optimizer step."""
    args = ["--dry-run", "--profile", "prof.txt"]
    run = subprocess.run([sys.executable, str(BENCH / "gpu.py"), *args], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trimtab under the profiler: " in run.stdout and "moe.experts" in run.stdout
    assert "Self CPU time total" in (tmp_path / "prof.txt").read_text()
    summary = json.loads((tmp_path / "prof.json").read_text())
    assert summary["time"] == "CPU" and summary["steps"] == 1 and summary["total_ms_per_step"] > 0
    # the kernels lead (a named range's self time can outrank the second on a busy host)
    assert len(summary["ops"]) == 30 and summary["ops"][0]["name"].startswith("aten::")
    assert sum(op["name"].startswith("aten::") for op in summary["ops"]) >= 20
    assert all(op["ms_per_step"] >= 0 and op["calls_per_step"] > 0 for op in summary["ops"])
    assert 0.5 < sum(op["share"] for op in summary["ops"]) <= 1.0 + 1e-9  # the top 30 of all self time
    ranges = {r["name"] for r in summary["ranges"]}
    for name in ("moe.route", "moe.sort", "moe.permute", "moe.experts", "moe.unpermute", "moe.combine"):
        assert name in ranges, name
    assert "LinearCrossEntropy" in ranges and any(r.startswith("Optimizer.step#") for r in ranges)


def test_recompute_dry_run_times_each_checkpointing_mode_and_measures_what_it_keeps():
    out = dry_run("recompute")
    assert "## Activation checkpointing: off, selective, full (bench/recompute.py)" in out
    rows = {
        mode: next(ln for ln in out.splitlines() if ln.startswith(f"| debug | {mode} | "))
        for mode in ("off", "selective", "full")
    }
    kept = {mode: float(row.split(" | ")[5].replace(",", "")) for mode, row in rows.items()}
    assert kept["full"] < kept["selective"] < 0.7 * kept["off"]  # measured, not the estimate (the next column)


def test_recompute_dry_run_measures_in_its_own_process(monkeypatch):
    """As gpu.py's: a dry run's preset is measured in the benchmark's process, with the child's settings."""
    import recompute

    seen = []
    monkeypatch.setattr(recompute, "run_child", lambda *a, **k: pytest.fail("a dry run started a child process"))
    monkeypatch.setattr(recompute, "_measure", lambda ns: seen.append((ns.preset, ns.steps)) or {"ok": 1})
    result = recompute._run_child(argparse.Namespace(dry_run=True, steps=2), "debug")
    assert seen == [("debug", 2)] and result["ok"] == 1 and result["other_cpu"] >= 0


def test_loss_dry_run_checks_every_chunk_size_against_the_plain_loss():
    out = dry_run("loss")
    assert "## Fused cross-entropy (bench/loss.py)" in out
    for variant in ("plain", "fused 128", "fused 256"):
        assert f"\n| {variant} | " in out, variant


@pytest.mark.slow  # three 2-process torchrun runs, one of them restarted twice: about a minute
def test_resilience_dry_run_restarts_names_the_slow_rank_and_projects_ettr():
    out = dry_run("resilience")
    assert "## Resilience: lost ranks, hangs, a slow rank, flipped bits (`bench/resilience.py`)" in out
    killed = next(line for line in out.splitlines() if line.startswith("| rank killed (SIGKILL) x2 |"))
    assert "| yes | 2 |" in killed  # the undisturbed run's loss, two restarts
    assert next(line for line in out.splitlines() if line.startswith("| rank 3x slower; named at step"))
    replaced = next(line for line in out.splitlines() if line.startswith("| torchft, replica group killed"))
    assert "; withheld at steps " in replaced and "GROUPS DIFFER" not in replaced and "| 2 | 0 |" in replaced
    for gpus in ("1,024", "16,384", "131,072"):
        assert f"\n| {gpus} | " in out, gpus


# slow tier: export, import and their parity have their own tests (tests/test_hf*.py); this checks
# the benchmark runs (CI under 10 minutes, issue 31)
@pytest.mark.slow
def test_interop_dry_run_times_the_four_operations_in_rounds_and_states_parity():
    out = dry_run("interop")
    assert "## Hugging Face export and import (bench/interop.py)" in out and "Time: 2 rounds" in out
    for op in ("trimtab export", "trimtab import", "transformers load", "transformers save"):
        assert f"\n| {op} | " in out, op
    for ratio in ("trimtab export / transformers save", "trimtab import / transformers load"):
        assert f"- {ratio}, time: **" in out and "as parity: " in out, ratio


def _healing():
    """bench/healing.py imported as `python bench/healing.py` would (its helpers sit beside it)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import healing

    return healing


def test_healing_lists_the_real_end_of_run_and_thin_scenarios_with_their_specs():
    healing = _healing()
    table = healing.scenarios(120, 4096)
    assert table["end_nan"] == ["weights_nan@120"] and table["end_noise"] == ["weights_noise@119:3"]
    thin = table["thin_bad_data"]  # a quarter of every 8th step's rows: ~3% of the rows seen
    assert thin[0] == "bad_rows@8:1" and thin[-1] == "bad_rows@112:1" and len(thin) == 14
    assert len(set(thin)) == len(thin)  # each spec fires once: faults.json keys them by spec
    from trimtab.orchestrator.fault_specs import parse_faults

    parse_faults([spec for specs in table.values() for spec in specs])  # every spec is one the trainer takes
    for name in ("disk_real", "disk_real_full", "lr_too_high"):
        assert table[name] == [] and name in healing.REAL  # nothing injected: a real condition
    assert healing.settings("lr_too_high", 3e-3) == ("optim.lr=0.3",)
    assert "checkpoint.keep=3" in healing.settings("disk_real", 3e-3) and healing.settings("nan_loss", 3e-3) == ()
    assert "disk_real_full" in healing.FREED and "disk_real" not in healing.FREED


def test_healing_sizes_the_tmpfs_from_the_clean_runs_checkpoints(tmp_path):
    healing = _healing()
    mb = 2**20
    for step, optim in ((80, 4.4 * mb), (100, 4.4 * mb)):  # a finished debug run: full checkpoints only
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(b"\0" * int(2.2 * mb))
        (ckpt / "optim.pt").write_bytes(b"\0" * int(optim))
    (tmp_path / "metrics.jsonl").write_bytes(b"\0" * 50_000)
    (tmp_path / "report.html").write_bytes(b"\0" * 5 * mb)  # not written on the tmpfs (log.report=false)
    initial, full, other = healing.checkpoint_sizes(tmp_path)
    assert (initial, full, other) == (int(2.2 * mb), int(2.2 * mb) + int(4.4 * mb), 50_000)
    (size, freed), text = healing.real_setup("disk_real", (initial, full, other), 3e-3)
    # the initial checkpoint and two full ones fit, a third does not: saves fail for real mid-run
    assert initial + 2 * full + other < size < initial + 3 * full
    assert size % 1024 == 0 and text.startswith("tmpfs 19.0 MiB: the initial checkpoint (2.2 MiB) + 2.5 full")
    (small, freed), text = healing.real_setup("disk_real_full", (initial, full, other), 3e-3)
    assert initial + other < small < full  # no full checkpoint fits, even alone: exit 4
    assert freed > initial + 4 * full + other and "remounted" in text  # three kept and one being written
    assert healing.real_setup("disk_real", None, 3e-3)[0] is None
    assert healing.checkpoint_sizes(tmp_path / "nowhere") is None


def test_healing_reports_real_and_skipped_scenarios_beside_the_injected_ones():
    healing = _healing()
    from _healing_score import judge, report, verdicts

    def run(mode, faults=(), val=3.0, kind="injected", setup=""):
        out = {"mode": mode, "preset": "debug", "faults": list(faults), "launches": [{"rc": 0, "status": "completed"}]}
        out |= {"finished": True, "status": "completed", "val_loss": val, "decisions": [], "updates_skipped": 0}
        out |= {"steps_redone": 0, "wall_s": 1.0, "other_cpu": 0.0, "max_load": None, "attribution": None}
        out |= {"kind": kind, "setup": setup}
        judge(out, 3.0)
        return out

    runs = {"clean/off": run("off"), "clean/auto": run("auto")}
    runs |= {"end_nan/off": run("off", ["weights_nan@120"], None), "end_nan/auto": run("auto", ["weights_nan@120"])}
    lr = "optim.lr=0.3 (100x the preset's)"
    runs |= {"lr_too_high/off": run("off", (), 4.0, "real", lr), "lr_too_high/auto": run("auto", (), 4.0, "real", lr)}
    runs |= {
        f"disk_real/{m}": healing.skipped(m, "debug", "tmpfs", "cannot mount a tmpfs: denied") for m in ("off", "auto")
    }
    results = {"date": "2026-11-26", "machine": "cpu", "torch": "2", "code": "abc", "preset": "debug", "steps": 120}
    results |= {"checkpoint_every": 20, "runtime_s": 60, "other_cpu": "0%", "clean_val_loss": 3.0, "runs": runs}
    results |= {"scenarios": ["end_nan", "lr_too_high", "disk_real"]}
    results["verdicts"] = verdicts(results)
    text = report(results)
    assert "| end_nan | `weights_nan@120` | ruined (eval loss NaN) (exit 0) | 3.0000 (+0.0%) |" in text
    assert f"| lr_too_high | real: {lr} | 4.0000 (+33.3%) **worse** | " in text
    assert "| disk_real | real: tmpfs | skipped (cannot mount a tmpfs: denied) | " in text
    assert "**1/2** (not met: lr_too_high)" in text  # the skipped scenario is named, not counted
    assert "- skipped: disk_real (cannot mount a tmpfs: denied)" in text


def test_garbage_corpus_is_deterministic_thin_named_and_leaves_the_clean_file_whole(tmp_path):
    healing = _healing()
    import _garbage_corpus as gc

    assert healing.scenarios(120, 4096)[healing.GARBAGE] == [] and healing.GARBAGE in healing.REAL
    text = "\n\n".join(f"def f{i}():\n    return {i}  # " + "x" * 300 for i in range(12))
    pieces = gc.documents(text, "stdlib/a.py", size=1000)
    assert [doc_id for doc_id, _ in pieces] == [f"stdlib/a.py#{k}" for k in range(len(pieces))]
    assert "\n\n".join(doc for _, doc in pieces) == text and all(len(doc) >= 1000 for _, doc in pieces[:-1])
    clean = [(f"stdlib/m{i}.py#0", f"import os\n\n\ndef f{i}(x):\n    return x + {i}\n" * 40) for i in range(300)]
    one, two = gc.write(tmp_path / "one", clean), gc.write(tmp_path / "two", clean)
    for name in (gc.MIXED, gc.CLEAN, gc.EVAL):  # a fixed seed: the same files byte for byte
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    records = [json.loads(line) for line in one.mixed.read_text().splitlines()]
    ids = [r["id"] for r in records]
    garbage = [i for i in ids if gc.is_garbage(i)]
    assert len(garbage) == one.n_garbage == two.n_garbage and 0.025 <= len(garbage) / len(ids) <= 0.035
    assert set(one.kinds) == set(gc.KINDS) and all(one.kinds.values())  # every kind, in turn
    positions = [ids.index(g) for g in garbage]
    assert positions != list(range(len(ids) - len(garbage), len(ids)))  # mixed in, not appended
    # the clean file is the mixed one without its garbage lines; the held-out documents are in neither
    assert [json.loads(line)["id"] for line in one.clean.read_text().splitlines()] == [
        i for i in ids if not gc.is_garbage(i)
    ]
    held = {json.loads(line)["id"] for line in one.eval.read_text().splitlines()}
    assert held and not held & set(ids) and one.n_clean + len(held) == len(clean)
    lengths = {len(doc.encode()) for _, doc in clean}
    for r in records:
        if gc.is_garbage(r["id"]):  # as long as a clean document, and not like one
            assert 0.9 * min(lengths) <= len(r["text"].encode()) <= max(lengths) and "return x" not in r["text"]
    mojibake = next(r["text"] for r in records if r["id"].startswith("garbage/mojibake/"))
    assert "Ã" in mojibake or "Ð" in mojibake or "Î" in mojibake
    hexdump = next(r["text"] for r in records if r["id"].startswith("garbage/hexdump/"))
    assert hexdump.startswith("00000000: ")
    # trimtab names each JSONL document FILE:LINE: the ground truth finds every one by that name
    from trimtab.config import DataConfig
    from trimtab.data.sources import read_documents

    docs, _ = read_documents(DataConfig(source=str(one.mixed), max_bytes=0))
    names = gc.ids_by_source(one.mixed)
    assert [names[d.source] for d in docs] == ids


def test_garbage_corpus_ground_truth_is_the_rows_mostly_garbage_and_scores_like_bad_rows():
    _healing()
    import numpy as np

    import _garbage_corpus as gc
    from _healing_score import attribution
    from trimtab.data.packing import TokenizedDocs, pack_rows

    # documents of 40, 100 (garbage), 30, 70 (garbage) tokens, packed into rows of 16 inputs
    lengths = [40, 100, 30, 70]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    sources = ["c.jsonl:1", "c.jsonl:2", "c.jsonl:3", "c.jsonl:4"]
    docs = TokenizedDocs(np.zeros(240, np.int32), np.ones(240, bool), offsets, sources)
    rows = pack_rows(docs, 16)
    ids = {"c.jsonl:1": "stdlib/a.py#0", "c.jsonl:2": "garbage/base64/0", "c.jsonl:3": "stdlib/b.py#0"}
    ids["c.jsonl:4"] = "garbage/hexdump/0"
    truth = gc.shares(rows, ids)
    garbage = np.zeros(240, bool)
    garbage[40:140] = garbage[170:240] = True
    share = [garbage[s + 1 : s + 17].mean() for s in rows.starts]  # a row's targets
    assert truth["rows"] == len(rows) == 14
    assert truth["bad"] == [i for i, f in enumerate(share) if f >= 0.5] == [2, 3, 4, 5, 6, 7, 8, 11, 12, 13]
    assert truth["touched"] == [i for i, f in enumerate(share) if f > 0] == [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]
    decisions = [{"mode": "auto", "params": {"rows": [3, 4, 5, 6, 7, 8, 10, 11]}}]
    decisions.append({"mode": "auto", "params": {"rows": [0]}})  # a clean row: a false alarm
    decisions.append({"mode": "off", "params": {"rows": [12, 13]}})  # off only logs: not left out
    scored = attribution(Path("nowhere"), decisions, set(truth["bad"]), set(truth["touched"]))
    # row 10 (7 of its 16 targets garbage) is no false alarm; row 0 is
    assert scored == {"left_out": 9, "bad": 10, "precision": 8 / 9, "recall": 7 / 10}


def test_garbage_corpus_ground_truth_rebuilds_a_runs_rows_from_its_config(tmp_path):
    _healing()
    import yaml

    import _garbage_corpus as gc
    from trimtab.config import load_config

    prepared = gc.prepare(tmp_path / "corpus", 40_000, 3, "debug")
    assert prepared["steps"] == math.ceil(3 * prepared["steps_per_epoch"]) and prepared["bad"] > 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(preset="debug", sets=[*prepared["sets"], f"out={run_dir}"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run_dir / "tokenizer.json").write_bytes((tmp_path / "corpus" / "tokenizer.json").read_bytes())
    truth = gc.truth(run_dir)  # as the trainer builds them: the same rows the bench counted
    assert (truth["rows"], len(truth["bad"]), len(truth["touched"])) == (
        prepared["rows"],
        prepared["bad"],
        prepared["touched"],
    )
    kinds = "garbage documents (printable 1, base64 1, hexdump 1, unicode 1, mojibake 1)"
    assert kinds in gc.describe(prepared, 40_000)


def test_healing_skips_a_real_disk_scenario_where_no_tmpfs_can_be_mounted(tmp_path, monkeypatch):
    healing = _healing()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mount").write_text("#!/bin/sh\necho 'mount: only root can use \"--types\" option' >&2\nexit 1\n")
    (fake / "mount").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    with pytest.raises(healing.Unmountable, match="only root can use"):
        with healing.small_disk(tmp_path / "fs", 2**20):
            pass
    assert not (tmp_path / "fs").exists()  # nothing left behind


def test_moe_dry_run_times_every_variant_on_a_tiny_layer():
    out = dry_run("moe")
    assert "## MoE expert compute (bench/moe.py)\n" in out and "; precision fp32;" in header(out)
    for variant in ("**moe**", "moe-padded", "slices", "naive"):
        assert f" | {variant} | " in out, variant


@pytest.mark.slow  # a 40-step debug run with the orchestrator: a minute or more on two busy cores
def test_overhead_dry_run_pairs_blocks_of_off_and_auto():
    out = dry_run("overhead")
    assert "## Orchestrator overhead (`bench/overhead.py`)\n" in out and "\n| 0 | " in out
    assert "- end to end, auto / off iteration time: **" in out and "block pairs, 95% interval" in out


@pytest.mark.slow  # three processes (one in-process loop, three 3-step RSS runs) on debug: about a minute
def test_throughput_dry_run_prints_every_variant_and_the_paired_ratios():
    out = dry_run("throughput")
    assert "## Training throughput (`bench/throughput.py --preset debug`)\n" in out
    for variant in ("trimtab", "minimal", "transformers"):
        assert f"\n| {variant} | " in out, variant
    assert "- trimtab / minimal loop, identical settings: **" in out and "pairs)**; target >= 0.98x: " in out


@pytest.mark.slow  # three trimtab train runs, two of them under torchrun: half a minute or more
def test_distributed_dry_run_compares_one_process_with_ddp_and_fsdp():
    out = dry_run("distributed")
    for variant in ("1 process", "2 processes, DDP", "2 processes, FSDP2"):
        assert f"\n| {variant} | " in out, variant
    assert "| 1.00x (1.00-1.00) |" in out  # 1 process against itself


def test_comm_dry_run_counts_one_mesh_against_the_planner():
    out = dry_run("comm")
    assert "## Communication volume per step (`bench/comm.py`)\n" in out and "\n| DDP x2 | " in out
    assert "; precision fp32;" in header(out)


@pytest.mark.slow  # a 20-step debug run with ten checkpoints, then their averages evaluated: under a minute
def test_lawa_dry_run_averages_the_last_checkpoints():
    out = dry_run("lawa")
    assert "## Checkpoint averaging (bench/lawa.py)\n" in out and "\n| 0 | 10 | " in out and "\n| 0 | 20 | " in out


@pytest.mark.slow  # two 4-step trainings
def test_mod_quality_dry_run_compares_at_equal_flops():
    out = dry_run("mod_quality")
    assert "\n| debug | " in out and "\n| debug-mod | " in out
    assert "- debug-mod / debug validation loss at equal FLOPs: **" in out


@pytest.mark.slow  # a 6-trial grid, 2 TPE trials and three retrainings of 4 steps: a minute or two
def test_tune_dry_run_searches_a_tiny_grid_and_tpe():
    out = dry_run("tune")
    assert "## Hyperparameter search (bench/tune.py)\n" in out and "Grid best: **" in out
    assert "\n| 0 | 2 | " in out  # TPE seed 0, a third of the 6 grid trials


@pytest.mark.slow  # builds two corpora, prepares them, datasets.map twice and two `small` trainings: minutes
def test_data_dry_run_prepares_trains_and_times_the_loader():
    out = dry_run("data")
    assert "## Data at scale (bench/data.py)\n" in out and "- prepare / datasets.map, tokens/s: **" in out
    assert "Loader: `BatchLoader.next_batch`" in out


@pytest.mark.slow  # four 12-step trainings (clean and nan_loss, off and auto)
def test_healing_dry_run_runs_one_scenario_into_a_temporary_directory(tmp_path):
    out = dry_run("healing", "--json", str(tmp_path / "healing.json"))
    assert "## Fault healing (`trimtab bench healing`)\n" in out and "\n| nan_loss | " in out
    results = json.loads((tmp_path / "healing.json").read_text())
    assert results["scenarios"] == ["nan_loss"] and results["steps"] == 12
    assert not Path("runs/bench-healing").exists() or "nan_loss-off" not in os.listdir("runs/bench-healing")


def test_checkpoint_dry_run_pairs_synchronous_and_background_saves():
    out = dry_run("checkpoint")
    assert "## Checkpoint stall: synchronous vs background saves (`bench/checkpoint.py`)\n" in out
    assert "\n| `debug` | 0.6M | " in out and "2 pairs)** |" in out


def test_rl_report_pools_the_seeds_and_resolves_only_a_gain_outside_the_interval():
    """bench/rl.py's claim: RL's mean pass@1 over each control's, as a difference of proportions
    over every seed's held-out problems with a 95% normal interval."""
    import argparse

    from rl import _difference, report

    d, low, high = _difference(0.3, 0.2, 600)
    se = math.sqrt(0.3 * 0.7 / 600 + 0.2 * 0.8 / 600)
    assert d == pytest.approx(0.1) and (low, high) == pytest.approx((0.1 - 1.96 * se, 0.1 + 1.96 * se))
    rows = [
        {"seed": s, "start": 0.15, "rl": 0.30, "sft": 0.17, "random": r} for s, r in ((1, 0.28), (2, 0.27), (3, 0.29))
    ]
    out = report(argparse.Namespace(sft_steps=1500, steps=300, held_out=200), rows)
    assert "| mean | 0.150 | 0.300 | 0.170 | 0.280 |" in out
    assert "rl - the warm start: **+0.150**" in out and out.count(": resolved") == 2  # start and sft
    assert "rl - the random reward: **+0.020**" in out and "not resolved" in out


@pytest.mark.slow  # six trimtab runs (~40 s)
def test_rl_dry_run_trains_every_arm_and_scores_them():
    out = dry_run("rl")
    assert "| 1 | " in out and "rl - the supervised continuation" in out


@pytest.mark.slow  # 10 s (transformers); generation's own parity: tests/test_rl_rollout.py
def test_generate_dry_run_times_both_engines_in_rounds_and_compares_their_tokens():
    out = dry_run("generate")
    assert "## RL rollout generation (bench/generate.py)" in out and "2 rounds" in out
    assert "\n| trimtab `rl.rollout.generate` | " in out and "\n| transformers `generate` | " in out
    assert "trimtab against transformers: **" in out and "The same greedy tokens: yes" in out


def test_rl_async_report_reads_each_arms_course_against_the_synchronous_target():
    """bench/rl_async.py: the target is the warm start plus a share of the synchronous arm's
    gain; each arm's seconds to it are its mean over the seeds at the first step its mean
    course reaches it; the step-time ratio is paired by seed."""
    import argparse

    from rl_async import report

    def run(passes, step_s):
        return {"passes": passes, "seconds": {0: 0.0, 10: 10 * step_s, 20: 20 * step_s}, "step_s": step_s, "acted": 0}

    arms = {
        0: [run({0: 0.1, 10: 0.2, 20: 0.3}, 1.0), run({0: 0.1, 10: 0.2, 20: 0.3}, 1.0)],
        1: [run({0: 0.1, 10: 0.3, 20: 0.3}, 0.5), run({0: 0.1, 10: 0.3, 20: 0.3}, 0.5)],
    }
    args = argparse.Namespace(sft_steps=600, steps=20, held_out=100, eval_every=10, target=0.8, seeds=[1, 2])
    out = report(args, arms)
    assert "Target: 0.260" in out  # 0.1 + 0.8 x (0.3 - 0.1)
    assert "| 0 | 1.000 | 1 | 0.300 | 20 | 20.0 | 0 |" in out
    assert "| 1 | 0.500 | 0.500x" in out and "| 0.300 | 10 | 5.0 | 0 |" in out


def test_rl_healing_report_judges_each_run_against_the_clean_one():
    import argparse

    from rl_healing import report

    def run(finished, held_out, decisions=()):
        status = {"finished": finished, "exit": 0 if finished else 1, "held_out": held_out, "start": 0.5}
        return {**status, "decisions": list(decisions), "seconds": 5.0}

    runs = {
        "clean/off": run(True, 0.9),
        "clean/auto": run(True, 0.9),
        "rollout_oom/off": run(False, None),
        "rollout_oom/auto": run(True, 0.85, ["oom:set_generation_rows"]),
        "slow_verifier/off": run(True, 0.5),
        "slow_verifier/auto": run(True, 0.6, ["rl_verifier:set_verifier_timeout"]),
    }
    out = report(argparse.Namespace(steps=16, scenarios=["clean", "rollout_oom", "slow_verifier"]), runs)
    assert "| rollout_oom | crashed (exit 1) (-, 5 s) | ok (0.850, 5 s) | oom:set_generation_rows (1) |" in out
    assert "| slow_verifier | worse (0.500, 5 s) | worse (0.600, 5 s) |" in out
    assert "auto ok: **2/3** (not: slow_verifier)" in out and "never worse than off: **met**" in out
    assert "false actions on the clean run: **0**" in out


@pytest.mark.slow  # about 15 s: a warm start, then each arm a few steps
def test_rl_async_dry_run_runs_every_arm():
    out = dry_run("rl_async")
    assert "| 0 | " in out and "| 2 | " in out and "pass@1 course" in out


@pytest.mark.slow  # four trimtab runs (~60 s)
def test_rl_healing_dry_run_heals_a_rollout_oom_that_crashes_without_the_orchestrator():
    out = dry_run("rl_healing")
    assert "| rollout_oom | gave up (exit 3)" in out and "oom:set_generation_rows" in out


@pytest.mark.slow  # two trainers in lockstep, a few steps each (~20 s); TRL is a bench peer, not a dependency
def test_rl_trl_dry_run_times_both_trainers_on_the_same_exported_model():
    pytest.importorskip("trl")
    out = dry_run("rl_trl")
    assert "| trimtab `rl` | " in out and "| TRL `GRPOTrainer` | " in out and "TRL / trimtab, time a step: **" in out


def test_healing_reads_a_summary_whose_loss_is_nan(tmp_path):
    """A run that gave up on a NaN loss writes val_loss "NaN" (rundir's JSON has no NaN); json.loads left the string,
    math.isfinite raised TypeError and the bench (its --dry-run too) crashed on nan_loss's off run."""
    from trimtab.rundir import read_summary, write_summary

    healing = _healing()
    write_summary(tmp_path, {"status": "gave up", "val_loss": float("nan")})
    assert healing.finite_val(read_summary(tmp_path)) is None
    write_summary(tmp_path, {"status": "completed", "val_loss": 4.17})
    assert healing.finite_val(read_summary(tmp_path)) == 4.17 and healing.finite_val(None) is None


def test_healing_names_the_code_it_measured_without_git(tmp_path, monkeypatch):
    """A copied tree without .git read "code unknown": the table names the version and a digest of the
    source instead, which changes with any source file."""
    healing = _healing()
    src = tmp_path / "src" / "trimtab"
    src.mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(healing, "ROOT", tmp_path)
    first = healing._code_version()
    assert "no git" in first and "unknown" not in first and healing.trimtab.__version__ in first
    (src / "a.py").write_text("x = 2\n")
    assert healing._code_version() != first


def test_healing_writes_benchmarks_md_only_for_the_whole_table(monkeypatch, capsys):
    """A part of the table (a scenario, other steps, another preset) written into BENCHMARKS.md replaced the whole
    section, every other row and the re-runs' notes with it (a helper's `--scenarios bad_data_early_long` did)."""
    healing = _healing()
    seen = []
    monkeypatch.setattr(healing, "_main", lambda args, parser: seen.append(args.markdown) or 0)
    healing.main([])
    healing.main(["--scenarios", "nan_loss"])
    healing.main(["--steps", "200"])
    healing.main(["--scenarios", "nan_loss", "--markdown", "part.md"])
    assert seen == [str(healing.ROOT / "BENCHMARKS.md"), "-", "-", "part.md"]
    assert "BENCHMARKS.md is not written for a part of the table" in capsys.readouterr().out
