"""Inputs at the edges of the data readers, each written as real files: a truncated or mislabelled
.zst, the same bytes under two names (a symlink, a copy), what a directory walk cannot read, a
whitespace-only file, sources too small (named), one large document among small ones held out,
special-token text in a document or a chat message, a tokenizer directory, and `trimtab eval
--data` through training's readers."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re

import numpy as np
import pytest

from trimtab.config import DataConfig, load_config
from trimtab.data import formats
from trimtab.data.chat import ChatFormat, render_document
from trimtab.data.dataset import build_phase_data, open_eval_source, open_sources
from trimtab.data.packing import build_splits, tokenize_documents
from trimtab.data.prepare import prepare
from trimtab.data.prepared import PreparedData, ShardedRows
from trimtab.data.sources import CHAT_TEMPLATE, Document, read_documents
from trimtab.data.tokenizer import SPECIAL_TOKENS, TextTokenizer
from trimtab.errors import ConfigError, DataError
from trimtab.evaluation.perplexity import read_texts

CODE = "def f(x):\n    return x * 2\n\n"


@pytest.fixture
def tok_file(tmp_path, tokenizer):
    path = tmp_path / "tok" / "tokenizer.json"
    tokenizer.save(path)
    return path


# ------------------------------------------------------------------------------------------- csv


def test_csv_cells_are_read_as_the_text_they_are(tmp_path):
    """pandas' inference read "NA" and "None" as nulls, "007" as 7 and a column of digits as
    ints: records refused as not a string. A cell is text; an empty one an empty document."""
    pytest.importorskip("datasets")
    path = tmp_path / "t.csv"
    path.write_text('text,id\nNA,1\nNone,2\n007,3\n,4\n"a, quoted ""one""",\n1.50,6\n')
    docs, skipped = read_documents(DataConfig(source=str(path), max_bytes=0))
    assert [d.text for d in docs] == ["NA", "None", "007", 'a, quoted "one"', "1.50"] and skipped == 0
    with gzip.open(tmp_path / "n.csv.gz", "wt") as fh:  # its header read through the decompression
        fh.write("text\n123\n45\n")
    docs, _ = read_documents(DataConfig(source=str(tmp_path / "n.csv.gz"), max_bytes=0))
    assert [d.text for d in docs] == ["123", "45"]


# ------------------------------------------------------------------------------------------ zstd


def test_a_truncated_or_mislabelled_zst_is_refused_naming_the_file(tmp_path, caplog):
    """zstandard's stream reader ended a truncated file quietly (its first half trained on as the
    whole), and a file named .zst that is not zstd was a ZstdError traceback."""
    zstandard = pytest.importorskip("zstandard")
    text = "".join(f"line {i}: " + "word " * (i % 13) + "\n" for i in range(40_000))
    whole = zstandard.ZstdCompressor().compress(text.encode())
    (tmp_path / "whole.txt.zst").write_bytes(whole)
    (tmp_path / "two.txt.zst").write_bytes(whole + whole)  # two frames (pzstd, cat): read across
    (tmp_path / "cut.txt.zst").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "fake.jsonl.zst").write_text('{"text": "hello"}\n')
    assert "".join(r.value for r in formats.records(tmp_path / "whole.txt.zst")) == text
    assert "".join(r.value for r in formats.records(tmp_path / "two.txt.zst")) == text + text
    with pytest.raises(DataError, match=r"cut.txt.zst: cannot be read as text \(the file ends inside a zstd frame"):
        read_documents(DataConfig(source=str(tmp_path / "cut.txt.zst")))
    with pytest.raises(DataError, match=r"fake.jsonl.zst: cannot be read as jsonl \(not zstd data"):
        read_documents(DataConfig(source=str(tmp_path / "fake.jsonl.zst")))
    (tmp_path / "dir").mkdir()
    for name in ("whole.txt.zst", "cut.txt.zst"):
        os.replace(tmp_path / name, tmp_path / "dir" / name)
    with caplog.at_level(logging.WARNING):  # in a directory: skipped whole, said
        docs, _ = read_documents(DataConfig(source=str(tmp_path / "dir"), max_bytes=0))
    assert [d.text for d in docs] == [text] and "cut.txt.zst: cannot be read as text (the file ends" in caplog.text


# -------------------------------------------------------------- the same bytes, what a walk passes


