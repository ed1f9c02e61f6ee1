"""The transformer of one stage in NumPy, in the style of llama2.c.

``StageWeights.load`` dequantizes the stage's tensors to float32 once, in the layout
the forward pass wants: contiguous matrices (a row of activations times a matrix is
then one BLAS call over memory read in order), Q, K and V fused into one matrix,
gate and up into another, each in the orientation OpenBLAS multiplies fastest (see
``BlockWeights``). ``StageModel`` holds those weights, the rotary tables and a KV
cache of ``max_seq_len`` positions, and runs ``forward(x, pos)`` over rows of the
residual stream.

The arithmetic follows llama.cpp's graphs (``src/models/{llama,qwen2,qwen3,gemma3,
phi3}.cpp``), as ``runtime_core.architectures`` lays them out: RMS norm, rotary
embedding, grouped-query attention with a causal mask (and a sliding window on the
blocks that have one), a gated feed-forward (SiLU or GELU) or a mixture of such
experts (``workers.experts`` routes each row), output norm and head;
per-head Q/K norms, post-norms, the embedding scale and the logit soft cap where the
architecture has them. A fused ``attn_qkv`` ([q; k; v]) or ``ffn_up`` ([gate; up]) is
already the fused matrix this model multiplies by, so it loads as one.

Rotary embedding is applied as a complex multiplication of adjacent pairs; for an
architecture whose pairs are the two halves of a head (NeoX) the Q and K columns are
permuted at load time into adjacent pairs. The attention scores of a head are dot
products of its Q and K, which a permutation applied to both leaves unchanged; a
per-head norm's mean square is unchanged too, and its weights are permuted alike.

A block's KV cache holds ``max_seq_len`` positions, or a sliding block's window when
that is shorter: a ring, position ``p`` in slot ``p % size``, so that a step only ever
reads the positions its window sees (the planner counts it so).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt

from runtime_core.architectures import Activation, FfnLayout, QkvLayout
from runtime_core.gguf_slice import (
    EMBEDDING,
    OUTPUT_NORM,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS,
    StageSlice,
    dequantize_rows,
    qkv_layout,
    rope_factors,
)
from runtime_core.model_config import ModelConfig
from runtime_core.workers.experts import route, shared_gate, weighted_sum
from runtime_core.workers.rotary import query_temperatures, rope_rotations

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


@attrs.define
class Scratch:
    """The Q|K|V rows of a step and views of them. A decode step reuses one set made
    at bind time, so it allocates none of these and computes none of the views."""

    qkv: F32  # (rows, q_dim + k_dim + v_dim)
    qk: F32  # (rows, n_heads + n_kv_heads, head_dim_k): the Q and K heads
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
            qk=qk,
            q=qk[:, : c.n_heads],
            k_by_head=qk[:, c.n_heads :].transpose(1, 0, 2),
            v_by_head=v.transpose(1, 0, 2),
            rotary=qk[:, :, : c.rope.n_dims].view(np.complex64),  # adjacent pairs
        )


class StageModel:
    """One stage's blocks (and embedding / head) with a KV cache per block;
    ``forward`` runs rows of the residual stream through the blocks."""

    def __init__(
        self, weights: StageWeights, max_seq_len: int, positions: int | None = None
    ) -> None:
        c = weights.config
        self.weights = weights
        self.config = c
        self.max_seq_len = max_seq_len
        tables = weights.rope_factor_tables
        name = rope_factors(c, tables, max_seq_len)
        factors = None if name is None else tables[name]
        self.rot = rope_rotations(c.rope, max_seq_len, factors)
        self.rot_swa = self.rot
        self.windows = [c.layer_windows[i] for i in weights.layers]
        self.rotary = [c.layer_rotary[i] for i in weights.layers]
        self.q_temps = query_temperatures(c, max_seq_len)
        if any(self.windows) and c.rope_swa != c.rope:
            self.rot_swa = rope_rotations(c.rope_swa, max_seq_len, factors)
        self._make_cache(max_seq_len if positions is None else positions)

    def for_run(self, positions: int) -> StageModel:
        """A model over the same weights and rotary tables with a KV cache of its own for
        ``positions`` positions: one run's (CONCURRENT_RUNS.md §3)."""
        run = object.__new__(StageModel)
        run.weights, run.config, run.max_seq_len = self.weights, self.config, self.max_seq_len
        run.rot, run.rot_swa, run.windows = self.rot, self.rot_swa, self.windows
        run.rotary, run.q_temps = self.rotary, self.q_temps
        run._make_cache(positions)
        return run

    @property
    def kv_bytes(self) -> int:
        """What the KV cache holds (allocated: its pages are taken as they are written)."""
        return sum(a.nbytes for a in (*self.k_cache, *self.v_cache))

    def _make_cache(self, positions: int) -> None:
        c = self.config
        # (n_kv_heads, size, head_dim) per block: ``positions``, or the window when that is
        # shorter. Untouched pages cost no memory: the cache grows as positions are written.
        sizes = [min(w, positions) if w else positions for w in self.windows]
        self.k_cache = [np.empty((c.n_kv_heads, n, c.head_dim_k), np.float32) for n in sizes]
        self.v_cache = [np.empty((c.n_kv_heads, n, c.head_dim_v), np.float32) for n in sizes]
        self.scale = np.float32(c.query_scale)
        self.one_row = Scratch.make(c, 1)

    def embed(self, ids: npt.NDArray[np.integer]) -> F32:
        assert self.weights.embedding is not None
        x = self.weights.embedding.lookup(ids)  # (rows, hidden)
        if self.config.embedding_scale != 1.0:
            x *= np.float32(self.config.embedding_scale)
        return x

    def forward(self, x: F32, pos: int) -> F32:
        """``x``: ``(rows, hidden)`` float32 residual rows at positions ``pos ..``,
        updated in place and returned."""
        c = self.config
        rows = x.shape[0]
        s = self.one_row if rows == 1 else Scratch.make(c, rows)
        rot = self.rot[pos : pos + rows, None, :]  # (rows, 1, rope_dims / 2)
        rot_swa = self.rot_swa[pos : pos + rows, None, :]
        gelu = c.spec.activation is Activation.GELU_TANH
        for i, w in enumerate(self.weights.blocks):
            # attention
            xn = rms_norm(x, w.attn_norm, c.rms_eps)
            linear(xn, w.wqkv, out=s.qkv)
            if w.bqkv is not None:
                s.qkv += w.bqkv
            if w.q_norm is not None and w.k_norm is not None:
                head_rms_norm(s.qk, c.n_heads, w.q_norm, w.k_norm, c.rms_eps)
            if self.rotary[i]:  # rotary embedding of Q and K (not in a NoPE block)
                s.rotary *= rot_swa if self.windows[i] else rot
            if self.q_temps is not None:  # mistral3's temperature of the queries
                s.q *= self.q_temps[pos : pos + rows, None, None]
            att = self._attention(i, s, pos)  # (rows, n_heads * head_dim_v)
            out = linear(att, w.wo)
            if w.bo is not None:
                out += w.bo
            if w.post_attn_norm is not None:
                out = rms_norm(out, w.post_attn_norm, c.rms_eps)
            if c.residual_scale:  # granite's, rounded before the sum
                out *= np.float32(c.residual_scale)
            x += out
            # feed-forward
            xn = rms_norm(x, w.ffn_norm, c.rms_eps)
            if w.router is not None:
                down = self._experts(w, xn)
                if c.residual_scale:  # granite's
                    down *= np.float32(c.residual_scale)
                x += down
                continue
            h = linear(xn, w.w13)  # (rows, 2 * ffn): gate | up
            if w.b13 is not None:
                h += w.b13
            f = h.shape[1] // 2
            gate, up = h[:, :f], h[:, f:]
            if gelu:
                gelu_tanh(gate)
            else:
                silu(gate)
            gate *= up
            down = linear(gate, w.w2.T)
            if w.b2 is not None:
                down += w.b2
            if w.post_ffn_norm is not None:
                down = rms_norm(down, w.post_ffn_norm, c.rms_eps)
            if c.residual_scale:
                down *= np.float32(c.residual_scale)
            x += down
        return x

    def _experts(self, w: BlockWeights, xn: F32) -> F32:
        """The mixture of experts' output for the normalized rows ``xn`` (``experts``)."""
        assert w.router is not None
        routing = route(
            linear(xn, w.router), self.config.n_experts_used, self.config.spec.expert_weights_norm
        )
        outputs = np.empty((routing.experts.shape[1], *xn.shape), np.float32)
        f = w.w13.shape[2] // 2
        for e, rows, slots in routing.by_expert():
            h = linear(xn[rows], w.w13[e])  # (n, 2 * ffn): gate | up
            gate = h[:, :f]
            silu(gate)
            gate *= h[:, f:]
            outputs[slots, rows] = linear(gate, w.w2[e].T) * routing.weights[rows, slots, None]
        out = weighted_sum(outputs)
        if w.shared_w13 is not None and w.shared_w2 is not None and w.shared_gate is not None:
            h = linear(xn, w.shared_w13)  # qwen2moe's shared expert, times its gate
            fs = h.shape[1] // 2
            gate = h[:, :fs]
            silu(gate)
            gate *= h[:, fs:]
            shared = linear(gate, w.shared_w2.T) * shared_gate(xn @ w.shared_gate)[:, None]
            out += shared
        return out

    def _attention(self, i: int, s: Scratch, pos: int) -> F32:
        """Store the step's keys and values in block ``i``'s cache and attend: query rows
        at positions ``pos ..`` see keys ``0 .. their own`` (causal), and a sliding
        block's only the last ``window`` of them. Returns ``(rows, n_heads * head_dim_v)``.

        The cache is a ring of ``size`` slots, position ``p`` in slot ``p % size``. While
        the step's positions fit (always, for a global block), slot and position are
        the same. Past that, a decode step sees the whole ring (its last ``size <=
        window`` positions); a longer step sees the cached positions before it and its
        own, masked by the window."""
        kc, vc, window = self.k_cache[i], self.v_cache[i], self.windows[i]
        rows, size = s.q.shape[0], kc.shape[1]
        end = pos + rows
        masked: npt.NDArray[np.bool_] | None = None
        if end <= size:
            kc[:, pos:end] = s.k_by_head
            vc[:, pos:end] = s.v_by_head
            keys, values = kc[:, :end], vc[:, :end]  # (n_kv_heads, n_ctx, head_dim)
            if rows > 1:  # causal: row r (at pos + r) sees keys 0 .. pos + r
                masked = np.arange(end)[None, :] > (pos + np.arange(rows))[:, None]
        elif rows == 1:
            kc[:, pos % size] = s.k_by_head[:, 0]
            vc[:, pos % size] = s.v_by_head[:, 0]
            keys, values = kc, vc  # positions pos - size + 1 .. pos, all in the window
        else:
            start = max(0, pos - size)
            slots = np.arange(start, pos) % size
            keys = np.concatenate([kc[:, slots], s.k_by_head], axis=1)
            values = np.concatenate([vc[:, slots], s.v_by_head], axis=1)
            key_pos = np.arange(start, end)[None, :]
            query_pos = (pos + np.arange(rows))[:, None]
            masked = (key_pos > query_pos) | (query_pos - key_pos >= window)
            kept = np.arange(max(pos, end - size), end)  # the last ``size`` positions
            kc[:, kept % size] = s.k_by_head[:, kept - pos]
            vc[:, kept % size] = s.v_by_head[:, kept - pos]
        return self._scores(s.q, keys, values, masked)

    def _scores(self, q: F32, keys: F32, values: F32, masked: npt.NDArray[np.bool_] | None) -> F32:
        """Attention of query rows ``q`` ``(rows, n_heads, head_dim)`` over ``keys`` and
        ``values`` ``(n_kv_heads, n_ctx, head_dim)``, with ``masked`` ``(rows, n_ctx)``
        (True: not seen); query head ``h`` reads kv head ``h // (n_heads / n_kv_heads)``."""
        c = self.config
        rows, n_ctx = q.shape[0], keys.shape[1]
        group = c.n_heads // c.n_kv_heads
        # (n_kv_heads, group * rows, head_dim): each kv head's query rows, head by head.
        qg: F32
        if rows == 1:
            qg = q.reshape(c.n_kv_heads, group, c.head_dim_k)
        else:
            by_head = q.reshape(rows, c.n_kv_heads, group, c.head_dim_k).transpose(1, 2, 0, 3)
            qg = by_head.reshape(c.n_kv_heads, group * rows, c.head_dim_k)
        scores: F32 = qg @ keys.transpose(0, 2, 1)  # (n_kv_heads, group * rows, n_ctx)
        scores *= self.scale
        _softcap(scores, c.attn_logit_softcap)
        if masked is not None:
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
        out = linear(rms_norm(x_last, w.output_norm, self.config.rms_eps), w.head).reshape(-1)
        if self.config.logit_factor != 1.0:  # granite's 1 / logit_scale
            out *= np.float32(self.config.logit_factor)
        _softcap(out, self.config.final_logit_softcap)
        return out


