"""The GGUF weight types the project runs, one table for every package: the types every
worker runs (the reference worker's, the CPU and CUDA kernels'), and their block
geometry.

Every kernel reads a row in chunks of 32 elements (``CHUNK``): one block of the
32-element types, one eighth of a K-quant super-block, 32 values of a float type.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

CHUNK = 32

#: Types without blocks: a one-row product reads float32 activations.
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")
#: Types whose one-row product runs on 8-bit activations (``matvec_q8_<T>``).
Q8_TYPES: tuple[str, ...] = (
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
#: Every type the workers run (all fifteen: the reference, CPU and CUDA workers').
QUANT_TYPES: tuple[str, ...] = FLOAT_TYPES + Q8_TYPES


def block_elems(qtype: str) -> int:
    return int(GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0])


def block_bytes(qtype: str) -> int:
    return int(GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1])


def row_bytes(qtype: str, n: int) -> int:
    """Bytes of a row of ``n`` elements (``n`` a multiple of the block)."""
    elems = block_elems(qtype)
    if n % elems:
        raise ValueError(f"{qtype}: a row of {n} elements is not whole blocks of {elems}")
    return n // elems * block_bytes(qtype)


def uses_q8(qtype: str, mode: str) -> bool:
    """Whether a one-row product of a ``qtype`` matrix runs on 8-bit activations."""
    return mode == "q8" and qtype in QUANT_TYPES and qtype not in FLOAT_TYPES
