"""trimtab eval: perplexity / bits per byte of a file, and lm-evaluation-harness through the
trimtab adapter, checked against hand computation and against lm-eval's own `hf` backend."""

import json
import logging
import math
import subprocess
import sys
import warnings

import pytest
import torch

from trimtab import api
from trimtab.cli import main
from trimtab.errors import ConfigError, DataError
from trimtab.evaluation import evaluate, score_text
from trimtab.evaluation.scoring import rolling_windows
from trimtab.hf import export_run

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000, "seq_len": 64}}
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 6


@pytest.fixture(scope="module", params=["debug", "debug-mod"])
def run(request, tmp_path_factory):
    """A 3-step run of a dense and of a Mixture-of-Depths preset, context 64."""
    out = tmp_path_factory.mktemp("eval") / request.param
    train = {"max_steps": 3, "eval_every": 0}
    api.train(preset=request.param, out=str(out), train=train, model={"max_seq_len": 64}, **FAST)
    return out


def by_hand(model, ids, start):
    """-sum log p(ids[j] | start, ids[:j]) from one forward (the text fits the context)."""
    if not ids:
        return 0.0
    seq = torch.tensor([[start, *ids]])
    with torch.no_grad():
        logp = model(seq)[0, :-1].log_softmax(-1)
    return -logp.gather(-1, seq[0, 1:, None]).sum().item()


def test_rolling_windows_score_every_token_once_within_the_context():
    for n, limit, stride in [(1, 8, 8), (7, 8, 8), (8, 8, 8), (30, 8, 8), (30, 8, 3), (30, 8, 1), (100, 16, 5)]:
        ids = list(range(100, 100 + n))
        pairs = rolling_windows(ids, 0, limit, stride)
        assert [t for _, cont in pairs for t in cont] == ids
        assert all(len(ctx) + len(cont) - 1 <= limit and ctx for ctx, cont in pairs)
        seq = [0, *ids]
        for ctx, cont in pairs:  # each pair is a contiguous stretch of the sequence
            start = seq.index(ctx[0]) if ctx[0] != 0 else 0
            assert seq[start : start + len(ctx) + len(cont)] == ctx + cont


def test_perplexity_and_bits_per_byte_equal_the_hand_computed_values(run):
    _, model, tok = api.load_run(run)
    short = TEXT[:60]
    ids = tok.encode(short)
    assert len(ids) < model.cfg.max_seq_len
    got = score_text(model, tok, short)
    nll = by_hand(model, ids, tok.eos_id)
    assert got["nll_per_token"] * got["tokens"] == pytest.approx(nll, rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nll / (math.log(2) * len(short.encode())), rel=1e-5)
    long = score_text(model, tok, TEXT)  # several windows; a shorter stride gives more context
    assert long["tokens"] > 2 * model.cfg.max_seq_len
    assert score_text(model, tok, TEXT, stride=16)["tokens"] == long["tokens"]


def test_bad_data_files_are_refused_naming_the_file(run, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG\x00\x01\xff")
    for name, message in [("missing.txt", "does not exist"), ("empty.txt", "is empty"), ("blob.bin", "not UTF-8")]:
        with pytest.raises(DataError, match=f"{name}.*{message}"):
            evaluate(run, data=str(tmp_path / name))
    with pytest.raises(ConfigError, match="needs --tasks and/or --data"):
        evaluate(run)


lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional [eval] extra")


def instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [("def add(a, b):\n    return a", " + b"), ("class Point:\n", "    x: int = 0"), ("", "import os")]


def test_adapter_loglikelihoods_equal_the_hand_computed_ones(run):
    from trimtab.evaluation.adapter import TrimtabLM

    _, model, tok = api.load_run(run)
    lm = TrimtabLM(model, tok, batch_size=2)
    scores = lm.loglikelihood(instances("loglikelihood", PAIRS))
    for (context, continuation), (score, _) in zip(PAIRS, scores):
        stripped = context.rstrip()  # lm-eval moves a context's trailing spaces to the continuation
        context, continuation = stripped, context[len(stripped) :] + continuation
        whole = tok.encode(context + continuation)
        n_ctx = len(tok.encode(context)) if context else 0
        start, ids = (whole[0], whole[1:]) if n_ctx else (tok.eos_id, whole)
        prefix = by_hand(model, ids[: n_ctx - 1], start) if n_ctx > 1 else 0.0
        assert -score == pytest.approx(by_hand(model, ids, start) - prefix, rel=1e-4)
    [rolling] = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(TEXT,)]))
    data = score_text(model, tok, TEXT)
    assert -rolling == pytest.approx(data["nll_per_token"] * data["tokens"], rel=1e-5)
    [text] = lm.generate_until(instances("generate_until", [("def f(x):\n", {"until": ["\n"], "max_gen_toks": 12})]))
    assert "\n" not in text


def merging_split(tok, text):
    """(context, continuation) cut from `text` whose continuation adds no token: the pair tokenizes
    to no more tokens than the context alone (its first character merges into the context's last)."""
    for end in range(2, len(text) + 1):
        for cut in range(1, end):
            context, continuation = text[:cut], text[cut:end]
            if context.strip() == context and len(tok.encode(context + continuation)) <= len(tok.encode(context)):
                return context, continuation
    raise AssertionError("no merging split in the text")


