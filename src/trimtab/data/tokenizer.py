"""Byte-level BPE tokenizer: trained on the corpus (and cached) or loaded from a tokenizer.json,
either trimtab's own or a Hugging Face model's (used as is)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trimtab.config import DataConfig
from trimtab.data import cutting, formats
from trimtab.data.chat import ChatFormat
from trimtab.data.sources import Document, corpus_fingerprint
from trimtab.errors import DataError
from trimtab.rundir import write_json

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
EOS, PAD = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
_SPECIAL_RE = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
# A BPE learns from TRAIN_SAMPLE_BYTES of its documents' text (as SentencePiece's input_sentence_size
# bounds its input; `data prepare` takes a share of every file's, sources._Reader.spread), fed in
# pieces of at most TRAIN_PIECE_CHARS: the trainer
# pre-tokenizes a string whole, holding tens of bytes per byte of it, so a 20 MB one-line JSON file
# (one document) took 1.6 GB where the same text as JSONL took 0.1 GB.
TRAIN_SAMPLE_BYTES = 50_000_000
TRAIN_PIECE_CHARS = 1 << 16
# Characters per encode_batch call. tokenizers holds ~130 bytes a character of a call's texts (a
# 10M-character text whole: 1.3 GB), so a 50 MB one-line file read by a run took 7.7 GB whole; calls of
# 4M characters still held 0.5 GB while a 10 MB document was encoded, calls of 1M 0.28 GB (the
# allocator keeps some of each call's)
ENCODE_CALL_CHARS = 1_000_000


HF_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: a Hugging Face tokenizer's settings


class TextTokenizer:
    """A tokenizers.Tokenizer whose special tokens are matched inside a prompt and where a chat
    template wrote them, never in a document's own text, and whose byte-level model round-trips
    any UTF-8 text.

    trimtab's own has SPECIAL_TOKENS (end of text, pad, chat roles). A Hugging Face one (`hf`: its
    tokenizer_config.json) is used exactly as it is: its vocabulary, its end-of-text and pad
    tokens, its chat template; nothing is added, so ids match the model it came with."""

    def __init__(self, tok: Tokenizer, hf: dict | None = None, settings: Path | None = None) -> None:
        self._tok = tok
        self.hf = hf
        self.settings = settings  # the tokenizer_config.json hf was read from, for messages
        self.origin: Path | None = None  # the tokenizer.json it was loaded from (load), for messages
        self._literal: Tokenizer | None = None  # _plain's copy
        self._special_re: re.Pattern[str] | None = None  # _special_spans'
        self._cutting: cutting.Cutting | None = None  # cuts()'s
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: int = tok.token_to_id(_content(hf.get("eos_token")) if hf else EOS)
        pad = _content(hf.get("pad_token")) if hf else PAD
        self.pad_id: int = tok.token_to_id(pad) if pad else self.eos_id
        bos = _content(hf.get("bos_token")) if hf else None
        self.bos_id: int | None = tok.token_to_id(bos) if bos else None  # trimtab's own has none
        # what decides the rows it makes: the token cache's key, a prepared dataset's record
        self.fingerprint = _fingerprint(tok, self.special_ids)
        # before, all of tokenizer_config.json counted (model_max_length...): what data prepared then recorded
        self._legacy = _sha256(tok.to_str() + json.dumps(hf, sort_keys=True)) if hf else self.fingerprint

    @functools.cached_property
    def id_limit(self) -> int:
        """One past the highest id this tokenizer decodes: vocab_size, or more where its ids have
        gaps (an added token placed past the rest). A model's head may be wider (padded)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def special_ids(self) -> tuple[int, int, int | None]:
        """The end-of-text, pad and start ids: where documents end and begin in the rows."""
        return self.eos_id, self.pad_id, self.bos_id

    def definition(self) -> dict[str, Any]:
        """tokenizer.json as tokenizers writes it (vocabulary, merges, normalizer, pre-tokenizer...)."""
        return json.loads(self._tok.to_str())

    def made(self, fingerprint: str) -> bool:
        """Whether rows recorded with `fingerprint` (a prepared dataset's) are this tokenizer's:
        its fingerprint, or the one it had before only what decides the rows counted."""
        return fingerprint in (self.fingerprint, self._legacy)

    def difference(self, other: TextTokenizer) -> str:
        """What of the fingerprint differs in `other`, in words (this one's value first); "" if nothing."""
        ours, theirs = self._tok.get_vocab(with_added_tokens=True), other._tok.get_vocab(with_added_tokens=True)
        found = []
        if ours != theirs:
            same = sum(theirs.get(token) == i for token, i in ours.items())
            found.append(f"the vocabularies differ ({len(ours)} vs {len(theirs)} tokens, {same} with the same id)")
        mine, its = self.definition(), other.definition()
        told = {"added_tokens", "model"} if ours != theirs else {"added_tokens"}  # said by the vocabularies
        if sections := [k for k in sorted((mine.keys() | its.keys()) - told) if mine.get(k) != its.get(k)]:
            found.append(f"tokenizer.json differs in {', '.join(repr(k) for k in sections)}")
        names = ("end-of-text", "pad", "start")
        found += [
            f"the {n} id differs ({a} vs {b})" for n, a, b in zip(names, self.special_ids, other.special_ids) if a != b
        ]
        return "; ".join(found)

    @property
    def chat(self) -> ChatFormat | None:
        """A Hugging Face tokenizer's chat format (its template, None if it has none); None for
        trimtab's own tokenizer, whose chat format is data/sources.py's, and for trimtab's own
        exported without a template (a run that never trained on chats: its tokenizer_config.json
        holds none), which a run initialised from the export formats chats as trimtab does."""
        if self.hf is None:
            return None
        template = self.hf.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and self._trimtabs():
            return None
        specials = {k: _content(v) for k, v in self.hf.items() if k.endswith("_token") and v}
        return ChatFormat(template, specials, str(self.settings or HF_CONFIG))

    def _trimtabs(self) -> bool:
        """Whether this is trimtab's own tokenizer (an export's): its special tokens, end of text first."""
        return _content(self.hf.get("eos_token")) == EOS and self._special_names() >= set(SPECIAL_TOKENS)

    def _special_names(self) -> set[str]:
        """The text of each special token of the vocabulary."""
        return {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}

    def encode(self, text: str, specials: bool = False) -> list[int]:
        """Token ids of a prompt, its special-token text the special tokens (as transformers'
        tokenizer reads a prompt: a chat template's output); `specials`: with what the tokenizer
        adds around a text (a Hugging Face tokenizer's bos, as transformers' encode does by
        default; trimtab's adds nothing). A document's text: encode_text."""
        return self._tok.encode(text, add_special_tokens=specials).ids

    def encode_text(self, text: str, specials: bool = False) -> list[int]:
        """Token ids of a document's text: special-token text in it is text (`<|endoftext|>`
        written in a file does not end it, `<|user|>` quoted in one is not a chat role);
        `specials`: with what the tokenizer adds around a text, as encode's."""
        return self._plain().encode(text, add_special_tokens=specials).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode_text of each of `texts`, on the tokenizer's threads."""
        return [enc.ids for enc in self._plain().encode_batch(texts, add_special_tokens=False)]

    def encode_documents(
        self, docs: list[Document], arrays: bool = False, later: list[bool] | None = None
    ) -> list[list[Any]]:
        """Each document's segments' ids (list[int] each; `arrays`: int32 numpy arrays, each encode
        call's ids converted as it returns: a 50 MB document's 12M ids as Python ints held 0.43 GB,
        as int32 48 MB); `later`, each document's: whether it continues a text (a long file's record
        after its first, data/shards.py), encoded without what the tokenizer puts before a text.
        Special-token text is the special token only where a chat template wrote it (Document.markup),
        else text (encode_text). A segment whose special-token text all lies in its markup is encoded
        whole, specials matched (as a prompt); one with some inside a message's content is encoded
        between its markup's."""
        out: list[list[list[Any]]] = [[] for _ in docs]  # each segment's ids in chunks, an encode call's each
        batches: dict[bool, list[tuple[int, int, str]]] = {False: [], True: []}  # specials matched?
        for i, doc in enumerate(docs):
            at = 0
            for j, (text, _) in enumerate(doc.segments):
                spans = _within(doc.markup, at, at + len(text))
                at += len(text)
                found = self._special_spans(text) if spans else []
                if all(_covered(spans, a, b) for a, b, _ in found):
                    batches[bool(found)].append((i, j, text))
                    out[i].append([])  # filled below, a batch at a time
                else:
                    out[i].append([self._between(text, [f for f in found if _covered(spans, f[0], f[1])])])
        for matched, items in batches.items():
            encoder = self._tok if matched else self._plain()
            # a long text in pieces whose ids are the whole text's (cutting.py); each: whether a later piece
            pieces = [(i, j, enumerate([t] if matched else self._pieces(t))) for i, j, t in items]
            parts = [(i, j, p, k > 0 or bool(later and later[i])) for i, j, texts in pieces for k, p in texts]
            for call in _calls(parts):
                for (i, j, *_), ids in zip(call, self._encoded(encoder, call)):
                    out[i][j].append(np.asarray(ids, dtype=np.int32) if arrays else ids)
        join = _joined_array if arrays else _joined_list
        return [[join(chunks) for chunks in segments] for segments in out]

    def _pieces(self, text: str) -> list[str]:
        """`text` in formats.pieces where their ids are the whole text's (cutting.Cutting.whole), else whole."""
        parts = list(formats.pieces(text, formats.TEXT_CHUNK_CHARS))
        return parts if len(parts) == 1 or self.cuts().whole(parts) else [text]

    def cuts(self) -> cutting.Cutting:
        """How its long texts are cut (cutting.py), learned on first use."""
        if self._cutting is None:
            self._cutting = cutting.learn(self._tok)
        return self._cutting

    def _encoded(self, encoder: Tokenizer, call: list[_Item]) -> list[list[int]]:
        """The ids of a call's texts by `encoder`, a later piece of a text by the Cutting's `later` (without
        what the tokenizer puts before a text)."""
        later = self.cuts().later if any(item[3] for item in call) else None
        if later is None:  # a byte-level tokenizer's pieces (it puts nothing before a text), or no piece
            return [enc.ids for enc in encoder.encode_batch([item[2] for item in call], add_special_tokens=False)]
        ids: list[list[int]] = [[] for _ in call]
        for tok, pick in ((encoder, False), (later, True)):
            texts = [(k, item[2]) for k, item in enumerate(call) if item[3] == pick]
            for (k, _), enc in zip(texts, tok.encode_batch([t for _, t in texts], add_special_tokens=False)):
                ids[k] = enc.ids
        return ids

    def _plain(self) -> Tokenizer:
        """A copy that reads special-token text as text (tokenizers' encode_special_tokens), made
        on first use; a copy, so a prompt encoded meanwhile on another thread keeps its specials."""
        if self._literal is None:
            self._literal = Tokenizer.from_str(self._tok.to_str())
            self._literal.encode_special_tokens = True
        return self._literal

    def _special_spans(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, id) of each special token's text in `text`, leftmost and longest first."""
        if self._special_re is None:
            names = sorted(self._special_names(), key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, names)) or "(?!)")
        return [(m.start(), m.end(), self._tok.token_to_id(m.group())) for m in self._special_re.finditer(text)]

    def _between(self, text: str, specials: list[tuple[int, int, int]]) -> list[int]:
        """`text` as text, but for `specials` (start, end, id): the special tokens there."""
        ids, at = [], 0
        for start, end, token in specials:
            ids += self.encode_text(text[at:start]) + [token]
            at = end
        return ids + self.encode_text(text[at:])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def prepends_bos(self, text: str) -> bool:
        """Whether a document beginning with `text` is trained with the start token before it: a
        tokenizer with one (Llama's) saw every document begin with it in pretraining; a chat
        template that writes it already is left alone. Not learned."""
        return self.bos_id is not None and not text.startswith(self.decode([self.bos_id]))

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            self._tok.save(str(tmp))
            os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
        except BaseException:  # a full disk: the half-written copy would stay beside it for good
            tmp.unlink(missing_ok=True)
            raise
        if self.hf is not None:  # its settings travel with it (load reads them back)
            write_json(path.with_name(HF_CONFIG), self.hf)

    @classmethod
    def load(cls, path: Path, key: str = "tokenizer file", fix: str | None = None) -> TextTokenizer:
        """Load a tokenizer.json, or a directory's (a Hugging Face model's: a tokenizer_config.json
        beside it makes it a Hugging Face one); `key` names it in errors (e.g. "data.tokenizer"),
        `fix` ends the error of a corrupt one (by default: restore it, or point data.tokenizer at a
        good one when that is the key)."""
        path = Path(path)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise DataError(
                    f"{key} '{path}' is a directory without a tokenizer.json; point it at a tokenizer.json, or at a "
                    "Hugging Face model directory that holds one (tokenizer.save_pretrained writes it)"
                )
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{key} '{path}' does not exist; check the path")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception, its text serde's, for any bad file
            if fix is None:
                fix = "restore a good copy of it (a backup, or the copy in checkpoint.dir's store if the run has one)"
                if key == "data.tokenizer":
                    fix = "restore it, or point data.tokenizer at a good tokenizer.json (tokenizers' Tokenizer.save)"
            raise DataError(f"{key} '{path}' is corrupt or unreadable: {_damage(path, exc)}; {fix}") from None
        if (path.parent / HF_CONFIG).is_file():
            loaded = cls(tok, _hf_settings(tok, path.parent / HF_CONFIG, key), path.parent / HF_CONFIG)
        else:
            if tok.token_to_id(EOS) is None:
                raise DataError(f"{key} '{path}' has no {EOS} token; add it to the tokenizer's vocabulary")
            tok.add_special_tokens(SPECIAL_TOKENS)  # no-op for those present; new ids for the rest
            loaded = cls(tok)
        loaded.origin = path
        return loaded


