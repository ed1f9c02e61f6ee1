"""Model facts from GGUF headers: generated models, SmolLM2, split sets, broken files."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

import runtime_sim
from runplan import GgufError, NodePool, NodeSpec, RunPlan, RuntimeConfig, plan_run
from runplan import model_facts_from_gguf as facts_of
from runplan.gguf_header import GgufHeader
from tests.fixtures.gguf_models import ModelShape, tiny_bpe, write_model
from tests.support.same_run import assert_same_run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", ModelShape())


def test_facts_describe_a_generated_llama_model(tmp_path: Path) -> None:
    shape = ModelShape(
        n_layers=5,
        hidden=96,
        heads=6,
        heads_kv=2,
        ffn=160,
        context_length=512,
        quant="Q8_0",
        tied=False,
    )
    path = write_model(tmp_path / "m.gguf", shape)
    f = facts_of(path)
    tokens, _ = tiny_bpe()
    assert f.model_id == "m"
    assert f.gguf_source.paths == (str(path.resolve()),)
    assert f.architecture == "llama"
    assert (f.num_layers, f.hidden_dim, f.head_count, f.head_count_kv) == (5, 96, 6, 2)
    assert (f.head_dim_k, f.head_dim_v) == (16, 16)
    assert f.vocab_size == len(tokens)
    assert f.eos_token_id == tokens.index("<|im_end|>")
    assert f.context_length == f.max_seq_len == 512
    assert f.quant_types == ("F32", "Q8_0")
    assert not f.tied_embeddings
    # Byte sizes: Q8_0 stores 34 bytes per 32 weights; norms are f32.
    q8 = lambda rows, cols: rows * cols // 32 * 34  # noqa: E731
    block = (
        q8(96, 96)
        + 2 * q8(32, 96)
        + q8(96, 96)  # q, k, v, output
        + 3 * q8(160, 96)
        + 2 * 96 * 4
    )  # gate, up, down, two norms
    assert f.block_bytes == (block,) * 5
    assert f.embedding_bytes == q8(len(tokens), 96)
    assert f.output_bytes == q8(len(tokens), 96) + 96 * 4
    assert f.shared_bytes == 0


def test_without_a_vocab_size_key_the_vocabulary_is_the_token_list(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", drop_keys=("llama.vocab_size",))
    assert not GgufHeader.read(path).has("llama.vocab_size")
    assert facts_of(path).vocab_size == len(tiny_bpe()[0])


def test_tied_head_is_the_embedding(tiny: Path) -> None:
    f = facts_of(tiny)
    assert f.tied_embeddings
    assert f.output_bytes == f.embedding_bytes + f.hidden_dim * 4


def test_qwen2_biases_count_in_their_block(tmp_path: Path) -> None:
    llama = facts_of(write_model(tmp_path / "l.gguf", ModelShape(arch="llama")))
    qwen = facts_of(write_model(tmp_path / "q.gguf", ModelShape(arch="qwen2")))
    assert qwen.architecture == "qwen2"
    bias_bytes = (4 + 2 + 2) * 16 * 4  # q, k, v biases of 16-wide heads in f32
    assert qwen.block_bytes == tuple(b + bias_bytes for b in llama.block_bytes)


def test_max_seq_len_overrides_the_context_length(tiny: Path) -> None:
    f = facts_of(tiny, max_seq_len=64)
    assert (f.context_length, f.max_seq_len) == (256, 64)


def test_smollm2_facts(smollm2_path: str) -> None:
    f = facts_of(smollm2_path)
    assert f.architecture == "llama"
    assert (f.num_layers, f.hidden_dim, f.head_count, f.head_count_kv) == (30, 576, 9, 3)
    assert (f.vocab_size, f.eos_token_id, f.context_length) == (49152, 2, 8192)
    assert f.quant_types == ("F32", "Q4_1", "Q8_0")
    assert f.tied_embeddings
    assert len(set(f.block_bytes)) == 1
    # Everything the header lists is accounted for exactly once.
    header = GgufHeader.read(smollm2_path)
    total = sum(t.n_bytes for t in header.tensors.values())
    assert (
        sum(f.block_bytes)
        + f.embedding_bytes
        + f.shared_bytes
        + (f.output_bytes - f.embedding_bytes)
        == total
    )
    elements = sum(int(np.prod(t.shape)) for t in header.tensors.values())
    assert (
        sum(f.block_elements)
        + f.embedding_elements
        + f.shared_elements
        + (f.output_elements - f.embedding_elements)
        == elements
    )
    assert f.embedding_elements == 49152 * 576


def test_a_split_set_reads_as_one_model(tmp_path: Path) -> None:
    shape = ModelShape(n_layers=3)
    whole = facts_of(write_model(tmp_path / "whole.gguf", shape))
    first = write_model(tmp_path / "parts.gguf", shape, split_max_tensors=10)
    shards = sorted(tmp_path.glob("parts-*-of-*.gguf"))
    assert len(shards) >= 2 and first == shards[0]
    for any_shard in shards:  # any file of the set names the whole set
        split = facts_of(any_shard)
        assert split.gguf_source.paths == tuple(str(p.resolve()) for p in shards)
        assert split.model_id == "parts"
        assert split.block_bytes == whole.block_bytes
        assert (split.embedding_bytes, split.output_bytes) == (
            whole.embedding_bytes,
            whole.output_bytes,
        )


def test_a_split_set_with_a_missing_shard_is_a_gguf_error(tmp_path: Path) -> None:
    write_model(tmp_path / "parts.gguf", ModelShape(n_layers=3), split_max_tensors=10)
    shards = sorted(tmp_path.glob("parts-*-of-*.gguf"))
    shards[-1].unlink()
    with pytest.raises(GgufError) as err:
        facts_of(shards[0])
    assert err.value.path == str(shards[-1].resolve())


def test_a_split_set_is_what_split_count_says_not_what_the_name_says(tmp_path: Path) -> None:
    """As llama.cpp: a file is a shard of a split set when its ``split.count`` is more
    than 1. Before, the name decided: a whole model named ``solo-00001-of-00002.gguf``
    was refused (``solo-00002-of-00002.gguf: no such file``), and the first shard of a
    set renamed off the pattern was read alone, refused for a block count."""
    shape = ModelShape(n_layers=3)
    solo = write_model(tmp_path / "solo-00001-of-00002.gguf", shape)
    assert facts_of(solo).gguf_source.paths == (str(solo.resolve()),)
    write_model(tmp_path / "parts.gguf", shape, split_max_tensors=10)
    shards = sorted(tmp_path.glob("parts-*-of-*.gguf"))
    renamed = shards[0].rename(tmp_path / "parts_part1.gguf")
    with pytest.raises(GgufError) as err:
        facts_of(renamed)
    assert err.value.key == "split.count"
    assert f"a split set of {len(shards)} files" in str(err.value)
    assert f"-NNNNN-of-{len(shards):05d}.gguf" in str(err.value)


def _corrupt(src: Path, dst: Path, data: bytes) -> Path:
    dst.write_bytes(data)
    return dst


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.3, 0.6, 0.999])
def test_truncated_files_are_gguf_errors(tiny: Path, tmp_path: Path, fraction: float) -> None:
    data = tiny.read_bytes()
    cut = _corrupt(tiny, tmp_path / "cut.gguf", data[: int(len(data) * fraction)])
    with pytest.raises(GgufError) as err:
        facts_of(cut)
    assert err.value.path == str(cut)
    assert str(cut) in str(err.value)


@pytest.mark.parametrize("magic", [b"GGUG", b"\x00\x00\x00\x00", b"PK\x03\x04"])
def test_wrong_magic_is_a_gguf_error(tiny: Path, tmp_path: Path, magic: bytes) -> None:
    bad = _corrupt(tiny, tmp_path / "bad.gguf", magic + tiny.read_bytes()[4:])
    with pytest.raises(GgufError, match="not a GGUF file"):
        facts_of(bad)


def test_a_big_endian_file_is_a_gguf_error_not_byte_swapped_weights(tmp_path: Path) -> None:
    """gguf.GGUFWriter writes big-endian files on request; their header reads, their
    tensor data does not (every worker reads little-endian), so they are refused at the
    header, as llama.cpp refuses them: before, the facts and the plan passed and the
    stages computed with byte-swapped weights (NaN logits, or wrong tokens)."""
    path = write_model(tmp_path / "big.gguf", ModelShape(n_layers=1), big_endian=True)
    assert path.read_bytes()[4:8] == struct.pack(">I", 3)
    with pytest.raises(GgufError, match="big-endian") as err:
        facts_of(path)
    assert err.value.path == str(path)


def test_a_name_that_is_not_utf8_is_refused_saying_so(tmp_path: Path) -> None:
    """The gguf package decodes key and tensor names as it parses (llama.cpp reads a
    key whose name is not UTF-8); such a file was refused as a "malformed or truncated
    header: 'utf-8' codec can't decode byte 0xff in position 7"."""
    path = write_model(tmp_path / "m.gguf", ModelShape(n_layers=1), extra_keys={"zz.key_X": 1})
    data = path.read_bytes()
    key = _corrupt(path, tmp_path / "key.gguf", data.replace(b"zz.key_X", b"zz.key_\xff"))
    with pytest.raises(GgufError) as err:
        facts_of(key)
    assert "a metadata key name that is not UTF-8: b'zz.key_\\xff' (byte 7)" in str(err.value)
    assert "malformed" not in str(err.value)
    name = b"output_norm.weight"
    tensor = _corrupt(path, tmp_path / "tensor.gguf", data.replace(name, b"\xff" + name[1:]))
    with pytest.raises(GgufError, match="name is not UTF-8: b'\\\\xffutput_norm"):
        facts_of(tensor)


