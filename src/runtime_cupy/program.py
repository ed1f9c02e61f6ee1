"""One stage's forward pass, written once over a backend.

The CUDA worker and its NumPy twin run the same sequence of fused operations (the
``Ops`` protocol), each on its own buffers: ``DeviceOps`` launches the kernels of
``kernels/*.cu``, ``TwinOps`` calls their twins. A test of the twin stage against
the reference worker (on any CPU) therefore checks this sequence, the tensor layout
and the host logic; a test of each kernel against its twin (on a GPU) checks the rest.

Weights stay as stored: a matrix is its GGUF rows (``(n_out, row_bytes)`` bytes). Q, K
and V become one matrix when they share a type (their rows concatenated, still GGUF
rows), and so do the feed-forward gate and up, unless the backend keeps the file's
rows where they are (``join_parts=False``: the CPU worker maps them); otherwise each
part writes its own slice of the output row. Norm weights and biases are float32.

A step of ``rows`` rows (a prefill of the prompt, or one decode row) runs, per block::

    xn  = rmsnorm(x) * attn_norm             (+ 8-bit xn when rows == 1)
    qkv = xn @ Wqkv^T                         one-row product, or tiles + matmul
    rope_kv: qkv += bias; rotate Q, K; K, V -> cache at positions pos ..
    att = attention(Q, cache)                 (+ 8-bit att)
    x  += att @ Wo^T (+ bo)
    xn  = rmsnorm(x) * ffn_norm
    h   = xn @ [Wgate | Wup]^T
    act = silu(h_gate) * h_up                 (+ 8-bit act)
    x  += act @ Wdown^T

and on the last stage ``xl = rmsnorm(x[rows - 1]) * output_norm``, ``logits = xl @
head^T``, ``token = argmax(logits)``. Buffer names: sources ``xn``, ``att``, ``act``,
``xl``; destinations ``qkv``, ``x``, ``h``, ``logits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runtime_core.gguf_slice import EMBEDDING, OUTPUT_NORM, ROPE_FREQS, StageSlice
from runtime_core.model_config import ModelConfig
from runtime_core.reference_model import rope_rotations
from runtime_cupy.quant_types import CHUNK, QUANT_TYPES, row_bytes

H = TypeVar("H")  # a backend's handle of raw GGUF rows
V = TypeVar("V")  # a backend's handle of a float32 vector
H_co = TypeVar("H_co", covariant=True)
V_co = TypeVar("V_co", covariant=True)
V_contra = TypeVar("V_contra", contravariant=True)
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Progress = Callable[[int, int], None]


@frozen
class MatrixPart:
    """One stored matrix (or several of one type, stacked): ``n_out`` rows of ``n_in``
    elements of ``qtype``, whose outputs go to ``out_offset ..`` of the output row."""

    name: str
    qtype: str
    n_out: int
    n_in: int
    out_offset: int

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.qtype, self.n_in)


@attrs.define
class Linear(Generic[H]):
    """``y = x @ W^T`` for a matrix made of one or more parts."""

    parts: tuple[tuple[MatrixPart, H], ...]
    n_in: int
    n_out: int


@attrs.define
class Layer(Generic[H, V]):
    attn_norm: V  # (hidden,)
    qkv: Linear[H]  # (q_dim + k_dim + v_dim) x hidden
    qkv_bias: V | None  # (q_dim + k_dim + v_dim,): zeros where a bias is absent
    wo: Linear[H]  # hidden x (n_heads * head_dim_v)
    wo_bias: V | None  # (hidden,)
    ffn_norm: V  # (hidden,)
    gate_up: Linear[H]  # (2 ffn) x hidden
    down: Linear[H]  # hidden x ffn


@attrs.define
class StageWeights(Generic[H, V]):
    config: ModelConfig
    layers: list[Layer[H, V]]
    embedding: Linear[H] | None  # first stage: vocab x hidden, rows looked up by id
    output_norm: V | None  # last stage
    head: Linear[H] | None  # last stage: vocab x hidden (the embedding when tied)
    rot: npt.NDArray[np.complex64]  # (max_seq_len, rope_dims / 2): exp(i theta)
    vocab_size: int
    stored_bytes: int  # the stage's tensors as stored (quantized) in the file

    @property
    def max_ffn(self) -> int:
        return max((layer.down.n_in for layer in self.layers), default=0)


class Uploader(Protocol[H_co, V_co]):
    """How a backend takes the stage's tensors from the memory-mapped file."""

    def raw(self, data: U8) -> H_co:
        """GGUF rows ``(n_out, row_bytes)`` (a view of the file's memory map): a copy
        (on the device), or the view itself for a backend that reads the mapping."""
        ...

    def f32(self, data: F32) -> V_co:
        """A float32 vector: an owned copy (on the device)."""
        ...


