"""Scoring and reporting for bench/healing.py: each run's outcome against the clean run, the data
attribution's precision and recall, false actions on fault-free runs, the table and the verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOLERANCE = 0.03  # final eval loss within 3% of the clean run
NOISE = 0.002  # auto vs off: a ratio within this of the other's is the same result
HEADING = "## Fault healing (`trimtab bench healing`)"


def judge(run: dict[str, Any], clean: float | None, balance_limit: float | None = None) -> None:
    """Adds ratio and outcome: ok (finished within 3%), worse, ruined (NaN), or the failure;
    with balance_limit, a finished run whose max_load is at or above it is "unbalanced"."""
    run["ratio"] = run["val_loss"] / clean if run["val_loss"] is not None and clean else None
    if not run["finished"]:
        run["outcome"] = run["status"]
    elif run["ratio"] is None:
        run["outcome"] = "ruined (eval loss NaN)"
    elif balance_limit and (run["max_load"] is None or run["max_load"] >= balance_limit):
        run["outcome"] = "unbalanced"
    else:
        run["outcome"] = "ok" if run["ratio"] <= 1 + TOLERANCE else "worse"


def attribution(
    run_dir: Path, decisions: list[dict[str, Any]], bad: set[int] | None = None, touched: set[int] = frozenset()
) -> dict[str, Any] | None:
    """Rows the orchestrator left out (skip_data, a rollback's skip_rows) against the bad rows: the
    rows the faults really poisoned (faults.json), or `bad` where the bench knows them (a real
    garbage corpus: rows mostly garbage); leaving out a row of `touched` (some garbage, not
    mostly) is no false alarm. Precision and recall; None where nothing was bad."""
    if bad is None:
        path = Path(run_dir) / "faults.json"
        bad = set(json.loads(path.read_text()).get("poisoned", [])) if path.is_file() else set()
    if not bad:
        return None
    left = {
        r for d in decisions if d["mode"] == "auto" for r in d["params"].get("rows", d["params"].get("skip_rows", []))
    }
    return {
        "left_out": len(left),
        "bad": len(bad),
        "precision": len(left & (bad | touched)) / len(left) if left else None,
        "recall": len(left & bad) / len(bad),
    }


def acting(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The orchestrator's own actions (not a person's, not a configuration change, not a log)."""
    return [
        d for d in decisions if d["mode"] == "auto" and d["action"] != "none" and d["rule"] not in ("manual", "config")
    ]


def worse(auto: dict[str, Any], off: dict[str, Any]) -> bool:
    """Whether auto ended worse than off: a worse kind of outcome (ok < finished worse < did not
    finish), or both finished worse and auto further from the clean run."""

    def rank(run: dict[str, Any]) -> int:
        return 0 if run["outcome"] == "ok" else 1 if run["finished"] and run["ratio"] is not None else 2

    if rank(auto) != rank(off):
        return rank(auto) > rank(off)
    return rank(auto) == 1 and auto["ratio"] > off["ratio"] + NOISE


def _cell(run: dict[str, Any]) -> str:
    if run.get("skipped"):
        return f"skipped ({run['skipped'][:80].replace('|', '/')})"
    first = run["launches"][0]
    before = f" after `{first['status'][:40]}` (exit {first['rc']})" if len(run["launches"]) > 1 else ""
    if run["ratio"] is not None and run["finished"]:
        mark = "" if run["outcome"] == "ok" else f" **{run['outcome']}**"
        load = f", max load {run['max_load']:.2f}x" if run.get("max_load") is not None else ""
        return f"{run['val_loss']:.4f} ({run['ratio'] - 1:+.1%}){load}{mark}{before}"
    text = run["outcome"].split(":")[0].replace("|", "/")  # the whole message is in the JSON
    return text + ")" * (text.count("(") - text.count(")")) + f" (exit {run['launches'][-1]['rc']})"


def _condition(run: dict[str, Any]) -> str:
    """What a scenario does: a real condition's setup, or the injected specs (a long series of one
    kind shortened to its first and last)."""
    if run.get("kind") == "real":
        return f"real: {run.get('setup') or '-'}"
    faults = run["faults"]
    if len(faults) > 4 and len({f.split("@")[0] for f in faults}) == 1:
        return f"`{faults[0]}` ... `{faults[-1]}` ({len(faults)} specs)"
    return f"`{' '.join(faults)}`"


def _reference(run: dict[str, Any]) -> str:
    if run["val_loss"] is None:
        return run["status"].split(":")[0]
    load = f", max load {run['max_load']:.2f}x" if run.get("max_load") is not None else ""
    return f"{run['val_loss']:.4f}{load}"


def _actions(run: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for d in run["decisions"]:
        name = d["action"] if d["action"] != "none" else f"log ({d['rule']})"
        name += "" if d["mode"] in ("auto", "manual") else f" [{d['mode']}]"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{a} x{n}" if n > 1 else a for a, n in counts.items()) or "-"


def _rows(run: dict[str, Any]) -> str:
    a = run.get("attribution")
    if a is None:
        return "-"
    precision = "-" if a["precision"] is None else f"{a['precision']:.2f}"
    return f"{a['left_out']} / {a['bad']} ({precision} / {a['recall']:.2f})"


def report(results: dict[str, Any]) -> str:
    """The section's body: the header line (date, machine, torch, precision, the CPU share) is
    _benchfile.publish's, from the same results."""
    runs, clean = results["runs"], results["clean_val_loss"]
    reference = f"eval loss **{clean:.4f}**" if clean else f"**{runs['clean/off']['status']}**"
    lines = [
        f"Code {results['code']}; preset "
        f"{results['preset']}, {results['steps']} steps, checkpoint every {results['checkpoint_every']}; "
        f"each run a `trimtab train` subprocess, one after another (total {results['runtime_s'] / 60:.1f} "
        f"min). Clean run (no fault, "
        f"orchestrator off): {reference}. Steps re-done: steps executed minus the furthest step reached "
        "(rollbacks, restarts). Preemption (sigkill, sigterm, corrupt_checkpoint) is relaunched once, as a "
        "scheduler would; disk_stays_full is relaunched once without its fault, as after a person freed the "
        "disk. Real conditions (not injected): disk_real and disk_real_full train on a real tmpfs sized from the "
        "clean run's checkpoints (disk_real_full relaunched once after it is remounted larger), lr_too_high, "
        "lr_30x and lr_3x with 100x, 30x and 3x the preset's learning rate, garbage_corpus on a JSONL corpus "
        "with ~3% garbage documents "
        "against the same corpus without them (its clean run, orchestrator off, on the same held-out clean "
        "documents and tokenizer: its % are against that), garbage_screened on the same corpus with "
        "data.garbage_filter=drop (documents that pack like garbage left out before training). Rows: rows "
        "left out / rows the faults poisoned "
        "(garbage_corpus: rows at least half garbage; leaving out one with less is no false alarm) (precision / "
        "recall); `slow` has nothing to heal (the throughput rule only logs).",
        "",
        "| scenario | fault | off | auto | auto decisions | rows left out / bad | auto updates skipped "
        "| steps re-done off / auto | wall s off / auto | auto within 3% |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in results["scenarios"]:
        off, auto = runs[f"{name}/off"], runs[f"{name}/auto"]
        clean_off = runs.get(f"clean@{auto['preset']}/off")  # a scenario on a preset of its own
        where = f" on {auto['preset']} (clean: {_reference(clean_off)})" if clean_off else ""
        if own := runs.get(auto.get("reference", "")):  # its own clean reference (garbage_corpus, garbage_screened)
            where = f" (clean: {_reference(own)})"
        if auto.get("skipped"):
            lines.append(
                f"| {name} | {_condition(auto)} | {_cell(off)} | {_cell(auto)} | - | - | - | - | - | skipped |"
            )
            continue
        lines.append(
            f"| {name} | {_condition(auto)}{where} | {_cell(off)} | {_cell(auto)} | "
            f"{len(auto['decisions'])}: {_actions(auto)} | {_rows(auto)} | {auto['updates_skipped']} | "
            f"{off['steps_redone']} / {auto['steps_redone']} "
            f"| {off['wall_s']:.0f} / {auto['wall_s']:.0f} | {'yes' if auto['outcome'] == 'ok' else '**no**'} |"
        )
    lines += ["", *_false_positive_table(results), *(f"- {v}" for v in results["verdicts"]), ""]
    return "\n".join(lines)


def _false_positive_table(results: dict[str, Any]) -> list[str]:
    clean_runs = results.get("false_positives", {})
    if not clean_runs:
        return []
    lines = [
        "Fault-free runs in auto (false actions: the orchestrator's own actions, logs excluded):",
        "",
        "| preset | seed | eval loss | false actions |",
        "|---|---|---|---|",
    ]
    for key, run in clean_runs.items():
        preset, seed = key.split("/")
        found = acting(run["decisions"])
        what = ", ".join(f"{d['action']} @{d['step']} ({d['rule']})" for d in found) or "-"
        loss = f"{run['val_loss']:.4f}" if run["val_loss"] is not None else run["status"][:40]
        lines.append(f"| {preset} | {seed} | {loss} | {len(found)}: {what} |")
    return [*lines, ""]


def verdicts(results: dict[str, Any]) -> list[str]:
    """The goals met or not, over the scenarios that ran (a skipped one is named, not counted)."""
    runs = results["runs"]
    names = [n for n in results["scenarios"] if not runs[f"{n}/auto"].get("skipped")]
    left = [n for n in results["scenarios"] if n not in names]
    healed = [n for n in names if runs[f"{n}/auto"]["outcome"] == "ok"]
    hurt = [n for n in names if runs[f"{n}/off"]["outcome"] != "ok"]
    behind = [n for n in names if worse(runs[f"{n}/auto"], runs[f"{n}/off"])]
    out = [
        f"auto finishes within 3% of the clean run: **{len(healed)}/{len(names)}** "
        f"({'met' if len(healed) == len(names) else 'not met: ' + ', '.join(n for n in names if n not in healed)})",
        f"auto never ends worse than off: **{'met' if not behind else 'not met: ' + ', '.join(behind)}**",
        f"off crashes, stalls, ends >3% worse or unbalanced (MoE): **{len(hurt)}/{len(names)}** "
        f"(within 3% without it: {', '.join(n for n in names if n not in hurt) or 'none'})",
    ]
    scored = [(n, runs[f"{n}/auto"]["attribution"]) for n in names if runs[f"{n}/auto"].get("attribution")]
    if scored:
        low = [n for n, a in scored if (a["precision"] or 0) < 0.9 or a["recall"] < 0.9]
        cells = ", ".join(f"{n} {_rows(runs[f'{n}/auto'])}" for n, _ in scored)
        out.append(f"data attribution precision / recall >= 0.9: **{'met' if not low else 'not met'}** ({cells})")
    if left:
        out.append("skipped: " + "; ".join(f"{n} ({runs[f'{n}/auto']['skipped']})" for n in left))
    clean_runs = {"clean": runs["clean/auto"], **results.get("false_positives", {})}
    false = sum(len(acting(r["decisions"])) for r in clean_runs.values())
    out.append(
        f"false actions on fault-free runs: **{false}** in {len(clean_runs)} runs "
        f"({'met' if not false else 'not met'}; goal 0)"
    )
    return out