def test_a_continuation_that_adds_no_token_is_refused_not_scored_as_a_sure_win(run):
    from trimtab.evaluation.adapter import TrimtabLM

    _, model, tok = api.load_run(run)
    lm = TrimtabLM(model, tok, batch_size=2)
    context, continuation = merging_split(tok, TEXT)
    with pytest.raises(DataError, match=f"continuation {continuation!r} adds no token.*target_delimiter"):
        lm.loglikelihood(instances("loglikelihood", [PAIRS[0], (context, continuation)]))
    with pytest.raises(DataError, match="the continuation is empty"):
        lm.loglikelihood(instances("loglikelihood", [("def f(x):", "")]))


def test_adapter_equals_lm_evals_hf_backend_on_the_exported_directory(run, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from trimtab.evaluation.adapter import TrimtabLM

    out = export_run(run, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = HFLM(pretrained=str(out), batch_size=2, device="cpu", trust_remote_code=True)
    ours = TrimtabLM(*api.load_run(run)[1:], batch_size=2)
    requests = instances("loglikelihood", PAIRS)
    for (a, ga), (b, gb) in zip(ours.loglikelihood(requests), theirs.loglikelihood(requests)):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    rolling = instances("loglikelihood_rolling", [(TEXT,)])
    assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(theirs.loglikelihood_rolling(rolling)[0], abs=1e-3)


def test_trimtab_eval_runs_the_shipped_tasks_and_records_them(run, capsys, tmp_path, monkeypatch):
    import torch.utils.collect_env

    data = tmp_path / "notes.txt"
    data.write_text(TEXT)
    tasks = "trimtab_tiny,trimtab_tiny_gen,trimtab_tiny_ppl"
    collected = []  # lm-eval's environment report, which trimtab does not keep: not collected (2 s)
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: collected.append(1) or "")
    assert main(["eval", str(run), "--tasks", tasks, "--data", str(data), "--limit", "4"]) == 0
    assert collected == []
    printed, err = capsys.readouterr()
    assert "trimtab_tiny (4 examples): acc " in printed and "bits per byte" in printed
    assert "sample_len" not in printed  # a count, once printed among the scores as "sample_len 4.0000"
    # no progress bar off a terminal (lm-eval's per task, the adapter's generating): a log's line each redraw
    assert "it/s" not in err and "%|" not in err, err[-2000:]
    [record] = (run / "eval").glob("*.json")
    results = json.loads(record.read_text())
    assert set(results["tasks"]) == set(tasks.split(",")) and results["step"] == 3
    assert 0 <= results["tasks"]["trimtab_tiny"]["acc"] <= 1
    assert results["tasks"]["trimtab_tiny_ppl"]["bits_per_byte"] > 0
    assert json.loads((run / "summary.json").read_text())["eval"] == results
    record.unlink()


def test_an_unknown_task_is_refused_at_once_naming_the_flag_and_the_known_tasks(tmp_path, capsys, monkeypatch):
    """A name no task YAML mentions (trimtab's, --include-path's, lm-eval's: their text searched)
    is refused before lm-eval's registry is indexed (~15 s) and before any model loads."""
    import time

    import lm_eval.tasks

    from trimtab.evaluation import harness

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached for an unknown task")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", never)
    monkeypatch.setattr(harness, "load_run_at", never)
    monkeypatch.setattr(harness, "local_run", never)
    start = time.perf_counter()
    assert main(["eval", str(tmp_path), "--tasks", "trimtab_tiny,no_such_task"]) == 2
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert "--tasks: unknown task 'no_such_task'" in err
    assert "trimtab's own are trimtab_tiny, trimtab_tiny_gen, trimtab_tiny_ppl" in err
    assert harness.own_tasks() == ["trimtab_tiny", "trimtab_tiny_gen", "trimtab_tiny_ppl"]


def test_trimtab_eval_prints_no_lm_eval_info_lines_and_LMEVAL_LOG_LEVEL_brings_them_back(
    run, tmp_path, monkeypatch, caplog, capfd
):
    """lm-eval logs ~20 INFO lines a run (seeds, task list, "Building contexts"...) and, outside a
    git repository, git's error: all noise to a trimtab user. Its warnings are kept."""

    monkeypatch.chdir(tmp_path)  # not a git repository
    caplog.set_level(logging.INFO)  # the CLI's own level: whatever lm-eval sends at INFO would show
    assert main(["eval", str(run), "--tasks", "trimtab_tiny", "--limit", "2"]) == 0
    lm_eval_records = [r for r in caplog.records if r.name.split(".")[0] in ("lm_eval", "lm-eval")]
    assert not [r.getMessage() for r in lm_eval_records if r.levelno < logging.WARNING]
    assert not [r for r in lm_eval_records if "--metadata" in r.getMessage()]  # lm-eval's CLI advice
    out, err = capfd.readouterr()
    assert "trimtab_tiny (2 examples): " in out and "not a git repository" not in err
    assert logging.getLogger("lm_eval").level == logging.NOTSET  # restored after the run
    logging.getLogger("lm_eval").warning("a warning that matters")
    assert caplog.records[-1].getMessage() == "a warning that matters"
    caplog.clear()
    monkeypatch.setenv("LMEVAL_LOG_LEVEL", "INFO")
    assert main(["eval", str(run), "--tasks", "trimtab_tiny", "--limit", "2"]) == 0
    assert any(r.levelno == logging.INFO and r.name.split(".")[0] in ("lm_eval", "lm-eval") for r in caplog.records)
    for record in (run / "eval").glob("*.json"):
        record.unlink()


