import pytest


@pytest.fixture(autouse=True, scope="session")
def _shared_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session, never the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRIMTAB_CACHE", str(tmp_path_factory.mktemp("trimtab-cache")))
    yield
    mp.undo()
