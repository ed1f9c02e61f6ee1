"""Value heads of another size than the key heads (``value_length`` other than
``key_length``) are refused for every architecture we run, before any process, naming
``value_length``: llama.cpp's loaders size the attention output by the key heads (qwen3's
its keys by the value heads), so llama.cpp refuses such a file by its tensors' shapes
("tensor 'blk.0.attn_output.weight' has wrong shape"). Before, such a file planned and
ran here, its attention output as wide as its value heads. (Every architecture checked
against llama-cpp-python 0.3.36: ``scripts/check_refusals_llamacpp.py``.)"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from runplan import model_facts_from_gguf
from runplan.config import WorkerCapabilities
from runtime_core.architectures import ARCHITECTURES
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import check_whole_model
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model


def wide_values(tmp_path: Path, arch: str) -> Path:
    """A consistent file of ``arch`` whose value heads are twice its key heads."""
    shape = FIXTURE_SHAPES[arch]
    head = shape.key_length or shape.hidden // shape.heads
    return write_model(tmp_path / f"{arch}.gguf", attrs.evolve(shape, value_length=2 * head))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_value_heads_of_another_size_are_refused_naming_value_length(
    tmp_path: Path, arch: str
) -> None:
    path = wide_values(tmp_path, arch)
    with pytest.raises(UnsupportedModel, match="value heads of") as info:
        check_whole_model(path, model_facts_from_gguf(path).num_layers, WorkerCapabilities())
    assert info.value.key == f"{arch}.attention.value_length"
    assert str(path) in str(info.value)
