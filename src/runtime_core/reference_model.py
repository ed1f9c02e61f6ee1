"""The transformer of one stage in NumPy, in the style of llama2.c.

``StageWeights.load`` dequantizes the stage's tensors to float32 once, in the layout
the forward pass wants: contiguous matrices (a row of activations times a matrix is
then one BLAS call over memory read in order), Q, K and V fused into one matrix,
gate and up into another, each in the orientation OpenBLAS multiplies fastest (see
``BlockWeights``). ``StageModel`` holds those weights, the rotary tables and a KV
cache of ``max_seq_len`` positions, and runs ``forward(x, pos)`` over rows of the
residual stream.

The arithmetic follows llama.cpp's graph for llama and qwen2 (``llm_build_llama``,
``llm_build_qwen2``): RMS norm, rotary embedding, grouped-query attention with a
causal mask and scale ``1/sqrt(head_dim)``, SwiGLU feed-forward, output norm and head.
Rotary embedding is applied as a complex multiplication of adjacent pairs; for an
architecture whose pairs are the two halves of a head (NeoX, qwen2) the Q and K
columns are permuted at load time into adjacent pairs. The attention scores of a head
are dot products of its Q and K, which a permutation applied to both leaves
unchanged, so nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt

from runtime_core.gguf_slice import EMBEDDING, OUTPUT_NORM, ROPE_FREQS, StageSlice, dequantize_rows
from runtime_core.model_config import ModelConfig, RopeConfig

F32 = npt.NDArray[np.float32]
Progress = Callable[[int, int], None]


@attrs.define
class BlockWeights:
    attn_norm: F32  # (hidden,)
    wqkv: F32  # (hidden, q_dim + k_dim + v_dim): attn_q | attn_k | attn_v, transposed
    bqkv: F32 | None  # (q_dim + k_dim + v_dim,): the attention biases (qwen2)
    wo: F32  # (n_heads * head_dim_v, hidden): attn_output, transposed
    bo: F32 | None  # (hidden,)
    ffn_norm: F32  # (hidden,)
    w13: F32  # (hidden, 2 * ffn): ffn_gate | ffn_up, transposed
    # (hidden, ffn): ffn_down as stored, used transposed. A matrix with more inputs than
    # outputs multiplies faster this way round (OpenBLAS's gemv, measured on SmolLM2).
    w2: F32


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
    blocks: list[BlockWeights]  # the stage's blocks, in order
    embedding: Embedding | None  # first stage
    output_norm: F32 | None  # (hidden,): last stage
    head: F32 | None  # (hidden, vocab): output (or token_embd when tied), transposed
    rope_freq_factors: F32 | None  # (rope_dims / 2,): llama3's rope_freqs, divides theta

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

        config = stage.config
        h, qkv_dim = config.hidden_dim, config.q_dim + config.k_dim + config.v_dim
        o_dim = config.n_heads * config.head_dim_v
        arena = _Arena(
            sum(h * (qkv_dim + o_dim + 3 * config.ffn_dims[i]) for i in stage.layers)
            + (h * stage.vocab_size if stage.head is not None else 0)
        )
        to_pairs = _rope_pair_order(config)
        blocks = []
        for layer in stage.layers:
            p = f"blk.{layer}."
            f = config.ffn_dims[layer]
            q_k_v = [p + "attn_q", p + "attn_k", p + "attn_v"]
            wqkv = matrix([n + ".weight" for n in q_k_v], arena.take(h, qkv_dim))
            wqkv[:, : to_pairs.size] = wqkv[:, to_pairs]
            biases = [optional(n + ".bias") for n in q_k_v]
            bqkv = None
            if any(b is not None for b in biases):
                widths = (config.q_dim, config.k_dim, config.v_dim)
                bqkv = np.concatenate(
                    [
                        np.zeros(w, np.float32) if b is None else b
                        for b, w in zip(biases, widths, strict=True)
                    ]
                )
                bqkv[: to_pairs.size] = bqkv[to_pairs]
            blocks.append(
                BlockWeights(
                    attn_norm=dense(p + "attn_norm.weight"),
                    wqkv=wqkv,
                    bqkv=bqkv,
                    wo=matrix([p + "attn_output.weight"], arena.take(o_dim, h)),
                    bo=optional(p + "attn_output.bias"),
                    ffn_norm=dense(p + "ffn_norm.weight"),
                    w13=matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], arena.take(h, 2 * f)),
                    w2=matrix([p + "ffn_down.weight"], arena.take(h, f), transposed=False),
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
            blocks=blocks,
            embedding=embedding,
            output_norm=output_norm,
            head=head,
            rope_freq_factors=optional(ROPE_FREQS),
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


def _load_rows(stage: StageSlice, names: list[str], out: F32, *, transposed: bool) -> F32:
    """Matrices ``names`` (``(n_out_i, n_in)`` once dequantized) stacked into ``out``:
    side by side and transposed, ``(n_in, sum n_out_i)``, or one above the other as
    stored, ``(sum n_out_i, n_in)``."""
    at = 0
    for name in names:
        raw = stage.raw(name)  # (n_out, row_bytes)
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


def _rope_pair_order(config: ModelConfig) -> npt.NDArray[np.intp]:
    """Column order of the fused Q|K output that puts each rotary pair side by side:
    the identity for llama's adjacent pairs; for NeoX, head by head, the rotary part
    ``[0, n/2, 1, n/2 + 1, ...]`` and the rest of the head unchanged."""
    hd, n = config.head_dim_k, config.rope.n_dims
    within = np.arange(hd)
    if config.rope.neox:
        within[:n] = np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], axis=1).ravel()
    heads = config.n_heads + config.n_kv_heads
    return (np.arange(heads)[:, None] * hd + within[None, :]).ravel()


def rope_rotations(
    rope: RopeConfig, max_seq_len: int, freq_factors: F32 | None
) -> npt.NDArray[np.complex64]:
    """``exp(i * theta)`` for every position and rotary pair: ``(max_seq_len, n/2)``.

    Computed as ggml does, in float32: ``theta_0 = pos``, ``theta_{i+1} = theta_i *
    freq_base ** (-2 / n)``, each divided by its frequency factor and multiplied by
    ``freq_scale``."""
    half = rope.n_dims // 2
    theta_scale = np.float32(rope.freq_base) ** np.float32(-2.0 / rope.n_dims)
    theta = np.empty((max_seq_len, half), dtype=np.float32)
    t = np.arange(max_seq_len, dtype=np.float32)
    for i in range(half):
        theta[:, i] = t
        t = t * theta_scale
    if freq_factors is not None:
        theta /= freq_factors
    theta *= np.float32(rope.freq_scale)
    out = np.empty((max_seq_len, half), dtype=np.complex64)
    out.real = np.cos(theta)
    out.imag = np.sin(theta)
    return out


@attrs.define
class Scratch:
    """The Q|K|V rows of a step and views of them. A decode step reuses one set made
    at bind time, so it allocates none of these and computes none of the views."""

    qkv: F32  # (rows, q_dim + k_dim + v_dim)
    q: F32  # (rows, n_heads, head_dim_k)
    k_by_head: F32  # (n_kv_heads, rows, head_dim_k): as the KV cache holds them
    v_by_head: F32  # (n_kv_heads, rows, head_dim_v)
    rotary: npt.NDArray[np.complex64]  # (rows, n_heads + n_kv_heads, rope_dims / 2)

    @classmethod
    def make(cls, c: ModelConfig, rows: int) -> Scratch:
        qkv = np.empty((rows, c.q_dim + c.k_dim + c.v_dim), np.float32)
        qk = qkv[:, : c.q_dim + c.k_dim].reshape(rows, c.n_heads + c.n_kv_heads, c.head_dim_k)
        v = qkv[:, c.q_dim + c.k_dim :].reshape(rows, c.n_kv_heads, c.head_dim_v)
        return cls(
            qkv=qkv,
            q=qk[:, : c.n_heads],
            k_by_head=qk[:, c.n_heads :].transpose(1, 0, 2),
            v_by_head=v.transpose(1, 0, 2),
            rotary=qk[:, :, : c.rope.n_dims].view(np.complex64),  # adjacent pairs
        )


class StageModel:
    """One stage's blocks (and embedding / head) with a KV cache of ``max_seq_len``
    positions; ``forward`` runs rows of the residual stream through the blocks."""

    def __init__(self, weights: StageWeights, max_seq_len: int) -> None:
        c = weights.config
        self.weights = weights
        self.config = c
        self.max_seq_len = max_seq_len
        self.rot = rope_rotations(c.rope, max_seq_len, weights.rope_freq_factors)
        n = len(weights.blocks)
        # Untouched pages cost no memory: the cache grows as positions are written.
        self.k_cache = np.empty((n, c.n_kv_heads, max_seq_len, c.head_dim_k), np.float32)
        self.v_cache = np.empty((n, c.n_kv_heads, max_seq_len, c.head_dim_v), np.float32)
        self.scale = np.float32(1.0 / np.sqrt(c.head_dim_k))
        self.one_row = Scratch.make(c, 1)

    def embed(self, ids: npt.NDArray[np.integer]) -> F32:
        assert self.weights.embedding is not None
        return self.weights.embedding.lookup(ids)  # (rows, hidden)

    def forward(self, x: F32, pos: int) -> F32:
        """``x``: ``(rows, hidden)`` float32 residual rows at positions ``pos ..``,
        updated in place and returned."""
        c = self.config
        rows = x.shape[0]
        s = self.one_row if rows == 1 else Scratch.make(c, rows)
        rot = self.rot[pos : pos + rows, None, :]  # (rows, 1, rope_dims / 2)
        for layer, w in enumerate(self.weights.blocks):
            # attention
            xn = rms_norm(x, w.attn_norm, c.rms_eps)
            linear(xn, w.wqkv, out=s.qkv)
            if w.bqkv is not None:
                s.qkv += w.bqkv
            s.rotary *= rot  # rotary embedding of Q and K
            self.k_cache[layer, :, pos : pos + rows] = s.k_by_head
            self.v_cache[layer, :, pos : pos + rows] = s.v_by_head
            att = self._attention(layer, s.q, pos)  # (rows, n_heads * head_dim_v)
            out = linear(att, w.wo)
            if w.bo is not None:
                out += w.bo
            x += out
            # feed-forward
            xn = rms_norm(x, w.ffn_norm, c.rms_eps)
            h = linear(xn, w.w13)  # (rows, 2 * ffn): gate | up
            f = h.shape[1] // 2
            gate, up = h[:, :f], h[:, f:]
            silu = np.exp(-gate)
            silu += 1.0
            np.divide(gate, silu, out=gate)
            gate *= up
            x += linear(gate, w.w2.T)
        return x

    def _attention(self, layer: int, q: F32, pos: int) -> F32:
        """Causal attention of query rows ``q`` ``(rows, n_heads, head_dim)`` at
        positions ``pos ..`` over the cached keys and values ``0 .. pos + rows - 1``;
        query head ``h`` reads kv head ``h // (n_heads / n_kv_heads)``."""
        c = self.config
        rows = q.shape[0]
        n_ctx = pos + rows
        group = c.n_heads // c.n_kv_heads
        # (n_kv_heads, group * rows, head_dim): each kv head's query rows, head by head.
        qg: F32
        if rows == 1:
            qg = q.reshape(c.n_kv_heads, group, c.head_dim_k)
        else:
            by_head = q.reshape(rows, c.n_kv_heads, group, c.head_dim_k).transpose(1, 2, 0, 3)
            qg = by_head.reshape(c.n_kv_heads, group * rows, c.head_dim_k)
        keys = self.k_cache[layer, :, :n_ctx]  # (n_kv_heads, n_ctx, head_dim)
        values = self.v_cache[layer, :, :n_ctx]
        scores: F32 = qg @ keys.transpose(0, 2, 1)  # (n_kv_heads, group * rows, n_ctx)
        scores *= self.scale
        if rows > 1:  # causal: row r (at pos + r) sees keys 0 .. pos + r
            masked = np.arange(n_ctx)[None, :] > (pos + np.arange(rows))[:, None]
            scores.reshape(c.n_kv_heads, group, rows, n_ctx)[:, :, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out: F32 = scores @ values  # (n_kv_heads, group * rows, head_dim_v)
        if rows > 1:
            out = out.reshape(c.n_kv_heads, group, rows, c.head_dim_v).transpose(2, 0, 1, 3)
        return out.reshape(rows, c.n_heads * c.head_dim_v)

    def logits(self, x_last: F32) -> F32:
        """Raw logits ``(vocab,)`` of one residual row ``(1, hidden)``."""
        w = self.weights
        assert w.output_norm is not None and w.head is not None
        return linear(rms_norm(x_last, w.output_norm, self.config.rms_eps), w.head).reshape(-1)


def linear(x: F32, w: F32, out: F32 | None = None) -> F32:
    """``x @ w`` for rows ``x`` ``(rows, n_in)`` and ``w`` ``(n_in, n_out)`` (into ``out``
    when given). One row goes to BLAS as a vector (gemv), which OpenBLAS runs faster
    than a one-row gemm."""
    if x.shape[0] == 1:
        if out is None:
            row: F32 = x[0] @ w
            return row[None, :]
        np.matmul(x[0], w, out=out[0])
        return out
    return np.matmul(x, w, out=out)


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis of ``(rows, n)``."""
    n = x.shape[1]
    if x.shape[0] == 1:  # a decode step: scalar arithmetic costs less than array calls
        out: F32 = x * np.float32(1.0 / math.sqrt(float(np.dot(x[0], x[0])) / n + eps))
    else:
        ms = np.einsum("ij,ij->i", x, x) / np.float32(n)
        out = x * (1.0 / np.sqrt(ms + np.float32(eps)))[:, None]
    out *= weight
    return out
