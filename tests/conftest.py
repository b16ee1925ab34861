import gc
import json
import os
from pathlib import Path

import pytest
import torch

# `pytest` runs on two pytest-xdist workers (pyproject's addopts). Each takes one torch thread, and
# so do the runs it starts: two threads slow 3-10x when the other core is busy.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
# Tests that start process groups (torchrun, 2 ranks each) share one worker: two at once would put
# four processes on two cores, and the one-process references they compare with (the session's
# `reference` fixture) are computed once instead of once per worker.
PROCESS_GROUPS = {
    "test_distributed.py",
    "test_tensor_parallel.py",
    "test_pipeline_parallel.py",
    "test_expert_parallel.py",
    "test_resilience.py",
    "test_async_checkpoint.py",
    "test_ft.py",
}
# Modules whose tests share a module-scoped fixture that trains: on one worker it is computed once
# (the golden runs: three trainings a preset), split over two it is computed on each.
SHARED_RUNS = {
    "test_golden.py",
    "test_eval.py",
    "test_data.py",
    "test_hf.py",
    "test_merge.py",
    "test_merge_moe.py",
    "test_orchestrator_loop.py",
    "test_quality.py",
    "test_report.py",
    "test_rl_train.py",
}

# The quick tier (`pytest --quick`, the edit loop): the cheapest tests by their measured time in
# DURATIONS, added until QUICK_BUDGET_S is spent, plus tests not measured yet (new ones: most likely
# the ones being written). `pytest --store-durations` measures them again (on a quiet machine, all
# tests: CI's tier) and drops the entries of tests since deleted or renamed (still_a_test). The full
# tier, `pytest`, is what CI runs.
DURATIONS = Path(__file__).with_name("durations.json")
QUICK_BUDGET_S = 65.0  # test time; with collection and start-up the tier stays under 2 minutes


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="the quick tier: the cheapest tests by tests/durations.json")
    parser.addoption("--store-durations", action="store_true", help="write the tests' times to tests/durations.json")


@pytest.hookimpl(tryfirst=True)  # before xdist's own (--dist loadgroup reads the xdist_group marks there)
def pytest_collection_modifyitems(config, items):
    for item in items:
        # a test that mostly waits (keep-alive beats, a frozen rank's timeout) runs beside the
        # others: its few processes barely use the cores while it waits
        waits = item.get_closest_marker("mostly_waits")
        if item.path.name in PROCESS_GROUPS and not waits:
            item.add_marker(pytest.mark.xdist_group("process_groups"))
        elif waits:  # one worker for a module's: they may share a fixture (test_resilience's `elastic`)
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}-waits"))
        elif item.path.name in SHARED_RUNS:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    if not config.getoption("--quick"):
        return
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    spent, keep = 0.0, set()
    # never a test that mostly waits (timeouts, beats): its measured time may be another's, whose
    # shared fixture it found made (test_resilience's `elastic`)
    quick = [i for i in items if i.nodeid in known and not i.get_closest_marker("mostly_waits")]
    for item in sorted(quick, key=lambda i: known[i.nodeid]):
        spent += known[item.nodeid]
        if spent > QUICK_BUDGET_S:
            break
        keep.add(item.nodeid)
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in known and i.nodeid not in keep])
    items[:] = [i for i in items if i.nodeid in keep or i.nodeid not in known]


_times: dict[str, float] = {}


def pytest_collection_finish(session):
    """What the worker has imported by now (torch, transformers, every test module) lives as long
    as it does: frozen out of the collector's sight (gc.freeze), and the collector run less often
    (a test's allocations, 18k Problem records in an RL setup, each set off collections of a large
    heap). The quick tier's two workers spent 6.6 + 4.1 s collecting (43 full collections of
    ~0.25 s); frozen alone, 3.5 + 5.1 s (freezing resets the count a full collection waits for:
    70 cheaper ones); with these thresholds, 2.9 + 3.1 s (2026-11-29)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def _plain(nodeid: str) -> str:
    """A node id without the "@group" xdist's loadgroup adds on the workers (the controller, which
    picks the quick tier, knows the plain one)."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group and "::" not in group else nodeid


