"""The reference model's attention: a step's Q|K|V rows (``Scratch``) and their
attention over each block's KV cache (``Attention``, a part of ``StageModel``).

A block's KV cache holds ``max_seq_len`` positions, or a sliding block's window when
that is shorter: a ring, position ``p`` in slot ``p % size``, so that a step only ever
reads the positions its window sees (the planner counts it so).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from runtime_core.model_config import ModelConfig
from runtime_core.workers.reference.functions import softcap

F32 = npt.NDArray[np.float32]


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


class Attention:
    """The attention of ``StageModel``'s blocks over their KV caches (a mix-in: the
    model makes the caches)."""

    config: ModelConfig
    k_cache: list[F32]  # per block: (n_kv_heads, size, head_dim_k)
    v_cache: list[F32]  # per block: (n_kv_heads, size, head_dim_v)
    windows: list[int]  # per block: its window (0: global)
    scale: np.float32  # the query scale

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
        softcap(scores, c.attn_logit_softcap)
        if masked is not None:
            scores.reshape(c.n_kv_heads, group, rows, n_ctx)[:, :, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out: F32 = scores @ values  # (n_kv_heads, group * rows, head_dim_v)
        if rows > 1:
            out = out.reshape(c.n_kv_heads, group, rows, c.head_dim_v).transpose(2, 0, 1, 3)
        return out.reshape(rows, c.n_heads * c.head_dim_v)
