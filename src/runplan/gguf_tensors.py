"""The tensor infos of a GGUF file, checked as llama.cpp's reader checks them: a known
type, a shape whose rows are whole blocks, and data that starts where the tensor before
it ends (rounded up to the file's alignment) and ends inside the file; each a
``TensorInfo`` with llama.cpp's shape (``ggml_shape``)."""

from __future__ import annotations

from attrs import frozen
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runplan.gguf_error import GgufError
from runplan.gguf_reader import HeaderReader


@frozen
class TensorInfo:
    """One tensor as the header describes it. ``shape`` is llama.cpp's ``ne``,
    fastest-varying dimension first, as llama.cpp reads it: trailing dimensions of size
    1 dropped (``ggml_shape``), so a norm some converter stored as ``[n_embd, 1]`` is
    ``(n_embd,)``, the shape every reader of a ``TensorInfo`` compares and slices by."""

    name: str
    ggml_type: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]
    n_bytes: int
    file_index: int  # which file of the source holds it
    offset: int  # absolute byte offset of the data in that file


def ggml_shape(stored: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as stored in a GGUF file without its trailing dimensions of size
    1 (at least one dimension kept): llama.cpp pads every shape to four dimensions with
    1s before comparing it, so ``[n, 1]`` and ``[n, 1, 1, 1]`` are ``[n]`` to it. A 1 before
    a larger dimension (``[1, n]``) is kept: llama.cpp refuses it where ``[n]`` belongs."""
    end = len(stored)
    while end > 1 and stored[end - 1] == 1:
        end -= 1
    return stored[:end]


def _tensor_infos(path: str, reader: HeaderReader, index: int) -> list[TensorInfo]:
    """The tensors of one file, checked as llama.cpp's reader checks them: a known type,
    a shape whose rows are whole blocks, and data that starts where the tensor before
    it ends (rounded up to the file's alignment) and ends inside the file."""
    alignment = int(reader.alignment)
    data_start = int(reader.data_offset)
    size = len(reader.data)
    expected = 0  # where the next tensor's data must start, relative to data_start
    out = []
    for raw in reader.tensor_infos:
        name, shape = raw.name, raw.shape
        try:
            qtype = GGMLQuantizationType(raw.raw_type)
        except ValueError:
            raise GgufError(path, f"tensor {name!r} has unknown GGML type {raw.raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = 1
        for d in shape:
            n_elems *= d
        if not shape or any(d < 1 for d in shape) or shape[0] % block_size or n_elems >= 2**63:
            raise GgufError(
                path, f"tensor {name!r} has shape {list(shape)}, impossible for {qtype.name}"
            )
        n_bytes = n_elems // block_size * type_size
        if raw.offset != expected:
            raise GgufError(
                path,
                f"tensor {name!r} has its data at offset {raw.offset}; it follows the "
                f"tensor before it, at {expected} (each tensor's data is aligned to "
                f"{alignment} bytes)",
            )
        start = data_start + raw.offset
        if start + n_bytes > size:
            raise GgufError(
                path,
                f"truncated: tensor {name!r} needs bytes up to {start + n_bytes}, "
                f"the file has {size}",
            )
        expected += -(-n_bytes // alignment) * alignment
        out.append(TensorInfo(name, qtype.name, ggml_shape(shape), n_bytes, index, start))
    return out
