"""``model_facts_from_gguf``: the planner's view of a model, from its header only."""

from __future__ import annotations

import os

from runplan.block_values import model_integer
from runplan.end_tokens import header_end_of_generation_ids
from runplan.facts import GgufSource, ModelFacts
from runplan.gguf_error import GgufError
from runplan.gguf_files import model_id_for
from runplan.gguf_header import GgufHeader
from runplan.layer_attention import layer_attention
from runplan.shards import ShardKeys
from runplan.tensor_names import (
    BLOCK_TENSOR,
    EMBEDDING_TENSOR,
    OUTPUT_NORM_TENSOR,
    OUTPUT_TENSOR,
    block_index,
)
from runplan.validate import U32_MAX

__all__ = [
    "BLOCK_TENSOR",
    "EMBEDDING_TENSOR",
    "OUTPUT_NORM_TENSOR",
    "OUTPUT_TENSOR",
    "block_count",
    "block_index",
    "facts_from_header",
    "model_facts_from_gguf",
    "special_token_id",
    "vocab_size",
]
#: llama.cpp's default special token ids of each tokenizer model (``llama-vocab.cpp``),
#: used when a file names none (or one outside its vocabulary).
SPECIAL_TOKEN_DEFAULTS: dict[str, dict[str, int | None]] = {
    "gpt2": {"bos": 11, "eos": 11, "unk": None},
    "llama": {"bos": 1, "eos": 2, "unk": 0},
}
#: The key of each special token's id.
SPECIAL_TOKEN_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
}


def model_facts_from_gguf(
    path: str | os.PathLike[str], max_seq_len: int | None = None
) -> ModelFacts:
    """Facts of the model in ``path`` (a GGUF file, or any file of a llama.cpp split
    set). Reads headers only. ``max_seq_len`` defaults to the model's context length.

    Raises ``GgufError`` naming the file (and the key) when a file is not GGUF, is
    truncated or malformed, or lacks a key or tensor a model needs (an empty path
    too); ``TypeError`` for a path that is not a ``str`` or a path-like of one.
    """
    header = GgufHeader.read(path)
    return facts_from_header(header, max_seq_len=max_seq_len)


def facts_from_header(header: GgufHeader, *, max_seq_len: int | None = None) -> ModelFacts:
    """Facts of the model in ``header``. Where llama.cpp has a default for a key the
    file lacks, the facts use it: ``head_count_kv`` = ``head_count``, key and value head
    sizes = ``embedding_length / head_count``, the vocabulary from the token list, the
    tokenizer model's end-of-sequence id; a key llama.cpp requires raises ``GgufError``
    naming it."""
    first = header.paths[0]
    arch = header.string("general.architecture")
    if not arch:  # every key of the model is named by it ("{arch}.block_count")
        raise GgufError(first, "is empty: the file names no architecture", "general.architecture")
    header.check_every_file_types(arch)
    num_layers = block_count(header, arch)
    hidden = header.dimension(f"{arch}.embedding_length")
    heads = model_integer(header, f"{arch}.attention.head_count", num_layers)
    heads_kv = model_integer(header, f"{arch}.attention.head_count_kv", num_layers, heads)
    for key, count in (("head_count", heads), ("head_count_kv", heads_kv)):
        if not 0 <= count <= U32_MAX:  # llama.cpp's uint32_t; 0 an architecture's own
            raise GgufError(
                first, f"{count}: it must be in 0..{U32_MAX}", f"{arch}.attention.{key}"
            )
    default_head_dim = hidden // heads if heads > 0 else 0
    head_dim_k = header.dimension(f"{arch}.attention.key_length", default=default_head_dim)
    head_dim_v = header.dimension(f"{arch}.attention.value_length", default=default_head_dim)
    context_length = header.integer(f"{arch}.context_length")  # a UINT32; 0: none stated

    tensors = header.tensors
    if EMBEDDING_TENSOR not in tensors:
        raise GgufError(first, f"the model has no {EMBEDDING_TENSOR!r} tensor")
    embedding = tensors[EMBEDDING_TENSOR]
    vocab = vocab_size(header, arch)
    # what llama.cpp's loader requires of it: its rows are the token list's (llama.cpp
    # sizes the vocabulary by the list, whatever {arch}.vocab_size says)
    listed = header.has("tokenizer.ggml.tokens")
    rows = header.array_length("tokenizer.ggml.tokens") if listed else vocab
    if embedding.shape != (hidden, rows):
        raise GgufError(
            first,
            f"{EMBEDDING_TENSOR!r} has shape {list(embedding.shape)}; the model's "
            f"embedding_length {hidden} and vocabulary of {rows} tokens make it "
            f"{[hidden, rows]}",
        )
    eos = special_token_id(header, "eos", vocab)
    if eos is None:
        eos_key = "tokenizer.ggml.eos_token_id"
        why = (
            f"{header.integer(eos_key)} is outside the vocabulary of {vocab} tokens"
            if header.has(eos_key)
            else "missing"
        )
        raise GgufError(
            first,
            f"{why}, and the file's tokenizer model has no default end-of-sequence id "
            "in its vocabulary",
            eos_key,
        )

    block_bytes = [0] * num_layers
    block_elements = [0] * num_layers
    shared = shared_elements = 0
    for name, info in tensors.items():
        block = block_index(name)
        if block is not None:
            block_bytes[block] += info.n_bytes
            block_elements[block] += _elements(info.shape)
        elif name not in (EMBEDDING_TENSOR, OUTPUT_TENSOR, OUTPUT_NORM_TENSOR):
            shared += info.n_bytes
            shared_elements += _elements(info.shape)

    tied = OUTPUT_TENSOR not in tensors
    head = embedding if tied else tensors[OUTPUT_TENSOR]
    norm = tensors.get(OUTPUT_NORM_TENSOR)
    output_bytes = head.n_bytes + (norm.n_bytes if norm is not None else 0)
    output_elements = _elements(head.shape) + (_elements(norm.shape) if norm is not None else 0)
    attention = layer_attention(header, arch, max(num_layers, 0))

    return ModelFacts(
        model_id=header.model_id or model_id_for(first),
        gguf_source=GgufSource(paths=header.source_paths),
        architecture=arch,
        num_layers=num_layers,
        hidden_dim=hidden,
        head_count=heads,
        head_count_kv=heads_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        vocab_size=vocab,
        eos_token_id=eos,
        eog_token_ids=header_end_of_generation_ids(header, eos, vocab),
        expert_count=expert_count(header, arch),
        context_length=context_length,
        max_seq_len=context_length if max_seq_len is None else max_seq_len,
        quant_types=tuple(sorted({t.ggml_type for t in tensors.values()})),
        block_bytes=tuple(block_bytes),
        embedding_bytes=embedding.n_bytes,
        output_bytes=output_bytes,
        shared_bytes=shared,
        tied_embeddings=tied,
        block_elements=tuple(block_elements),
        embedding_elements=_elements(embedding.shape),
        output_elements=output_elements,
        shared_elements=shared_elements,
        layer_windows=tuple(a.window for a in attention),
        layer_rope_freq_bases=tuple(a.rope_freq_base for a in attention),
    )


