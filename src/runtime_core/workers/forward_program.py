"""One stage's forward pass, written once over a backend.

The CUDA worker, its NumPy twin and the CPU worker run the same sequence of fused
operations (the ``Ops`` protocol), each on its own buffers: ``DeviceOps`` launches the
kernels of ``kernels/*.cu``, ``TwinOps`` calls their twins, ``CpuOps`` the compiled
CPU kernels. A test of the twin stage against the reference worker therefore checks this
sequence, the tensor layout and the host logic; a test of each kernel against its twin
(on a GPU, and on the SIMT emulator of the tests) checks the rest.

The stage's weights, as the backend holds them, are ``stage_weights``'s.

A step of ``rows`` rows (a prefill of the prompt, or one decode row) runs, per block
(``runtime_core.architectures`` says which of the optional steps, marked ``[...]``, an
architecture has)::

    xn  = rmsnorm(x) * attn_norm             (+ 8-bit xn rows, q8 mode)
    qkv = xn @ Wqkv^T                         (attn_q, attn_k, attn_v or phi3's attn_qkv)
    [qk_norm: qkv += bias; per-head rmsnorm of Q and K]          qwen3, gemma3
    rope_kv: qkv += bias; rotate Q, K (the block's rope base);   K, V -> the block's cache
             (smollm3's NoPE blocks: 0 rotated dims, so nothing rotates)
    att = attention(Q, cache)                 (+ 8-bit att; a sliding block's window;
                                               gemma2: scores capped, c * tanh(s / c))
    x  += att @ Wo^T (+ bo)                   [gemma2/3: o = att @ Wo^T; x += rmsnorm(o) * w]
    xn  = rmsnorm(x) * ffn_norm
    h   = xn @ [Wgate | Wup]^T                (ffn_gate, ffn_up or phi3's fused ffn_up)
    act = silu(h_gate) * h_up                 [gemma, gemma2/3: gelu_tanh(h_gate) * h_up]
    x  += act @ Wdown^T                       [gemma2/3: post-norm as above]
    [experts: o = ``forward_experts``, in place of the three lines above; x += o, or
     granite's x += o * residual_scale]

with ``x = embed(ids) [* embedding_scale]`` on the first stage (``forward_embed``), and
on the last ``xl = rmsnorm(x[heads]) * output_norm``, ``logits = xl @ head^T``
[``logits = cap * tanh(logits / cap)``: gemma2's and gemma3's soft cap], ``token = argmax(logits)``
per row (``forward_head``).

A step is a batch (CONCURRENT_RUNS.md §3): the rows of several runs' steps stacked, each
run's a ``Segment`` (its first row in the step, its rows, its first position, its KV
cache). Every product and row-wise operation runs once over all the step's rows, so a
backend whose kernels take several rows reads each weight once per batch; ``rope_kv``
and ``attention`` run per segment, each against its run's cache at its run's positions.
The head runs for the rows ``heads``: each run's last row that needs a token.
Buffer names: sources ``xn``, ``att``, ``act``, ``xl``; destinations ``qkv``, ``x``,
``o``, ``h``, ``logits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runtime_core.architectures import Activation
from runtime_core.workers.experts import Routing, route, shared_gate
from runtime_core.workers.stage_weights import F32, Experts, H, Linear, StageWeights, V

V_contra = TypeVar("V_contra", contravariant=True)


@frozen
class Segment:
    """One run's rows in a step: rows ``start .. start + rows`` of the step's buffers, at
    positions ``pos .. pos + rows`` of that run's KV cache ``cache`` (the backend's)."""

    start: int
    rows: int
    pos: int
    cache: Any

    @property
    def end(self) -> int:
        return self.start + self.rows


def segments_of(steps: Sequence[tuple[int, int, Any]]) -> tuple[Segment, ...]:
    """The segments of a batch of ``(rows, pos, cache)`` steps stacked in order."""
    out: list[Segment] = []
    start = 0
    for rows, pos, cache in steps:
        out.append(Segment(start, rows, pos, cache))
        start += rows
    return tuple(out)


class Ops(Protocol[H, V_contra]):
    """The fused operations of a step, on the backend's own buffers. Every operation
    takes the step's ``rows``; each row's arithmetic does not depend on the step's other
    rows (a run's bits are the same alone or batched, CONCURRENT_RUNS.md)."""

    def embed(self, table: Linear[H], rows: int) -> None:
        """x = rows of ``table`` picked by the step's token ids."""

    def norm(self, weight: V_contra, rows: int) -> None:
        """xn = rmsnorm(x) * weight."""

    def linear(
        self,
        lin: Linear[H],
        src: str,
        dst: str,
        rows: int,
        *,
        accumulate: bool = False,
        bias: V_contra | None = None,
    ) -> None:
        """dst (+)= src @ lin^T (+ bias)."""

    def rope_kv(self, layer: int, bias: V_contra | None, seg: Segment) -> None:
        """The segment's rows: biases, rotary embedding at the segment's positions, and
        K, V into block ``layer`` of the segment's cache."""

    def attention(self, layer: int, seg: Segment) -> None:
        """att = attention of the segment's rotated Q rows over block ``layer`` of the
        segment's cache."""

    def swiglu(self, rows: int) -> None:
        """act = silu(h_gate) * h_up."""

    def head_norm(self, weight: V_contra, heads: Sequence[int]) -> None:
        """xl[k] = rmsnorm(x[heads[k]]) * weight for each k."""

    def argmax(self, rows: int) -> None:
        """Per row of ``logits[:rows]``: the token, the first index of its largest logit
        (and a count of its non-finite ones)."""

    # -- the optional steps (runtime_core.architectures) ----------------------------------
    def scale_x(self, factor: float, rows: int) -> None:
        """x *= factor (gemma3's embedding scale)."""

    def qk_norm(self, q_norm: V_contra, k_norm: V_contra, bias: V_contra | None, rows: int) -> None:
        """qkv += bias; each Q head = rmsnorm(head) * q_norm, each K head likewise."""

    def add_norm(self, weight: V_contra, rows: int) -> None:
        """x += rmsnorm(o) * weight (gemma3's post-attention and post-feed-forward norms)."""

    def geglu(self, rows: int) -> None:
        """act = gelu_tanh(h_gate) * h_up."""

    def softcap(self, cap: float, rows: int) -> None:
        """logits[:rows] = cap * tanh(logits[:rows] / cap)."""

    def add_scaled(self, factor: float, rows: int) -> None:
        """x += o * factor, the product rounded first (granite's residual scale)."""

    def scale_logits(self, factor: float, rows: int) -> None:
        """logits[:rows] *= factor (granite's 1 / logit_scale)."""


@runtime_checkable
class ExpertOps(Protocol):
    """The operations of a mixture of experts (``forward_experts``), of the backends
    that run one (every worker's here; a worker without them declares
    ``WorkerCapabilities.experts`` false, and the planner refuses it such a model)."""

    def router(self, lin: Linear[Any], rows: int) -> F32:
        """The router's logits ``xn @ lin^T`` of the ``rows`` rows, on the host."""
        ...

    def experts(
        self, experts: Experts[Any], routing: Routing, rows: int, accumulate: bool = False
    ) -> None:
        """o (+)= the mixture's output for the rows ``xn`` routed so: each (row, slot)
        pair through its expert's gated feed-forward (each expert's rows one product),
        times its weight, the slots summed in order (``workers.experts``); ``accumulate``:
        added to ``o`` (qwen2moe's gated shared expert there)."""
        ...

    def scale_rows(self, factors: F32, rows: int) -> None:
        """o[r] *= factors[r] for each of the ``rows`` rows (qwen2moe's shared gate)."""
        ...


class GatherOps(Protocol):
    """What ``experts_by_gather`` runs a mixture on: a backend's own buffers."""

    def linear(
        self, lin: Linear[Any], src: str, dst: str, rows: int, *, accumulate: bool = False,
        bias: Any = None,
    ) -> None: ...  # fmt: skip

    def swiglu(self, rows: int) -> None: ...

    def begin_experts(self, used: int, rows: int, accumulate: bool) -> None:
        """Keep the ``rows`` normalized rows ``xn``: the experts' inputs (and ``o``'s rows,
        where the mixture adds to them)."""

    def pick_rows(self, rows: npt.NDArray[np.int64]) -> None:
        """xn[:n] = the kept rows ``rows`` (n of them)."""

    def put_rows(
        self, rows: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], weights: F32
    ) -> None:
        """The output of slot ``slots[i]`` of row ``rows[i]`` = o[i] * weights[i]."""

    def end_experts(self, rows: int) -> None:
        """o (+)= the sum of each row's slot outputs, in slot order (``experts.py``)."""


