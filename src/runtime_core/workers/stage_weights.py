"""A stage's weights as a backend holds them, and their loading from the file
(``load_weights``), for the forward pass of ``forward_program``.

Weights stay as stored: a matrix is its GGUF rows (``(n_out, row_bytes)`` bytes). Q, K
and V become one matrix when they share a type (their rows concatenated, still GGUF
rows), and so do the feed-forward gate and up, unless the backend keeps the file's
rows where they are (``join_parts=False``: the CPU worker maps them); otherwise each
part writes its own slice of the output row. A file's fused ``attn_qkv`` or ``ffn_up``
(phi3) is one such matrix already, rows ``[q; k; v]`` or ``[gate; up]``: the step splits
its output by the config's sizes, as it splits the joined parts'. Norm weights and biases
are float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan.gguf_tensors import TensorInfo
from runplan.quant_types import CHUNK, QUANT_TYPES, row_bytes
from runtime_core.architectures import FfnLayout, QkvLayout
from runtime_core.gguf_slice import (
    EMBEDDING,
    OUTPUT_NORM,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS,
    StageSlice,
    qkv_layout,
    rope_factors,
)
from runtime_core.model_config import ModelConfig
from runtime_core.workers.rotary import query_temperatures, rope_rotations

H = TypeVar("H")  # a backend's handle of raw GGUF rows
V = TypeVar("V")  # a backend's handle of a float32 vector
H_co = TypeVar("H_co", covariant=True)
V_co = TypeVar("V_co", covariant=True)
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
class Experts(Generic[H]):
    """A block's mixture of experts: the router and each expert's matrices."""

    # n_experts x hidden (float32 in llama.cpp's files); qwen2moe's: (n_experts + 1) x
    # hidden, its last row the shared expert's gate (ffn_gate_inp_shexp)
    router: Linear[H]
    gate_up: list[Linear[H]]  # per expert: (2 ffn) x hidden, rows [gate; up]
    down: list[Linear[H]]  # per expert: hidden x ffn
    used: int  # experts per row
    norm: bool = True  # the chosen weights divided by their sum (qwen2moe: not)
    shared_gate_up: Linear[H] | None = None  # qwen2moe's shared expert: (2 fs) x hidden
    shared_down: Linear[H] | None = None  # hidden x fs

    @property
    def n_experts(self) -> int:
        return len(self.gate_up)

    @property
    def linears(self) -> list[Linear[H]]:
        shared = [lin for lin in (self.shared_gate_up, self.shared_down) if lin is not None]
        return [self.router, *self.gate_up, *self.down, *shared]


@attrs.define
class Layer(Generic[H, V]):
    attn_norm: V  # (hidden,)
    qkv: Linear[H]  # (q_dim + k_dim + v_dim) x hidden
    qkv_bias: V | None  # (q_dim + k_dim + v_dim,): zeros where a bias is absent
    wo: Linear[H]  # hidden x (n_heads * head_dim_v)
    wo_bias: V | None  # (hidden,)
    ffn_norm: V  # (hidden,)
    # the feed-forward, or (``experts``) None
    gate_up: Linear[H] | None  # (2 ffn) x hidden: rows [gate; up]
    down: Linear[H] | None  # hidden x ffn
    gate_up_bias: V | None = None  # (2 ffn,): [gate; up] biases (llama), zeros where absent
    down_bias: V | None = None  # (hidden,)
    window: int = 0  # positions a sliding block attends to; 0: every one (global)
    rotary: bool = True  # rotates Q and K (False: a smollm3 NoPE block, ModelConfig's)
    q_norm: V | None = None  # (head_dim_k,): attn_q_norm (qwen3, gemma3)
    k_norm: V | None = None  # (head_dim_k,): attn_k_norm
    post_attn_norm: V | None = None  # (hidden,): post_attention_norm (gemma3)
    post_ffn_norm: V | None = None  # (hidden,): post_ffw_norm (gemma3)
    experts: Experts[H] | None = None  # a mixture of experts in place of the feed-forward


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
    # (max_seq_len, rope_dims / 2): the sliding blocks' rotations (their own base), or
    # ``rot`` when the stage has none or their rotary is the global one
    rot_swa: npt.NDArray[np.complex64] | None = None
    # (max_seq_len,): each position's factor on the rotated queries (mistral3's
    # temperature past its original context), or None
    q_temps: npt.NDArray[np.float32] | None = None
    first_block: int = 0  # the model's index of ``layers[0]``

    def layer_rot(self, layer: int) -> npt.NDArray[np.complex64]:
        """The rotations of the stage's block ``layer``."""
        if self.layers[layer].window and self.rot_swa is not None:
            return self.rot_swa
        return self.rot

    @property
    def max_ffn(self) -> int:
        """The widest feed-forward (an expert's, in a mixture, or its shared expert's)."""
        widest = max((self.config.ffn_dims[i] for i in self.block_indices), default=0)
        return max(widest, self.config.shared_ffn if self.layers else 0)

    @property
    def block_indices(self) -> range:
        """The model's indices of the stage's blocks."""
        return range(self.first_block, self.first_block + len(self.layers))

    @property
    def linears(self) -> list[Linear[H]]:
        """Every matrix of the stage, block by block, then the embedding and the head."""
        out: list[Linear[H]] = []
        for layer in self.layers:
            out += [layer.qkv, layer.wo]
            if layer.experts is not None:
                out += layer.experts.linears
            else:
                assert layer.gate_up is not None and layer.down is not None
                out += [layer.gate_up, layer.down]
        return out + [lin for lin in (self.embedding, self.head) if lin is not None]


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

    def joined_bias(names: list[str], widths: tuple[int, ...]) -> V | None:
        """The biases of the matrices ``names`` joined (zeros where one has none);
        ``None`` where none has one."""
        if not any(stage.has(n + ".bias") for n in names):
            return None
        pieces = []
        for name, width in zip(names, widths, strict=True):
            if stage.has(name + ".bias"):
                count(name + ".bias")
                pieces.append(stage.dequantize(name + ".bias").reshape(-1))
            else:
                pieces.append(np.zeros(width, np.float32))
        return up.f32(np.concatenate(pieces).astype(np.float32))

    def linear(names: list[str], expert: int | None = None) -> Linear[H]:
        """The matrix of the stored tensors ``names`` (of a stacked experts' tensor,
        that ``expert``'s rows)."""
        infos = [stage.tensors[n] for n in names]

        def rows(name: str, n_out: int) -> U8:
            data = stage.raw(name)
            return (data if expert is None else data[expert]).reshape(n_out, -1)

        def outputs(info: TensorInfo) -> int:  # a vector (qwen2moe's gate) is one row
            return info.shape[1] if len(info.shape) > 1 else 1

        n_in = infos[0].shape[0]
        for name, info in zip(names, infos, strict=True):
            if info.ggml_type not in QUANT_TYPES:
                raise ValueError(f"{name}: type {info.ggml_type} is not one the kernels read")
            if info.shape[0] != n_in or n_in % CHUNK:
                raise ValueError(
                    f"{name}: rows of {info.shape[0]} elements; the kernels read rows of a "
                    f"multiple of {CHUNK} elements, the same for every part"
                )
        parts: list[tuple[MatrixPart, H]] = []
        n_out = sum(outputs(info) for info in infos)
        which = "" if expert is None else f"[{expert}]"
        if join_parts and len({info.ggml_type for info in infos}) == 1 and len(names) > 1:
            data = np.concatenate(
                [rows(n, outputs(info)) for n, info in zip(names, infos, strict=True)]
            )
            part = MatrixPart("+".join(names) + which, infos[0].ggml_type, n_out, n_in, 0)
            parts.append((part, up.raw(data)))
        else:
            at = 0
            for name, info in zip(names, infos, strict=True):
                if name + which not in raw_cache:
                    raw_cache[name + which] = up.raw(rows(name, outputs(info)))
                part = MatrixPart(name + which, info.ggml_type, outputs(info), n_in, at)
                parts.append((part, raw_cache[name + which]))
                at += outputs(info)
        for name in names:
            count(name)
        return Linear(tuple(parts), n_in, n_out)

    spec = config.spec
    layers: list[Layer[H, V]] = []
    for i in stage.layers:
        p = f"blk.{i}."
        fused = qkv_layout(config, i, stage.tensors) is QkvLayout.FUSED
        q_k_v = [p + "attn_qkv"] if fused else [p + "attn_q", p + "attn_k", p + "attn_v"]
        widths = (config.q_dim + config.k_dim + config.v_dim,) if fused else (
            config.q_dim, config.k_dim, config.v_dim,
        )  # fmt: skip
        qkv_bias = joined_bias(q_k_v, widths)
        gate_up = [p + "ffn_up"] if spec.ffn is FfnLayout.FUSED else [p + "ffn_gate", p + "ffn_up"]
        f = config.ffn_dims[i]
        experts = None
        if config.n_experts:
            gate_up = []
            exps = [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]
            shared = config.shared_ffn > 0
            router = [p + "ffn_gate_inp.weight"] + [p + "ffn_gate_inp_shexp.weight"] * shared
            experts = Experts(
                router=linear(router),
                gate_up=[linear(exps, e) for e in range(config.n_experts)],
                down=[linear([p + "ffn_down_exps.weight"], e) for e in range(config.n_experts)],
                used=config.n_experts_used,
                norm=spec.expert_weights_norm,
                shared_gate_up=(
                    linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
                    if shared
                    else None
                ),
                shared_down=linear([p + "ffn_down_shexp.weight"]) if shared else None,
            )
        gate_up_bias = joined_bias(gate_up, (2 * f,) if len(gate_up) == 1 else (f, f))
        post = spec.post_norms
        layers.append(
            Layer(
                attn_norm=vector(p + "attn_norm.weight"),
                qkv=linear([n + ".weight" for n in q_k_v]),
                qkv_bias=qkv_bias,
                wo=linear([p + "attn_output.weight"]),
                wo_bias=optional(p + "attn_output.bias"),
                ffn_norm=vector(p + "ffn_norm.weight"),
                gate_up=None if experts is not None else linear([n + ".weight" for n in gate_up]),
                down=None if experts is not None else linear([p + "ffn_down.weight"]),
                gate_up_bias=gate_up_bias,
                down_bias=optional(p + "ffn_down.bias"),
                window=config.layer_windows[i],
                rotary=config.layer_rotary[i],
                q_norm=vector(p + "attn_q_norm.weight") if spec.qk_norm else None,
                k_norm=vector(p + "attn_k_norm.weight") if spec.qk_norm else None,
                post_attn_norm=vector(p + "post_attention_norm.weight") if post else None,
                post_ffn_norm=vector(p + "post_ffw_norm.weight") if post else None,
                experts=experts,
            )
        )
    embedding = linear([EMBEDDING]) if stage.is_first else None
    output_norm = head = None
    if stage.is_last:
        assert stage.head is not None
        output_norm = vector(OUTPUT_NORM)
        head = linear([stage.head])
    factors = None
    factors_name = rope_factors(config, stage.tensors)
    for name in (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT):
        if stage.has(name):
            count(name)  # every tensor the stage owns is counted, the one chosen read
    if factors_name is not None:
        factors = stage.dequantize(factors_name).reshape(-1)
    rot = rope_rotations(config.rope, max_seq_len, factors)
    rot_swa = None
    if any(layer.window for layer in layers) and config.rope_swa != config.rope:
        rot_swa = rope_rotations(config.rope_swa, max_seq_len, factors)
    return StageWeights(
        config=config,
        layers=layers,
        embedding=embedding,
        output_norm=output_norm,
        head=head,
        rot=rot,
        vocab_size=stage.vocab_size,
        stored_bytes=total,
        rot_swa=rot_swa,
        q_temps=query_temperatures(config, max_seq_len),
        first_block=stage.layer_start,
    )
