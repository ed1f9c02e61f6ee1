from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for ``tests.fixtures`` and ``tests.support``

# The clause suite's fixture (runplan_planner), also under PYTEST_DISABLE_PLUGIN_AUTOLOAD;
# the entry point has this very name, so pytest registers it once either way.
pytest_plugins = ["runplan.testing.plugin"]

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a shell gives a foreground program: SIGINT neither ignored nor blocked
    in this process, so in every process it starts. A test run started as a
    non-interactive shell's background job (``make test &`` in a script, ``nohup``
    under some shells) inherits SIGINT ignored, Python then keeps it ignored, and each
    command a test starts inherits that: the tests that send Ctrl-C (the commands'
    ``Cancelled`` object and exit 130) would see it have no effect."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture(scope="session", autouse=True)
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The slice cache of every process the tests start (runtime_cupy.slices.cache):
    a folder of this session's, never the user's ~/.cache. Under /tmp, so that each
    network-namespace test host (its own /tmp) has a cache of its own."""
    folder = tmp_path_factory.mktemp("slice-cache")
    before = os.environ.get("GGUF_PIPELINE_CACHE")
    os.environ["GGUF_PIPELINE_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("GGUF_PIPELINE_CACHE", None)
    else:
        os.environ["GGUF_PIPELINE_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from runplan.models import ModelNotFound, resolve_model

    try:
        return resolve_model("smollm2-135m")
    except ModelNotFound as exc:
        pytest.fail(f"the bundled test model is missing: {exc}")
