"""Suite-wide settings.

- The token cache goes to a temporary folder, never the user's ~/.cache.
- `engine.workers = "auto"` means one worker: many tests inject failures or count calls by
  monkeypatching client-side code in this process, which forked workers would not see.
  tests/test_workers.py sets `engine.workers` explicitly to test the parallel engine.
"""
import pytest


@pytest.fixture(scope="session", autouse=True)
def own_token_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_CACHE_DIR", str(tmp_path_factory.mktemp("fedsilo-cache")))
        mp.setattr("fedsilo.engines.workers.MAX_AUTO_CPU_WORKERS", 1)
        yield
