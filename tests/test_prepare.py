"""`trimtab data prepare` and training on prepared directories: formats, manifest, incremental and
interrupted prepares, corrupt shards, the held-out split, and parity with the in-memory pipeline."""

import gzip
import json
import random

import numpy as np
import pytest

from trimtab.cli import main
from trimtab.config import DataConfig
from trimtab.data import prepare as prepare_py
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import build_splits
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData, ShardedRows, held_out, read_manifest
from trimtab.data.sources import read_documents
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_corpus(folder, seed=0):
    """One file of each format: JSONL, gzip JSONL, plain text, Parquet, CSV."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": text(rng, 30)}) + "\n" for _ in range(40)))
    with gzip.open(folder / "b.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"text": text(rng, 20)}) + "\n" for _ in range(30))
    (folder / "c.txt").write_text("\n\n".join(text(rng, 25) for _ in range(10)))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [text(rng, 15) for _ in range(20)], "id": list(range(20))}), folder / "d.parquet")
    (folder / "e.csv").write_text("text,id\n" + "".join(f'"{text(rng, 10)}",{i}\n' for i in range(10)))
    return folder


@pytest.fixture
def tok_file(tmp_path, tokenizer):
    path = tmp_path / "tok" / "tokenizer.json"
    tokenizer.save(path)
    return path


def documents(data: PreparedData):
    """Each prepared document's tokens."""
    bounds = data.doc_bounds()
    return [data.read(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def test_every_format_is_prepared_and_decodes_back_to_its_records(tmp_path, tok_file):
    src = write_corpus(tmp_path / "src")
    manifest = prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    tok = TextTokenizer.load(tok_file)
    assert [f["documents"] for f in manifest["files"]] == [40, 30, 1, 20, 10]
    assert manifest["documents"] == 101 and manifest["dtype"] == "uint16"
    data = PreparedData(tmp_path / "p")
    docs = read_documents(DataConfig(source=str(src), max_bytes=0))[0]
    prepared = documents(data)
    assert len(prepared) == len(docs) == 101
    for doc, ids in zip(docs, prepared):
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1].tolist()) == doc.text
    assert data.source(0) == f"{src / 'a.jsonl'}:1" and data.source(45) == f"{src / 'b.jsonl.gz'}:6"
    assert data.source(70) == str(src / "c.txt") and data.source(71) == f"{src / 'd.parquet'}:1"


def test_packed_rows_equal_the_in_memory_pipeline(tmp_path, tok_file):
    """With no hold-out, a prepared directory gives the very rows the in-memory path cuts."""
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    tok = TextTokenizer.load(tok_file)
    cfg = DataConfig(source=str(src), max_bytes=0, seq_len=32, eval_fraction=0.0)
    for pack in (True, False):
        cfg.pack = pack
        memory, _ = build_splits(cfg, tok, read_documents(cfg)[0], None, seed=0)
        sharded = ShardedRows(PreparedData(tmp_path / "p"), 32, pack, "train", 0.0)
        assert len(sharded) == len(memory) > 10
        for i in range(len(memory)):
            assert all(np.array_equal(x, y) for x, y in zip(sharded.get(i), memory.get(i))), (pack, i)


