"""The report page: one self-contained HTML file (plotly.js embedded once, no network to open it).

Top: a summary table per run; then the plots the runs have data for; then the orchestrator's
decisions as a table (the same ones the loss plot marks); then a healing benchmark's result when
one was given.
"""

from __future__ import annotations

import html
import time
from typing import Any

import plotly.graph_objects as go

from trimtab.report import figures
from trimtab.report.healing import HEADER, Healing, curves, table_rows
from trimtab.report.plotlyjs import head_scripts
from trimtab.report.run import RunRecord, finite, outcome_result, val_loss
from trimtab.report.runs import run_wall
from trimtab.rundir import advice_line, healed, is_note, standing_advice
from trimtab.words import counted

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #666; font-size: 0.9em; }
.figure { margin-bottom: 1.5em; }
"""

CAPTIONS = {
    "loss": "Train loss (solid) and validation loss (dotted) against tokens. Diamonds: the orchestrator's "
    "decisions (hover: evidence, reasoning, confidence, outcome); open, faded: decisions a rollback or a resume "
    "abandoned, not in effect. Dashed, faded: steps a rollback abandoned.",
    "rl_reward": "RL: the training reward of each step (over every group drawn), the held-out reward (dotted) and "
    "pass@1 (dashed) at each evaluation. Diamonds: the orchestrator's decisions.",
    "rl_signals": "RL: what the rules read: the share of flat groups (and of solved ones, every response at "
    "rl.full_reward), of responses cut at the budget, of clipped and "
    "off-policy tokens (left); the sampled tokens' entropy and the rollouts' staleness (right).",
    "dpo_preference": "DPO: the share of pairs whose implicit reward prefers the chosen response, each step's "
    "(solid) and the held-out pairs' at each evaluation (dashed), and the margins between the two rewards (right).",
    "lr": "Applied LR (the schedule times the orchestrator's multiplier, unless something else moved it) against "
    "the schedule alone (dotted).",
    "grad_norm": "Gradient norm before clipping: mean and max over each log interval.",
    "throughput": "Tokens per second (left) and model FLOPs utilization (right, dotted).",
    "memory": "Peak resident memory of the process and, on GPU, the CUDA allocator's peak.",
    "moe_load": "Each expert's share of the routed tokens over the fair share (1 = balanced, 0 = idle).",
    "moe_balance": "The busiest expert's load over the fair share, and the fraction of tokens dropped by capacity.",
    "mod": "Mixture-of-Depths: the share of tokens each routed layer processes, and the causal predictor's accuracy.",
    "chinchilla": "The live planner's fit: the predicted final loss (left) and token progress / convergence (right).",
}


def render(runs: list[RunRecord], healings: list[Healing]) -> str:
    parts = [_summary_table(runs)] if runs else []
    for key, build in figures.FIGURES:
        fig = build(runs) if runs else None
        if fig is not None:
            parts.append(_figure(fig, key, CAPTIONS[key]))
    parts += [_decisions_table(run) for run in runs if run.decisions]
    parts += [_healing(healing, n) for n, healing in enumerate(healings)]
    title = "trimtab report: " + ", ".join([r.name for r in runs] + [str(h.path) for h in healings])
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style>\n{head_scripts()}\n</head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n<p class='note'>written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def _figure(fig: go.Figure, key: str, caption: str) -> str:
    # plotly.js is in the head once; each figure is a div and the call that draws it
    div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{key}", config={"displaylogo": False})
    # drawn once plotly.js is unpacked (plotlyjs.LOADER: a browser that cannot is told so on the page, once)
    start, end = div.index("<script"), div.rindex("</script>")
    body = div[div.index(">", start) + 1 : end]
    draw = f"<script>window.plotlyReady.then(() => {{{body}}}, () => null);</script>"
    div = f"{div[:start]}{draw}{div[end + len('</script>') :]}"
    return f"<div class='figure'><p class='note'>{html.escape(caption)}</p>{div}</div>"


def _table(header: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if j in numeric else ''}>{html.escape(str(c))}</td>" for j, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


SUMMARY = [
    "run",
    "preset",
    "status",
    "steps",
    "tokens",
    "val loss",
    "params",
    "decisions (faults healed)",  # healed counts incidents (rundir.healed), as the runs table's column: not decisions
    "wall",
    "ETTR",
    "Chinchilla",
]


def summary_row(run: RunRecord) -> list[Any]:
    s = run.summary or {}
    last = run.train[-1] if run.train else {}
    steps = s.get("step", last.get("step"))
    total = s.get("total_steps")
    tokens = s.get("tokens", last.get("tokens"))
    loss = val_loss(run)
    params = s.get("params")
    wall = run_wall(run.goodput, s)  # every session's, as the ETTR beside it and `trimtab runs`: not the last one's
    kept = [d for d in run.decisions if not d.get("abandoned")]
    gone = len(run.decisions) - len(kept)
    return [
        run.name,
        run.preset or "-",
        run.detail if run.status != "completed" and run.detail else run.status,
        f"{steps}/{total}" if steps is not None and total else steps if steps is not None else "-",
        f"{tokens:,}" if isinstance(tokens, int) else "-",
        f"{loss:.4f}" if loss is not None else "-",
        f"{params:,}" if isinstance(params, int) else "-",
        f"{sum(not is_note(d) for d in kept)} ({healed(kept)})" + (f", {gone} abandoned" if gone else ""),
        f"{wall:.0f} s" if finite(wall) is not None else "-",
        f"{run.goodput['ettr']:.1%}" if run.goodput and run.goodput.get("ettr") is not None else "-",
        _chinchilla(run),
    ]


def _chinchilla(run: RunRecord) -> str:
    if not run.plan:
        return "-"
    p = run.plan[-1]
    return f"step {p.get('step')}: {p.get('phase')}, {p.get('recommendation')} ({p.get('recommended_steps')} steps)"


def _summary_table(runs: list[RunRecord]) -> str:
    notes = []
    for run in runs:
        gone = sum(1 for m in run.lines if m.get("abandoned"))
        if gone:
            notes.append(
                f"{run.name}: {gone} logged line(s) abandoned by rollbacks, drawn dashed apart from the curves."
            )
    paths = "".join(f"<li>{html.escape(r.name)}: {html.escape(str(r.path))}</li>" for r in runs)
    return (
        "<h2>Runs</h2>"
        + _table(SUMMARY, [summary_row(r) for r in runs], numeric={3, 4, 5, 6, 8, 9})
        + f"<ul class='note'>{paths}</ul>"
        + "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)
        + _goodput_table(runs)
    )


GOODPUT = ["productive", "redone", "checkpoint", "evaluation", "hang", "start_up", "other", "down"]


def _goodput_table(runs: list[RunRecord]) -> str:
    """Where each run's wall time went, over every session (docs/resilience.md)."""
    rows = [
        [r.name, g["sessions"], g["incidents"], g["steps_lost"]]
        + [f"{g['seconds'].get(b, 0):.1f} s" for b in GOODPUT]
        + [f"{g['ettr']:.1%}" if g.get("ettr") is not None else "-"]
        for r in runs
        if (g := r.goodput)
    ]
    if not rows:
        return ""
    header = ["run", "sessions", "restarts", "steps lost", *(b.replace("_", "-") for b in GOODPUT), "ETTR"]
    return (
        "<h2>Goodput</h2><p class='note'>Wall time by where it went, over every session; down: from a lost "
        "session's last sign of life to the restart; ETTR: productive / all.</p>"
        + _table(header, rows, numeric=set(range(1, len(header))))
    )


