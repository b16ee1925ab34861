"""`trimtab ctl RUN_DIR ACTION [ARGS]`: a person acts on a running job.

The command drops one JSON file into RUN_DIR/control/ (written atomically); the job picks it up at
its next metrics read, applies it through the same Control surface the orchestrator uses, and
journals it as a manual decision. A command the job cannot apply is answered in a `.error` file.
A run that is not running (trimtab/rundir.py: no lock held, no fresh heartbeat) gets nothing,
since the command would fire unnoticed whenever it next resumes, unless it is queued on purpose.
Nor does one whose last step is done (its final evaluation, save and report still hold the lock):
the job marks its inbox ended (control/.ended), and a command that slipped in after that anyway
(sent as it ended) names the session it was sent to, so the next session answers it, not applies it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trimtab.errors import ConfigError, RunStateError
from trimtab.rundir import newest_step, read_json, read_metrics, read_summary, write_json
from trimtab.runlock import liveness, lock_holder
from trimtab.training.actions import REQUIRED, RL_ONLY, VERBS
from trimtab.words import counted


def parse_command(verb: str, args: list[str]) -> dict[str, Any]:
    """CLI words -> {"action": ..., "params": {...}}, checked against the action table (types and
    bounds), with errors that name the fix."""
    if verb not in VERBS:
        raise ConfigError(f"unknown ctl action '{verb}'; one of {', '.join(VERBS)}")
    action = VERBS[verb]
    names = [p for p in action.params if p.ctl]
    required = sum(p.default is REQUIRED for p in names)
    if not required <= len(args) <= len(names):
        raise ConfigError(f"usage: trimtab ctl RUN_DIR {action.usage()}")
    params = {p.name: p.parse(verb, word) for p, word in zip(names, args)}
    action.check(params, who=f"ctl {verb}")  # types and bounds now; the job fills in the defaults
    return {"action": action.name, "params": params}


# the layer kind an action's `layer` names (actions.py: LAYER, MOE_LAYER)
LAYER_KIND = {"set_mod_capacity": "mod"} | {
    name: "moe"
    for name in ("add_expert", "prune_expert", "reinit_expert", "reset_router")
    + ("set_capacity_factor", "set_router_temperature", "set_balance_coef")
}


def check_against_config(run_dir: Path, command: dict[str, Any]) -> None:
    """A command the run's config.yaml says it cannot apply, refused now (the job would only journal
    it as failed, after the person had gone): a layer not of the kind the action acts on, or no layer
    of that kind at all when none is named (every layer of the kind), naming the layers that are; an
    RL knob on a run that is not `trimtab rl`; an overlong penalty over the whole response budget; a difficulty
    for a task read from a file."""
    action, params = command.get("action"), command.get("params")
    kind = LAYER_KIND.get(action)
    if not isinstance(params, dict) or (kind is None and action not in RL_ONLY):
        return  # not one the config answers, or a malformed one: the job answers it
    layer = params.get("layer")
    if layer is not None and not isinstance(layer, int):
        return
    from trimtab.config import read_saved  # the run's model: which layer is which kind

    cfg = read_saved(run_dir)
    if action in RL_ONLY:
        if not cfg.rl.enabled:
            verb = next((v for v, a in VERBS.items() if a.name == action), action)
            raise ConfigError(
                f"ctl {verb}: a knob of reinforcement learning, and '{run_dir}' is not an RL run (its config.yaml "
                "has rl.enabled false); it applies to runs of `trimtab rl`"
            )
        if action == "set_rl_difficulty" and not cfg.rl.prompts.startswith("builtin:arithmetic"):
            raise ConfigError(  # the job refuses it too (rl/curriculum.py), but only journals that
                f"ctl rl-difficulty: '{run_dir}' trains on rl.prompts '{cfg.rl.prompts}', a file with no difficulty "
                "to set; the built-in task's is builtin:arithmetic:DIGITS, harder prompts in a file are yours to write"
            )
        tokens, budget = params.get("tokens"), cfg.rl.max_new_tokens
        if action == "set_overlong_penalty" and isinstance(tokens, int) and tokens >= budget:
            raise ConfigError(  # the job refuses it too (rl.overlong_buffer's bound), but only journals that
                f"ctl overlong-penalty: {counted(tokens, 'token')} is not under the response budget of '{run_dir}' "
                f"(rl.max_new_tokens {budget} in its config.yaml); pass 0 (off) to {budget - 1}"
            )
        return
    layers = cfg.model.layers
    ours = [i for i, k in enumerate(layers) if kind in k.split("+")]
    name = {"moe": "MoE", "mod": "Mixture-of-Depths"}[kind]
    if layer is None and not ours:
        kinds = " and ".join(sorted(set(layers)))
        raise ConfigError(f"'{run_dir}' has no {name} layers (model.layer_pattern: {kinds} only); nothing to set")
    if layer is not None and layer not in ours:
        raise ConfigError(
            f"layer {layer} of '{run_dir}' is {layers[layer] if layer < len(layers) else 'not there'}; its {name} "
            f"layers are {ours or 'none'}"
        )


# commands that answer the state they were sent in: not applied again when a resume lost them
ONE_TIME = {"skip_step", "rollback", "save_checkpoint", "stop", "exclude_node"} | {
    "add_expert",
    "prune_expert",
    "reinit_expert",
    "reset_router",
}


def lost_commands(dropped: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A person's commands a run applied after its last checkpoint and lost with its process (the
    journal's decisions a resume found in force but not in the checkpoint): the settings, to apply
    again at the step they were applied at, and the one-time ones (ONE_TIME), said but not redone.
    One that failed changed nothing and was answered then: neither (a `total-steps` sent in the
    finetune phase was journaled as failed once more by each resume, "applied again")."""
    manual = sorted(
        (d for d in dropped if d.get("rule") == "manual" and (d.get("outcome") or {}).get("result") != "failed"),
        key=lambda d: d["id"],
    )
    return [d for d in manual if d["action"] not in ONE_TIME], [d for d in manual if d["action"] in ONE_TIME]


