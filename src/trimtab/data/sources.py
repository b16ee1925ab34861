"""Reading a corpus into documents: the builtin stdlib corpus, text files and JSONL records.

A document is a list of (text, trainable) segments so that chat and instruction data can mask the
loss on the prompt side; plain text is one fully trainable segment.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab.config import DataConfig
from trimtab.data import arithmetic, formats
from trimtab.data.chat import ChatFormat, MissingTemplate, TemplateError, render_document
from trimtab.data.listing import PREPARED_MANIFEST, SHOWN, SameBytes, builtin_files, shown, source_files
from trimtab.data.prepared import read_manifest
from trimtab.errors import DataError

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
END = "<|end|>"
# _render's format as a Jinja chat template (exported with the tokenizer of a chat-trained model)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class Document:
    segments: list[tuple[str, bool]]  # (text, trainable): loss is computed only on trainable text
    source: str = ""  # where it came from: a file, file:line for a JSONL record (journaled when left out)
    # [start, end) character spans of the text a chat template wrote (not a message's content):
    # special-token text there is the special token; anywhere else it is text (encode_documents)
    markup: tuple[tuple[int, int], ...] = ()

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)


def corpus_fingerprint(docs: Iterable[Document]) -> str:
    """A hash of the texts and their trainable flags: the key of the tokenizer and token caches."""
    h = hashlib.sha256()
    for doc in docs:
        for text, trainable in doc.segments:
            data = text.encode()
            h.update(b"%d:%d:" % (trainable, len(data)))
            h.update(data)
        h.update(repr(doc.markup).encode() if doc.markup else b"")  # plain text's key as it was
        h.update(b"|")
    return h.hexdigest()


def read_documents(
    cfg: DataConfig,
    source: str | list[str] | None = None,
    section: str = "data",
    chat: ChatFormat | None = None,
    key: str = "",
) -> tuple[list[Document], int]:
    """Read `source` (default cfg.source) up to cfg.max_bytes; returns (docs, n_skipped_bad_records).

    `section` is the config section named in error messages ("finetune.data" for that phase),
    `key` the config key of the source (default: SECTION.source or SECTION.eval_source).
    `chat`: a Hugging Face tokenizer's chat format for chat and instruction records (None:
    trimtab's own, CHAT_TEMPLATE).
    """
    source = cfg.source if source is None else source
    key = key or (f"{section}.source" if source == cfg.source else f"{section}.eval_source")
    reader = _Reader(cfg, section, key, chat, limit=cfg.max_bytes)
    docs, capped = _take_bytes(reader.documents(source), cfg.max_bytes)
    if capped and source != "builtin" and not str(source).startswith(arithmetic.SOURCE):
        logger.warning(
            "%s %s: reached %s.max_bytes=%d, the rest is not read; set it to 0 to read all",
            key,
            as_written(source),
            section,
            cfg.max_bytes,
        )
    _say_skipped(reader, key, as_written(source), section)
    if not docs:
        why = f"; all {reader.n_skipped} records were malformed" if reader.n_skipped else ""
        raise DataError(
            f"{key} {as_written(source)} has no text (the corpus is empty{why}); point it at non-empty text or "
            ".jsonl files"
        )
    return docs, reader.n_skipped


def _say_skipped(reader: _Reader, key: str, source: str, section: str) -> None:
    """What the reader left out, a line for each kind: unreadable files, malformed records, files
    with the bytes of one read before them."""
    if reader.n_undecodable:
        logger.warning(
            "%s %s: skipped %d %s that cannot be read as text (the first: %s)",
            key,
            source,
            reader.n_undecodable,
            "file" if reader.n_undecodable == 1 else "files",
            reader.undecodable_example,
        )
    if reader.n_skipped:
        more = ", ..." if reader.n_skipped > len(reader.skipped_where) else ""
        logger.warning(
            "%s %s: skipped %d malformed %s (%s.skip_bad_records=true; the first: %s%s)",
            key,
            source,
            reader.n_skipped,
            "record" if reader.n_skipped == 1 else "records",
            section,
            ", ".join(reader.skipped_where),
            more,
        )
    if reader.empty:  # a file a tool left empty, or one half written: training read nothing of it, unsaid
        logger.warning("%s %s: skipped %s (no text in it)", key, source, shown(reader.empty, "empty file", "", "s"))
    if reader.repeated:
        said = shown(reader.repeated, "file", "", "s")
        logger.warning(
            "%s %s: the same bytes as a file before, read once (as data prepare does): %s", key, source, said
        )


def as_written(source: str | list[str]) -> str:
    """A source as a person wrote it in the config: 'PATH', or a list as YAML's [A, B] (not Python's repr)."""
    return f"'{source}'" if isinstance(source, str) else f"[{', '.join(source)}]"


def _take_bytes(docs: Iterator[Document], max_bytes: int) -> tuple[list[Document], bool]:
    """Consume docs until max_bytes of UTF-8 text (0: all); returns (docs, whether it was reached)."""
    out: list[Document] = []
    total = 0
    for doc in docs:
        size = len(doc.text.encode())
        if max_bytes and total + size > max_bytes and len(doc.segments) == 1 and not doc.markup:
            # plain text is cut to fit; a chat record is kept whole so its template stays intact
            doc = Document([(_truncate(doc.text, max_bytes - total), doc.segments[0][1])], doc.source)
        if doc.text:
            out.append(doc)
        total += size
        if max_bytes and total >= max_bytes:  # checked before pulling more: nothing past it is read
            return out, True
    return out, False


def _disk_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # unreadable: reading it says so
        return 0


def _truncate(text: str, n_bytes: int) -> str:
    """The first n_bytes of text, cut back to a line end when there is one (no half lines)."""
    head = text.encode()[:n_bytes].decode(errors="ignore")
    cut = head.rfind("\n")
    return head[: cut + 1] if cut >= 0 else head


def _decode(data: bytes) -> str | None:
    """UTF-8 text (BOM dropped), or None for binary / other encodings."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