def test_a_loader_resumes_only_over_the_prepared_data_it_drew_from(tmp_path, tok_file):
    """The same documents prepared in another order cut into as many packed rows holding other
    tokens: a checkpoint's loader state is refused there (the digest is the manifest's shard
    sha256s and the row bounds, no token read), and accepted over the same directory reopened."""
    lines = [json.dumps({"text": f"{WORDS[i % 12]} " * (3 + i % 7)}) + "\n" for i in range(60)]
    for name, order in (("a", lines), ("b", lines[::-1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "docs.jsonl").write_text("".join(order))
        prepare([str(tmp_path / name / "docs.jsonl")], tmp_path / f"p{name}", tokenizer=str(tok_file))
    a, b = (ShardedRows(PreparedData(tmp_path / f"p{n}"), 16, True, "train", 0.0) for n in "ab")
    assert len(a) == len(b) > 4 and a.get(0)[0].tolist() != b.get(0)[0].tolist()
    state = BatchLoader(a, 64, 64, seed=0, pad_id=0).state_dict()
    BatchLoader(ShardedRows(PreparedData(tmp_path / "pa"), 16, True, "train", 0.0), 64, 64, 0, 0).load_state_dict(state)
    with pytest.raises(DataError, match="other data in source0 than the data now gives: as many rows"):
        BatchLoader(b, 64, 64, seed=0, pad_id=0).load_state_dict(state)


def test_the_held_out_split_is_disjoint_fixed_and_near_its_fraction():
    held = held_out(10_000, 0.05)
    assert abs(held.mean() - 0.05) < 0.01
    assert np.array_equal(held, held_out(10_000, 0.05))  # no seed: every run holds out the same documents
    assert held_out(2, 0.01).sum() == 1 and not held_out(5, 0.0).any()


def test_a_large_file_gives_evaluation_its_tail_in_memory_and_prepared_alike(tmp_path, tok_file):
    """One large file beside two small ones, eval_fraction 0.02: the file chosen is cut, the
    fraction's worth of its tail held out (it was held out whole: training got 2% of the corpus),
    and the in-memory split, choosing the same file, cuts the very same rows."""
    rng, src = random.Random(0), tmp_path / "src"
    src.mkdir()
    for name, words in (("a_big.txt", 20_000), ("b.txt", 100), ("c.txt", 100)):
        (src / name).write_text(text(rng, words))
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    data = PreparedData(tmp_path / "p")
    sharded = [ShardedRows(data, 16, True, split, 0.02) for split in ("train", "eval")]
    assert sharded[0].n_tokens >= 0.97 * data.n_tokens - 16 and sharded[1].n_tokens >= 0.019 * data.n_tokens - 32
    cfg = DataConfig(source=str(src), max_bytes=0, seq_len=16, eval_fraction=0.02)
    tok = TextTokenizer.load(tok_file)
    memory = build_splits(cfg, tok, read_documents(cfg)[0], None, seed=1)  # seed 1 chooses the first file too
    for ours, theirs in zip(sharded, memory):
        assert len(ours) == len(theirs) > 0
        assert all(np.array_equal(ours.get(i)[0], theirs.get(i)[0]) for i in range(len(ours)))


def test_held_out_documents_never_reach_training_rows(tmp_path, tok_file):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    data = PreparedData(tmp_path / "p")
    train = ShardedRows(data, 100_000, False, "train", 0.2)  # a row per whole document
    held = ShardedRows(data, 100_000, False, "eval", 0.2)
    assert len(train) + len(held) == data.n_docs
    train_docs = {tuple(train.get(i)[0]) for i in range(len(train))}
    assert not train_docs & {tuple(held.get(i)[0]) for i in range(len(held))}


def test_rerun_adds_only_new_files_and_keeps_the_shards(tmp_path, tok_file):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    before = {p.name: p.read_bytes() for p in (tmp_path / "p" / "shards").iterdir()}
    (src / "f.jsonl").write_text(json.dumps({"text": "new words here"}) + "\n")
    manifest = prepare([str(src)], tmp_path / "p")
    after = {p.name: p.read_bytes() for p in (tmp_path / "p" / "shards").iterdir()}
    assert all(after[name] == data for name, data in before.items())  # untouched
    assert len(after) == len(before) + 2 and manifest["documents"] == 102
    again = prepare([str(src)], tmp_path / "p")
    assert again["shards"] == manifest["shards"]  # nothing new: nothing done


def test_an_interrupted_prepare_resumes_to_the_same_data(tmp_path, tok_file, monkeypatch):
    src = write_corpus(tmp_path / "src")
    good = (src / "c.txt").read_text()
    (src / "c.txt").write_bytes(b"\x00\x01binary")  # named alone below: it fails its job
    monkeypatch.setattr(prepare_py, "SHARD_BYTES", 1)  # a job per file, so some finish first
    files = [str(p) for p in sorted(src.iterdir())]
    with pytest.raises(DataError, match="c.txt: binary data, not text"):
        prepare(files, tmp_path / "p", tokenizer=str(tok_file), workers=1)
    partial = json.loads((tmp_path / "p" / "trimtab-data.json").read_text())
    assert [f.get("prepared", False) for f in partial["files"]] == [True, True, False, False, False]  # kept
    (src / "c.txt").write_text(good)
    prepare(files, tmp_path / "p", tokenizer=str(tok_file), workers=1)
    prepare(files, tmp_path / "fresh", tokenizer=str(tok_file), workers=1)
    assert documents(PreparedData(tmp_path / "p")) and all(
        np.array_equal(a, b)
        for a, b in zip(documents(PreparedData(tmp_path / "p")), documents(PreparedData(tmp_path / "fresh")))
    )


def test_a_file_changed_before_any_piece_of_it_was_prepared_is_cut_again(tmp_path, tok_file, monkeypatch):
    """An interrupted prepare keeps a large JSONL file's pieces (byte ranges) in the manifest; the
    file grown before the re-run prepared a piece of it was taken as it is now, but cut at the
    old ranges: the records past them were left out, silently."""
    monkeypatch.setattr(prepare_py, "SHARD_BYTES", 1)  # a job per file, a piece per line of c.jsonl
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"text": "first file"}) + "\n")
    (src / "b.txt").write_bytes(b"\x00binary")  # named alone: its job fails before c.jsonl's
    (src / "c.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(4)))
    files = [str(src / name) for name in ("a.jsonl", "b.txt", "c.jsonl")]
    with pytest.raises(DataError, match="b.txt: binary data, not text"):
        prepare(files, tmp_path / "p", tokenizer=str(tok_file), workers=1)
    assert read_manifest(tmp_path / "p")["files"][2]["done"] == []
    with open(src / "c.jsonl", "a") as fh:
        fh.writelines(json.dumps({"text": f"appended {i}"}) + "\n" for i in range(3))
    (src / "b.txt").write_text("now text")
    manifest = prepare(files, tmp_path / "p", workers=1)
    assert [f["documents"] for f in manifest["files"]] == [1, 1, 7]


def test_a_corrupt_shard_is_named_and_rebuilt_from_its_sources(tmp_path, tok_file):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    [shard] = (tmp_path / "p" / "shards").glob("*.bin")
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"shard {shard.stem} fails its sha256 check .*{shard.name}"):
        PreparedData(tmp_path / "p")
    prepare([str(src)], tmp_path / "p")
    assert PreparedData(tmp_path / "p").n_docs == 101


