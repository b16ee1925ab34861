"""Atomic checkpoints: write to a temp dir, fsync, rename; verify on load; fall back when corrupt.

    checkpoints/step_000120/
        model.safetensors   weights (tied tensors stored once)
        optim.pt            optimizer state + RNG states (loaded with weights_only=True)
        state.json          step, tokens, data position, hook state, and a manifest
                            (size + sha256 of each file, state.json's own content included)
                            that makes truncation and bit flips detectable

A data-parallel run (torchrun, see trimtab.distributed) writes model and optimizer sharded with
torch.distributed.checkpoint instead, readable at any world size (a 1-process resume included):

    checkpoints/step_000120/
        dcp/.metadata, dcp/__<rank>_0.distcp   model + optimizer, one file per rank
        optim.pt            RNG state of every rank, GradScaler state
        state.json          as above; its manifest covers every rank's files

state.json records the checkpoint's format (FORMAT): a checkpoint of a newer format, written by a
newer trimtab, is refused with the fix (upgrade trimtab) instead of failing deep in a load, and
never taken for corrupt; one without it (written before formats were recorded) is format 0.

state.json is written last, inside the temp dir, so a directory named step_* is complete by
construction; the manifest still catches later damage (a truncated copy, a bad disk). A corrupt
checkpoint found at resume is moved to checkpoints/corrupt/ (set_aside_corrupt), where nothing
resumes from it; that folder keeps the newest checkpoint.keep. Every file of a checkpoint has the
same mode, the one the umask gives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trimtab import __version__
from trimtab.errors import CheckpointError, NewerCheckpointError
from trimtab.storage import fetch_run, is_url
from trimtab.write_errors import writing

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d{6,})$")
SHARDED = "dcp"  # the torch.distributed.checkpoint directory of a sharded checkpoint
STATE = "state.json"  # sealed by its own manifest entry (_sealed); written last, inside the temp dir
CORRUPT = "corrupt"  # checkpoints/corrupt/: corrupt checkpoints set aside at resume
REPLACED = "_replaced_"  # .tmp_step_N_replaced_<pid>: step_N renamed aside while it is saved again
_REPLACING: set[Path] = set()  # this process's aside copies whose replacement is under way
_SAID_CORRUPT: set[tuple[str, int, str]] = set()  # corrupt checkpoints warned of (say_skipped)
# What state.json's "format" says this code writes: raise it when a change to what a checkpoint holds
# (a renamed or new key a load needs, a new file) would break the load of an older trimtab.
FORMAT = 1


def local_run(path: str | Path, key: str) -> Path:
    """`path` as a local directory: a path as it is; a run in object storage (its checkpoint.dir,
    or a step_N under it) fetched into the cache with its newest valid checkpoint (or that one),
    verified (storage.fetch_run). `key` names the setting or argument in its errors. A URL must
    not go through Path first: Path("s3://b/x") is "s3:/b/x"."""
    if is_url(str(path)):
        return fetch_run(str(path), key, verify)
    return Path(path)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories, oldest first."""
    return step_dirs(checkpoint_root(run_dir))


def step_dirs(root: Path) -> list[Path]:
    """The step_N directories under `root` (checkpoints, lean snapshots), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def save_checkpoint(
    run_dir: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    protect: tuple[int, ...] = (),
    written: Callable[[], None] | None = None,
) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep` (plus `protect` steps).
    `written` runs once the files are in the temp directory, before the commit (where the
    kill_in_save fault lands)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(tmp):
            tmp.mkdir()
            save_file(dedup(model_state), str(tmp / "model.safetensors"))
            torch.save(optim_state, tmp / "optim.pt")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if written is not None:
        written()
    return commit_checkpoint(run_dir, step, tmp, state, keep, protect)


def commit_checkpoint(
    run_dir: Path,
    step: int,
    tmp: Path,
    state: dict[str, Any],
    keep: int,
    protect: tuple[int, ...] = (),
    digests: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Finish a checkpoint whose files are in `tmp`: state.json with the manifest of every file
    (`digests` holds those already hashed, e.g. by the rank that wrote them), fsync, rename to
    step_<step>, prune."""
    final = install(tmp, checkpoint_root(run_dir) / f"step_{step:06d}", {**state, "step": step}, digests)
    prune(run_dir, keep, protect=(*protect, step))
    return final


