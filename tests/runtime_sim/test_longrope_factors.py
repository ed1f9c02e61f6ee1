"""LongRoPE's factors are the model's choice, as llama.cpp's at its default context (the
trained one): the long ones where the model's context length passes its original one,
whatever a run's prompt and ``max_tokens``. They were picked by the run's cache length,
so a run's tokens changed with its ``max_tokens`` and disagreed with llama.cpp's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_sim import generate
from tests.fixtures.llamacpp_fixtures import load_doc, model_file

PROMPT = [5, 77, 30, 12, 9, 100, 101, 7, 8, 40]


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return load_doc("tiny")


@pytest.fixture(scope="module")
def entry(doc: dict[str, Any]) -> dict[str, Any]:
    models: list[dict[str, Any]] = doc["models"]
    (found,) = [m for m in models if m["name"] == "tiny-phi3-longrope-F32"]
    return found


@pytest.fixture(scope="module")
def longrope(entry: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """phi3 with both factor tensors, an original context of 32 and a context of 256:
    the model llama.cpp's fixture ran."""
    return model_file(entry, tmp_path_factory.mktemp("longrope"))


@pytest.mark.parametrize("worker", ["cpu", "numpy"])
def test_a_runs_logits_do_not_depend_on_its_max_tokens(longrope: Path, worker: str) -> None:
    # 10 + 4 positions are within the original context, 10 + 40 past it
    short = generate(longrope, PROMPT, max_tokens=4, worker=worker, return_logits=True)
    long = generate(longrope, PROMPT, max_tokens=40, worker=worker, return_logits=True)
    assert short.logits is not None and long.logits is not None
    assert short.tokens == long.tokens[:4]
    for a, b in zip(short.logits, long.logits[:4], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("worker", ["cpu", "numpy"])
def test_the_long_factors_give_llama_cpps_tokens_at_any_max_tokens(
    doc: dict[str, Any], entry: dict[str, Any], longrope: Path, worker: str
) -> None:
    # llama.cpp ran it at its trained context, 256 (the long factors); this run's 16 + 16
    # positions do not pass the original 32
    assert len(doc["prompt"]) + doc["greedy_tokens"] == 32
    run = generate(longrope, doc["prompt"], max_tokens=doc["greedy_tokens"], worker=worker)
    assert list(run.tokens) == entry["greedy"]