def _damage(path: Path, exc: Exception) -> str:
    """What is wrong with a tokenizer file tokenizers could not read, in words: unreadable, not
    JSON (cut short or garbled: where, as Python's parser says), or JSON that is no tokenizer."""
    try:
        text = path.read_bytes().decode()
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    except UnicodeDecodeError:
        return "it is not text (binary or garbled bytes)"
    try:
        value = json.loads(text)
    except ValueError as err:
        where = f"line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        cut = not text.rstrip().endswith("}")  # a whole one ends its object; a truncated write does not
        return f"it is not valid JSON ({'cut short' if cut else 'garbled'}: {where} of {len(text)} bytes)"
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not isinstance(value, dict) or "model" not in value:
        return "it is JSON but not a tokenizer (a tokenizers tokenizer.json has a 'model' with its vocabulary)"
    return f"it is JSON but not a tokenizer tokenizers can read ({reason})"


_Item = tuple[int, int, str, bool]  # (document, segment, text, whether a piece of it after the first)


def _calls(items: list[_Item]) -> Iterator[list[_Item]]:
    """`items` in runs of at most ENCODE_CALL_CHARS characters (at least one item each): an encode
    call holds ~130 bytes a character of its texts until it returns."""
    call: list[_Item] = []
    size = 0
    for item in items:
        if call and size + len(item[2]) > ENCODE_CALL_CHARS:
            yield call
            call, size = [], 0
        call.append(item)
        size += len(item[2])
    if call:
        yield call


