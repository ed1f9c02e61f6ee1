from __future__ import annotations

import os
import sys
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


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from runplan.models import ModelNotFound, resolve_model

    try:
        return resolve_model("smollm2-135m")
    except ModelNotFound as exc:
        pytest.fail(f"the bundled test model is missing: {exc}")
