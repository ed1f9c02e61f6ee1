"""Element types that cross edges: the (family, width) pairs the object header can name."""

from __future__ import annotations

import enum


class DTypeFamily(enum.Enum):
    """The family of an element type; the width in bytes is carried beside it."""

    FLOAT = "FLOAT"  # IEEE 754 binary16 / binary32
    BFLOAT = "BFLOAT"  # bfloat16
    UINT = "UINT"  # unsigned integers (token ids)


#: Widths in bytes that each family may have. The object header knows exactly these
#: four element types: u32 token ids, f16, bf16 and f32 activations.
VALID_WIDTHS: dict[DTypeFamily, frozenset[int]] = {
    DTypeFamily.FLOAT: frozenset({2, 4}),
    DTypeFamily.BFLOAT: frozenset({2}),
    DTypeFamily.UINT: frozenset({4}),
}

#: Short names used on command lines and in reports.
DTYPE_NAMES: dict[tuple[DTypeFamily, int], str] = {
    (DTypeFamily.FLOAT, 4): "f32",
    (DTypeFamily.FLOAT, 2): "f16",
    (DTypeFamily.BFLOAT, 2): "bf16",
    (DTypeFamily.UINT, 4): "u32",
}
DTYPES_BY_NAME: dict[str, tuple[DTypeFamily, int]] = {v: k for k, v in DTYPE_NAMES.items()}


def width_is_valid(family: DTypeFamily, width: int) -> bool:
    """True when ``width`` bytes is a width that ``family`` has."""
    return width in VALID_WIDTHS[family]
