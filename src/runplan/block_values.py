"""Hyperparameters llama.cpp reads as one number for every block or an array of one per
block (``get_key_or_arr`` in ``llama-model.cpp``): ``{arch}.feed_forward_length``,
``.attention.head_count`` and ``.attention.head_count_kv``.

An array must hold integers (llama.cpp takes arrays of UINT32 and INT32), one per
block; anything else is a ``GgufError`` naming the key. Feed-forward sizes may differ
between blocks; head counts are read as one number for the model, so an array of head
counts that differ between blocks is refused naming the key and its values (no worker
runs blocks of different head counts). Feed-forward sizes are each in 1..2**32-1
(``per_block_dimensions``).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFValueType

from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runplan.validate import U32_MAX

#: The array item types llama.cpp's ``get_arr`` takes for a per-block integer.
_ITEM_TYPES = (np.dtype(np.uint32), np.dtype(np.int32))


def per_block_integers(
    header: GgufHeader, key: str, n_blocks: int, default: int | None = None
) -> tuple[int, ...]:
    """The value of ``key`` for each of ``n_blocks`` blocks: a number for every block,
    or an array of one per block (``default`` for every block when the key is absent;
    ``GgufError`` when it is absent without one)."""
    if not header.has(key) or header.value_type(key) != GGUFValueType.ARRAY:
        return (header.integer(key, default),) * n_blocks
    n = header.array_length(key)
    values = header.array(key) if n else None  # (an array of strings is refused)
    if values is None or values.dtype not in _ITEM_TYPES or n != n_blocks:
        raise GgufError(
            header.paths[0],
            f"an array of {n} {'items' if values is None else values.dtype.name}; an "
            f"array here holds one UINT32 or INT32 per block ({n_blocks} blocks)",
            key,
        )
    return tuple(int(v) for v in values)


def per_block_dimensions(header: GgufHeader, key: str, n_blocks: int) -> tuple[int, ...]:
    """``per_block_integers`` that size a block (a feed-forward length): each in
    1..2**32-1, as ``GgufHeader.dimension`` has a model's sizes; else ``GgufError``
    naming the key, the value and, in an array, its block."""
    values = per_block_integers(header, key, n_blocks)
    per_block = header.value_type(key) == GGUFValueType.ARRAY
    for block, value in enumerate(values):
        if not 1 <= value <= U32_MAX:
            where = f"block {block}'s " if per_block else ""
            raise GgufError(header.paths[0], f"{where}{value}: it must be in 1..{U32_MAX}", key)
    return values


def model_integer(header: GgufHeader, key: str, n_blocks: int, default: int | None = None) -> int:
    """``per_block_integers`` that must be one value for the whole model: an array of
    equal values is that value; one of values that differ is a ``GgufError`` naming
    them."""
    values = per_block_integers(header, key, n_blocks, default)
    if len(set(values)) > 1:
        raise GgufError(
            header.paths[0],
            f"one value per block, and they differ ({list(values)}); blocks that differ in "
            "it are not supported",
            key,
        )
    return values[0] if values else header.integer(key, default)
