"""GGUF files as other converters write them: what llama.cpp loads, every worker loads
and runs to the tokens of the same model written as our generator writes it; what
llama.cpp refuses is a typed error naming the tensor.

- Trailing dimensions of size 1 (a norm stored as ``[n_embd, 1]``, a matrix as
  ``[n_in, n_out, 1, 1]``): llama.cpp pads every shape to four dimensions with 1s
  before comparing it, so they are the tensor without them. Checked with
  llama-cpp-python 0.3.36 (greedy, the same tokens as the plain file's); a 1 before a
  larger dimension (``[1, n_embd]``, ``[n_in, 1, n_out]``) it refuses, and so do we.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runplan import model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runplan.split import split_model, split_plan
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_stage_slice
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import provisions, run
from tests.support.every_worker import WORKERS, MakeWorker, worker_for

PROMPT = [5, 77, 300, 12, 9]
N = 6
SHAPES = {
    "llama": ModelShape(n_layers=2, tied=False, quant="Q8_0", rope_freqs=True, seed=21),
    "qwen2": ModelShape(arch="qwen2", n_layers=2, seed=22),
    "gemma3": ModelShape(arch="gemma3", n_layers=2, sliding_window=4, key_length=32, seed=23),
    "phi3": ModelShape(arch="phi3", n_layers=2, rope_dims=8, tied=False, seed=24),
}


@pytest.fixture(params=list(WORKERS))
def make(request: pytest.FixtureRequest) -> MakeWorker:
    return worker_for(request.param)


def trailing_ones(plain: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``plain`` with 1, 2 or 3 more dimensions of size 1 after its own,
    in turn, as many as four dimensions leave room for."""
    tensors = GgufHeader.read(plain).tensors
    return {
        name: info.shape + (1,) * min(1 + i % 3, 4 - len(info.shape))
        for i, (name, info) in enumerate(tensors.items())
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(plain, padded) of each architecture: the same model, the second's every tensor
    with trailing dimensions of size 1."""
    d = tmp_path_factory.mktemp("variants")
    out = {}
    for key, shape in SHAPES.items():
        plain = write_model(d / f"{key}.gguf", shape)
        padded = write_model(d / f"{key}-ones.gguf", shape, stored_shapes=trailing_ones(plain))
        out[key] = (plain, padded)
    return out


def test_trailing_dimensions_of_size_one_read_as_absent(
    files: dict[str, tuple[Path, Path]],
) -> None:
    for plain, padded in files.values():
        want, got = GgufHeader.read(plain).tensors, GgufHeader.read(padded).tensors
        assert {n: i.shape for n, i in got.items()} == {n: i.shape for n, i in want.items()}
        assert model_facts_from_gguf(padded).block_elements == (
            model_facts_from_gguf(plain).block_elements
        )


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_a_model_with_trailing_dimensions_of_size_one_gives_the_same_tokens(
    files: dict[str, tuple[Path, Path]], key: str, make: MakeWorker
) -> None:
    plain, padded = files[key]
    want = [o.token_id for o in run(provisions(plain, 2), make, PROMPT, N)]
    assert [o.token_id for o in run(provisions(padded, 2), make, PROMPT, N)] == want


def test_shards_of_a_model_with_trailing_dimensions_of_size_one_load(
    files: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    plain, padded = files["llama"]
    plan = split_plan(model_facts_from_gguf(padded), 2, None, "even")
    split = split_model(str(padded), plan, tmp_path / "split")
    manifest = tmp_path / "split" / "manifest.json"
    want = [o.token_id for o in run(provisions(plain, 2), WORKERS["cpu"], PROMPT, N)]
    assert [o.token_id for o in run(provisions(manifest, 2), WORKERS["cpu"], PROMPT, N)] == want
    for entry in split.manifest.shards:
        parts = entry.parts
        with open_stage_slice(
            manifest, parts.layer_start, parts.layer_end_exclusive,
            is_first=parts.embedding, is_last=parts.output,
        ) as stage:  # fmt: skip
            for name, info in stage.tensors.items():
                assert stage.dequantize(name).shape == tuple(reversed(info.shape)), name


@pytest.mark.parametrize(
    ("tensor", "ne", "read"),  # the shape stored, and as read: its trailing 1s dropped
    [
        ("output_norm.weight", (1, 64), "1, 64"),
        ("blk.1.attn_norm.weight", (1, 64, 1), "1, 64"),
        ("blk.0.ffn_down.weight", (128, 1, 64), "128, 1, 64"),
        ("token_embd.weight", (64, 1, 323, 1), "64, 1, 323"),
    ],
)
def test_a_dimension_of_size_one_before_a_larger_one_is_refused_naming_the_tensor(
    tmp_path: Path, tensor: str, ne: tuple[int, ...], read: str
) -> None:
    bad = write_model(tmp_path / "bad.gguf", ModelShape(n_layers=2), stored_shapes={tensor: ne})
    with pytest.raises(UnsupportedModel, match=rf"shape \[{read}\] where") as info:
        open_stage_slice(bad, 0, 2, is_first=True, is_last=True)
    assert info.value.tensor == tensor
