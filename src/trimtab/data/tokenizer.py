"""Byte-level BPE tokenizer: trained on the corpus (and cached) or loaded from a tokenizer.json,
either trimtab's own or a Hugging Face model's (used as is)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trimtab.config import DataConfig
from trimtab.data.chat import ChatFormat
from trimtab.data.sources import Document, corpus_fingerprint
from trimtab.errors import DataError
from trimtab.rundir import write_json

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
EOS, PAD = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
_SPECIAL_RE = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens


HF_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: a Hugging Face tokenizer's settings


class TextTokenizer:
    """A tokenizers.Tokenizer whose special tokens are matched inside text (chat templates) and whose
    byte-level model round-trips any UTF-8 text.

    trimtab's own has SPECIAL_TOKENS (end of text, pad, chat roles). A Hugging Face one (`hf`: its
    tokenizer_config.json) is used exactly as it is: its vocabulary, its end-of-text and pad
    tokens, its chat template; nothing is added, so ids match the model it came with."""

    def __init__(self, tok: Tokenizer, hf: dict | None = None) -> None:
        self._tok = tok
        self.hf = hf
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
        trimtab's own tokenizer, whose chat format is data/sources.py's."""
        if self.hf is None:
            return None
        template = self.hf.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        specials = {k: _content(v) for k, v in self.hf.items() if k.endswith("_token") and v}
        return ChatFormat(template, specials)

    def encode(self, text: str, specials: bool = False) -> list[int]:
        """Token ids of `text`; `specials`: with what the tokenizer adds around a text (a Hugging
        Face tokenizer's bos, as transformers' encode does by default; trimtab's adds nothing)."""
        return self._tok.encode(text, add_special_tokens=specials).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

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
        self._tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
        if self.hf is not None:  # its settings travel with it (load reads them back)
            write_json(path.with_name(HF_CONFIG), self.hf)

    @classmethod
    def load(
        cls, path: Path, key: str = "tokenizer file", fix: str = "save it with tokenizers' Tokenizer.save"
    ) -> TextTokenizer:
        """Load a tokenizer.json (a Hugging Face one when a tokenizer_config.json sits beside it);
        `key` names it in errors (e.g. "data.tokenizer"), `fix` ends the error of an unreadable one."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{key} '{path}' does not exist; check the path")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable files
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"{key} '{path}' is not a tokenizers JSON file ({reason}); {fix}") from None
        if (path.parent / HF_CONFIG).is_file():
            return cls(tok, _hf_settings(tok, path.parent / HF_CONFIG, key))
        if tok.token_to_id(EOS) is None:
            raise DataError(f"{key} '{path}' has no {EOS} token; add it to the tokenizer's vocabulary")
        tok.add_special_tokens(SPECIAL_TOKENS)  # no-op for those present; new ids for the rest
        return cls(tok)


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


def get_tokenizer(cfg: DataConfig, docs: list[Document], cache_dir: Path) -> TextTokenizer:
    """cfg.tokenizer if set, else a BPE trained on docs, cached by (corpus, vocab size)."""
    if cfg.tokenizer:
        return TextTokenizer.load(Path(cfg.tokenizer), key="data.tokenizer")
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
    tok.save(path)
    return tok


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
    # the trainer does not split out special tokens itself: it would learn merges like "<|"
    for doc in docs:
        for text, _ in doc.segments:
            yield from (piece for piece in _SPECIAL_RE.split(text) if piece)
