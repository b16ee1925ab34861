"""`trimtab plan` counts what a run does: its MFU on a CPU, the tokens a step trains, the tokens the
eval hold-out leaves to training."""

import dataclasses
import json
import logging

import numpy as np
import pytest

from trimtab.config import load_config
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import TokenizedDocs, _hold_out, pack_rows, tokenize_documents
from trimtab.plan import Hardware, make_plan
from trimtab.plan.memory import CPU_MFU
from trimtab.plan.report import format_plan

CPU = Hardware(name="CPU", kind="cpu", precision="fp32", peak_flops=1e11, peak_source="test", memory_bytes=10**9)


def test_a_cpu_plan_times_by_a_runs_measured_mfu_else_says_its_guess_loudly(tmp_path):
    """A CPU trains these models at ~5-7% of its matmul peak, not the 40% once assumed (a plan of
    8 min for a 46 min run): a run of the config in its run directory gives its own MFU, which
    the plan uses and names; without one the CPU's typical MFU, marked ASSUMED."""
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path)})
    guessed = make_plan(cfg, hardware=CPU)
    assert guessed.mfu == CPU_MFU["dense"] and guessed.mfu_source.startswith("ASSUMED")
    assert guessed.run_hours == pytest.approx(guessed.run_flops / (1e11 * CPU_MFU["dense"]) / 3600)
    summary = {"mfu": 0.031, "device": "cpu", "precision": "fp32", "params": guessed.model.total, "step": 100}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    measured = make_plan(cfg, hardware=CPU)
    assert measured.mfu == pytest.approx(0.031)
    line = next(ln for ln in format_plan(measured).splitlines() if ln.startswith("Time on"))
    assert f"measured by the run in {tmp_path}" in line, line
    (tmp_path / "summary.json").write_text(json.dumps(summary | {"params": 1}))  # another model: not its MFU
    assert make_plan(cfg, hardware=CPU).mfu == CPU_MFU["dense"]


def test_batch_tokens_is_whole_rows_so_the_plan_counts_what_a_step_trains(caplog):
    """A step draws packed rows until it holds train.batch_tokens: 3000 at seq_len 64 trained 3,008
    while the plan (and train.epochs, the Chinchilla budget) counted 3,000. Resolved to whole rows,
    said once; a multiple stays as it is."""
    with caplog.at_level(logging.WARNING, logger="trimtab.config"):
        cfg = load_config(preset="debug", sets=["train.batch_tokens=3000", "train.micro_batch_tokens=1024"])
    assert [r.getMessage() for r in caplog.records if "train.batch_tokens=3000" in r.getMessage()]
    n = 20 * cfg.data.seq_len + 1
    docs = TokenizedDocs(tokens=np.arange(n, dtype=np.int32) % 50, mask=np.ones(n, bool), offsets=np.array([0, n]))
    loader = BatchLoader(pack_rows(docs, cfg.data.seq_len), cfg.train.batch_tokens, 1024, seed=0, pad_id=0)
    trained = loader.next_batch().n_tokens
    assert trained == cfg.train.batch_tokens == 3008
    assert make_plan(cfg, hardware=CPU).run_tokens == cfg.train.max_steps * trained
    assert load_config(preset="debug", sets=["train.batch_tokens=2048"]).train.batch_tokens == 2048
    unpacked = load_config(preset="debug", sets=["train.batch_tokens=3000", "data.pack=false"])
    assert unpacked.train.batch_tokens == 3000  # rows of varying length: no whole number of them to round to