@dataclass
class _Reader:
    cfg: DataConfig
    section: str
    key: str
    chat: ChatFormat | None = None
    fix: str = ""  # how the caller skips a malformed record (default: the SECTION.skip_bad_records key)
    limit: int = 0  # the bytes the caller takes at most (0: all): a file's records are held back up to it
    exclude: tuple[Path, ...] = ()  # directories never read (prepare's --out)
    n_skipped: int = 0
    skipped_where: list[str] = field(default_factory=list)  # FILE:LINE of the first malformed records (SHOWN)
    n_undecodable: int = 0
    undecodable_example: str = ""
    repeated: list[str] = field(default_factory=list)  # "FILE (as EARLIER)": files of the same bytes, read once
    empty: list[str] = field(default_factory=list)  # files with no text and no malformed record (prepare says them)
    _same: SameBytes = field(default_factory=SameBytes)

    def documents(self, source: str | list[str]) -> Iterator[Document]:
        if source == "builtin":
            yield from self._builtin()
            return
        if isinstance(source, str) and source.startswith(arithmetic.SOURCE):
            yield from self._arithmetic(source)
            return
        for path, named in source_files(source, self.key, self.exclude):
            if (earlier := self._earlier(path)) is not None:
                self.repeated.append(f"{path} (as {earlier})")
                continue
            yield from self._file(path, named, self.limit)

    def spread(self, sources: list[str], budget: int) -> list[Document]:
        """About `budget` bytes of the sources' text drawn from every file, in the files' order: a
        tokenizer trained on the first files until the budget learns only their kind of text. Files
        are read smallest first (on disk), each taking at most an equal share of what is left, so a
        file under its share leaves the rest to larger ones (water-filling); the same files give the
        same sample. A file's own head is its share (its text is read up to it, not past it)."""
        files = [pair for source in sources for pair in source_files(source, self.key, self.exclude)]
        order = sorted(range(len(files)), key=lambda i: _disk_size(files[i][0]))  # stable: ties keep the listing's
        taken: dict[int, list[Document]] = {}
        left = budget
        for rank, i in enumerate(order):
            share = left // (len(order) - rank)
            path, named = files[i]
            if share <= 0:  # fewer bytes than files left: _take_bytes(0) would mean all of it
                break
            if (earlier := self._earlier(path)) is not None:
                self.repeated.append(f"{path} (as {earlier})")
                continue
            taken[i], _ = _take_bytes(self._file(path, named, share), share)
            left -= sum(len(doc.text.encode()) for doc in taken[i])
        return [doc for i in sorted(taken) for doc in taken[i]]

    def _earlier(self, path: Path) -> Path | None:
        """The file read before with path's bytes (a symlink, a copy, a file named twice): read
        once, as `trimtab data prepare` prepares it once (by its sha256)."""
        try:
            return self._same.earlier(path)
        except OSError:  # unreadable: reading it says so
            return None

    def _builtin(self) -> Iterator[Document]:
        root, files = builtin_files()
        if not files:
            raise DataError(
                f"{self.key}: no .py files under {root} (this Python ships its standard "
                f"library zipped?); set {self.key} to a text file or directory"
            )
        for file in files:
            text = _decode(file.read_bytes())
            if text:  # a few stdlib test files are deliberately not UTF-8
                yield Document([(text, True)], f"stdlib/{file.relative_to(root).as_posix()}")

    def _arithmetic(self, source: str) -> Iterator[Document]:
        """The built-in arithmetic task's train problems as text (data/arithmetic.py): a
        supervised warm start for RL on the same task; its held-out problems are never read."""
        try:
            digits = arithmetic.digits_of(source)
        except ValueError as exc:
            raise DataError(f"{self.key} {exc}") from None
        for i, (prompt, answer) in enumerate(arithmetic.problems(arithmetic.DOCUMENTS, 0, digits)):
            yield Document([(arithmetic.text(prompt, answer), True)], f"arithmetic/{i}")

    def _file(self, path: Path, strict: bool, limit: int) -> Iterator[Document]:
        """The file's documents; `limit` the bytes the caller takes at most (0: all)."""
        if formats.kind_of(path, self.cfg.format) != "text":
            yield from self._records(path, strict, limit)
            return
        parts, chars = [], 0
        try:  # a text file is one document: read whole (up to the limit), so an unreadable one yields nothing
            for record in formats.records(path, self.cfg.format):
                parts.append(record.value)
                chars += len(record.value)
                if limit and chars > limit:
                    break  # the caller takes no more: a 30 GB file is not read into memory for 6 MB of it
        except formats.Unreadable as exc:
            if strict:
                raise
            self._unreadable(exc)
            return
        if text := "".join(parts):
            yield Document([(text, True)], str(path))
        else:
            self.empty.append(str(path))

    def _records(self, path: Path, strict: bool, limit: int) -> Iterator[Document]:
        """The file's records as documents. They are held back until the file is read, or until
        the caller has all it takes (`limit`): so a directory's file found unreadable part way
        (a bad byte on line 20) is skipped whole, as a text file is."""
        fix = self.fix or f"set {self.section}.skip_bad_records=true"
        held, chars, skipped = [], 0, []  # skipped: the malformed records' FILE:LINE, the first SHOWN of them
        n_skipped, any_record = 0, False
        try:
            for doc, record in record_documents(path, self.cfg, self.chat, fix):
                if doc is None:
                    n_skipped, any_record = n_skipped + 1, True
                    skipped += [record.where][: SHOWN - len(skipped)]
                elif doc.text:
                    held.append(doc)
                    any_record = True
                    chars += len(doc.text)  # at most its bytes: the limit is never passed unread
                if limit and chars > limit:
                    self._skipped(n_skipped, skipped)
                    yield from held
                    held, chars, skipped, n_skipped = [], 0, [], 0
        except formats.Unreadable as exc:
            if strict:
                raise
            self._unreadable(exc)
            return
        self._skipped(n_skipped, skipped)
        if not any_record:
            self.empty.append(str(path))
        yield from held

    def _skipped(self, n: int, where: list[str]) -> None:
        """Count `n` malformed records left out, keeping the first few FILE:LINEs (`where`): a count alone left a
        person to hunt through the files for them."""
        self.n_skipped += n
        self.skipped_where += where[: max(0, SHOWN - len(self.skipped_where))]

    def _unreadable(self, exc: formats.Unreadable) -> None:
        self.n_undecodable += 1  # the first one's whole message: cut at "; " it lost the fix (the iconv command)
        self.undecodable_example = self.undecodable_example or str(exc)


