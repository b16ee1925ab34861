"""Weighted mixtures of sources, train.epochs and max_steps: auto, through the loader and the
real training loop on prepared directories."""

import json
import logging
import math
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trimtab
from helpers import StopAt
from test_trainer import debug_cfg, final_weights, logged
from trimtab.config import DataConfig, load_config
from trimtab.config.data import MixSource
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import ConcatRows, build_splits
from trimtab.data.prepare import prepare
from trimtab.data.sources import Document
from trimtab.errors import DataError
from trimtab.model.catalog import model_size
from trimtab.training.run_length import left_out_tokens, mixed_sources, resolve_max_steps

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "red green blue cyan magenta yellow black white orange purple brown grey".split()


def rows_of(tok, n_docs, seed, seq_len=16):
    rng = random.Random(seed)
    docs = [Document([(" ".join(rng.choice(WORDS) for _ in range(40)), True)]) for _ in range(n_docs)]
    cfg = DataConfig(seq_len=seq_len, eval_fraction=0.0)
    return build_splits(cfg, tok, docs, None, seed=0)[0]


def test_every_step_holds_the_mixture_to_within_a_row_and_resumes_exactly(tokenizer):
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    rows = ConcatRows([a, b])

    def loader():
        return BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[7, 3], names=["a", "b"])

    first = loader()
    drawn, later = [0, 0], []
    for step in range(40):
        batch = first.next_batch()
        for i in batch.rows:
            drawn[int(i >= len(a))] += rows.length(i)
        assert abs(drawn[0] - 0.7 * sum(drawn)) <= 16, (step, drawn)  # within one row of 16 tokens
        if step == 19:
            state = json.loads(json.dumps(first.state_dict()))
        elif step > 19:
            later.append(batch.rows)
    assert first.metrics()["data/a/share"] == pytest.approx(0.7, abs=0.01)
    assert first.metrics()["data/b/epochs"] > first.metrics()["data/a/epochs"]  # the small source repeats more
    resumed = loader()
    resumed.load_state_dict(state)
    assert [resumed.next_batch().rows for _ in range(20)] == later
    wrong = BatchLoader(a, 160, 160, seed=3, pad_id=0)
    with pytest.raises(DataError, match="2 sources but the data now has 1"):
        wrong.load_state_dict(state)


def test_a_source_s_epochs_count_its_passes_when_rows_are_left_out(tokenizer):
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    loader = BatchLoader(ConcatRows([a, b]), 160, 160, seed=3, pad_id=0, weights=[1, 1], names=["a", "b"])
    left_out = loader.skip_rows(list(range(0, len(a), 2)))  # half of a's rows: garbage, or a rollback's window
    served = 0
    while served < len(a) - left_out:
        served += sum(1 for r in loader.next_batch().rows if r < len(a))
    # every row `a` still has was served once: one pass (its tokens drawn over all its tokens said half of one)
    assert loader.metrics()["data/a/epochs"] == pytest.approx(1.0, abs=0.1)


def test_a_mixtures_epoch_counts_the_tokens_trained_on_when_rows_are_left_out(tokenizer):
    """loader.epoch (metrics.jsonl `epoch`) of a mixture is its tokens drawn over its tokens: counted with the
    rows left out (flagged documents' from the start, a rollback's), it said 0 after a whole pass over the rest;
    so did the repeat warning's tokens per source (run_length.py mixed_sources)."""
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    rows = ConcatRows([a, b])
    loader = BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[3, 1], names=["a", "b"])
    left = [*range(0, len(a), 2), len(a)]  # half of a's rows and b's first
    loader.skip_rows(left)
    trained = rows.n_tokens - sum(rows.length(r) for r in left)
    while sum(loader.drawn) < trained:
        assert loader.epoch == 0
        loader.next_batch()
    assert sum(loader.drawn) < rows.n_tokens and loader.epoch == 1  # before: 0
    built = SimpleNamespace(train=rows, names=["a", "b"], weights=[0.75, 0.25], indices=[0, 1])
    tokens = [t for _, _, _, t in mixed_sources(built, "data", left_out_tokens(rows, frozenset(left)))]
    assert tokens == [a.n_tokens - sum(a.length(r) for r in left[:-1]), b.n_tokens - b.length(0)]


