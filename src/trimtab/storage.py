"""Checkpoints in object storage: `checkpoint.dir: s3://bucket/prefix` (any fsspec URL) holds a
copy of the run's checkpoints (docs/storage.md).

The run directory's checkpoints/ stays the working copy the trainer writes atomically (a rename);
each committed checkpoint is then uploaded here. An object store has no rename, so completeness is
said by order instead: every file of a checkpoint first, its state.json (the manifest: size and
sha256 of every file) last. A step_N prefix without state.json is an upload that did not finish
and is never resumed from; one whose files do not match the manifest is skipped for the one
before it, as on disk. The run's own files a resume reads (config.yaml, tokenizer.json) go to
run/ beside the checkpoints.

    s3://bucket/prefix/step_000120/{model.safetensors, optim.pt, state.json}
    s3://bucket/prefix/run/{config.yaml, tokenizer.json}

Credentials come from where the store's own client looks (for S3: the AWS environment variables,
~/.aws/credentials, AWS_PROFILE, an instance role; AWS_ENDPOINT_URL for another S3 API server),
never from the config: a URL with user:password@ is refused, and text that could hold an
endpoint's userinfo is redacted before it is said. Torch-free: it moves files and knows nothing
of their contents (the caller hands restore() its verify).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trimtab.errors import ConfigError, NewerCheckpointError, TrimtabError
from trimtab.extras import require
from trimtab.paths import cache_dir
from trimtab.rundir import (
    DECISIONS_FILE,
    GOODPUT_FILE,
    METRICS_FILE,
    PLAN_STATUS_FILE,
    STEP_FILE,
    SUMMARY,
    write_atomic,
)

log = logging.getLogger(__name__)
MANIFEST = "state.json"  # written last: its presence is what makes an uploaded checkpoint complete
RUN = "run"  # the run's own files a resume reads, beside the checkpoints
# the last two only beside a model initialised from a Hugging Face one (hf/importer.py SOURCE): without
# them a fresh machine read its tokenizer as trimtab's own, and refused it, and lost the model's source
RUN_FILES = ("config.yaml", "tokenizer.json", "tokenizer_config.json", "hf_source.json")
# run/writer.json: the process uploading here. A second one pointed at the prefix (a run started
# with another's checkpoint.dir, a machine thought lost that is still running) takes over at its
# first upload; the earlier one then stops writing, rather than both interleaving their
# checkpoints and each deleting the other's as "newer than its own" (retain).
WRITER = "writer.json"
_PROCESS = uuid.uuid4().hex  # this process: every Remote it opens writes as the same writer
# the run's record, uploaded again with each checkpoint (a fresh machine goes on with its loss
# curve, its decisions and its goodput ledger, with the ledger's mark of the last step done: without
# it a fresh machine's restart incident could not say a lost session's steps lost exactly,
# resilience/incidents.py; a resume drops the lines past its checkpoint), and the live planner's
# status blocks (the report's convergence plot: without them a fresh machine's report began at its restore)
RECORD_FILES = (METRICS_FILE, DECISIONS_FILE, GOODPUT_FILE, STEP_FILE, PLAN_STATUS_FILE)
# what the run's end writes after every hook (api.train_or_raise): uploaded then, restored with the run
# files. Without summary.json a finished run restored on a fresh machine read as one whose last session
# ended before writing it ("has not finished"); report.html (trimtab.report.REPORT) is the run's report.
END_FILES = (SUMMARY, "report.html")
STEP = re.compile(r"^step_(\d{6,})$")
# stores whose first path component is a bucket (it must exist; nothing here creates one)
BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
# S3 clients: fail in seconds on a dead endpoint, not in minutes of retries (a closed port is refused
# at once; a silent one costs connect_timeout per attempt). A hung one (a stopped server, a stalled
# proxy) accepts the connection and costs read_timeout per attempt: botocore's 3 attempts, and s3fs's
# own retries (5 by default) on top multiplied them into half an hour; botocore's alone retry.
S3_CONFIG = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
S3FS_RETRIES = 1
CHECK_READ_S = 10  # the start-up check's requests are small: a hung store refused in ~30 s, not minutes
_USERINFO = re.compile(r"//[^/@\s]+@")


def _named(key: str) -> str:
    """How an error names where a URL came from: a config key, or a command's argument."""
    return f"config key '{key}'" if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", key) else key


def is_url(text: str) -> bool:
    """Whether a path setting names object storage (any fsspec URL) rather than a local path."""
    return "://" in str(text)