def test_a_symlink_or_a_copy_is_read_once_in_memory_as_prepare_prepares_it(tmp_path, tok_file, caplog):
    """A symlink to a file of the directory (and a copy) was read twice in memory while prepare
    skipped it by its sha256: the rows parted. One line says it, not a line per file."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}.txt").write_text(CODE * (i + 2))
    os.symlink("f0.txt", src / "link.txt")
    for i in range(5):
        (src / f"copy{i}.txt").write_text(CODE * 2)  # f0's bytes
    cfg = DataConfig(source=str(src), max_bytes=0, seq_len=8, eval_fraction=0.0)
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(cfg)
        prepare([str(src)], tmp_path / "p", tokenizer=str(tok_file))
    assert len(docs) == 6
    said = [r.getMessage() for r in caplog.records if "the same bytes as a file" in r.getMessage()]
    assert len(said) == 2 and all("6 files: " in m and m.endswith(", ...") for m in said)
    memory, _ = build_splits(cfg, TextTokenizer.load(tok_file), docs, None, seed=0)
    prepared = ShardedRows(PreparedData(tmp_path / "p"), 8, True, "train", 0.0)
    assert len(prepared) == len(memory) > 0
    assert all(np.array_equal(prepared.get(i)[0], memory.get(i)[0]) for i in range(len(memory)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a directory without permission")
def test_what_a_directory_walk_cannot_read_is_said_in_one_line(tmp_path, caplog):
    _passed_entries(tmp_path, caplog, locked=True)


def test_broken_symlinks_and_link_loops_are_said_in_one_line(tmp_path, caplog):
    """A dangling symlink, a link loop and (not as root) a directory without permission were
    left out in silence."""
    _passed_entries(tmp_path, caplog, locked=False)


def _passed_entries(tmp_path, caplog, locked: bool) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(CODE)
    os.symlink(tmp_path / "nowhere", src / "dangling.txt")
    os.symlink(src, src / "sub" / "back")  # a loop to the root
    if locked:
        (src / "locked").mkdir()
        (src / "locked" / "b.txt").write_text(CODE)
        os.chmod(src / "locked", 0)
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(src)))
    if locked:
        os.chmod(src / "locked", 0o755)  # for pytest to remove it
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert [d.source for d in docs] == [str(src / "a.txt")]
    assert f"{src / 'dangling.txt'} (a broken symlink)" in line and f"{src / 'sub' / 'back'} (a link to" in line
    assert line.startswith(f"data.source '{src}': left out {3 if locked else 2} entries: ")
    assert not locked or "locked (Permission denied)" in line


# ------------------------------------------------------------------ too little text, said where


def test_a_whitespace_only_source_is_refused_by_prepare_as_training_refuses_it(tmp_path, tok_file):
    """It was prepared as "2 tokens in 1 documents" and failed only when trained on."""
    (tmp_path / "ws.txt").write_text("   \n\n\t\t\n   \r\n")
    for tokenizer in (None, str(tok_file)):  # a new BPE, or a given tokenizer
        with pytest.raises(DataError, match=r"^the sources \(.*ws.txt\) hold no text: .*ws.txt holds only whitespace"):
            prepare([str(tmp_path / "ws.txt")], tmp_path / "p", tokenizer=tokenizer, vocab_size=300)
        assert not (tmp_path / "p").exists()  # nothing left behind
    (tmp_path / "src").mkdir()  # beside text, kept as training keeps it
    (tmp_path / "src" / "a.txt").write_text(CODE * 20)
    (tmp_path / "src" / "ws.txt").write_text(" \n")
    assert prepare([str(tmp_path / "src")], tmp_path / "p", tokenizer=str(tok_file))["documents"] == 2


def test_a_small_eval_source_or_mixture_source_is_named_with_its_path_not_the_training_split(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(CODE * 40)
    (tmp_path / "ws.txt").write_text(" \n\n\t\n")
    cases = [
        (
            {"source": str(tmp_path / "a.txt"), "eval_source": str(tmp_path / "ws.txt")},
            r"data.eval_source '.*ws.txt' has ",
        ),
        (
            {"mix": [{"source": str(tmp_path / "a.txt")}, {"source": str(tmp_path / "ws.txt")}]},
            r"data.mix\[1\].source '.*ws.txt' has \d+ tokens in 1 document once data.eval_fraction=0.02 is held out",
        ),
    ]
    for data, said in cases:
        cfg = load_config(preset="debug", overrides={"data": {**data, "seq_len": 16}}).data
        sources, evals = open_sources(cfg, "data", None), open_eval_source(cfg, "data", None)
        with pytest.raises(DataError, match=f"^{said}.*add data or lower data.seq_len"):
            build_phase_data(cfg, sources, tokenizer, 0, None, evals)


def test_an_infinite_mixture_weight_is_refused_naming_the_key():
    """.inf passed the check and ended in a traceback (a NaN share of the eval tokens)."""
    for weight in (float("inf"), float("nan")):
        mix = [{"source": "a.txt", "weight": weight}, {"source": "b.txt", "weight": 1.0}]
        with pytest.raises(ConfigError, match=r"'data.mix\[0\].weight' must be a finite number > 0"):
            load_config(preset="debug", overrides={"data": {"mix": mix}})


def test_a_source_listed_twice_in_a_mixture_is_refused_naming_the_fix():
    """Listed twice it was drawn as two sources (given two names) or refused asking for distinct names; a weight of
    0 was refused without saying how to leave a source out."""
    twice = [{"source": "web/", "weight": 0.25}, {"source": "./web", "weight": 0.5, "name": "more"}]
    with pytest.raises(ConfigError, match=r"'data.mix\[1\].source' names the same data as data.mix\[0\].source .*"
                       r"list it once, with the weights added \(0.75\)"):  # fmt: skip
        load_config(preset="debug", overrides={"data": {"mix": twice}})
    zero = [{"source": "a.txt", "weight": 0}, {"source": "b.txt"}]
    with pytest.raises(ConfigError, match=r"'data.mix\[0\].weight' .* got 0.0; to train without this source, remove"):
        load_config(preset="debug", overrides={"data": {"mix": zero}})


# ------------------------------------------------------------------------------------- hold-out


def test_a_large_document_gives_evaluation_its_tail_not_the_whole_of_it(tokenizer):
    """Documents are chosen by count, but a document of more than a quarter of the tokens is not
    held out whole: a large file chosen among small ones is cut, the fraction's worth of its tail held out
    (it used to be held out whole: training got the 2% of small files)."""
    docs = [Document([(CODE * 300, True)]), Document([("a = 1\n", True)]), Document([("b = 2\n", True)])]
    cfg = DataConfig(seq_len=8, eval_fraction=0.02)
    stream = tokenize_documents(docs, tokenizer, cfg).tokens
    big = tokenize_documents(docs[:1], tokenizer, cfg).tokens
    target = len(stream) - int(len(stream) * 0.98)
    for seed in range(6):  # the seeds choose each of the three documents
        train, held = build_splits(cfg, tokenizer, docs, None, seed)
        assert train.n_tokens >= len(stream) * 0.97 - 2 * 8, seed
        if np.random.default_rng(seed).permutation(3)[0] == 0:  # the large one: its tail
            tail = big[len(big) - target :]
            assert len(held) == (target - 1) // 8 > 0
            assert all(np.array_equal(held.get(r)[0], tail[r * 8 : r * 8 + 9]) for r in range(len(held)))


# ------------------------------------------------------------------------------------ tokenizers


def test_special_token_text_in_documents_and_chat_contents_is_text(tokenizer, tmp_path):
    """`<|endoftext|>` inside a document was its end-of-text id mid-document, `<|user|>` quoted in
    a chat reply a role: both are text now; the roles and ends the template writes stay specials."""
    ids = {t: tokenizer.encode(t)[0] for t in SPECIAL_TOKENS}
    docs = [Document([("x = '<|endoftext|>'\n<|user|>", True)])]
    tokens = tokenize_documents(docs, tokenizer, DataConfig()).tokens.tolist()
    assert tokens.count(tokenizer.eos_id) == 1 and tokens[-1] == tokenizer.eos_id and ids["<|user|>"] not in tokens
    quoted = "say <|end|> or <|user|>"
    messages = [{"role": role, "content": quoted} for role in ("user", "assistant")]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    tokenized = tokenize_documents(
        read_documents(DataConfig(source=str(tmp_path / "c.jsonl")))[0], tokenizer, DataConfig()
    )
    tokens = tokenized.tokens.tolist()
    assert [t for t in tokens if t in ids.values()] == [
        ids["<|user|>"], ids["<|end|>"], ids["<|assistant|>"], ids["<|end|>"], ids["<|endoftext|>"]
    ]  # fmt: skip
    assert tokenizer.decode(tokens) == f"<|user|>\n{quoted}<|end|>\n<|assistant|>\n{quoted}<|end|>\n<|endoftext|>"
    assert tokenizer.decode(tokenized.tokens[tokenized.mask].tolist()) == f"{quoted}<|end|>"


def test_data_tokenizer_takes_a_hugging_face_directory(tmp_path, tokenizer):
    """As `data prepare --tokenizer DIR` does; it said the directory "does not exist"."""
    tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    loaded = TextTokenizer.load(tmp_path / "hf", key="data.tokenizer")
    assert loaded.encode(CODE) == tokenizer.encode(CODE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="^data.tokenizer '.*empty' is a directory without a tokenizer.json"):
        TextTokenizer.load(tmp_path / "empty", key="data.tokenizer")


def test_a_templates_special_tokens_stay_specials_and_a_messages_are_text(tokenizer, tmp_path):
    """Through a Hugging Face tokenizer's template (rendered with Jinja), as through trimtab's."""
    ids = {t: tokenizer.encode(t)[0] for t in SPECIAL_TOKENS}
    quoted = "a reply <|end|> with <|user|> in it"
    messages = [{"role": "user", "content": "hi <|assistant|>"}, {"role": "assistant", "content": quoted}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    [doc], _ = read_documents(DataConfig(source=str(tmp_path / "c.jsonl")), chat=ChatFormat(CHAT_TEMPLATE, {}))
    tokens = [t for segment in tokenizer.encode_documents([doc])[0] for t in segment]
    found = [t for t in tokens if t in ids.values()]
    assert found == [ids["<|user|>"], ids["<|end|>"], ids["<|assistant|>"], ids["<|end|>"]]
    assert tokenizer.decode(tokens) == doc.text
    trimming = CHAT_TEMPLATE.replace("m['content']", "m['content'] | trim")  # does more than write it
    turns = [("user", " q "), ("assistant", " a ")]
    segments, markup = render_document(ChatFormat(trimming, {}), turns)
    assert markup == ((0, len("".join(t for t, _ in segments))),)  # all markup: matched, as transformers does


def test_a_run_from_trimtabs_own_export_trains_on_chats_in_trimtabs_format(tmp_path, tokenizer):
    """An export of a run that never saw a chat has no template; a run initialised from it was
    refused chat data ("add one", not how). It is trimtab's tokenizer: trimtab's format, as
    init_from=<the run> gives, and the next export carries the template."""
    from trimtab.hf.export import _generation_config, write_tokenizer

    write_tokenizer(tokenizer, tmp_path / "base", 128, chat=False)
    exported = TextTokenizer.load(tmp_path / "base" / "tokenizer.json")
    assert exported.hf is not None and exported.chat is None
    write_tokenizer(exported, tmp_path / "again", 128, chat=True)
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    base = {"generation_config": {"eos_token_id": exported.eos_id}}  # the base's, recorded when initialised from it
    end = exported.encode("<|end|>")
    assert _generation_config(exported, base, chat=True)["eos_token_id"] == [
        exported.eos_id,
        *end,
    ]  # stops at a turn's end
    settings = tmp_path / "base" / "tokenizer_config.json"
    settings.write_text(json.dumps({"eos_token": "<|pad|>"}))  # no longer trimtab's: its template is wanted
    chat = TextTokenizer.load(tmp_path / "base" / "tokenizer.json").chat
    with pytest.raises(
        ValueError, match=f"add the Jinja template .* as 'chat_template' in {re.escape(str(settings))} "
    ):
        render_document(chat, [("user", "q"), ("assistant", "a")])


# --------------------------------------------------------------------------- eval --data readers


def test_eval_data_is_read_through_trainings_readers(tmp_path):
    """.gz said "not UTF-8 (byte 1)", Parquet "(byte 7)", JSONL was scored as raw JSON, a BOM as
    text, and a pipe did not exist."""
    with gzip.open(tmp_path / "notes.txt.gz", "wt") as fh:
        fh.write(CODE)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + CODE.encode())
    (tmp_path / "bom_only.txt").write_bytes(b"\xef\xbb\xbf")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate("ab")))
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    assert read_texts(tmp_path / "notes.txt.gz") == read_texts(tmp_path / "bom.txt") == [CODE]
    assert read_texts(tmp_path / "r.jsonl") == ["a", "b"]
    with pytest.raises(DataError, match="bom_only.txt' is empty"):
        read_texts(tmp_path / "bom_only.txt")
    with pytest.raises(DataError, match=r"chat.jsonl:1 is a chat or instruction record; --data scores text"):
        read_texts(tmp_path / "chat.jsonl")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pytest.importorskip("pyarrow").table({"text": ["x", "y"]}), tmp_path / "t.parquet")
    assert read_texts(tmp_path / "t.parquet") == ["x", "y"]
    # what bash's `<(printf 'piped text')` passes: a /dev/fd path to a pipe's read end (here, not in a
    # second interpreter: 3 s of CPU importing torch)
    read, write = os.pipe()
    try:
        os.write(write, b"piped text")
        os.close(write)
        assert read_texts(f"/dev/fd/{read}") == ["piped text"]
    finally:
        os.close(read)