def test_a_single_source_keeps_its_order_and_old_checkpoints_load(tokenizer):
    rows = rows_of(tokenizer, 20, 0)
    loader = BatchLoader(rows, 64, 64, seed=5, pad_id=0)
    order = np.random.default_rng([5, 0]).permutation(len(rows))
    assert loader.next_batch().rows == order[:4].tolist()  # the order before mixtures existed
    old = {"epoch": 0, "cursor": 4, "seed": 5, "n_rows": len(rows), "skipped": []}  # a checkpoint from before
    resumed = BatchLoader(rows, 64, 64, seed=5, pad_id=0)
    resumed.load_state_dict(old)
    assert resumed.next_batch().rows == loader.next_batch().rows


def corpus(folder, seed, n, field="text"):
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    lines = [json.dumps({field: " ".join(rng.choice(WORDS) for _ in range(60))}) for _ in range(n)]
    (folder / "part.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def mix_cfg(tmp_path, out, **train):
    web, code = tmp_path / "web", tmp_path / "code"
    if not web.exists():
        prepare([str(corpus(tmp_path / "web-src", 0, 120))], web, vocab_size=300)
        prepare([str(corpus(tmp_path / "code-src", 1, 60))], code, tokenizer=str(web / "tokenizer.json"))
    mix = [{"source": str(web), "weight": 0.7}, {"source": str(code), "weight": 0.3, "name": "code"}]
    return debug_cfg(
        out,
        steps=0,
        # the corpora are random words: word salad the screen names (data/junk.py), not what these tests are about
        data={"mix": mix, "seq_len": 64, "garbage_filter": "off"},
        train={"max_steps": 1000, "epochs": 2, "batch_tokens": 512, "micro_batch_tokens": 512, **train},
        checkpoint={"every": 10},
    )


def test_two_epochs_of_a_70_30_mixture_interrupted_and_resumed_equal_one_run(tmp_path):
    whole = trimtab.train(mix_cfg(tmp_path, tmp_path / "a"))
    prepared = [json.loads((tmp_path / name / "trimtab-data.json").read_text()) for name in ("web", "code")]
    train_tokens = sum(m["tokens"] for m in prepared) * 0.98  # less the held-out documents
    assert whole["total_steps"] == pytest.approx(2 * train_tokens / 512, rel=0.05)
    saved = load_config(overrides=__import__("yaml").safe_load((tmp_path / "a" / "config.yaml").read_text()))
    assert saved.train.max_steps == whole["total_steps"]  # resolved and recorded
    last = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln][-1]
    assert last["data/web/share"] == pytest.approx(0.7, abs=0.02)
    assert last["data/code/share"] == pytest.approx(0.3, abs=0.02)
    evals = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if "val_loss" in ln]
    final = evals[-1]  # one figure per source too, and the overall one lies between them
    assert min(final["val_loss/web"], final["val_loss/code"]) <= final["val_loss"]
    assert final["val_loss"] <= max(final["val_loss/web"], final["val_loss/code"])

    stop = whole["total_steps"] // 2 + 1
    first = trimtab.train(mix_cfg(tmp_path, tmp_path / "b"), hooks=[StopAt(stop)])
    assert first["step"] == stop
    trimtab.train(mix_cfg(tmp_path, tmp_path / "b"))
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert logged(tmp_path / "a") == logged(tmp_path / "b")


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_max_steps_auto_is_the_planners_chinchilla_budget(tmp_path, tokenizer, preset, caplog):
    cfg = load_config(preset=preset, sets=["train.max_steps=auto"])
    steps = resolve_max_steps(cfg, train_tokens=10_000, tok=tokenizer)
    size = model_size(cfg, tokenizer.vocab_size)  # active parameters for MoE, as the planner counts
    assert steps == math.ceil(20 * size.compute_params / cfg.train.batch_tokens)
    assert cfg.train.max_steps == "auto"  # the resolved config is not changed: setup completes a copy
    assert "repeats the training data" in caplog.text  # 10,000 tokens: far more than 4 epochs


