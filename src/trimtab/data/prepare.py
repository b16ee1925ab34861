"""`trimtab data prepare`: text, JSONL and table files -> memory-mapped token shards.

A prepared directory:
    trimtab-data.json    the manifest: the tokenizer's hash, the token dtype, every source file
                         (path, sha256, documents, tokens, skipped records) and every shard (its
                         tokens, documents, files and the sha256 of each of its files)
    tokenizer.json       the tokenizer the shards were made with (+ tokenizer_config.json)
    shards/NAME.bin      tokens back to back: uint16 when the vocabulary fits, else uint32
    shards/NAME.idx.npz  offsets int64 [D+1] (document d is tokens[offsets[d]:offsets[d+1]]),
                         where int64 [D, 2] (file number in the manifest, line or row; 0: a text
                         file), masked int64 [S, 2] (spans [start, end) that are not trainable
                         targets: chat prompts, a start-of-text token)

Documents are tokenized as training reads them (data/packing.py): [bos] + text + eos. Files are
grouped into jobs of up to SHARD_BYTES (smaller, so that every process gets two); a pool of
processes runs the jobs (data/shards.py: read, tokenize, screen for garbage with the scale this
module measured once, data/quality.py), each writing its shards under temporary names and renaming
them when whole, and the manifest is rewritten (atomically) after every job. So an interrupted prepare
loses at most the jobs in flight, a re-run prepares only the files not yet in the manifest, and
nothing already prepared is touched.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trimtab.data import boilerplate, formats, junk, quality, references, stretches, windows
from trimtab.data.listing import shown, source_files
from trimtab.data.prepare_report import garbage_line, skipped_line
from trimtab.data.prepare_tokenizer import directory_tokenizer
from trimtab.data.prepared import MANIFEST_VERSION, PreparedData, read_manifest, sha256_file, write_manifest
from trimtab.data.shards import BIGRAMS, SKIP_HINT, Item, Options, run_job, save_bigrams
from trimtab.data.sources import Document, _Reader, _take_bytes, record_documents
from trimtab.data.tokenizer import MIN_VOCAB, TextTokenizer
from trimtab.errors import DataError
from trimtab.rundir import CONFIG, METRICS_FILE, SUMMARY

log = logging.getLogger(__name__)

SHARD_BYTES = 256 << 20  # source bytes per job at most: a job writes one shard, more for a larger file
MIN_JOB_BYTES = 16 << 20  # ... and at least, unless the files are smaller
SCALE_SAMPLE_BYTES = 8_000_000  # text the garbage screen measures the sources' packing on (data/quality.py)
PROBE_BYTES = 1_000_000  # read at most of a file to find that the sources hold text


WRITTEN = ("shards", BIGRAMS, "tokenizer.json", "tokenizer_config.json", "trimtab-data.json")  # prepare makes these
RUN_FILES = (CONFIG, "checkpoints", METRICS_FILE, SUMMARY)  # a training run's directory


def prepare(
    sources: list[str],
    out: str | Path,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    options: Options | None = None,
    workers: int = 0,
    skip_hint: str = SKIP_HINT,
) -> dict[str, Any]:
    """Prepare `sources` (files, directories, globs) into `out`; returns the manifest. New files
    are added to an existing directory; files already there are skipped. `vocab_size`: the BPE a
    new directory trains (None: prepare_tokenizer.DEFAULT_VOCAB_SIZE); one other than an existing directory's is
    refused. `skip_hint`: how the caller turns on skip_bad_records, for the
    error a malformed record raises."""
    out = Path(out)
    if vocab_size is not None and vocab_size < MIN_VOCAB:  # train_tokenizer's own error names no flag
        raise DataError(
            f"--vocab-size {vocab_size} is below {MIN_VOCAB}, the byte-level base (256) and trimtab's special "
            f"tokens a BPE starts from; give at least {MIN_VOCAB}"
        )
    _check_out(out, sources)
    before = {name for name in (*WRITTEN, ".") if (out / name).exists()}
    before |= {path.name for path in out.glob(references.SOURCE_BIGRAMS.format("*"))}
    # a tokenizer.json no prepare wrote (one interrupted leaves shards/ beside its own): a model's folder
    foreign = "tokenizer.json" in before and not {"shards", "trimtab-data.json"} & before
    try:
        return _prepare(sources, out, tokenizer, vocab_size, options or Options(), workers, skip_hint, foreign)
    except BaseException:
        _remove_unfinished(out, before)
        raise


def _check_out(out: Path, sources: list[str]) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a directory to prepare into")
    for source in sources:  # its files would be left out (never read prepare's own output as text)
        if Path(source).is_dir() and Path(source).resolve().is_relative_to(out.resolve()):
            raise DataError(
                f"--out {out} is or holds the source directory {source}; prepare into a directory outside the sources"
            )
    held = [name for name in RUN_FILES if (out / name).exists()]
    if held:
        raise DataError(
            f"--out {out} is a training run's directory (it holds {held[0]}), not one for prepared data; "
            "prepare into a new directory"
        )


def _remove_unfinished(out: Path, before: set[str]) -> None:
    """A prepare that failed before it prepared any file leaves nothing behind that it created
    (an empty shards/, a tokenizer, the directory itself); one that did keeps all its manifest
    names, to resume from. Files that were there before it are never touched."""
    manifest = read_manifest(out) if out.is_dir() else None
    kept = {s.get("bigrams") for s in manifest.get("sources", [])} if manifest and manifest.get("shards") else set()
    for path in out.glob(references.SOURCE_BIGRAMS.format("*")):  # a source's, unless a manifest with shards names it
        if path.name not in before | kept:
            path.unlink()
    if manifest and manifest.get("shards"):
        return
    for name in WRITTEN:
        path = out / name
        if name in before or not path.exists():
            continue
        if path.is_dir():
            for stale in path.glob(".tmp-*"):
                stale.unlink()
            with contextlib.suppress(OSError):  # not empty: something not ours is in it
                path.rmdir()
        else:
            path.unlink()
    if "." not in before:
        with contextlib.suppress(OSError):
            out.rmdir()


def _prepare(
    sources: list[str],
    out: Path,
    tokenizer: str | None,
    vocab_size: int | None,
    options: Options,
    workers: int,
    hint: str,
    foreign: bool = False,
) -> dict[str, Any]:
    (out / "shards").mkdir(parents=True, exist_ok=True)
    for stale in (out / "shards").glob(".tmp-*"):  # jobs an interruption cut short
        stale.unlink()
    manifest = read_manifest(out) or _new_manifest(options)
    _check_options(manifest, options, out)
    manifest = _drop_corrupt(manifest, out)
    if not manifest.get("documents"):  # a new directory: it must get something to train on
        _require_text(sources, out, options, hint)
    tok = directory_tokenizer(manifest, out, tokenizer, vocab_size, sources, options, hint, foreign)
    # bpe_vocab_size (set by _tokenizer) kept: the --vocab-size asked for, which a small corpus's BPE falls short of
    manifest["tokenizer"] = {**manifest.get("tokenizer", {}), "sha256": tok.fingerprint, "vocab_size": tok.vocab_size}
    manifest["dtype"] = manifest.get("dtype") or ("uint16" if tok.vocab_size <= 1 << 16 else "uint32")
    files = _new_files(manifest, sources, out)
    shared = _measure_scale(manifest, out, [str(path) for _, path, _ in files], tok, options, hint)
    small: list[str] = []  # sources too small for word salad to be judged (junk.SMALL_WORDS): said at the end
    samples: list[tuple[int, int] | None] = []  # their samples' words, and those left out of the reference as salad
    if options.garbage_filter != "off":  # one reference per source (data/references.py)
        small, samples = references.measure(
            manifest, out, files, lambda paths: [d.text for d in _sample(paths, options, hint)], shared
        )
    workers = workers or os.cpu_count() or 1
    tally = _run_all(_jobs(manifest, files, workers, options.format), out, manifest, options, workers, hint)
    _say_tally(manifest, tally, options)
    if small:
        log.warning("%s", junk.unjudged_line(small, samples))
    if shared and manifest.get("boilerplate", {}).get("lines"):  # measured on this run's sample
        log.info("%s", boilerplate.said(manifest["boilerplate"]))
    return manifest


@dataclass
class _Tally:
    """What the jobs found across the sources, said once at the end (_say_tally)."""

    skipped: int = 0
    shown: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    garbage: list[str] = field(default_factory=list)
    spared: int = 0
    spared_shown: list[str] = field(default_factory=list)
    repeated: int = 0  # documents of repeated text kept, most of the sample being so (junk.spare_repeats)
    stretches: list[tuple[str, int, int, str]] = field(default_factory=list)  # junk inside text files (stretches.py)


def _run_all(
    jobs: list[list[Item]], out: Path, manifest: dict[str, Any], options: Options, workers: int, hint: str
) -> _Tally:
    """Runs the jobs, merging each result into the manifest as it lands (so an interruption keeps it)."""
    tally, start, done_tokens = _Tally(), time.perf_counter(), 0
    for i, result in enumerate(_run(jobs, out, manifest, options, workers, hint), start=1):
        for line in result["warnings"]:
            log.warning("%s", line)
        _merge(manifest, result)
        write_manifest(out, manifest)
        tally.skipped += sum(stats.get("skipped", 0) for stats in result["files"].values())
        tally.shown += result["skipped"]
        tally.kinds.update(result["kinds"])
        tally.garbage += [_place(manifest["files"][n]["path"], line, why) for n, line, why in result["garbage"]]
        tally.spared += result["spared"]
        tally.spared_shown += [
            _place(manifest["files"][n]["path"], line, why) for n, line, why in result["spared_shown"]
        ]
        tally.repeated += result.get("repeated", 0)
        tally.stretches += [(manifest["files"][n]["path"], *where) for n, *where in result["stretches"]]
        done_tokens += sum(s["tokens"] for s in result["shards"])
        rate = done_tokens / max(time.perf_counter() - start, 1e-9)
        log.info("prepared %d/%d jobs: %s tokens so far (%.0f tokens/s)", i, len(jobs), f"{done_tokens:,}", rate)
    write_manifest(out, manifest)
    return tally


def _say_tally(manifest: dict[str, Any], tally: _Tally, options: Options) -> None:
    if tally.skipped:
        log.warning("%s", skipped_line(tally.skipped, tally.shown))
    if tally.spared:
        log.warning("%s", quality.spared_line(tally.spared, "the sources", tally.spared_shown[: quality.SHOWN]))
    if tally.repeated:
        log.warning("%s", junk.repeats_line(tally.repeated, None, "the sources"))
    if tally.kinds:
        log.warning("%s", garbage_line(manifest, tally.kinds, tally.garbage, options.garbage_filter == "drop"))
    if tally.stretches:
        log.warning("%s", stretches.line(tally.stretches, options.garbage_filter == "drop"))


def _require_text(sources: list[str], out: Path, options: Options, hint: str) -> None:
    """DataError unless the sources hold some text that is not whitespace, as training refuses
    them (prepared, they gave a directory of a few tokens that failed only when trained on).
    Read until the first document that holds any."""
    reader = _Reader(options.data_config(), "data", "data prepare source", fix=hint, limit=PROBE_BYTES, exclude=(out,))
    blank = ""
    for source in sources:
        for doc in reader.documents(source):
            if doc.text.strip():
                return
            blank = blank or doc.source
    only = f": {blank} holds only whitespace" if blank else ""
    raise DataError(f"the sources ({', '.join(sources)}) hold no text{only}; point them at files with text")


def _measure_scale(
    manifest: dict[str, Any], out: Path, files: list[str], tok: TextTokenizer, options: Options, hint: str
) -> bool:
    """The garbage screen's scale, measured once on a sample of the files to prepare and kept in
    the manifest, so that files added later are judged alike (null: too few documents to say); and
    the sample's word pairs, which the jobs judge word salad against where a source has none of its
    own (BIGRAMS: a 4 MB batch alone is too little text, data/junk.py), kept beside it. Whether
    this measured them (on `files`)."""
    if options.garbage_filter == "off" or not files or ("garbage" in manifest and (out / BIGRAMS).is_file()):
        return False
    docs = _sample(files, options, hint)
    texts = [doc.text for doc in docs]
    save_bigrams(out, bigrams := junk.reference(texts))
    manifest["salad"] = junk.mostly_salad(texts, bigrams)  # mostly word salad: judged so per source (data/junk.py)
    manifest["repeated"] = junk.repeated_fraction(texts)  # mostly repeated text: kept as meant (junk.spare_repeats)
    manifest["boilerplate"] = boilerplate.measure(texts)  # lines across many documents: said, not removed
    if "garbage" in manifest:  # a directory prepared before its word pairs were kept
        return True
    n_bytes = np.array([len(t.encode()) for t in texts])
    if not quality.judgeable(n_bytes):  # no scale to find: not encoded (a one-line JSON file's 8 MB took 1.1 GB)
        manifest["garbage"] = None
        return True
    # counted as trained (start token, text, end token), as the jobs and the in-memory screen count
    encoded = tok.encode_documents(docs)
    n_tokens = [sum(map(len, ids)) + 1 + tok.prepends_bos(text) for ids, text in zip(encoded, texts)]
    found = quality.scale(n_bytes, np.array(n_tokens), options.garbage_sigma)
    manifest["garbage"] = found and {"median": found[0], "threshold": found[1], "sigma": options.garbage_sigma}
    return True


def _sample(files: list[str], options: Options, hint: str) -> list[Document]:
    """SCALE_SAMPLE_BYTES of `files`' whole documents, spread over them (`_spread`): the first 8 MB in
    input order gave a source whose first files are of one kind (docs, then code) a reference of that
    kind only, against which its other files' word pairs looked like word salad (data/junk.py). Each
    file gives at most an equal share of what is left (at least one document), so a few large files
    each give some too; a file is read up to its share only, so nothing is read twice (a larger file's
    share is read from across it, `_across`: a file whose text changes past its head was judged by its
    head)."""
    reader = _Reader(options.data_config(), "data", "data prepare source", fix=hint, limit=SCALE_SAMPLE_BYTES)

    def readable() -> Iterator[Document]:  # a file that fails is named by its own job, not here
        left = SCALE_SAMPLE_BYTES
        for rank, i in enumerate(_spread(len(files))):
            share, taken = max(left // (len(files) - rank), 1), 0
            reader.limit = share  # a file's records are held back up to its share, not the whole sample's
            with contextlib.suppress(DataError, formats.Unreadable, OSError):
                for doc in _across(reader, Path(files[i]), share) or reader.documents(files[i]):
                    yield doc
                    size = len(doc.text.encode())
                    taken, left = taken + size, left - size
                    if taken >= share:
                        break

    return _take_bytes(readable(), SCALE_SAMPLE_BYTES)[0]


def _across(reader: _Reader, path: Path, share: int) -> list[Document]:
    """A file larger than its `share` of the sample, its share read from across it (data/windows.py) rather than from
    its head: a text file as one document of its windows' lines, JSONL as their records (a file of bytes read before
    gives none, as reader.documents does). Empty for the rest: read from the head."""
    if not path.is_file() or path.stat().st_size <= share or not windows.seekable(path, reader.cfg.format):
        return []
    if not (spans := windows.spans(path, share)):  # one line longer than windows.MAX_LINE: its head
        return []
    if reader._earlier(path) is not None:  # asked once: a second time, the file would be its own earlier copy
        return []
    if formats.kind_of(path, reader.cfg.format) == "text":
        return [Document([("".join(windows.text(path, spans)), True)], str(path))]
    fix = reader.fix or "set data.skip_bad_records=true"
    return [doc for span in spans for doc, _ in record_documents(path, reader.cfg, reader.chat, fix, span) if doc]


def _spread(n: int) -> list[int]:
    """0..n-1 in bit-reversed order (van der Corput): the first k of them are spread evenly over the
    listing (first, middle, quarters, ...), the same for the same listing."""
    bits = max(n - 1, 1).bit_length()
    return sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))


def _place(path: str, line: int, why: str = "") -> str:
    """FILE:LINE for a JSONL line or table row; FILE alone for a plain-text file, one document whose
    line is 0 (formats.Record), as a run's own screen names it: "FILE:0" is no line of the file; with
    `why` (junk.Verdict's words, a dump's byte range among them) in brackets, as a run's console says it."""
    place = f"{path}:{line}" if line else path
    return f"{place} ({why})" if why else place


