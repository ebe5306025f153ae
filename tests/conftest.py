"""Suite-wide: the token cache goes to a temporary folder, never the user's ~/.cache."""
import pytest


@pytest.fixture(scope="session", autouse=True)
def own_token_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_CACHE_DIR", str(tmp_path_factory.mktemp("fedsilo-cache")))
        yield
