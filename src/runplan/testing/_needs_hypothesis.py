"""Imported first by ``runplan.testing.strategies``: without Hypothesis, a clear
error saying what to install instead of a bare ``ModuleNotFoundError``."""

import importlib.util

if importlib.util.find_spec("hypothesis") is None:
    raise ImportError(
        "runplan.testing.strategies needs Hypothesis: pip install 'gguf-pipeline[testing]'",
        name="hypothesis",
    )
