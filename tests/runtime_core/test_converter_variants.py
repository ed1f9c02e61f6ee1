"""GGUF files as other converters write them: what llama.cpp loads, every worker loads
and runs to the tokens of the same model written as our generator writes it; what
llama.cpp refuses is a typed error naming the tensor.

- Trailing dimensions of size 1 (a norm stored as ``[n_embd, 1]``, a matrix as
  ``[n_in, n_out, 1, 1]``): llama.cpp pads every shape to four dimensions with 1s
  before comparing it, so they are the tensor without them. Checked with
  llama-cpp-python 0.3.36 (greedy, the same tokens as the plain file's); a 1 before a
  larger dimension (``[1, n_embd]``, ``[n_in, 1, n_out]``) it refuses, and so do we.
- Tensor data aligned to other than 32 bytes (``general.alignment``: 1 or 8 leave
  tensors at addresses of the mapped file that are not multiples of 32 for a worker to
  read): the tokens of the file aligned to 32.
- A mixture of one expert: its stacked experts' tensors and its router end in a
  dimension of size 1 (the expert count), which the file stores or not; either way it
  runs (llama.cpp runs it: llama-cpp-python 0.3.36, the same greedy token) to the
  tokens of the dense model of that expert's matrices (the router's softmax over one
  expert weighs it 1).
- Head counts as arrays of one per block (llama.cpp's ``get_key_or_arr``): the same
  tokens as the numbers (llama.cpp's too). Counts that differ between blocks, an array
  of another length or of floats are a ``GgufError`` naming the key.
- A qwen2 file without some or all of its Q/K/V biases (each optional in llama.cpp's
  loader: llama-cpp-python 0.3.36 runs it, ``scripts/check_refusals_llamacpp.py``): the
  tokens and logits of the same file with those biases zero. It was refused ("a tensor
  the stage needs is missing").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from runplan import GgufError, model_facts_from_gguf
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


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_tensor_data_aligned_to_other_than_32_bytes_gives_the_same_tokens(
    tmp_path: Path, make: MakeWorker, alignment: int
) -> None:
    shape = ModelShape(n_layers=2, quant="Q8_0", seed=29)
    plain = write_model(tmp_path / "plain.gguf", shape)
    other = write_model(tmp_path / "other.gguf", shape, alignment=alignment)
    header = GgufHeader.read(other)
    assert header.integer("general.alignment") == alignment
    if alignment < 32:  # some tensor lies where a file aligned to 32 puts none
        assert any(info.offset % 32 for info in header.tensors.values())
    want = [o.token_id for o in run(provisions(plain, 2), make, PROMPT, N)]
    assert [o.token_id for o in run(provisions(other, 2), make, PROMPT, N)] == want


def _dense_twin(moe: Path, out: Path) -> Path:
    """The dense model of a mixture of one expert: ``moe``'s keys but its expert counts,
    its tensors but the routers, each expert matrix as the plain one of its block."""
    reader = GGUFReader(moe)
    writer = GGUFWriter(out, "llama")
    writer.kv_data[0].clear()
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or "expert" in field.name:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            item = field.types[1]
            values = [field.parts[i] for i in field.data]
            items = [bytes(v) if item == GGUFValueType.STRING else v.tolist()[0] for v in values]
            writer.add_key_value(field.name, items, kind, item)
        else:
            value = field.parts[-1]
            scalar = bytes(value) if kind == GGUFValueType.STRING else value.tolist()[0]
            writer.add_key_value(field.name, scalar, kind)
    for tensor in reader.tensors:
        if "ffn_gate_inp" in tensor.name:
            continue
        data = np.array(tensor.data)
        if "_exps" in tensor.name:
            data = data.reshape(data.shape[-2:])  # the one expert's matrix
        writer.add_tensor(tensor.name.replace("_exps", ""), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("stored", ["with the 1", "without it"])
def test_a_mixture_of_one_expert_runs_as_the_dense_model_of_its_expert(
    tmp_path: Path, make: MakeWorker, stored: str
) -> None:
    shape = ModelShape(n_layers=2, experts=1, experts_used=1, seed=28)
    moe = write_model(tmp_path / "moe.gguf", shape)
    dense = _dense_twin(moe, tmp_path / "dense.gguf")
    if stored == "without it":
        tensors = GgufHeader.read(moe).tensors
        moe = write_model(tmp_path / "moe-2d.gguf", shape, stored_shapes={
            name: info.shape for name, info in tensors.items() if "_exps" in name or "_inp" in name
        })  # fmt: skip
    header = GgufHeader.read(moe)
    assert header.tensors["blk.0.ffn_gate_inp.weight"].shape == (64,)
    assert model_facts_from_gguf(moe).num_layers == 2
    with open_stage_slice(moe, 0, 2, is_first=True, is_last=True) as stage:
        assert stage.tensors["blk.0.ffn_gate_inp.weight"].shape == (64, 1)
        assert stage.tensors["blk.1.ffn_down_exps.weight"].shape == (128, 64, 1)
        assert stage.dequantize("blk.1.ffn_down_exps.weight").shape == (1, 64, 128)
    want = [o.token_id for o in run(provisions(dense, 2), make, PROMPT, N)]
    assert [o.token_id for o in run(provisions(moe, 2), make, PROMPT, N)] == want


def _head_arrays(heads: list[int], heads_kv: list[int]) -> dict[str, tuple[object, GGUFValueType]]:
    return {
        "llama.attention.head_count": (heads, GGUFValueType.ARRAY),
        "llama.attention.head_count_kv": (heads_kv, GGUFValueType.ARRAY),
    }


def test_head_counts_as_one_per_block_give_the_tokens_of_the_numbers(
    tmp_path: Path, make: MakeWorker
) -> None:
    shape = ModelShape(n_layers=3, heads=4, heads_kv=2, seed=27)
    plain = write_model(tmp_path / "plain.gguf", shape)
    arrays = write_model(tmp_path / "arrays.gguf", shape,
                         override_keys=_head_arrays([4, 4, 4], [2, 2, 2]))  # fmt: skip
    assert GgufHeader.read(arrays).value_type("llama.attention.head_count") == GGUFValueType.ARRAY
    facts = model_facts_from_gguf(arrays)
    assert (facts.head_count, facts.head_count_kv) == (4, 2)
    want = [o.token_id for o in run(provisions(plain, 2), make, PROMPT, N)]
    assert [o.token_id for o in run(provisions(arrays, 2), make, PROMPT, N)] == want


@pytest.mark.parametrize(
    ("heads", "heads_kv", "key", "says"),
    [
        ([4, 4, 4], [2, 1, 2], "head_count_kv", r"they differ \(\[2, 1, 2\]\)"),
        ([4, 8, 4], [2, 2, 2], "head_count", r"they differ \(\[4, 8, 4\]\)"),
        ([4, 4], [2, 2, 2], "head_count", r"an array of 2 int32.*\(3 blocks\)"),
        ([4, 4, 4], [2.0, 2.0, 2.0], "head_count_kv", r"an array of 3 float32"),
    ],
)
def test_head_counts_that_are_not_one_per_block_and_the_same_are_named(
    tmp_path: Path, heads: list[int], heads_kv: list[float], key: str, says: str
) -> None:
    shape = ModelShape(n_layers=3, heads=4, heads_kv=2, seed=27)
    path = write_model(tmp_path / "m.gguf", shape, override_keys=_head_arrays(heads, heads_kv))
    for read in (
        lambda: model_facts_from_gguf(path),
        lambda: open_stage_slice(path, 0, 3, is_first=True, is_last=True),
    ):
        with pytest.raises(GgufError, match=says) as info:
            read()
        assert info.value.key == f"llama.attention.{key}"


#: qwen2 files without Q/K/V biases (``unbiased_qwen2``), which llama.cpp runs: which
#: biases each lacks, by name (``{i}``: every block).
UNBIASED_QWEN2: dict[str, tuple[str, ...]] = {
    "no Q/K/V biases": ("attn_q", "attn_k", "attn_v"),
    "no K bias": ("attn_k",),
    "no Q and V biases": ("attn_q", "attn_v"),
}
UNBIASED_SHAPE = ModelShape(arch="qwen2", n_layers=2, seed=30)


def unbiased_qwen2(folder: Path, case: str) -> Path:
    """The qwen2 model of ``UNBIASED_SHAPE`` without the biases ``case`` names."""
    dropped = tuple(
        f"blk.{i}.{name}.bias"
        for i in range(UNBIASED_SHAPE.n_layers)
        for name in UNBIASED_QWEN2[case]
    )
    return write_model(folder / "unbiased.gguf", UNBIASED_SHAPE, drop_tensors=dropped)


def _zeroed(path: Path, out: Path, tensors: set[str]) -> Path:
    """A copy of ``path`` with the data of ``tensors`` all zeros."""
    data = bytearray(path.read_bytes())
    for name, info in GgufHeader.read(path).tensors.items():
        if name in tensors:
            data[info.offset : info.offset + info.n_bytes] = bytes(info.n_bytes)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("case", sorted(UNBIASED_QWEN2))
def test_a_qwen2_file_without_qkv_biases_runs_as_with_them_zero(
    tmp_path: Path, make: MakeWorker, case: str
) -> None:
    biased = write_model(tmp_path / "biased.gguf", UNBIASED_SHAPE)
    unbiased = unbiased_qwen2(tmp_path, case)
    missing = set(GgufHeader.read(biased).tensors) - set(GgufHeader.read(unbiased).tensors)
    assert missing and all(name.endswith(".bias") for name in missing)
    zero = _zeroed(biased, tmp_path / "zero.gguf", missing)
    want = run(provisions(zero, 2), make, PROMPT, N)
    got = run(provisions(unbiased, 2), make, PROMPT, N)
    assert [o.token_id for o in got] == [o.token_id for o in want]
    for mine, theirs in zip(got, want, strict=True):
        assert mine.logits is not None and theirs.logits is not None
        np.testing.assert_array_equal(mine.logits, theirs.logits)
