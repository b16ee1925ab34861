"""The junk screen's references for `trimtab data prepare`: one per source, as training builds one per
data.mix entry (data/junk.py). Judged against one shared sample (8 MB spread over all the inputs), code
met prose's word pairs and a foreign-language folder English's spellings, or all of them met the first
folder's. A source is what the user names as one (a file, a directory, a glob); its reference is
measured on its files' sample when it is first prepared and kept beside the manifest (SOURCE_BIGRAMS), so
files added to it later are judged alike; manifest["sources"] says which file each source's is, and each
file's entry its source."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trimtab.data import junk
from trimtab.data.listing import BUILTIN
from trimtab.data.shards import BIGRAMS, save_bigrams

SOURCE_BIGRAMS = "junk-bigrams-{}.npz"  # a source's own reference, by its number in manifest["sources"]


def source_numbers(manifest: dict[str, Any], sources: list[str]) -> list[int]:
    """Each of `sources`' number in manifest["sources"], registered when new, known by its absolute path."""
    known = manifest.setdefault("sources", [])
    names = [entry["source"] for entry in known]
    absolute = [source if source == BUILTIN else os.path.abspath(source) for source in sources]
    for source in absolute:
        if source not in names:
            names.append(source)
            known.append({"source": source})
    return [names.index(source) for source in absolute]


def measure(
    manifest: dict[str, Any],
    out: Path,
    files: list[tuple[int, Path, bool]],
    sample: Callable[[list[str]], list[str]],
    shared: bool,
) -> tuple[list[str], list[tuple[int, int] | None]]:
    """The reference of each source of `files` (manifest numbers) not yet measured, on `sample` of its
    files' texts; BIGRAMS when that is its sample (`shared`: BIGRAMS was just measured on all of `files`).
    A source under junk.CORPUS_WORDS words keeps its own all the same: its spellings are judged, its word
    order by the stricter small-source rule down to junk.SMALL_WORDS and not under it, as a small data.mix
    entry's are in training; those under it are returned, for prepare's report to say so (junk.unjudged_line),
    with their sample's words and those of them left out of the reference as word salad (None: measured before).
    Each source's share of repeated text is measured on its own sample too (entry["repeated"], junk.spare_repeats)."""
    by_source: dict[int, list[str]] = {}
    for n, path, _ in files:
        by_source.setdefault(manifest["files"][n]["source"], []).append(str(path))
    small, samples = [], []
    for k, paths in by_source.items():
        entry, texts = manifest["sources"][k], None
        fresh = "bigrams" not in entry  # measured now, on this sample
        if "bigrams" in entry or (shared and len(paths) == len(files)):  # measured before, or BIGRAMS is its own
            entry.setdefault("bigrams", BIGRAMS)
            if shared and len(paths) == len(files):  # the shared sample is its own
                entry.setdefault("repeated", manifest.get("repeated"))
                entry.setdefault("salad", manifest.get("salad"))
            words = _words(out / entry["bigrams"])
        else:
            texts = sample(paths)
            # its own share of repeated text: a toy source beside real text spared the real one's loops (spare_repeats)
            entry["repeated"] = junk.repeated_fraction(texts)
            bigrams = junk.reference(texts)
            entry["salad"] = junk.mostly_salad(texts, bigrams)  # judged per source, not per batch (data/junk.py)
            entry["bigrams"] = BIGRAMS if _same_sample(out, bigrams) else SOURCE_BIGRAMS.format(k)
            if entry["bigrams"] != BIGRAMS:
                save_bigrams(out, bigrams, entry["bigrams"])
            words = bigrams.total
        if words < junk.SMALL_WORDS:  # its sample's, or its large documents judged word salad whole (junk.reference)
            small.append(entry["source"])
            total = sum(len(junk.words(text)) for text in (sample(paths) if texts is None else texts)) if fresh else 0
            samples.append((total, total - words) if fresh else None)
    return small, samples


def _words(path: Path) -> int:
    """The words of a kept reference's sample (SMALL_WORDS: whether word salad is judged against it); a reference
    not kept (a directory prepared before references were) is measured again, its count then unknown: 0."""
    if not path.is_file():
        return 0
    with np.load(path) as kept:
        return int(kept["words"].sum())


def _same_sample(out: Path, bigrams: junk.Bigrams) -> bool:
    """Whether BIGRAMS was drawn from the same documents (a lone source's sample): not kept twice."""
    if not (out / BIGRAMS).is_file():
        return False
    with np.load(out / BIGRAMS) as shared:  # reads the members only
        return np.array_equal(shared["members"], bigrams.members)


def of_job(manifest: dict[str, Any], job: list) -> dict[int, str]:
    """{file number: its source's reference} for a job's files (shards.run_job's `references`)."""
    sources, files = manifest.get("sources", []), manifest["files"]
    return {n: sources[files[n]["source"]].get("bigrams", BIGRAMS) for n, *_ in job}


def repeated_of_job(manifest: dict[str, Any], job: list) -> dict[int, float]:
    """{file number: its source's sample's share of repeated text} for a job's files (shards.run_job's `repeated`);
    a source measured before its share was kept has the shared sample's (manifest["repeated"])."""
    sources, files, shared = manifest.get("sources", []), manifest["files"], manifest.get("repeated")
    found = {n: sources[files[n]["source"]].get("repeated", shared) for n, *_ in job}
    return {n: share for n, share in found.items() if share is not None}


def salad_of_job(manifest: dict[str, Any], job: list) -> dict[int, bool]:
    """{file number: whether its source's sample is mostly word salad} for a job's files (shards.run_job's `salad`,
    junk.mostly_salad); a source measured before it was kept is absent: each batch judged by its own share."""
    sources, files = manifest.get("sources", []), manifest["files"]
    found = {n: sources[files[n]["source"]].get("salad") for n, *_ in job}
    return {n: mostly for n, mostly in found.items() if mostly is not None}
