"""Which architectures rotate whole heads (``ArchSpec.whole_head_rotary``), as llama.cpp
decides it: a ``rope.dimension_count`` below the key head size is refused before any
process, naming the key, where llama.cpp cannot run the file (llama's loader: "invalid
n_rot"; qwen2's, qwen3's, smollm3's, mistral3's, granite's, exaone's and the mixtures'
graphs abort on ``GGML_ASSERT(n_embd_head == n_rot)``), and taken where llama.cpp runs
it (the gemmas, phi3). Before, every architecture but llama ran a partial rotary that
llama.cpp aborts on. (Each row checked against llama-cpp-python 0.3.36.)"""

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

#: architecture -> llama.cpp runs a rotary over half of each head
PARTIAL_ROTARY_RUNS = {
    "llama": False,
    "qwen2": False,
    "qwen3": False,
    "smollm3": False,
    "mistral3": False,
    "granite": False,
    "exaone": False,
    "qwen2moe": False,
    "qwen3moe": False,
    "granitemoe": False,
    "gemma": True,
    "gemma2": True,
    "gemma3": True,
    "phi3": True,
}


def test_every_architecture_has_a_row() -> None:
    assert set(PARTIAL_ROTARY_RUNS) == set(ARCHITECTURES)


def half_rotary(tmp_path: Path, arch: str) -> Path:
    shape = FIXTURE_SHAPES[arch]
    head = shape.key_length or shape.hidden // shape.heads
    return write_model(tmp_path / f"{arch}.gguf", attrs.evolve(shape, rope_dims=head // 2))


def check(path: Path) -> None:
    check_whole_model(path, model_facts_from_gguf(path).num_layers, WorkerCapabilities())


@pytest.mark.parametrize("arch", sorted(PARTIAL_ROTARY_RUNS))
def test_a_rotary_over_part_of_each_head_is_taken_where_llamacpp_runs_it(
    tmp_path: Path, arch: str
) -> None:
    path = half_rotary(tmp_path, arch)
    assert ARCHITECTURES[arch].whole_head_rotary is not PARTIAL_ROTARY_RUNS[arch]
    if PARTIAL_ROTARY_RUNS[arch]:
        check(path)
        return
    with pytest.raises(UnsupportedModel, match="rotates whole heads") as info:
        check(path)
    assert info.value.key == f"{arch}.rope.dimension_count"
    assert str(path) in str(info.value)
