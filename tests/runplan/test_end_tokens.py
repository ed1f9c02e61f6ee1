"""The ids that end generation (``runplan.end_tokens``), where the file's keys and the
token texts disagree. (Every tokenizer fixture's set is llama.cpp's recorded one:
``tests/runtime_core/test_tokenizer_llamacpp.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from runplan.end_tokens import end_of_generation_ids
from runplan.gguf_header import GgufHeader
from tests.fixtures.gguf_models import ModelShape, write_model

TOKENS = ["a", "<|fim_repo|>", "</s>", "<|fim_pad|>"]
IDS = {text: i for i, text in enumerate(TOKENS)}


def _header(tmp_path: Path, **keys: int) -> GgufHeader:
    return GgufHeader.read(str(write_model(tmp_path / "m.gguf", ModelShape(), extra_keys=keys)))


@pytest.mark.parametrize("named", [4, 10**6])
def test_a_fim_id_outside_the_vocabulary_is_found_by_its_text(tmp_path: Path, named: int) -> None:
    """llama.cpp warns of a fill-in-the-middle id outside the vocabulary, drops it, and
    finds the token by its text, as for a key the file lacks: ``<|fim_repo|>`` ends
    generation (it was left out)."""
    header = _header(tmp_path, **{"tokenizer.ggml.fim_rep_token_id": named})
    assert end_of_generation_ids(header, TOKENS, IDS, 2) == {1, 2, 3}


def test_a_fim_id_in_the_vocabulary_is_taken_over_the_text(tmp_path: Path) -> None:
    header = _header(tmp_path, **{"tokenizer.ggml.fim_rep_token_id": 0})
    assert end_of_generation_ids(header, TOKENS, IDS, 2) == {0, 2, 3}