def record_documents(
    path: Path, cfg: DataConfig, chat: ChatFormat | None, fix: str, span: formats.Span | None = None
) -> Iterator[tuple[Document | None, formats.Record]]:
    """Each record of a file (of `span` of it) as a document, with the record it came from; None
    for a malformed record when cfg.skip_bad_records, else a DataError naming FILE:LINE (or FILE
    row N) and how to skip it (`fix`)."""
    for record in formats.records(path, cfg.format, span):
        try:
            doc = to_document(formats.parse_json(record), cfg, chat)
        except MissingTemplate as exc:
            raise DataError(f"{record.where}: a chat record, and {exc}") from None
        except (json.JSONDecodeError, BadRecord) as exc:
            if not cfg.skip_bad_records:
                raise DataError(f"{record.where}: {_describe(exc)}; fix the record or {fix}") from None
            yield None, record
            continue
        doc.source = record.where
        yield doc, record


def _describe(exc: Exception) -> str:
    """What is wrong with a record, in words."""
    if isinstance(exc, json.JSONDecodeError):
        # json's "Unterminated string starting at" ends in its own "at": said once
        return f"invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
    return str(exc)


def to_document(rec: Any, cfg: DataConfig, chat: ChatFormat | None = None) -> Document:
    """A record (a JSON object or a table row) as a document: its cfg.text_field, a chat
    (`messages`) or an instruction (`prompt` / `response`), per cfg.format; BadRecord if it is
    none of them. `chat`: a Hugging Face tokenizer's chat format (None: trimtab's own)."""
    if not isinstance(rec, dict):
        raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    kind = cfg.format if cfg.format in ("text", "chat", "instruction") else _detect(rec, cfg.text_field)
    if kind == "text":
        return Document([(_string(rec, cfg.text_field), True)])
    turns = (
        _chat(rec) if kind == "chat" else [("user", _string(rec, "prompt")), ("assistant", _string(rec, "response"))]
    )
    if chat is None:
        return _render(turns)
    try:
        segments, markup = render_document(chat, turns)
    except MissingTemplate:
        raise  # the tokenizer's, for the caller to name: skipping the record would skip them all
    except TemplateError as exc:
        raise BadRecord(str(exc)) from None
    return Document(segments, markup=markup)