def test_prepared_data_with_another_tokenizer_is_refused(tmp_path, tokenizer):
    prepare([str(corpus(tmp_path / "src", 0, 20))], tmp_path / "p", vocab_size=300)
    tokenizer.save(tmp_path / "other" / "tokenizer.json")
    other = str(tmp_path / "other" / "tokenizer.json")
    cfg = debug_cfg(tmp_path / "r", data={"source": str(tmp_path / "p"), "tokenizer": other})
    with pytest.raises(DataError, match=r"data.source '.*p' was prepared with another tokenizer.*--tokenizer .*other"):
        trimtab.train(cfg)
    # two directories prepared with their own BPEs: the run takes the first's, and names that file (the
    # run directory, with its tokenizer.json, is never made)
    prepare([str(corpus(tmp_path / "src2", 1, 20))], tmp_path / "q", vocab_size=320)
    mix = [{"source": str(tmp_path / "p"), "weight": 1}, {"source": str(tmp_path / "q"), "weight": 1}]
    cfg = debug_cfg(tmp_path / "r", data={"mix": mix})
    first = re.escape(str(tmp_path / "p" / "tokenizer.json"))
    with pytest.raises(DataError, match=rf"data.mix\[1\].source .* --tokenizer {first} \(this run's\)"):
        trimtab.train(cfg)


def test_a_prepared_eval_source_replaces_the_hold_out(tmp_path):
    prepare([str(corpus(tmp_path / "train-src", 0, 60))], tmp_path / "train", vocab_size=300)
    prepare(
        [str(corpus(tmp_path / "val-src", 1, 10))], tmp_path / "val", tokenizer=str(tmp_path / "train/tokenizer.json")
    )
    data = {"source": str(tmp_path / "train"), "eval_source": str(tmp_path / "val"), "seq_len": 64}
    cfg = debug_cfg(tmp_path / "r", steps=4, data=data, train={"batch_tokens": 512, "micro_batch_tokens": 512})
    summary = trimtab.train(cfg)
    assert summary["val_loss"] is not None
    from trimtab.training.phase_data import build_phases

    [phase] = build_phases(cfg, tmp_path / "r" / "tokenizer.json")[1]
    assert (
        phase.train_rows.n_tokens
        == (json.loads((tmp_path / "train/trimtab-data.json").read_text())["tokens"] - 1) // 64 * 64
    )
    assert sum(m.n_targets for m in phase.eval_rows.micro) > 0


def test_a_resume_over_another_number_of_sources_names_both_and_the_way_forward(tokenizer):
    rows = ConcatRows([rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)])
    state = BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[7, 3], names=["web", "code"]).state_dict()
    single = BatchLoader(rows_of(tokenizer, 30, 0), 160, 160, seed=3, pad_id=0, names=["books"])
    with pytest.raises(DataError) as refused:
        single.load_state_dict(state)
    assert "had 2 sources but the data now has 1 (web, code then, books now); resume with the same data.mix" in str(
        refused.value
    )
    assert "a new --out with --set train.init_from=RUN" in str(refused.value)


def test_a_small_source_with_a_large_weight_is_warned_of_by_its_own_epochs(tmp_path, tokenizer, caplog):
    """Weights 0.1 / 0.9 over a large source and a small one at train.epochs 1: the small one is drawn
    ~9x over, the large one ~0.1x; the warning counted epochs over both sources' tokens together (1) and
    said nothing. Now it names the source, its epochs and the weight to lower."""
    tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    big, small = corpus(tmp_path / "a", 0, 80), corpus(tmp_path / "d", 1, 8)
    mix = [{"source": str(big), "weight": 0.1, "name": "a"}, {"source": str(small), "weight": 0.9, "name": "d"}]
    data = {"mix": mix, "tokenizer": str(tmp_path / "tok" / "tokenizer.json"), "seq_len": 16, "eval_fraction": 0.0}
    cfg = debug_cfg(tmp_path / "r", data=data, train={"epochs": 1, "batch_tokens": 256, "micro_batch_tokens": 256})
    from trimtab.training.phase_data import build_phases

    with caplog.at_level(logging.WARNING, logger="trimtab"):
        [phase] = build_phases(cfg, None)[1]
    a, d = (part.n_tokens for part in phase.train_rows.parts)
    drawn = phase.steps * 256
    assert drawn * 0.9 / d > 4 > drawn * 0.1 / a  # d repeats past FRESH_EPOCHS; a is not even read once
    assert f"repeats mixture source 'd' (data.mix[1]) {drawn * 0.9 / d:.1f} times" in caplog.text
    assert "lower data.mix[1].weight" in caplog.text and "'a'" not in caplog.text


