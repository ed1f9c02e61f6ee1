"""Random but valid GGUF rows of every type the kernels read, built directly.

Every bit pattern of a block's quants and packed scales is a valid block; only the
float16 factors must be finite. ``random_rows`` fills a block with random bytes and
then writes its factors (d, and m or dmin) so that the dequantized values have a
standard deviation near ``scale`` and a mean near zero, as a model's weights do. This
is fast enough to write a model with Llama-3-8B shapes in seconds (the gguf package
cannot quantize to K-quants, and quantizing 8 billion floats would take minutes), and
covers every bit of every layout (tests of the decoders use it too).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from runplan.quant_types import block_bytes, block_elems
from runtime_core.activations import float32_to_bf16

#: Per type: byte offsets of d (and of m / dmin), the spread of the integer part of a
#: value (so d = scale / spread), and the offset dmin / d (or -m / d) that centres it.
_FACTORS: dict[str, tuple[int, int | None, float, float]] = {
    "Q8_0": (0, None, 74.0, 0.0),
    "Q4_0": (0, None, 4.6, 0.0),
    "Q4_1": (0, 2, 4.6, 7.5),
    "Q5_0": (0, None, 9.2, 0.0),
    "Q5_1": (0, 2, 9.2, 15.5),
    "Q2_K": (80, 82, 8.4, 1.5),
    "Q3_K": (108, None, 41.0, 0.0),
    "Q4_K": (0, 2, 145.0, 7.5),
    "Q5_K": (0, 2, 290.0, 15.5),
    "Q6_K": (208, None, 1184.0, 0.0),
    "IQ4_NL": (0, None, 67.0, 0.0),
    "IQ4_XS": (0, None, 1240.0, 0.0),  # values near 67, scales -32 .. 31 (18.5 rms)
}


def _put_f16(blocks: npt.NDArray[np.uint8], at: int, values: npt.NDArray[np.float32]) -> None:
    blocks[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_rows(
    rng: np.random.Generator, qtype: str, rows: int, n: int, scale: float = 1.0
) -> npt.NDArray[np.uint8]:
    """``rows`` random rows of ``n`` elements of ``qtype``: ``(rows, row_bytes)`` uint8."""
    if qtype == "F32":
        return (rng.standard_normal((rows, n), dtype=np.float32) * np.float32(scale)).view(np.uint8)
    if qtype == "F16":
        values = rng.standard_normal((rows, n), dtype=np.float32) * np.float32(scale)
        return values.astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        values = rng.standard_normal((rows, n), dtype=np.float32) * np.float32(scale)
        return float32_to_bf16(values).view(np.uint8).reshape(rows, -1)
    elems, size = block_elems(qtype), block_bytes(qtype)
    if n % elems:
        raise ValueError(f"{qtype}: rows of {n} are not whole blocks of {elems}")
    nb = n // elems
    data = np.frombuffer(rng.bytes(rows * nb * size), np.uint8).reshape(rows, nb, size).copy()
    d_at, m_at, spread, centre = _FACTORS[qtype]
    d = (scale / spread) * rng.uniform(0.5, 1.5, (rows, nb)).astype(np.float32)
    _put_f16(data, d_at, d)
    if m_at is not None:
        if qtype in ("Q4_1", "Q5_1"):  # v = d q + m: m = -centre d
            _put_f16(data, m_at, -centre * d)
        else:  # v = d sc q - dmin m: dmin = d centre (the scales and mins are alike)
            _put_f16(data, m_at, centre * d)
    return data.reshape(rows, nb * size)


def filled_rows(qtype: str, rows: int, n: int, fill: int, d: float) -> npt.NDArray[np.uint8]:
    """``rows`` rows of ``n`` elements of a block ``qtype`` whose every byte is ``fill``
    but the factors (d, and dmin or m where the type has one), which are the half ``d``:
    0xFF gives every quant (and K-quant scale) its largest code, the extremes that bound
    a kernel's integer sums."""
    elems, size = block_elems(qtype), block_bytes(qtype)
    if n % elems:
        raise ValueError(f"{qtype}: rows of {n} are not whole blocks of {elems}")
    data = np.full((rows, n // elems, size), fill, np.uint8)
    d_at, m_at, _, _ = _FACTORS[qtype]
    factor = np.full((rows, n // elems), d, np.float32)
    _put_f16(data, d_at, factor)
    if m_at is not None:
        _put_f16(data, m_at, factor)
    return data.reshape(rows, -1)