def prepared_dir(source: str | list[str]) -> Path | None:
    """The directory if `source` is one `trimtab data prepare` wrote (data/prepared.py)."""
    if isinstance(source, str) and (Path(source) / PREPARED_MANIFEST).is_file():
        return Path(source)
    return None


def is_chat(cfg: DataConfig) -> bool:
    """Whether this data trains on chat or instruction records: its format says so, or (auto,
    jsonl) the first record of a source is one."""
    if cfg.format in ("chat", "instruction"):
        return True
    if cfg.format == "text":
        return False
    return any(_source_is_chat(part.source, cfg) for part in cfg.sources)


def _source_is_chat(source: str | list[str], cfg: DataConfig) -> bool:
    if source == "builtin" or str(source).startswith(arithmetic.SOURCE):
        return False
    if (prepared := prepared_dir(source)) is not None:
        return bool((read_manifest(prepared) or {}).get("chat", False))
    try:
        files = source_files(source, "data.source")
        first = next((p for p, _ in files if formats.kind_of(p, cfg.format) != "text"), None)
        record = next(formats.records(first, cfg.format), None) if first else None
        rec = formats.parse_json(record) if record else None
    except (DataError, json.JSONDecodeError):
        return False
    return isinstance(rec, dict) and _detect_kind(rec, cfg.text_field) in ("chat", "instruction")