def test_an_unreadable_shard_index_is_named_without_the_sha256_check(tmp_path, tok_file):
    """data.verify_shards=false checks sizes only: an index damaged (truncated, overwritten) was
    a ValueError or BadZipFile traceback from numpy, not the shard and how to rebuild it."""
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": text(random.Random(i), 20)}) + "\n" for i in range(8)))
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    [index] = (tmp_path / "p" / "shards").glob("*.idx.npz")
    for damaged in (b"not an index", index.read_bytes()[:40]):
        index.write_bytes(damaged)
        with pytest.raises(DataError, match=rf"'{tmp_path / 'p'}': shard .* index .*{index.name}.*data prepare"):
            PreparedData(tmp_path / "p", verify=False)
    prepare([str(src)], tmp_path / "p")
    assert PreparedData(tmp_path / "p", verify=False).n_docs == 8


@pytest.mark.parametrize(
    "edit", [lambda m: [m], lambda m: {k: v for k, v in m.items() if k != "shards"}], ids=["list", "no-shards"]
)
def test_a_manifest_not_as_prepare_writes_it_is_named_by_training_and_prepare(tmp_path, tok_file, edit):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": text(random.Random(0), 40)}) + "\n")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    manifest = tmp_path / "p" / "trimtab-data.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    for read in (lambda: PreparedData(tmp_path / "p"), lambda: prepare([str(src)], tmp_path / "p")):
        with pytest.raises(DataError, match=rf"{manifest}: .*not .*manifest.*; prepare the sources into a new"):
            read()


def test_a_shard_changed_under_a_run_is_named_when_read(tmp_path, tok_file):
    """The sha256 is checked when a run opens the directory; a shard overwritten or cut while the
    run reads it gives ids outside the tokenizer or too few bytes: a DataError naming the shard,
    not an IndexError from the embedding."""
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    data = PreparedData(tmp_path / "p")
    [shard] = (tmp_path / "p" / "shards").glob("*.bin")
    assert int(data.read(0, 64).max()) < data.vocab_size
    raw = bytearray(shard.read_bytes())
    raw[: 64 * data.dtype.itemsize] = b"\xff" * (64 * data.dtype.itemsize)
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{shard.name}: changed after it was prepared .*: token id \d+ is not one of"):
        data.read(0, 64)
    shard.write_bytes(bytes(raw[: 32 * data.dtype.itemsize]))
    with pytest.raises(DataError, match=rf"{shard.name}: changed after .* bytes read where the manifest has"):
        data.read(16, 64)


