"""What a study leaves in its directory: trials.csv (every trial), best.yaml (the best trial's
resolved config, ready for `trimtab train`) and the summary printed at the end."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from trimtab.config import dump_yaml
from trimtab.tune.space import Space

COLUMNS = ("number", "state", "values", "params", "run_dir", "status", "decisions", "faults_healed", "note")


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        note = attrs.get("pruned_reason") or attrs.get("error") or attrs.get("interrupted") or attrs.get("lost") or ""
        if "surplus" in attrs:
            note = "surplus claim (the study had its trials): not run"
        if "rerun_of" in attrs:
            note = f"re-run of trial {attrs['rerun_of']}" + (f"; {note}" if note else "")
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "values": " ".join(f"{v:.6g}" for v in t.values or []),
                "params": " ".join(f"{k}={_fmt(v)}" for k, v in sorted(t.params.items())),
                "run_dir": attrs.get("run_dir", ""),
                "status": attrs.get("status", ""),
                "decisions": attrs.get("decisions", ""),
                "faults_healed": attrs.get("faults_healed", ""),
                "note": note,
            }
        )
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The best trial (one objective) or the Pareto front, lowest first objective first."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if _finite(t)]
    if not done:
        return []
    if len(study.directions) == 1:
        return [min(done, key=lambda t: t.values[0])]
    return sorted(study.best_trials, key=lambda t: t.values)


def _finite(t: FrozenTrial) -> bool:
    return all(v is not None and math.isfinite(v) for v in t.values or [])


def write_best(trial: FrozenTrial, space: Space, directory: Path) -> Path:
    """best.yaml: the trial's whole resolved config, trained into STUDY_DIR/best (not the trial's
    own directory, which `trimtab train` would resume); injected faults are left out."""
    config = dict(trial.user_attrs["config"])
    config["out"] = str(directory / "best")
    config["faults"] = []
    stored = config.get("checkpoint", {}).get("dir")
    if stored:  # the trial's own prefix (tune/space.py) would resume the trial: best's, beside it
        config["checkpoint"] = {**config["checkpoint"], "dir": f"{stored.rstrip('/').rsplit('/', 1)[0]}/best"}
    values = ", ".join(f"{v:.6g}" for v in trial.values)
    head = (
        f"# best trial {trial.number} of study '{space.name}' ({', '.join(space.objectives)}: {values})\n"
        f"# its run: {trial.user_attrs.get('run_dir')}; train it: trimtab train {directory / 'best.yaml'}"
        " --max-steps N\n"
    )
    note = lr_note(trial)
    head += f"# {note}\n" if note else ""
    path = directory / "best.yaml"
    path.write_text(head + dump_yaml(config))
    return path


def lr_note(trial: FrozenTrial) -> str:
    """Said of a best trial whose LR the orchestrator cut for good (an LR far too high, healed): its
    objective is that of the lower LR, not of the optim.lr sampled, which best.yaml keeps."""
    scale = trial.user_attrs.get("lr_scale", 1.0)
    lr = trial.user_attrs.get("config", {}).get("optim", {}).get("lr")
    if lr is None or math.isclose(scale, 1.0, rel_tol=1e-6):
        return ""
    return (
        f"its LR multiplier ended at x{scale:.3g} (the orchestrator's decisions.jsonl there): it finished at an"
        f" effective optim.lr {lr * scale:.4g}, not the {lr:.4g} sampled and kept in best.yaml, which trains"
        " as well only with the same healing"
    )


def write_outputs(study: optuna.Study, space: Space, directory: Path) -> str:
    """trials.csv and best.yaml in the study directory; returns the summary to print."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(study)
    with open(directory / "trials.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    best = best_trials(study)
    if best:
        write_best(best[0], space, directory)
    return summary_text(study, space, directory, rows, best)


def summary_text(
    study: optuna.Study, space: Space, directory: Path, rows: list[dict[str, Any]], best: list[FrozenTrial]
) -> str:
    states = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    lines = [
        f"study '{space.name}' ({space.sampler}, pruner {space.pruner}): "
        + ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())),
        f"{'#':>4} {'state':<9} {'values':<22} params",
    ]
    lines += [f"{r['number']:>4} {r['state']:<9} {r['values']:<22} {r['params']}  {r['note']}".rstrip() for r in rows]
    if best:
        label = "best" if len(best) == 1 else f"Pareto front ({len(best)} trials), lowest {space.objectives[0]}"
        b = best[0]
        lines.append(f"{label}: trial {b.number} {b.values} {b.params} -> {directory / 'best.yaml'}")
        lines.append(f"its run: {b.user_attrs.get('run_dir')} (report.html there)")
        note = lr_note(b)
        lines += [note] if note else []
    else:
        lines.append(_no_best(states))
    lines.append(f"trials: {directory / 'trials.csv'}")
    return "\n".join(lines)


def _no_best(states: dict[str, int]) -> str:
    """Said when no trial completed: "yet" only while some trial may still complete; a study whose
    trials all ended pruned or failed has no best.yaml, and the notes above say why."""
    if states.get("RUNNING") or states.get("WAITING"):
        return "no trial completed yet"
    ended = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "no trials"
    return (
        f"no trial completed ({ended}): no best.yaml; the notes above say why each ended"
        " (for an orchestrator that gave up, lower the space's high ends)"
    )
