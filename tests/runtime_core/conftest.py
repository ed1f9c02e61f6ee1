from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime_core.chain import Chain, provisions


@pytest.fixture(scope="session")
def smollm2_chain(smollm2_path: str) -> Iterator[Chain]:
    """SmolLM2 in one stage (first and last), greedy, returning logits."""
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=96))
    yield chain
    chain.release()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where regenerated fixture models are written (once per session)."""
    return tmp_path_factory.mktemp("models")