def test_bad_input_is_named_in_one_line(tmp_path, tok_file, caplog):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: no 'text', 'messages' or 'prompt'/'response' key"):
        prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    manifest = prepare([str(src)], tmp_path / "p", options=Options(skip_bad_records=True))
    assert manifest["files"][0]["skipped"] == 1 and manifest["documents"] == 1
    (src / "empty.jsonl").write_text("")
    (src / "image.bin").write_bytes(bytes(range(256)))
    prepare([str(src)], tmp_path / "p", options=Options(skip_bad_records=True))
    assert "empty.jsonl: empty, nothing to prepare" in caplog.text and "image.bin: not UTF-8" in caplog.text
    with pytest.raises(DataError, match="image.bin: not UTF-8"):  # named on its own, it must be read
        prepare([str(src / "image.bin")], tmp_path / "q", tokenizer=str(tok_file))
    with pytest.raises(DataError, match="--text-field"):
        prepare([str(src)], tmp_path / "p", options=Options(text_field="body"))


def test_the_cli_prepares_in_parallel_pieces_the_same_documents(tmp_path, capsys, monkeypatch, tok_file):
    src = write_corpus(tmp_path / "src")
    whole = documents(
        PreparedData(prepare([str(src)], tmp_path / "whole", tokenizer=str(tok_file)) and tmp_path / "whole")
    )
    monkeypatch.setattr(prepare_py, "SHARD_BYTES", 2000)  # a.jsonl (8 KB) goes in pieces cut at line ends
    args = ["data", "prepare", str(src), "--out", str(tmp_path / "p"), "--tokenizer", str(tok_file), "--workers", "2"]
    assert main(args) == 0
    assert "101 documents from 5 files" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "p" / "trimtab-data.json").read_text())
    pieces = manifest["files"][0]["spans"]
    assert len(pieces) >= 3 and manifest["files"][0]["done"] == [span[0] for span in pieces]
    data = PreparedData(tmp_path / "p")
    assert all(np.array_equal(a, b) for a, b in zip(documents(data), whole)) and len(documents(data)) == len(whole)
    assert data.source(40) == f"{src / 'b.jsonl.gz'}:1" and data.source(39) == f"{src / 'a.jsonl'}:40"  # lines count on


def test_a_vocabulary_is_trained_when_no_tokenizer_is_given(tmp_path):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "p", vocab_size=300)
    assert TextTokenizer.load(tmp_path / "p" / "tokenizer.json").vocab_size <= 300


def test_a_vocab_size_below_the_bpe_base_is_refused_naming_the_flag_and_one_minimum(tmp_path, capsys):
    """The flag said "at least 2", then the BPE "a vocabulary of 10 is below ...", naming no flag."""
    src = tmp_path / "a.txt"
    src.write_text("some text\n")
    for size in ("2", "10"):
        with pytest.raises(SystemExit):  # argparse's usage error
            main(["data", "prepare", str(src), "--out", str(tmp_path / "p"), "--vocab-size", size])
        assert f"argument --vocab-size: must be at least 262, got {size}" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"^--vocab-size 10 is below 262, .*give at least 262"):
        prepare([str(src)], tmp_path / "p", vocab_size=10)
    assert not (tmp_path / "p").exists()


