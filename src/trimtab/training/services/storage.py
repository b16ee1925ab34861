"""checkpoint.dir in object storage (storage.py, docs/storage.md), around the loop: the store
opened and checked at start-up (before anything is written), a run directory without a valid
checkpoint restored from it (with the run's record files: metrics, decisions, goodput), and
each committed checkpoint uploaded by a hook on rank 0, the record files as they were at it after.

The upload starts once the checkpoint is on disk (Hook.on_checkpoint: at once for a synchronous
save, when the next save or the run's end collects a background one) and runs in a thread of its
own while training goes on (RemoteCheckpoints). A failed upload is said and training goes on:
the run directory's checkpoint is the resume point, and the next checkpoint is uploaded again
(unless another process took the prefix over: StoreTakenError, and this run uploads no more).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.checkpoint import checkpoint_root, list_checkpoints, verify
from trimtab.config import DataConfig, RunConfig, derive, read_saved
from trimtab.config.checks import leaves
from trimtab.config.model import LIVE_MODEL_KEYS
from trimtab.errors import ConfigError, SavedConfigError
from trimtab.resilience.goodput import add_after_end
from trimtab.resilience.incidents import mark_restored
from trimtab.rundir import GOODPUT_FILE, STEP_FILE, read_metrics
from trimtab.storage import (
    END_FILES,
    MANIFEST,
    RECORD_FILES,
    RUN_FILES,
    STEP,
    Remote,
    StoreTakenError,
    is_url,
    mirror,
    open_remote,
    redact,
    restore,
    retain,
    step_of,
)
from trimtab.training.hooks import Hook

if TYPE_CHECKING:
    from trimtab.training.view import RunView

log = logging.getLogger(__name__)
WAIT_WARN_S = 5.0  # training held this long by the upload before it is said (a slow or unreachable store)
# what goes up after each checkpoint and at the end: the run's record, and config.yaml, which each resume
# rewrites (a lengthened run, a changed setting); uploaded only while run/ lacked it, the store kept the
# first session's (or a damaged copy), which a fresh machine, eval, export and generate then read
UPDATED = (*RECORD_FILES, "config.yaml")
# after each checkpoint, all but the ledger's step mark: copied at the checkpoint's commit it names that
# step, so a session lost later read, restored on a fresh machine, as ended there exactly (debug, kill -9
# at step 10, store's newest step 8: "at step 8 ... 0 steps lost", step_exact true); without it the steps
# lost are the lower bound docs/resilience.md says. The end's upload, the session closed, has it.
AT_CHECKPOINT = tuple(name for name in UPDATED if name != STEP_FILE)
# how upload_before_exit names what it uploads (`saved`: the newest checkpoint, rank 0 lost before it was uploaded)
NAMED = {False: "the emergency save", True: "the newest checkpoint, saved before the loss"}


def open_store(cfg: RunConfig) -> Remote | None:
    """checkpoint.dir opened and checked (storage.open_remote: ConfigError, exit 2), or None
    when it is empty. Under torchrun every rank checks it (each fails alike, before any
    collective); rank 0 alone restores and uploads: a sharded checkpoint is one directory that
    every rank wrote into, on the file system the job shares, and is uploaded and restored whole.
    Not with resilience.ft: each replica group keeps checkpoints of its own, which one prefix
    cannot hold apart. A prefix holding another model's run is refused (same_model) before
    anything of it is downloaded."""
    url = cfg.checkpoint.dir
    if not url:
        return None
    if cfg.resilience.ft.enabled:
        raise ConfigError(
            "config key 'checkpoint.dir': object storage for checkpoints is not built for resilience.ft's replica "
            "groups yet; unset checkpoint.dir (or resilience.ft.enabled)"
        )
    remote = open_remote(url)
    same_model(remote, cfg)
    return remote


def same_model(remote: Remote, cfg: RunConfig) -> None:
    """ConfigError naming checkpoint.dir and the model.* keys that differ when `remote` holds a run
    (its run/config.yaml) of another model than `cfg`'s: restored, its files would fill this run's
    --out before the resume refused the model; written to, this run would take the other's
    prefix over and prune its checkpoints. The live knobs (LIVE_MODEL_KEYS) may differ, as on a
    resume; model.vocab_size 0 (the tokenizer's) is settled only once the tokenizer is read. Not
    compared with train.init_from set: the model is the one it names (a Hugging Face model's or a
    run's), read later, and a run of it was refused as "another model" (the preset's sizes here)."""
    if cfg.train.init_from:
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not remote.get_run_files(Path(tmp), ("config.yaml",)):
            return
        try:
            saved = leaves(read_saved(tmp).to_dict()["model"], "model.")
        except SavedConfigError as exc:  # damaged: the resume checks the model against the checkpoint
            log.warning("%s/run/config.yaml: not compared with this run's model (%s)", remote.url, exc.problem)
            return
    ours = leaves(cfg.to_dict()["model"], "model.")
    differ = [
        f"{k}: {saved.get(k)!r} there, {v!r} here"
        for k, v in ours.items()
        if saved.get(k) != v and k not in LIVE_MODEL_KEYS and not (k == "model.vocab_size" and v == 0)
    ]
    if differ:
        raise ConfigError(
            f"config key 'checkpoint.dir' = '{remote.url}' holds another run, of a different model "
            f"({'; '.join(differ[:4])}{f'; and {len(differ) - 4} more' if len(differ) > 4 else ''}); give this "
            "run a checkpoint.dir of its own, or that run's model settings to resume it"
        )


def restore_from(
    remote: Remote, run_dir: Path, also: tuple[str, ...] = (), refused: list[dict[str, Any]] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """A run directory with no valid checkpoint (a fresh machine, a lost disk): the run files it
    lacks and the newest valid checkpoint in `remote`, downloaded and verified, and the `also`
    steps (the step-0 checkpoint RL's KL term and DPO read their reference from: reference_steps);
    None: none there. The store's checkpoints that failed verification go into `refused`."""
    got = remote.get_run_files(run_dir, RUN_FILES + RECORD_FILES + END_FILES)
    if got:
        log.info("restored %s from %s/run", ", ".join(got), remote.url)
    if GOODPUT_FILE in got:  # its sessions ran elsewhere: their ranks' records are not here (incidents.py)
        mark_restored(run_dir, remote.url)
    found = restore(remote, checkpoint_root(run_dir), verify, refused=refused)
    if found is None:
        log.info("%s holds no complete checkpoint: the run starts at step 0", remote.url)
        return None
    for name in also:
        if name != found[0].name and restore(remote, checkpoint_root(run_dir), verify, only=name) is None:
            log.warning("%s/%s: not in the store; what reads it will say so", remote.url, name)
    return found


def newer_in_store(
    remote: Remote, run_dir: Path, found: tuple[Path, dict[str, Any]], refused: list[dict[str, Any]] | None = None
) -> tuple[Path, dict[str, Any]]:
    """`found`, the run directory's newest valid checkpoint, unless the store holds a newer complete
    one of a step this directory never trained to: a disk left behind when the run moved to
    another machine, which trained on and uploaded. Resumed from its own checkpoint, the run
    redid that work unsaid, and its first upload's retention deleted the store's newer ones (they
    read as a rolled-back trajectory). Such a checkpoint is restored, with the store's record
    files (the newer sessions' metrics, decisions and ledger). A store's newer checkpoint of a step
    this directory did train to (its metrics, its step mark, a rolled-back copy) stays where it
    is: a trajectory rolled back, or a copy found corrupt here."""
    newer = [n for n in remote.listing()[0] if step_of(n) > step_of(found[0].name)]
    if not newer:  # the common resume: nothing newer there, and the metrics are not read
        return found
    trained = _trained_here(run_dir)
    for name in reversed([n for n in newer if step_of(n) > trained]):
        restored = restore(remote, checkpoint_root(run_dir), verify, only=name, refused=refused)
        if restored is not None:
            log.warning(
                "%s: its newest checkpoint is %s, this directory trained to step %d, and %s holds step %d, "
                "trained elsewhere (the run moved to another machine): resuming from the store's",
                run_dir,
                found[0].name,
                trained,
                remote.url,
                step_of(name),
            )
            remote.get_run_files(run_dir, RECORD_FILES, replace=True)
            return restored
    return found


def _trained_here(run_dir: Path) -> int:
    """The furthest step this run directory's sessions trained to, as far as it says: its metrics
    (abandoned lines too), the last session's step mark, the checkpoints a rollback set aside."""
    steps = [int(m["step"]) for m in read_metrics(run_dir, abandoned=True) if isinstance(m.get("step"), int)]
    with contextlib.suppress(OSError, ValueError, IndexError):
        steps.append(int((run_dir / STEP_FILE).read_text().split()[1]))
    attic = checkpoint_root(run_dir) / "rolled_back"
    steps += [step_of(p.name) for p in attic.iterdir() if STEP.match(p.name)] if attic.is_dir() else []
    return max(steps, default=-1)


def reference_steps(cfg: RunConfig) -> tuple[str, ...]:
    """The checkpoints besides the newest a restored run reads: RL's KL term and DPO compare with
    the run's step-0 weights (rl/reference.py)."""
    return ("step_000000",) if cfg.dpo.enabled or (cfg.rl.enabled and cfg.rl.kl_coef) else ()


def local_sources(cfg: RunConfig) -> RunConfig:
    """`cfg` with every data path in object storage (data.source, its mix, eval_source and
    tokenizer, the same under finetune.data) replaced by its copy in the cache (storage.mirror:
    a file or a whole prefix, prepared shards included, fetched once and used again while the
    store's listing is unchanged); `cfg` itself when none is a URL."""
    changes = {}
    for section, data in (("data", cfg.data), ("finetune.data", cfg.finetune.data)):
        found = _local_data(data, section)
        if found:
            changes[section] = found
    if not changes:
        return cfg
    nested = {"data": changes.get("data", {})} if "data" in changes else {}
    if "finetune.data" in changes:
        nested["finetune"] = {"data": changes["finetune.data"]}
    return derive(cfg, nested)


def _local_data(data: DataConfig, section: str) -> dict[str, Any]:
    def local(value: str | list[str], key: str) -> str | list[str]:
        if isinstance(value, list):
            return [local(v, f"{key}[{i}]") for i, v in enumerate(value)]
        return str(mirror(value, key)) if value and is_url(value) else value

    changes = {}
    for name in ("source", "eval_source", "tokenizer"):
        value = getattr(data, name)
        if _has_url(value):
            changes[name] = local(value, f"{section}.{name}")
    if any(_has_url(m.source) for m in data.mix):
        changes["mix"] = [
            {"source": local(m.source, f"{section}.mix[{i}].source"), "weight": m.weight, "name": name}
            for i, (m, name) in enumerate(zip(data.mix, data.names))
        ]
    return changes


def _has_url(value: str | list[str]) -> bool:
    return any(is_url(v) for v in value) if isinstance(value, list) else bool(value) and is_url(value)


class RemoteCheckpoints(Hook):
    """Uploads each checkpoint once it is on disk (manifest last), in a thread of its own, then
    prunes the store as the run directory was pruned (storage.retain).

    The upload works on hard links of the checkpoint's files in checkpoints/.upload/ (made at
    once: a checkpoint's files are written once and never changed), so training goes on while it
    uploads and the run directory's own pruning, rollback or corrupt-checkpoint handling may move
    the checkpoint meanwhile. One upload at a time: the next checkpoint waits for the one before
    (its stall is what uploading is slower than checkpointing); the run's end waits for the last.
    A process killed mid-upload leaves a prefix without state.json: partial, never resumed from."""

    def __init__(self, url: str, run_dir: Path, keep: int, rank: int = 0) -> None:
        """`rank` other than 0: a survivor that wrote the emergency save, rank 0 lost (training/emergency.py), opened
        at its exit: the store not checked again (every rank checked it at start-up; a request here would not be
        bounded by the exit's UPLOAD_BY_S), its links in a folder of its own (a late rank 0's may be in flight)."""
        self.remote = open_remote(url, check=rank == 0)
        self.run_dir, self.keep = Path(run_dir), keep
        root = checkpoint_root(self.run_dir)
        self.staging = root / (".upload" if rank == 0 else f".upload_rank{rank}")
        for old in root.glob(".upload*") if rank == 0 else [self.staging]:  # a killed session's links
            shutil.rmtree(old, ignore_errors=True)
        self._thread: threading.Thread | None = None
        self._uploading = ""  # the checkpoint the thread uploads
        self._current = False  # the store holds this session's newest checkpoint, uploaded whole
        self._taken = False  # another process took the prefix over (StoreTakenError): no more uploads
        self._error = ""  # the last upload's failure in words (_failed): said by upload_before_exit
        self._held = ""  # a checkpoint the store held whole already (upload_before_exit `saved`): not uploaded
        # upload_before_exit from two threads at once (the watchdog's hang exit, the loop's lost peer): one at a time
        self._exiting = threading.Lock()

    def on_save_stall(self, run: RunView) -> None:
        """The next save waits here for the upload in flight, inside the save's own time, so the
        stall counts as checkpointing; waited for in on_checkpoint instead, after the goodput
        ledger (an earlier hook) had read save_seconds, it was time between steps no bucket took.
        A background save's stall is its collection, before the upload of what it collected starts."""
        self.wait()

    def on_checkpoint(self, run: RunView, path: Path) -> None:
        self.wait()
        self._start(Path(path), AT_CHECKPOINT)

    def _start(self, path: Path | None, names: tuple[str, ...], unless_held: bool = False) -> None:
        """The upload of checkpoint `path` (None: of the record alone; `unless_held`: nor of `path` where the store
        holds it whole) and then of the record files `names`, as they are now, started in a thread of its own."""
        if self._taken:
            return
        self._error = ""
        name = path.name if path is not None else "record"
        if path is not None:
            self._current = False  # until this checkpoint's upload ends whole
            if not path.is_dir():  # pruned already when a background save is collected late: nothing to copy
                return
        try:
            links = _link(path, self.staging / path.name) if path is not None else None
            records = _copy_records(self.run_dir, self.staging / f"{name}.run", names)  # as they are at this step
        except OSError as exc:
            self._failed(name, exc)
            return
        self._uploading = name
        args = (links, records, names, unless_held)
        self._thread = threading.Thread(target=self._upload, args=args, name=f"upload-{name}", daemon=True)
        self._thread.start()

    def upload_before_exit(
        self, path: Path | None, began: float, bound_s: float, after: str = "the loss", saved: bool = False
    ) -> str:
        """The process ends next (a peer lost: training/emergency.py; a hang: the watchdog's os._exit), which cuts
        an upload's thread (a daemon): the upload in flight finished, then `path` (an emergency save written here;
        `saved`: the run directory's newest checkpoint, saved before the loss, uploaded only where the store lacks
        it whole: rank 0, its uploader, lost; None: none) uploaded with the whole record, its step mark too (the
        session ends at that step: a fresh machine's restart says how far it got exactly), or, None, the record
        alone where the store holds this session's newest checkpoint; each waited for until `bound_s` after `began`
        (time.monotonic(), when `after` happened). What the store holds, in one line (empty: nothing to say, or
        another thread's exit says it)."""
        if not self._exiting.acquire(timeout=max(0.0, began + bound_s - time.monotonic())):
            return ""
        try:
            return self._before_exit(path, began, bound_s, after, saved)
        finally:
            self._exiting.release()

    def _before_exit(self, path: Path | None, began: float, bound_s: float, after: str, saved: bool) -> str:
        flight, url = self._uploading if self._thread is not None else "", self.remote.url
        if not self._joined(began + bound_s):
            named = f"{path.name} ({NAMED[saved]}) not uploaded, and " if path is not None else ""
            return (
                f"{named}the upload of {flight} to {url} was still running {bound_s:.0f} s after {after}: cut at "
                "the exit (a step_N/ without state.json, never resumed from); the restart resumes from the run "
                "directory's checkpoint, a fresh machine from the store's newest whole one"
            )
        if path is not None:
            return self._emergency_upload(path, began, bound_s, saved)
        if self._current:  # else the last upload failed: the record would run past the store's newest checkpoint
            self._start(None, UPDATED)
            self._joined(began + bound_s)
        return f"the upload of {flight} to {url} finished before the exit" if flight and self._current else ""

    def _emergency_upload(self, path: Path, began: float, bound_s: float, saved: bool) -> str:
        """upload_before_exit's upload of `path` (an emergency save; `saved`: the newest checkpoint), in words."""
        url, what = self.remote.url, NAMED[saved]
        if self._taken:
            why = "this run's uploads there stopped: another process took the prefix over"
        else:
            self._start(path, UPDATED, unless_held=saved)
            if self._joined(began + bound_s) and self._current:
                seconds = time.monotonic() - began
                if self._held == path.name:
                    return f"{path.name} ({what}) was in {url} whole; the record with the step mark uploaded"
                return f"{path.name} ({what}) uploaded to {url}, {seconds:.1f} s after the loss"
            cut = f"still uploading {bound_s:.0f} s after the loss: cut at the exit"
            why = cut if self._thread else self._error or "its files were gone from the run directory"
        return (
            f"{path.name} ({what}) not uploaded to {url} ({why}); the restart resumes from the run "
            "directory's copy, a fresh machine from the store's newest whole checkpoint"
        )

    def _joined(self, deadline: float) -> bool:
        """Whether the upload in flight, if any, ended by `deadline` (time.monotonic())."""
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        """The last upload finished; a final checkpoint set aside after its upload (rolled_back/)
        leaves the store too; the run's record goes up once more, as it ends: the goodput ledger
        (an earlier hook: api.built_in_hooks) has closed this session, which a run restored from
        the store would otherwise take for a lost one (a restart incident, its gap down time). The
        wait for the last upload comes after that close: it is added to the closed session's
        checkpoint bucket (goodput.add_after_end), and to the summary's goodput."""
        if self._thread is not None:
            started = time.monotonic()
            self.wait()
            if "goodput" in summary:  # the ledger's hook ran: this run keeps one
                totals = add_after_end(self.run_dir, "checkpoint", time.monotonic() - started)
                summary["goodput"] = totals or summary["goodput"]
        if self._taken:
            return
        try:
            self._retain()
            if self._current:  # records past the store's newest checkpoint would not match it
                self.remote.put_run_files(self.run_dir, UPDATED)
        except Exception as exc:
            log.warning(
                "%s: not pruned, or the run's record not uploaded at its end (%s: %s)",
                self.remote.url,
                type(exc).__name__,
                redact(exc),
            )

    def on_summary(self) -> None:
        """summary.json and the report, once the run wrote them (api.train_or_raise: after every
        hook's on_train_end), into run/: a finished run restored on a fresh machine reads as
        finished. Skipped as the end's record is (the last upload failed, or the prefix was taken
        over): a failure is said, and the run's outcome stands."""
        if self._taken or not self._current:
            return
        try:
            self.remote.put_run_files(self.run_dir, END_FILES)
        except Exception as exc:
            log.warning(
                "%s: summary.json and the report not uploaded at the run's end (%s: %s); a fresh machine "
                "restoring this run writes them again",
                self.remote.url,
                type(exc).__name__,
                redact(exc),
            )

    def wait(self) -> None:
        """Until the upload in flight, if any, has ended (it says its own failure); a wait past
        WAIT_WARN_S is said, naming the store, as it starts and when it ends."""
        if self._thread is None:
            return
        started = time.monotonic()
        self._thread.join(WAIT_WARN_S)
        if self._thread.is_alive():
            where = f"{self._uploading} to {self.remote.url} (checkpoint.dir)"
            log.warning(
                "training waits for the upload of %s: %.0f s so far (a slow or unreachable store)", where, WAIT_WARN_S
            )
            self._thread.join()
            log.warning("the upload of %s held training %.0f s", where, time.monotonic() - started)
        self._thread = None

    def _upload(self, links: Path | None, records: Path, names: tuple[str, ...], unless_held: bool = False) -> None:
        """`links` (a checkpoint's; None: the record alone; `unless_held`: nor it where the store holds it whole),
        then the record files `names` from `records`."""
        try:
            if links is not None and unless_held and self._holds(links):
                self._held = links.name  # rank 0 uploaded it before it was lost
            elif links is not None:
                held = tuple(name for name in RUN_FILES if (self.run_dir / name).is_file())
                self.remote.put_run_files(self.run_dir, self.remote.lacks(held))  # the first, or the store lost them
                self.remote.upload(links)
            self.remote.put_run_files(records, names)  # after the checkpoint they lead up to
            if links is not None:
                self._retain()
                self._current = True
        except Exception as exc:  # a network or store failure: the local checkpoint stands
            self._failed(links.name if links is not None else "the run's record", exc)
        finally:
            if links is not None:
                shutil.rmtree(links, ignore_errors=True)
            shutil.rmtree(records, ignore_errors=True)

    def _holds(self, links: Path) -> bool:
        """Whether the store holds checkpoint `links` whole: its state.json, written last (the manifest: every
        file's size and sha256), the same bytes. Not the listing's word alone: a step saved again after a rollback
        has the rolled-back trajectory's copy there, whole, until its own upload begins."""
        try:
            there = self.remote.fs.cat_file(f"{self.remote.root}/{links.name}/{MANIFEST}")
        except FileNotFoundError:
            return False
        return there == (links / MANIFEST).read_bytes()

    def _failed(self, name: str, exc: BaseException) -> None:
        self._error = f"{type(exc).__name__}: {redact(exc)}"
        if isinstance(exc, StoreTakenError):
            self._taken = True
            log.warning(
                "%s was not uploaded to %s: this run's uploads there stopped for good, training goes on (%s)",
                name,
                self.remote.url,
                redact(exc),
            )
            return
        log.warning(
            "%s was not uploaded to %s (%s: %s); training goes on, the next checkpoint is uploaded again",
            name,
            self.remote.url,
            type(exc).__name__,
            redact(exc),
        )

    def _retain(self) -> None:
        local = {p.name for p in list_checkpoints(self.run_dir)}
        if local:  # never prune the store after a run directory with nothing in it
            # a survivor's (rank != 0) leaves partial uploads alone: a late rank 0's may be in flight, its files cut
            retain(self.remote, local, self.keep, partial=self.staging.name == ".upload")


def _link(source: Path, target: Path) -> Path:
    """`target` holding hard links to every file of `source` (copies where the file system has no
    hard links): what the upload reads while the run directory goes on changing."""
    shutil.rmtree(target, ignore_errors=True)
    for file in (p for p in source.rglob("*") if p.is_file()):
        dest = target / file.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(file, dest)
        except OSError:
            shutil.copy2(file, dest)
    return target


def _copy_records(run_dir: Path, target: Path, names: tuple[str, ...] = AT_CHECKPOINT) -> Path:
    """`target` holding copies of the run's record files and config.yaml (`names`) as they are now: they
    are appended to and rewritten in place while the upload reads them."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in names:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, target / name)
    return target
