"""The CPU worker's step buffers: the rows a step's operations read and write.

A bound stage holds the buffers of steps of up to ``KEPT_ROWS`` rows (and the 8-bit,
half or bfloat16 forms of their sources), every page written at bind: each step of up to
that many rows (decode rows, batches, prefill chunks) takes views of their first rows,
so steps whose row counts change make no buffers, and none of them, the first after
bind included, takes a page fault in them; a step program (``csrc/program.c``) records
their addresses once. A longer step (a prefill chunk of more rows) makes its own, which
go when it ends (``CpuOps.end_step``) but for its output rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from runplan.quant_types import CHUNK
from runtime_core.workers.cpu import _kernels

F32 = npt.NDArray[np.float32]
PAGE = 4096
#: the rows of the step buffers a stage makes when it binds and keeps (a batch of decode
#: rows, a prefill chunk of up to this many): every step of at most this many rows takes
#: views of them; a step of more rows (a longer prefill chunk) makes its own for that step
KEPT_ROWS = 64
#: bytes between the places in their pages where two step buffers start (``RowSet``)
STAGGER = 320
#: bytes a row of 8-bit activations is padded by (``q_row_stride``)
Q_PAD = 64


def q_row_stride(n: int) -> int:
    """Bytes between rows of ``n`` 8-bit activations: ``n`` and a cache line, more if that
    put rows a whole number of 2 KiB apart. A prefill's tile reads a block of each of
    its rows in turn; rows a whole number of 4 KiB apart (a hidden size of 4096) made
    Q4_0's tile of 32 rows some 20 % slower on AVX2 and AVX-512 BW
    (``benchmarks/cpu_repack.py --rows 32`` against ``--packed-q``, docs/benchmarks.md):
    most likely reads waiting on stores 4 KiB away, which a processor takes for the same
    address until it compares the rest (the slowdown measured, its cause not)."""
    stride = n + Q_PAD
    return stride + Q_PAD if stride % 2048 == 0 else stride


def q_rows(alloc: Any, rows: int, n: int) -> npt.NDArray[np.int8]:
    """``rows`` rows of ``n`` 8-bit activations, ``q_row_stride(n)`` bytes apart (a view
    of wider rows that ``_kernels.linear`` reads and writes as such)."""
    wide: npt.NDArray[np.int8] = alloc((rows, q_row_stride(n)), np.int8)
    return wide[:, :n]


def buffer(shape: int | tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
    """A buffer the kernels write before anything reads it: zeros, or, from a debug build
    of the kernels (``_kernels.POISON``: ``make sanitize-address``), 0xFF bytes (NaN as
    a float or a half), so that a value read before it was written shows."""
    if not _kernels.POISON:
        return np.zeros(shape, dtype)
    out = np.empty(shape, dtype)
    out.view(np.uint8)[...] = 0xFF
    return out


def written(shape: int | tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
    """``buffer`` with every page written now: the process owns its pages from here on, so
    a step that writes it later takes no page faults."""
    out = buffer(shape, dtype)
    if not _kernels.POISON:  # poisoned pages are written already
        out.fill(0)
    return out


@attrs.frozen
class Q8Rows:
    """Rows in an 8-bit format (``_kernels.linear`` writes them): q, d, s, g."""

    q: npt.NDArray[np.int8]
    d: F32
    s: F32
    g: npt.NDArray[np.int32]

    @classmethod
    def make(cls, rows: int, n: int, alloc: Any) -> Q8Rows:
        nc = n // CHUNK
        return cls(
            q_rows(alloc, rows, n), alloc((rows, nc), np.float32),
            alloc((rows, nc), np.float32), alloc((rows, 2 * nc), np.int32),
        )  # fmt: skip

    def first(self, rows: int) -> Q8Rows:
        return Q8Rows(self.q[:rows], self.d[:rows], self.s[:rows], self.g[:rows])


class RowSet:
    """The buffers of steps of up to ``cap`` rows, made once (``kept``: every page written
    when made, with the 8-bit or f16 / bf16 forms of every source in ``formats``): a step
    takes views of their first rows (``rows``), so steps of changing row counts make
    nothing.

    Each buffer starts ``STAGGER`` bytes further into a page than the one before: buffers
    of whole pages all starting page-aligned put a row of ``x`` and the same row of
    ``xn`` or ``o`` at the same place in the cache's sets (and a whole number of 4 KiB
    apart, which processors take for the same address until they compare the rest);
    such a version ran SmolLM2's steps up to 15 % slower (``cpu_step_buffers.py``)."""

    def __init__(
        self,
        cap: int,
        hidden: int,
        qkv: int,
        att: int,
        ffn: int,
        kept: bool = False,
        formats: Sequence[str] = (),
    ) -> None:
        self.fill = kept
        self.made = 0  # buffers made so far
        self.nbytes = 0  # their bytes, padding included
        self.cap, self.ffn = cap, ffn
        names = {"x": hidden, "xn": hidden, "qkv": qkv, "att": att, "o": hidden, "xl": hidden}
        # "o": a block's output before its post-norm; "xl": the head's rows (first ones used)
        self.full = {name: self.alloc((cap, n), np.float32) for name, n in names.items()}
        self.h_flat = self.alloc((cap * 2 * ffn,), np.float32)  # viewed (rows, 2 ffn) per layer
        self.act_flat = self.alloc((cap * ffn,), np.float32)  # viewed (rows, ffn) per layer
        self.widths = {"xn": hidden, "att": att, "act": ffn, "xl": hidden}  # of the sources
        self.q8: dict[tuple[str, str], Q8Rows] = {}
        self.rounded: dict[tuple[str, str], F32] = {}
        for fmt in formats:
            for src in self.widths:
                if fmt in ("f16", "bf16"):
                    self.rounded_of(src, fmt)
                else:
                    self.q8_of(src, fmt)

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        """A buffer starting ``STAGGER`` bytes further into its page than the last one."""
        skip = (self.made % (PAGE // STAGGER)) * STAGGER
        self.made += 1
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = (written if self.fill else buffer)(skip + size + PAGE, np.uint8)
        self.nbytes += raw.nbytes
        start = -raw.ctypes.data % PAGE + skip  # from the next page boundary
        out: npt.NDArray[Any] = raw[start : start + size].view(dtype).reshape(shape)
        return out

    def q8_of(self, src: str, fmt: str) -> Q8Rows:
        key = (src, fmt)
        if key not in self.q8:
            self.q8[key] = Q8Rows.make(self.cap, self.widths[src], self.alloc)
        return self.q8[key]

    def rounded_of(self, src: str, fmt: str) -> F32:
        """The f16 / bf16 form of a source (F16 / BF16 weights' activations), made at its
        first use."""
        key = (src, fmt)
        if key not in self.rounded:
            self.rounded[key] = self.alloc((self.cap, self.widths[src]), np.float32)
        return self.rounded[key]

    def rows(self, rows: int) -> StepRows:
        return StepRows(rows, self)


class StepRows:
    """The named buffers of a step of ``rows`` rows (views of a ``RowSet``'s), and the
    8-bit forms of its sources."""

    def __init__(self, rows: int, base: RowSet) -> None:
        if not 1 <= rows <= base.cap:
            raise ValueError(f"a step of {rows} rows in buffers of {base.cap}")
        self.rows, self.base = rows, base
        self.x = base.full["x"][:rows]
        self.h_flat = base.h_flat[: rows * 2 * base.ffn]
        self.act_flat = base.act_flat[: rows * base.ffn]
        self.views: dict[str, F32] = {name: a[:rows] for name, a in base.full.items()}
        self.q8: dict[tuple[str, str], Q8Rows] = {}
        self.rounded: dict[tuple[str, str], F32] = {}  # f16 / bf16 forms of the sources
        self.fresh: dict[str, set[str]] = {}  # per source, its 8-bit forms up to date

    def q8_of(self, src: str, fmt: str) -> Q8Rows:
        key = (src, fmt)
        if key not in self.q8:
            self.q8[key] = self.base.q8_of(src, fmt).first(self.rows)
        return self.q8[key]

    def rounded_of(self, src: str, fmt: str) -> F32:
        key = (src, fmt)
        if key not in self.rounded:
            self.rounded[key] = self.base.rounded_of(src, fmt)[: self.rows]
        return self.rounded[key]
