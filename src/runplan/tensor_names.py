"""The names llama.cpp gives a model's tensors, as far as planning and slicing care:
block tensors ``blk.{i}.*``, the token embedding, the output norm and the head."""

from __future__ import annotations

import re

#: A block tensor's name as llama.cpp writes it: ``blk.{i}.{rest}``, ``i`` in decimal,
#: at most 10 digits (a block count is 32 bits; Python refuses to read an integer of
#: more than 4300 digits, which a hostile name may hold).
BLOCK_TENSOR = re.compile(r"blk\.(0|[1-9][0-9]{0,9})\.(.+)", re.ASCII)
EMBEDDING_TENSOR = "token_embd.weight"
OUTPUT_TENSOR = "output.weight"
OUTPUT_NORM_TENSOR = "output_norm.weight"


def block_index(name: str) -> int | None:
    """The block a tensor belongs to (``blk.{i}.*``), or ``None`` for other tensors."""
    m = BLOCK_TENSOR.fullmatch(name)
    return int(m[1]) if m is not None else None
