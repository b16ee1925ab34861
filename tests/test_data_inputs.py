"""Awkward inputs to the data readers and `trimtab data prepare`, each written as real files: bad
bytes inside a directory, trimtab's own outputs inside a source, symlinked directories, a text
file with no newline, a damaged token cache, a directory given to `trimtab eval --data`."""

from __future__ import annotations

import gzip
import json
import logging
import os
import time

import numpy as np
import pytest

from trimtab.config import DataConfig
from trimtab.data import formats, packing, references
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData
from trimtab.data.sources import Document, builtin_files, read_documents, source_files
from trimtab.errors import DataError
from trimtab.evaluation.perplexity import read_texts

WORDS = "alpha beta  gamma\tdelta epsilon, zeta: eta 12 345 theta! iota kappa".split(" ")


def jsonl_with_bad_byte(path, n=40, bad=20):
    """n {"text"} records, line `bad` holding an invalid UTF-8 byte."""
    lines = [json.dumps({"text": f"document number {i} " * 5}).encode() for i in range(n)]
    lines[bad - 1] = b'{"text": "bad \xff\xfe bytes here"}'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# ------------------------------------------------------------- a bad byte in a directory's JSONL


def test_a_directorys_jsonl_with_a_bad_byte_is_skipped_whole_with_its_line(tmp_path, caplog):
    jsonl_with_bad_byte(tmp_path / "src" / "b.jsonl")
    (tmp_path / "src" / "ok.txt").write_text("fine text " * 20)
    docs, _ = read_documents(DataConfig(source=str(tmp_path / "src"), skip_bad_records=True))
    assert [d.source for d in docs] == [str(tmp_path / "src" / "ok.txt")]  # none of b.jsonl, not its first 19
    assert "skipped 1 file that cannot be read as text" in caplog.text
    assert "b.jsonl: not UTF-8 text at line 20" in caplog.text


def test_a_named_file_with_a_bad_byte_names_its_line(tmp_path):
    path = jsonl_with_bad_byte(tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"b.jsonl: not UTF-8 text at line 20 \(invalid start byte\); convert it"):
        read_documents(DataConfig(source=str(path)))
    text = tmp_path / "c.txt"
    text.write_bytes(b"one\ntwo\nthree \xe9 four\n")  # latin-1, in a file read through the text decoder
    with pytest.raises(DataError, match=r"c.txt: not UTF-8 text at line 3 "):
        read_documents(DataConfig(source=str(text)))


def test_prepare_trains_its_tokenizer_past_a_directorys_bad_jsonl(tmp_path, caplog):
    jsonl_with_bad_byte(tmp_path / "src" / "b.jsonl")
    (tmp_path / "src" / "ok.txt").write_text("fine text " * 200)
    manifest = prepare([str(tmp_path / "src")], tmp_path / "p", vocab_size=300, options=Options(skip_bad_records=True))
    assert [f["documents"] for f in manifest["files"]] == [0, 1]
    assert "b.jsonl: not UTF-8 text at line 20" in manifest["files"][0]["unreadable"]


@pytest.mark.parametrize("bad", [b"\xff", b"\x00"], ids=["not-utf8", "nul"])
def test_prepare_writes_nothing_of_a_directorys_file_found_unreadable_after_its_first_batches(
    tmp_path, tokenizer, monkeypatch, bad
):
    """A text file encoded in several batches with a bad byte near its end: its first batches
    were in the shard (unended, uncounted) while the manifest said it was skipped. It is now
    read through once before, and skipped whole; a NUL byte (binary) as much as one not UTF-8:
    the check ahead passed it, and 2.5M tokens of a skipped file ran into the next's document."""
    from trimtab.data import shards

    monkeypatch.setattr(shards, "ENCODE_CHARS", 100)  # batches of 100 characters (prepare's in this process)
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 64)
    src = tmp_path / "src"
    src.mkdir()
    good = b"alpha beta gamma delta\n" * 4000  # past the text decoder's first block
    (src / "a.txt").write_bytes(good + b"bad " + bad + b" byte\n")
    (src / "b.txt").write_text("fine text here\n" * 10)
    tokenizer.save(tmp_path / "tok.json")
    manifest = prepare([str(src)], tmp_path / "p", tokenizer=str(tmp_path / "tok.json"), workers=1)
    assert [f["documents"] for f in manifest["files"]] == [0, 1]
    data = PreparedData(tmp_path / "p")
    assert data.n_tokens == manifest["files"][1]["tokens"]  # nothing of a.txt in the shards
    said = (
        "binary data, not text (a NUL byte at line 4001); remove it"
        if bad == b"\x00"
        else "not UTF-8 text at line 4001"
    )
    assert f"a.txt: {said}" in manifest["files"][0]["unreadable"]  # a binary file is not told to convert to UTF-8


