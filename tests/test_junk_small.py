"""A corpus of a few files (under quality.MIN_DOCS documents) has no packing scale: its junk is judged by each
document alone (data/junk.py: random characters, dumps), as a run and `data prepare` do."""

import base64
import gzip
import json
import random
import re
import shutil
from pathlib import Path

import pytest

from test_junk_small_salad import PIECES
from test_junk_sources import flagged
from test_quality import phase
from trimtab.config import DataConfig
from trimtab.data import junk
from trimtab.data.prepare import Options, prepare
from trimtab.errors import DataError

DOCS = Path(__file__).resolve().parents[1] / "docs"


def bad_documents(rng: random.Random) -> dict[str, str]:
    raw = rng.randbytes(3000)
    printable = "".join(chr(rng.randrange(32, 127)) for _ in range(3000))
    return {
        "base64": base64.encodebytes(raw).decode(),
        "hex": raw.hex(" ", 2),
        "latin-1": raw.decode("latin-1").replace("\x00", " "),
        "printable": printable,
    }


def test_junk_catches_random_characters_and_dumps_but_no_real_file():
    """Each document judged by itself: every bad kind is named, no docs/*.md page."""
    bad = bad_documents(random.Random(0))
    verdicts = junk.kinds(list(bad.values()))
    assert [v.kind if v else None for v in verdicts] == [
        "hex or base64 dump",
        "hex or base64 dump",
        "random characters",
        "random characters",
    ]
    real = [p.read_text() for p in sorted(DOCS.glob("*.md"))]
    assert len(real) >= 10 and junk.kinds(real) == [None] * len(real)


def with_certificate(rng: random.Random) -> tuple[str, tuple[int, int]]:
    """Prose with a base64 certificate in it, and the certificate's byte range."""
    prose = "Vérifié: the licence below applies to every file of this package, as written. " * 12
    body = base64.encodebytes(rng.randbytes(57 * 40)).decode()
    head = prose + "\n-----BEGIN CERTIFICATE-----\n"
    start = len(head.encode())
    return head + body + "-----END CERTIFICATE-----\n" + prose[:200], (start, start + len(body.encode()) - 1)


def test_prepare_of_ten_files_flags_the_bad_ones_and_says_where_a_dump_is(tmp_path):
    """Ten files, three of them junk: before, a corpus under MIN_DOCS documents was not screened at all. An embedded
    certificate is named with its byte range (before: its share of base64 only, nothing to find it by)."""
    src = tmp_path / "corpus"
    src.mkdir()
    for page in sorted(DOCS.glob("*.md"))[:7]:
        shutil.copy(page, src / f"{page.stem}.txt")
    bad = bad_documents(random.Random(1))
    for kind in ("base64", "printable"):
        (src / f"{kind}.txt").write_text(bad[kind])
    certificate, (start, end) = with_certificate(random.Random(2))
    (src / "cert.txt").write_text(certificate)
    prepare([str(src)], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    found = flagged(tmp_path / "out")
    assert {Path(name).stem: why.split(":")[0] for name, why in found.items()} == {
        "base64": "hex or base64 dump",
        "printable": "random characters",
        "cert": "hex or base64 dump",
    }
    assert found[str(src / "cert.txt")].endswith(f", bytes {start:,}-{end:,} of its text")
    assert (
        certificate.encode()[start:end].decode().split()
        == base64.encodebytes(random.Random(2).randbytes(57 * 40)).decode().split()
    )


def test_a_file_not_utf8_is_said_for_what_it_is(tmp_path):
    """A gzip file named .txt, UTF-16 text and a file cut inside a character: each named with its own fix (before:
    "convert it to UTF-8" for all three, which a gzip archive is no case of)."""
    text = "héllo wörld, some text " * 20
    files = {
        "gz.txt": (gzip.compress(text.encode()), "gzip-compressed data named as text"),
        "utf16.txt": (text.encode("utf-16"), "UTF-16 text (its byte-order mark): convert it (iconv -f UTF-16"),
        "cut.txt": (text.encode() + "é".encode()[:1], "a multi-byte character is cut short"),
    }
    for name, (raw, said) in files.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(DataError, match=re.escape(said)):
            prepare([str(tmp_path / name)], tmp_path / f"out-{name}", vocab_size=300, options=Options(), workers=1)


def test_a_run_on_ten_files_leaves_out_printable_noise(tmp_path):
    """A run's own screen of a small source: printable noise (no hex, no base64) was trained on before, unflagged."""
    for page in sorted(DOCS.glob("*.md"))[:9]:
        (tmp_path / f"{page.stem}.txt").write_text(page.read_text()[:3000])  # small: the run's BPE trains on them
    (tmp_path / "noise.txt").write_text(bad_documents(random.Random(3))["printable"])
    cfg = DataConfig(source=str(tmp_path), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="drop")
    kept = set(phase(cfg).train.docs.sources)
    assert len(kept) == 9 and str(tmp_path / "noise.txt") not in kept


def test_random_text_over_a_small_alphabet_is_named_in_a_source_made_of_it():
    """A mixture source of random text over 18 symbols (letters and space; digits and punctuation), 24 documents:
    the packing screen judges it against its own median, which it sets, and its characters carry ~4.2 bits, under
    the random-characters rule's 5 (judged before only in a source under quality.MIN_DOCS documents): nothing
    named. Now each document is, by itself; no frozen real piece of the docs nor a module of src/ is."""
    rng = random.Random(5)
    alphabets = ("abcdefghijklmnopq ", "0123456789.,;:-+()")
    bad = ["".join(rng.choice(a) for _ in range(rng.randrange(600, 2000))) for a in alphabets for _ in range(12)]
    assert [v.kind if v else None for v in junk.kinds(bad)] == ["random characters"] * len(bad)
    code = [p.read_text() for p in sorted((DOCS.parent / "src" / "trimtab" / "data").glob("*.py"))]
    real = [json.loads(line)["text"] for line in PIECES.read_text().splitlines()] + code
    assert not [v for v in junk.kinds(real) if v is not None and v.kind == "random characters"]
