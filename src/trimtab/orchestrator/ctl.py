"""`trimtab ctl RUN_DIR ACTION [ARGS]`: a person acts on a running job.

The command drops one JSON file into RUN_DIR/control/ (written atomically); the job picks it up at
its next metrics read, applies it through the same Control surface the orchestrator uses, and
journals it as a manual decision. A command the job cannot apply is answered in a `.error` file.
A run that is not running (training/runlock.py: no lock held, no fresh heartbeat) gets nothing,
since the command would fire unnoticed whenever it next resumes, unless it is queued on purpose.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trimtab.config.orchestrator import MODES, OrchestratorConfig
from trimtab.errors import ConfigError, RunStateError
from trimtab.training.runlock import liveness

# CLI verb -> (action, parameter names in order, their types, how many are required)
VERBS: dict[str, tuple[str, tuple[str, ...], tuple[type, ...], int]] = {
    "skip-step": ("skip_step", (), (), 0),
    "scale-lr": ("scale_lr", ("factor",), (float,), 1),
    "set-lr": ("set_lr", ("value",), (float,), 1),
    "emergency-lr": ("emergency_lr_reduction", ("factor",), (float,), 0),
    "rollback": ("rollback", ("to",), (str,), 0),
    "micro-batch": ("adjust_batch_size", ("micro_batch_tokens",), (int,), 1),
    "grad-clip": ("adjust_grad_clip", ("value",), (float,), 1),
    "weight-decay": ("adjust_weight_decay", ("value",), (float,), 1),
    "checkpoint": ("save_checkpoint", (), (), 0),
    "stop": ("stop", ("reason",), (str,), 0),
    "add-expert": ("add_expert", ("layer", "source"), (int, int), 1),
    "prune-expert": ("prune_expert", ("layer", "expert"), (int, int), 2),
    "reinit-expert": ("reinit_expert", ("layer", "expert"), (int, int), 2),
    "reset-router": ("reset_router", ("layer", "expert"), (int, int), 2),
    "capacity-factor": ("adjust_capacity_factor", ("value", "layer"), (float, int), 1),
    "router-temperature": ("adjust_routing_temperature", ("value", "layer"), (float, int), 1),
    "balance-coef": ("adjust_balance_coefficient", ("value", "layer"), (float, int), 1),
    "mod-capacity": ("adjust_mod_capacity", ("value", "layer"), (float, int), 1),
    "total-steps": ("set_total_steps", ("steps",), (int,), 1),
    "pause-rule": ("pause_rule", ("rule",), (str,), 1),
    "resume-rule": ("resume_rule", ("rule",), (str,), 1),
    "mode": ("set_mode", ("mode",), (str,), 1),
}
RULE_NAMES = ("nonfinite", *OrchestratorConfig.RULES)


def parse_command(verb: str, args: list[str]) -> dict[str, Any]:
    """CLI words -> {"action": ..., "params": {...}}, with errors that name the fix."""
    if verb not in VERBS:
        raise ConfigError(f"unknown ctl action '{verb}'; one of {', '.join(VERBS)}")
    action, names, types, required = VERBS[verb]
    if not required <= len(args) <= len(names):
        usage = " ".join(n.upper() if i < required else f"[{n.upper()}]" for i, n in enumerate(names))
        raise ConfigError(f"usage: trimtab ctl RUN_DIR {verb} {usage}".rstrip())
    params: dict[str, Any] = {}
    for name, kind, raw in zip(names, types, args):
        try:
            params[name] = kind(raw)
        except ValueError:
            raise ConfigError(f"ctl {verb}: {name.upper()} must be a {kind.__name__}, got '{raw}'") from None
    if action == "rollback" and "to" in params and params["to"] != "last_good":
        if not params["to"].isdigit():
            raise ConfigError("ctl rollback: give a step number or nothing (the last good checkpoint)")
        params["to"] = int(params["to"])
    if action in ("pause_rule", "resume_rule") and params["rule"] not in RULE_NAMES:
        raise ConfigError(f"unknown rule '{params['rule']}'; one of {', '.join(RULE_NAMES)}")
    if action == "set_mode" and params["mode"] not in MODES:
        raise ConfigError(f"unknown mode '{params['mode']}'; one of {', '.join(MODES)}")
    return {"action": action, "params": params}


def send(run_dir: str | Path, command: dict[str, Any], queue: bool = False) -> Path:
    """Drop a command for the job in run_dir; returns the file written. Refuses when the run is not
    running, unless `queue` (the command then applies when the run next resumes)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (no config.yaml); pass the --out of a run")
    running, evidence = liveness(run_dir)
    if not running and not queue:
        raise RunStateError(
            f"'{run_dir}' is not running ({evidence}); nothing was sent. Pass --queue (queue=True in Python) "
            "to have the command applied when it next resumes"
        )
    inbox = run_dir / "control"
    inbox.mkdir(exist_ok=True)
    path = inbox / f"{time.time_ns()}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(command))
    os.replace(tmp, path)
    return path


def take_commands(run_dir: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """Commands waiting in run_dir/control, oldest first, removed as they are taken; a file that
    does not parse comes back as (name, None)."""
    inbox = Path(run_dir) / "control"
    if not inbox.is_dir():
        return []
    out = []
    for path in sorted(inbox.glob("*.json")):
        try:
            command = json.loads(path.read_text())
            ok = isinstance(command, dict) and "action" in command
        except (OSError, ValueError):
            command, ok = None, False
        path.unlink(missing_ok=True)
        out.append((path.name, command if ok else None))
    return out


def answer(run_dir: Path, name: str, message: str) -> None:
    (Path(run_dir) / "control" / f"{Path(name).stem}.error").write_text(message + "\n")