def _softcap(x: F32, cap: float) -> None:
    """``x = cap * tanh(x / cap)`` in place (llama.cpp's three operations, the first a
    product by ``1 / cap``), where ``cap`` > 0."""
    if cap > 0.0:
        x *= np.float32(1.0 / cap)
        np.tanh(x, out=x)
        x *= np.float32(cap)


def silu(x: F32) -> None:
    """``x * sigmoid(x)``, in place."""
    e = np.exp(-x)
    e += 1.0
    np.divide(x, e, out=x)


_GELU_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: F32) -> None:
    """GELU's tanh form ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, in place."""
    inner = x * x
    inner *= _GELU_A
    inner += 1.0
    inner *= x
    inner *= _SQRT_2_OVER_PI
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= 0.5
    x *= inner


def head_rms_norm(qk: F32, n_q_heads: int, q_weight: F32, k_weight: F32, eps: float) -> None:
    """RMS norm of every head of ``qk`` ``(rows, heads, head_dim)`` over its
    ``head_dim``, in place; the first ``n_q_heads`` heads times ``q_weight``, the others
    times ``k_weight``."""
    ms = np.einsum("rhd,rhd->rh", qk, qk) / np.float32(qk.shape[-1])
    qk *= (1.0 / np.sqrt(ms + np.float32(eps)))[:, :, None]
    qk[:, :n_q_heads] *= q_weight
    qk[:, n_q_heads:] *= k_weight


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
