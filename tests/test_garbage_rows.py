"""The orchestrator's `garbage` rule (orchestrator/screened.py): the documents the data screen
flagged and kept (data.garbage_filter=warn) have their training rows left out at the start of
training, as one journaled skip_data decision; in memory, from a prepared directory and in a
mixture."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import trimtab
from helpers import CrashAt
from test_quality import clean_documents, garbage
from trimtab.checkpoint import list_checkpoints
from trimtab.config import DataConfig, load_config, merge
from trimtab.config.data import MixSource
from trimtab.data import quality
from trimtab.data.dataset import build_phase_data, open_sources
from trimtab.data.listing import sha256_file
from trimtab.data.prepare import prepare
from trimtab.data.prepared import PreparedData, ShardedRows, read_manifest, write_manifest
from trimtab.data.sources import read_documents
from trimtab.data.tokenizer import TextTokenizer, train_tokenizer
from trimtab.rundir import read_decisions
from trimtab.training.hooks import Hook

KINDS = ("printable", "base64", "hexdump", "mojibake")


@pytest.fixture(scope="module")
def crawl(tmp_path_factory) -> tuple[Path, set[int], TextTokenizer]:
    """A JSONL corpus of ~90 clean documents with 6 garbage ones at random lines, their line
    numbers, and a 512-token BPE trained on it (garbage and all, as a run trains its own)."""
    rng = random.Random(0)
    docs = [(text, False) for text in clean_documents()]
    for k in range(6):
        docs.insert(rng.randrange(len(docs)), (garbage(KINDS[k % 4], 1500, rng), True))
    folder = tmp_path_factory.mktemp("garbage_rows")
    path = folder / "crawl.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    tok = train_tokenizer(read_documents(DataConfig(source=str(path), max_bytes=0))[0], 512)
    tok.save(folder / "tokenizer.json")
    return path, {n for n, (_, bad) in enumerate(docs, 1) if bad}, tok


def rows_of(cfg: DataConfig, tok: TextTokenizer, seed: int = 1234):
    return build_phase_data(cfg, open_sources(cfg, "data", None), tok, seed=seed, cache_dir=None).train


def garbage_share(rows, i: int, bad: set[str]) -> float:
    """Row i's share of tokens from the documents named in `bad`, counted token by token."""
    docs = rows.docs
    start, end = int(rows.starts[i]), int(rows.starts[i] + rows.lengths[i] + 1)
    doc = np.searchsorted(docs.offsets, np.arange(start, end), side="right") - 1
    return float(np.mean([docs.sources[d] in bad for d in doc]))


def test_the_rows_at_least_half_garbage_are_flagged_in_memory(crawl):
    path, bad_lines, tok = crawl
    rows = rows_of(DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.05), tok)
    (found,) = rows.flagged_rows()
    bad = {f"{path}:{n}" for n in bad_lines}
    assert found.scale.key == "data.source" and 0 < found.scale.threshold <= quality.CAP
    assert found.documents == len(bad & set(rows.docs.sources))  # those that reach training
    assert set(found.names) <= bad and all(p < found.scale.threshold for p in found.packing)
    truth = [i for i in range(len(rows)) if garbage_share(rows, i, bad) >= 0.5]
    assert found.rows.tolist() == truth and truth
    off = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.05, garbage_filter="off")
    assert rows_of(off, tok).flagged_rows() == []
    drop = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.05, garbage_filter="drop")
    assert rows_of(drop, tok).flagged_rows() == []


def test_a_mixture_numbers_each_sources_rows_in_its_one_set(crawl, tmp_path):
    path, _, tok = crawl
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"text": t}) + "\n" for t in clean_documents()))
    single = rows_of(DataConfig(source=str(path), max_bytes=0, seq_len=64), tok)
    mix = [MixSource(str(clean), 1.0), MixSource(str(path), 1.0)]
    mixed = rows_of(DataConfig(mix=mix, max_bytes=0, seq_len=64), tok)
    (found,) = mixed.flagged_rows()  # the clean source flags nothing
    assert found.scale.key == "data.mix[1].source"
    assert found.rows.tolist() == (single.flagged_rows()[0].rows + len(mixed.parts[0])).tolist()
    assert all(np.array_equal(mixed.get(int(r))[0], single.get(int(r) - len(mixed.parts[0]))[0]) for r in found.rows)


def test_a_prepared_directory_in_warn_mode_gives_the_same_rows(crawl, tmp_path):
    path, bad_lines, tok = crawl
    out = tmp_path / "prepared"
    prepare([str(path)], out, tokenizer=str(path.with_name("tokenizer.json")))  # --garbage-filter warn
    memory = rows_of(DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0), tok)
    shards = rows_of(DataConfig(source=str(out), seq_len=64, eval_fraction=0.0), tok)
    (ours,), (theirs,) = memory.flagged_rows(), shards.flagged_rows()
    assert len(shards) == len(memory) and theirs.rows.tolist() == ours.rows.tolist()
    assert theirs.documents == ours.documents == len(bad_lines) and theirs.names == ours.names
    assert np.allclose(theirs.packing, ours.packing)
    # held out and packed across documents: each flagged row counted token by token
    data = PreparedData(out)
    rows = ShardedRows(data, 64, True, "train", 0.1, screened=True)
    (held,) = rows.flagged_rows()
    flagged, bounds = ~np.isnan(data.garbage), data.doc_bounds()
    per_row = [
        np.concatenate(
            [flagged[np.searchsorted(bounds, np.arange(a, b), side="right") - 1] for a, b in rows._pieces(i)]
        )
        for i in range(len(rows))
    ]
    assert held.rows.tolist() == [i for i, f in enumerate(per_row) if f.mean() >= 0.5]
    assert held.documents <= len(bad_lines) and ShardedRows(data, 64, True, "train", 0.1).flagged_rows() == []