def _detect_kind(rec: dict[str, Any], text_field: str) -> str | None:
    try:
        return _detect(rec, text_field)
    except BadRecord:
        return None


class BadRecord(ValueError):
    """One JSONL record is malformed; the message says what is wrong with it."""


def _detect(rec: dict[str, Any], text_field: str) -> str:
    if text_field in rec:
        return "text"
    if "messages" in rec:
        return "chat"
    if "prompt" in rec or "response" in rec:
        return "instruction"
    keys = ", ".join(map(repr, rec)) or "none"
    raise BadRecord(f"no '{text_field}', 'messages' or 'prompt'/'response' key (found {keys}){_text_hint(rec)}")


def _text_hint(rec: dict[str, Any]) -> str:
    """The setting that reads text under another name ("fix the record" meant every line); several
    string fields (Alpaca's) are named, none picked: one alone would drop the others."""
    texts = [k for k, v in rec.items() if isinstance(v, str)]
    if len(texts) != 1:
        named = ", ".join(map(repr, texts))
        return (
            f"; if one of {named} holds the text, name it in data.text_field (prepare: --text-field)" if texts else ""
        )
    return f"; if '{texts[0]}' holds the text: data.text_field={texts[0]} (prepare: --text-field {texts[0]})"


def _string(rec: dict[str, Any], name: str, where: str = "") -> str:
    if name not in rec:
        raise BadRecord(f"missing '{where}{name}'")
    if not isinstance(rec[name], str):
        raise BadRecord(f"'{where}{name}' must be a string, got {type(rec[name]).__name__}")
    _check_unicode(rec[name], f"{where}{name}")
    return rec[name]


def _check_unicode(text: str, name: str) -> None:
    """JSON's \\uD800-\\uDFFF escapes decode to a lone surrogate when unpaired (scraped text cut
    inside an emoji): no UTF-8 holds it, so byte counting and the tokenizer would fail on it later
    with a traceback naming no record. Refused here, where the record's file:line is known."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRecord(
            f"'{name}' holds a lone UTF-16 surrogate ({text[exc.start]!r} at character {exc.start}: a \\u escape "
            "without its pair), which is not Unicode text"
        ) from None


def _chat(rec: dict[str, Any]) -> list[tuple[str, str]]:
    messages = rec.get("messages")
    if messages is None:
        raise BadRecord("missing 'messages'")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list of {role, content} objects")
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRecord(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise BadRecord(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        turns.append((role, _string(msg, "content", where=f"messages[{i}].")))
    if not any(role == "assistant" for role, _ in turns):
        raise BadRecord("no assistant message, so nothing to train on")
    return turns


def _render(turns: list[tuple[str, str]]) -> Document:
    """Chat template; only assistant content and its <|end|> are trainable. The roles' tokens and
    <|end|> are its markup: the same text inside a content is text."""
    segments: list[tuple[str, bool]] = []
    markup: list[tuple[int, int]] = []
    at = 0
    for role, content in turns:
        head = f"<|{role}|>\n"
        if role == "assistant":
            parts = [(head, False, True), (content, True, False), (END, True, True), ("\n", False, True)]
        else:
            parts = [(head, False, True), (content, False, False), (END + "\n", False, True)]
        for text, trainable, written in parts:
            if written:
                markup.append((at, at + len(text)))
            at += len(text)
            if segments and segments[-1][1] == trainable:  # merge: fewer, longer pieces to encode
                segments[-1] = (segments[-1][0] + text, trainable)
            else:
                segments.append((text, trainable))
    return Document(segments, markup=tuple(markup))