def test_a_metric_that_several_filters_score_keeps_each_filters_number():
    """gsm8k scores exact_match under two filters; cut to one name, the last one's number replaced
    the other's and the record did not say which filter it was."""
    from trimtab.evaluation.harness import _clean

    gsm8k = {
        "alias": "gsm8k",
        "exact_match,strict-match": 0.25,
        "exact_match_stderr,strict-match": 0.1,
        "exact_match,flexible-extract": 0.5,
        "exact_match_stderr,flexible-extract": 0.1,
        "sample_len,none": 8,
    }
    # sample_len is a count of examples: kept apart as `samples`, printed as "(8 examples)", never as a score
    assert _clean(gsm8k) == {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.5, "samples": 8}
    assert _clean({"acc,none": 0.5, "acc_norm,none": 0.75, "acc_stderr,none": 0.1}) == {"acc": 0.5, "acc_norm": 0.75}


def test_scores_are_printed_when_the_model_directory_cannot_be_written(run, tmp_path, capsys, monkeypatch):
    """A read-only model directory (a mounted model, a full disk): an OSError traceback after the
    whole evaluation, its scores lost; now they are printed and the missing record said."""
    from trimtab.evaluation import harness

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(harness, "write_json", read_only)
    data = tmp_path / "notes.txt"
    data.write_text(TEXT)
    assert main(["eval", str(run), "--data", str(data)]) == 0
    printed = capsys.readouterr()
    assert "bits per byte" in printed.out and "results not recorded" in printed.out
    assert "Permission denied" in printed.out and not list((run / "eval").glob("*.json"))


def test_two_evaluations_in_one_second_keep_both_records_in_order(tmp_path, monkeypatch):
    """Records were named by the second: the second evaluation's overwrote the first's."""
    from trimtab.evaluation import harness

    for n in range(3):
        assert harness._record(tmp_path, {"time": "2026-01-02T03:04:05", "n": n}) is None
    records = sorted((tmp_path / "eval").glob("*.json"))
    assert [r.name for r in records] == [
        "2026-01-02T030405.json",
        "2026-01-02T030405_2.json",
        "2026-01-02T030405_3.json",
    ]
    assert [json.loads(r.read_text())["n"] for r in records] == [0, 1, 2]

    def full_disk(path, *args, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(harness, "write_json", full_disk)
    assert "No space left" in harness._record(tmp_path, {"time": "2026-01-02T03:04:05", "n": 3})
    assert sorted((tmp_path / "eval").glob("*.json")) == records  # no empty record left behind


def test_trimtab_eval_takes_set_items_over_the_runs_config_and_records_them(run, tmp_path, capsys):
    """`trimtab eval RUN --set model.max_seq_len=128` scores in 128-token windows (the run trained at 64;
    before: argparse refused --set) and the record says what was changed; a bad key is named."""
    data = tmp_path / "notes.txt"
    data.write_text(TEXT)
    assert main(["eval", str(run), "--data", str(data), "--set", "model.max_seq_len=128"]) == 0
    assert "(context 128, stride 128)" in capsys.readouterr().out
    record = json.loads(max((run / "eval").glob("*.json")).read_text())
    assert record["sets"] == ["model.max_seq_len=128"] and record["data"]["context"] == 128
    assert main(["eval", str(run), "--data", str(data), "--set", "model.nope=1"]) == 2
    assert "model.nope" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text("{}")  # a Hugging Face directory: its config.json is the model's
    with pytest.raises(ConfigError, match="--set model.max_seq_len=128: .* Hugging Face model directory"):
        api.load_run_at(tmp_path / "hf", ["model.max_seq_len=128"])


def test_a_library_with_its_own_console_handler_prints_each_line_once():
    """huggingface_hub and datasets add a handler of their own when imported and propagate to the root's: `trimtab
    eval --tasks hellaswag` offline printed each of the hub's retries twice, plain and as "trimtab: ..."."""
    # a process of its own: the logging of a fresh CLI, which pytest's capture handlers would change
    script = (
        "import logging; from trimtab.cli import main; main(['presets']); "
        "from huggingface_hub.utils import logging as hub; "  # its handler, added at its first logger's
        "hub.get_logger('huggingface_hub.file_download').warning('Retrying in 1s [Retry 1/5].')"
    )
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert err.count("Retrying in 1s") == 1, err