def test_an_old_prepared_directory_gives_no_flagged_rows(crawl, tmp_path):
    path, _, tok = crawl
    out = tmp_path / "old"
    manifest = prepare([str(path)], out, tokenizer=str(path.with_name("tokenizer.json")))
    for shard in manifest["shards"]:  # the index as a prepare before this change wrote it
        idx = out / "shards" / f"{shard['name']}.idx.npz"
        with np.load(idx) as arrays:
            kept = {k: arrays[k] for k in arrays.files if k != "garbage"}
        np.savez(idx, **kept)
        shard["sha256"]["idx"] = sha256_file(idx)
    write_manifest(out, manifest)
    assert "garbage" in read_manifest(out)
    assert rows_of(DataConfig(source=str(out), seq_len=64), tok).flagged_rows() == []


# ------------------------------------------------------------------ runs


class Drawn(Hook):
    """The rows each step trains on."""

    def __init__(self):
        self.rows: dict[int, list[int]] = {}

    def on_step_start(self, run, batch):
        self.rows[run.step + 1] = list(batch.rows)


def run_cfg(out: Path, crawl, steps: int = 8, mode: str = "auto", **data):
    path, _, _ = crawl
    base = {
        "out": str(out),
        "model": {"n_layers": 1},
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1, "batch_tokens": 1024, "precision": "fp32"},
        "data": {"source": str(path), "max_bytes": 0, "tokenizer": str(path.with_name("tokenizer.json"))} | data,
        "checkpoint": {"every": 4},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "orchestrator": {"mode": mode, "throughput": {"enabled": False}},
    }
    return load_config(preset="debug", overrides=merge(base, {}))


def expected_rows(cfg, tok) -> list[int]:
    return rows_of(cfg.data, tok, cfg.train.seed).flagged_rows()[0].rows.tolist()


def skipped(run: Path) -> set[int]:
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())
    return set(state["data"]["skipped"])


def test_auto_leaves_the_garbage_rows_out_as_one_decision(crawl, tmp_path):
    _, _, tok = crawl
    torch.set_num_threads(1)
    drawn = Drawn()
    cfg = run_cfg(tmp_path / "auto", crawl)
    trimtab.train(cfg, hooks=[drawn])
    rows = expected_rows(cfg, tok)
    (decision,) = [d for d in read_decisions(cfg.run_dir) if d["rule"] == "garbage"]
    assert decision["action"] == "skip_data" and decision["mode"] == "auto" and decision["step"] == 0
    assert decision["params"]["rows"] == rows and decision["evidence"]["rows"] == len(rows)
    (source,) = decision["evidence"]["sources"]
    assert source["source"] == "data.source" and source["documents"] == decision["evidence"]["documents"] > 0
    assert 0 < source["threshold"] <= quality.CAP and source["median_bytes_per_token"] > 1
    assert all(v < source["threshold"] for v in source["first"].values())
    assert "data.garbage_filter=off keeps them" in decision["reasoning"] and 0 < decision["confidence"] < 1
    assert decision["applied"] == [f"{len(rows)} rows left out of training"]
    assert set(rows) <= skipped(cfg.run_dir)
    # applied before the initial checkpoint: no step trains them, the first neither
    assert drawn.rows and not {r for drawn_rows in drawn.rows.values() for r in drawn_rows} & set(rows)


def test_off_decides_nothing_and_advise_only_advises(crawl, tmp_path):
    _, _, tok = crawl
    drawn = Drawn()
    off = run_cfg(tmp_path / "off", crawl, steps=16, mode="off")
    trimtab.train(off, hooks=[drawn])
    rows = set(expected_rows(off, tok))
    assert read_decisions(off.run_dir) == [] and not skipped(off.run_dir)
    assert {r for drawn_rows in drawn.rows.values() for r in drawn_rows} & rows  # trained on
    advise = run_cfg(tmp_path / "advise", crawl, steps=4, mode="advise")
    trimtab.train(advise)
    (decision,) = [d for d in read_decisions(advise.run_dir) if d["rule"] == "garbage"]
    assert decision["mode"] == "advise" and decision["outcome"]["result"] == "not applied"
    assert decision["applied"] == [] and not skipped(advise.run_dir)


def test_a_resume_does_not_decide_again(crawl, tmp_path):
    _, _, tok = crawl
    cfg = run_cfg(tmp_path / "r", crawl, steps=6)
    trimtab.train(cfg)  # checkpoints at 4 and 6
    trimtab.train(run_cfg(tmp_path / "r", crawl, steps=10))
    decisions = [d for d in read_decisions(cfg.run_dir) if d["rule"] == "garbage"]
    assert len(decisions) == 1 and len(decisions[0]["applied"]) == 1
    # a crash before the first checkpoint after the decision: the step-0 checkpoint holds the
    # decision and the rows, so the resume neither decides again nor trains them
    crashed = run_cfg(tmp_path / "c", crawl, steps=8)
    with pytest.raises(RuntimeError, match="crash"):
        trimtab.train(crashed, hooks=[CrashAt(2)])
    assert set(expected_rows(crashed, tok)) <= skipped(crashed.run_dir)  # only the step-0 checkpoint
    trimtab.train(crashed)
    (decision,) = [d for d in read_decisions(crashed.run_dir) if d["rule"] == "garbage"]
    assert decision["applied"] == [f"{len(expected_rows(crashed, tok))} rows left out of training"]
