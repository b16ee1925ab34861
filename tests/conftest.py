import json

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _shared_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session, never the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRIMTAB_CACHE", str(tmp_path_factory.mktemp("trimtab-cache")))
    yield
    mp.undo()


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
