"""The files of a run directory, read and written in one place (torch-free: report tools,
benchmarks, tune and tests read runs with it without the training stack).

    RUN_DIR/config.yaml        the resolved config (written whole, once per session)
    RUN_DIR/metrics.jsonl      one line per log interval and per evaluation, appended as training goes
    RUN_DIR/decisions.jsonl    one line per orchestrator decision, rewritten whole on every change
    RUN_DIR/plan_status.jsonl  the live planner's status blocks, appended
    RUN_DIR/summary.json       written when fit() returns (and merged into by `trimtab eval`)
    RUN_DIR/.lock              held while a `trimtab train` runs it, with a heartbeat

A rollback restores an older checkpoint and trains the steps after it again, so a step can appear
twice in metrics.jsonl. The lines the rollback threw away stay in the file, in place, with
`"abandoned": true`: each line says for itself whether it belongs to the run's trajectory, so any
line-by-line filter (jq, pandas) gets it without replaying events, and nothing that happened is
lost. The unmarked lines, in file order, are the kept trajectory: each step once (per kind of
line), in order. A resume deletes the unmarked lines past its checkpoint (they are trained again,
the same), never abandoned ones. decisions.jsonl marks the same way the decisions a resumed run's
checkpoint does not hold (taken in a session that ended without saving again). The readers here
leave abandoned records out unless asked for them (`abandoned=True`).

Every small file is written whole (write_atomic): a reader never sees half a file, and a write
that fails (a full disk) leaves the old file as it was and no temp file.
The run lock (RUN_DIR/.lock): runlock.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS_FILE = "metrics.jsonl"
DECISIONS_FILE = "decisions.jsonl"
GOODPUT_FILE = "goodput.json"  # where the run's wall time went, by session (resilience/goodput.py)
STEP_FILE = "goodput.step"  # the goodput ledger's mark of the last step a session completed
PLAN_STATUS_FILE = "plan_status.jsonl"
SUMMARY = "summary.json"
LOCK = ".lock"
ABANDONED = "abandoned"  # the key set (true) on records a rollback or a resume threw away
# JSON has no NaN or infinity: Python's json writes them bare (a NaN loss in a decision's evidence),
# which jq, a browser's JSON.parse and most other readers refuse. Written as these strings, read back as floats.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# A string that is one of those words (a source named "NaN") is written with a leading apostrophe, as a
# spreadsheet marks text that would read as a number: "'NaN"; one that already has some gets one more.
TEXT_MARK = "'"


# ---------------------------------------------------------------------------- writing whole files


def write_atomic(path: Path, text: str, durable: bool = True) -> None:
    """`text` into `path` through a temp file beside it and a rename: a reader never sees half a
    file, and a write that fails (a full disk) leaves the old file as it was and no temp file.
    durable=False skips the fsync: the file outlives a crash of the process, not of the machine
    (for a record rewritten every second, where a sync would cost more than the record is worth)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a read-only directory: the open's error is the one to say
            tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any, indent: int | None = 1, durable: bool = True) -> None:
    """`data` as JSON into `path`, whole (write_atomic)."""
    write_atomic(path, json_text(data, indent=indent), durable)


def read_json(path: Path) -> Any:
    """A JSON file's value; None when it is missing or does not parse."""
    try:
        return json_value(Path(path).read_text())
    except (OSError, ValueError):
        return None


def json_text(value: Any, **kwargs: Any) -> str:
    """json.dumps(value, **kwargs) that is JSON: a NaN or infinite float as NON_FINITE's string, a string
    that would read back as one marked (TEXT_MARK), in dicts and lists at any depth."""
    return json.dumps(_finite(value), **kwargs)


def json_value(text: str) -> Any:
    """json.loads(text), NON_FINITE's strings (json_text's) read back as the floats they stand for and a
    marked string (TEXT_MARK) with one mark less."""
    return _restored(json.loads(text))


def _finite(value: Any) -> Any:
    """`value` with each NaN or infinite float as NON_FINITE's string and each string that is one,
    behind any number of TEXT_MARKs, with one mark more."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, str):
        return TEXT_MARK + value if value.lstrip(TEXT_MARK) in NON_FINITE else value
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return [_finite(v) for v in value] if isinstance(value, (list, tuple)) else value


def _restored(value: Any) -> Any:
    if isinstance(value, str):
        if value in NON_FINITE:
            return NON_FINITE[value]
        return value[1:] if value.startswith(TEXT_MARK) and value.lstrip(TEXT_MARK) in NON_FINITE else value
    if isinstance(value, dict):
        return {k: _restored(v) for k, v in value.items()}
    return [_restored(v) for v in value] if isinstance(value, list) else value


# ---------------------------------------------------------------------------- JSONL files


def read_jsonl(path: Path, abandoned: bool = True) -> list[dict[str, Any]]:
    """The records of a JSONL file in file order ([] when there is none). A last line without its
    newline (being written by a live run, or cut off by a crash), a line that does not parse (or
    holds bytes that are not UTF-8) and one that is not a JSON object are left out; with
    abandoned=False so are the records marked abandoned."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_bytes().decode(errors="replace")  # a damaged byte spoils its line, not the file
    lines = text.splitlines()
    if not text.endswith("\n"):
        lines = lines[:-1]
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json_value(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):  # every record trimtab writes is an object: anything else is damage
            records.append(record)
    return records if abandoned else [r for r in records if not r.get(ABANDONED)]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]], default: Callable[[Any], Any] | None = None) -> None:
    """A whole JSONL file, one record a line (write_atomic: a reader sees the old file or the new)."""
    write_atomic(path, "".join(json_text(r, default=default) + "\n" for r in records))


