"""What a person changed in a run's config between its sessions: the config the run was trained
with (its config.yaml) against the config of the session that resumes it, key by key.

A resumed run trains on under the new values (the optimizer's, the batch's, the rules'), so each
change is a person's decision, as a changed phase length is: the orchestrator journals it (rule
"config", action "none": the config itself applies it) and the console says them all in one
line (changes_line), so a run that was resumed with `--set optim.lr=...` shows why its LR moved.
Each change says who made it (`by`, _mark_origins): a key this session's config set (its --set items,
its file, a flag: config/provenance.py) is a person's, whatever its value, or the subcommand's (`trimtab
rl` turns the likelihood rules off: said as its own, not as a person's flag); one it left at this
trimtab's default is marked `default` and said as one, not as a person's, and config.yaml's first line
(the keys the session that wrote it set) tells which: an earlier session's setting not repeated, or a
default that moved between versions (unknown for a config.yaml an older trimtab wrote).

Compared: every leaf of the resolved configs (dotted keys, model.moe.top_k; a list is one leaf,
data.mix). Left out (IGNORED), each for its reason:
    out, preset              the run directory itself (a resume names it), and the preset's name (its
                             values are compared key by key)
    faults                   test instruments; the fault injector says what it does with them
                             (orchestrator/faults.py)
    train.max_steps, train.epochs, finetune.steps
                             the phase lengths: training/schedule.reconcile journals them, with their
                             effect on the schedule (set_total_steps)
    train.init_from          a fresh run's starting weights: a resumed run's come from its checkpoint
                             (and one in object storage is saved as its local copy, so it always differs)
    train.micro_batch_tokens, train.activation_checkpointing
                             the orchestrator journals them itself, with the action that applies them over
                             an out-of-memory remedy's saved value (orchestrator/people.py, _configured_knobs)
    log.*                    the console, the report, TensorBoard and the trackers: nothing it trains on
    finetune.*               where one of the configs has no finetune phase (finetune.steps 0): the
                             phase added or dropped is the change, journaled by reconcile; its settings
                             are part of it
"""

from __future__ import annotations

import logging
from typing import Any

from trimtab.config import RunConfig, load_config, read_saved, resolve_saved
from trimtab.config.checks import leaves
from trimtab.config.provenance import by_command, saved_sources, sources
from trimtab.errors import ConfigError, SavedConfigError
from trimtab.rundir import CONFIG

log = logging.getLogger(__name__)

IGNORED = (  # each one's reason: the module docstring
    "out",
    "preset",
    "faults",
    "train.max_steps",
    "train.epochs",
    "finetune.steps",
    "train.init_from",
    "train.micro_batch_tokens",
    "train.activation_checkpointing",
    "log",
)
TRAINED = "config"  # state.json's copy of the config its checkpoint was trained with (trained_config)
SHOWN = 6  # changes named in the console line; the others are counted (the journal holds each)


def config_changes(saved: RunConfig, new: RunConfig) -> list[dict[str, Any]]:
    """The keys whose value differs between the run's saved config and this session's, in the
    config's order, each {key, old, new, effect} (the shape of schedule.reconcile's changes);
    the IGNORED keys left out."""
    before, after = leaves(saved.to_dict()), leaves(new.to_dict())
    phase_added_or_dropped = not (saved.finetune.steps and new.finetune.steps)
    changes = []
    for key in [*after, *(k for k in before if k not in after)]:  # a key only one side has: none yet
        old, value = before.get(key), after.get(key)
        if phase_added_or_dropped and key.startswith("finetune."):
            continue
        if old != value and not _ignored(key):
            said = unread(key, new) or effect(key, old, value)
            changes.append({"key": key, "old": old, "new": value, "effect": said})
    return changes


# The size of the BPE a new run trains (data/tokenizer.py): a resume reads its run's tokenizer instead
# (training/run_tokenizer.py tokenizer_source), whose size its embeddings have
BPE_SIZE_KEYS = ("data.bpe_vocab_size", "finetune.data.bpe_vocab_size")
# The sections only one command's runs read (rl.enabled, dpo.enabled): the run, the command
POLICY_SECTIONS = {"rl": ("an RL run", "trimtab rl"), "dpo": ("a DPO run", "trimtab dpo")}


