"""``model_facts_from_gguf``: the planner's view of a model, from its header only."""

from __future__ import annotations

import os

from runplan.facts import GgufSource, ModelFacts
from runplan.gguf_header import GgufError, GgufHeader, model_id_for
from runplan.layer_attention import layer_attention

_BLOCK_PREFIX = "blk."
EMBEDDING_TENSOR = "token_embd.weight"
OUTPUT_TENSOR = "output.weight"
OUTPUT_NORM_TENSOR = "output_norm.weight"


def model_facts_from_gguf(
    path: str | os.PathLike[str], max_seq_len: int | None = None
) -> ModelFacts:
    """Facts of the model in ``path`` (a GGUF file, or any file of a llama.cpp split
    set). Reads headers only. ``max_seq_len`` defaults to the model's context length.

    Raises ``GgufError`` naming the file (and the key) when a file is not GGUF, is
    truncated or malformed, or lacks a key or tensor a model needs.
    """
    header = GgufHeader.read(path)
    return facts_from_header(header, max_seq_len=max_seq_len)


def facts_from_header(header: GgufHeader, *, max_seq_len: int | None = None) -> ModelFacts:
    first = header.paths[0]
    arch = header.string("general.architecture")
    num_layers = header.integer(f"{arch}.block_count")
    hidden = header.integer(f"{arch}.embedding_length")
    heads = header.integer(f"{arch}.attention.head_count")
    heads_kv = header.integer(f"{arch}.attention.head_count_kv", default=heads)
    default_head_dim = hidden // heads if heads > 0 else 0
    head_dim_k = header.integer(f"{arch}.attention.key_length", default=default_head_dim)
    head_dim_v = header.integer(f"{arch}.attention.value_length", default=default_head_dim)
    context_length = header.integer(f"{arch}.context_length")
    eos = header.integer("tokenizer.ggml.eos_token_id")

    tensors = header.tensors
    if EMBEDDING_TENSOR not in tensors:
        raise GgufError(first, f"the model has no {EMBEDDING_TENSOR!r} tensor")
    embedding = tensors[EMBEDDING_TENSOR]
    vocab = vocab_size(header, arch)

    block_bytes = [0] * max(num_layers, 0)
    block_elements = [0] * max(num_layers, 0)
    shared = shared_elements = 0
    for name, info in tensors.items():
        if name.startswith(_BLOCK_PREFIX):
            index_text = name[len(_BLOCK_PREFIX) :].split(".", 1)[0]
            if not index_text.isdigit() or int(index_text) >= num_layers:
                raise GgufError(
                    first,
                    f"tensor {name!r} names a block outside 0..{num_layers - 1}",
                    f"{arch}.block_count",
                )
            block_bytes[int(index_text)] += info.n_bytes
            block_elements[int(index_text)] += _elements(info.shape)
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
        model_id=model_id_for(first),
        gguf_source=GgufSource(paths=header.paths),
        architecture=arch,
        num_layers=num_layers,
        hidden_dim=hidden,
        head_count=heads,
        head_count_kv=heads_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        vocab_size=vocab,
        eos_token_id=eos,
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


def vocab_size(header: GgufHeader, arch: str) -> int:
    """``{arch}.vocab_size``, else the number of tokens, else the token embedding's
    second dimension (``GgufError`` when there is none of them)."""
    if header.has(f"{arch}.vocab_size"):
        return header.integer(f"{arch}.vocab_size")
    if header.has("tokenizer.ggml.tokens"):
        return header.array_length("tokenizer.ggml.tokens")
    info = header.tensors.get(EMBEDDING_TENSOR)
    if info is None or len(info.shape) != 2:
        raise GgufError(header.paths[0], f"no 2-d {EMBEDDING_TENSOR!r} to size the vocabulary")
    return info.shape[1]


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