def session(run_dir: str | Path) -> str | None:
    """The `trimtab train` session holding run_dir's lock (runlock.run_lock's record: host, pid, start),
    whom a command sent now is for; None when none is recorded."""
    holder = lock_holder(run_dir)
    if "pid" not in holder:
        return None
    return f"{holder.get('host')}:{holder['pid']}:{holder.get('started')}"


ENDED = ".ended"  # control/.ended: {"session", "step"} of the last session whose last step is done


def close_inbox(run_dir: Path, step: int) -> None:
    """The job's last step is done (Orchestrator.on_train_end): it takes no more commands."""
    inbox = Path(run_dir) / "control"
    inbox.mkdir(exist_ok=True)
    write_json(inbox / ENDED, {"session": session(run_dir), "step": step}, indent=None)


def ended(run_dir: str | Path) -> dict[str, Any] | None:
    """The control/.ended record of the session that holds run_dir's lock or last held it, when that
    session's last step is done; None while it can still apply a command."""
    record = read_json(Path(run_dir) / "control" / ENDED)
    if isinstance(record, dict) and record.get("session") is not None:
        return record
    return None


def too_late(run_dir: str | Path, command: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ended session's record when `command` was sent to it (after its last step): it is not for
    the session taking it now. Queued commands and older files name no session: for whoever takes them."""
    record = ended(run_dir)
    sent_to = command.get("session") if isinstance(command, dict) else None
    return record if record is not None and sent_to == record["session"] else None


def taking(run_dir: str | Path) -> tuple[bool, str]:
    """(whether a job in run_dir takes commands now, the evidence): runlock.liveness, but not once the
    session running has done its last step."""
    running, evidence = liveness(run_dir)
    if running and (done := ended(run_dir)) is not None and done["session"] == session(run_dir):
        return False, f"its last step, {done['step']}, is done: it is saving and ending"
    return running, evidence


def send(run_dir: str | Path, command: dict[str, Any], queue: bool = False) -> Path:
    """Drop a command for the job in run_dir; returns the file written. Refuses when the run is not
    running, or has done its last step, unless `queue` (the command then applies when the run next
    resumes)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (no config.yaml); pass the --out of a run")
    check_against_config(run_dir, command)
    running, evidence = taking(run_dir)
    now = session(run_dir) if running else None
    if not running and not queue:
        raise RunStateError(
            f"'{run_dir}' is not running ({evidence}); nothing was sent. Pass --queue (queue=True in Python) "
            "to have the command applied when it next resumes"
        )
    _check_length(run_dir, command, running)
    if running and now is not None:  # for this session only: one that ends before taking it answers it
        command = {**command, "session": now}
    inbox = run_dir / "control"
    inbox.mkdir(exist_ok=True)
    path = inbox / f"{time.time_ns()}-{os.getpid()}.json"
    write_json(path, command, indent=None)
    return path


def _check_length(run_dir: Path, command: dict[str, Any], running: bool) -> None:
    """A run length the run has already passed, refused now: the job (or the resume that takes a
    queued one) would only journal it as failed ("would end pretraining before the current step"),
    the person gone. A running job's step is its newest logged one (`total-steps 60` sent at step
    88 was sent, said as a run length of 60 steps, then failed)."""
    params = command.get("params")
    steps = params.get("steps") if isinstance(params, dict) else None
    if command.get("action") != "set_total_steps" or not isinstance(steps, int):
        return  # another action, or a malformed one: the job answers it
    at, where = newest_step(run_dir), "resumes at step {} (its newest checkpoint)"
    logged = [m for m in read_metrics(run_dir) if isinstance(m.get("step"), int)] if running else []
    if logged and logged[-1].get("phase") == "finetune":  # sent, then failed: "only during pretraining"
        raise ConfigError(
            f"ctl total-steps {steps}: '{run_dir}' is in its finetune phase (step {logged[-1]['step']}, "
            "metrics.jsonl): total-steps is pretraining's length, which has ended (finetune.steps is the "
            "finetune phase's)"
        )
    if logged and logged[-1]["step"] > at:
        at, where = logged[-1]["step"], "is running, at step {} (metrics.jsonl)"
    if steps < at:
        raise ConfigError(
            f"ctl total-steps {steps}: '{run_dir}' {where.format(at)}, past that length; name a total of at least {at}"
        )
    if steps > at and not running:
        _refuse_past_a_completed_run(run_dir, steps, at)


def _refuse_past_a_completed_run(run_dir: Path, steps: int, at: int) -> None:
    """A longer run length queued for a run that has completed, refused: a queued command applies
    when the run resumes, and a run at its length resumes only when `trimtab train` asks a larger
    length, which sets the length itself (the queued command then overrode what it asked)."""
    done = read_summary(run_dir) or {}
    if done.get("status") == "completed" and at == done.get("step") == done.get("total_steps"):
        raise ConfigError(
            f"ctl total-steps {steps}: '{run_dir}' has completed (step {at} of {at}) and resumes only through "
            f"`trimtab train` with a larger --max-steps (train.max_steps): run it with --out {run_dir} --max-steps "
            f"{steps} to train to step {steps}; nothing was sent"
        )


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
