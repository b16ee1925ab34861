"""Files as streams of records, one at a time, so memory stays flat however large a file is.

Plain text (a whole file is one document), JSONL (also gzip / zstd compressed) and the columnar
formats Parquet, Arrow and CSV, read through Hugging Face `datasets` in streaming mode (the
`[data]` extra). Each record comes with where it is: its line in a JSONL file, its row in a
columnar one, so that an error names it.
"""

from __future__ import annotations

import codecs
import csv
import functools
import gzip
import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trimtab.errors import DataError
from trimtab.extras import require

logger = logging.getLogger(__name__)

JSONL = (".jsonl", ".ndjson")
COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
ZSTD_CHUNK = 1 << 16  # compressed bytes decompressed at once
READ_CHUNK = 1 << 20  # bytes (characters) of a JSONL file read at once
TEXT_CHUNK_CHARS = 1_000_000  # a long plain-text file is encoded in pieces of about this size
# where a piece of text is cut, searched in reversed text: before the last space that precedes a
# word, else the last whitespace that does. Pre-tokenizers attach a space to the word after it and
# join a run of whitespace (GPT-2's "\n\n   " before " def", Llama 3's "\r\n" and `")\n\n`): a cut
# after a line end can split what the whole text keeps as one pre-token, so other tokens than in memory
_SPACE_BEFORE_WORD = re.compile(r"\S ")
_WHITESPACE_BEFORE_WORD = re.compile(r"\S\s")
_SPACE_BETWEEN_WORDS = re.compile(r"\S \S")  # formats.pieces' first choice (its docstring)


class Unreadable(DataError):
    """A file that cannot be read as its format: not UTF-8, a broken archive, a damaged table."""


@dataclass(frozen=True)
class Record:
    """One record: a JSON object (JSONL, a table row) or a piece of plain text (str)."""

    value: Any
    where: str  # "FILE:LINE" for a JSONL line, "FILE row N" for a table row, "FILE" for text
    line: int = 0  # the line (JSONL) or row (table) number, from 1; 0 for plain text
    last: bool = True  # plain text in pieces: False until a document's last piece


def kind_of(path: Path, fmt: str = "auto") -> str:
    """'jsonl', 'columnar' or 'text', from the name (a compression suffix looked through);
    `fmt` jsonl/chat/instruction reads any non-columnar file as JSONL."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in COLUMNAR:
        return "columnar"
    if last in JSONL or fmt in ("jsonl", "chat", "instruction"):
        return "jsonl"
    return "text"


Span = list[int]  # [start byte, end byte, number of the line at start]: a piece of a JSONL file


def splittable(path: Path, fmt: str = "auto") -> bool:
    """Whether the file can be read in byte ranges (uncompressed JSONL: a line is a record)."""
    return kind_of(path, fmt) == "jsonl" and path.suffix.lower() not in COMPRESSED


def spans(path: Path, piece: int) -> list[Span]:
    """The file cut into pieces of about `piece` bytes at line ends, each with its first line's
    number (counted on the way: one read of the file)."""
    cuts, line, pos, target = [[0, 1]], 1, 0, piece
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            while target < pos + len(block):
                at = block.find(b"\n", max(target - pos, 0))
                if at < 0:
                    break  # the line goes on in the next block: cut there
                cuts.append([pos + at + 1, line + block.count(b"\n", 0, at + 1)])
                target = pos + at + 1 + piece
            line += block.count(b"\n")
            pos += len(block)
    ends = [c[0] for c in cuts[1:]] + [pos]
    return [[start, end, first] for (start, first), end in zip(cuts, ends) if end > start]


def records(path: Path, fmt: str = "auto", span: Span | None = None) -> Iterator[Record]:
    """The records of one file (of its `span` only, for a splittable file), in order. Raises
    Unreadable naming the file for a file that cannot be read as its format (not UTF-8, a
    broken archive, a damaged table)."""
    kind = kind_of(path, fmt)
    try:
        if kind == "columnar":
            yield from _table(path)
        elif splittable(path, fmt):
            yield from _jsonl_bytes(path, span or [0, path.stat().st_size, 1])
        elif kind == "jsonl":
            with _open_text(path) as fh:
                for lineno, line in enumerate(_lines(fh), start=1):
                    if line.strip():
                        yield Record(line, f"{path}:{lineno}", lineno)
        else:
            yield from _text(path)
    except UnicodeDecodeError as exc:
        raise Unreadable(_not_utf8(path, _bad_line(path, binary_nul=kind == "text"), exc)) from None
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise Unreadable(f"{path}: cannot be read as {kind} ({_first_line(exc)}); check the file") from None


def _not_utf8(path: Path, line: int, exc: UnicodeDecodeError) -> str:
    at = f" at line {line}" if line else ""
    if exc.reason == _nul_byte().reason:  # a binary file (an image, an archive): no encoding makes it text
        return (
            f"{path}: binary data, not text (a NUL byte{at}); remove it from the sources, or name the text files only"
        )
    return f"{path}: not UTF-8 text{at} ({exc.reason}); {_fix_for(path, exc)}"


# what a file that does not decode as UTF-8 is, by its first bytes (magic numbers, byte-order marks), and its fix
_SIGNATURES = (
    (b"\x1f\x8b", "gzip-compressed data named as text: decompress it (gunzip -c FILE > NEW.txt), or name it .jsonl.gz"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data named as text: decompress it (zstd -d), or name it .jsonl.zst"),
    (b"\xff\xfe\x00\x00", "UTF-32 text (its byte-order mark): convert it (iconv -f UTF-32 -t UTF-8 FILE)"),
    (b"\xff\xfe", "UTF-16 text (its byte-order mark): convert it (iconv -f UTF-16 -t UTF-8 FILE)"),
    (b"\xfe\xff", "UTF-16 text (its byte-order mark): convert it (iconv -f UTF-16 -t UTF-8 FILE)"),
)


def _fix_for(path: Path, exc: UnicodeDecodeError) -> str:
    """The fix for a file that is not UTF-8: what it is when its first bytes say (an archive, UTF-16 text),
    a file cut short inside a character when that is all that is wrong, else convert it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        head = b""
    for magic, said in _SIGNATURES:
        if head.startswith(magic):
            return f"it is {said.replace('FILE', str(path))}"
    if exc.reason == "unexpected end of data":  # only the last bytes are a character's first ones: cut short
        return "a multi-byte character is cut short (a truncated file?): remove its partial bytes"
    return f"convert it to UTF-8 ({_converter(path)})"