def _joined_list(chunks: list[list[int]]) -> list[int]:
    return chunks[0] if len(chunks) == 1 else list(chain.from_iterable(chunks))


def _joined_array(chunks: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(c, dtype=np.int32) for c in chunks]) if chunks else np.zeros(0, np.int32)


def _within(spans: tuple[tuple[int, int], ...], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of `spans` inside [start, end), relative to start."""
    return [(max(a, start) - start, min(b, end) - start) for a, b in spans if a < end and b > start]


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(a <= start and end <= b for a, b in spans)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _fingerprint(tok: Tokenizer, special_ids: tuple[int, int, int | None]) -> str:
    """tokenizer.json as tokenizers writes it (vocabulary, merges, normalizer, pre-tokenizer...)
    and the special ids; nothing else of a Hugging Face tokenizer_config.json counts (its
    model_max_length, its class: an exported run's tokenizer is that run's). The special ids of
    trimtab's own tokenizer add nothing, so its fingerprint is the one recorded before."""
    own = (tok.token_to_id(EOS), tok.token_to_id(PAD), None)
    return _sha256(tok.to_str() + ("" if special_ids == own else json.dumps(special_ids)))


def _content(token: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_settings(tok: Tokenizer, path: Path, key: str) -> dict:
    """tokenizer_config.json, checked: its end-of-text token (and pad, if any) must be in the
    vocabulary, since documents are separated by it."""
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); it must be the tokenizer's JSON settings") from None
    jinja = path.parent / "chat_template.jinja"  # transformers 5 saves the template beside
    if "chat_template" not in settings and jinja.is_file():
        settings["chat_template"] = jinja.read_text()
    for field in ("eos_token", "pad_token"):
        name = _content(settings.get(field))
        if field == "eos_token" and not name:
            raise DataError(f"{path}: no 'eos_token'; name the end-of-text token there ({key})")
        if name and tok.token_to_id(name) is None:
            raise DataError(f"{path}: '{field}' {name!r} is not in the vocabulary of {path.parent / 'tokenizer.json'}")
    return settings


def configured_tokenizer(cfg: DataConfig) -> TextTokenizer | None:
    """data.tokenizer as a run reads it (a tokenizer.json, or a directory holding one); None when
    unset. `trimtab plan` reads it through here too, so both accept the same paths."""
    return TextTokenizer.load(Path(cfg.tokenizer), key="data.tokenizer") if cfg.tokenizer else None


def get_tokenizer(cfg: DataConfig, docs: list[Document], cache_dir: Path) -> TextTokenizer:
    """cfg.tokenizer if set, else a BPE trained on docs, cached by (corpus, vocab size)."""
    if (configured := configured_tokenizer(cfg)) is not None:
        return configured
    if cfg.bpe_vocab_size < MIN_VOCAB:
        raise DataError(
            f"data.bpe_vocab_size={cfg.bpe_vocab_size} is below the {MIN_VOCAB} byte-level base and special "
            "tokens; raise it"
        )
    key = hashlib.sha256(f"{corpus_fingerprint(docs)}:{cfg.bpe_vocab_size}:{SPECIAL_TOKENS}".encode())
    path = Path(cache_dir) / f"tokenizer-{key.hexdigest()[:20]}.json"
    if path.is_file():
        return TextTokenizer.load(path)
    tok = train_tokenizer(docs, cfg.bpe_vocab_size)
    try:
        tok.save(path)
    except Exception as exc:  # tokenizers raises a bare Exception for a failed write
        cache_not_written(path, exc)
    return tok


def cache_not_written(path: Path, exc: BaseException) -> None:
    """Say that a cache entry (a tokenizer, a corpus's tokens) could not be written: a cache only
    saves time, so a full or read-only cache disk must not stop a run (it stopped it at start-up,
    "the disk is full", naming no path, on a run directory with room to spare)."""
    logger.warning(
        "%s not cached (%s); the run goes on without it: free space there or point TRIMTAB_CACHE elsewhere",
        path,
        exc,
    )


def train_tokenizer(docs: list[Document], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE of vocab_size trained on docs, with trimtab's special tokens."""
    if vocab_size < MIN_VOCAB:
        raise DataError(f"a vocabulary of {vocab_size} is below the {MIN_VOCAB} byte-level base and special tokens")
    start = time.perf_counter()
    tok = TextTokenizer(_train_bpe(docs, vocab_size))
    logger.info("trained a byte-level BPE tokenizer (vocab %d) in %.1fs", tok.vocab_size, time.perf_counter() - start)
    return tok


def _train_bpe(docs: list[Document], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(docs), trainer)
    return tok


def _training_texts(docs: list[Document]) -> Iterator[str]:
    """The texts the BPE trains on: the documents' first TRAIN_SAMPLE_BYTES, in pieces of at most
    TRAIN_PIECE_CHARS cut before a word (the pieces' words are the whole text's)."""
    left = TRAIN_SAMPLE_BYTES
    for piece in _pieces(docs):
        size = len(piece.encode())
        yield piece if size <= left else piece.encode()[:left].decode(errors="ignore")
        left -= size
        if left <= 0:
            return


def _pieces(docs: list[Document]) -> Iterator[str]:
    # the trainer does not split out special tokens itself: it would learn merges like "<|"
    for doc in docs:
        for text, _ in doc.segments:
            for part in _SPECIAL_RE.split(text):
                yield from formats.pieces(part, TRAIN_PIECE_CHARS)
