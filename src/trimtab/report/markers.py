"""The orchestrator's decisions on the report's curves: one marker per decision, on the kept curve
at its step, the journal line in its hover; and the x axis they share with every plot (tokens at a
step, report/figures.py).
"""

from __future__ import annotations

import html
import json
import re
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from trimtab.report.run import RunRecord, finite, outcome_result

ACTION_COLOURS = qualitative.Dark24
ABANDONED_DECISIONS = "decisions abandoned (not in effect)"


def tokens_of(run: RunRecord) -> Callable[[float], float]:
    """Tokens at a step, from the training lines (kept ones win), linear between logged steps:
    evaluation lines and decisions carry only the step."""
    known: dict[int, float] = {}
    for m in run.lines:
        if "tokens" in m and (m["step"] not in known or not m.get("abandoned")):
            known[m["step"]] = float(m["tokens"])
    steps = sorted(known)
    if not steps:
        return lambda step: float(step)

    def at(step: float) -> float:
        i = bisect_left(steps, step)
        if i < len(steps) and steps[i] == step:
            return known[steps[i]]
        lo, hi = steps[max(0, min(i - 1, len(steps) - 2))], steps[min(i, len(steps) - 1)]
        if lo == hi:  # one logged step: tokens proportional to steps
            return known[lo] * step / lo if lo else 0.0
        return known[lo] + (known[hi] - known[lo]) * (step - lo) / (hi - lo)

    return at


def decisions(runs: list[RunRecord], key: str = "loss") -> list[go.Scatter]:
    """The orchestrator's decisions as markers on each run's curve of `key` (the loss; RL's
    reward), one colour per action, the journal line in the hover. Those a rollback or a resume
    abandoned (rundir's `abandoned` mark) are not in effect: one faded trace of open markers apart,
    so a re-applied decision at the same step is not drawn as two live ones."""
    by_action: dict[str, tuple[list[float], list[float | None], list[str]]] = {}
    gone: tuple[list[float], list[float | None], list[str]] = ([], [], [])
    for run in runs:
        at, on_curve = tokens_of(run), _value_at(run, key)
        spot: dict[tuple[int, bool], list[dict[str, Any]]] = {}  # decisions drawn at one point
        for d in run.decisions:
            spot.setdefault((d["step"], bool(d.get("abandoned"))), []).append(d)
        for d in run.decisions:
            xs, ys, texts = (
                gone if d.get("abandoned") else by_action.setdefault(str(d.get("action", "none")), ([], [], []))
            )
            xs.append(at(d["step"]))
            ys.append(on_curve(d["step"]))
            texts.append(_hover(run, d) + _same_spot(d, spot[d["step"], bool(d.get("abandoned"))]))
    traces = [
        _markers(xs, ys, texts, f"decision: {action}", ACTION_COLOURS[j % len(ACTION_COLOURS)], "diamond")
        for j, (action, (xs, ys, texts)) in enumerate(sorted(by_action.items()))
    ]
    if gone[0]:
        traces.append(_markers(*gone, ABANDONED_DECISIONS, "grey", "diamond-open", opacity=0.5))
    return traces


def _markers(
    xs: list[float], ys: list[float | None], texts: list[str], name: str, colour: str, symbol: str, opacity: float = 1.0
) -> go.Scatter:
    return go.Scatter(
        x=xs,
        y=ys,
        name=name,
        mode="markers",
        marker={"symbol": symbol, "size": 13, "color": colour, "line": {"width": 1}},
        opacity=opacity,
        hovertext=texts,
        hoverinfo="text",
        legendgroup="decisions",
    )


def _value_at(run: RunRecord, key: str) -> Callable[[int], float | None]:
    """Where a decision's marker sits on the kept curve of `key`: on the line between the two
    logged steps around it (a decision is rarely at a logged step: with train.log_every 5 the
    markers sat at a neighbour's height, off the line), else, next to a gap (a NaN), at the finite
    logged step nearest it (a decision's own step is often the NaN)."""
    logged = {m["step"]: finite(m[key]) for m in run.lines if key in m and not m.get("abandoned")}
    steps = sorted(logged)
    points = [(s, logged[s]) for s in steps if logged[s] is not None]
    if not points:
        return lambda step: None

    def at(step: int) -> float | None:
        i = bisect_left(steps, step)
        if 0 < i < len(steps) and steps[i] != step:
            (lo, a), (hi, b) = (steps[i - 1], logged[steps[i - 1]]), (steps[i], logged[steps[i]])
            if a is not None and b is not None:  # the drawn line joins them
                return a + (b - a) * (step - lo) / (hi - lo)
        return min(points, key=lambda p: (abs(p[0] - step), p[0]))[1]

    return at


def _hover(run: RunRecord, d: dict[str, Any]) -> str:
    outcome = d.get("outcome") or {}
    params = json.dumps(d.get("params") or {}, default=str)
    rows = [
        f"<b>{run.name}: step {d.get('step')} {d.get('rule', '')}</b>",
        f"action: {d.get('action')} {params if params != '{}' else ''} ({d.get('mode', '')})",
        f"confidence: {d.get('confidence')}",
        f"evidence: {_short(json.dumps(d.get('evidence') or {}, default=str))}",
        f"reasoning: {_short(str(d.get('reasoning', '')))}",
        f"applied: {_short('; '.join(map(str, d.get('applied') or [])))}",
        f"outcome: {_short(outcome_result(d))} {_short(json.dumps(outcome, default=str)) if outcome else ''}",
    ]
    if d.get("abandoned"):
        rows.append("abandoned: a rollback or a resume threw it away; not in effect")
    return "<br>".join(rows)


def _same_spot(d: dict[str, Any], there: list[dict[str, Any]]) -> str:
    """The other decisions at this marker's step: their markers sit on one point and hover shows the
    top one alone (an out-of-memory fix and a person's `trimtab ctl` at step 50: the LR cut was hidden)."""
    others = [o for o in there if o is not d]
    if not others:
        return ""
    said = "; ".join(f"{o.get('rule', '')} -> {o.get('action')} ({o.get('mode', '')})" for o in others)
    return f"<br><b>also at step {d.get('step')}</b> (markers on one point): {_short(said)}"


def _short(text: str, width: int = 90, limit: int = 400) -> str:
    """Escaped for the hover box, cut to `limit` characters and wrapped at `width`. Quotes stay:
    plotly's hover decodes &lt; &gt; &amp; and numeric entities but not &quot;, which every JSON
    evidence showed literally."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    chunks = re.findall(rf".{{1,{width}}}(?:\s|$)|.{{1,{width}}}", text)
    return "<br>   ".join(html.escape(c.strip(), quote=False) for c in chunks)
