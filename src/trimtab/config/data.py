"""The data's section of a run config (data.*): where the training and held-out text comes from
(one source or a weighted mixture), its format, tokenizer, row length and quality filter."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from trimtab.config.checks import Section, _check, _positive

# A source's compression and format suffixes (data/formats.py reads a file by them): no part of its name
DATA_SUFFIXES = (".gz", ".zst", ".zstd", ".jsonl", ".ndjson", ".json", ".parquet", ".arrow", ".csv", ".txt", ".text")


def source_name(source: str) -> str:
    """A source's name in logs and metrics when none is given: its last path component holding no
    wildcard, less its compression and format suffixes. corpus/web.jsonl, web.jsonl.zst elsewhere,
    the prepared/web made of it and data/web/*.jsonl are all `web`: moving, compressing or preparing
    a source keeps its metric names (the whole last component, web.jsonl, changed with each)."""
    parts = [p for p in source.rstrip("/").split("/") if p not in ("", ".", "..") and not set(p) & set("*?[")]
    name = parts[-1] if parts else source
    while Path(name).stem and Path(name).suffix.lower() in DATA_SUFFIXES:
        name = name[: -len(Path(name).suffix)]
    return name


@dataclass
class MixSource(Section):
    """One source of a weighted mixture (data.mix)."""

    source: str | list[str] = ""  # as data.source: a prepared directory, a file, a directory, a glob or a list
    weight: float = 1.0  # share of each step's tokens (weights are normalised to sum to 1)
    name: str = ""  # in logs and metrics; empty: source_name of the (first) source, e.g. web for data/web.jsonl

    @property
    def label(self) -> str:
        return self.name or source_name(self.first)

    @property
    def first(self) -> str:
        return self.source if isinstance(self.source, str) else (self.source[0] if self.source else "")


@dataclass
class DataConfig(Section):
    # "builtin" (Python's own stdlib sources), a directory `trimtab data prepare` wrote, a file, a
    # directory, a glob (`**` recurses) or a list of these
    source: str | list[str] = "builtin"
    # A weighted mixture instead of one source: [{source, weight, name}], drawn in these
    # proportions of tokens at every step (data.source is then unused)
    mix: list[MixSource] = field(default_factory=list)
    format: str = "auto"  # auto | text | jsonl | chat | instruction
    eval_source: str | list[str] = ""  # separate eval set (as data.source); empty: hold out eval_fraction
    eval_fraction: float = 0.02
    seq_len: int = 256
    # a tokenizer.json, or a Hugging Face model directory holding one; empty: a prepared source's,
    # else a BPE trained on the corpus
    tokenizer: str = ""
    bpe_vocab_size: int = 4096  # size of the byte-level BPE trained on the corpus when no tokenizer is given
    pack: bool = True  # pack documents into full rows; False: one (truncated) document per row
    skip_bad_records: bool = False  # skip malformed JSONL lines (counted) instead of failing
    text_field: str = "text"
    max_bytes: int = 6_000_000  # cap on the corpus read into memory (0: no cap); prepared data has none
    verify_shards: bool = True  # check prepared shards against their sha256 at start (a full read)
    # Documents whose bytes per token lie garbage_sigma robust deviations under their source's median
    # (random bytes, base64, hex dumps, mis-encoded text: data/quality.py): warn (named on the
    # console), drop (left out of training) or off. In-memory sources at start; prepared data when
    # it is prepared.
    garbage_filter: str = "warn"
    garbage_sigma: float = 6.0

    @property
    def sources(self) -> list[MixSource]:
        """The sources drawn from: data.mix, or data.source alone with weight 1."""
        return list(self.mix) or [MixSource(self.source, 1.0)]

    @property
    def names(self) -> list[str]:
        """Each source's name in logs and metrics (MixSource.label). Unnamed sources whose derived
        names clash (web.jsonl beside web/) keep their whole last path component, as trimtab named
        every source before source_name: a mixture that ran then is not refused now."""
        labels = [part.label for part in self.sources]
        whole = [part.name or Path(part.first.rstrip("/*")).name or part.first for part in self.sources]
        return [
            whole[i] if not part.name and labels.count(labels[i]) > 1 else labels[i]
            for i, part in enumerate(self.sources)
        ]

    def validate(self) -> None:
        _positive(self, "data", "seq_len", "bpe_vocab_size")
        _check(
            self.format in ("auto", "text", "jsonl", "chat", "instruction"),
            "data.format",
            "must be one of auto, text, jsonl, chat, instruction",
        )
        _check(0.0 <= self.eval_fraction < 0.5, "data.eval_fraction", "must be in [0, 0.5)")
        _check(self.max_bytes >= 0, "data.max_bytes", "must be >= 0")
        # an empty key matched no record's field: every JSONL record then failed as "no '' key"
        _check(bool(self.text_field.strip()), "data.text_field", "must name the records' text field (default: text)")
        _check(self.garbage_filter in ("off", "warn", "drop"), "data.garbage_filter", "must be one of off, warn, drop")
        _check(self.garbage_sigma > 0, "data.garbage_sigma", f"must be > 0, got {self.garbage_sigma}")
        # an empty name is the current directory to the file listing: `--set data.source=$DATA` with
        # $DATA unset trained on whatever the shell was in
        named = [self.source] if isinstance(self.source, str) else list(self.source)
        _check(
            bool(self.mix) or (bool(named) and all(isinstance(s, str) and s.strip() for s in named)),
            "data.source",
            f"must name the data, got {self.source!r}: a file, a directory, a glob, a prepared directory or builtin",
        )
        for i, part in enumerate(self.mix):
            _check(bool(part.source), f"data.mix[{i}].source", "must name the source's data")
            ok = math.isfinite(part.weight) and part.weight > 0  # an infinite share leaves the others none
            _check(
                ok,
                f"data.mix[{i}].weight",
                f"must be a finite number > 0, got {part.weight}; to train without this source, remove its entry",
            )
        source = self.source if isinstance(self.source, str) else ", ".join(self.source)
        mixed = "add it to data.mix as one more source, or remove it"
        _check(not self.mix or source == "builtin", "data.source", f"'{source}' is unused beside data.mix: {mixed}")
        _once(self.mix)
        labels = self.names
        dupes = sorted({label for label in labels if labels.count(label) > 1})
        _check(not dupes, "data.mix", f"has two sources named {', '.join(dupes)}; give each a distinct name")


def _once(mix: list[MixSource]) -> None:
    """Refuse a source listed twice: under two names it was drawn as two sources (its rows at the weights' sum,
    in two orders, its held-out rows scored twice); under one, the refusal asked for distinct names."""
    seen: dict[tuple[str, ...], int] = {}
    for i, part in enumerate(mix):
        key = tuple(_where(s) for s in ([part.source] if isinstance(part.source, str) else part.source))
        if key in seen:
            j = seen[key]
            fix = f"list it once, with the weights added ({mix[j].weight + part.weight:g}) as its weight"
            _check(
                False, f"data.mix[{i}].source", f"names the same data as data.mix[{j}].source ({part.source}): {fix}"
            )
        seen[key] = i


def _where(source: str) -> str:
    """A local source as an absolute path (`web/` and `./web` are one directory); URLs and builtin as written."""
    if "://" in source or source.startswith("builtin"):
        return source
    return os.path.normpath(os.path.abspath(os.path.expanduser(source)))
