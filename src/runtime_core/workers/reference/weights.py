"""The reference model's weights of one stage, dequantized to float32 once.

``StageWeights.load`` dequantizes the stage's tensors to float32 once, in the layout
the forward pass wants: contiguous matrices (a row of activations times a matrix is
then one BLAS call over memory read in order), Q, K and V fused into one matrix,
gate and up into another, each in the orientation OpenBLAS multiplies fastest (see
``BlockWeights``). ``StageModel`` holds those weights, the rotary tables and a KV
cache of ``max_seq_len`` positions, and runs ``forward(x, pos)`` over rows of the
residual stream.

Rotary embedding is applied as a complex multiplication of adjacent pairs; for an
architecture whose pairs are the two halves of a head (NeoX) the Q and K columns are
permuted at load time into adjacent pairs. The attention scores of a head are dot
products of its Q and K, which a permutation applied to both leaves unchanged; a
per-head norm's mean square is unchanged too, and its weights are permuted alike.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt

from runtime_core.architectures import FfnLayout, QkvLayout
from runtime_core.gguf_slice import (
    EMBEDDING,
    OUTPUT_NORM,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS,
    StageSlice,
    dequantize_rows,
    qkv_layout,
)
from runtime_core.model_config import ModelConfig

F32 = npt.NDArray[np.float32]
Progress = Callable[[int, int], None]


@attrs.define
class BlockWeights:
    attn_norm: F32  # (hidden,)
    # (hidden, q_dim + k_dim + v_dim): attn_q | attn_k | attn_v (or attn_qkv), transposed
    wqkv: F32
    bqkv: F32 | None  # (q_dim + k_dim + v_dim,): the attention biases (qwen2)
    q_norm: F32 | None  # (head_dim_k,): attn_q_norm, per head (qwen3, gemma3)
    k_norm: F32 | None  # (head_dim_k,): attn_k_norm
    wo: F32  # (n_heads * head_dim_v, hidden): attn_output, transposed
    bo: F32 | None  # (hidden,)
    post_attn_norm: F32 | None  # (hidden,): post_attention_norm (gemma3)
    ffn_norm: F32  # (hidden,)
    w13: F32  # (hidden, 2 * ffn): ffn_gate | ffn_up (or phi3's fused ffn_up), transposed
    # (hidden, ffn): ffn_down as stored, used transposed. A matrix with more inputs than
    # outputs multiplies faster this way round (OpenBLAS's gemv, measured on SmolLM2).
    w2: F32
    post_ffn_norm: F32 | None  # (hidden,): post_ffw_norm (gemma3)
    b13: F32 | None = None  # (2 * ffn,): the gate | up biases (llama), zeros where absent
    b2: F32 | None = None  # (hidden,): ffn_down's
    # a mixture of experts: the router ffn_gate_inp (hidden, n_experts), transposed; then
    # w13 is every expert's (n_experts, hidden, 2 * ffn) and w2 (n_experts, hidden, ffn)
    router: F32 | None = None
    # qwen2moe's shared expert: its gate (hidden,) and gate | up (hidden, 2 * fs),
    # transposed, and down (hidden, fs) as stored
    shared_gate: F32 | None = None
    shared_w13: F32 | None = None
    shared_w2: F32 | None = None


@attrs.define
class Embedding:
    """``token_embd`` as stored (quantized rows); a row is dequantized when used."""

    rows: npt.NDArray[np.uint8]  # (vocab, row_bytes), an owned copy
    ggml_type: str

    def lookup(self, ids: npt.NDArray[np.integer]) -> F32:
        return dequantize_rows(self.rows[ids], self.ggml_type)  # (len(ids), hidden)


@attrs.define
class StageWeights:
    config: ModelConfig
    layers: range  # the model's block indices of ``blocks``
    blocks: list[BlockWeights]  # the stage's blocks, in order
    embedding: Embedding | None  # first stage
    output_norm: F32 | None  # (hidden,): last stage
    head: F32 | None  # (hidden, vocab): output (or token_embd when tied), transposed
    # (rope_dims / 2,) each: llama3's rope_freqs, LongRoPE's long and short factors (those
    # the file has), by name: the stage's context picks the one theta is divided by
    rope_factor_tables: dict[str, F32]

    @classmethod
    def load(cls, stage: StageSlice, progress: Progress | None = None) -> StageWeights:
        """Dequantize the stage's tensors, a few rows at a time, into one allocation
        (``_Arena``). ``progress(done, total)`` counts bytes as stored in the file."""
        total = stage.stored_bytes
        counted: set[str] = set()

        def count(name: str) -> None:
            if name not in counted:  # a tied head is the embedding: one tensor
                counted.add(name)
                if progress is not None:
                    progress(sum(stage.tensors[n].n_bytes for n in counted), total)

        def dense(name: str) -> F32:
            out = stage.dequantize(name)
            count(name)
            return out

        def optional(name: str) -> F32 | None:
            return dense(name) if stage.has(name) else None

        def matrix(names: list[str], out: F32, *, transposed: bool = True) -> F32:
            for name in names:
                count(name)
            return _load_rows(stage, names, out, transposed=transposed)

        def experts(names: list[str], out: F32, *, transposed: bool = True) -> F32:
            """Every expert's matrix of ``names`` into ``out[e]``."""
            for name in names:
                count(name)
            for e in range(out.shape[0]):
                _load_rows(stage, names, out[e], transposed=transposed, expert=e)
            return out

        config = stage.config
        h, qkv_dim = config.hidden_dim, config.q_dim + config.k_dim + config.v_dim
        o_dim = config.n_heads * config.head_dim_v
        n_exp = config.n_experts
        per_ffn = max(n_exp, 1)  # a mixture: each expert's, and the router's n_exp columns
        fs = config.shared_ffn
        arena = _Arena(
            sum(
                h * (qkv_dim + o_dim + 3 * config.ffn_dims[i] * per_ffn + n_exp + 3 * fs)
                for i in stage.layers
            )
            + (h * stage.vocab_size if stage.head is not None else 0)
        )
        to_pairs = _rope_pair_order(config)
        head_pairs = _head_pair_order(config)
        spec = config.spec
        blocks = []
        for layer in stage.layers:
            p = f"blk.{layer}."
            f = config.ffn_dims[layer]
            fused = qkv_layout(config, layer, stage.tensors) is QkvLayout.FUSED
            q_k_v = [p + "attn_qkv"] if fused else [p + "attn_q", p + "attn_k", p + "attn_v"]
            wqkv = matrix([n + ".weight" for n in q_k_v], arena.take(h, qkv_dim))
            wqkv[:, : to_pairs.size] = wqkv[:, to_pairs]
            bqkv = _joined_bias(
                [optional(n + ".bias") for n in q_k_v], (config.q_dim, config.k_dim, config.v_dim)
            )
            if bqkv is not None:
                bqkv[: to_pairs.size] = bqkv[to_pairs]
            q_norm = k_norm = None
            if spec.qk_norm:
                q_norm = dense(p + "attn_q_norm.weight")[head_pairs]
                k_norm = dense(p + "attn_k_norm.weight")[head_pairs]
            gate_up = ["ffn_up"] if spec.ffn is FfnLayout.FUSED else ["ffn_gate", "ffn_up"]
            post = spec.post_norms
            router = shared_gate = shared_w13 = shared_w2 = None
            if fs:
                shared_gate = dense(p + "ffn_gate_inp_shexp.weight")
                shexp = [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]
                shared_w13 = matrix(shexp, arena.take(h, 2 * fs))
                down = [p + "ffn_down_shexp.weight"]
                shared_w2 = matrix(down, arena.take(h, fs), transposed=False)
            if n_exp:
                router = matrix([p + "ffn_gate_inp.weight"], arena.take(h, n_exp))
                w13 = experts(
                    [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"],
                    arena.take(n_exp * h, 2 * f).reshape(n_exp, h, 2 * f),
                )
                w2 = experts(
                    [p + "ffn_down_exps.weight"],
                    arena.take(n_exp * h, f).reshape(n_exp, h, f),
                    transposed=False,
                )
            else:
                w13 = matrix([f"{p}{n}.weight" for n in gate_up], arena.take(h, 2 * f))
                w2 = matrix([p + "ffn_down.weight"], arena.take(h, f), transposed=False)
            blocks.append(
                BlockWeights(
                    attn_norm=dense(p + "attn_norm.weight"),
                    wqkv=wqkv,
                    bqkv=bqkv,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    wo=matrix([p + "attn_output.weight"], arena.take(o_dim, h)),
                    bo=optional(p + "attn_output.bias"),
                    post_attn_norm=dense(p + "post_attention_norm.weight") if post else None,
                    ffn_norm=dense(p + "ffn_norm.weight"),
                    w13=w13,
                    w2=w2,
                    b13=_joined_bias([optional(f"{p}{n}.bias") for n in gate_up], (f, f)),
                    b2=optional(p + "ffn_down.bias"),
                    post_ffn_norm=dense(p + "post_ffw_norm.weight") if post else None,
                    router=router,
                    shared_gate=shared_gate,
                    shared_w13=shared_w13,
                    shared_w2=shared_w2,
                )
            )
        embedding = None
        if stage.is_first:
            embedding = Embedding(
                np.array(stage.raw(EMBEDDING)), stage.tensors[EMBEDDING].ggml_type
            )
            count(EMBEDDING)
        output_norm = head = None
        if stage.is_last and stage.head is not None:
            output_norm = dense(OUTPUT_NORM)
            head = matrix([stage.head], arena.take(h, stage.vocab_size))
        arena.check_full()
        return cls(
            config=config,
            layers=stage.layers,
            blocks=blocks,
            embedding=embedding,
            output_norm=output_norm,
            head=head,
            rope_factor_tables={
                name: dense(name)
                for name in (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
                if stage.has(name)
            },
        )


class _Arena:
    """One allocation for every matrix of a stage, so that what loading allocates and
    frees never sits between two of them."""

    def __init__(self, n_floats: int) -> None:
        self._data = np.empty(n_floats, dtype=np.float32)
        self._at = 0

    def take(self, rows: int, cols: int) -> F32:
        """The next ``(rows, cols)`` of the arena, contiguous."""
        view = self._data[self._at : self._at + rows * cols].reshape(rows, cols)
        self._at += rows * cols
        return view

    def check_full(self) -> None:
        assert self._at == self._data.size, (self._at, self._data.size)


#: Rows dequantized at a time. The gguf package holds a few copies of what it
#: dequantizes; a whole head (SmolLM2: 113 MB in float32) would leave the stage
#: holding up to that much more memory after loading, depending on the heap's layout.
_CHUNK_ROWS = 1024


def _load_rows(
    stage: StageSlice, names: list[str], out: F32, *, transposed: bool, expert: int | None = None
) -> F32:
    """Matrices ``names`` (``(n_out_i, n_in)`` once dequantized; of an expert's stacked
    tensors, that expert's) stacked into ``out``: side by side and transposed, ``(n_in,
    sum n_out_i)``, or one above the other as stored, ``(sum n_out_i, n_in)``."""
    at = 0
    for name in names:
        raw = stage.raw(name)  # (n_out, row_bytes)
        if expert is not None:
            raw = raw[expert]
        for start in range(0, raw.shape[0], _CHUNK_ROWS):
            rows = dequantize_rows(raw[start : start + _CHUNK_ROWS], stage.tensors[name].ggml_type)
            span = slice(at + start, at + start + rows.shape[0])
            if transposed:
                out[:, span] = rows.T
            else:
                out[span] = rows
        at += raw.shape[0]
    assert at == (out.shape[1] if transposed else out.shape[0]), (names, out.shape)
    return out


def _joined_bias(biases: list[F32 | None], widths: tuple[int, ...]) -> F32 | None:
    """The bias of joined projections (Q|K|V, gate|up) from theirs, ``widths`` wide
    (zeros for any missing), or ``None`` when there is none."""
    if all(b is None for b in biases):
        return None
    if len(biases) == 1:
        return biases[0]
    return np.concatenate(
        [np.zeros(w, np.float32) if b is None else b for b, w in zip(biases, widths, strict=True)]
    )


def _head_pair_order(config: ModelConfig) -> npt.NDArray[np.intp]:
    """Order of one head's ``head_dim_k`` columns that puts each rotary pair side by
    side: the identity for llama's adjacent pairs; for NeoX, the rotary part
    ``[0, n/2, 1, n/2 + 1, ...]`` and the rest of the head unchanged."""
    n = config.rope.n_dims
    within = np.arange(config.head_dim_k)
    if config.rope.neox:
        within[:n] = np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], axis=1).ravel()
    return within


def _rope_pair_order(config: ModelConfig) -> npt.NDArray[np.intp]:
    """Column order of the fused Q|K output that puts each rotary pair side by side,
    head by head (``_head_pair_order``)."""
    heads = config.n_heads + config.n_kv_heads
    within = _head_pair_order(config)
    return (np.arange(heads)[:, None] * config.head_dim_k + within[None, :]).ravel()
