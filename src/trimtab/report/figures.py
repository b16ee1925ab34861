"""The report's plots: plotly figures built from runs read off disk (report/run.py: RunRecord).

Every builder takes the runs to overlay (one colour per run) and returns a figure, or None when no
run has the data (a dense run has no MoE heatmap): a plot is never shown empty. The x axis is
tokens, so runs with different batch sizes line up. Lines a rollback abandoned are drawn apart,
faded and dashed, never joined into the kept curve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from trimtab.report.markers import decisions, tokens_of
from trimtab.report.run import RunRecord, finite

RUN_COLOURS = qualitative.Plotly
ABANDONED_LABEL = "abandoned (rolled back)"
LAYOUT = {
    "template": "plotly_white",
    "height": 380,
    "margin": {"l": 60, "r": 30, "t": 50, "b": 50},
    "hovermode": "closest",
}


def colour(i: int) -> str:
    return RUN_COLOURS[i % len(RUN_COLOURS)]


def _fig(title: str, ytitle: str, **layout: Any) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title="tokens", yaxis_title=ytitle, **{**LAYOUT, **layout})
    return fig


def _has_data(fig: go.Figure) -> bool:
    """Whether some trace has a point to draw (a figure with none is left out of the page)."""
    for trace in fig.data:
        values = getattr(trace, "z", None) if trace.type == "heatmap" else getattr(trace, "y", None)
        if values is not None and any(v is not None for v in _flat(values)):
            return True
    return False


def _flat(values: Any) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out


def _or_none(fig: go.Figure) -> go.Figure | None:
    return fig if _has_data(fig) else None


def _logged(runs: list[RunRecord], prefix: str) -> bool:
    """Whether some run logged a metric under `prefix` (rl/, dpo/, moe/, mod/): a figure no run has
    data for is not built (plotly's figure and layout objects cost 0.1-0.4 s each, most of a page)."""
    return any(k.startswith(prefix) for run in runs for m in run.lines for k in m)


def _segments(
    run: RunRecord, key: str, f: Callable[[dict[str, Any]], Any] | None = None
) -> tuple[list[float | None], list[float | None]]:
    """The abandoned stretches of `key` as one trace with gaps (None) between stretches; each
    starts at the kept point it branched from, so the reader sees where the rollback went back."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    at, last_kept, inside = tokens_of(run), None, False
    value = f or (lambda m: m[key])
    for m in run.lines:
        if key not in m:
            continue
        if not m.get("abandoned"):
            last_kept, inside = m, False
            continue
        if not inside:
            if xs:
                xs.append(None), ys.append(None)
            if last_kept is not None and last_kept["step"] < m["step"]:
                xs.append(at(last_kept["step"])), ys.append(finite(value(last_kept)))
            inside = True
        xs.append(at(m["step"])), ys.append(finite(value(m)))
    return xs, ys


def _kept(run: RunRecord, key: str, f: Callable[[dict[str, Any]], Any] | None = None) -> tuple[list[float], list[Any]]:
    at = tokens_of(run)
    lines = [m for m in run.lines if key in m and not m.get("abandoned")]
    return [at(m["step"]) for m in lines], [finite(f(m) if f else m[key]) for m in lines]


def _line(
    fig: go.Figure, run: RunRecord, i: int, key: str, label: str = "", cell: dict[str, int] | None = None, **kw: Any
) -> None:
    """The kept curve of `key`, and its abandoned stretches apart from it (`cell`: row and col
    of a subplot)."""
    f = kw.pop("value", None)
    xs, ys = _kept(run, key, f)
    name = f"{run.name} {label}".strip()
    style = {"color": colour(i), **kw.pop("line", {})}
    fig.add_trace(
        go.Scatter(x=xs, y=ys, name=name, mode="lines", line=style, legendgroup=run.name, **kw), **(cell or {})
    )
    ax, ay = _segments(run, key, f)
    if any(y is not None for y in ay):
        fig.add_trace(
            go.Scatter(
                x=ax,
                y=ay,
                name=f"{name} {ABANDONED_LABEL}",
                mode="lines+markers",
                line={**style, "dash": "dash"},
                marker={"size": 5},
                opacity=0.4,
                legendgroup=run.name,
                **kw,
            ),
            **(cell or {}),
        )


# ------------------------------------------------------------------ figures


def loss(runs: list[RunRecord]) -> go.Figure | None:
    fig = _fig("Loss", "loss (nats/token)")
    for i, run in enumerate(runs):
        _line(fig, run, i, "loss", "train")
        xs, ys = _kept(run, "val_loss")
        if xs:
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    name=f"{run.name} validation",
                    mode="lines+markers",
                    line={"color": colour(i), "dash": "dot", "width": 3},
                    legendgroup=run.name,
                )
            )
    for trace in decisions(runs):
        fig.add_trace(trace)
    return _or_none(fig)


def learning_rate(runs: list[RunRecord]) -> go.Figure | None:
    """Applied LR (what the optimizer used: the schedule times the orchestrator's multiplier)
    against the schedule alone."""
    fig = _fig("Learning rate: scheduled vs applied", "learning rate")
    for i, run in enumerate(runs):
        _line(fig, run, i, "lr", "applied")
        _line(fig, run, i, "lr", "scheduled", value=_scheduled, line={"dash": "dot", "width": 1})
    return _or_none(fig)


def _scheduled(m: dict[str, Any]) -> float | None:
    """The schedule's LR as logged; lr / lr_scale for older runs (a schedule 10x the real one once
    the orchestrator cut an LR something else raised: lr_spike@45:10)."""
    if "lr_scheduled" in m:
        return m["lr_scheduled"]
    return m["lr"] / m["lr_scale"] if m.get("lr_scale") else None


def grad_norm(runs: list[RunRecord]) -> go.Figure | None:
    fig = _fig("Gradient norm", "gradient norm", yaxis_type="log")
    for i, run in enumerate(runs):
        _line(fig, run, i, "grad_norm", "mean over the log interval")
        _line(fig, run, i, "grad_norm_max", "max over the log interval", line={"dash": "dot", "width": 1})
    return _or_none(fig)


def throughput(runs: list[RunRecord]) -> go.Figure | None:
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(title="Throughput: tokens/s and MFU", xaxis_title="tokens", **LAYOUT)
    fig.update_yaxes(title_text="tokens/s", secondary_y=False)
    fig.update_yaxes(title_text="MFU (% of peak)", secondary_y=True)
    for i, run in enumerate(runs):
        xs, ys = _kept(run, "tokens_per_s")
        fig.add_trace(go.Scatter(x=xs, y=ys, name=f"{run.name} tokens/s", line={"color": colour(i)}), secondary_y=False)
        xs, ys = _kept(run, "mfu", lambda m: m["mfu"] * 100 if finite(m["mfu"]) is not None else None)
        if xs:
            trace = go.Scatter(x=xs, y=ys, name=f"{run.name} MFU %", line={"color": colour(i), "dash": "dot"})
            fig.add_trace(trace, secondary_y=True)
    return _or_none(fig)


def memory(runs: list[RunRecord]) -> go.Figure | None:
    """Every *_mb key of the log lines: peak resident memory, and the CUDA allocator's on GPU."""
    fig = _fig("Memory", "MiB")
    dashes = ["solid", "dot", "dash", "dashdot", "longdash"]
    for i, run in enumerate(runs):
        keys = sorted({k for m in run.train for k in m if k.endswith("_mb")})
        for j, key in enumerate(keys):
            _line(fig, run, i, key, key.removesuffix("_mb"), line={"dash": dashes[j % len(dashes)]})
    return _or_none(fig)


def _layers(run: RunRecord, prefix: str, suffix: str) -> list[str]:
    """Layer numbers that have `prefix/N/suffix` keys, in layer order."""
    found = {k.split("/")[1] for m in run.train for k in m if k.startswith(prefix + "/") and k.endswith("/" + suffix)}
    return sorted(found, key=int)


def moe_load(runs: list[RunRecord]) -> go.Figure | None:
    """Each MoE layer's load per expert over training: the expert's share of the assignments over
    the fair share (1 = balanced, 0 = idle)."""
    panels = [(run, layer) for run in runs for layer in _layers(run, "moe", "tokens_per_expert")]
    if not panels:
        return None
    titles = [f"{run.name}: MoE layer {layer}" for run, layer in panels]
    fig = make_subplots(rows=len(panels), cols=1, subplot_titles=titles, vertical_spacing=0.25 / len(panels))
    for row, (run, layer) in enumerate(panels, start=1):
        key = f"moe/{layer}/tokens_per_expert"
        lines, at = [m for m in run.train if key in m], tokens_of(run)
        xs, counts = [at(m["step"]) for m in lines], [m[key] for m in lines]
        n = max(len(c) for c in counts)
        z = [[c[e] / (sum(c) or 1) * len(c) if e < len(c) else None for c in counts] for e in range(n)]
        fig.add_trace(
            go.Heatmap(
                x=xs,
                y=list(range(n)),
                z=z,
                coloraxis="coloraxis",
                hovertemplate="tokens %{x}<br>expert %{y}<br>load %{z:.2f} x fair<extra></extra>",
            ),
            row=row,
            col=1,
        )
        fig.update_yaxes(title_text="expert", row=row, col=1)
    fig.update_xaxes(title_text="tokens", row=len(panels), col=1)
    layout = {**LAYOUT, "height": 120 + 220 * len(panels)}
    fig.update_layout(
        title="MoE load per expert", coloraxis={"colorscale": "Viridis", "colorbar": {"title": "x fair"}}, **layout
    )
    return _or_none(fig)


def moe_balance(runs: list[RunRecord]) -> go.Figure | None:
    if not _logged(runs, "moe/"):
        return None
    fig = _fig("MoE balance: busiest expert's load and dropped tokens", "x fair share / fraction")
    dashes = ["solid", "dot", "dash", "dashdot"]
    for i, run in enumerate(runs):
        for j, layer in enumerate(_layers(run, "moe", "max_load")):
            _line(fig, run, i, f"moe/{layer}/max_load", f"layer {layer} max load", line={"dash": dashes[j % 4]})
            _line(
                fig, run, i, f"moe/{layer}/dropped", f"layer {layer} dropped", line={"dash": dashes[j % 4], "width": 1}
            )
    return _or_none(fig)


def mod(runs: list[RunRecord]) -> go.Figure | None:
    """Mixture-of-Depths: each layer's capacity (share of tokens through the block) and the
    causal predictor's accuracy (how well generation can guess the router's choice)."""
    if not _logged(runs, "mod/"):
        return None
    panels = ("capacity", "predictor_acc")
    fig = make_subplots(rows=2, cols=1, subplot_titles=["capacity", "predictor accuracy"], shared_xaxes=True)
    fig.update_layout(title="Mixture-of-Depths", **{**LAYOUT, "height": 560})
    dashes = ["solid", "dot", "dash", "dashdot"]
    for i, run in enumerate(runs):
        for j, layer in enumerate(_layers(run, "mod", "capacity")):
            for row, what in enumerate(panels, start=1):
                xs, ys = _kept(run, f"mod/{layer}/{what}")
                name = f"{run.name} layer {layer} {what}"
                trace = go.Scatter(x=xs, y=ys, name=name, line={"color": colour(i), "dash": dashes[j % 4]})
                fig.add_trace(trace, row=row, col=1)
    fig.update_xaxes(title_text="tokens", row=2, col=1)
    return _or_none(fig)


def chinchilla(runs: list[RunRecord]) -> go.Figure | None:
    """The live planner's status blocks (plan_status.jsonl): the loss its fit predicts at the
    planned end and at the longest allowed run, and the share of the planned tokens seen."""
    if not any(run.plan for run in runs):
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(title="Chinchilla status (live planner)", xaxis_title="tokens", **LAYOUT)
    fig.update_yaxes(title_text="predicted loss", secondary_y=False)
    fig.update_yaxes(title_text="progress (0-1)", secondary_y=True, range=[0, 1.05])
    for i, run in enumerate(runs):
        if not run.plan:
            continue
        xs = [p["tokens"] for p in run.plan]
        series = (("loss_end", "predicted at the planned end", "solid"), ("loss_best", "at the longest run", "dash"))
        for key, label, dash in series:
            ys = [finite(p.get(key)) for p in run.plan]
            trace = go.Scatter(x=xs, y=ys, name=f"{run.name} {label}", line={"color": colour(i), "dash": dash})
            fig.add_trace(trace, secondary_y=False)
        hover = [
            f"phase {p.get('phase')}, {p.get('recommendation')} ({p.get('recommended_steps')} steps)" for p in run.plan
        ]
        for key, dash in (("token_progress", "dot"), ("convergence", "dashdot")):
            ys = [finite(p.get(key)) for p in run.plan]
            trace = go.Scatter(
                x=xs,
                y=ys,
                name=f"{run.name} {key.replace('_', ' ')}",
                text=hover,
                line={"color": colour(i), "dash": dash, "width": 1},
            )
            fig.add_trace(trace, secondary_y=True)
    return _or_none(fig)


def rl_reward(runs: list[RunRecord]) -> go.Figure | None:
    """RL runs: the training reward (each step's, over every group drawn), the held-out reward
    and pass@1 at each evaluation, and the orchestrator's decisions on the training reward."""
    if not _logged(runs, "rl/"):
        return None
    fig = _fig("RL reward", "reward, pass@1")
    for i, run in enumerate(runs):
        _line(fig, run, i, "rl/reward", "train reward")
        for key, label, dash in (
            ("rl/held_out_reward", "held-out reward", "dot"),
            ("rl/held_out_pass@1", "held-out pass@1", "dash"),
        ):
            xs, ys = _kept(run, key)
            if xs:
                line = {"color": colour(i), "dash": dash, "width": 2}
                fig.add_trace(
                    go.Scatter(
                        x=xs, y=ys, name=f"{run.name} {label}", mode="lines+markers", line=line, legendgroup=run.name
                    )
                )
    if not _has_data(fig):
        return None
    for trace in decisions([run for run in runs if any("rl/reward" in m for m in run.lines)], key="rl/reward"):
        fig.add_trace(trace)
    return fig


# what RL's rules read (orchestrator/rl_health.py): shares of a step, left axis
RL_SHARES = (
    ("rl/zero_variance_groups", "flat groups", "solid"),
    ("rl/solved_groups", "solved (flat at rl.full_reward)", "4px,2px"),
    ("rl/truncated", "cut at the budget", "dash"),
    ("rl/clip_fraction", "clipped", "dot"),
    ("rl/off_policy", "off the clip range", "dashdot"),
)


def rl_signals(runs: list[RunRecord]) -> go.Figure | None:
    """RL runs: the shares RL's rules read (flat groups and the solved ones among them, responses
    cut at the budget, clipped and off-policy tokens) and, on the right, the sampled tokens'
    entropy and the rollouts' staleness."""
    if not _logged(runs, "rl/"):
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(title="RL: what the rules read", xaxis_title="tokens", **LAYOUT)
    fig.update_yaxes(title_text="share of the step (0-1)", secondary_y=False)
    fig.update_yaxes(title_text="entropy (nats/token), staleness (steps)", secondary_y=True)
    right = (("rl/entropy", "entropy", "longdash"), ("rl/staleness", "staleness", "longdashdot"))
    for i, run in enumerate(runs):
        for series, secondary in ((RL_SHARES, False), (right, True)):
            for key, label, dash in series:
                xs, ys = _kept(run, key)
                if xs:
                    line = {"color": colour(i), "dash": dash, "width": 1 if secondary else 2}
                    trace = go.Scatter(x=xs, y=ys, name=f"{run.name} {label}", line=line, legendgroup=run.name)
                    fig.add_trace(trace, secondary_y=secondary)
    return _or_none(fig)


def dpo_preference(runs: list[RunRecord]) -> go.Figure | None:
    """DPO runs: the share of pairs whose implicit reward prefers the chosen response, each
    step's and the held-out pairs' at each evaluation (left), and their margins (right)."""
    if not _logged(runs, "dpo/"):
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(title="DPO: preference", xaxis_title="tokens", **LAYOUT)
    fig.update_yaxes(title_text="accuracy (share of pairs)", secondary_y=False)
    fig.update_yaxes(title_text="margin r(chosen) - r(rejected)", secondary_y=True)
    series = (
        ("dpo/accuracy", "train accuracy", "solid", False),
        ("dpo/held_out_accuracy", "held-out accuracy", "dash", False),
        ("dpo/margin", "train margin", "dot", True),
        ("dpo/held_out_margin", "held-out margin", "dashdot", True),
    )
    for i, run in enumerate(runs):
        for key, label, dash, secondary in series:
            xs, ys = _kept(run, key)
            if xs:
                line = {"color": colour(i), "dash": dash, "width": 1 if secondary else 2}
                mode = "lines+markers" if "held_out" in key else "lines"
                trace = go.Scatter(x=xs, y=ys, name=f"{run.name} {label}", mode=mode, line=line, legendgroup=run.name)
                fig.add_trace(trace, secondary_y=secondary)
    return _or_none(fig)


# (title, builder) in page order
FIGURES: list[tuple[str, Callable[[list[RunRecord]], go.Figure | None]]] = [
    ("loss", loss),
    ("rl_reward", rl_reward),
    ("rl_signals", rl_signals),
    ("dpo_preference", dpo_preference),
    ("lr", learning_rate),
    ("grad_norm", grad_norm),
    ("throughput", throughput),
    ("memory", memory),
    ("moe_load", moe_load),
    ("moe_balance", moe_balance),
    ("mod", mod),
    ("chinchilla", chinchilla),
]