def _converter(path: Path) -> str:
    """The command converting `path` from its likely 8-bit encoding: cp1252 where its first 64 KB decode as that
    (Windows text; Latin-1 reads the same letters, not its quotes and dashes), else Latin-1 (any bytes decode)."""
    try:
        with open(path, "rb") as fh:
            fh.read(1 << 16).decode("cp1252")
        source = "cp1252"
    except (OSError, UnicodeDecodeError):
        source = "latin1"
    return f"if it is {source} text: iconv -f {source} -t utf-8 {path} > NEW"


def parse_json(record: Record) -> Any:
    """A JSONL record's object; json.JSONDecodeError for a bad line (the caller names it)."""
    return json.loads(record.value) if isinstance(record.value, str) else record.value


def _jsonl_bytes(path: Path, span: Span) -> Iterator[Record]:
    """The lines of bytes [start, end) of an uncompressed JSONL file, decoded one by one."""
    start, end, lineno = span
    with open(path, "rb") as fh:
        fh.seek(start)
        held, left = [], end - start  # held: the chunks of a line not ended yet
        while left > 0 or held:
            chunk = fh.read(min(READ_CHUNK, left)) if left > 0 else b""
            left -= len(chunk)
            if chunk and b"\n" not in chunk:
                # a long line: joined once it ends (a buffer += chunk copied it whole at every chunk:
                # 20 s for one line of 110 MB), and split then, not at every chunk of it
                held.append(chunk)
                continue
            lines = b"".join([*held, chunk]).split(b"\n")
            rest = lines.pop() if chunk else b""  # the last, unfinished line waits for more
            held = [rest] if rest else []
            for raw in lines:
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise Unreadable(_not_utf8(path, lineno, exc)) from None
                if text.strip():
                    yield Record(text, f"{path}:{lineno}", lineno)
                lineno += 1
            if not chunk:
                break


def _lines(fh: IO[str]) -> Iterator[str]:
    # split on "\n" only: JSON strings may legally hold raw U+2028, which str.splitlines() cuts
    held: list[str] = []  # the chunks of a line not ended yet: joined once it ends, as _jsonl_bytes's
    while chunk := fh.read(READ_CHUNK):
        if "\n" not in chunk:
            held.append(chunk)
            continue
        *lines, rest = "".join([*held, chunk]).split("\n")
        held = [rest]
        yield from lines
    if tail := "".join(held):
        yield tail