def rewrite_jsonl(path: Path, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Each record of an existing JSONL file through `change` (None drops it), atomically."""
    if not Path(path).exists():
        return
    write_jsonl(path, [r for r in map(change, read_jsonl(path)) if r is not None])


def append_lines(path: Path, text: str) -> None:
    """Append whole lines. A write that fails (a full disk) raises, and what part of `text`
    reached the file is cut back off first, so the caller can write it all again later."""
    start = None
    try:
        with open(path, "a") as fh:
            start = fh.tell()
            fh.write(text)
    except OSError:
        if start is not None:
            with contextlib.suppress(OSError):
                os.truncate(path, start)
        raise


def read_metrics(run_dir: str | Path, abandoned: bool = False) -> list[dict[str, Any]]:
    """The lines of RUN_DIR/metrics.jsonl in file order: the kept trajectory, or with
    abandoned=True every line (those of abandoned steps marked); [] when there is no file. Every
    line trimtab writes has a whole-number step: one without (a hand edit, another tool's note)
    is left out, as read_jsonl leaves out a line that does not parse (the report sorted by it)."""
    return [r for r in read_jsonl(Path(run_dir) / METRICS_FILE, abandoned) if has_step(r)]


def is_eval(record: dict[str, Any]) -> bool:
    """Whether a metrics line is an evaluation's: a training line always has the LR it applied
    (training/metrics.py step_metrics), an evaluation's never."""
    return "lr" not in record


def has_step(record: dict[str, Any]) -> bool:
    """Whether a metrics line has the whole-number step every line trimtab writes has."""
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool)


def read_decisions(run_dir: str | Path, abandoned: bool = False) -> list[dict[str, Any]]:
    """A run's decisions, oldest first (the journal's format: docs/orchestrator.md): the kept ones,
    or with abandoned=True also those a resume abandoned (marked "abandoned": true). A line
    without a whole-number step (a hand edit, another tool's note) is left out: the report places
    and groups decisions by their step (int(None) raised)."""
    return [d for d in read_jsonl(Path(run_dir) / DECISIONS_FILE, abandoned) if has_step(d)]


def is_decision(record: dict[str, Any]) -> bool:
    """Whether a journal line has the whole-number id and step every decision has (the resume and
    the report index and sort by them: a KeyError or TypeError traceback on one that has not)."""
    ident = record.get("id")
    return has_step(record) and isinstance(ident, int) and not isinstance(ident, bool)


# a person's decisions (a `trimtab ctl` command, a config change), a moved default's and a subcommand's own
# setting (`trimtab rl` turning the likelihood rules off; journals before it said these "manual"): none answers a fault
PEOPLES = ("manual", "default", "command")
# Decisions that answer no fault of their own: follow-ups of another's remedy (withheld updates made
# up, an LR cut given back, the rows watched after rows were left out) and the tuning of a sound run
# (an LR raised off a plateau, the checkpoint interval, the live planner's run length, an early stop)
NOT_FAULTS = ("make_up", "lr_restore", "data", "plateau", "checkpoint_interval", "convergence", "early_stop")
# One family's remedies this close in steps answer one incident (the ladder's escalation window): a
# fault's skipped steps, its rollback and what the replay decided again
INCIDENT_STEPS = 50
SAME_INCIDENT = {"data": "instability"}  # bad data shows as spikes and as outlier rows: one incident
# outcomes that say how an incident ended; "too early" (the run ended before the outcome was measured) heals none
# ("continued": a restart on fewer ranks, the job gone on without the lost one: orchestrator/outcomes.py)
ENDED = ("recovered", "not recovered", "failed", "stopped", "too early", "continued")
# answers a later finding cannot undo once "recovered": after SETTLED (5) healthy steps one is another
# fault (orchestrator/outcomes.py: SETTLED); for a restart (`resume`) once its session trained on: a rank
# lost 18 steps after another's restart is another fault (2 restarts read "faults healed 1", or 0 with the
# second judged "too early"). Not a rollback: the ladder's incident stays open until the replay saved a
# good checkpoint and trained outcome_after quiet steps (ladder.py: _clear), its outcome window.
SETTLED_ANSWERS, SETTLED = ("skip_step", "resume"), 5
CAUSES = {"spike": "data", "rows": "data", "data": "data"}  # a rule's cause, when rules share one: bad data


def is_note(decision: dict[str, Any]) -> bool:
    """A decision that takes no action (a slower machine, a failed evaluation, a straggler named):
    an observation journaled for a person, not a remedy."""
    return decision.get("action") == "none"


def standing_advice(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The advice still standing at the end: kept advice (mode advise, an action) that no later kept
    decision carried out (the same action and parameters, the orchestrator's or a person's ctl) and
    that is its rule's latest word (no decision of the rule taken after it was last seen: an
    imbalance advised once, then answered by a router reset, is not standing). The same advice
    again is counted on the first one (evidence seen_again, last_seen_at: orchestrator/deciding.py),
    so without this a pruning advised from step 60 to the end read as one line at step 60. The row
    gate's rows are not (_gated)."""
    kept = [d for d in decisions if not d.get("abandoned")]
    advice = [(i, d) for i, d in enumerate(kept) if d.get("mode") == "advise" and not is_note(d) and not _gated(d)]
    return [d for i, d in advice if not any(_ends(o, d) for o in kept[i + 1 :])]


def _gated(advice: dict[str, Any]) -> bool:
    """The row gate's skip_data (orchestrator/outliers.py gate_finding, evidence `gated`): its rows were left
    out of the update of the step that met them before it was journaled, whatever its mode; fallen to advice
    (debug, bad_batch@15:106: after 0 of 7 recovered, the garbage going on) it only leaves them in the loader
    for a later epoch, where the gate tests them again. Listed, the end of that run named 32 rows of step 55
    as advice to apply, of the 1,310 the gate had left out."""
    evidence = advice.get("evidence") or {}
    return advice.get("rule") == "row_gate" and advice.get("action") == "skip_data" and bool(evidence.get("gated"))


def _ends(later: dict[str, Any], advice: dict[str, Any]) -> bool:
    """Whether decision `later` carried `advice` out or superseded it."""
    same = later.get("action") == advice.get("action") and later.get("params") == advice.get("params")
    last_seen = (advice.get("evidence") or {}).get("last_seen_at", advice.get("step"))
    newer = later.get("rule") == advice.get("rule") and isinstance(later.get("step"), int) and later["step"] > last_seen
    return (same and later.get("mode") != "advise") or newer


def advice_line(d: dict[str, Any]) -> str:
    """A standing advice in a line, e.g. `step 60 moe: prune_expert {"layer": 1, "expert": 5} (layer 1:
    expert 5 dead; advised 12 times, last at step 140)`."""
    evidence = d.get("evidence") or {}
    params = json.dumps(d.get("params") or {}, default=str)
    again = evidence.get("seen_again", 0)
    times = f"; advised {again + 1} times, last at step {evidence.get('last_seen_at')}" if again else ""
    return f"step {d.get('step')} {d.get('rule')}: {d.get('action')} {params} ({d.get('summary') or ''}{times})"


def incidents(decisions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The kept decisions that answer a fault, grouped by incident, in journal order: one family's
    (bad data's spikes and rows together) within INCIDENT_STEPS steps of the incident's span (a
    rollback's replay goes back in steps and stays in it) or of the ladder's incident number (evidence
    `incident`, orchestrator/deciding.py) however far, unless the incident was over before (_over).
    Notes, NOT_FAULTS, PEOPLES' decisions and a restart that was no failure (_resized) answer none."""
    found: list[tuple[str, list[int], list[dict[str, Any]]]] = []  # family, [first, last step], decisions
    for d in decisions:
        if d.get(ABANDONED) or is_note(d) or d.get("rule") in NOT_FAULTS or d.get("mode") in PEOPLES or _resized(d):
            continue
        # a layer's family (moe/1, mod/3) is for judging outcomes per layer; one fault can strike every
        # layer at once (debug-moe, expert_collapse@10: layers 1 and 3 answered at steps 20 and 21, "faults healed 2")
        family = str(d.get("family") or d.get("rule")).split("/")[0]
        family, step = SAME_INCIDENT.get(family, family), int(d.get("step", 0))
        number = _ladder_incident(d)
        near = (  # the latest first: a ladder rollback belongs to the incident it counted on (_over)
            i
            for i in reversed(found)
            if i[0] == family
            and (i[1][0] - INCIDENT_STEPS <= step <= i[1][1] + INCIDENT_STEPS or number in _numbers(i[2]))
            and not _over(i[2], d)
        )
        if (incident := next(near, None)) is None:
            found.append((family, [step, step], [d]))
            continue
        incident[1][:] = [min(incident[1][0], step), max(incident[1][1], step)]
        incident[2].append(d)
    return [i[2] for i in found]


def _resized(d: dict[str, Any]) -> bool:
    """A restart after a clean end (a new launch on another world, or the agent's stop to admit a node:
    docs/resilience.md `resized`): nothing was lost, so no fault (a run resumed on 1 rank after a
    2-rank job completed read "faults healed 2" for its one killed rank)."""
    return d.get("rule") == "restart" and (d.get("evidence") or {}).get("kind") == "resized"


def _over(incident: list[dict[str, Any]], d: dict[str, Any]) -> bool:
    """Whether the incident was over before decision d: its latest decision "recovered" (not on a
    branch a rollback threw away), and d has another cause (a non-finite loss, then bad data), or
    the same one after that recovery was settled (a skipped step's SETTLED steps, or any other's
    outcome window). nan_loss@20, bad_rows@30 and nan_loss@57 on one run were one incident, and 3
    faults, 2 of them healed, read "faults healed 1". Bad data is the exception: its rows recur (the
    next epoch, the next of a bad stretch) as spikes and rows left out, one fault however long. A ladder
    rollback after another in the incident is the ladder's count: its second of an open incident stays in
    it, its first again (the ladder closed the last one) starts another. Where the ladder numbered its
    incidents (evidence `incident`), another number is another incident (the ladder closed it, or its window
    passed: a skip after the close joined the closed incident while no rollback followed to say so), and one
    of its numbers with a rollback counted is one incident until the ladder closes it; before its first
    rollback the ladder has no word on it (a NaN weights' rollback after gradient spikes skipped, within its
    window) and the outcomes above say."""
    if (number := _ladder_incident(d)) is not None and (numbers := _numbers(incident)):
        if number not in numbers:
            return True
        if any(_ladder_count(e) for e in incident if _ladder_incident(e) == number):
            return False
    counted = _ladder_count(d)
    if counted is not None and any(_ladder_count(e) for e in incident):  # the ladder's own word (ladder.py)
        return counted == 1
    last = incident[-1]
    outcome = last.get("outcome") or {}
    if outcome.get("result") not in ("recovered", "continued") or outcome.get("rolled_back"):
        return False
    cause = CAUSES.get(str(d.get("rule")), d.get("rule"))
    if cause != CAUSES.get(str(last.get("rule")), last.get("rule")):
        return True
    if cause == "data":
        return False
    step, settled = int(d.get("step", 0)), outcome.get("steps")
    if last.get("action") in SETTLED_ANSWERS:
        settled = SETTLED
    return isinstance(settled, int) and step > int(last.get("step", 0)) + settled


def _ladder_count(d: dict[str, Any]) -> int | None:
    """Which of its incident's rollbacks the ladder counted d (evidence `incident_rollback`: 1 after the
    ladder closed the last one, ladder.py _clear); None for a decision it did not count."""
    n = (d.get("evidence") or {}).get("incident_rollback")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _ladder_incident(d: dict[str, Any]) -> int | None:
    """The number of the ladder's incident decision d answers (evidence `incident`); None: not a ladder decision,
    or a journal from before the ladder numbered them (_over then reads its rollbacks' counts)."""
    n = (d.get("evidence") or {}).get("incident")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _numbers(incident: list[dict[str, Any]]) -> set[int]:
    """The ladder's incident numbers among an incident's decisions."""
    return {n for e in incident if (n := _ladder_incident(e)) is not None}


def healed(decisions: list[dict[str, Any]]) -> int:
    """Incidents healed: those whose last measured outcome says the run recovered (only an applied
    remedy is judged: advice never heals; a stop, a failure, no recovery or too few steps to tell
    after it leaves it unhealed)."""
    ended = ([r for d in i if (r := (d.get("outcome") or {}).get("result")) in ENDED] for i in incidents(decisions))
    return sum(bool(results) and results[-1] == "recovered" for results in ended)


# ---------------------------------------------------------------------------- summary.json


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN_DIR/summary.json, or None when there is none (a run still going, or one that crashed)
    or it is damaged (not a JSON object: a disk fault; the next session writes it whole again)."""
    found = read_json(Path(run_dir) / SUMMARY)
    return found if isinstance(found, dict) else None


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    write_json(Path(run_dir) / SUMMARY, summary)


def newest_step(run_dir: Path) -> int:
    """The newest checkpoint's step by its directory name (0: none), the step a re-run resumes
    from unless that checkpoint turns out corrupt. By name, without torch (a signal in start-up may
    come while torch is being imported; `trimtab ctl` imports none)."""
    names = [p.name.removeprefix("step_") for p in (Path(run_dir) / "checkpoints").glob("step_*")]
    return max((int(n) for n in names if n.isdigit()), default=0)
