"""Garbage documents screened before training (data/quality.py): on real text with real garbage,
through the data a phase trains on, and through `data prepare`."""

import base64
import json
import logging
import random
import string
from pathlib import Path

import numpy as np
import pytest

from trimtab.cli import main
from trimtab.config import DataConfig
from trimtab.data import quality
from trimtab.data.dataset import build_phase_data, open_sources
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import read_manifest
from trimtab.data.sources import read_documents
from trimtab.data.tokenizer import train_tokenizer
from trimtab.errors import ConfigError

# A frozen copy of this repository's own source (the golden runs' corpus). The live tree changed
# with every edit, and with it the threshold: two garbage documents 0.62x the median fell over it.
CLEAN = Path(__file__).with_name("golden") / "corpus.jsonl"


def clean_documents() -> list[str]:
    """Real code and prose: trimtab's source, cut at blank lines into ~1.5 KB documents."""
    docs, current = [], ""
    for line in CLEAN.read_text().splitlines():
        for block in json.loads(line)["text"].split("\n\n"):
            current = f"{current}\n\n{block}" if current else block
            if len(current.encode()) >= 1500:
                docs.append(current)
                current = ""
    return docs


def garbage(kind: str, n: int, rng: random.Random) -> str:
    """~n bytes of what a crawl picks up: a binary file's strings, a base64 blob, `xxd` output, and
    CJK and Hangul text in UTF-8 read back as latin-1 (mojibake)."""
    if kind == "printable":
        return "".join(rng.choice(string.printable) for _ in range(n))
    if kind == "base64":
        return base64.b64encode(rng.randbytes(n * 3 // 4)).decode()
    if kind == "hexdump":
        lines = []
        for i in range(n // 68):
            data = rng.randbytes(16)
            shown = "".join(chr(b) if 32 <= b < 127 else "." for b in data)
            lines.append(f"{16 * i:08x}: {data.hex(' ', 2)}  {shown}")
        return "\n".join(lines)
    if kind == "mojibake":
        scripts = ((0x4E00, 0x9FFF), (0xAC00, 0xD7A3))
        words = ("".join(chr(rng.randint(*rng.choice(scripts))) for _ in range(4)) for _ in range(n // 26))
        return " ".join(words).encode().decode("latin-1")
    raise ValueError(kind)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, set[int]]:
    """A JSONL file of the clean documents with 12 garbage ones at random lines; their line numbers."""
    rng = random.Random(0)
    docs = [(text, False) for text in clean_documents()]
    for k in range(12):
        kind = ("printable", "base64", "hexdump", "mojibake")[k % 4]
        docs.insert(rng.randrange(len(docs)), (garbage(kind, 1500, rng), True))
    path = tmp_path_factory.mktemp("quality") / "crawl.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    return path, {n for n, (_, bad) in enumerate(docs, 1) if bad}


def phase(cfg: DataConfig):
    docs, _ = read_documents(cfg)
    tok = train_tokenizer(docs, 512)  # as a run trains its BPE: on its corpus, garbage and all
    return build_phase_data(cfg, open_sources(cfg, "data", None), tok, seed=0, cache_dir=None)


def test_the_screen_flags_only_documents_packed_far_under_the_median():
    rng = np.random.default_rng(0)
    n_tokens = np.round(1000 / rng.normal(2.5, 0.25, 40))  # text at 2.5 +- 0.25 bytes a token
    n_bytes = np.array([1000] * 40 + [1000, 100, 1000, 1000])
    n_tokens = np.concatenate([n_tokens, [900, 100, 350, 300]])  # 1.1 bytes a token; too short; 2.9; 3.3
    found = quality.screen(n_bytes, n_tokens, 6.0)
    assert found.median == pytest.approx(2.5, rel=0.05) and 0.45 < found.threshold < quality.CAP
    assert np.flatnonzero(found.flagged).tolist() == [40]
    # a source of near-identical documents: the cap keeps small variation from being flagged
    same = quality.screen(np.full(40, 1000), np.r_[np.full(39, 400), 480], 6.0)
    assert same.threshold == quality.CAP and not same.flagged.any()
    # too few documents to know what the source's text packs like: nothing is judged
    assert not quality.screen(n_bytes[-10:], n_tokens[-10:], 6.0).flagged.any()


def test_drop_leaves_out_exactly_the_garbage_of_a_real_mixed_corpus(corpus, caplog):
    path, bad_lines = corpus
    cfg = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="drop")
    with caplog.at_level(logging.WARNING):
        kept = phase(cfg).train
    (line,) = [r.message for r in caplog.records if "bytes per token" in r.message]
    assert line.startswith(f"data.source: {len(bad_lines)} of ") and "left out" in line
    sources = set(kept.docs.sources)
    assert not {f"{path}:{n}" for n in bad_lines} & sources  # every garbage document is out
    n_docs = sum(1 for _ in open(path))
    assert len(sources) == n_docs - len(bad_lines)  # and no clean one


def test_warn_keeps_everything_and_names_the_documents(corpus, caplog):
    path, bad_lines = corpus
    cfg = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0)
    assert cfg.garbage_filter == "warn"
    with caplog.at_level(logging.WARNING):
        kept = phase(cfg).train
    (line,) = [r.message for r in caplog.records if "bytes per token" in r.message]
    assert f"{path}:{min(bad_lines)} (0." in line and "data.garbage_filter=drop leaves them out" in line
    assert len(set(kept.docs.sources)) == sum(1 for _ in open(path))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        phase(DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="off"))
    assert not [r for r in caplog.records if "bytes per token" in r.message]


def test_a_bad_setting_names_its_key():
    with pytest.raises(ConfigError, match="data.garbage_filter"):
        DataConfig(garbage_filter="yes").validate()
    with pytest.raises(ConfigError, match="data.garbage_sigma"):
        DataConfig(garbage_sigma=0).validate()


def prepared_lines(out: Path) -> set[int]:
    """The source lines (JSONL records) held in a prepared directory's shards."""
    return {int(line) for idx in (out / "shards").glob("*.idx.npz") for line in np.load(idx)["where"][:, 1]}


def test_data_prepare_screens_with_one_scale_and_counts_per_file(corpus, tmp_path, caplog):
    path, bad_lines = corpus
    n_docs = sum(1 for _ in open(path))
    args = ["data", "prepare", str(path), "--out", str(tmp_path / "drop"), "--vocab-size", "512"]
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--garbage-filter", "drop"]) == 0
    manifest = read_manifest(tmp_path / "drop")
    assert manifest["files"][0]["garbage"] == len(bad_lines) and manifest["documents"] == n_docs - len(bad_lines)
    assert prepared_lines(tmp_path / "drop") == set(range(1, n_docs + 1)) - bad_lines
    assert 0 < manifest["garbage"]["threshold"] <= quality.CAP
    (line,) = [r.message for r in caplog.records if "documents flagged" in r.message]
    assert line.startswith(f"{len(bad_lines)} documents") and f"{path}:{min(bad_lines)}" in line and "left out" in line

    kept = prepare([str(path)], tmp_path / "warn", vocab_size=512)  # the default names them and keeps them
    assert kept["files"][0]["garbage"] == len(bad_lines) and kept["documents"] == n_docs
    off = prepare([str(path)], tmp_path / "off", vocab_size=512, options=Options(garbage_filter="off"))
    assert "garbage" not in off and "garbage" not in off["files"][0]


# Tolstoy (1877), Homer, and a sentence of Arabic: prose of scripts a BPE of this corpus never learnt
RUSSIAN = (
    "Все счастливые семьи похожи друг на друга, каждая несчастливая семья несчастлива по-своему. "
    "Всё смешалось в доме Облонских."
)
GREEK = (
    "Μῆνιν ἄειδε θεὰ Πηληϊάδεω Ἀχιλῆος οὐλομένην, ἣ μυρί᾽ Ἀχαιοῖς ἄλγε᾽ ἔθηκε, πολλὰς δ᾽ ἰφθίμους ψυχὰς Ἄϊδι προΐαψεν."
)
ARABIC = "اللغة العربية هي إحدى أكثر اللغات انتشارا في العالم ويتحدثها أكثر من أربعمائة مليون نسمة في بلدان كثيرة."


DISCLAIMER = (  # GPL-3 section 15, which packed at 0.47x the median beside the licence's other paragraphs
    "  THERE IS NO WARRANTY FOR THE PROGRAM, TO THE EXTENT PERMITTED BY\nAPPLICABLE LAW.  EXCEPT WHEN OTHERWISE "
    'STATED IN WRITING THE COPYRIGHT\nHOLDERS AND/OR OTHER PARTIES PROVIDE THE PROGRAM "AS IS" WITHOUT WARRANTY\n'
    "OF ANY KIND, EITHER EXPRESSED OR IMPLIED, INCLUDING, BUT NOT LIMITED TO,\nTHE IMPLIED WARRANTIES OF "
    "MERCHANTABILITY AND FITNESS FOR A PARTICULAR\nPURPOSE.  THE ENTIRE RISK AS TO THE QUALITY AND PERFORMANCE OF "
    "THE PROGRAM\nIS WITH YOU.  SHOULD THE PROGRAM PROVE DEFECTIVE, YOU ASSUME THE COST OF\nALL NECESSARY "
    "SERVICING, REPAIR OR CORRECTION.\n"
)


def test_english_in_capitals_is_said_to_be_so_not_another_script():
    """The GPL's disclaimers in capitals were kept as "written in another script than Latin or ... a minority
    language", unnamed: a BPE learns English words in lower case, so they pack like garbage."""
    assert quality.language(DISCLAIMER) == "in capitals"
    assert quality.language(DISCLAIMER.lower()) == "Latin letters"
    kept, spared = quality.spare_scripts(np.array([False, True]), lambda i: DISCLAIMER)
    assert not kept.any() and spared == {1: "in capitals"}
    line = quality.spared_line(7, "data.mix[0].source", ["GPL-3:104 (in capitals)"])
    assert "7 documents pack like garbage but read as natural text: GPL-3:104 (in capitals), ...;" in line


def test_a_minority_language_is_kept_where_garbage_is_flagged(corpus, tmp_path, caplog):
    """5% of Japanese passages in an English corpus were all flagged (a script the tokenizer never
    learnt packs like random bytes), and the orchestrator in auto mode left every one out of
    training. Text of another script is a language, not garbage: kept, said; garbage still flagged."""
    path, bad_lines = corpus
    lines = path.read_text().splitlines()
    rng = random.Random(2)  # the passages' words in new orders: a corpus does not repeat a page
    foreign = [" ".join(rng.choices(text.split(), k=150)) + "." for text in (RUSSIAN, GREEK, ARABIC)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(lines + [json.dumps({"text": t}) for t in foreign]) + "\n")
    assert all(quality.other_script(t) for t in foreign)
    assert not any(quality.other_script(garbage(k, 1500, random.Random(1))) for k in ("base64", "hexdump", "mojibake"))
    cfg = DataConfig(source=str(mixed), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="drop")
    with caplog.at_level(logging.WARNING):
        kept = set(phase(cfg).train.docs.sources)
    assert {f"{mixed}:{len(lines) + k}" for k in (1, 2, 3)} <= kept  # the three foreign documents
    assert not {f"{mixed}:{n}" for n in bad_lines} & kept  # and every garbage one out
    said = [r.message for r in caplog.records]
    named = ", ".join(f"{mixed}:{len(lines) + k} (another script than Latin)" for k in (1, 2, 3))
    assert any(f"3 documents pack like garbage but read as natural text: {named};" in line for line in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        manifest = prepare([str(mixed)], tmp_path / "p", vocab_size=512, options=Options(garbage_filter="drop"))
    assert manifest["files"][0]["garbage"] == len(bad_lines)  # the garbage only: the three foreign documents kept
    assert f"the sources: 3 documents pack like garbage but read as natural text: {named};" in caplog.text
    assert manifest["documents"] == len(lines) + 3 - len(bad_lines)