def _open_bytes(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed."""
    compression = COMPRESSED.get(path.suffix.lower())
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return io.BufferedReader(_Zstd(path), ZSTD_CHUNK)
    return open(path, "rb")


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, every frame of it, decompressed. zstandard's stream_reader ends a
    truncated file quietly, as if it were shorter (and so does a decompressobj: its `eof` alone
    tells); here a file that ends inside a frame is an EOFError and one that is not zstd an
    OSError, as gzip's reader raises them (records() names the file)."""

    def __init__(self, path: Path) -> None:
        self._zstd = require("zstandard", f"{path}: reading .zst", DataError)
        self._file = open(path, "rb")
        self._frame = self._zstd.ZstdDecompressor().decompressobj()
        self._inside = False  # part of a frame read, not its end
        self._out = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            chunk = self._file.read(ZSTD_CHUNK)  # small: a decompressobj's output is not bounded
            if not chunk:
                if self._inside:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            self._out = self._decompress(chunk)
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        out = []
        while chunk:  # a frame's end may come mid-chunk: the next frame starts after it
            if self._frame.eof:
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            try:
                out.append(self._frame.decompress(chunk))
            except self._zstd.ZstdError as exc:
                raise OSError(f"not zstd data ({exc})") from None
            chunk = self._frame.unused_data if self._frame.eof else b""
            self._inside = not self._frame.eof
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_text(path: Path) -> IO[str]:
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig", newline="")


def _bad_line(path: Path, binary_nul: bool = False) -> int:
    """The line of the file's first byte that is not UTF-8 (0: none found). The decoder that
    failed read in blocks and cannot tell, so the error path reads the file once more, up to it."""
    try:
        found = _first_undecodable(path, binary_nul)
    except (OSError, EOFError):  # a damaged archive: the line is unknown
        return 0
    return found[0] if found else 0


def check_text(path: Path, binary_nul: bool = False) -> None:
    """Unreadable unless the whole file (decompressed) is UTF-8 text, and (binary_nul: a plain-text
    file, as _text reads it) holds no NUL byte: read once, in blocks. For a file encoded in several
    batches (prepare's shards), whose first batches would be written before a bad byte further on
    is met."""
    try:
        found = _first_undecodable(path, binary_nul)
    except (OSError, EOFError) as exc:
        raise Unreadable(f"{path}: cannot be read ({_first_line(exc)}); check the file") from None
    if found:
        raise Unreadable(_not_utf8(path, *found))


def _first_undecodable(path: Path, binary_nul: bool = False) -> tuple[int, UnicodeDecodeError] | None:
    """(line, error) of the file's first byte that is not UTF-8 (binary_nul: or a NUL byte); None
    when there is none."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    try:
        with _open_bytes(path) as fh:
            while block := fh.read(1 << 22):
                nul = block.find(b"\x00") if binary_nul else -1
                decoder.decode(block if nul < 0 else block[:nul])  # a bad byte before it comes first
                if nul >= 0:
                    return line + block.count(b"\n", 0, nul), _nul_byte()
                line += block.count(b"\n")
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:  # exc.object: a split character's held-back bytes (no newline), the block
        return line + exc.object.count(b"\n", 0, exc.start), exc
    return None


def _text(path: Path) -> Iterator[Record]:
    """A plain-text file as one document, in the pieces `pieces` cuts a text in (_cut) so that a file
    of any size is encoded piece by piece into the whole text's tokens; a NUL byte means binary."""
    json_file = Path(path.stem if path.suffix.lower() in COMPRESSED else path).suffix.lower() == ".json"
    with _open_text(path) as fh:
        pending = ""
        while chunk := fh.read(TEXT_CHUNK_CHARS):
            if json_file and not pending:
                _hint_json_records(path, _json_shape(chunk))
                json_file = False
            if "\x00" in chunk:
                raise _nul_byte()
            pending += chunk
            while cut := _cut(pending):
                yield Record(pending[:cut], str(path), last=False)
                pending = pending[cut:]
        yield Record(pending, str(path), last=True)


def _nul_byte() -> UnicodeDecodeError:
    """A plain-text file's NUL byte: valid UTF-8, but the mark of a binary file, refused as one."""
    return UnicodeDecodeError("utf-8", b"\x00", 0, 1, "a NUL byte: binary data")


def _json_shape(head: str) -> str:
    """'array' for a .json file that opens as an array of objects, 'lines' for one whose first two
    lines are each a whole JSON object (JSON Lines under a .json name, as many datasets ship
    them), '' otherwise (a config file, a single object spread over lines)."""
    if re.match(r"\s*\[\s*\{", head[:256]):
        return "array"
    lines = [line for line in head.split("\n", 2)[:2] if line.strip()]
    if len(lines) < 2 or not all(line.lstrip().startswith("{") for line in lines):
        return ""
    try:
        json.loads(lines[0])
    except ValueError:
        return ""
    return "lines"


@functools.cache  # once a file: prepare reads it twice (the tokenizer's sample, the shards)
def _hint_json_records(path: Path, shape: str) -> None:
    """A .json file is text (a document like any other: code corpora hold config files); one that
    opens as an array of objects (Alpaca's format) or as one object a line (JSON Lines named .json)
    is more likely records meant as documents: said, with the conversion."""
    if shape == "array":
        logger.warning(
            "%s is read as one plain-text document; if it is an array of records, write it as JSONL (one "
            'object a line: `python -c "import json,sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]" '
            "< FILE.json > FILE.jsonl`) to train on each record's text",
            path,
        )
    elif shape == "lines":
        logger.warning(
            "%s is read as one plain-text document, JSON syntax and all, though it holds one JSON object a "
            "line (JSON Lines); rename it to .jsonl (or set data.format=jsonl where every file of the source "
            "is JSON Lines) to train on each record's text",
            path,
        )


def _cut(text: str) -> int:
    """Where to end a piece of text (0: keep all, it is not over a piece): where `pieces` cuts a text, before
    the last space between two words in a piece's second half, else the last whitespace that precedes a
    word, else at the piece size, so that a file's records are the pieces a run reading it into memory
    encodes (tokenizer.encode_documents) and their tokens the whole file's (a cut after a line end is not:
    the whitespace run from a blank line into an indented line is one pre-token; one between two spaces
    split Llama 2's "▁▁"). So no piece, and no encode call, grows with the file."""
    if len(text) <= TEXT_CHUNK_CHARS:
        return 0
    head = text[:TEXT_CHUNK_CHARS]
    word = _SPACE_BETWEEN_WORDS.search(head[: len(head) // 2 - 1 : -1])
    return len(head) - word.end() + 1 if word else _space_cut(head)


def _space_cut(head: str) -> int:
    """The start of the last space (else whitespace) that precedes a word in the second half of
    `head` (so the word keeps its space, as a pre-tokenizer splits it), else len(head)."""
    tail = head[: len(head) // 2 - 1 : -1]
    found = _SPACE_BEFORE_WORD.search(tail) or _WHITESPACE_BEFORE_WORD.search(tail)
    return len(head) - found.end() if found else len(head)


def pieces(text: str, size: int) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters, cut before the last space between
    two words in a piece's second half, else where a long text file is (_space_cut), so that the
    pieces pre-tokenize as the whole text does; a space between words is also where a tokenizer
    without a pre-tokenizer (Llama 2's) has no token across the cut (tokenizer.py: cutting.py), where
    one after a space ("▁▁") or in indentation could."""
    at = 0
    while len(text) - at > size:
        head = text[at : at + size]
        word = _SPACE_BETWEEN_WORDS.search(head[: len(head) // 2 - 1 : -1])
        cut = len(head) - word.end() + 1 if word else _space_cut(head)
        yield text[at : at + cut]
        at += cut
    if at < len(text):
        yield text[at:]


def _table(path: Path) -> Iterator[Record]:
    datasets = require("datasets", f"{path}: reading {path.suffix} files", DataError)
    datasets.logging.set_verbosity_error()
    builder = COLUMNAR[path.suffix.lower() if path.suffix.lower() in COLUMNAR else Path(path.stem).suffix.lower()]
    kwargs = _csv_as_text(path, datasets) if builder == "csv" else {}
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **kwargs)
        for i, row in enumerate(rows, start=1):
            yield Record(row, f"{path} row {i}", i)
    except DataError:
        raise
    except Exception as exc:  # pyarrow and datasets raise many types for a damaged file
        raise Unreadable(f"{path}: cannot be read as {builder} ({_first_line(exc)}); check the file") from None


def _csv_as_text(path: Path, datasets: Any) -> dict[str, Any]:
    """load_dataset's options that read a CSV file's cells as the text they are: every column a
    string, none taken for a missing value. pandas' inference made a cell "NA", "None" or "" a
    null, "007" the number 7 and a column of numbers ints or floats: records refused as "not a
    string", or a document lost."""
    try:
        with _open_text(path) as fh:
            header = next(csv.reader(fh), None)
    except (OSError, EOFError, ValueError, csv.Error):
        return {}  # the read itself names what is wrong with the file
    if not header or "" in header or len(set(header)) < len(header):
        return {}  # columns pandas renames (unnamed, repeated): left to its inference
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}), "na_filter": False}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