def test_a_vocab_size_other_than_the_directorys_is_refused(tmp_path, caplog, capsys, tok_file):
    """A directory keeps its tokenizer: a --vocab-size that differs was silently ignored."""
    rng = random.Random(0)
    src = tmp_path / "src"
    src.mkdir()
    for name in "abcd":
        (src / f"{name}.txt").write_text("\n\n".join(text(rng, 25) for _ in range(10)))
    prepare([str(src / "a.txt")], tmp_path / "p", vocab_size=300)
    with pytest.raises(DataError, match=r"prepared with --vocab-size 300, not --vocab-size 500; leave --vocab-size"):
        prepare([str(src / "b.txt")], tmp_path / "p", vocab_size=500)
    args = ["data", "prepare", str(src / "b.txt"), "--out", str(tmp_path / "p"), "--vocab-size", "500"]
    assert main(args) == 2 and "not --vocab-size 500" in capsys.readouterr().err
    prepare([str(src / "b.txt")], tmp_path / "p", vocab_size=300)  # its own size, or none: added with its tokenizer
    prepare([str(src / "c.txt")], tmp_path / "p")
    main(["data", "prepare", str(src / "d.txt"), "--out", str(tmp_path / "p")])  # the flag left out: its own
    assert sum(f.get("prepared", False) for f in read_manifest(tmp_path / "p")["files"]) == 4
    prepare([str(src / "a.txt")], tmp_path / "q", tokenizer=str(tok_file))
    with pytest.raises(DataError, match=r"prepared with --tokenizer \(a vocabulary of \d+\), not --vocab-size 500"):
        prepare([str(src / "b.txt")], tmp_path / "q", vocab_size=500)


def test_a_tokenizer_already_in_a_new_out_directory_is_used_only_when_named(tmp_path, tokenizer, capsys):
    """Prepared into a Hugging Face model's folder, its tokenizer.json was taken silently as the
    data's (no --tokenizer, a --vocab-size ignored). A killed prepare's own (shards/ beside it) is
    still taken up by the re-run."""
    src = write_corpus(tmp_path / "src")
    model = tmp_path / "model"
    tokenizer.save(model / "tokenizer.json")
    args = ["data", "prepare", str(src), "--out", str(model), "--workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--out {model} already holds a tokenizer.json that no `trimtab data prepare` wrote" in err
    assert f"--tokenizer {model / 'tokenizer.json'}" in err and sorted(p.name for p in model.iterdir()) == [
        "tokenizer.json"
    ]
    assert main([*args, "--tokenizer", str(model / "tokenizer.json")]) == 0
    assert read_manifest(model)["tokenizer"]["bpe_vocab_size"] is None
    killed = tmp_path / "killed"  # what a prepare killed before its first job leaves
    (killed / "shards").mkdir(parents=True)
    tokenizer.save(killed / "tokenizer.json")
    assert prepare([str(src)], killed, workers=1)["tokenizer"]["sha256"] == tokenizer.fingerprint


def test_zstd_jsonl_arrow_and_chat_records_are_read(tmp_path, tok_file):
    zstandard = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    src = tmp_path / "src"
    src.mkdir()
    lines = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(5)).encode()
    (src / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.table({"body": ["arrow one", "arrow two"]})
    with pa.ipc.new_stream(str(src / "b.arrow"), table.schema) as writer:
        writer.write_table(table)
    manifest = prepare([str(src / "a.jsonl.zst")], tmp_path / "p", tokenizer=str(tok_file))
    assert manifest["documents"] == 5
    arrow = prepare([str(src / "b.arrow")], tmp_path / "q", tokenizer=str(tok_file), options=Options(text_field="body"))
    assert arrow["documents"] == 2
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    manifest = prepare([str(chat)], tmp_path / "c", tokenizer=str(tok_file))
    data = PreparedData(tmp_path / "c")
    tokens, mask = data.read(0, data.n_tokens), data.mask(0, data.n_tokens)
    tok = TextTokenizer.load(tok_file)
    assert manifest["chat"] and tok.decode(tokens[mask].tolist()) == "hello<|end|>"  # as in memory


def test_the_planner_counts_a_prepared_directory_from_its_manifest(tmp_path, tok_file):
    from trimtab.config import load_config
    from trimtab.plan.chinchilla import count_dataset_tokens

    prepare([str(write_corpus(tmp_path / "src"))], tmp_path / "p", tokenizer=str(tok_file))
    cfg = load_config(preset="debug")
    tokens, how = count_dataset_tokens(cfg, str(tmp_path / "p"))
    # the split's own training tokens (whole documents held out), as the run's packed rows hold them
    rows = ShardedRows(PreparedData(tmp_path / "p"), cfg.data.seq_len, True, "train", cfg.data.eval_fraction)
    assert 0 <= tokens - rows.n_tokens < 2 * (cfg.data.seq_len + 1) and "manifest" in how


# ---------------------------------------------------------------------- issue #30: a new user's prepare


def bad_records(folder):
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['{"text": "fine"}', '{"body": "no text"}', "not json", '{"text": "also fine"}']
    (folder / "a.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def test_a_bad_record_suggests_the_flag_on_the_cli_and_the_option_in_python(tmp_path, capsys, tok_file):
    src = bad_records(tmp_path / "src")
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "p")]) == 2  # a new vocabulary reads it first
    err = capsys.readouterr().err
    assert "a.jsonl:2:" in err and "pass --skip-bad-records" in err and "skip_bad_records=true" not in err
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "p"), "--tokenizer", str(tok_file)]) == 2
    assert "pass --skip-bad-records" in capsys.readouterr().err  # and the workers' own read
    with pytest.raises(DataError, match=r"a.jsonl:2: .*pass Options\(skip_bad_records=True\)"):
        prepare([str(src)], tmp_path / "q")