def test_a_sources_name_survives_moving_compressing_or_preparing_it_and_old_mixtures_still_load():
    """An unnamed source's metric names (val_loss/NAME, data/NAME/share) came from its whole last path
    component: web.jsonl, then web.jsonl.zst compressed, then web prepared. Now its stem, `web`, in
    each; unnamed sources whose stems clash keep their whole names, so a mixture that ran before loads."""
    for where in (
        "corpus/web.jsonl",
        "/moved/web.jsonl.zst",
        "prepared/web/",
        "data/web/*.jsonl",
        "s3://b/web.parquet",
    ):
        assert MixSource(where).label == "web", where
    mix = [{"source": "a/web.jsonl"}, {"source": "b/web/"}, {"source": "c/code.txt", "name": "py"}, {"source": "d.txt"}]
    assert load_config(preset="debug", overrides={"data": {"mix": mix}}).data.names == ["web.jsonl", "web", "py", "d"]


def test_a_resumed_mixture_keeps_the_names_its_run_trained_under(tmp_path, tokenizer, caplog):
    """A run an older trimtab started named its unnamed sources web.jsonl and code.jsonl (their whole
    last path component); resumed here they were web and code: data/web.jsonl/share went on as
    data/web/share, val_loss/web.jsonl as val_loss/web, each series split in two. The checkpoint's
    names are kept; a name the config gives is the person's and wins."""
    from trimtab.training.phase_data import build_phases
    from trimtab.training.source_names import saved_names

    tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    web, code = corpus(tmp_path / "web", 0, 40) / "part.jsonl", corpus(tmp_path / "code", 1, 40) / "part.jsonl"
    (web.parent / "web.jsonl").write_bytes(web.read_bytes())
    (code.parent / "code.jsonl").write_bytes(code.read_bytes())
    mix = [{"source": str(web.parent / "web.jsonl"), "weight": 0.7}, {"source": str(code.parent / "code.jsonl")}]
    data = {"mix": mix, "tokenizer": str(tmp_path / "tok" / "tokenizer.json"), "seq_len": 16}
    cfg = debug_cfg(tmp_path / "r", steps=4, data=data, train={"batch_tokens": 256, "micro_batch_tokens": 256})
    state = {"train": {"phase": 0}, "data": {"parts": [{"name": "web.jsonl"}, {"name": "code.jsonl"}]}}
    with caplog.at_level(logging.INFO, logger="trimtab"):
        [phase] = build_phases(cfg, None, None, saved_names(state))[1]
    assert phase.names == ["web.jsonl", "code.jsonl"] == [name for *_, name in phase.eval_rows.sets]
    loader = phase.loader(cfg, pad_id=0)
    loader.next_batch()
    assert set(loader.metrics()) == {f"data/{n}/{m}" for n in ("web.jsonl", "code.jsonl") for m in ("share", "epochs")}
    assert "keep the names this run trained under (web.jsonl, code.jsonl; their paths name them web, code" in (
        caplog.text
    )
    mix[1]["name"] = "py"  # the person's name wins; a fresh run (no checkpoint) takes the paths' stems
    named = debug_cfg(tmp_path / "r", steps=4, data=data, train={"batch_tokens": 256, "micro_batch_tokens": 256})
    assert build_phases(named, None, None, saved_names(state))[1][0].names == ["web.jsonl", "py"]
    assert build_phases(cfg, None)[1][0].names == ["web", "code"]
