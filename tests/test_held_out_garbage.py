"""The held-out rows of documents the data screen flagged (data.garbage_filter=warn) are not scored
where the orchestrator leaves their training rows out (mode auto), so val_loss measures the text
trained on; in advise and off mode they are trained on and stay scored (training/phase_data.py held_out)."""

import json
import math
from pathlib import Path

import pytest

import trimtab
from test_garbage_rows import crawl  # noqa: F401  (the module's fixture)
from test_quality import clean_documents
from trimtab.config import derive, load_config
from trimtab.data.held_out import eval_rows, screened_decisions
from trimtab.data.prepare import prepare
from trimtab.errors import DataError
from trimtab.evaluation import evaluate
from trimtab.evaluation.held_out import is_prepared
from trimtab.evaluation.perplexity import read_texts
from trimtab.training.phase_data import build_phases


def flagged(rows) -> set[int]:
    return {int(r) for found in rows.flagged_rows() for r in found.rows}


def config(crawl, mode: str = "auto", **data):  # noqa: F811
    path, _, _ = crawl
    data = {"source": str(path), "max_bytes": 0, "eval_fraction": 0.3, "seq_len": 64} | data
    overrides = {
        "data": data | {"tokenizer": str(path.with_name("tokenizer.json"))},
        "model": {"n_layers": 1},
        "train": {"eval_tokens": 10**6},
        "orchestrator": {"mode": mode},
    }
    return load_config(preset="debug", overrides=overrides)


def scored_sets(cfg, decided=None) -> list:
    """(rows, the indices val_loss scores, name) of each held-out set of the run's first phase."""
    _, phases = build_phases(cfg, None, decided)
    return phases[0].eval_rows.sets


def prepared_mix(crawl, tmp_path) -> tuple[Path, list[dict[str, str]]]:  # noqa: F811
    """The crawl prepared into shards (its flagged documents found there) and a data.mix of it beside a
    clean source: the prepared directory and the mix."""
    path, _, _ = crawl
    prepared = tmp_path / "prepared"
    prepare([str(path)], prepared, tokenizer=str(path.with_name("tokenizer.json")))
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"text": t}) + "\n" for t in clean_documents()))
    return prepared, [{"source": str(prepared), "name": "crawl"}, {"source": str(clean), "name": "clean"}]


def test_auto_scores_no_flagged_row_and_advise_scores_them(crawl):  # noqa: F811
    ((rows, scored, _),) = scored_sets(config(crawl))
    assert flagged(rows) and not flagged(rows) & set(scored)
    assert scored == [i for i in range(len(rows)) if i not in flagged(rows)]  # the rest, all within the budget
    ((rows, scored, _),) = scored_sets(config(crawl, mode="advise"))
    assert scored == list(range(len(rows))) and flagged(rows) <= set(scored)  # trained on: scored


def test_a_resume_keeps_the_checkpoints_held_out_split_under_another_mode(crawl):  # noqa: F811
    """The checkpoint's journal says whether the rows were left out (its loader keeps skipping them)."""
    decision = {"rule": "garbage", "evidence": {"phase": 0}, "applied": ["9 rows left out of training"]}
    state = {"hooks": {"Orchestrator": {"journal": [{"rule": "rows", "evidence": {}}, decision]}}}
    assert screened_decisions(state) == {0: True} and screened_decisions(None) == {}
    advised = {"hooks": {"Orchestrator": {"journal": [decision | {"applied": []}]}}}
    ((rows, auto, _),) = scored_sets(config(crawl))
    ((_, resumed, _),) = scored_sets(config(crawl, mode="advise"), screened_decisions(state))
    assert resumed == auto and len(auto) < len(rows)
    ((_, kept, _),) = scored_sets(config(crawl), screened_decisions(advised))  # advised then: trained on
    assert kept == list(range(len(rows)))


