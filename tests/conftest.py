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
def single(tmp_path_factory):
    """The one-process reference run the multi-process tests compare with (tests/helpers.py);
    its checkpoints are only read, so one run serves them all."""
    from helpers import run

    out = tmp_path_factory.mktemp("single") / "run"
    return out, run(out, 1)[0]
