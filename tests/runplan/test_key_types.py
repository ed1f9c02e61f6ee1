"""A model key stored as another GGUF type than the one llama.cpp reads it as
(``runplan.key_types``) is refused, as llama.cpp refuses it ("key llama.context_length
has wrong type i32 but expected type u32"): a ``GgufError`` naming the file, the key,
the type llama.cpp reads and the value found, from the reader that reads the key.

Before, every integer type was read as the number it holds, and every float or integer
type as a float: a file that llama.cpp refuses planned and ran, and an end-of-sequence
id of INT32 -1 was silently replaced by the tokenizer model's default id (generation
then ended at another token than the file's). The table was checked against
llama-cpp-python 0.3.36, which refuses every row."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType

from runplan import GgufError, model_facts_from_gguf
from runplan.config import WorkerCapabilities
from runplan.key_types import every_file_type, llamacpp_type
from runtime_core.gguf_slice import check_whole_model
from runtime_core.tokenizer import Tokenizer
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model

U32, I32, U16 = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT16
U64, I64 = GGUFValueType.UINT64, GGUFValueType.INT64
F32, F64 = GGUFValueType.FLOAT32, GGUFValueType.FLOAT64


def _slice(path: Path) -> None:
    check_whole_model(path, model_facts_from_gguf(path).num_layers, WorkerCapabilities())


READERS: dict[str, Callable[[Path], Any]] = {
    "facts": model_facts_from_gguf,
    "slice": _slice,
    "tokenizer": Tokenizer.from_gguf,
}

#: (architecture, key, value stored, its type, the reader that reads the key). ``{a}``
#: is the architecture.
ROWS: list[tuple[str, str, int | float, GGUFValueType, str]] = [
    ("llama", "{a}.block_count", 4, U64, "facts"),
    ("qwen2", "{a}.context_length", 256, I32, "facts"),
    ("qwen3", "{a}.embedding_length", 64, I64, "facts"),
    ("gemma3", "{a}.attention.head_count", 4, U16, "facts"),
    ("phi3", "{a}.attention.head_count_kv", 2, I32, "facts"),
    ("qwen2", "{a}.attention.key_length", 16, U64, "facts"),
    ("gemma3", "{a}.attention.sliding_window", 512, I32, "facts"),
    ("llama", "{a}.vocab_size", 323, I32, "facts"),
    ("llama", "tokenizer.ggml.eos_token_id", -1, I32, "facts"),
    ("gemma3", "tokenizer.ggml.eos_token_id", 322, U64, "facts"),
    ("qwen3", "tokenizer.ggml.bos_token_id", 320, I32, "tokenizer"),
    ("llama", "{a}.rope.freq_base", 10000.0, F64, "facts"),
    ("qwen2", "{a}.rope.freq_base", 10000, U32, "facts"),
    ("llama", "{a}.feed_forward_length", 128, I32, "slice"),
    ("qwen3", "{a}.rope.dimension_count", 16, I32, "slice"),
    ("phi3", "{a}.attention.layer_norm_rms_epsilon", 1e-5, F64, "slice"),
    ("gemma3", "{a}.final_logit_softcapping", 30, U32, "slice"),
]


def write_row(tmp_path: Path, arch: str, key: str, value: Any, vtype: GGUFValueType) -> Path:
    return write_model(
        tmp_path / f"{arch}.gguf", ModelShape(arch=arch), override_keys={key: (value, vtype)}
    )


@pytest.mark.parametrize(("arch", "key", "value", "vtype", "reader"), ROWS)
def test_a_key_of_another_type_than_llamacpp_reads_is_a_gguf_error_naming_it(
    tmp_path: Path, arch: str, key: str, value: int | float, vtype: GGUFValueType, reader: str
) -> None:
    key = key.format(a=arch)
    expected = llamacpp_type(key)
    assert expected is not None and expected != vtype
    path = write_row(tmp_path, arch, key, value, vtype)
    with pytest.raises(GgufError) as info:
        READERS[reader](path)
    assert info.value.key == key
    message = str(info.value)
    assert str(path) in message
    assert f"expected a {expected.name}" in message
    assert f"found a {vtype.name} ({value!r})" in message


@pytest.mark.parametrize(("arch", "key", "value", "vtype", "reader"), ROWS)
def test_the_same_value_of_llamacpps_type_is_read(
    tmp_path: Path, arch: str, key: str, value: int | float, vtype: GGUFValueType, reader: str
) -> None:
    """The other side of each row: stored as llama.cpp reads it, the file is read."""
    key = key.format(a=arch)
    expected = llamacpp_type(key)
    assert expected is not None
    if expected == U32 and value < 0:  # no UINT32 holds it; the file's own id instead
        value = 322
    stored = float(value) if expected == F32 else int(value)
    READERS[reader](write_row(tmp_path, arch, key, stored, expected))


@pytest.mark.parametrize(
    "key",
    ["split.count", "split.tensors.count", "general.alignment", "general.name",
     "gemma3.attention.sliding_window_pattern", "gguf_pipeline.shard.layer_start",
     "tokenizer.ggml.add_bos_token",
     # read here, not by llama.cpp's loader of these: it loads them of any type
     "qwen2moe.expert_shared_count", "qwen3moe.expert_gating_func"],
)  # fmt: skip
def test_keys_outside_the_table_keep_their_own_types(key: str) -> None:
    assert llamacpp_type(key) is None


U8, BOOL = GGUFValueType.UINT8, GGUFValueType.BOOL
#: Keys llama.cpp reads of every file (``key_types.EVERY_FILE_KEYS``, ``_SUFFIXES``),
#: read here or not, stored as another type: (architecture, key, value stored, its
#: type). Each file, a fixture of llama.cpp's but that key, ran here; llama.cpp refuses
#: it ("key general.file_type has wrong type i32 but expected type u32").
EVERY_FILE_ROWS: list[tuple[str, str, int, GGUFValueType]] = [
    ("llama", "general.file_type", 0, I32),
    ("qwen3", "general.file_type", 0, GGUFValueType.UINT16),
    ("qwen2", "{a}.rope.scaling.finetuned", 1, U8),
    ("gemma3", "{a}.attention.causal", 1, U8),
    ("phi3", "{a}.pooling_type", 0, I32),
    ("smollm3", "{a}.expert_group_used_count", 0, I32),
    ("exaone", "{a}.expert_group_count", 0, I32),
    ("granite", "{a}.expert_count", 0, I32),
    ("mistral3", "tokenizer.ggml.add_sep_token", 0, U8),
    ("gemma2", "tokenizer.ggml.remove_extra_whitespaces", 0, U8),
    ("gemma", "tokenizer.ggml.padding_token_id", 0, U64),
    ("qwen3moe", "tokenizer.ggml.mask_token_id", 0, I32),
    ("qwen2moe", "tokenizer.ggml.unknown_token_id", 0, I64),
    ("granitemoe", "tokenizer.ggml.fim_pre_token_id", 0, I32),
    ("llama", "tokenizer.ggml.prefix_token_id", 0, I32),
    ("llama", "split.count", 1, U32),
]


def write_every_file_row(
    folder: Path, arch: str, key: str, value: int, vtype: GGUFValueType
) -> Path:
    """``FIXTURE_SHAPES[arch]`` with ``key`` (``{a}``: the architecture) stored as
    ``value`` of ``vtype``."""
    return write_model(
        folder / f"{arch}.gguf",
        FIXTURE_SHAPES[arch],
        override_keys={key.format(a=arch): (value, vtype)},
    )


@pytest.mark.parametrize(("arch", "key", "value", "vtype"), EVERY_FILE_ROWS)
def test_a_key_llamacpp_reads_of_every_file_stored_as_another_type_is_refused(
    tmp_path: Path, arch: str, key: str, value: int, vtype: GGUFValueType
) -> None:
    """Refused by the facts (the planner, and every runtime before a stage starts),
    naming the key, though nothing here reads it (or reads it of any type)."""
    key = key.format(a=arch)
    expected = every_file_type(key, arch)
    assert expected is not None and expected != vtype
    path = write_every_file_row(tmp_path, arch, key, value, vtype)
    with pytest.raises(GgufError) as info:
        model_facts_from_gguf(path)
    assert info.value.key == key
    assert f"expected a {expected.name}" in str(info.value)
    assert f"found a {vtype.name} ({value!r})" in str(info.value)
    (tmp_path / "good").mkdir()
    good = write_every_file_row(tmp_path / "good", arch, key, value, expected)
    _slice(good)  # of llama.cpp's type, the file is read, and every stage loads it


def test_a_split_sets_later_shard_of_split_no_of_another_type_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """llama.cpp reads every shard's ``split.no`` as a UINT16 (``gguf_get_val_u16``
    aborts on another); here any integer type was read."""
    first = write_model(tmp_path / "m.gguf", ModelShape(n_layers=2), split_max_tensors=8)
    second = first.with_name(first.name.replace("-00001-", "-00002-"))
    data = bytearray(second.read_bytes())
    key = b"split.no"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<IH", data, at) == (int(GGUFValueType.UINT16), 1)
    # the same bytes as a UINT32 would not fit; an INT16 of the same value does
    struct.pack_into("<I", data, at, int(GGUFValueType.INT16))
    second.write_bytes(bytes(data))
    with pytest.raises(GgufError) as info:
        model_facts_from_gguf(first)
    assert info.value.key == "split.no"
    assert str(second) in str(info.value) and "expected a UINT16" in str(info.value)