def experts_by_gather(
    ops: GatherOps, experts: Experts[Any], routing: Routing, rows: int, accumulate: bool
) -> None:
    """``ExpertOps.experts`` on a backend's named buffers: per expert, the rows that chose
    it gathered into ``xn``, its gated feed-forward, each output times its weight into its
    slot; then the slots summed in order into ``o`` (or added to it)."""
    ops.begin_experts(experts.used, rows, accumulate)
    for e, chosen, slots in routing.by_expert():
        n = len(chosen)
        ops.pick_rows(chosen)
        ops.linear(experts.gate_up[e], "xn", "h", n)
        ops.swiglu(n)
        ops.linear(experts.down[e], "act", "o", n)
        ops.put_rows(chosen, slots, routing.weights[chosen, slots])
    ops.end_experts(rows)


def expert_ops(ops: Ops[H, V]) -> ExpertOps:
    """``ops`` as the backend's mixture-of-experts operations (checked once a step: the
    protocol's check looks up each of its methods)."""
    assert isinstance(ops, ExpertOps), f"{type(ops).__name__} runs no mixture of experts"
    return ops


def forward_experts(ops: Ops[H, V], moe: ExpertOps, experts: Experts[H], rows: int) -> None:
    """o = the mixture of experts' output for the normalized rows ``xn``: the router's
    logits read back and routed on the host (``workers.experts``), then the backend's
    ``experts``. qwen2moe's shared expert goes first, into ``o``, each row times its
    gate (the router's last column through ``shared_gate``), and the mixture is added to
    it (llama.cpp adds the two the other way round: the same sum). ``moe``: ``ops``'s
    mixture operations (``expert_ops``)."""
    logits = moe.router(experts.router, rows)
    n = experts.n_experts
    routing = route(logits[:, :n], experts.used, experts.norm)
    gate_up, down = experts.shared_gate_up, experts.shared_down
    if gate_up is not None and down is not None:
        ops.linear(gate_up, "xn", "h", rows)
        ops.swiglu(rows)
        ops.linear(down, "act", "o", rows)
        moe.scale_rows(shared_gate(logits[:, n]), rows)
    moe.experts(experts, routing, rows, accumulate=gate_up is not None)