def test_skipped_records_are_named_on_the_console(tmp_path, caplog, tok_file):
    """A warning: the CLI's logging prints it on stderr (as trimtab: ...), not only in the manifest."""
    src = bad_records(tmp_path / "src")
    args = ["data", "prepare", str(src), "--out", str(tmp_path / "p"), "--tokenizer", str(tok_file)]
    assert main([*args, "--skip-bad-records"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"skipped 2 malformed records: {src / 'a.jsonl'}:2, {src / 'a.jsonl'}:3" in warned
    assert prepare_py.skipped_line(9, [f"f:{i}" for i in range(1, 6)]) == (
        "skipped 9 malformed records: f:1, f:2, f:3, f:4, f:5, ..."
    )


def test_a_failed_prepare_leaves_nothing_it_created(tmp_path, tok_file):
    src = bad_records(tmp_path / "src")
    for tokenizer in (None, str(tok_file)):  # failing while training a vocabulary, or in a job
        with pytest.raises(DataError, match="a.jsonl:2"):
            prepare([str(src)], tmp_path / "new" / "p", tokenizer=tokenizer)
        assert not (tmp_path / "new" / "p").exists()
    mine = tmp_path / "mine"  # a directory the user made, with a file of theirs
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DataError):
        prepare([str(src)], mine, tokenizer=str(tok_file))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    good = tmp_path / "good"  # a prepared directory that a later, failing prepare adds to keeps all it had
    write_corpus(good)
    prepare([str(good)], tmp_path / "p", tokenizer=str(tok_file))
    kept = sorted(p.relative_to(tmp_path / "p") for p in (tmp_path / "p").rglob("*"))
    with pytest.raises(DataError):
        prepare([str(src)], tmp_path / "p")
    assert sorted(p.relative_to(tmp_path / "p") for p in (tmp_path / "p").rglob("*")) == kept


@pytest.mark.parametrize("held", ["config.yaml", "checkpoints", "metrics.jsonl"])
def test_prepare_refuses_to_write_into_a_run_directory(tmp_path, capsys, tok_file, held):
    run = tmp_path / "runs" / "small"
    (run / "checkpoints").mkdir(parents=True)
    if held != "checkpoints":
        (run / "checkpoints").rmdir()
        (run / held).write_text("")
    src = write_corpus(tmp_path / "src")
    assert main(["data", "prepare", str(src), "--out", str(run), "--tokenizer", str(tok_file)]) == 2
    assert f"--out {run} is a training run's directory (it holds {held})" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == [held]


def test_a_deleted_tokenizer_is_trained_again_as_it_was_or_refused(tmp_path, tok_file):
    """rm tokenizer.json, then prepare again: a new BPE of the default 4096 tokens was trained and the shards
    of the 300-token one kept, their ids read with it as other text (a run trained on them without a word)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(text(random.Random(0), 400))
    out = tmp_path / "p"
    first = prepare([str(tmp_path / "src")], out, vocab_size=300, workers=1)
    made = (out / "tokenizer.json").read_bytes()
    (out / "tokenizer.json").unlink()
    again = prepare([str(tmp_path / "src")], out, workers=1)  # the same sources: the same BPE back
    assert again["tokenizer"] == first["tokenizer"] and (out / "tokenizer.json").read_bytes() == made
    (out / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer.json is missing, and --tokenizer .* is not the tokenizer the"):
        prepare([str(tmp_path / "src")], out, tokenizer=str(tok_file), workers=1)