def expert_count(header: GgufHeader, arch: str) -> int:
    """``{arch}.expert_count``: 0 (absent too) for a model without experts; a negative
    count is a ``GgufError`` naming it (not read as none)."""
    key = f"{arch}.expert_count"
    count = header.integer(key, default=0)
    if count < 0:
        raise GgufError(
            header.paths[0], f"an expert count of {count}: it must not be negative", key
        )
    return count


def block_count(header: GgufHeader, arch: str) -> int:
    """``{arch}.block_count``, checked against the file's tensors before anything is
    made per block: every block ``0..n-1`` holds at least one tensor and no tensor names
    a block past them (``GgufError`` naming the key otherwise). So a forged count of
    billions fails at once, and a file holding only some of a model's blocks (a shard
    cut by block, which llama.cpp does not write) is refused here, not by a stage.

    The one exception, on purpose: a header read through a shard manifest of the shards
    one stage needs (``header.held_blocks``, ``runplan.shards``) holds the blocks the
    manifest says, and only those."""
    key = f"{arch}.block_count"
    n = header.integer(key)
    first = header.paths[0]
    if n < 1:  # before the tensors, which would name a block "outside 0..-1"
        raise GgufError(first, f"{n} blocks: a model has at least one", key)
    blocks: set[int] = set()
    for name in header.tensors:
        block = block_index(name)
        if block is None:
            if name.startswith("blk."):
                raise GgufError(first, f"tensor {name!r} is not named blk.<block>.<name>", key)
            continue
        if block >= n:
            raise GgufError(first, f"tensor {name!r} names a block outside 0..{n - 1}", key)
        blocks.add(block)
    if header.held_blocks is not None:  # some shards, through their manifest
        if blocks != header.held_blocks:
            raise GgufError(first, "the shards do not hold the blocks their manifest says", key)
        return n
    if len(blocks) < n:
        missing = next(i for i in range(len(blocks) + 1) if i not in blocks)
        shard = ""
        if header.has(ShardKeys.LAYER_START):
            shard = (
                "; it is a shard written by 'python -m runplan split': read it through "
                "its manifest (the folder, or its manifest.json)"
            )
        raise GgufError(
            first,
            f"{n} blocks, but the file holds tensors of {len(blocks)} "
            f"(none of block {missing}); a file holding only some blocks is not a model" + shard,
            key,
        )
    return n


def special_token_id(header: GgufHeader, kind: str, n_vocab: int) -> int | None:
    """The id of special token ``kind`` (``bos``, ``eos``, ``unk``) as llama.cpp reads
    it: its key (``SPECIAL_TOKEN_KEYS``) when inside the vocabulary, else the tokenizer
    model's default (``SPECIAL_TOKEN_DEFAULTS``) when that is inside it, else
    ``None``."""
    model = header.string("tokenizer.ggml.model", "")
    default = SPECIAL_TOKEN_DEFAULTS.get(model, {}).get(kind)
    if default is not None and not 0 <= default < n_vocab:
        default = None
    key = SPECIAL_TOKEN_KEYS[kind]
    if not header.has(key):
        return default
    value = header.integer(key)
    return value if 0 <= value < n_vocab else default


def vocab_size(header: GgufHeader, arch: str) -> int:
    """The number of tokens in ``tokenizer.ggml.tokens``, else ``{arch}.vocab_size``,
    else the token embedding's second dimension (``GgufError`` when there is none of
    them). llama.cpp sizes the embedding and head by the token list and reads
    ``{arch}.vocab_size`` only for its type: beside a list the key's value is ignored
    (0, or above or below the list, as llama.cpp runs such a file), its type checked."""
    key = f"{arch}.vocab_size"
    stated = header.integer(key) if header.has(key) else None  # a UINT32, as llama.cpp's
    if header.has("tokenizer.ggml.tokens"):
        return header.array_length("tokenizer.ggml.tokens")
    if stated is not None:
        if stated < 1:
            raise GgufError(header.paths[0], f"{stated}: a vocabulary holds at least 1 token", key)
        return stated
    info = header.tensors.get(EMBEDDING_TENSOR)
    if info is None or len(info.shape) != 2:
        raise GgufError(header.paths[0], f"no 2-d {EMBEDDING_TENSOR!r} to size the vocabulary")
    return info.shape[1]


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
