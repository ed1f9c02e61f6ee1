"""Each kind of header damage found by hand, through every entry point that reads a GGUF
file: ``model_facts_from_gguf``, ``Tokenizer.from_gguf``, ``open_stage_slice``, both
runtimes' ``generate`` and every command line. Each raises a typed error naming the
file and the key or tensor (a command line: one line and a non-zero exit), never a
``UnicodeDecodeError`` or a wrong reading, and at once (the time limits are hundreds
of times what the calls take; a forged block count once took 20 s).

Where a field is is read off the gguf package's own reading of the file
(``tests.fuzz.mutants.structure``), never by our parser.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType

import runtime_cupy
import runtime_sim
from runplan import GgufError, model_facts_from_gguf
from runplan.cli import main as runplan_main
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.cli.main import main as cupy_main
from runtime_sim.cli import main as sim_main
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.fuzz.mutants import Target, structure
from tests.fuzz.pipeline import time_limit

SHAPE = ModelShape(n_layers=3)
LIMIT_S = 20.0


def target(path: Path, label: str) -> Target:
    found = [t for t in structure(path)[0] if t.label == label]
    assert len(found) == 1, label
    return found[0]


def patched(path: Path, out: Path, label: str, value: int | bytes) -> Path:
    """A copy of ``path`` with field ``label`` (a ``structure`` label) overwritten."""
    t = target(path, label)
    data = bytearray(path.read_bytes())
    raw = value if isinstance(value, bytes) else value.to_bytes(t.width, "little")
    data[t.offset : t.offset + len(raw)] = raw
    out.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("known") / "model.gguf", SHAPE)


def slice_all(path: Path) -> None:
    open_stage_slice(path, 0, SHAPE.n_layers, is_first=True, is_last=True).close()


def tokenize(path: Path) -> None:
    tok = Tokenizer.from_gguf(path)
    tok.decode(tok.encode("Hello <|im_start|> world"))


READERS: dict[str, Callable[[Path], Any]] = {
    "facts": model_facts_from_gguf,
    "tokenizer": tokenize,
    "slice": slice_all,
}


def outcomes(path: Path) -> dict[str, Exception | None]:
    """What each reader makes of ``path``: ``None``, or the typed error it raised."""
    out: dict[str, Exception | None] = {}
    for name, read in READERS.items():
        try:
            with time_limit(LIMIT_S, name):
                read(path)
            out[name] = None
        except (GgufError, UnsupportedModel) as exc:
            out[name] = exc
    return out


def _one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- strings that are not UTF-8 ----------------------------------------------------------

#: Key -> the readers that read it (and must refuse it), the others read the file fine.
#: ``general.name``, only shown, is read by every reader with its bad bytes replaced, as
#: llama.cpp takes it: no reader refuses it.
STRING_KEYS = {
    "general.architecture": {"facts", "tokenizer", "slice"},
    "tokenizer.ggml.model": {"facts", "tokenizer"},
    "tokenizer.ggml.pre": {"tokenizer"},
    "general.name": set(),
}


@pytest.mark.parametrize("key", sorted(STRING_KEYS))
def test_a_string_value_that_is_not_utf8_is_a_gguf_error_naming_the_key(
    model: Path, tmp_path: Path, key: str
) -> None:
    bad = patched(model, tmp_path / "bad.gguf", key, b"\xff")
    results = outcomes(bad)
    assert {name for name, exc in results.items() if exc is not None} == STRING_KEYS[key]
    for exc in results.values():
        if exc is not None:
            assert isinstance(exc, GgufError) and exc.key == key, exc
            assert str(bad) in str(exc) and "UTF-8" in str(exc)


#: A key read by the stages alone (a NaN epsilon): before, ``runtime_sim.generate`` and
#: ``generate_runs`` ran the chain and gave back a faulted run, its command line exit 1.
STAGE_KEY = "llama.attention.layer_norm_rms_epsilon"
GENERATE_KEYS = ["general.architecture", "tokenizer.ggml.pre", STAGE_KEY]


def damaged(model: Path, tmp_path: Path, key: str) -> Path:
    """A copy of ``model`` whose ``key`` no reader can take: a string that is not UTF-8,
    or for ``STAGE_KEY`` a NaN."""
    if key == STAGE_KEY:
        nan = (float("nan"), GGUFValueType.FLOAT32)
        return write_model(tmp_path / "bad.gguf", SHAPE, override_keys={key: nan})
    return patched(model, tmp_path / "bad.gguf", key, b"\xff")


@pytest.mark.parametrize("key", GENERATE_KEYS)
def test_both_runtimes_generate_raise_the_gguf_error(model: Path, tmp_path: Path, key: str) -> None:
    bad = damaged(model, tmp_path, key)
    sim_runs = functools.partial(runtime_sim.generate_runs, runs=2)
    for generate in (runtime_sim.generate, sim_runs, runtime_cupy.generate):
        with pytest.raises(GgufError) as err, time_limit(60, str(generate)):
            generate(bad, [1, 2, 3], stages=1, max_tokens=1)
        assert err.value.key == key and str(bad) in str(err.value)


@pytest.mark.parametrize("key", GENERATE_KEYS)
def test_every_command_line_says_it_in_one_line(
    model: Path, tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = str(damaged(model, tmp_path, key))
    run = ["--model", bad, "--prompt-ids", "1,2,3", "--stages", "1", "--max-tokens", "1"]
    assert sim_main(["run", *run]) == 2
    _one_error_line(capsys, bad, key)
    assert cupy_main(run) == 2
    _one_error_line(capsys, bad, key)
    if key == "general.architecture":
        assert runplan_main(["facts", bad]) == 1
        _one_error_line(capsys, bad, key)


# ---- counts the file cannot back -----------------------------------------------------------


@pytest.mark.parametrize("count", [2**31, 2**32 - 1, 7])
def test_a_forged_block_count_is_refused_at_once(model: Path, tmp_path: Path, count: int) -> None:
    bad = patched(model, tmp_path / "bad.gguf", "llama.block_count", count)
    results = outcomes(bad)
    for name in ("facts", "slice"):
        exc = results[name]
        assert isinstance(exc, GgufError) and exc.key == "llama.block_count", (name, exc)
        assert "holds tensors of 3" in str(exc)


def test_a_file_holding_only_some_blocks_is_refused_by_the_facts(tmp_path: Path) -> None:
    """A decision: a model's file holds every block its header counts. A pre-split
    shard holding blocks 0..1 of 3 is refused when the facts are read, naming the first
    block it lacks, instead of planning its missing blocks as zero bytes."""
    names = tuple(f"blk.2.{t}" for t in ("attn_norm.weight", "attn_q.weight", "attn_k.weight",
        "attn_v.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight"))  # fmt: skip
    path = write_model(tmp_path / "part.gguf", SHAPE, drop_tensors=names)
    with pytest.raises(GgufError, match="none of block 2") as err:
        model_facts_from_gguf(path)
    assert err.value.key == "llama.block_count"


@pytest.mark.parametrize("value", [2**32, 2**63, 2**64 - 1])
def test_a_forged_string_length_is_an_error_naming_it(
    model: Path, tmp_path: Path, value: int
) -> None:
    """A token's length past the file's end: before, 2**63 reached ``struct`` as an
    offset and came out as "Python int too large to convert to C ssize_t"."""
    bad = patched(model, tmp_path / "bad.gguf", "tokenizer.ggml.tokens[0]: length", value)
    tokens = model_facts_from_gguf(model).vocab_size
    for name, exc in outcomes(bad).items():
        assert isinstance(exc, GgufError), (name, exc)
        assert f"string 0 of an array of {tokens}" in str(exc), (name, exc)
        assert f"claims {value} bytes" in str(exc), (name, exc)


@pytest.mark.parametrize(
    "label",
    ["GGUF.kv_count", "GGUF.tensor_count", "tokenizer.ggml.tokens: item count",
     "tokenizer.ggml.merges: item count", "tensor blk.0.attn_q.weight: dimension count"],
)  # fmt: skip
@pytest.mark.parametrize("value", [2**32 - 1, 2**60, 2**64 - 1])
def test_a_forged_count_fails_at_once(model: Path, tmp_path: Path, label: str, value: int) -> None:
    bad = patched(
        model, tmp_path / "bad.gguf", label, value % 2 ** (8 * target(model, label).width)
    )
    results = outcomes(bad)
    for name, exc in results.items():
        assert isinstance(exc, GgufError), (name, exc)
        assert str(bad) in str(exc)


@pytest.mark.parametrize("what", ["key-value pairs", "tensors"])
def test_more_keys_or_tensors_than_a_model_holds_are_refused_before_they_are_read(
    tmp_path: Path, what: str
) -> None:
    """Each key-value pair and tensor info costs the gguf package's reader a field of
    NumPy views: a model with a key or a tensor per few dozen bytes, which its bytes
    back, took seconds and hundreds of MB (a 6 MB header of 300,000 keys 8 s and 490
    MB). A model of 65,537 keys or tensors (``MAX_KEYS`` or ``MAX_TENSORS`` and one) is
    refused by every reader, naming the count, before any is read."""
    if what == "tensors":
        one = np.ones(1, dtype=np.float32)
        path = write_model(
            tmp_path / "m.gguf", SHAPE, extra_tensors={f"t{i:x}": one for i in range(65_537)}
        )
    else:
        keys: dict[str, int | float | str | list[Any]] = {f"k{i:x}": 1 for i in range(65_537)}
        path = write_model(tmp_path / "m.gguf", SHAPE, extra_keys=keys)
    for name, exc in outcomes(path).items():
        assert isinstance(exc, GgufError), (name, exc)
        assert f"{what}; at most 65536 are read" in str(exc), (name, exc)


def test_an_array_where_a_number_belongs_is_refused_without_being_read(tmp_path: Path) -> None:
    path = write_model(
        tmp_path / "m.gguf",
        SHAPE,
        override_keys={"llama.context_length": ([7] * 100_000, GGUFValueType.ARRAY)},
    )
    with pytest.raises(GgufError, match="found an array of 100000 INT32") as err:
        model_facts_from_gguf(path)
    assert err.value.key == "llama.context_length"


@pytest.mark.parametrize(
    ("key", "value", "vtype"),
    [
        ("llama.rope.freq_base", float("nan"), GGUFValueType.FLOAT32),
        ("llama.attention.layer_norm_rms_epsilon", float("inf"), GGUFValueType.FLOAT32),
        ("llama.rope.freq_base", "10000", GGUFValueType.STRING),
        ("tokenizer.ggml.add_bos_token", 1, GGUFValueType.UINT8),
    ],
)
def test_a_value_of_the_wrong_kind_is_a_gguf_error_naming_the_key(
    tmp_path: Path, key: str, value: Any, vtype: GGUFValueType
) -> None:
    path = write_model(tmp_path / "m.gguf", SHAPE, override_keys={key: (value, vtype)})
    reader = "tokenizer" if key.startswith("tokenizer.") else "slice"
    exc = outcomes(path)[reader]
    assert isinstance(exc, GgufError) and exc.key == key, exc


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.rope.freq_base", 0.0),
        ("llama.rope.freq_base", -10000.0),
        ("llama.attention.layer_norm_rms_epsilon", -1e-5),
    ],
)
def test_a_number_no_forward_pass_can_take_is_a_gguf_error_naming_the_key(
    tmp_path: Path, key: str, value: float
) -> None:
    """A rotary base of 0 makes every angle infinite, a negative one NaN, and a negative
    epsilon the norm of a small row NaN (ggml asserts it): before, the file loaded and
    its first step failed with NaN logits, naming no key."""
    path = write_model(
        tmp_path / "m.gguf", SHAPE, override_keys={key: (value, GGUFValueType.FLOAT32)}
    )
    exc = outcomes(path)["slice"]
    assert isinstance(exc, GgufError) and exc.key == key, exc


@pytest.mark.parametrize(
    ("key", "value", "vtype", "match"),
    [
        ("llama.rope.freq_base", 1e300, GGUFValueType.FLOAT64, "expected a FLOAT32"),
        ("llama.attention.layer_norm_rms_epsilon", 1e300, GGUFValueType.FLOAT64, "FLOAT32"),
        ("llama.rope.scaling.attn_factor", -1e300, GGUFValueType.FLOAT64, "FLOAT32"),
        ("llama.rope.freq_base", 1e-45, GGUFValueType.FLOAT32, "angle passes float32"),
        ("llama.expert_count", -3, GGUFValueType.INT32, "found a INT32 (-3)"),
    ],
)
def test_a_value_past_what_llamacpp_holds_is_a_gguf_error_naming_the_key(
    tmp_path: Path, key: str, value: float, vtype: GGUFValueType, match: str
) -> None:
    """llama.cpp holds its float hyperparameters as float32: a FLOAT64 of 1e300 (finite
    as a double) loaded, then was infinite in the workers' float32 arithmetic (a
    meaningless token, or NaN logits naming no key); a denormal rotary base made its
    angles infinite; a negative expert count read as none. (llama.cpp reads a FLOAT64
    or an INT32 there as no value at all: ``key_types``.)"""
    path = write_model(tmp_path / "m.gguf", SHAPE, override_keys={key: (value, vtype)})
    exc = outcomes(path)["slice"]
    assert isinstance(exc, GgufError) and exc.key == key and match in str(exc), exc


# ---- keys llama.cpp's reader refuses -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "vtype", "says"),
    [
        (0, GGUFValueType.UINT32, "0: the data's alignment must be a power of two"),
        (3, GGUFValueType.UINT32, "3: the data's alignment must be a power of two"),
        (48, GGUFValueType.UINT32, "48: the data's alignment must be a power of two"),
        (2**31 + 1, GGUFValueType.UINT32, f"{2**31 + 1}: the data's alignment"),
        (64, GGUFValueType.UINT64, "stored as UINT64: llama.cpp reads it only as a UINT32"),
        (32, GGUFValueType.INT32, "stored as INT32: llama.cpp"),
        ([32], GGUFValueType.ARRAY, "stored as ARRAY/INT32: llama.cpp"),
    ],
)
def test_an_alignment_llamacpp_refuses_is_a_gguf_error_naming_the_key_and_value(
    tmp_path: Path, value: Any, vtype: GGUFValueType, says: str
) -> None:
    """``general.alignment`` must be a UINT32 power of two: the gguf package's refusal
    ('Invalid alignment: must be a non-zero power of two') named neither the key nor
    the value."""
    path = write_model(
        tmp_path / "m.gguf", SHAPE, override_keys={"general.alignment": (value, vtype)}
    )
    for reader, exc in outcomes(path).items():
        assert isinstance(exc, GgufError), (reader, exc)
        assert exc.key == "general.alignment" and says in str(exc), (reader, exc)


@pytest.mark.parametrize(
    ("label", "value", "key", "says"),
    [  # the field patched (a ``structure`` label), its value, the key named, what is said
        ("tokenizer.ggml.token_type: item type", 9, "tokenizer.ggml.token_type",
         "an array of ARRAY (llama.cpp reads no arrays of arrays)"),
        ("tokenizer.ggml.token_type: item type", 13, "tokenizer.ggml.token_type",
         "an array's item type of 13, none of GGUF's (0..12)"),
        ("general.name: value type", 13, "general.name", "a value type of 13, none of GGUF's"),
        ("tokenizer.ggml.merges: item count", 2**40, "tokenizer.ggml.merges",
         f"string array of {2**40} items runs past the end of the file"),
        ("tokenizer.ggml.token_type: item count", 2**40, "tokenizer.ggml.token_type",
         f"array of {2**40} INT32 runs past the end of the file"),
        ("general.name: string length", 2**40, "general.name", "run past the end of the file"),
        ("tokenizer.ggml.tokens[1]: length", 2**40, "tokenizer.ggml.tokens",
         "string 1 of an array of 323, at byte"),
    ],
)  # fmt: skip
def test_a_value_that_cannot_be_read_is_a_gguf_error_naming_its_key(
    model: Path, tmp_path: Path, label: str, value: int, key: str, says: str
) -> None:
    """A value of no GGUF type, an array of arrays, a value or string past the end of
    the file: the refusal named the file and what was wrong, not the key whose value it
    was (``GgufError.key`` None)."""
    bad = patched(model, tmp_path / "bad.gguf", label, value)
    for reader, exc in outcomes(bad).items():
        assert isinstance(exc, GgufError) and exc.key == key, (reader, exc)
        assert says in str(exc), (reader, exc)


def test_a_key_stored_twice_is_a_gguf_error_naming_it(tmp_path: Path) -> None:
    """llama.cpp refuses a repeated key; so do we, naming it (``GgufError.key``)."""
    path = write_model(tmp_path / "m.gguf", SHAPE, extra_keys={"general.namf": "again"})
    data = path.read_bytes()
    assert data.count(b"general.namf") == 1
    path.write_bytes(data.replace(b"general.namf", b"general.name"))
    for reader, exc in outcomes(path).items():
        assert isinstance(exc, GgufError) and exc.key == "general.name", (reader, exc)
        assert "stored twice" in str(exc), exc


# ---- where tensor data lies ----------------------------------------------------------------


def test_a_tensor_offset_that_wraps_around_64_bits_is_an_error(model: Path, tmp_path: Path) -> None:
    """An offset that, added to the data section's start, wraps to byte 0 of the file
    once read the header as the tensor's data."""
    data_start = structure(model)[1]
    name = "blk.0.attn_q.weight"
    original = target(model, f"tensor {name}: data offset").original
    bad = patched(model, tmp_path / "bad.gguf", f"tensor {name}: data offset", 2**64 - data_start)
    assert original != 2**64 - data_start
    results = outcomes(bad)
    for reader in READERS:
        exc = results[reader]
        assert isinstance(exc, GgufError) and name in str(exc), (reader, exc)


@pytest.mark.parametrize("shift", [-32, 32, 1])
def test_tensor_data_that_overlaps_or_leaves_a_gap_is_an_error(
    model: Path, tmp_path: Path, shift: int
) -> None:
    """llama.cpp's reader requires each tensor's data to start where the tensor before
    it ends, rounded up to the alignment; any other offset reads other bytes."""
    name = "blk.1.ffn_up.weight"
    label = f"tensor {name}: data offset"
    bad = patched(model, tmp_path / "bad.gguf", label, target(model, label).original + shift)
    with pytest.raises(GgufError, match=name.replace(".", r"\.")):
        model_facts_from_gguf(bad)
