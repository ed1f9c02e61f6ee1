"""A mixture of experts' operations on the CPU worker (``forward_program.ExpertOps``):
the router's product, the chosen experts' products over their (row, slot) pairs
(``linear_spans``: each matrix's experts in one call), the gate, and the weighted sum in
slot order (``workers.experts``), each pair computing the bits it computes alone. A mix-in
of ``ops.CpuOps``, whose buffers, matrices and kernels it uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from runplan.quant_types import CHUNK
from runtime_core.workers.cpu.step_buffers import (
    KEPT_ROWS,
    Q8Rows,
    StepRows,
    buffer,
    q_rows,
    written,
)
from runtime_core.workers.experts import Routing, weighted_sum
from runtime_core.workers.stage_weights import Experts, Linear, StageWeights

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
#: the shapes of pair buffers kept (``_pair_buffers``), the least recently used dropped
KEPT_PAIR_SHAPES = 16


class CpuExpertOps:
    """The mixture's operations, on ``CpuOps``'s state (declared here)."""

    w: StageWeights[U8, F32]
    buf: StepRows
    kernels: Any
    threads: int
    isa: str | None
    use_q8: bool
    matrices: dict[int, list[tuple[str, Any]]]
    router_logits: F32
    moe_bufs: dict[str, npt.NDArray[Any]]
    pair_views: dict[tuple[int, int, int, int], dict[str, Any]]
    expert_formats: list[tuple[str, str]]

    if TYPE_CHECKING:

        def linear(
            self,
            lin: Linear[U8],
            src: str,
            dst: str,
            rows: int,
            *,
            accumulate: bool = False,
            bias: F32 | None = None,
        ) -> None: ...

    def router(self, lin: Linear[U8], rows: int) -> F32:
        self.linear(lin, "xn", "router", rows)
        return self.router_logits

    def experts(
        self, experts: Experts[U8], routing: Routing, rows: int, accumulate: bool = False
    ) -> None:
        """o (+)= the mixture's output: the rows' (row, slot) pairs sorted by expert, each
        expert's two products one call over its pairs (their 8-bit forms made by its
        call), the gate one call over every pair, NumPy's gathers, float32 products and
        sums in slot order (``workers.experts``): per pair, the bits of the pair alone."""
        spans = list(routing.by_expert())
        pair_rows = np.concatenate([chosen for _, chosen, _ in spans])
        pair_slots = np.concatenate([slots for _, _, slots in spans])
        at, start = [], 0  # each expert's pairs: (expert, first, end)
        for e, chosen, _ in spans:
            at.append((e, start, start + len(chosen)))
            start += len(chosen)
        pairs, f = len(pair_rows), experts.down[0].n_in
        b = self._pair_buffers(pairs, rows, experts.used, f)
        np.take(self.buf.views["xn"][:rows], pair_rows, axis=0, out=b["xs"])
        self._expert_products(experts.gate_up, at, b, "xs", b["h"])
        self.kernels.swiglu(b["h"], b["act"], pairs, f, self.threads, isa=self.isa)
        self._expert_products(experts.down, at, b, "act", b["out"])
        b["out"] *= routing.weights[pair_rows, pair_slots][:, None]
        b["slotted"][pair_slots, pair_rows] = b["out"]
        total = weighted_sum(b["slotted"])
        if accumulate:
            self.buf.views["o"][:rows] += total
        else:
            self.buf.views["o"][:rows] = total

    def scale_rows(self, factors: F32, rows: int) -> None:
        self.buf.views["o"][:rows] *= factors[:, None]

    def _pair_buffers(self, pairs: int, rows: int, used: int, f: int) -> dict[str, Any]:
        """Views of the mixture's buffers for ``pairs`` (row, slot) pairs of ``rows``
        rows: the pairs' inputs (``xs``) in every format the experts' matrices take
        (``xs-<format>``), gate and up (``h``), the gated rows (``act``, and theirs), the
        outputs, the outputs by slot. Those of a step of up to KEPT_ROWS rows are views
        of buffers kept from step to step (``moe_bufs``, made when the stage binds, every
        page written); a longer step (a prompt fed unchunked) makes its own, which go
        with it."""
        key = (pairs, rows, used, f)
        if (views := self.pair_views.get(key)) is not None:
            return views
        hidden = self.w.config.hidden_dim
        own = rows > KEPT_ROWS

        def kept(name: str, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
            n = int(np.prod(shape))
            if own:
                return buffer(n, dtype).reshape(shape)
            buf = self.moe_bufs.get(name)
            if buf is None or buf.size < n:
                buf = self.moe_bufs[name] = written(n, dtype)
                self.pair_views.clear()  # views of the buffer it replaces
            return buf[:n].reshape(shape)

        out: dict[str, Any] = {
            "xs": kept("xs", (pairs, hidden), np.float32),
            "h": kept("h", (pairs, 2 * f), np.float32),
            "act": kept("act", (pairs, f), np.float32),
            "out": kept("out", (pairs, hidden), np.float32),
            "slotted": kept("slotted", (used, rows, hidden), np.float32),
        }
        for src, fmt in self.expert_formats:
            (n_rows, n), k = out[src].shape, f"{src}-{fmt}"
            if fmt in ("f16", "bf16"):
                out[k] = kept(k, (n_rows, n), np.float32)
                continue
            nc = n // CHUNK
            out[k] = Q8Rows(
                q_rows(lambda shape, dtype, k=k: kept(k + "-q", shape, dtype), n_rows, n),
                kept(k + "-d", (n_rows, nc), np.float32),
                kept(k + "-s", (n_rows, nc), np.float32),
                kept(k + "-g", (n_rows, 2 * nc), np.int32),
            )
        if own:
            return out
        if len(self.pair_views) >= KEPT_PAIR_SHAPES:
            del self.pair_views[next(iter(self.pair_views))]
        self.pair_views[key] = out
        return out

    def _expert_products(
        self,
        lins: Sequence[Linear[U8]],
        at: Sequence[tuple[int, int, int]],
        b: dict[str, Any],
        src: str,
        y: F32,
    ) -> None:
        """y[a:b] = src[a:b] @ lins[e]^T for each span ``(e, a, b)``, in the activation
        formats the weights take (llama.cpp's, as ``linear``'s): ``src`` rounded to half
        or bfloat16 once, or made 8-bit (a matrix takes one). Experts of one matrix
        each, all of one format (the rule), go as one call (``linear_spans``: one pool
        run for all); others span by span."""
        x = b[src]
        entries = [self.matrices[id(lins[e])] for e, _, _ in at]
        if all(len(m) == 1 for m in entries) and len({m[0][0] for m in entries}) == 1:
            fmt = entries[0][0][0]
            matrices = [m[0][1] for m in entries]
            spans = [(first, end) for _, first, end in at]
            if fmt in ("f32", "f16", "bf16") or not self.use_q8:
                xf = x
                if self.use_q8 and fmt != "f32":
                    xf = b[f"{src}-{fmt}"]
                    self.kernels.round(x, xf, fmt, self.threads)
                self.kernels.linear_spans(
                    matrices, spans, xf, None, None, None, None, y, self.threads, isa=self.isa
                )
            else:
                q = b[f"{src}-{fmt}"]
                self.kernels.linear_spans(
                    matrices, spans, x, q.q, q.d, q.s, q.g, y, self.threads, isa=self.isa
                )
            return
        rounded: set[str] = set()
        for e, first, end in at:
            rows = end - first
            for fmt, matrix in self.matrices[id(lins[e])]:
                if fmt in ("f32", "f16", "bf16") or not self.use_q8:
                    xf = x
                    if self.use_q8 and fmt != "f32":
                        xf = b[f"{src}-{fmt}"]
                        if fmt not in rounded:
                            self.kernels.round(x, xf, fmt, self.threads)
                            rounded.add(fmt)
                    self.kernels.linear(
                        matrix, rows, xf[first:end], None, None, None, None,
                        False, False, y[first:end], None, False, self.threads, isa=self.isa,
                    )  # fmt: skip
                    continue
                q = b[f"{src}-{fmt}"].first(end)  # each span's rows made 8-bit by its call
                self.kernels.linear(
                    matrix, rows, x[first:end], q.q[first:], q.d[first:], q.s[first:],
                    q.g[first:], True, True, y[first:end], None, False, self.threads,
                    isa=self.isa,
                )  # fmt: skip