def test_the_plans_training_tokens_are_what_the_hold_out_leaves(tmp_path):
    """The hold-out takes whole documents (a large one's tail), not a flat data.eval_fraction of the
    tokens: a corpus of one large file and 49 small ones held out one small file, 0.4% of its
    tokens, where the plan subtracted 2%. The plan counts the split's own training tokens, for a
    corpus as the in-memory split cuts it and for a prepared directory as its index does."""
    from trimtab.data import TextTokenizer, read_documents
    from trimtab.data.prepare import prepare
    from trimtab.data.prepared import PreparedData, ShardedRows
    from trimtab.data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = np.random.default_rng(0).choice("the quick brown fox jumps over a lazy dog".split(), 12_000)
    (corpus / "big.txt").write_text(" ".join(words))
    for i in range(49):
        (corpus / f"small{i:02d}.txt").write_text(" ".join(words[i * 60 : i * 60 + 60]))
    # random words are word salad, which training leaves out (and the plan too, test_plan_junk.py): off counts them
    data = {"max_bytes": 0, "garbage_filter": "off"}
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run"), "data": data})
    docs, _ = read_documents(dataclasses.replace(cfg.data, source=str(corpus), mix=[]), key="x")
    train_tokenizer(docs, 300).save(tmp_path / "run" / "tokenizer.json")
    tok = TextTokenizer.load(tmp_path / "run" / "tokenizer.json")
    split = _hold_out(tokenize_documents(docs, tok, cfg.data, None), cfg.data.eval_fraction, cfg.train.seed)
    counted = make_plan(cfg, data_path=str(corpus), hardware=CPU).data
    assert counted.dataset_tokens == len(split[0].tokens) and "eval hold-out" in counted.source
    assert counted.dataset_tokens != round(0.98 * (len(split[0].tokens) + len(split[1].tokens)))

    prepare([str(corpus)], tmp_path / "prep", tokenizer=str(tmp_path / "run" / "tokenizer.json"))
    rows = ShardedRows(PreparedData(tmp_path / "prep"), cfg.data.seq_len, True, "train", cfg.data.eval_fraction)
    prepared = make_plan(cfg, data_path=str(tmp_path / "prep"), hardware=CPU).data.dataset_tokens
    # packed rows: each run of training documents less its last partial row (one run each side of the held one)
    assert 0 <= prepared - rows.n_tokens < 2 * (cfg.data.seq_len + 1)
    assert prepared != round(0.98 * PreparedData(tmp_path / "prep").n_tokens)


def test_a_finetune_phase_of_another_seq_len_says_its_steps_train_whole_rows_too(caplog):
    """The finetune phase draws whole rows of finetune.data.seq_len with the same train.batch_tokens:
    2048 at 48 trained 2,064 a step, unsaid (only data.seq_len's rounding was)."""
    sets = ["finetune.steps=5", "finetune.data.source=ft.jsonl", "finetune.data.seq_len=48"]
    with caplog.at_level(logging.WARNING, logger="trimtab.config"):
        cfg = load_config(preset="debug", sets=["train.batch_tokens=2048", *sets])
    said = [r.getMessage() for r in caplog.records if "finetune.data.seq_len=48" in r.getMessage()]
    assert said and "2064" in said[0], said
    assert cfg.train.batch_tokens == 2048  # the pretraining's whole rows of data.seq_len 64 kept


def test_data_that_leaves_training_no_tokens_or_no_row_is_said_with_the_key_to_change(tmp_path):
    """One document held out whole (data.eval_fraction) left 0 training tokens, and the plan dropped
    its data section without a word; a few tokens short of one packed row planned a run that
    stops at its start."""
    from trimtab.errors import ConfigError

    doc = tmp_path / "one.txt"
    doc.write_text("a short document\n")
    cfg = load_config(preset="debug", sets=["data.eval_fraction=0.4"], overrides={"out": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match=r"leaves 0 training tokens.*data\.eval_fraction \(now 0\.4"):
        make_plan(cfg, data_path=str(doc), hardware=CPU)
    doc.write_text("a short document of some twenty-odd words, far fewer tokens than one row of the debug preset\n")
    few = make_plan(
        load_config(preset="debug", overrides={"out": str(tmp_path / "r")}), data_path=str(doc), hardware=CPU
    )
    assert any("one packed row of data.seq_len+1=65" in w for w in few.data.warnings), few.data.warnings


def test_a_prepared_source_of_junk_only_is_refused_as_training_refuses_it(tmp_path, tokenizer):
    """A prepared directory every document of which `data prepare` flagged (random characters) was counted whole
    (4,505 tokens), where training leaves it out of a mixture and refuses it alone (data/dataset.py)."""
    from test_mixture_junk_source import mixture
    from trimtab.data.prepare import prepare
    from trimtab.errors import ConfigError

    source = mixture(tmp_path, 2).mix[0].source  # 6 documents of random characters
    tokenizer.save(tmp_path / "tokenizer.json")
    prepare([source], tmp_path / "p", tokenizer=str(tmp_path / "tokenizer.json"))
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match=r"--data .*p: every one of its 6 documents was flagged as junk"):
        make_plan(cfg, data_path=str(tmp_path / "p"), hardware=CPU)
    off = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, garbage_filter="off"))
    assert make_plan(off, data_path=str(tmp_path / "p"), hardware=CPU).data.dataset_tokens > 0  # off: as asked
