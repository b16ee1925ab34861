"""The tokenizer of a `trimtab data prepare` directory (data/prepare.py): a new directory's --tokenizer or
a BPE trained on a sample spread over its sources; an existing one's own, with the --tokenizer or
--vocab-size that would silently not apply refused; a deleted one trained again only as it was (the
shards' ids are its)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trimtab.data.shards import SKIP_HINT, Options
from trimtab.data.sources import _Reader
from trimtab.data.tokenizer import TRAIN_SAMPLE_BYTES, TextTokenizer, train_tokenizer
from trimtab.errors import DataError

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 4096  # the BPE a new directory trains when neither --tokenizer nor --vocab-size is given


def directory_tokenizer(
    manifest: dict[str, Any],
    out: Path,
    given: str | None,
    vocab_size: int | None,
    sources: list[str],
    options: Options,
    hint: str = SKIP_HINT,
    foreign: bool = False,
) -> TextTokenizer:
    """The directory's tokenizer; a new directory takes --tokenizer (a tokenizer.json or a
    Hugging Face model directory) or a BPE of vocab_size trained on a sample of the sources. The
    manifest's tokenizer.bpe_vocab_size records the size asked for (null: a given tokenizer).
    `foreign`: a new directory already holds a tokenizer.json no prepare wrote (a Hugging Face
    model's folder): used only when --tokenizer names that same tokenizer, refused otherwise."""
    own = out / "tokenizer.json"
    if given:
        fix = "point --tokenizer at a good tokenizer.json (tokenizers' Tokenizer.save), or leave it out to train a BPE"
        tok = TextTokenizer.load(Path(given), key="--tokenizer", fix=fix)
        if own.is_file() and TextTokenizer.load(own).fingerprint != tok.fingerprint:
            if foreign:  # no prepare's: leaving --tokenizer out would not add files with it
                raise DataError(f"--tokenizer {given} is not the tokenizer.json {out} already holds; " + _NEW_OUT)
            raise DataError(
                f"--tokenizer {given} is not the tokenizer {out} was prepared with ({own}); "
                "leave --tokenizer out to add files with it, or prepare into a new directory"
            )
        if not own.is_file():
            _same_as_shards(manifest, out, tok, f"--tokenizer {given}")
        if foreign or not own.is_file():  # a new directory's: a given tokenizer
            manifest["tokenizer"] = {"bpe_vocab_size": None}
        if not own.is_file():
            tok.save(own)
        return tok
    if foreign:
        raise DataError(_foreign_tokenizer(out, own))
    if own.is_file():
        tok = TextTokenizer.load(own)
        _check_vocab_size(manifest, out, tok, vocab_size)
        return tok
    reader = _Reader(
        options.data_config(), "data", "data prepare source", fix=hint, limit=TRAIN_SAMPLE_BYTES, exclude=(out,)
    )
    docs = reader.spread(sources, TRAIN_SAMPLE_BYTES)  # a share of every file's, not the first files'
    if not docs:
        raise DataError(f"the sources ({', '.join(sources)}) hold no text; point them at non-empty files")
    size = (manifest.get("tokenizer") or {}).get("bpe_vocab_size") or vocab_size or DEFAULT_VOCAB_SIZE
    tok = train_tokenizer(docs, size)
    _same_as_shards(manifest, out, tok, f"a BPE of {size} trained again on the sources")
    tok.save(own)
    manifest["tokenizer"] = {"bpe_vocab_size": size}
    return tok


def _same_as_shards(manifest: dict[str, Any], out: Path, tok: TextTokenizer, what: str) -> None:
    """A directory whose tokenizer.json was deleted keeps shards of the ids it gave: another tokenizer
    (a new BPE of the default size, or another --tokenizer) would have them read as other text, silently
    (a soak: rm tokenizer.json, prepare again, and the run trained on the 512-token BPE's ids with a
    4096-token one). The same one, trained again from the same sources, is kept."""
    made = (manifest.get("tokenizer") or {}).get("sha256")
    if not manifest.get("shards") or made in (None, tok.fingerprint):
        return
    raise DataError(
        f"{out / 'tokenizer.json'} is missing, and {what} is not the tokenizer the shards in {out / 'shards'} "
        f"were made with (sha256 {made[:12]}, trimtab-data.json); restore that tokenizer.json, give it with "
        "--tokenizer, or prepare into a new directory"
    )


_NEW_OUT = "prepare into a new directory"


def _foreign_tokenizer(out: Path, own: Path) -> str:
    """Data tokenized silently with a tokenizer nobody chose (preparing into a model's folder) is
    data for another model than the one the person had in mind: said, with both ways on."""
    return (
        f"--out {out} already holds a tokenizer.json that no `trimtab data prepare` wrote (e.g. a Hugging Face "
        f"model's folder); to prepare with that tokenizer, say so: --tokenizer {own}; for a BPE trained on the "
        f"sources (--vocab-size), {_NEW_OUT}"
    )


def _check_vocab_size(manifest: dict[str, Any], out: Path, tok: TextTokenizer, vocab_size: int | None) -> None:
    """Refuse a --vocab-size other than the one the directory's tokenizer was made with: the
    directory keeps its tokenizer, so the flag would be silently ignored. A manifest from before
    bpe_vocab_size was recorded cannot tell (a small corpus's BPE falls short of the size asked):
    a warning."""
    saved = manifest.get("tokenizer", {})
    made = saved.get("bpe_vocab_size", tok.vocab_size)
    if vocab_size is None or made == vocab_size:
        return
    if "bpe_vocab_size" not in saved:
        log.warning(
            "%s: keeps the tokenizer it was prepared with (a vocabulary of %d); --vocab-size %d applies to a "
            "new directory only",
            out,
            tok.vocab_size,
            vocab_size,
        )
        return
    was = f"--vocab-size {made}" if made is not None else f"--tokenizer (a vocabulary of {tok.vocab_size})"
    raise DataError(
        f"{out} was prepared with {was}, not --vocab-size {vocab_size}; leave --vocab-size out to add files "
        "with its tokenizer, or prepare into a new directory"
    )
