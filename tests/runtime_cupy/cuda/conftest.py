"""The CUDA worker's tests: the ASan run of the kernels' tests starts as soon as the
session has collected ``test_simt_asan.py`` (``tests/support/simt/asan_run.py``: a
process of its own, its environment the session's before any test set its own), so
that it compiles and runs beside the other tests; it is ended with the session."""

from __future__ import annotations

import pytest

from tests.support.simt import asan_run


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_simt_asan.py" for item in session.items):
        asan_run.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    asan_run.stop()