def _decisions_table(run: RunRecord) -> str:
    rows = [
        [
            d.get("step"),
            d.get("rule", ""),
            d.get("action", "") + (" (abandoned)" if d.get("abandoned") else ""),
            d.get("mode", ""),
            d.get("confidence", ""),
            _outcome(d, _outcome_after(run)),
            d.get("summary") or "",
            d.get("reasoning", ""),
        ]
        for d in run.decisions
    ]
    header = ["step", "rule", "action", "mode", "confidence", "outcome", "evidence", "reasoning"]
    gone = sum(1 for d in run.decisions if d.get("abandoned"))
    note = (
        f"<p class='note'>{gone} of {len(run.decisions)} marked (abandoned): a rollback or a resume threw them "
        "away; they are not in effect and not counted in the runs table.</p>"
        if gone
        else ""
    )
    standing = standing_advice(run.decisions)  # folded into its first row (seen_again): said apart
    if standing:
        listed = "".join(f"<li>{html.escape(advice_line(d))}</li>" for d in standing)
        note += f"<p class='note'>Advice standing at the end, not applied ({len(standing)}):</p><ul>{listed}</ul>"
    return f"<h2>Decisions: {html.escape(run.name)}</h2>" + note + _table(header, rows)


def _outcome_after(run: RunRecord) -> int | None:
    """orchestrator.outcome_after of the run's config: the steps a decision's outcome is judged on."""
    section = run.config.get("orchestrator")
    value = section.get("outcome_after") if isinstance(section, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _outcome(d: dict[str, Any], after: int | None) -> str:
    """The journal's result, with what it rests on when that is less than it says: judged early ("too
    early"; an older run's journal said "recovered" 1 step after an RL rule's decision, the trouble
    still there), or cut
    off by a rollback (a skipped step's "not recovered" is the branch the rollback threw away)."""
    outcome = d.get("outcome") or {}
    text = outcome_result(d)
    steps = outcome.get("steps")
    if (
        after
        and isinstance(steps, int)
        and steps < after
        and "loss_after" in outcome
        and not outcome.get("rolled_back")
    ):
        text += f" (on {steps} of the {after} steps it is judged on: the run ended first)"
    found = outcome.get("found_after")
    if outcome.get("result") == "continued":  # a restart on fewer ranks: no fault healed, the job went on without them
        lost = f"{outcome.get('steps_lost')} steps lost, {outcome.get('down_s')} s down"
        text += f" on {outcome.get('world_after')} of {outcome.get('world_before')} ranks ({lost})"
    if text == "not recovered" and isinstance(found, list) and found:  # the findings that said it was back
        text += f" (the trouble back: {', '.join(str(f).replace('@', ' at step ') for f in found)})"
    if outcome.get("rolled_back"):
        text += " (judged on the branch a rollback then threw away)"
    if outcome.get("weights_kept"):  # a full disk's stop: the weights alone, a new run's train.init_from
        text += f" (its weights alone kept in {outcome['weights_kept']}: not a resume point)"
    evidence = d.get("evidence") or {}
    again = evidence.get("seen_again")
    if d.get("mode") == "advise" and again:  # the same advice again, counted on this row
        text += f" (advised {again + 1} times, last at step {evidence.get('last_seen_at')})"
    elif again:  # the same trouble again, answered the same way (a disk incident's saves out of space)
        text += f" (came back {counted(again, 'time')}, last at step {evidence.get('last_seen_at')})"
    if evidence.get("made_room"):  # a disk incident's later saves, made room for before they wrote (saves.py)
        freed = f", deleting {counted(evidence.get('freed', 0), 'older checkpoint')}" if "freed" in evidence else ""
        text += f" (room made before {counted(evidence['made_room'], 'later save')}{freed})"
    return text


def _healing(healing: Healing, n: int) -> str:
    results = healing.results
    about = ", ".join(
        f"{k} {results[k]}" for k in ("date", "preset", "steps", "clean_val_loss", "machine", "code") if k in results
    )
    # the verdicts are written for BENCHMARKS.md: its **bold** marks are left out here
    verdicts = "".join(f"<li>{html.escape(str(v).replace('**', ''))}</li>" for v in results.get("verdicts") or [])
    fig = curves(healing)
    return (
        f"<h2>Healing benchmark: {html.escape(str(healing.path))}</h2><p class='note'>{html.escape(about)}</p>"
        + _table(HEADER, table_rows(healing))
        + (f"<ul>{verdicts}</ul>" if verdicts else "")
        + (_figure(fig, f"healing-{n}", "Train loss of each scenario.") if fig else "")
    )
