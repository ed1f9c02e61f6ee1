"""A mixture of experts' operations on the CUDA worker (``forward_program.ExpertOps``):
CuPy's gathers, scatters and float32 products and sums on the stage's stream, each
rounded once, as ggml's (``forward_program.experts_by_gather`` drives them). A mix-in of
``ops.DeviceOps``, whose buffers and launches it uses. Imports CuPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cupy
import numpy as np
import numpy.typing as npt

from runtime_core.workers.experts import Routing, weighted_sum
from runtime_core.workers.forward_program import experts_by_gather
from runtime_core.workers.stage_weights import Experts, Linear, StageWeights


class DeviceExpertOps:
    """The mixture's operations, on ``DeviceOps``'s state (declared here)."""

    w: StageWeights[Any, Any]
    stream: Any
    buf: dict[str, Any]
    bq8: dict[str, Any]
    groups: list[tuple[int, int, bool]]

    if TYPE_CHECKING:

        def linear(
            self,
            lin: Linear[Any],
            src: str,
            dst: str,
            rows: int,
            *,
            accumulate: bool = False,
            bias: Any = None,
        ) -> None: ...

        def _eight_bit(self, row: int) -> bool: ...

        def swiglu(self, rows: int) -> None: ...

    def router(self, lin: Linear[Any], rows: int) -> npt.NDArray[np.float32]:
        """The router's logits, on the host (the stream waited for)."""
        self.linear(lin, "xn", "router", rows)
        logits = cupy.asnumpy(self.buf["router"], stream=self.stream)
        self.stream.synchronize()
        return np.asarray(logits, dtype=np.float32)

    def experts(
        self, experts: Experts[Any], routing: Routing, rows: int, accumulate: bool = False
    ) -> None:
        experts_by_gather(self, experts, routing, rows, accumulate)

    def scale_rows(self, factors: Any, rows: int) -> None:
        with self.stream:
            f = cupy.asarray(np.asarray(factors, np.float32))
            self.buf["o"][:rows] *= f[:, None]

    def begin_experts(self, used: int, rows: int, accumulate: bool) -> None:
        """Keep the rows ``xn`` (and their 8-bit form), which rows multiply 8-bit, and
        ``o``'s rows where the mixture adds to them."""
        q8 = self.bq8.get("xn")
        with self.stream:
            self.moe_base = self.buf["o"][:rows].copy() if accumulate else None
            self.moe_in = self.buf["xn"][:rows].copy()
            self.moe_q8 = None if q8 is None else tuple(a.copy() for a in q8.rows(0, rows))
            self.moe_out = cupy.empty((used, rows, self.w.config.hidden_dim), cupy.float32)
        self.moe_groups = self.groups
        self.moe_eight = [self._eight_bit(r) for r in range(rows)]

    def pick_rows(self, rows: npt.NDArray[np.int64]) -> None:
        """xn[:n] (and its 8-bit form) = the kept rows ``rows``; the groups of 8-bit rows
        are theirs."""
        n = len(rows)
        with self.stream:
            at = cupy.asarray(rows)
            self.buf["xn"][:n] = self.moe_in[at]
            if self.moe_q8 is not None:
                for kept, now in zip(self.moe_q8, self.bq8["xn"].rows(0, n), strict=True):
                    now.reshape(n, -1)[:] = kept.reshape(len(self.moe_eight), -1)[at]
        flags = [self.moe_eight[int(r)] for r in rows]
        starts = [i for i in range(n) if i == 0 or flags[i] != flags[i - 1]]
        ends = [*starts[1:], n]
        self.groups = [(a, b, flags[a]) for a, b in zip(starts, ends, strict=True)]

    def put_rows(
        self, rows: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], weights: Any
    ) -> None:
        n = len(rows)
        with self.stream:
            w = cupy.asarray(np.asarray(weights, np.float32))
            self.moe_out[cupy.asarray(slots), cupy.asarray(rows)] = self.buf["o"][:n] * w[:, None]

    def end_experts(self, rows: int) -> None:
        with self.stream:
            total = weighted_sum(self.moe_out)  # CuPy's arrays, the same additions
            if self.moe_base is not None:
                total = self.moe_base + total
            self.buf["o"][:rows] = total
        self.groups = self.moe_groups
