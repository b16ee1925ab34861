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
