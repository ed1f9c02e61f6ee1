"""The attention heads a model may have: the rules by which llama.cpp refuses a file.

``ModelConfig.from_header`` reads the sizes; these check them, each failure a typed
error naming the key that set the bad value:

- At least one attention head, sharing a whole number of key/value heads
  (``GgufError``).
- Value heads as wide as key heads (``value_length`` = ``key_length``): llama.cpp's
  loaders of every architecture here size the attention output by the key heads.
- qwen2's, qwen2moe's and phi3's heads fill ``embedding_length`` exactly (``heads *
  key_length`` and ``heads * value_length``): llama.cpp sizes their query and attention
  output by it (``ArchSpec.hidden_wide_attention``), so another width is refused.
- ``rope.dimension_count`` is even, at least 2 and at most the key head size; it must be
  the key head size but for the gemmas and phi3, as llama.cpp's loader (llama's) or graph
  (the others') requires (``ArchSpec.whole_head_rotary``).
"""

from __future__ import annotations

from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runtime_core.architectures import ArchSpec
from runtime_core.errors import UnsupportedModel


def head_counts(header: GgufHeader, arch: str, heads: int, heads_kv: int) -> None:
    """At least one attention head, and key/value heads that the heads share evenly;
    else ``GgufError`` naming ``head_count`` or ``head_count_kv``."""
    path = header.paths[0]
    if heads < 1:  # (the key/value heads' key names a count of its own)
        raise GgufError(
            path,
            f"{heads} attention heads: the {arch} architecture has at least one",
            f"{arch}.attention.head_count",
        )
    if heads_kv < 1 or heads % heads_kv:
        raise GgufError(
            path,
            f"{heads} attention heads cannot share {heads_kv} key/value heads",
            f"{arch}.attention.head_count_kv",
        )


def values_as_wide_as_keys(header: GgufHeader, arch: str, head_dim_k: int, head_dim_v: int) -> None:
    """Value heads as wide as the key heads, for every architecture we run: llama.cpp's
    loaders size the attention output by the key heads (or the keys by the value heads:
    qwen3's), so it refuses a file whose ``value_length`` differs by its tensors' shapes;
    else ``UnsupportedModel`` naming ``value_length`` (``key_length`` where the file sets
    only that one, the value heads then ``embedding_length / head_count``)."""
    if head_dim_v == head_dim_k:
        return
    key = f"{arch}.attention.value_length"
    if not header.has(key):
        key = f"{arch}.attention.key_length"
    raise UnsupportedModel(
        header.paths[0],
        f"value heads of {head_dim_v} where the key heads are {head_dim_k}: the {arch} "
        "architecture's are the same size (llama.cpp sizes its attention output by the "
        "key heads, and refuses the tensors of such a file)",
        key=key,
    )


def heads_as_wide_as_hidden(
    header: GgufHeader, arch: str, hidden: int, heads: int, head_dim: int
) -> None:
    """An architecture whose query and attention output llama.cpp sizes by
    ``embedding_length`` (``ArchSpec.hidden_wide_attention``): its heads fill it exactly
    (the value heads are as wide: ``values_as_wide_as_keys``), else ``UnsupportedModel``
    naming ``key_length`` (``head_count`` where the file sets no head size) and the
    widths, as llama.cpp refuses the file ("tensor 'blk.0.attn_q.weight' has wrong
    shape")."""
    if heads * head_dim == hidden:
        return
    key = f"{arch}.attention.key_length"
    if not header.has(key):
        key = f"{arch}.attention.head_count"
    raise UnsupportedModel(
        header.paths[0],
        f"{heads} heads of {head_dim} are {heads * head_dim} wide; the {arch} "
        f"architecture's query and attention output are embedding_length ({hidden}) "
        "wide (llama.cpp sizes its attn_q and attn_output by it)",
        key=key,
    )


def rotary_within_heads(
    header: GgufHeader, arch: str, spec: ArchSpec, head_dim: int, n_dims: int
) -> None:
    """``n_dims`` rotary dimensions (``rope.dimension_count``) for key heads of
    ``head_dim``: even, at least 2 and at most ``head_dim``, and ``head_dim`` itself
    where the architecture rotates whole heads (``ArchSpec.whole_head_rotary``); else
    ``UnsupportedModel`` naming ``rope.dimension_count`` and what sized the heads."""
    partial = spec.whole_head_rotary and n_dims != head_dim
    if not (partial or n_dims < 2 or n_dims % 2 or n_dims > head_dim):
        return
    size_key = f"{arch}.attention.key_length"
    sized_by = (
        size_key
        if header.has(size_key)
        else f"{arch}.embedding_length / {arch}.attention.head_count"
    )
    whole = f": the {arch} architecture rotates whole heads" if partial else ""
    raise UnsupportedModel(
        header.paths[0],
        f"rotary dimension count {n_dims} for heads of {head_dim} ({sized_by}){whole}",
        key=f"{arch}.rope.dimension_count",
    )