def install(tmp: Path, final: Path, state: dict[str, Any], digests: dict[str, dict[str, Any]] | None = None) -> Path:
    """Seal the files in `tmp` (state.json with the manifest of every file: `digests` holds those
    already hashed, e.g. by the rank that wrote them), fsync, and rename it to `final` (a
    checkpoint, a lean snapshot), replacing one there; `tmp` is removed on any failure."""
    try:
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        files = [name for name in files if name != STATE]  # its entry is its seal (_sealed)
        manifest = {name: (digests or {}).get(name) or _digest(tmp / name) for name in files}
        _write_json(tmp / STATE, _sealed({**state, "format": FORMAT, "manifest": manifest}))
        # safetensors writes 0600, torch and dcp 0666 & ~umask: give every file the mode open() gave
        # state.json (reading the umask with os.umask would set it process-wide for a moment)
        mode = (tmp / "state.json").stat().st_mode & 0o777
        for name in files:
            os.chmod(tmp / name, mode)
        for name in (*files, "state.json"):
            _fsync(tmp / name)
        for folder in {(tmp / name).parent for name in files}:
            _fsync(folder)
        _fsync(tmp)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. One there already (a step saved again after a rollback restored
    it) is renamed aside first and deleted only once the new one is in place: deleting it first
    would leave a killed process no copy of the step, or a half-deleted one that fails its
    manifest, for as long as the deletion of a checkpoint's gigabytes takes. A kill between the
    two renames leaves the step in its aside copy and the new one's temp folder: put_back_replaced
    makes the new one (or, invalid, the old) step_N again."""
    old = final.with_name(f".tmp_{final.name}{REPLACED}{os.getpid()}")
    _REPLACING.add(old)
    try:
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old.exists():
                os.replace(old, final)
            raise
        _fsync(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        _REPLACING.discard(old)


def put_back_replaced(root: Path) -> list[Path]:
    """Each step saved again (_replace_dir) whose step_N is missing, put back as step_N: a process
    killed between _replace_dir's two renames had it nowhere else. The new copy, sealed in its
    temp folder, is the one put back when it is valid (it holds what the run decided since, a
    rollback's skipped rows among it), else the aside copy. One whose step_N is in place is left
    for prune() to delete; invalid copies are left as they are (said). Returns the steps put back.
    A folder this process may not rename in (another run's, read for train.init_from) is only
    read: the copy is said, and the resume takes an older step."""
    restored = []
    for aside in sorted(root.glob(f".tmp_step_*{REPLACED}*")) if root.is_dir() else []:
        final = _replaced_step(aside)
        if aside in _REPLACING or final.exists() or not STEP_DIR.match(final.name):
            continue  # a replacement under way in this process (a background save), or nothing lost
        pid = aside.name.partition(REPLACED)[2]
        newer = [p for p in (root / f".tmp_{final.name}_{pid}", root / f".tmp_{final.name}_sharded") if p.is_dir()]
        for copy in (*newer, aside):
            try:
                verify(copy)
                os.replace(copy, final)
            except (CheckpointError, OSError) as exc:
                log.warning("%s: a copy of %s, not put back (%s)", copy, final.name, exc)
                continue
            log.warning("%s: put back as %s (a process was killed while saving that step again)", copy, final)
            restored.append(final)
            break
    return restored


def _replaced_step(aside: Path) -> Path:
    """The step_N an aside copy (.tmp_step_N_replaced_<pid>) was renamed from."""
    return aside.with_name(aside.name.removeprefix(".tmp_").partition(REPLACED)[0])


def digest_files(paths: list[Path], base: Path) -> dict[str, dict[str, Any]]:
    """Manifest entries of `paths`, named relative to `base` (a rank hashes the shards it wrote)."""
    return {p.relative_to(base).as_posix(): _digest(p) for p in paths}


def prune(run_dir: Path, keep: int, protect: tuple[int, ...] = ()) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and the `protect` steps); returns the deleted."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return []  # data parallelism: one writer of the shared checkpoint directory (rank 0)
    put_back_replaced(checkpoint_root(run_dir))  # before the stale temp dirs go: it may be a step's only copy
    gone = [path for path in list_checkpoints(run_dir)[:-keep] if dir_step(path) not in protect]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    clear_stale(checkpoint_root(run_dir))
    return gone


def cadence_kept(run_dir: Path, step: int, every: int, keep: int) -> tuple[int, ...]:
    """The checkpoints the configured cadence would have kept at `step`: at each of its last `keep`
    steps (multiples of checkpoint.every, at most `step`), the newest checkpoint on disk at or before it.
    Kept by prune beside the newest `keep` while the interval is shorter than checkpoint.every
    (rule checkpoint_interval): those alone span keep x the short interval, and a rollback target
    older than that was deleted (an RL run at 1 step: rl_reward's target, step 0, gone at step 11,
    the run stopped). At most `keep` more checkpoints; the history spans keep x every again."""
    if every <= 0 or keep <= 0:
        return ()
    saved = [dir_step(path) for path in list_checkpoints(run_dir)]
    top = step // every * every
    marks = [top - k * every for k in range(keep) if top - k * every >= 0]
    return tuple(max((s for s in saved if s <= mark), default=-1) for mark in marks)


def clear_stale(root: Path) -> None:
    """Delete the temp folders killed writers left under `root` (checkpoints, lean snapshots):
    each is a whole copy of the weights that nothing reads, and every kill in a save adds one.
    Call it where this process has no save of its own under way there, after put_back_replaced."""
    for stale in root.glob(".tmp_step_*") if root.is_dir() else []:
        if REPLACED in stale.name and not _replaced_step(stale).exists():
            continue  # an invalid only copy, said by put_back_replaced: kept for a person to look at
        shutil.rmtree(stale, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """Return the checkpoint's state.json after checking every file against the manifest."""
    try:
        state = json.loads((path / "state.json").read_text())
        manifest = state["manifest"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable state.json ({exc})") from None
    check_format(path, state)
    # manifests written before state.json was sealed have no entry for it: nothing to check
    if STATE in manifest and _seal(state) != manifest[STATE]:
        raise CheckpointError(f"{path / STATE}: size or checksum differs from the manifest (truncated or corrupt)")
    for name, expected in ((n, e) for n, e in manifest.items() if n != STATE):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if _digest(file) != expected:
            raise CheckpointError(f"{file}: size or checksum differs from the manifest (truncated or corrupt)")
    return state


def check_format(path: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose state.json says a format newer than FORMAT (none: format 0)."""
    found = state.get("format", 0)
    if isinstance(found, int) and not isinstance(found, bool) and found <= FORMAT:
        return
    raise NewerCheckpointError(
        f"{path}: checkpoint format {found!r} is newer than this trimtab's ({__version__}: format {FORMAT} "
        "and older); it was written by a newer trimtab: upgrade trimtab (pip install -U trimtab) to resume, "
        "load or export it"
    )


def latest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest checkpoint that verifies; corrupt newer ones are skipped with a warning (what happens
    instead is the caller's to say: an older one, or none). A step whose only copy a killed save
    left aside is put back first (put_back_replaced)."""
    put_back_replaced(checkpoint_root(run_dir))
    return _newest_verified(list_checkpoints(run_dir), lambda state: True)


def search_valid(run_dir: Path) -> tuple[tuple[Path, dict[str, Any]] | None, dict[str, str]]:
    """latest_valid, with the corrupt newer checkpoints unsaid: returned as {path: verify's error}, for
    the caller to say once and record (a resume's set-aside) without hashing each of them again."""
    put_back_replaced(checkpoint_root(run_dir))
    refused: list[tuple[Path, CheckpointError]] = []
    found = _newest_verified(list_checkpoints(run_dir), lambda state: True, refused)
    return found, {str(path): str(exc) for path, exc in refused}


def set_aside_corrupt(run_dir: Path, after: int, keep: int) -> dict[Path, Path | None]:
    """Move the checkpoints newer than step `after` to checkpoints/corrupt/; returns where each went
    (None: more were set aside than the folder keeps, and its bound pruned this one at once).
    At resume `after` is the newest valid checkpoint's step (-1: none), so these are the ones that
    failed verification. Kept for inspection, they leave list_checkpoints' sight: never resumed
    from, never counted among the newest `keep`, which would otherwise make a restarted run prune
    its fresh checkpoints in favour of a newer corrupt one. The folder keeps the newest `keep`
    (_bound_attic): each is a whole checkpoint's bytes, and a failing disk sets one aside at every try."""
    attic = checkpoint_root(run_dir) / CORRUPT
    moved = {}
    for path in list_checkpoints(run_dir):
        if dir_step(path) > after:
            attic.mkdir(exist_ok=True)
            moved[path] = _unused(attic / path.name)
            os.replace(path, moved[path])
    _bound_attic(attic, keep)
    return {path: kept if kept.is_dir() else None for path, kept in moved.items()}


def _bound_attic(attic: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints in `attic` (rolled_back/, corrupt/), by modification time;
    bounded at every move into it, not only one that moved some (a rollback whose loads all failed retired
    checkpoints and put them back since, put_back_retired). Its other files (corrupt/'s record) are kept."""
    kept = [p for p in attic.iterdir() if p.is_dir()] if attic.is_dir() else []
    for old in sorted(kept, key=lambda p: p.stat().st_mtime)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(run_dir: Path, to: str | int = "last_good") -> tuple[Path, dict[str, Any]] | None:
    """A rollback target: the newest valid checkpoint marked good (`"last_good"`), or the newest
    valid one at or before step `to`."""
    if to == "last_good":
        return _newest_verified(list_checkpoints(run_dir), lambda state: bool(state.get("good")))
    return _newest_verified([p for p in list_checkpoints(run_dir) if dir_step(p) <= int(to)], lambda state: True)


def _newest_verified(
    paths: list[Path],
    wanted: Callable[[dict[str, Any]], bool],
    refused: list[tuple[Path, CheckpointError]] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest of `paths` (oldest first) that verifies and whose state is `wanted`, with that
    state; the corrupt ones newer than it are said (say_skipped), or, given `refused`, added to it
    unsaid. One a newer trimtab wrote is not corrupt: raised."""
    skipped: list[tuple[Path, CheckpointError]] = [] if refused is None else refused
    for path in reversed(paths):
        try:
            state = verify(path)
        except NewerCheckpointError:
            raise
        except CheckpointError as exc:
            skipped.append((path, exc))
            continue
        if wanted(state):
            if refused is None:
                say_skipped(skipped, path)
            return path, state
    if refused is None:
        say_skipped(skipped, None)
    return None


def say_skipped(skipped: list[tuple[Path, CheckpointError]], used: Path | None, instead: str = "") -> None:
    """Warn of each corrupt checkpoint passed over, with the one used instead (or `instead`, what
    is done: merge --method average's), once a process: the same search runs on several readers
    (a rule's has_good_checkpoint, then the rollback's own find_checkpoint; resume's latest_valid;
    export and merge), each of which said it again. A directory saved again at that step (a new
    inode) is new evidence and is said again."""
    if not instead:
        instead = f"falling back to {used} (step {dir_step(used)})" if used else "no valid checkpoint before it"
    for path, exc in skipped:
        try:
            seen = (str(path), path.stat().st_ino, str(exc))
        except OSError:  # moved aside meanwhile: say it
            seen = (str(path), -1, str(exc))
        if seen not in _SAID_CORRUPT:
            _SAID_CORRUPT.add(seen)
            log.warning("skipping corrupt checkpoint %s (%s); %s", path, exc, instead)


def saved_healthy(path: Path) -> bool:
    """Whether checkpoint `path` was saved while the run was healthy (state.json "good" not false:
    no escalation under way, no instability just before); False for one whose state.json cannot
    be read. Older checkpoints without the flag count as healthy."""
    try:
        return json.loads((Path(path) / STATE).read_text()).get("good", True) is not False
    except (OSError, ValueError):
        return False


def retire_after(run_dir: Path, step: int, keep: int) -> list[Path]:
    """After a rollback to `step`, newer checkpoints belong to an abandoned trajectory: move them to
    checkpoints/rolled_back/ (kept for inspection, newest `keep`) so resume never picks them."""
    attic = checkpoint_root(run_dir) / "rolled_back"
    moved = []
    for path in list_checkpoints(run_dir):
        if dir_step(path) > step:
            attic.mkdir(exist_ok=True)
            target = attic / path.name
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    _bound_attic(attic, keep)
    return moved


def put_back_retired(run_dir: Path, retired: list[Path]) -> list[Path]:
    """A rollback whose loads all failed kept the run's trajectory: the checkpoints it retired
    (retire_after) are moved back from checkpoints/rolled_back/, its resume points again; those
    pruned meanwhile or whose step is on disk again are left. Returns the ones put back."""
    back = []
    for path in retired:
        target = checkpoint_root(run_dir) / path.name
        if path.is_dir() and not target.exists():
            os.replace(path, target)
            back.append(target)
    return back


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDED).is_dir()


def dedup(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses aliased tensors: keep the first name of each storage."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[key] = tensor.detach().contiguous().cpu()
    return out


def _digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _sealed(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its own sha256 in its manifest (manifest["state.json"]). A file cannot hold
    its own digest, so the seal covers the content, less the seal itself (_seal)."""
    # hashed as it will read back (json round trip: int dict keys become strings, tuples lists),
    # so verify's hash of the parsed file matches
    return {**state, "manifest": {**state["manifest"], STATE: _seal(json.loads(json.dumps(state)))}}


def _seal(state: dict[str, Any]) -> dict[str, Any]:
    """The manifest entry of state.json: sha256 of its content without that entry, serialized
    canonically (so indentation is not part of it, and any changed value is)."""
    content = {**state, "manifest": {n: e for n, e in state.get("manifest", {}).items() if n != STATE}}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return {"sha256": hashlib.sha256(text.encode()).hexdigest()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unused(path: Path) -> Path:
    """`path`, or path.2, path.3, ... if taken: an earlier corrupt copy of the same step stays too."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def dir_step(path: Path) -> int:
    """The step a checkpoint or snapshot directory (step_NNNNNN) holds."""
    return int(STEP_DIR.match(path.name).group(1))