def test_a_prepared_mixture_leaves_out_only_the_flagged_sources_rows(crawl, tmp_path):  # noqa: F811
    _, mix = prepared_mix(crawl, tmp_path)
    (crawl_rows, crawl_scored, _), (clean_rows, clean_scored, _) = scored_sets(config(crawl, source="builtin", mix=mix))
    assert flagged(crawl_rows) and not flagged(crawl_rows) & set(crawl_scored)
    # the clean source's val rows do not move
    assert not flagged(clean_rows) and clean_scored == eval_rows(clean_rows, 10**6 // 2)


def test_eval_refuses_a_directory_that_is_not_prepared_naming_what_one_holds(tmp_path):
    (tmp_path / "notes.txt").write_text("text")
    assert not is_prepared(tmp_path)
    with pytest.raises(DataError, match="is a directory; pass one file.*trimtab data prepare.*trimtab-data.json"):
        read_texts(tmp_path)


@pytest.mark.slow  # a run to compare with (~8 s on a busy CPU): the trainer's own val_loss is the reference
def test_eval_scores_the_runs_held_out_per_source_and_a_prepared_directory(crawl, tmp_path):  # noqa: F811
    """`trimtab eval RUN --held-out` gives the run's last val_loss and val_loss/NAME; `--data PREPARED_DIR`
    its held-out split's (the source's val_loss/NAME, the run scoring all of it), flagged rows left out."""
    prepared, mix = prepared_mix(crawl, tmp_path)
    cfg = config(crawl, source="builtin", mix=mix)
    cfg = load_config(
        preset="debug",
        overrides={
            **{k: v for k, v in cfg.to_dict().items() if k in ("data", "model")},
            "out": str(tmp_path / "run"),
            "train": {"max_steps": 2, "eval_every": 0, "batch_tokens": 1024, "eval_tokens": 10**6, "precision": "fp32"},
            "log": {"progress": False, "tensorboard": False, "report": False},
        },
    )
    trimtab.train(cfg)
    last = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in last if "val_loss" in r][-1]
    results = evaluate(cfg.run_dir, held_out=True, data=str(prepared))
    ours, split = results["held_out"], results["prepared"]
    assert {"val_loss/crawl", "val_loss/clean"} <= set(ours)
    assert all(abs(ours[k] - val[k]) < 1e-4 for k in ("val_loss", "val_loss/crawl", "val_loss/clean"))
    assert split["flagged_rows_left_out"] > 0 and abs(split["val_loss"] - val["val_loss/crawl"]) < 1e-4
    assert evaluate(cfg.run_dir, data=str(prepared), split="all")["prepared"]["rows"] > split["rows"]


def test_the_orchestrators_row_reference_samples_no_flagged_row_where_val_loss_scores_none(crawl):  # noqa: F811
    """The data watch's reference (HeldOut.reference) is a sample of its own over the held-out split: it
    held the flagged documents' rows that val_loss leaves out in auto mode, scoring the text against
    base64 and noise."""
    held = build_phases(config(crawl), None)[1][0].eval_rows
    ((rows, scored, _),) = held.sets
    everything = {r for m in held.reference(len(rows)) for r in m.rows}
    assert flagged(rows) and everything == set(scored)  # before: every row of the split, the flagged too
    assert not flagged(rows) & {r for m in held.reference(8) for r in m.rows}


def test_train_epochs_and_the_repeat_warning_count_the_rows_trained_on_not_the_flagged_ones_left_out(crawl):  # noqa: F811
    """In auto mode the flagged documents' training rows are left out from the start (here 9% of the
    tokens): train.epochs counted them, so 4 epochs trained the rest 4.4 times over, unwarned."""
    cfg = derive(config(crawl), {"train": {"epochs": 2}})
    (phase,) = build_phases(cfg, None)[1]
    rows = phase.train_rows
    trained = rows.n_tokens - sum(rows.length(r) for r in flagged(rows))
    assert trained < 0.95 * rows.n_tokens
    assert phase.steps == math.ceil(2 * trained / cfg.train.batch_tokens)  # before: 2 x all the rows' tokens