def test_records_past_the_callers_limit_are_not_read(tmp_path):
    """A file's records are held back to skip it whole, but only up to what the caller takes: a
    bad byte past max_bytes is never reached."""
    path = jsonl_with_bad_byte(tmp_path / "src" / "b.jsonl", n=400, bad=390)
    docs, _ = read_documents(DataConfig(source=str(path.parent), max_bytes=2000))
    assert docs and all(d.source.startswith(str(path)) for d in docs)


def test_a_text_file_is_read_only_as_far_as_the_caller_takes(tmp_path):
    """A plain-text file is one document, read whole so that a bad byte skips it whole; but not
    past max_bytes (a corpus of one huge file would be read into memory for a sample of it): its
    first megabytes train, a bad byte 3 MB in is never reached."""
    path = tmp_path / "big.txt"
    line = "the quick brown fox jumps over the lazy dog\n"
    path.write_bytes((line * (3_000_000 // len(line))).encode() + b"\xff\xfe bad\n")
    docs, _ = read_documents(DataConfig(source=str(path), max_bytes=1_000_000))
    assert len(docs) == 1 and 900_000 < len(docs[0].text) <= 1_000_000 and docs[0].text.endswith("dog\n")
    with pytest.raises(DataError, match="big.txt"):  # read to the end, the bad byte is found and named
        read_documents(DataConfig(source=str(path), max_bytes=0))


# ------------------------------------------------------------ trimtab's own outputs in a source


def test_prepare_into_its_own_source_reads_only_the_sources(tmp_path, tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 50)
    (src / "b.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(5)))
    for given in (None, "tok"):  # the tokenizer trained on the sources, or given
        if given:
            tokenizer.save(tmp_path / "tok" / "tokenizer.json")
        out = src / f"prep-{given}"
        for _ in range(2):  # the re-run finds its own manifest and shards there too
            manifest = prepare([str(src)], out, tokenizer=given and str(tmp_path / given), vocab_size=300)
        assert [f["path"] for f in manifest["files"]] == [str((src / n).resolve()) for n in ("a.txt", "b.jsonl")]


def test_prepare_refuses_an_out_that_holds_a_source(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text\n")
    with pytest.raises(DataError, match="--out .* is or holds the source directory .*src; prepare into a directory"):
        prepare([str(tmp_path / "src")], tmp_path / "src", vocab_size=300)


def test_a_prepared_or_run_directory_inside_a_source_is_skipped_with_a_warning(tmp_path, caplog):
    src = tmp_path / "corpus"
    (src / "data").mkdir(parents=True)
    (src / "data" / "a.txt").write_text("text")
    (src / "prep" / "shards").mkdir(parents=True)
    (src / "prep" / "trimtab-data.json").write_text("{}")
    (src / "prep" / "tokenizer.json").write_text("{}")
    (src / "run" / "checkpoints").mkdir(parents=True)
    (src / "run" / "config.yaml").write_text("seed: 0\n")
    (src / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (src / "notes").mkdir()
    (src / "notes" / "config.yaml").write_text("a corpus file, not a run\n")  # no checkpoints or metrics
    with caplog.at_level(logging.WARNING):
        files = [p.relative_to(src).as_posix() for p, _ in source_files(str(src), "data.source")]
        source_files(str(src), "data.source")
    assert files == ["data/a.txt", "notes/config.yaml"]
    assert caplog.text.count("prep, prepared data (it holds trimtab-data.json)") == 1  # once per directory
    assert caplog.text.count("run, a training run's directory") == 1


def test_builtin_lists_the_files_training_reads_and_a_generated_source_is_named():
    """`trimtab data prepare builtin` prepares the stdlib corpus training reads (it said "does not
    exist"); builtin:arithmetic is made at start, so preparing it says to train on it as it is."""
    assert [p for p, _ in source_files("builtin", "data prepare source")] == builtin_files()[1]
    with pytest.raises(DataError, match=r"'builtin:arithmetic' is made at start.*data.source=builtin:arithmetic"):
        source_files(["builtin:arithmetic"], "data prepare source")
    assert references.source_numbers({}, ["builtin", "builtin"]) == [0, 0]


# ------------------------------------------------------------------------ symlinked directories


def test_symlinked_directories_are_followed_once_and_loops_end(tmp_path):
    shared = tmp_path / "shared"
    (shared / "deep").mkdir(parents=True)
    (shared / "deep" / "x.txt").write_text("x")
    src = tmp_path / "src"
    src.mkdir()
    (src / "own.txt").write_text("own")
    os.symlink(shared, src / "linked")
    os.symlink(shared, src / "linked_again")  # the same directory twice: read once
    os.symlink(src, src / "linked" / "deep" / "back")  # a loop back to the source
    files = [p.relative_to(src).as_posix() for p, _ in source_files(str(src), "data.source")]
    assert files == ["linked/deep/x.txt", "own.txt"]


# ------------------------------------------------------------------ one very long line of text


def test_a_line_longer_than_a_piece_is_cut_at_a_space_into_the_same_tokens(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 64)
    text = " ".join(WORDS * 40)  # no newline at all; spaces, a tab, double spaces, digits
    path = tmp_path / "src" / "long.txt"
    path.parent.mkdir()
    path.write_text(text)
    pieces = [r.value for r in formats.records(path)]
    assert "".join(pieces) == text and len(pieces) > 20 and max(map(len, pieces)) <= 64
    assert all(p[0].isspace() and not p[1].isspace() for p in pieces[1:])  # cut before the space a word keeps
    tokenizer.save(tmp_path / "tok.json")
    prepare([str(path)], tmp_path / "p", tokenizer=str(tmp_path / "tok.json"))
    ids = PreparedData(tmp_path / "p").read(0, PreparedData(tmp_path / "p").n_tokens)
    assert ids[:-1].tolist() == tokenizer.encode(text)  # the whole line's tokens, then eos


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_long_code_file_is_cut_into_the_whole_files_tokens(tmp_path, tokenizer, monkeypatch, newline):
    """Cut after a line end, the indentation that follows lost the newline a pre-tokenizer joins
    it to ("\n" + "    return"): a 2.5 MB file of code prepared into other tokens than in memory."""
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 64)
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(40)).replace("\n", newline)
    path = tmp_path / "code.txt"
    path.write_bytes(text.encode())
    pieces = [r.value for r in formats.records(path)]
    assert "".join(pieces) == text and len(pieces) > 10
    tokenizer.save(tmp_path / "tok.json")
    prepare([str(path)], tmp_path / "p", tokenizer=str(tmp_path / "tok.json"))
    data = PreparedData(tmp_path / "p")
    assert data.read(0, data.n_tokens)[:-1].tolist() == tokenizer.encode_text(text)


@pytest.mark.parametrize("name", ["one.jsonl", "one.jsonl.gz"])
def test_a_jsonl_line_of_many_chunks_is_read_in_time_linear_in_it(tmp_path, monkeypatch, name):
    """A line longer than a read was grown by `buffer += chunk`, a copy of all of it per chunk:
    20 s for one record of 110 MB, 5x the time of half of it. Timed against the same bytes in
    short lines (as many chunks, no long line), so that a slow machine slows both."""
    monkeypatch.setattr(formats, "READ_CHUNK", 16)  # 25,000 chunks to a line of 400 KB
    record = json.dumps({"text": " ".join(WORDS) * 6_000})
    opener = gzip.open if name.endswith(".gz") else open
    with opener(tmp_path / name, "wt") as fh:
        fh.write(record + "\n")
    with opener(tmp_path / f"short-{name}", "wt") as fh:
        fh.write("".join(json.dumps({"text": " ".join(WORDS)}) + "\n" for _ in range(len(record) // 90)))
    took = {}
    for path in (tmp_path / name, tmp_path / f"short-{name}"):
        start = time.perf_counter()
        n = sum(len(r.value) for r in formats.records(path))
        took[path.name] = time.perf_counter() - start
    assert n > 0 and [r.value for r in formats.records(tmp_path / name)] == [record]
    assert took[name] < 3 * took[f"short-{name}"] + 0.1, took


def test_a_line_with_no_space_is_cut_at_the_piece_size(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 64)
    text = "é" * 300 + "a b" + "漢" * 200
    path = tmp_path / "blob.txt"
    path.write_text(text)
    pieces = [r.value for r in formats.records(path)]
    assert "".join(pieces) == text and max(map(len, pieces)) <= 64


# ------------------------------------------------------------------------------ token cache


def test_a_damaged_token_cache_entry_is_rebuilt(tmp_path, tokenizer, caplog):
    docs = [Document([(f"def f{i}(x):\n    return x\n", True)]) for i in range(20)]
    cfg = DataConfig()
    fresh = packing.tokenize_documents(docs, tokenizer, cfg, tmp_path)
    (entry,) = tmp_path.glob("tokens-*.npz")
    entry.write_bytes(entry.read_bytes()[:100])  # a partial copy of the cache
    again = packing.tokenize_documents(docs, tokenizer, cfg, tmp_path)
    assert np.array_equal(again.tokens, fresh.tokens) and "cannot be read" in caplog.text
    with np.load(entry) as data:  # written over whole
        assert np.array_equal(data["tokens"], fresh.tokens)
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]


# ------------------------------------------------------------------------------- eval --data


def test_eval_data_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(DataError, match="is a directory; pass one file"):
        read_texts(tmp_path)


def test_a_json_array_of_records_is_read_as_text_with_the_conversion_said(tmp_path, caplog):
    """A .json file stays a plain-text document (code corpora hold config files), but one that
    opens as an array of objects says how to make it JSONL; gzip'd too."""
    import gzip

    records = '[\n  {"text": "first record"},\n  {"text": "second"}\n]\n'
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "alpaca.json").write_text(records)
    with gzip.open(tmp_path / "src" / "more.json.gz", "wt") as fh:
        fh.write(records)
    (tmp_path / "src" / "config.json").write_text('{"name": "a setting"}')
    docs, _ = read_documents(DataConfig(source=str(tmp_path / "src")))
    assert sorted(d.text for d in docs) == sorted([records, records, '{"name": "a setting"}'])
    said = [r.getMessage() for r in caplog.records if "write it as JSONL" in r.getMessage()]
    assert len(said) == 2 and all("alpaca.json" in m or "more.json.gz" in m for m in said)


def test_a_prepared_source_too_small_to_hold_out_a_row_says_evaluation_is_skipped(tmp_path, tokenizer, caplog):
    """As the in-memory split says it (it was silent: no val_loss, no word why)."""
    import trimtab
    from trimtab.config import load_config

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.txt").write_text("def f(x):\n    return x * 2\n" * 100)  # one document: its tail held out
    tokenizer.save(tmp_path / "tok.json")
    prepare([str(tmp_path / "src")], tmp_path / "p", tokenizer=str(tmp_path / "tok.json"))
    quick = {"max_steps": 1, "batch_tokens": 128, "micro_batch_tokens": 0, "eval_tokens": 128}
    sets = {"train": quick, "data": {"source": str(tmp_path / "p"), "seq_len": 64}, "log": {"progress": False}}
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        summary = trimtab.train(load_config(preset="debug", overrides={"out": str(tmp_path / "r"), **sets}))
    assert summary["status"] == "completed" and summary["val_loss"] is None
    assert "its held-out share (data.eval_fraction=0.02) is too small for one row of data.seq_len+1=65" in caplog.text


def test_the_same_bytes_twice_are_prepared_once_in_one_call_as_across_calls(tmp_path, tokenizer, caplog):
    """Identical files were both kept when prepared in one call, the second skipped when added by
    a re-run: the corpus depended on how it was fed."""
    (tmp_path / "src").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "src" / name).write_text("def f(x):\n    return x\n" * 20)
    tokenizer.save(tmp_path / "tok.json")
    together = prepare([str(tmp_path / "src")], tmp_path / "one", tokenizer=str(tmp_path / "tok.json"))
    prepare([str(tmp_path / "src" / "a.txt")], tmp_path / "two", tokenizer=str(tmp_path / "tok.json"))
    apart = prepare([str(tmp_path / "src" / "b.txt")], tmp_path / "two")
    assert [f["path"].rsplit("/", 1)[1] for f in together["files"]] == ["a.txt"]
    assert [f["path"].rsplit("/", 1)[1] for f in apart["files"]] == ["a.txt"]
    assert PreparedData(tmp_path / "one").n_tokens == PreparedData(tmp_path / "two").n_tokens
    said = [r.getMessage() for r in caplog.records if "the same bytes as a file prepared before" in r.getMessage()]
    assert len(said) == 2 and all("1 file: " in m and "b.txt (as " in m for m in said)