def test_a_directory_or_missing_file_is_a_gguf_error(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="no such file"):
        facts_of(tmp_path / "absent.gguf")
    with pytest.raises(GgufError, match="directory"):
        facts_of(tmp_path)


def test_an_empty_path_is_a_gguf_error_not_the_current_folder() -> None:
    with pytest.raises(GgufError, match="an empty path names no file") as refused:
        facts_of("")
    assert os.getcwd() not in str(refused.value)


@pytest.mark.parametrize("path", [b"model.gguf", None, 3])
def test_a_path_that_is_not_text_is_a_type_error_naming_it(path: object) -> None:
    with pytest.raises(TypeError, match=f"a GGUF path must be a str .*, not {type(path).__name__}"):
        facts_of(path)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "key",
    [
        "llama.block_count",
        "llama.embedding_length",
        "llama.attention.head_count",
        "llama.context_length",
    ],
)
def test_a_missing_required_key_is_a_gguf_error_naming_it(tmp_path: Path, key: str) -> None:
    path = write_model(tmp_path / "m.gguf", ModelShape(), drop_keys=(key,))
    with pytest.raises(GgufError) as err:
        facts_of(path)
    assert err.value.key == key
    assert key in str(err.value) and str(path.resolve()) in str(err.value)


def test_a_missing_embedding_is_a_gguf_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", ModelShape(), drop_tensors=("token_embd.weight",))
    with pytest.raises(GgufError, match=r"token_embd\.weight"):
        facts_of(path)


