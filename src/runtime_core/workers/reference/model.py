"""The transformer of one stage in NumPy, in the style of llama2.c.

``StageModel`` holds the stage's weights (``weights``: dequantized to float32 once, in
the layout the forward pass wants), the rotary tables and a KV cache of ``max_seq_len``
positions, and runs ``forward(x, pos)`` over rows of the residual stream: its
attention is ``attention``'s, its mixture of experts ``mixture``'s, its row-wise
functions (norms, products, activations) ``functions``'.

The arithmetic follows llama.cpp's graphs (``src/models/{llama,qwen2,qwen3,gemma3,
phi3}.cpp``), as ``runtime_core.architectures`` lays them out: RMS norm, rotary
embedding, grouped-query attention with a causal mask (and a sliding window on the
blocks that have one), a gated feed-forward (SiLU or GELU) or a mixture of such
experts (``workers.experts`` routes each row), output norm and head;
per-head Q/K norms, post-norms, the embedding scale and the logit soft cap where the
architecture has them. A fused ``attn_qkv`` ([q; k; v]) or ``ffn_up`` ([gate; up]) is
already the fused matrix this model multiplies by, so it loads as one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from runtime_core.architectures import Activation
from runtime_core.gguf_slice import rope_factors
from runtime_core.workers.reference.attention import Attention, Scratch
from runtime_core.workers.reference.functions import (
    gelu_tanh,
    head_rms_norm,
    linear,
    rms_norm,
    silu,
    softcap,
)
from runtime_core.workers.reference.mixture import MixtureOfExperts
from runtime_core.workers.reference.weights import StageWeights
from runtime_core.workers.rotary import query_temperatures, rope_rotations

F32 = npt.NDArray[np.float32]


class StageModel(Attention, MixtureOfExperts):
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
        name = rope_factors(c, tables)
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

    def logits(self, x_last: F32) -> F32:
        """Raw logits ``(vocab,)`` of one residual row ``(1, hidden)``."""
        w = self.weights
        assert w.output_norm is not None and w.head is not None
        out = linear(rms_norm(x_last, w.output_norm, self.config.rms_eps), w.head).reshape(-1)
        if self.config.logit_factor != 1.0:  # granite's 1 / logit_scale
            out *= np.float32(self.config.logit_factor)
        softcap(out, self.config.final_logit_softcap)
        return out
