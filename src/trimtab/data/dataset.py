"""A phase's data from its config section: each source (data.source, or each of data.mix) read
into memory or opened as a prepared directory, split into training and evaluation rows, and
joined for the loader with the mixture's weights.

In memory (text, JSONL, tables): read up to data.max_bytes, tokenized at start (cached).
Prepared (`trimtab data prepare`): memory-mapped, nothing read ahead, any size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from trimtab.config.data import DataConfig, MixSource
from trimtab.data.chat import ChatFormat
from trimtab.data.packing import ConcatRows, JunkSource, Rows, build_splits, every_flagged
from trimtab.data.prepared import PreparedData, ShardedRows
from trimtab.data.sources import Document, as_written, prepared_dir, read_documents
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class OpenedSource:
    """One source of a phase, before tokenization: a prepared directory, or documents."""

    spec: MixSource
    key: str  # its config key, for messages: data.source, data.mix[1].source, ...
    prepared: PreparedData | None = None
    docs: list[Document] | None = None
    skipped_records: int = 0


@dataclass
class PhaseData:
    train: Rows | ConcatRows | ShardedRows
    evals: list[Rows | ShardedRows]  # each source's held-out rows, or the eval_source's (one)
    weights: list[float]  # normalised to sum to 1
    names: list[str]
    skipped_records: int
    # each kept source's index in the section's config (data.mix[i]): a mixture's junk sources left out before
    # one shift its place among the kept, which named the wrong entry in messages (run_length.kept_whole)
    indices: list[int]


def open_sources(cfg: DataConfig, section: str, chat: ChatFormat | None) -> list[OpenedSource]:
    """Each source of the section, opened (prepared) or read (documents)."""
    out = []
    for i, spec in enumerate(cfg.sources):
        key = f"{section}.mix[{i}].source" if cfg.mix else f"{section}.source"
        if (folder := prepared_dir(spec.source)) is not None:
            out.append(OpenedSource(spec, key, prepared=PreparedData(folder, key, verify=cfg.verify_shards)))
        else:
            docs, skipped = read_documents(cfg, spec.source, section=section, chat=chat, key=key)
            out.append(OpenedSource(spec, key, docs=docs, skipped_records=skipped))
    return out


def open_eval_source(cfg: DataConfig, section: str, chat: ChatFormat | None) -> OpenedSource | None:
    """The section's eval_source opened or read; None when it holds its evaluation data out."""
    if not cfg.eval_source:
        return None
    spec, key = MixSource(cfg.eval_source), f"{section}.eval_source"
    if (folder := prepared_dir(cfg.eval_source)) is not None:
        return OpenedSource(spec, key, prepared=PreparedData(folder, key, verify=cfg.verify_shards))
    docs, _ = read_documents(cfg, cfg.eval_source, section=section, chat=chat, key=key)
    return OpenedSource(spec, key, docs=docs)


def first_prepared(sections: list[DataConfig]) -> Path | None:
    """The first prepared directory among the sections' sources: a run on prepared data takes
    its tokenizer."""
    for cfg in sections:
        for spec in cfg.sources + ([MixSource(cfg.eval_source)] if cfg.eval_source else []):
            if (folder := prepared_dir(spec.source)) is not None:
                return folder
    return None


def build_phase_data(
    cfg: DataConfig,
    sources: list[OpenedSource],
    tok: TextTokenizer,
    seed: int,
    cache_dir: Path | None,
    eval_source: OpenedSource | None = None,
) -> PhaseData:
    """Training and evaluation rows of every source; eval_source (data.eval_source) replaces the
    hold-out of each source."""
    fraction = 0.0 if eval_source is not None else cfg.eval_fraction
    trains, evals, kept, junk = [], [], [], []
    for i, source in enumerate(sources):
        try:
            train, held = _split(cfg, source, tok, seed, cache_dir, fraction, screen=True)
        except JunkSource as found:
            junk.append((i, found))
            continue
        if not len(train):
            raise DataError(
                f"{source.key} {as_written(source.spec.source)} gives no training row of "
                f"data.seq_len+1={cfg.seq_len + 1} tokens with a trainable target; add data or lower data.seq_len"
            )
        trains.append(train)
        evals.append(held)
        kept.append(i)
    weights = [s.spec.weight for s in sources]
    if junk:
        _leave_out_junk(junk, kept, cfg.names, weights)
    if eval_source is not None:
        evals = [_split(cfg, eval_source, tok, seed, cache_dir, 0.0)[0]]
        if not len(evals[0]):  # prepared (in memory, build_splits says it)
            raise DataError(
                f"{eval_source.key} {as_written(eval_source.spec.source)} gives no row of "
                f"data.seq_len+1={cfg.seq_len + 1} tokens with a trainable target; add data or lower data.seq_len"
            )
    total = sum(weights[i] for i in kept)
    return PhaseData(
        train=trains[0] if len(trains) == 1 else ConcatRows(trains),
        evals=evals,
        weights=[weights[i] / total for i in kept],
        names=[cfg.names[i] for i in kept],  # sources: open_sources(cfg), one per cfg.sources
        skipped_records=sum(s.skipped_records for s in sources),
        indices=kept,
    )