def forward_embed(ops: Ops[H, V], w: StageWeights[H, V], rows: int) -> None:
    """x = the embeddings of the step's token ids (first stage)."""
    assert w.embedding is not None
    ops.embed(w.embedding, rows)
    if w.config.embedding_scale != 1.0:
        ops.scale_x(w.config.embedding_scale, rows)


def forward_blocks(ops: Ops[H, V], w: StageWeights[H, V], segments: Sequence[Segment]) -> None:
    """Run the residual rows ``x`` of a step (the ``segments``' rows, stacked) through the
    stage's blocks: every product and row-wise operation once over all rows, rotary
    embedding and attention per segment."""
    rows = segments[-1].end
    gelu = w.config.spec.activation is Activation.GELU_TANH
    residual = w.config.residual_scale  # granite's (0: none)
    moe = expert_ops(ops) if w.config.n_experts else None
    for i, layer in enumerate(w.layers):
        ops.norm(layer.attn_norm, rows)
        ops.linear(layer.qkv, "xn", "qkv", rows)
        bias = layer.qkv_bias
        if layer.q_norm is not None and layer.k_norm is not None:
            ops.qk_norm(layer.q_norm, layer.k_norm, bias, rows)  # adds the bias first
            bias = None
        for seg in segments:
            ops.rope_kv(i, bias, seg)
            ops.attention(i, seg)
        if layer.post_attn_norm is not None:
            ops.linear(layer.wo, "att", "o", rows, bias=layer.wo_bias)
            ops.add_norm(layer.post_attn_norm, rows)
        elif residual:
            ops.linear(layer.wo, "att", "o", rows, bias=layer.wo_bias)
            ops.add_scaled(residual, rows)
        else:
            ops.linear(layer.wo, "att", "x", rows, accumulate=True, bias=layer.wo_bias)
        ops.norm(layer.ffn_norm, rows)
        if layer.experts is not None:  # o = the mixture's output; x += o (granite: o scaled)
            assert moe is not None
            forward_experts(ops, moe, layer.experts, rows)
            ops.add_scaled(residual or 1.0, rows)
            continue
        assert layer.gate_up is not None and layer.down is not None
        ops.linear(layer.gate_up, "xn", "h", rows, bias=layer.gate_up_bias)
        if gelu:
            ops.geglu(rows)
        else:
            ops.swiglu(rows)
        if layer.post_ffn_norm is not None:
            ops.linear(layer.down, "act", "o", rows, bias=layer.down_bias)
            ops.add_norm(layer.post_ffn_norm, rows)
        elif residual:
            ops.linear(layer.down, "act", "o", rows, bias=layer.down_bias)
            ops.add_scaled(residual, rows)
        else:
            ops.linear(layer.down, "act", "x", rows, accumulate=True, bias=layer.down_bias)


def forward_head(ops: Ops[H, V], w: StageWeights[H, V], heads: Sequence[int]) -> None:
    """Logits of the rows ``heads`` and their greedy tokens (last stage), the head's
    weights read once for all of them."""
    assert w.output_norm is not None and w.head is not None
    ops.head_norm(w.output_norm, heads)
    ops.linear(w.head, "xl", "logits", len(heads))
    if w.config.logit_factor != 1.0:
        ops.scale_logits(w.config.logit_factor, len(heads))
    if w.config.final_logit_softcap > 0.0:
        ops.softcap(w.config.final_logit_softcap, len(heads))
    ops.argmax(len(heads))