def _new_manifest(options: Options) -> dict[str, Any]:
    return {"version": MANIFEST_VERSION, "options": asdict(options), "files": [], "shards": [], "chat": False}


def _check_options(manifest: dict[str, Any], options: Options, out: Path) -> None:
    saved = manifest.get("options", {})
    for key in ("format", "text_field"):
        if saved.get(key, getattr(options, key)) != getattr(options, key):
            raise DataError(
                f"{out} was prepared with --{key.replace('_', '-')} {saved[key]}, not {getattr(options, key)}; "
                "prepare into a new directory to change it"
            )


def _drop_corrupt(manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Shards whose files are missing or fail their sha256 leave the manifest, and so do their
    source files: this run prepares those files again if they are still there."""
    bad = PreparedData.corrupt_shards(out, manifest)
    for name, why in bad.items():
        log.warning("%s: shard %s %s; its source files are prepared again", out, name, why)
    files = {n for shard in manifest["shards"] if shard["name"] in bad for n in shard["files"]}
    while True:  # a file goes again whole, so every other shard holding part of it goes too
        dropped = {s["name"] for s in manifest["shards"] if set(s["files"]) & files}
        grown = files | {n for s in manifest["shards"] if s["name"] in dropped for n in s["files"]}
        if grown == files:
            break
        files = grown
    manifest["shards"] = [s for s in manifest["shards"] if s["name"] not in dropped | set(bad)]
    for n in files:
        entry = manifest["files"][n]
        for key in ("prepared", "done", "documents", "tokens", "skipped", "unreadable", "garbage"):
            entry.pop(key, None)
    return manifest


def _new_files(manifest: dict[str, Any], sources: list[str], out: Path) -> list[tuple[int, Path, bool]]:
    """(manifest number, path, named on its own) of each source file not yet prepared, none of
    them under `out` (its tokenizer is written before this lists the files); registers new ones
    in the manifest."""
    known = {f["path"]: n for n, f in enumerate(manifest["files"])}
    by_hash = {f["sha256"]: f["path"] for f in manifest["files"] if f.get("prepared")}
    todo, same = [], []
    numbers = references.source_numbers(manifest, sources)
    listed = (
        (k, *pair)
        for k, source in zip(numbers, sources)
        for pair in source_files(source, "data prepare source", (out,))
    )
    for k, path, named in listed:
        resolved, digest = str(path.resolve()), sha256_file(path)
        n = known.get(resolved)
        if n is not None and manifest["files"][n].get("prepared"):
            if manifest["files"][n]["sha256"] != digest:
                raise DataError(
                    f"{path} changed since it was prepared into this directory (sha256 differs); restore it, "
                    "or prepare into a new directory"
                )
            continue
        if n is not None and manifest["files"][n].get("done") and manifest["files"][n]["sha256"] != digest:
            raise DataError(
                f"{path} changed while it was being prepared in pieces (sha256 differs); restore it, or "
                "prepare into a new directory"
            )
        if n is not None:  # registered by a prepare that stopped before it: take it as it is now
            if manifest["files"][n]["sha256"] != digest:  # its pieces were cut from the bytes it had then
                for key in ("spans", "done"):
                    manifest["files"][n].pop(key, None)
            manifest["files"][n].update(sha256=digest, bytes=path.stat().st_size)
        if n is None and digest in by_hash:  # prepared before, or earlier in this same call
            same.append(f"{path} (as {by_hash[digest]})")
            continue
        if n is None:
            n = len(manifest["files"])
            manifest["files"].append({"path": resolved, "sha256": digest, "bytes": path.stat().st_size})
            known[resolved] = n
        manifest["files"][n].setdefault("source", k)  # the first source that named it: its junk reference
        if any(t[0] == n for t in todo):
            continue  # named twice (a file and its directory)
        by_hash.setdefault(digest, resolved)
        todo.append((n, path, named))
    if same:  # one line, however many (a corpus of copies has thousands)
        log.warning("the same bytes as a file prepared before, skipped: %s", shown(same, "file", "", "s"))
    return todo


def _jobs(manifest: dict[str, Any], files: list[tuple[int, Path, bool]], workers: int, fmt: str) -> list[list[Item]]:
    """Jobs of up to SHARD_BYTES of input, smaller when that gives every worker two or more:
    consecutive small files grouped, a larger uncompressed JSONL file cut into pieces at line
    ends (its pieces are kept in the manifest, so a re-run cuts it the same way)."""
    total = sum(path.stat().st_size for _, path, _ in files)
    target = min(SHARD_BYTES, max(MIN_JOB_BYTES, total // (2 * workers)))
    jobs: list[list[Item]] = []
    size = target
    for n, path, named in files:
        entry = manifest["files"][n]
        if "spans" in entry or (path.stat().st_size > target and formats.splittable(path, fmt)):
            entry.setdefault("spans", formats.spans(path, target))
            entry.setdefault("done", [])
            jobs += [[(n, str(path), named, span)] for span in entry["spans"] if span[0] not in entry["done"]]
            continue
        if size >= target:
            jobs.append([])
            size = 0
        jobs[-1].append((n, str(path), named, None))
        size += path.stat().st_size
    return jobs


def _run(
    jobs: list[list[Item]], out: Path, manifest: dict[str, Any], options: Options, workers: int, hint: str
) -> Iterator[dict[str, Any]]:
    """Each job's result as it completes: in this process for one job or one worker (then the
    tokenizer's own threads use every core), else in a pool of processes with a thread each."""
    workers = min(workers, len(jobs))
    # null (too few documents for a scale): {}, the jobs judge junk by each document alone (data/junk.py)
    scale = manifest.get("garbage") or {} if options.garbage_filter != "off" else None
    if scale is not None and manifest.get("repeated") is not None:  # the sample's share of repeated text
        scale = {**scale, "repeated": manifest["repeated"]}
    refs = [references.of_job(manifest, job) for job in jobs]  # each file's source's junk reference
    shares = [references.repeated_of_job(manifest, job) for job in jobs]  # ... and its share of repeated text
    salads = [references.salad_of_job(manifest, job) for job in jobs]  # ... and whether it is mostly word salad
    args = [
        (job, str(out), manifest["dtype"], asdict(options), hint, scale, ref, share, salad)
        for job, ref, share, salad in zip(jobs, refs, shares, salads)
    ]
    if workers <= 1:
        yield from (run_job(*a) for a in args)
        return
    os.environ["RAYON_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))  # read by spawned workers
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(_star_job, args)


def _star_job(args: tuple) -> dict[str, Any]:
    return run_job(*args)


def _merge(manifest: dict[str, Any], result: dict[str, Any]) -> None:
    for n, stats in result["files"].items():
        entry = manifest["files"][int(n)]
        if result["span"] is None:
            entry.update(stats, prepared=True)
            continue
        for key, value in stats.items():  # a piece of the file: its counts add up
            entry[key] = entry.get(key, 0) + value
        entry["done"] = sorted(entry["done"] + [result["span"][0]])
        entry["prepared"] = len(entry["done"]) == len(entry["spans"])
    manifest["shards"] = sorted(manifest["shards"] + result["shards"], key=lambda s: (min(s["files"]), s["start"]))
    manifest["chat"] = manifest["chat"] or result["chat"]
    manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    manifest["documents"] = sum(s["documents"] for s in manifest["shards"])