def pytest_runtest_logreport(report):
    key = _plain(report.nodeid)
    _times[key] = _times.get(key, 0.0) + report.duration  # setup + call + teardown


def pytest_sessionfinish(session):
    if not session.config.getoption("--store-durations") or hasattr(session.config, "workerinput"):
        return  # under xdist the controller gets every worker's reports and writes once
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    known.update({k: round(v, 3) for k, v in _times.items()})
    kept = {k: v for k, v in known.items() if still_a_test(k, session.config.rootpath)}
    DURATIONS.write_text(json.dumps(dict(sorted(kept.items())), indent=0) + "\n")


def still_a_test(nodeid: str, root: Path) -> bool:
    """Whether a durations.json entry's test still exists (its file, and a function of its name in it): a
    store merges this session's times into the file's, so a test deleted or renamed kept its entry for good."""
    file, _, name = nodeid.partition("::")
    path = root / file
    return path.is_file() and f"def {name.rsplit('::', 1)[-1].split('[')[0]}(" in path.read_text()


@pytest.fixture(autouse=True, scope="session")
def _shared_cache(tmp_path_factory):
    """One cache (tokenizers, tokens, the CPU's measured peak and bf16 timings) for the whole
    session, never the user's ~/.cache: under xdist one for both workers (their basetemps' common
    folder), so each is built or measured once (its writes are atomic renames, as for two runs
    of a user's sharing ~/.cache/trimtab)."""
    mp = pytest.MonkeyPatch()
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "trimtab-cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "trimtab-cache"
    shared.mkdir(exist_ok=True)
    mp.setenv("TRIMTAB_CACHE", str(shared))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _no_report(request, monkeypatch):
    """The end-of-run report, only where it is looked at (helpers.REPORTED; `trimtab` commands the
    fork server runs: helpers.trimtab_cli)."""
    from helpers import REPORTED

    if request.path.name not in REPORTED:
        from trimtab.training.hooks import ReportWriter

        monkeypatch.setattr(ReportWriter, "on_train_end", lambda self, run, summary: None)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tiny models: a second intra-op thread only adds sync cost
    (3-10x when the other core is busy), and bitwise comparisons want one fixed reduction order.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    """A 300-token byte-level BPE of trimtab's kind, trained on a few lines of code."""
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import TextTokenizer, _train_bpe

    docs = [Document([(f"def f{i}(x):\n    return x * {i}\n", True)]) for i in range(200)]
    return TextTokenizer(_train_bpe(docs, 300))


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory):
    """helpers.base_run once a worker: a 2-step debug run through the CLI (a tokenizer and weights to
    start RL or DPO from), read only (copy it to change it). Seven modules made their own: ~2 s of
    CPU each."""
    from helpers import base_run

    return base_run(tmp_path_factory.mktemp("debug_run") / "run")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(**overrides)`: the one-process run (tests/helpers.py) the multi-process tests
    compare with, as (run dir, record); one run per distinct config for the whole session, so
    its checkpoints are only to be read."""
    from helpers import run

    runs: dict[str, tuple] = {}

    def get(**overrides):
        key = json.dumps(overrides, sort_keys=True)
        if key not in runs:
            out = tmp_path_factory.mktemp("reference") / "run"
            runs[key] = (out, run(out, 1, **overrides)[0])
        return runs[key]

    return get


@pytest.fixture(scope="session")
def single(reference):
    """The default config's one-process reference run."""
    return reference()


@pytest.fixture(scope="session")
def ddp(tmp_path_factory):
    """The default config under torchrun, 2 processes (DDP), undisturbed: (run dir, records)."""
    from helpers import run

    out = tmp_path_factory.mktemp("ddp") / "run"
    return out, run(out, 2)


@pytest.fixture(scope="session")
def fsdp(tmp_path_factory):
    """The default config sharded by FSDP2 over 2 processes, undisturbed: (run dir, records)."""
    from helpers import run

    out = tmp_path_factory.mktemp("fsdp") / "run"
    return out, run(out, 2, distributed={"strategy": "fsdp"})