def redact(text: str) -> str:
    """`text` with any URL's user:password@ replaced: what a client's error says is safe to log."""
    return _USERINFO.sub("//***@", str(text))


class StoreTakenError(TrimtabError):
    """Another process took over uploading to this checkpoint.dir (run/writer.json)."""


class Remote:
    """One checkpoint.dir: step_N prefixes under `root` on the fsspec file system `fs`."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs, self.root, self.url = fs, root.rstrip("/"), url
        self._claimed = False  # this Remote has said, in run/writer.json, that this process writes here

    def listing(self) -> tuple[list[str], list[str]]:
        """(complete, partial) step_N names, oldest first: complete ones have their state.json."""
        self.fs.invalidate_cache()  # s3fs caches listings; another writer may have changed them
        try:
            files = self.fs.find(self.root)
        except FileNotFoundError:
            return [], []
        contents: dict[str, set[str]] = {}
        for path in files:
            parts = path[len(self.root) :].strip("/").split("/", 1)
            if len(parts) == 2 and STEP.match(parts[0]):
                contents.setdefault(parts[0], set()).add(parts[1])
        names = sorted(contents, key=step_of)
        return [n for n in names if MANIFEST in contents[n]], [n for n in names if MANIFEST not in contents[n]]

    def upload(self, local: Path) -> None:
        """Copy checkpoint directory `local` to step_N here: a re-saved step's old state.json is
        removed first (the prefix reads as partial while it is replaced), then every file,
        then state.json; files of the old copy that the new one lacks are removed before it."""
        self.own()
        target = f"{self.root}/{local.name}"
        old = set(self._files(target))
        if MANIFEST in old:
            self.fs.rm_file(f"{target}/{MANIFEST}")
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        for name in (n for n in names if n != MANIFEST):
            self._put(local / name, f"{target}/{name}")
        for stale in old - set(names):
            self.fs.rm_file(f"{target}/{stale}")
        self._put(local / MANIFEST, f"{target}/{MANIFEST}")

    def download(self, name: str, into: Path) -> None:
        """Every file of step `name` that its state.json lists, and state.json last, into `into`."""
        source = f"{self.root}/{name}"
        manifest = json.loads(self.fs.cat_file(f"{source}/{MANIFEST}")).get("manifest", {})
        outside = [f for f in manifest if Path(f).is_absolute() or ".." in Path(f).parts]
        if outside:  # the bucket's word is not trusted with where files land
            raise ValueError(f"its manifest names a file outside the checkpoint: {outside[0]!r}")
        for file in (*(f for f in manifest if f != MANIFEST), MANIFEST):  # its own entry is its seal: once, last
            (into / file).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{source}/{file}", str(into / file))

    def own(self, claim: bool = True) -> None:
        """Before writing: the first time (`claim`), take the prefix over (run/writer.json names
        this process); after, or without `claim`, check no other process has taken it since
        (StoreTakenError naming it)."""
        path = f"{self.root}/{RUN}/{WRITER}"
        if claim and not self._claimed:
            me = {"writer": _PROCESS, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
            if _local(self.fs):
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, json.dumps(me).encode())
            self._claimed = True
            return
        try:
            other = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:  # removed by hand: nobody else claims it
            return
        if other.get("writer") != _PROCESS:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.get("since", 0)))
            raise StoreTakenError(
                f"another trimtab (pid {other.get('pid')} on {other.get('host')}) writes to {self.url} since {since}; "
                "this run's checkpoints stay in its run directory only: give each run a checkpoint.dir of its own"
            )

    def delete(self, name: str) -> None:
        self.fs.rm(f"{self.root}/{name}", recursive=True)

    def put_run_files(self, run_dir: Path, names: tuple[str, ...] = RUN_FILES) -> None:
        """The run files (`names`) `run_dir` holds, into run/ (a write: the prefix claimed first, own)."""
        self.own()
        for name in names:
            if (run_dir / name).is_file():
                self._put(run_dir / name, f"{self.root}/{RUN}/{name}")

    def lacks(self, names: tuple[str, ...] = RUN_FILES) -> tuple[str, ...]:
        """The run files (`names`) run/ does not hold now (never uploaded, or the store lost them)."""
        self.fs.invalidate_cache(f"{self.root}/{RUN}")
        return tuple(n for n in names if not self.fs.exists(f"{self.root}/{RUN}/{n}"))

    def get_run_files(self, run_dir: Path, names: tuple[str, ...] = RUN_FILES, replace: bool = False) -> list[str]:
        """The run files (`names`) this run directory lacks (`replace`: all it has too), from run/;
        returns those it got."""
        got = []
        for name in names:
            source = f"{self.root}/{RUN}/{name}"
            if (replace or not (run_dir / name).is_file()) and self.fs.exists(source):
                run_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(run_dir / name, self.fs.cat_file(source).decode("utf-8"))
                got.append(name)
        return got

    def _files(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(prefix)
        try:
            return [p[len(prefix) :].strip("/") for p in self.fs.find(prefix)]
        except FileNotFoundError:
            return []

    def _put(self, local: Path, remote: str) -> None:
        """`local` as object `remote`. An object store's PUT is whole or absent; a file system's copy
        (file://, a shared mount) is not: a process killed in it left a truncated file where a whole
        one stood (the run's goodput.json, metrics.jsonl: restored cut on a fresh machine), so it
        is copied beside and renamed into place."""
        if _local(self.fs):
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)  # a file system needs its folders
        if not {"file", "local"} & set(_protocols(self.fs)):  # an object store, memory://: whole or absent
            self.fs.put_file(str(local), remote)
            return
        tmp = f"{remote}.tmp-{_PROCESS[:8]}"
        self.fs.put_file(str(local), tmp)
        self.fs.mv(tmp, remote)


def _protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _local(fs: Any) -> bool:
    return not BUCKETED & set(_protocols(fs))


def step_of(name: str) -> int:
    return int(STEP.match(name).group(1))


def open_remote(url: str, key: str = "checkpoint.dir", write: bool = True, check: bool = True) -> Remote:
    """The store at `url`, checked now: reachable, credentials found and accepted, the bucket
    there, and (`write`) writable: a probe object written and removed. Each failure is a
    ConfigError naming `key` and the fix (exit code 2), before anything is written. Not `check`:
    checked already (at start-up), opened without a request (a survivor's exit, bounded in time)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ConfigError(
            f"{_named(key)} holds credentials (user:password@ in the URL); remove them and use the "
            "store's standard credentials (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
            "~/.aws/credentials)"
        )
    fsspec = require("fsspec", key)
    if parts.scheme in ("s3", "s3a"):
        require("s3fs", key)
    s3 = parts.scheme in ("s3", "s3a")
    try:
        fs, root = _client(fsspec, url, S3_CONFIG if s3 else None)
        checker = _client(fsspec, url, {**S3_CONFIG, "read_timeout": CHECK_READ_S})[0] if s3 else fs
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{_named(key)} = '{url}' is not a usable storage URL ({redact(exc)})") from None
    if check:
        _check(Remote(checker, root, url), key, write)
    return Remote(fs, root, url)


def _client(fsspec: Any, url: str, s3_config: dict[str, Any] | None) -> tuple[Any, str]:
    """A fresh client for `url` (one cached by fsspec would keep the endpoint and credentials it was
    made with), and the path in it; an S3 one with `s3_config` and botocore's retries alone."""
    options = {"config_kwargs": s3_config} if s3_config else {}
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    if s3_config:
        fs.retries = S3FS_RETRIES
    return fs, root


def _check(remote: Remote, key: str, write: bool = True) -> None:
    fs, root, url = remote.fs, remote.root, remote.url
    bucket = root.split("/", 1)[0]
    probe = f"{root}/.trimtab-probe-{os.getpid()}"
    try:
        if not _local(fs):
            fs.ls(bucket)  # the bucket exists and these credentials may list it
        elif write:
            fs.makedirs(root, exist_ok=True)
        elif not fs.exists(root):
            raise FileNotFoundError(root)
        if write:
            fs.pipe_file(probe, b"")
            fs.rm_file(probe)
    except FileNotFoundError:
        what = f"bucket '{bucket}'" if not _local(fs) else f"'{root}'"
        raise ConfigError(
            f"{_named(key)} = '{url}': {what} does not exist; create it"
            + (f" (aws s3 mb s3://{bucket})" if not _local(fs) else "")
            + f" or fix {key}"
        ) from None
    except PermissionError as exc:
        raise ConfigError(
            f"{_named(key)} = '{url}': access denied ({redact(exc)}); give these credentials read and "
            f"write access to the bucket, use others (AWS_PROFILE, AWS_ACCESS_KEY_ID), or fix {key}"
        ) from None
    except Exception as exc:  # the client's own types (botocore's): told apart by name, not imported
        raise ConfigError(f"{_named(key)} = '{url}': {_explain(exc, key)}") from None


def _explain(exc: BaseException, key: str) -> str:
    name = type(exc).__name__
    if "Credentials" in name:  # NoCredentialsError, PartialCredentialsError
        return (
            f"no credentials found ({name}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
            "or ~/.aws/credentials (credentials never go in the config)"
        )
    if "Connect" in name or "Timeout" in name or isinstance(exc, (ConnectionError, TimeoutError)):
        return (
            f"the object store is unreachable ({name}: {redact(exc)}); check the network and AWS_ENDPOINT_URL "
            f"(for an S3 API server other than AWS), or fix {key}"
        )
    return f"the object store refused the check ({name}: {redact(exc)}); fix {key} or the store's settings"


def restore(
    remote: Remote,
    root: Path,
    verify: Callable[[Path], dict[str, Any]],
    only: str | None = None,
    refused: list[dict[str, Any]] | None = None,
) -> tuple[Path, dict] | None:
    """The newest complete checkpoint in `remote` (or step `only`) whose files `verify`
    (checkpoint.verify: the manifest's sizes and sha256), downloaded into `root` as step_N; None
    when there is none. Partial uploads and ones that fail verification are skipped, each with
    a warning line; the ones that failed verification are also added to `refused` (the resume's
    fallback record: training/resume.py)."""
    complete, partial = remote.listing()
    if only is not None:
        complete, partial = [n for n in complete if n == only], [n for n in partial if n == only]
    for name in partial:
        log.warning("%s/%s: skipped, an upload that did not finish (no %s)", remote.url, name, MANIFEST)
    for name in reversed(complete):
        tmp = root / f".tmp_{name}_remote"  # prune() removes one a killed download leaves
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            remote.download(name, tmp)
            state = verify(tmp)
        except NewerCheckpointError:  # not corrupt: an older copy would train the run back from there
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as exc:  # a corrupt or vanished copy: the one before it, as on disk
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("%s/%s: skipped, not a valid checkpoint (%s)", remote.url, name, redact(exc))
            if refused is not None:
                refused.append({"checkpoint": name, "step": step_of(name), "reason": redact(exc), "store": remote.url})
            continue
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        log.info("restored %s from %s/%s", final, remote.url, name)
        return final, state
    return None


def retain(remote: Remote, local: set[str], keep: int, partial: bool = True) -> list[str]:
    """Remote retention after an upload, following the local prune: keep what the run directory
    keeps (the newest `keep`, the protected steps) and the newest `keep` here older than the
    newest local one; delete partial uploads (`partial`: one writer, none in flight; a survivor's,
    not: a late rank 0's may be) and checkpoints newer than the newest local one that it lacks (a
    rolled-back trajectory, a copy found corrupt). Returns the deleted names; StoreTakenError when
    another process writes here now."""
    remote.own(claim=False)  # pruning alone never takes a prefix over
    complete, partials = remote.listing()
    newest = max((step_of(n) for n in local), default=-1)
    older = [n for n in complete if step_of(n) <= newest]
    kept = set(local) | set(older[-keep:])
    gone = [*(partials if partial else []), *(n for n in complete if n not in kept)]
    for name in gone:
        remote.delete(name)
    return gone


def fetch_run(url: str, key: str, verify: Callable[[Path], dict[str, Any]]) -> Path:
    """A run in object storage as a local run directory, for what reads one (train.init_from,
    trimtab eval, export, generate): `url` is a run's checkpoint.dir (its newest valid checkpoint)
    or one step_N under it. Its config.yaml, tokenizer.json and that checkpoint are downloaded
    (verified against the manifest) into a cache folder named by the URL, which is returned;
    a checkpoint already there and valid is not downloaded again."""
    only = None
    parent, _, last = url.rstrip("/").rpartition("/")
    if STEP.match(last):
        url, only = parent, last
    remote = open_remote(url, key, write=False)
    local = cache_dir() / "remote" / hashlib.sha256(f"{url}/{only or ''}".encode()).hexdigest()[:16]
    for name in RUN_FILES:  # the newest ones: the run may have been restarted since
        (local / name).unlink(missing_ok=True)
    if "config.yaml" not in remote.get_run_files(local):
        raise ConfigError(f"{_named(key)} = '{url}' holds no trimtab run (no {RUN}/config.yaml); fix {key}")
    root = local / "checkpoints"
    found = _cached(root, remote, only, verify) or restore(remote, root, verify, only)
    if found is None:
        raise ConfigError(f"{_named(key)} = '{url}' holds no complete, valid checkpoint{f' {only}' if only else ''}")
    for old in root.iterdir():  # one checkpoint a cache folder
        if old != found[0]:
            shutil.rmtree(old, ignore_errors=True)
    return local


def _cached(root: Path, remote: Remote, only: str | None, verify: Callable[[Path], dict[str, Any]]) -> Any:
    """The cache's copy of the checkpoint fetch_run would download, if it is there and valid."""
    complete, _ = remote.listing()
    name = only or (complete[-1] if complete else None)
    if name is None or not (root / name / MANIFEST).is_file():
        return None
    try:
        return root / name, verify(root / name)
    except Exception:
        return None


def export_record(remote: Remote, marker: str) -> list[str]:
    """The files an earlier export wrote under `remote` (its `marker` lists them; [] for an empty
    prefix). A prefix holding other files is refused: trimtab never deletes what it did not write."""
    files = remote._files(remote.root)
    if not files:
        return []
    try:
        return json.loads(remote.fs.cat_file(f"{remote.root}/{marker}"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--out '{remote.url}' is not empty and holds no trimtab export (no valid {marker}); trimtab never "
            "deletes files it did not write: choose a new or empty prefix"
        ) from None


def publish(local: Path, remote: Remote, marker: str, previous: list[str]) -> None:
    """Upload directory `local` to `remote`, `marker` (the record of its files) last: an earlier
    one's marker is removed first, so a prefix being replaced reads as unfinished, never as a mix;
    the files the earlier export wrote that this one lacks are removed before the new marker."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    present = set(remote._files(remote.root))
    if marker in present:
        remote.fs.rm_file(f"{remote.root}/{marker}")
    for name in (n for n in names if n != marker):
        remote._put(local / name, f"{remote.root}/{name}")
    for stale in (set(previous) - set(names)) & present:
        remote.fs.rm_file(f"{remote.root}/{stale}")
    remote._put(local / marker, f"{remote.root}/{marker}")


def mirror(url: str, key: str) -> Path:
    """A file or a prefix in object storage (a data source, prepared shards) copied whole into
    $TRIMTAB_CACHE/remote-data/, its last path component kept (a file's extension says its
    format); the local path. A copy there whose record (every file's size and ETag or mtime)
    matches the store's listing now is used again; otherwise it is fetched into a temp folder
    and renamed into place, so a killed fetch leaves no copy that looks complete."""
    remote = open_remote(url, key, write=False)
    files = _listing(remote)
    if not files:
        raise ConfigError(f"{_named(key)} = '{url}': nothing there (no file, no prefix with files); fix {key}")
    version = {n: d.get("ETag") or d.get("mtime") or d.get("LastModified") for n, d in files.items()}
    listing = {name: [d.get("size"), version[name]] for name, d in files.items()}
    listing = json.loads(json.dumps(listing, default=str))  # datetimes as text: the record compares as read back
    folder = cache_dir() / "remote-data" / hashlib.sha256(url.encode()).hexdigest()[:16]
    local, record = folder / (remote.root.rsplit("/", 1)[-1] or "data"), folder / "fetched.json"
    if local.exists() and record.is_file() and json.loads(record.read_text()) == listing:
        return local
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{os.getpid()}"
    _remove(tmp)
    try:
        for name in files:
            target = tmp / name if name else tmp
            target.parent.mkdir(parents=True, exist_ok=True)
            remote.fs.get_file(f"{remote.root}/{name}" if name else remote.root, str(target))
        record.unlink(missing_ok=True)
        _remove(local)
        os.replace(tmp, local)
    except BaseException:
        _remove(tmp)
        raise
    write_atomic(record, json.dumps(listing))
    log.info("%s: fetched %d file(s) from %s into %s", key, len(files), url, local)
    return local


def _listing(remote: Remote) -> dict[str, dict[str, Any]]:
    """The files at remote.root by their path below it ("" for root itself, a file)."""
    fs, root = remote.fs, remote.root
    fs.invalidate_cache()
    try:
        info = fs.info(root)
    except FileNotFoundError:
        return {}
    if info["type"] == "file":
        return {"": info}
    return {path[len(root) :].strip("/"): d for path, d in fs.find(root, detail=True).items()}


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