def test_an_unknown_quant_type_is_a_gguf_error_naming_the_tensor(
    tiny: Path, tmp_path: Path
) -> None:
    data = bytearray(tiny.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    struct.pack_into("<I", data, type_at, 77)
    bad = _corrupt(tiny, tmp_path / "bad.gguf", bytes(data))
    with pytest.raises(GgufError, match=r"blk\.0\.attn_q\.weight.*unknown GGML type 77"):
        facts_of(bad)


def test_a_block_beyond_block_count_is_a_gguf_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", ModelShape(n_layers=3))
    data = bytearray(path.read_bytes())
    # Claim two blocks while the file holds three.
    key = b"llama.block_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    struct.pack_into("<I", data, at, 2)
    bad = _corrupt(path, tmp_path / "bad.gguf", bytes(data))
    with pytest.raises(GgufError, match=r"blk\.2\."):
        facts_of(bad)


def test_facts_read_headers_only_so_a_huge_sparse_file_is_fine(tmp_path: Path) -> None:
    """A 60 GiB model (Llama-70B FFN shapes) whose data was never written (a
    sparse file): the facts come from the header alone."""
    path = tmp_path / "huge.gguf"
    writer = GGUFWriter(path, "llama")
    hidden, ffn, layers, vocab = 8192, 28672, 80, 128256
    for key, value in (
        ("block_count", layers),
        ("context_length", 8192),
        ("embedding_length", hidden),
    ):
        getattr(writer, f"add_{key}")(value)
    writer.add_head_count(64)
    writer.add_eos_token_id(2)
    q8 = GGMLQuantizationType.Q8_0
    tensors = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.ffn_gate.weight", (ffn, hidden)),
            (f"blk.{i}.ffn_up.weight", (ffn, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, ffn)),
        ]
    for name, (rows, cols) in tensors:
        writer.add_tensor_info(
            name, (rows, cols * 34 // 32), np.dtype(np.uint8), rows * cols // 32 * 34, raw_dtype=q8
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    data_bytes = sum(rows * cols // 32 * 34 for _, (rows, cols) in tensors)
    os.truncate(path, data_bytes + (1 << 20))  # sparse: no data blocks written
    assert os.path.getsize(path) > 55 * 2**30
    assert os.stat(path).st_blocks * 512 < 1 << 20
    f = facts_of(path)
    assert f.num_layers == layers
    assert sum(f.block_bytes) == layers * 3 * (ffn * hidden // 32 * 34)
    assert f.embedding_bytes == vocab * hidden // 32 * 34
    plan = plan_run(
        f,
        RuntimeConfig(run_id="huge", max_tokens=8),
        NodePool("orch", (NodeSpec("a", 2**40), NodeSpec("b", 2**40))),
        stage_count=2,
    )
    assert isinstance(plan, RunPlan)


def test_a_fifo_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A FIFO at the model's path is refused by its kind: opened, a read of it waits
    for a writer for ever (both CLIs once hung on one)."""
    import threading

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    seen: list[BaseException] = []
    reader = threading.Thread(
        target=lambda: _raised(lambda: facts_of(str(fifo)), seen), daemon=True
    )
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO's header waited"
    assert len(seen) == 1 and isinstance(seen[0], GgufError), seen
    assert "not a regular file" in str(seen[0])


def _raised(call: Callable[[], object], seen: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:  # the test looks at what it was
        seen.append(exc)


@pytest.mark.parametrize("stated", ["0", "the list's less 5", "the list's and 5", "2**32-1"])
def test_vocab_size_beside_a_token_list_is_ignored_as_llamacpp_ignores_it(
    tmp_path: Path, stated: str
) -> None:
    """``llama.vocab_size`` other than ``tokenizer.ggml.tokens``' length: llama.cpp sizes
    the vocabulary, the embedding and the head by the list and runs the file
    (llama-cpp-python 0.3.36, ``scripts/check_refusals_llamacpp.py``), and so does every
    reader here, to the tokens and logits of the file that says the list's length. A key
    of 0 or above the list was refused ("a vocabulary holds at least 1 token",
    "tokenizer.ggml.tokens holds 323 tokens")."""
    ok = write_model(tmp_path / "ok.gguf", ModelShape(n_layers=1))
    tokens = GgufHeader.read(str(ok)).array_length("tokenizer.ggml.tokens")
    bad = vocab_size_beside_the_list(tmp_path, stated)
    assert GgufHeader.read(str(bad)).integer("llama.vocab_size") != tokens
    assert facts_of(str(bad)).vocab_size == tokens
    assert_same_run(str(ok), str(bad), [1, 2, 3], max_tokens=3)


#: ``llama.vocab_size`` values other than the token list's 323, which llama.cpp runs.
VOCAB_SIZES_BESIDE_THE_LIST = {
    "0": 0,
    "the list's less 5": 318,
    "the list's and 5": 328,
    "2**32-1": 2**32 - 1,
}


def vocab_size_beside_the_list(folder: Path, stated: str) -> Path:
    """A one-block llama file whose ``llama.vocab_size`` is ``stated``'s value."""
    value = VOCAB_SIZES_BESIDE_THE_LIST[stated]
    return write_model(
        folder / "vocab.gguf",
        ModelShape(n_layers=1),
        override_keys={"llama.vocab_size": (value, GGUFValueType.UINT32)},
    )


def test_vocab_size_without_a_token_list_sizes_the_vocabulary(tmp_path: Path) -> None:
    """Where the file has no token list, ``llama.vocab_size`` is the vocabulary: 0 is
    refused naming it."""
    path = write_model(
        tmp_path / "m.gguf",
        ModelShape(n_layers=1),
        drop_keys=("tokenizer.ggml.tokens",),
        override_keys={"llama.vocab_size": (0, GGUFValueType.UINT32)},
    )
    with pytest.raises(GgufError, match="0: a vocabulary holds at least 1 token") as info:
        facts_of(str(path))
    assert info.value.key == "llama.vocab_size"


def test_a_path_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    """Plans carry the model's path as UTF-8: a file name of other bytes (which Linux
    file systems allow) is refused at once, where stages once refused their own plans
    and the run waited for them."""
    from runplan.models import ModelNotFound, resolve_model

    ok = write_model(tmp_path / "ok.gguf", ModelShape(n_layers=1))
    odd = os.fsencode(tmp_path) + b"/bad\xff.gguf"
    try:
        os.link(ok, odd)
    except OSError as exc:  # a file system that takes no such name
        pytest.skip(f"this file system refuses a non-UTF-8 name: {exc}")
    with pytest.raises(ModelNotFound, match="not UTF-8"):
        resolve_model(os.fsdecode(odd))


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("llama.attention.head_count_kv", -1, GGUFValueType.INT32),
        ("llama.attention.head_count", 2**64 - 1, GGUFValueType.UINT64),
        ("llama.attention.head_count", 2**40, GGUFValueType.UINT64),
        ("llama.attention.head_count_kv", [-1] * 4, GGUFValueType.ARRAY),
    ],
)
def test_a_head_count_outside_32_bits_is_refused_naming_it(
    tmp_path: Path, key: str, value: int | list[int], kind: GGUFValueType
) -> None:
    """llama.cpp holds head counts as ``uint32_t``: -1 once gave a KV cache of -2 KiB a
    block, 2**40 a plan every stage then refused at load (its tensors' shapes). A count
    stored as another type than UINT32 is refused as llama.cpp refuses it (naming the
    type and the value); one per block, an array of INT32 (as llama.cpp reads them), by
    its range."""
    path = write_model(tmp_path / "m.gguf", ModelShape(), override_keys={key: (value, kind)})
    said = (
        r"-1: it must be in 0\.\.4294967295"
        if isinstance(value, list)
        else rf"found a {kind.name} \({value}\)"
    )
    with pytest.raises(GgufError, match=said) as info:
        facts_of(str(path))
    assert info.value.key == key


def test_the_embedding_has_a_row_per_listed_token_whatever_vocab_size_says(
    tmp_path: Path,
) -> None:
    """llama.cpp sizes the embedding by the token list, whatever ``llama.vocab_size``
    says: a key below the list with an embedding of the list's rows loads there, and
    runs here with the list's vocabulary (the facts once took the key's, and every stage
    refused the embedding); an embedding short of the list is refused there at load, and
    here by the facts, naming both (the plan once passed and every stage refused it)."""
    ok = write_model(tmp_path / "ok.gguf", ModelShape(n_layers=1))
    header = GgufHeader.read(str(ok))
    hidden, rows = header.tensors["token_embd.weight"].shape
    assert rows == header.array_length("tokenizer.ggml.tokens")
    smaller_key = write_model(
        tmp_path / "key.gguf",
        ModelShape(n_layers=1),
        override_keys={"llama.vocab_size": (rows - 6, GGUFValueType.UINT32)},
    )
    assert facts_of(str(smaller_key)).vocab_size == rows
    ran = runtime_sim.generate(str(smaller_key), [1, 2, 3], max_tokens=2, return_logits=True)
    assert ran.outcome == "completed" and ran.logits[0].shape == (rows,)
    tokens = [*GgufHeader.read(str(ok)).strings("tokenizer.ggml.tokens"), *"abcdef"]
    bad = write_model(  # six tokens more than the embedding's rows
        tmp_path / "short.gguf",
        ModelShape(n_layers=1),
        override_keys={"tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY)},
    )
    shown = rf"has shape \[{hidden}, {rows}\].*vocabulary of {rows + 6} tokens"
    with pytest.raises(GgufError, match=shown):
        facts_of(str(bad))


def test_a_block_index_of_thousands_of_digits_is_a_gguf_error(tiny: Path, tmp_path: Path) -> None:
    """Python refuses to read an integer of more than 4300 digits (``ValueError``); a
    tensor named ``blk.<5000 digits>.*`` is no block tensor, and the file is refused."""
    data = bytearray(tiny.read_bytes())
    name = b"blk.0.attn_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name)
    long = b"blk." + b"1" * 5000 + b".attn_norm.weight"
    data[at : at + 8 + len(name)] = struct.pack("<Q", len(long)) + long
    bad = tmp_path / "long.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GgufError, match=r"is not named blk\.<block>\.<name>|blk\.0\."):
        facts_of(str(bad))


def test_keys_named_like_the_packages_header_fields_are_keys(tmp_path: Path) -> None:
    """The gguf package files the header's version and counts among the keys as
    ``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``; a file's own key of such a
    name (llama.cpp reads it as any key) was refused as a duplicate, and other
    ``GGUF.*`` keys were left out of the header's keys (so a split lost them)."""
    path = write_model(
        tmp_path / "m.gguf", ModelShape(), extra_keys={"GGUF.version": "mine", "GGUF.note": 7}
    )
    header = GgufHeader.read(str(path))
    assert {"GGUF.version", "GGUF.note"} <= set(header.keys())
    assert header.string("GGUF.version") == "mine"
    assert not {"GGUF.tensor_count", "GGUF.kv_count"} & set(header.keys())
    assert facts_of(str(path)).num_layers == ModelShape().n_layers


def test_field_bytes_are_each_keys_stored_bytes(smollm2_path: str) -> None:
    """Each key's stored bytes (key, type, value: what content keys and split shards
    hash and copy) against the gguf package's reading of the same field, every key."""
    from gguf import GGUFReader

    header = GgufHeader.read(smollm2_path)
    theirs = GGUFReader(smollm2_path).fields
    keys = header.keys()
    assert keys == [k for k in theirs if not k.startswith("GGUF.")]
    for key in keys:
        want = b"".join(bytes(part.tobytes()) for part in theirs[key].parts)
        assert header.field_bytes(key) == want, key


@pytest.mark.parametrize(
    ("key", "value", "kind", "said"),
    [
        ("llama.block_count", -1, GGUFValueType.INT32, r"expected a UINT32.*INT32 \(-1\)"),
        ("llama.block_count", 0, GGUFValueType.UINT32, "0 blocks: a model has at least one"),
        ("general.architecture", "", GGUFValueType.STRING, "is empty: the file names no arch"),
    ],
)
def test_a_bad_value_is_named_not_what_it_breaks_later(
    tmp_path: Path, key: str, value: object, kind: GGUFValueType, said: str
) -> None:
    """Each once blamed something else: a block count of -1 or 0 "a tensor names a
    block outside 0..-2"; an empty architecture "'.block_count': required key is
    missing". (A ``vocab_size`` of 1 beside a longer token list once made the file's
    end-of-sequence id "missing"; the list sizes the vocabulary now, as llama.cpp's.)"""
    path = write_model(tmp_path / "m.gguf", ModelShape(), override_keys={key: (value, kind)})
    with pytest.raises(GgufError, match=said):
        facts_of(str(path))
