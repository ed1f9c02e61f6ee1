"""Architectures whose query and attention output llama.cpp sizes by
``embedding_length`` (``ArchSpec.hidden_wide_attention``: qwen2, qwen2moe, phi3): a file
whose heads are another width (``head_count * key_length`` other than
``embedding_length``; value heads are as wide as key heads: ``test_value_heads``) is
refused before any process, naming the head size's key, as llama.cpp refuses it
("tensor 'blk.0.attn_q.weight' has wrong shape; expected 64, 64, got 64, 96"). Before,
such a file planned and ran here, its attention as wide as its tensors. The
architectures that size them by the heads (llama, qwen3, gemma3) take such a file, as
llama.cpp does. (Checked against llama-cpp-python 0.3.36.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from runplan import model_facts_from_gguf
from runplan.config import WorkerCapabilities
from runtime_core.architectures import ARCHITECTURES
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import check_whole_model
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model

#: 6 heads of 16 in a 64-wide model: queries 96 wide
WIDER = {"heads": 6, "heads_kv": 2, "key_length": 16}
#: 3 heads of 64 // 3 = 21: queries 63 wide, no head size key
NARROWER = {"heads": 3, "heads_kv": 3}

#: (architecture, shape changes, write_model's other arguments, the key named)
REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("qwen2", WIDER, {}, "qwen2.attention.key_length"),
    ("phi3", WIDER, {}, "phi3.attention.key_length"),
    ("qwen2moe", WIDER, {}, "qwen2moe.attention.key_length"),
    ("qwen2", NARROWER, {}, "qwen2.attention.head_count"),
    ("phi3", NARROWER, {}, "phi3.attention.head_count"),
]
#: The same widths where llama.cpp sizes the attention by the heads: run there and here.
TAKEN = [("llama", WIDER), ("qwen3", WIDER), ("gemma3", WIDER)]


def shape(arch: str, changes: dict[str, Any]) -> ModelShape:
    base = FIXTURE_SHAPES[arch] if arch == "qwen2moe" else ModelShape(arch=arch)
    return attrs.evolve(base, **changes)


def check(path: Path) -> None:
    facts = model_facts_from_gguf(path)
    check_whole_model(path, facts.num_layers, WorkerCapabilities())


@pytest.mark.parametrize(("arch", "changes", "kwargs", "key"), REFUSED)
def test_heads_of_another_width_than_the_embedding_are_refused_naming_the_key(
    tmp_path: Path, arch: str, changes: dict[str, Any], kwargs: dict[str, Any], key: str
) -> None:
    assert ARCHITECTURES[arch].hidden_wide_attention
    path = write_model(tmp_path / "m.gguf", shape(arch, changes), **kwargs)
    with pytest.raises(UnsupportedModel) as info:
        check(path)
    assert info.value.key == key
    assert str(path) in str(info.value)
    assert "embedding_length" in str(info.value)


@pytest.mark.parametrize(("arch", "changes"), TAKEN)
def test_architectures_that_size_attention_by_the_heads_take_them(
    tmp_path: Path, arch: str, changes: dict[str, Any]
) -> None:
    assert not ARCHITECTURES[arch].hidden_wide_attention
    check(write_model(tmp_path / "m.gguf", shape(arch, changes)))