def _leave_out_junk(
    junk: list[tuple[int, JunkSource]], kept: list[int], names: list[str], weights: list[float]
) -> None:
    """A mixture's sources that are junk through and through are left out, their weight spread over the
    others in proportion: kept, such a source trained at its full weight, as the loader keeps a row of
    each source and the orchestrator's skip_data of its rows failed. With no other source (one source,
    or every one junk) there is nothing to train on: refused, each named."""
    if not kept:
        raise DataError("; ".join(str(found) for _, found in junk))
    total, left = sum(weights), sum(weights[i] for i in kept)
    for i, found in junk:
        logger.warning(
            "%s ('%s', %s): every one of its %d documents is flagged as junk: left out of the mixture, its "
            "weight %.2f spread over the others (each x%.2f); replace its data or remove it from the mixture "
            "(%s.garbage_filter=off trains on it as it is)",
            found.key.removesuffix(".source"),
            names[i],
            found.where,
            found.n_docs,
            weights[i] / total,
            total / left,
            found.key.split(".mix[")[0],
        )


def _split(
    cfg: DataConfig,
    source: OpenedSource,
    tok: TextTokenizer,
    seed: int,
    cache_dir: Path | None,
    fraction: float,
    screen: bool = False,
) -> tuple[Rows | ShardedRows, Rows | ShardedRows]:
    """The source's (train, held-out) rows; screen: its documents are screened for garbage
    (data.garbage_filter) first. A separate eval set is the user's own choice and is not."""
    if source.prepared is not None:
        if not tok.made(source.prepared.tokenizer_sha):
            theirs = source.prepared.path / "tokenizer.json"
            differs = tok.difference(TextTokenizer.load(theirs)) or f"{theirs} is not the one it recorded"
            # the run directory may not exist yet: name the file the run's tokenizer was loaded from
            ours = f"{tok.origin} (this run's)" if tok.origin else "set to the run directory's tokenizer.json"
            raise DataError(
                f"{source.key} {as_written(source.spec.source)} was prepared with another tokenizer than this run's "
                f"({differs}, this run's first); prepare it with --tokenizer {ours}, or train a new run on it"
            )
        # the documents `data prepare` flagged and kept are reported as the in-memory screen's (warn)
        flagged = screen and cfg.garbage_filter == "warn"
        if flagged and every_flagged(source.prepared.garbage):
            raise JunkSource(source.key, str(source.prepared.path), len(source.prepared.garbage))
        held = ShardedRows(source.prepared, cfg.seq_len, cfg.pack, "eval", fraction, flagged)
        if fraction > 0 and not len(held):  # as the in-memory split says it
            logger.warning(
                "%s '%s': its held-out share (data.eval_fraction=%g) is too small for one row of data.seq_len+1=%d "
                "tokens; evaluation is skipped (raise data.eval_fraction, or give data.eval_source)",
                source.key,
                source.spec.source,
                fraction,
                cfg.seq_len + 1,
            )
        return ShardedRows(source.prepared, cfg.seq_len, cfg.pack, "train", fraction, flagged), held
    cfg = replace(cfg, eval_fraction=fraction)
    where = source.spec.source if isinstance(source.spec.source, str) else ", ".join(map(str, source.spec.source))
    return build_splits(cfg, tok, source.docs, None, seed, cache_dir, source.key, screen, where)
