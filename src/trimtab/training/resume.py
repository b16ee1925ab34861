"""What `train` finds in an existing run directory before it builds anything: the checkpoint to
resume from, with corrupt newer ones moved aside, or the news that this config leaves nothing to
train (the run is at or past the length its config asks for, or orchestrator.early_stop stopped
it and neither the length nor the rule changed), in which case nothing is built and nothing in
the directory changes (re-running a finished run used to overwrite its summary with this call's
empty figures and append a duplicate evaluation to metrics.jsonl). The message says which: a
finished run, a checkpoint past the length asked for, one at it that is not a finished run (saved
on the way to a longer length, or no summary.json), an early stop. Asked for fewer steps than the
run has (a checkpoint past the length, or at it on the way to a longer one) is RunPastLength: the
CLI's exit 2, since the run is not complete at the length asked for.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trimtab.checkpoint import (
    CORRUPT,
    REPLACED,
    checkpoint_root,
    search_valid,
    set_aside_corrupt,
)
from trimtab.config import RunConfig, read_saved
from trimtab.distributed import Parallel
from trimtab.errors import CheckpointError, ConfigError, RunFinished, RunPastLength
from trimtab.rundir import SUMMARY, is_eval, read_json, read_metrics, write_json
from trimtab.storage import Remote
from trimtab.training.schedule import KEYS, configured_lengths, fixed_lengths
from trimtab.training.services.signals import run_length, stopped_in_start_up
from trimtab.training.services.storage import newer_in_store, reference_steps, restore_from

log = logging.getLogger(__name__)
Found = tuple[Path, dict[str, Any]]  # a checkpoint directory and its state.json


def resume_point(cfg: RunConfig, dist: Parallel, remote: Remote | None = None) -> Found | None:
    """The newest valid checkpoint (rank 0 reads the directory, and alone moves files); with
    none there, the newest valid one in `remote` (checkpoint.dir), downloaded into it. Raises
    RunFinished for a run already at its length; moves corrupt newer checkpoints aside."""
    found, refused = dist.from_main(search_valid, cfg.run_dir)
    in_store: list[dict[str, Any]] = []  # the store's checkpoints that failed verification (filled on rank 0)
    if found is None and remote is not None:
        found = dist.from_main(restore_from, remote, cfg.run_dir, reference_steps(cfg), in_store)
    elif remote is not None:  # a disk left behind by a run that moved on: the store's newer checkpoint
        found = dist.from_main(newer_in_store, remote, cfg.run_dir, found, in_store)
    if found is not None and "train" not in found[1]:  # weights without a training state (trimtab merge)
        dist.close()
        raise CheckpointError(
            f"{cfg.run_dir} holds a merged model, not a run to resume; start a new run from it: "
            f"--out NEW --set train.init_from={cfg.run_dir}"
        )
    if found is not None:
        found[1]["train"]["made_up"] = made_up_steps(found[1])  # a checkpoint older than the field
        _stop_if_finished(cfg, found, dist)
    dist.on_main(_set_aside, cfg.run_dir, found, refused, cfg.checkpoint.keep, in_store)
    return found


def _stop_if_finished(cfg: RunConfig, found: Found, dist: Parallel) -> None:
    """RunFinished when this config leaves nothing to train: the run is at or past its length (the
    configured phase lengths plus set_total_steps' changes to pretraining, TrainState.length_delta),
    or orchestrator.early_stop stopped it at this checkpoint and neither the length nor the rule
    changed since (a wrapper that relaunches until exit 0 must not train past the stop)."""
    state = found[1]
    step, lengths = state["train"].get("step", 0), _lengths(cfg)
    if lengths is None:
        return  # its length is not resolved yet: it cannot have reached it
    total = run_length(state["train"], lengths)
    early = _early_stop_decision(cfg, state, lengths) if step < total else None
    if step < total and early is None:
        return
    status = _status(state, early)
    summary, saved = dist.from_main(saved_summary, cfg.run_dir, found, total, status)
    if not saved and early is None and step == total and step >= _trained_to(state):
        # trained to its end, but the session ended before its summary (a kill or preemption in the
        # final upload): this one ends the run as that would have, training nothing (logged_eval)
        log.warning(
            "%s: its training ended at step %d, but the session that saved that checkpoint ended before writing "
            "summary.json and the report: this session writes them, training nothing",
            cfg.run_dir,
            step,
        )
        return
    dist.close()
    if early is not None:
        raise RunFinished(_stopped_early(cfg, step, total, early), summary)
    message = _at_length(cfg.run_dir, state, lengths, total, summary if saved else None)
    if step > total or step < _trained_to(state):  # fewer steps than the run has: not complete at this length
        raise RunPastLength(message, summary)
    raise RunFinished(message, summary)


def _early_stop_decision(cfg: RunConfig, state: dict[str, Any], lengths: list[int]) -> dict[str, Any] | None:
    """The journaled orchestrator.early_stop decision that ended the run at this checkpoint, when
    this config would stop it there again: the rule on in auto mode with the patience and
    min_delta it stopped under, and the phase lengths the checkpoint was saved with. None: the
    run was not stopped early here, or something changed and it trains on (the rule judges again)."""
    rule, train = cfg.orchestrator.early_stop, state["train"]
    if not rule.enabled or cfg.orchestrator.mode != "auto":
        return None
    if train.get("phase_steps") and list(train["phase_steps"]) != list(lengths):  # absent: before the key
        return None
    stops = [d for d in _journal(state) if d.get("action") == "stop" and d.get("applied")]
    last = stops[-1] if stops else {}  # the newest stop is what ended the session that saved this
    evidence = last.get("evidence") or {}
    if last.get("rule") != "early_stop" or last.get("step") != train.get("step"):
        return None
    if (evidence.get("patience"), evidence.get("min_delta")) != (rule.patience, rule.min_delta):
        return None
    return last


def _stopped_early(cfg: RunConfig, step: int, total: int, decision: dict[str, Any]) -> str:
    rule = cfg.orchestrator.early_stop
    return (
        f"{cfg.run_dir} stopped early at step {step} of {total}, by orchestrator.early_stop "
        f"({decision.get('summary', 'no improvement')}); nothing was trained and nothing in it changed. To train on: "
        "--set orchestrator.early_stop.enabled=false, or a larger orchestrator.early_stop.patience "
        f"({rule.patience}) or smaller min_delta ({rule.min_delta:g}); with a larger --max-steps alone it trains "
        "to its next evaluation, where the rule stops it again unless val_loss improved"
    )


def _at_length(
    run_dir: Path, state: dict[str, Any], lengths: list[int], total: int, summary: dict[str, Any] | None
) -> str:
    """Why a run at or past its length trains nothing, and what it is: finished (its summary
    written), its training done but not its summary, or a checkpoint on the way to a longer length.
    `summary`: summary.json when it is this checkpoint's, else None."""
    step, key = state["train"]["step"], KEYS[len(lengths) - 1]  # the last phase's length is the one to raise
    longer = "--max-steps (train.max_steps)" if key == "train.max_steps" else key
    changes = _length_changes(state, lengths[0]) if total != sum(lengths) else ""  # who changed the length
    length = f"{key} {lengths[-1]}{changes}"
    unchanged = "nothing was trained and nothing in it changed"
    was = f" ({lengths[-1] - total + _trained_to(state)}: the run as it was)" if step < _trained_to(state) else ""
    fresh = f", or a new --out trains a new run of {total} steps"
    if step > total:
        above = f"{longer} above {step - total + lengths[-1]}"
        return (
            f"{run_dir} has nothing to train: its newest checkpoint is at step {step}, past the {total} steps "
            f"asked for ({length}); {_where(state, summary)}. {unchanged.capitalize()}; {above} trains on{was}{fresh}"
        )
    if summary is not None and summary.get("status") == "completed":
        finished = f"{run_dir} has finished: it is at step {step} of {total} ({length})"
        return f"{finished}; {unchanged}. A larger {longer} trains on"
    return (
        f"{run_dir} is at step {step} of {total} ({length}) but has not finished: {_where(state, summary)}; "
        f"{unchanged}. A larger {longer} trains on{was}{fresh if was else ''}"
    )


def _where(state: dict[str, Any], summary: dict[str, Any] | None) -> str:
    """What the newest checkpoint is, against the length the run trained with when it was saved."""
    step, trained_to = state["train"]["step"], _trained_to(state)
    if step < trained_to:
        ended = f"that {summary['status']} there" if summary else "that ended without writing summary.json"
        return (
            f"the checkpoint at step {step} was saved on the way to step {trained_to}, the length the run trained "
            f"with then (its LR schedule not at its end), by a session {ended}"
        )
    if summary is None:
        return (
            f"its training ended at step {step}, but the session that saved that checkpoint ended before writing "
            "summary.json and the report"
        )
    return "the run finished there" if summary.get("status") == "completed" else f"its last session {summary['status']}"


def _status(state: dict[str, Any], early: dict[str, Any] | None) -> str:
    """The status of a summary built from the checkpoint (no summary.json of its step)."""
    step, trained_to = state["train"]["step"], _trained_to(state)
    if early is not None:
        return f"stopped ({(early.get('params') or {}).get('reason', 'early stopping')})"
    if step >= trained_to:
        return "completed"
    return f"stopped (at step {step} of {trained_to}: its last session ended without a summary)"


def _trained_to(state: dict[str, Any]) -> int:
    """The run's length when this checkpoint was saved; its step where the checkpoint predates the record."""
    train = state["train"]
    if not train.get("phase_steps"):
        return train["step"]
    return sum(train["phase_steps"]) + train.get("length_delta", 0)


# who changes pretraining's length through set_total_steps (a person's config change on resume is
# journaled too, rule "config", but moves phase_steps, not length_delta)
CHANGED_BY = {"make_up": "orchestrator.make_up", "convergence": "the live planner", "manual": "trimtab ctl total-steps"}
APPLIED_LENGTH = re.compile(r"total steps (\d+) -> (\d+)")  # Control._set_total_steps' report


def _length_changes(state: dict[str, Any], pretraining: int) -> str:
    """TrainState.length_delta by whom, from the checkpoint's journal, e.g. ", +1 by orchestrator.make_up";
    where the journal does not account for it (an older checkpoint), by set_total_steps, unnamed. Under
    another train.max_steps (`pretraining`) only make-up's part counts (schedule.reconcile)."""
    train = state["train"]
    if train.get("phase_steps") and train["phase_steps"][0] != pretraining:
        made_up = train.get("made_up", 0)
        return f", {made_up:+d} by {CHANGED_BY['make_up']}" if made_up else ""
    delta = train.get("length_delta", 0)
    if not delta:
        return ""
    by = _length_by_rule(state)
    if sum(by.values()) != delta:
        return f", {delta:+d} by set_total_steps"
    return "".join(f", {n:+d} by {CHANGED_BY.get(rule, f'rule {rule}')}" for rule, n in by.items() if n)


def _length_by_rule(state: dict[str, Any]) -> dict[str, int]:
    """The steps set_total_steps added to pretraining (TrainState.length_delta), by rule, as the
    checkpoint's journal applied them (a person's config change on resume left out: it moves phase_steps)."""
    by: dict[str, int] = {}
    for decision in _journal(state):
        if decision.get("action") != "set_total_steps" or decision.get("rule") == "config":
            continue
        for line in decision.get("applied") or []:
            if match := APPLIED_LENGTH.fullmatch(line):
                rule = decision.get("rule", "")
                by[rule] = by.get(rule, 0) + int(match[2]) - int(match[1])
    return by


def made_up_steps(state: dict[str, Any]) -> int:
    """TrainState.made_up of a checkpoint's state; one saved before the field existed holds none, and its
    made-up steps were dropped by a resume naming another --max-steps: recovered from its journal's
    orchestrator.make_up decisions where the journal accounts for the whole length_delta (else 0: the
    journal misses a change, and a guess could lengthen the run by steps no make-up added)."""
    train = state["train"]
    if "made_up" in train:
        return int(train["made_up"])
    by = _length_by_rule(state)
    return by.get("make_up", 0) if sum(by.values()) == train.get("length_delta", 0) else 0


def _journal(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The orchestrator's decisions as the checkpoint saved them (its hook's state; hooks.keyed's key)."""
    orchestrator = (state.get("hooks") or {}).get("Orchestrator") or {}
    return [d for d in orchestrator.get("journal") or [] if isinstance(d, dict)]


def _lengths(cfg: RunConfig) -> list[int] | None:
    """The phase lengths; a pretraining length that depends on the data (train.epochs) or the
    model (max_steps: auto) is the one the run resolved and saved in config.yaml."""
    if (lengths := fixed_lengths(cfg)) is not None:
        return lengths
    try:
        saved = read_saved(cfg.run_dir)
    except (OSError, ConfigError):
        return None
    return [int(saved.train.max_steps)] + configured_lengths(cfg)[1:]


def logged_eval(run_dir: Path, step: int) -> dict[str, Any]:
    """The evaluation metrics.jsonl holds of `step` (the last one there, without `abandoned`), as
    Trainer.evaluate's last_eval: what the summary of a session resumed at the run's end reports,
    the same figures the session that evaluated them would have. {} when there is none."""
    logged = [m for m in read_metrics(run_dir) if m.get("step") == step and is_eval(m)]
    return dict(logged[-1]) if logged else {}


def saved_summary(run_dir: Path, found: Found, total: int, status: str = "completed") -> tuple[dict[str, Any], bool]:
    """summary.json as the session that reached this checkpoint wrote it, and True; if it is
    missing or belongs to another step (a session killed before writing it) or to a session stopped
    in its start-up (it trained nothing and replaced the summary of the one that did), one from the
    checkpoint with `status`, and False."""
    saved = read_json(run_dir / SUMMARY)
    train = found[1]["train"]
    if isinstance(saved, dict) and saved.get("step") == train["step"] and not stopped_in_start_up(saved):
        return saved, True
    built = {
        "status": status,
        "run_dir": str(run_dir),
        "step": train["step"],
        "total_steps": total,
        "tokens": train["tokens"],
        "train_seconds": train.get("train_seconds", 0.0),
        "tokens_per_s": train["tokens"] / max(train.get("train_seconds", 0.0), 1e-9),  # over the whole run
        "checkpoint": str(found[0]),
    }
    return built, False


def _set_aside(
    run_dir: Path, found: Found | None, refused: dict[str, str], keep: int, in_store: Sequence[dict[str, Any]] = ()
) -> None:
    """Move the checkpoints newer than `found` aside and record each with why the search refused it
    (`refused`, search_valid's errors by path: verify ran once), with `in_store`, the store's
    (checkpoint.dir) newer ones that failed verification where they lie (restore() skipped them; the
    next upload's retention deletes them); the resume's line says them (set_aside_note), or, with
    none valid left, the start over's line here."""
    _say_cut_saves(run_dir, found)
    after = found[1]["step"] if found else -1
    moved = set_aside_corrupt(run_dir, after, keep)
    store = [dict(r, kept_in=None) for r in in_store if r["step"] > after]
    if not moved and not store:
        return
    unverified = "not verified by this resume's search (saved meanwhile)"  # a run lock keeps writers out
    record = {
        "resumed_step": max(after, 0),
        "refused": [
            {
                "checkpoint": p.name,
                "step": _step(p),
                "reason": refused.get(str(p), unverified),
                "kept_in": kept and str(kept),
            }
            for p, kept in moved.items()
        ]
        + store,
    }
    (checkpoint_root(run_dir) / CORRUPT).mkdir(parents=True, exist_ok=True)  # none moved: the store's alone
    write_json(checkpoint_root(run_dir) / CORRUPT / FALLBACK, record)
    if not found:
        log.warning("no valid checkpoint is left: the run starts over from step 0%s", _kept(run_dir, record))


FALLBACK = "fallback.json"  # checkpoints/corrupt/: the corrupt ones the last resume passed over, until journaled


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def set_aside_note(run_dir: Path, step: int) -> str:
    """The corrupt checkpoints the resume to `step` set aside, and why, and the saves after it that were
    cut before their commit, for its one "resuming from" line (Checkpointing.resume): "" when there were
    none. Read, not taken: the orchestrator journals the set-aside ones."""
    record = _on_disk(read_json(checkpoint_root(run_dir) / CORRUPT / FALLBACK), step)
    return (_kept(run_dir, record) if record and record["refused"] else "") + _cut_note(run_dir, step)


def _on_disk(record: Any, step: int) -> dict[str, Any] | None:
    """The record of the resume to `step` (None: none, or another resume's), each `kept_in` that
    corrupt/'s bound (the newest checkpoint.keep) has pruned since it was written as None."""
    if not (
        isinstance(record, dict) and isinstance(record.get("refused"), list) and record.get("resumed_step") == step
    ):
        return None
    for r in record["refused"]:
        r["kept_in"] = r.get("kept_in") if r.get("kept_in") and Path(r["kept_in"]).is_dir() else None
    return record


def _kept(run_dir: Path, record: dict[str, Any]) -> str:
    names = ", ".join(f"{r['checkpoint']} ({short_reason(r['reason'])}{_lies(r)})" for r in record["refused"])
    where = checkpoint_root(run_dir) / CORRUPT
    bound = "never resumed from; it keeps the newest checkpoint.keep"
    return f"; corrupt newer checkpoint(s) set aside in {where} ({bound}): {names}"


def _lies(refused: dict[str, Any]) -> str:
    """Where a refused checkpoint is: corrupt/ (""), pruned from there, or left in the object store."""
    if refused.get("store"):
        return f"; in {refused['store']}, not downloaded"
    return "" if refused["kept_in"] else "; pruned"


def short_reason(reason: str) -> str:
    """verify's error without the checkpoint's directory: the file and what is wrong with it."""
    head, _, rest = reason.partition(": ")
    file = head.rsplit("/", 1)[-1]
    return f"{file}: {rest}" if rest else reason


def take_fallback(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The record of the corrupt checkpoints the resume to `step` passed over (_set_aside), read
    once: the session journals it (orchestrator/fallbacks.py), as it journals a restart, so the
    steps trained again are a recorded incident, not a console line alone. None: there was none,
    or it is of another resume (a session that ended before journaling it, then trained on)."""
    path = checkpoint_root(run_dir) / CORRUPT / FALLBACK
    record = read_json(path)
    path.unlink(missing_ok=True)
    return _on_disk(record, step)


CUT_SAVE = re.compile(r"^\.tmp_step_(\d{6,})_")  # a save's temp folder (save_checkpoint's, _write_sharded's)


def _say_cut_saves(run_dir: Path, found: Found | None) -> None:
    """Say each save newer than the resumed step that was cut before its commit (a rank lost in a
    sharded write: the survivors' shards, no state.json): never a checkpoint, the resume passed
    over it without a word and the steps since the one it took were lost unexplained. With a
    checkpoint found, the resume's one "resuming from" line says it (set_aside_note: a line of its
    own here, "resuming from step_N", stood beside it); here only a start over from step 0."""
    if found is None and (note := _cut_note(run_dir, -1)):
        log.warning("%s: starting over from step 0", note.removeprefix("; "))


def _cut_note(run_dir: Path, after: int) -> str:
    """The saves newer than step `after` cut before their commit, said ("; the save of step N was cut
    ..."), or "". Left for the next save's prune (clear_stale); a step's aside copy (REPLACED) is
    put_back_replaced's."""
    root = checkpoint_root(run_dir)
    temps = [p for p in sorted(root.glob(".tmp_step_*")) if REPLACED not in p.name] if root.is_dir() else []
    cut = {p.name: int(m.group(1)) for p in temps if (m := CUT_SAVE.match(p.name)) and int(m.group(1)) > after}
    if not cut:
        return ""
    steps = ", ".join(str(step) for step in sorted(set(cut.values())))
    return (
        f"; the save of step {steps} was cut before its commit ({', '.join(cut)} in {root}: no state.json, not a "
        "checkpoint; a rank stopped in its write)"
    )
