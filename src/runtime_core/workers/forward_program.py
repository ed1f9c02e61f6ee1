"""One stage's forward pass, written once over a backend.

The CUDA worker, its NumPy twin and the CPU worker run the same sequence of fused
operations (the ``Ops`` protocol), each on its own buffers: ``DeviceOps`` launches the
kernels of ``kernels/*.cu``, ``TwinOps`` calls their twins, ``CpuOps`` the compiled
CPU kernels. A test of the twin stage against the reference worker therefore checks this
sequence, the tensor layout and the host logic; a test of each kernel against its twin
(on a GPU, and on the SIMT emulator of the tests) checks the rest.

Weights stay as stored: a matrix is its GGUF rows (``(n_out, row_bytes)`` bytes). Q, K
and V become one matrix when they share a type (their rows concatenated, still GGUF
rows), and so do the feed-forward gate and up, unless the backend keeps the file's
rows where they are (``join_parts=False``: the CPU worker maps them); otherwise each
part writes its own slice of the output row. A file's fused ``attn_qkv`` or ``ffn_up``
(phi3) is one such matrix already, rows ``[q; k; v]`` or ``[gate; up]``: the step splits
its output by the config's sizes, as it splits the joined parts'. Norm weights and biases
are float32.

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

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan.gguf_header import TensorInfo
from runplan.quant_types import CHUNK, QUANT_TYPES, row_bytes
from runtime_core.architectures import Activation, FfnLayout, QkvLayout
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
from runtime_core.workers.experts import Routing, route, shared_gate
from runtime_core.workers.rotary import query_temperatures, rope_rotations

H = TypeVar("H")  # a backend's handle of raw GGUF rows
V = TypeVar("V")  # a backend's handle of a float32 vector
H_co = TypeVar("H_co", covariant=True)
V_co = TypeVar("V_co", covariant=True)
V_contra = TypeVar("V_contra", contravariant=True)
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Progress = Callable[[int, int], None]


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
    factors_name = rope_factors(config, stage.tensors, max_seq_len)
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