def unread(key: str, cfg: RunConfig) -> str:
    """The effect of a key the run never reads: RL's settings in a run that is no RL run, DPO's in
    one that is no DPO run (a dpo.* edit on an RL run was said to be in effect), the BPE's size on
    a resume; empty otherwise."""
    if key in BPE_SIZE_KEYS:  # said "in effect from this step" while the run kept its 512-token BPE
        return "no effect: a resumed run keeps the tokenizer it trained with (its tokenizer.json); a new run trains one"
    section, _, name = key.partition(".")
    if section in POLICY_SECTIONS and name != "enabled" and not getattr(cfg, section).enabled:
        run, command = POLICY_SECTIONS[section]
        return f"no effect: this is not {run} (only {command} reads {section}.*)"
    return ""


def trained_config(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint keeps of the config it was trained with (state.json TRAINED, ~8 KB): its values
    and who set each key (config/provenance.py). With config.yaml alone, a person's edit of it in place,
    then `trimtab train RUN/config.yaml --out RUN`, compared the file with itself: never said."""
    return {"values": cfg.to_dict(), "set_by": sources(cfg)}


def changes_on_resume(cfg: RunConfig, trained: Any = None) -> list[dict[str, Any]]:
    """config_changes from the config the resumed checkpoint was trained with (`trained`, its state.json
    TRAINED: trained_config) to `cfg`; for a checkpoint without one (an older trimtab's, a merge's) from
    the run directory's config.yaml, read before this session writes its own over it. None found where
    that is missing or damaged: setup's check_resume_compatible says so, and the checkpoint is checked."""
    before, set_by = _trained_with(trained, cfg)
    if before is None:
        return []
    return _mark_origins(config_changes(before, cfg), cfg, set_by)


def checkpoint_config(trained: Any) -> RunConfig | None:
    """The config a checkpoint was trained with, from its own copy (`trained`: state.json TRAINED); None
    for a checkpoint without one (an older trimtab's, a merge's) or a copy not read (a hand edit of it)."""
    if not (isinstance(trained, dict) and isinstance(trained.get("values"), dict)):
        return None
    try:
        return resolve_saved(trained["values"], "the resumed checkpoint's config (state.json)")
    except ConfigError as exc:
        log.debug("the checkpoint's config is not read (%s): config.yaml is compared", exc)
        return None


def _trained_with(trained: Any, cfg: RunConfig) -> tuple[RunConfig | None, dict[str, str] | None]:
    """The config a resumed checkpoint was trained with, and who set its keys (None: unknown)."""
    before = checkpoint_config(trained)
    if before is not None:
        set_by = trained.get("set_by")
        _say_unread_edit(before, cfg)
        return before, {str(k): str(v) for k, v in set_by.items()} if isinstance(set_by, dict) else None
    try:
        saved = read_saved(cfg.run_dir)
    except SavedConfigError as exc:
        log.debug("no config changes read: %s", exc)
        return None, None
    return saved, saved_sources(cfg.run_dir / CONFIG)


def _say_unread_edit(before: RunConfig, cfg: RunConfig) -> None:
    """A person's edit of RUN/config.yaml that this session's config does not read (resumed with `--preset`
    and flags, not the file): config.yaml is written over with this session's, so the edit is said, not lost
    unsaid."""
    try:
        edits = config_changes(before, read_saved(cfg.run_dir))
    except SavedConfigError:
        return
    now = leaves(cfg.to_dict())
    unread = [f"{c['key']} {show(c['old'])} -> {show(c['new'])}" for c in edits if now.get(c["key"]) != c["new"]]
    if unread:
        log.warning(
            "%s was edited since the checkpoint (%s), but this session's config is not that file: the edit is "
            "not applied, and this session writes its own config.yaml over it; to apply it, resume with the "
            "file as the config (`trimtab train %s --out %s`)",
            cfg.run_dir / CONFIG,
            "; ".join(unread[:SHOWN]) + (f"; and {len(unread) - SHOWN} more" if len(unread) > SHOWN else ""),
            cfg.run_dir / CONFIG,
            cfg.run_dir,
        )


NOT_REPEATED, MOVED = "not repeated", "default moved"  # a `default` change's `by`: which of the two


def _mark_origins(changes: list[dict[str, Any]], cfg: RunConfig, before: dict[str, str] | None) -> list[dict]:
    """Each change with who made it (`by`): where this session's config set the key (a person's, even
    at the default's value: an explicit --set equal to it was said to be the default); else, where its
    new value is this trimtab's own for the run's preset, marked `default` (no person's doing in this
    session: a user upgrading mid-run read a moved default as their change), `by` NOT_REPEATED where
    the earlier session (`before`: the keys it set, None when unknown) had set it, MOVED where not."""
    if not changes:
        return changes
    mine = sources(cfg)
    defaults = leaves(load_config(preset=cfg.preset, overrides={"out": str(cfg.run_dir)}).to_dict())
    marked = []
    for c in changes:
        key = c["key"]
        if key in mine:
            marked.append({**c, "by": mine[key]})
        elif key in defaults and defaults[key] == c["new"]:
            marked.append({**c, "default": True, **_which_default(key, before)})
        else:
            marked.append(c)
    return marked


def _which_default(key: str, before: dict[str, str] | None) -> dict[str, str]:
    """A `default` change's `by`: NOT_REPEATED (with where the session before set it) or MOVED; {} unknown."""
    if before is None:
        return {}
    return {"by": NOT_REPEATED, "set_by": before[key]} if key in before else {"by": MOVED}


def changes_line(changes: list[dict[str, Any]], step: int) -> str:
    """One console line for a resume's config changes, e.g. `config changed on resume at step 20:
    optim.lr 0.0005 -> 0.001 (LR x2 at once, no warm-up); train.batch_tokens 1024 -> 2048 (x2
    tokens a step; the LR is not rescaled)`; empty when there are none."""
    if not changes:
        return ""
    named = [f"{c['key']} {show(c['old'])} -> {show(c['new'])}{_by(c)} ({c['effect']})" for c in changes[:SHOWN]]
    more = f"; and {len(changes) - SHOWN} more (decisions.jsonl)" if len(changes) > SHOWN else ""
    return f"config changed on resume at step {step}: {'; '.join(named)}{more}"


def journal_text(change: dict[str, Any], step: int) -> tuple[str, str]:
    """A change's decision summary and reasoning, worded as those of a changed phase length."""
    summary = f"{change['key']} {show(change['old'])} -> {show(change['new'])}{_by(change)} on resume at step {step}"
    if not change.get("default") and by_command(change.get("by", "")):  # trimtab rl's own: not a person's flag
        return summary, f"changed in the config by {change['by']}, not by a person: {change['effect']}"
    if not change.get("default"):
        by = f" (set by {change['by']})" if change.get("by") else ""
        return summary, f"changed in the config by a person{by}: {change['effect']}"
    old, new = show(change["old"]), show(change["new"])
    keep = f"set it to keep {old}"
    unset = f"not set by this session's config, which leaves it at this trimtab's default ({new}); "
    if change.get("by") == NOT_REPEATED:
        why = f"the run was trained with {old}, set by {change['set_by']} in the session before and not repeated"
    elif change.get("by") == MOVED:
        why = f"the run was trained with {old}, the default of the trimtab that wrote its config.yaml, which has moved"
    else:
        why = (
            f"the run was trained with {old}, which an earlier session set and this one did not repeat, or the "
            "default then, which has moved since (this config.yaml keeps values, not who set them: which of the "
            "two is not known)"
        )
    return summary, f"{unset}{why}; {keep}: {change['effect']}"


def _by(change: dict[str, Any]) -> str:
    """What a change is said to be when it is not a person's setting: a subcommand's own (trimtab rl's), or
    this version's default: an earlier session's setting not repeated, or the default moved (or, config.yaml
    silent on who set what, either)."""
    if not change.get("default"):  # a person's: their --set, file or flag is in the reasoning (journal_text)
        return f" (set by {change['by']})" if by_command(change.get("by", "")) else ""
    said = {
        NOT_REPEATED: f"set by {change.get('set_by')} in the session before, not repeated",
        MOVED: "the default moved",
    }
    return f" (this version's default: {said.get(change.get('by'), 'the old value not repeated or the default moved')})"


def effect(key: str, old: Any, new: Any) -> str:
    """What the change does to the run from the resume on, short, for the keys whose effect is
    not plain (a jump in the LR, a batch of another size, a seed the checkpoint overrides, a live
    router knob set over the checkpoint's value)."""
    if key == "optim.lr":
        return f"LR x{_ratio(old, new)} at once, no warm-up"
    if key == "finetune.optim.lr":
        return f"the finetune phase's LR x{_ratio(old, new)} (at once, without a warm-up, if it has begun)"
    if key == "train.batch_tokens":
        return f"x{_ratio(old, new)} tokens a step; the LR is not rescaled"
    if key.startswith("model."):  # any other model.* change is refused before (setup.check_resume_compatible)
        return "a live router knob: applied over the checkpoint's value"
    if key == "train.seed":
        return "the data order and random state stay the checkpoint's"
    if key.startswith(("optim.", "finetune.optim.")):
        return "the optimizer uses it from this step"
    return "in effect from this step"


def show(value: Any) -> str:
    """A config value as the console shows it: floats short (0.0005), empty strings quoted."""
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return "''"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _ratio(old: Any, new: Any) -> str:
    return f"{new / old:.3g}" if isinstance(old, (int, float)) and old else "?"


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in IGNORED)