def load_weights(
    stage: StageSlice,
    up: Uploader[H, V],
    max_seq_len: int,
    progress: Progress | None = None,
    *,
    join_parts: bool = True,
) -> StageWeights[H, V]:
    """The stage's tensors through ``up``; raises ``ValueError`` for a matrix whose rows
    are not a multiple of 32 elements or of a type the kernels do not read.
    ``join_parts``: Q, K, V (and gate, up) of one type become one matrix (a copy of
    their rows, one launch); ``False`` keeps every stored matrix a part of its own."""
    config = stage.config
    total = stage.stored_bytes
    done: set[str] = set()
    raw_cache: dict[str, H] = {}

    def count(name: str) -> None:
        if name not in done:
            done.add(name)
            if progress is not None:
                progress(sum(stage.tensors[n].n_bytes for n in done), total)

    def vector(name: str) -> V:
        count(name)
        return up.f32(np.ascontiguousarray(stage.dequantize(name).reshape(-1)))

    def optional(name: str) -> V | None:
        return vector(name) if stage.has(name) else None

    def linear(names: list[str]) -> Linear[H]:
        infos = [stage.tensors[n] for n in names]
        n_in = infos[0].shape[0]
        for name, info in zip(names, infos, strict=True):
            if info.ggml_type not in QUANT_TYPES:
                raise ValueError(f"{name}: type {info.ggml_type} is not one the kernels read")
            if info.shape[0] != n_in or n_in % CHUNK:
                raise ValueError(
                    f"{name}: rows of {info.shape[0]} elements; the CUDA kernels read rows "
                    f"of a multiple of {CHUNK}, the same for every part"
                )
        parts: list[tuple[MatrixPart, H]] = []
        n_out = sum(info.shape[1] for info in infos)
        if join_parts and len({info.ggml_type for info in infos}) == 1 and len(names) > 1:
            data = np.concatenate(
                [
                    stage.raw(n).reshape(info.shape[1], -1)
                    for n, info in zip(names, infos, strict=True)
                ]
            )
            part = MatrixPart("+".join(names), infos[0].ggml_type, n_out, n_in, 0)
            parts.append((part, up.raw(data)))
        else:
            at = 0
            for name, info in zip(names, infos, strict=True):
                if name not in raw_cache:
                    raw_cache[name] = up.raw(stage.raw(name).reshape(info.shape[1], -1))
                parts.append(
                    (MatrixPart(name, info.ggml_type, info.shape[1], n_in, at), raw_cache[name])
                )
                at += info.shape[1]
        for name in names:
            count(name)
        return Linear(tuple(parts), n_in, n_out)

    layers: list[Layer[H, V]] = []
    for i in stage.layers:
        p = f"blk.{i}."
        q_k_v = [p + "attn_q", p + "attn_k", p + "attn_v"]
        biases = [stage.has(n + ".bias") for n in q_k_v]
        qkv_bias = None
        if any(biases):
            widths = (config.q_dim, config.k_dim, config.v_dim)
            pieces = []
            for name, has, width in zip(q_k_v, biases, widths, strict=True):
                if has:
                    count(name + ".bias")
                    pieces.append(stage.dequantize(name + ".bias").reshape(-1))
                else:
                    pieces.append(np.zeros(width, np.float32))
            qkv_bias = up.f32(np.concatenate(pieces).astype(np.float32))
        layers.append(
            Layer(
                attn_norm=vector(p + "attn_norm.weight"),
                qkv=linear([n + ".weight" for n in q_k_v]),
                qkv_bias=qkv_bias,
                wo=linear([p + "attn_output.weight"]),
                wo_bias=optional(p + "attn_output.bias"),
                ffn_norm=vector(p + "ffn_norm.weight"),
                gate_up=linear([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                down=linear([p + "ffn_down.weight"]),
            )
        )
    embedding = linear([EMBEDDING]) if stage.is_first else None
    output_norm = head = None
    if stage.is_last:
        assert stage.head is not None
        output_norm = vector(OUTPUT_NORM)
        head = linear([stage.head])
    factors = None
    if stage.has(ROPE_FREQS):
        count(ROPE_FREQS)
        factors = stage.dequantize(ROPE_FREQS).reshape(-1)
    return StageWeights(
        config=config,
        layers=layers,
        embedding=embedding,
        output_norm=output_norm,
        head=head,
        rot=rope_rotations(config.rope, max_seq_len, factors),
        vocab_size=stage.vocab_size,
        stored_bytes=total,
    )


class Ops(Protocol[H, V_contra]):
    """The fused operations of a step, on the backend's own buffers. Every operation
    takes the step's ``rows``; ``rows == 1`` runs the one-row (decode) kernels, with
    8-bit activations where the backend's mode says so."""

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

    def rope_kv(self, layer: int, bias: V_contra | None, rows: int) -> None:
        """Biases, rotary embedding, and K, V into the cache of the stage's ``layer``."""

    def attention(self, layer: int, rows: int) -> None:
        """att = attention of the rotated Q rows over the cache of ``layer``."""

    def swiglu(self, rows: int) -> None:
        """act = silu(h_gate) * h_up."""

    def head_norm(self, weight: V_contra, rows: int) -> None:
        """xl = rmsnorm(x[rows - 1]) * weight (one row)."""

    def argmax(self) -> None:
        """token = the first index of the largest logit (and a count of non-finite ones)."""


def forward_blocks(ops: Ops[H, V], w: StageWeights[H, V], rows: int) -> None:
    """Run the residual rows ``x`` of a step through the stage's blocks."""
    for i, layer in enumerate(w.layers):
        ops.norm(layer.attn_norm, rows)
        ops.linear(layer.qkv, "xn", "qkv", rows)
        ops.rope_kv(i, layer.qkv_bias, rows)
        ops.attention(i, rows)
        ops.linear(layer.wo, "att", "x", rows, accumulate=True, bias=layer.wo_bias)
        ops.norm(layer.ffn_norm, rows)
        ops.linear(layer.gate_up, "xn", "h", rows)
        ops.swiglu(rows)
        ops.linear(layer.down, "act", "x", rows, accumulate=True)


def forward_head(ops: Ops[H, V], w: StageWeights[H, V], rows: int) -> None:
    """Logits of the last row and the greedy token (last stage)."""
    assert w.output_norm is not None and w.head is not None
    ops.head_norm(w.output_norm, rows)
    ops.linear(w.head, "xl", "logits", 1)
    ops.argmax()
