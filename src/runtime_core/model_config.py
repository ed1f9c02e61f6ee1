"""The model's hyperparameters, read from GGUF metadata (llama2.c's ``Config``).

Keys follow llama.cpp (``llama-model.cpp``, ``llama-context.cpp``):

- ``{arch}.block_count``, ``.embedding_length``, ``.feed_forward_length`` (a number,
  or one per block), ``.attention.head_count``, ``.attention.head_count_kv`` (a number,
  or one per block, all the same: ``runplan.block_values``),
  ``.attention.key_length`` / ``.value_length`` (default ``hidden / heads``),
  ``.attention.layer_norm_rms_epsilon``.
- Heads that llama.cpp refuses are refused by its rules, in ``runtime_core.head_shapes``:
  no head, value heads of another size than the key heads, qwen2's, qwen2moe's and
  phi3's heads not filling ``embedding_length``, a rotary width the heads do not hold.
- Rotary embedding: ``{arch}.rope.freq_base`` (default 10000),
  ``.rope.dimension_count`` (default the key head size; it must be it but for the
  gemmas and phi3: ``head_shapes.rotary_within_heads``), ``.rope.scaling.type``
  (``none``, ``linear`` or ``yarn``; llama.cpp's default when absent is linear) and
  ``.rope.scaling.factor`` (or the older ``.rope.scale_linear``): positions are
  multiplied by ``1 / factor``, and by 1 when the type is ``none``; YaRN mixes those
  angles with the unscaled ones by a ramp over the pairs, from
  ``.rope.scaling.original_context_length`` (default the context length), and scales
  cos and sin (``workers.rotary``); ``.rope.scaling.attn_factor`` scales them under
  every type, as llama.cpp does; ``longrope`` is linear by the factor (1 without one),
  its per-frequency factors tensors (``gguf_slice.rope_factors``). llama3's ``rope_freqs.weight``
  tensor (per-frequency divisors) is a tensor, so the slice loads it, not this config.
- The layout of rotary pairs is the architecture's: llama and smollm3 rotate adjacent
  pairs ``(2i, 2i+1)`` ("normal"), the others the two halves ``(i, i + n/2)`` ("NeoX").
  smollm3's every fourth block rotates nothing (``layer_rotary``: the workers rotate 0
  dimensions there).
- Each block's attention (``runplan.layer_attention``): its sliding window (gemma2's
  and gemma3's ``attention.sliding_window`` and ``sliding_window_pattern``) and rotary
  base. A sliding block rotates with ``rope.freq_base_swa`` and no scaling (llama.cpp's
  ``rope_freq_scale_train_swa`` is 1); a global one with ``rope.freq_base`` and the
  file's scaling. Head sizes and rotary dimensions of sliding blocks must be those of
  the global ones (``*_swa`` keys that differ are refused).
- What else differs between architectures is in ``runtime_core.architectures``: the
  embedding scale (the gemmas: ``sqrt(hidden)``), the query scale, the soft caps
  ``final_logit_softcapping`` (gemma3's optional, gemma2's 30 by default) and
  ``attn_logit_softcapping`` (gemma2's, 50 by default).
- A mixture of experts (qwen3moe's, qwen2moe's, granitemoe's, llama's where
  ``expert_count`` is set: Mixtral): ``{arch}.expert_count`` and ``.expert_used_count``;
  each expert's feed-forward size (``ffn_dims``) is qwen3moe's and qwen2moe's
  ``.expert_feed_forward_length`` (else ``feed_forward_length / expert_used_count``),
  llama's and granitemoe's ``feed_forward_length``; qwen2moe's shared expert
  ``.expert_shared_feed_forward_length`` (else ``feed_forward_length``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from attrs import frozen

from runplan.block_values import model_integer, per_block_dimensions
from runplan.gguf_error import GgufError
from runplan.gguf_facts import block_count, expert_count
from runplan.gguf_header import GgufHeader
from runplan.layer_attention import SLIDING_WINDOWS, layer_attention, number
from runtime_core.architectures import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    ArchSpec,
    EmbeddingScale,
    Presence,
    QueryScale,
)
from runtime_core.errors import UnsupportedModel
from runtime_core.f32_math import log_f32
from runtime_core.head_shapes import (
    head_counts,
    heads_as_wide_as_hidden,
    rotary_within_heads,
    values_as_wide_as_keys,
)


@frozen
class RopeConfig:
    n_dims: int  # leading dimensions of each head that rotate (even, <= head size)
    freq_base: float  # theta_i = pos * freq_scale * freq_base ** (-2i / n_dims)
    freq_scale: float  # 1 / the scaling factor
    neox: bool  # pairs (i, i + n_dims/2) when True, (2i, 2i+1) when False
    # YaRN (ggml's rope_yarn): 1 mixes each pair's scaled angle with its unscaled one
    # by a ramp over the pairs between the correction dimensions of beta_fast and
    # beta_slow turns in orig_context positions, and scales cos and sin by
    # 1 + 0.1 ln(1 / freq_scale); 0: the scaled angle alone (linear scaling, none)
    ext_factor: float = 0.0
    attn_factor: float = 1.0  # cos and sin are multiplied by it (ggml's mscale)
    orig_context: int = 0  # rope.scaling.original_context_length (YaRN)
    beta_fast: float = 32.0  # llama.cpp's defaults (no key read for these architectures)
    beta_slow: float = 1.0


@frozen
class ModelConfig:
    architecture: str
    spec: ArchSpec  # what the architecture's blocks hold and do
    n_layers: int
    hidden_dim: int
    ffn_dims: tuple[int, ...]  # feed-forward size of each block
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    context_length: int
    rms_eps: float
    rope: RopeConfig  # global blocks
    rope_swa: RopeConfig  # sliding-window blocks (``rope`` when there are none)
    layer_windows: tuple[int, ...]  # each block's window in positions; 0: global
    layer_rotary: tuple[bool, ...]  # each block rotates Q and K (False: smollm3's NoPE)
    query_scale: float  # queries (or scores) are multiplied by this
    embedding_scale: float  # token embeddings are multiplied by this (float32)
    final_logit_softcap: float  # logits = c * tanh(logits / c); 0: none
    attn_logit_softcap: float  # attention scores = c * tanh(scores / c); 0: none
    # queries times 1 + attn_temp_scale * ln(floor(pos / attn_temp_length) + 1) after
    # rotary (mistral3's attention.temperature_scale); 0: none
    attn_temp_scale: float = 0.0
    attn_temp_length: int = 0
    # llama.cpp's n_ctx_orig_yarn: rope.scaling.original_context_length, else the
    # context length (LongRoPE's long factors where the context length passes it)
    original_context: int = 0
    # granite: each block's attention and feed-forward outputs times this before their
    # residual sums (0: none); the logits times this (1 / logit_scale; 1: none)
    residual_scale: float = 0.0
    logit_factor: float = 1.0
    # a mixture of experts in every block (``n_experts`` > 0): ``n_experts_used`` of them
    # per row; ``ffn_dims`` are then each expert's feed-forward size
    n_experts: int = 0
    n_experts_used: int = 0
    shared_ffn: int = 0  # the shared expert's feed-forward size (qwen2moe's); 0: none

    @property
    def sliding(self) -> bool:
        """Some block attends within a sliding window."""
        return any(self.layer_windows)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim_k

    @property
    def k_dim(self) -> int:
        return self.n_kv_heads * self.head_dim_k

    @property
    def v_dim(self) -> int:
        return self.n_kv_heads * self.head_dim_v

    @classmethod
    def from_header(cls, header: GgufHeader, architectures: tuple[str, ...]) -> ModelConfig:
        """The config of the model in ``header``. Raises ``UnsupportedModel`` for an
        architecture outside ``architectures`` (or one we have no layout for), a
        mixture of experts, or a rope scaling we do not run; ``GgufError`` for a
        missing or malformed key."""
        path = header.paths[0]
        arch = header.string("general.architecture")
        if arch in MOE_ARCHITECTURES:
            raise UnsupportedModel(
                path,
                f"{arch!r} is a mixture-of-experts architecture: not supported",
                key="general.architecture",
            )
        if arch not in architectures or arch not in ARCHITECTURES:
            runs = ", ".join(a for a in architectures if a in ARCHITECTURES)
            raise UnsupportedModel(
                path,
                f"architecture {arch!r} is not one this worker runs ({runs})",
                key="general.architecture",
            )
        spec = ARCHITECTURES[arch]
        n_layers = block_count(header, arch)
        experts = _experts(header, arch, spec, n_layers)
        hidden = header.dimension(f"{arch}.embedding_length")
        heads = model_integer(header, f"{arch}.attention.head_count", n_layers)
        heads_kv = model_integer(header, f"{arch}.attention.head_count_kv", n_layers, heads)
        head_counts(header, arch, heads, heads_kv)
        head_dim_k = header.dimension(f"{arch}.attention.key_length", default=hidden // heads)
        head_dim_v = header.dimension(f"{arch}.attention.value_length", default=hidden // heads)
        values_as_wide_as_keys(header, arch, head_dim_k, head_dim_v)
        if spec.hidden_wide_attention:
            heads_as_wide_as_hidden(header, arch, hidden, heads, head_dim_k)
        rope = _rope(header, arch, head_dim_k, spec)
        attention = layer_attention(header, arch, n_layers)
        if any(a.sliding for a in attention):
            _same_for_sliding_blocks(header, arch, head_dim_k, head_dim_v, rope.n_dims)
        swa_bases = {a.rope_freq_base for a in attention if a.sliding}
        rope_swa = rope
        if swa_bases:  # llama.cpp's sliding blocks: their base; gemma3's without the
            # scaling's factor (YaRN's terms kept), gemma2's with it (llama.cpp's default)
            rope_swa = attrs.evolve(rope, freq_base=swa_bases.pop())
            if SLIDING_WINDOWS[arch].swa_unscaled:
                rope_swa = attrs.evolve(rope_swa, freq_scale=1.0)
        config = cls(
            architecture=arch,
            spec=spec,
            n_layers=n_layers,
            hidden_dim=hidden,
            ffn_dims=_ffn_dims(header, arch, n_layers, experts),
            n_heads=heads,
            n_kv_heads=heads_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            context_length=header.integer(f"{arch}.context_length"),  # 0: none stated
            rms_eps=_rms_eps(header, f"{arch}.attention.layer_norm_rms_epsilon"),
            rope=rope,
            rope_swa=rope_swa,
            layer_windows=tuple(a.window for a in attention),
            layer_rotary=tuple(
                not spec.no_rope_period or (i + 1) % spec.no_rope_period != 0
                for i in range(n_layers)
            ),
            query_scale=_query_scale(spec, n_layers, hidden, heads, head_dim_k),
            embedding_scale=(
                float(np.sqrt(np.float32(hidden)))
                if spec.embedding_scale is EmbeddingScale.SQRT_HIDDEN
                else 1.0
            ),
            final_logit_softcap=_softcap(
                header, f"{arch}.final_logit_softcapping", spec.final_logit_softcap
            ),
            attn_logit_softcap=_softcap(
                header, f"{arch}.attn_logit_softcapping", spec.attn_logit_softcap
            ),
            **_attn_temperature(header, arch, spec),
            original_context=header.integer(
                f"{arch}.rope.scaling.original_context_length", default=0
            )
            or header.integer(f"{arch}.context_length"),
            n_experts=experts[0],
            n_experts_used=experts[1],
            shared_ffn=_shared_ffn(header, arch, spec, n_layers),
        )
        # granite's multipliers (in place of the embedding and query scales, and every
        # block's rotary where the file turns it off)
        granite = _granite_scales(header, arch, spec, n_layers)
        return attrs.evolve(config, **granite) if granite else config


def _query_scale(spec: ArchSpec, n_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """``1 / sqrt(n)`` in float32, as llama.cpp computes it (``1.0f / sqrtf(n)``: for
    some sizes, 96 among them, one unit in the last place from the float64 value)."""
    n = head_dim
    big = {QueryScale.GEMMA3: 62, QueryScale.GEMMA2: 46}.get(spec.query_scale)
    if n_layers == big:  # Gemma 3 27B, Gemma 2 27B
        n = hidden // heads
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


def _softcap(header: GgufHeader, key: str, default: float | None) -> float:
    """A soft cap the architecture reads (``default`` None: it reads none, 0.0); a
    negative one, or one past float32's range (the kernels take a float32), is a
    ``GgufError`` (0: none)."""
    if default is None:
        return 0.0
    cap = _float(header, key, default)
    if cap < 0.0 or cap > float(np.finfo(np.float32).max):
        raise GgufError(
            header.paths[0], f"a soft cap of {cap}: it must be a float32 not negative", key
        )
    return cap


def _same_for_sliding_blocks(
    header: GgufHeader, arch: str, head_dim_k: int, head_dim_v: int, n_rot: int
) -> None:
    """Sliding blocks of another head size or rotary width are not supported."""
    for suffix, value in (
        ("attention.key_length_swa", head_dim_k),
        ("attention.value_length_swa", head_dim_v),
        ("rope.dimension_count_swa", n_rot),
    ):
        key = f"{arch}.{suffix}"
        found = header.integer(key, default=value)
        if found != value:
            raise UnsupportedModel(
                header.paths[0],
                f"sliding-window blocks of {found} where the others have {value}: not supported",
                key=key,
            )


def _float(header: GgufHeader, key: str, default: float | None) -> float:
    return number(header, key, default)


def _rms_eps(header: GgufHeader, key: str) -> float:
    """The RMS norm's epsilon: not negative (ggml's ``rms_norm`` asserts it; a negative
    one makes the norm of a small row NaN)."""
    eps = _float(header, key, None)
    if eps < 0.0:
        raise GgufError(header.paths[0], f"an epsilon of {eps}: it must not be negative", key)
    return eps


def _ffn_dims(
    header: GgufHeader, arch: str, n_layers: int, experts: tuple[int, int]
) -> tuple[int, ...]:
    """Each block's feed-forward size; with experts, each expert's: qwen3moe's
    ``expert_feed_forward_length`` where set, else ``feed_forward_length / k`` (llama.cpp's
    ``n_ff_exp``); llama's (Mixtral) and granitemoe's ``feed_forward_length``."""
    own = experts[0] and ARCHITECTURES[arch].expert_ffn_length
    key = f"{arch}.expert_feed_forward_length"
    if own and header.has(key):
        return per_block_dimensions(header, key, n_layers)
    dims = per_block_dimensions(header, f"{arch}.feed_forward_length", n_layers)
    if own:
        return tuple(d // experts[1] for d in dims)
    return dims


def _shared_ffn(header: GgufHeader, arch: str, spec: ArchSpec, n_layers: int) -> int:
    """The shared expert's feed-forward size: ``expert_shared_feed_forward_length``, else
    ``feed_forward_length`` (llama.cpp's ``n_ff_shexp``, qwen2moe's); 0 without one.
    One shared expert (``expert_shared_count`` at most 1)."""
    if not spec.shared_expert:
        return 0
    count_key = f"{arch}.expert_shared_count"
    if header.integer(count_key, default=1) != 1:
        raise UnsupportedModel(
            header.paths[0], "shared experts other than one: not supported", key=count_key
        )
    size = header.integer(f"{arch}.expert_shared_feed_forward_length", default=0)
    return size or model_integer(header, f"{arch}.feed_forward_length", n_layers)


def _experts(header: GgufHeader, arch: str, spec: ArchSpec, n_layers: int) -> tuple[int, int]:
    """``(expert_count, expert_used_count)`` of a mixture of experts, ``(0, 0)`` without.
    Refused (``UnsupportedModel``): experts where the architecture has none, and what
    llama.cpp's other mixtures add (expert groups, shared experts, a gating other than
    the softmax); a count out of range is a ``GgufError``."""
    path = header.paths[0]
    count_key = f"{arch}.expert_count"
    count = expert_count(header, arch)
    if count == 0:
        if spec.experts is Presence.REQUIRED:
            raise GgufError(path, f"{arch} has experts: expert_count must be above 0", count_key)
        return (0, 0)
    if spec.experts is Presence.ABSENT:
        raise UnsupportedModel(
            path, f"a mixture of experts in {arch!r}: not supported", key=count_key
        )
    used_key = f"{arch}.expert_used_count"
    used = model_integer(header, used_key, n_layers, 0)
    if not 1 <= used <= count:
        raise GgufError(path, f"{used} experts used of {count}: not 1 .. {count}", used_key)
    shared = (
        ()
        if spec.shared_expert  # qwen2moe: its one shared expert
        else (("expert_shared_count", 0), ("expert_shared_feed_forward_length", 0))
    )
    for name, none in (("expert_group_count", 1), *shared):
        if header.integer(f"{arch}.{name}", default=none) > none:
            raise UnsupportedModel(
                path, f"{name} above {none}: not supported", key=f"{arch}.{name}"
            )
    gating_key = f"{arch}.expert_gating_func"
    if header.integer(gating_key, default=1) != 1:  # llama.cpp's 1: softmax
        raise UnsupportedModel(path, "an expert gating other than the softmax", key=gating_key)
    return (count, used)


def _granite_scales(header: GgufHeader, arch: str, spec: ArchSpec, n_layers: int) -> dict[str, Any]:
    """granite's multipliers, as llama.cpp reads them (``models/granite.cpp``): the
    logit scale required, the others where set and not 0 (each a float32); and no block
    rotating where ``rope.scaling.finetuned`` is false (its default is true)."""
    if not spec.granite_scales:
        return {}
    path = header.paths[0]
    out: dict[str, Any] = {}
    logit_key = f"{arch}.logit_scale"
    logit_scale = np.float32(_float(header, logit_key, None))
    if logit_scale == 0.0:
        raise UnsupportedModel(path, "a logit scale of 0", key=logit_key)
    out["logit_factor"] = float(np.float32(1.0) / logit_scale)  # ggml: 1.0f / scale
    residual = np.float32(_float(header, f"{arch}.residual_scale", 0.0))
    if residual != 0.0:
        out["residual_scale"] = float(residual)
    embedding = np.float32(_float(header, f"{arch}.embedding_scale", 0.0))
    if embedding != 0.0:
        out["embedding_scale"] = float(embedding)
    attention = np.float32(_float(header, f"{arch}.attention.scale", 0.0))
    if attention != 0.0:
        out["query_scale"] = float(attention)
    if not header.boolean(f"{arch}.rope.scaling.finetuned", True):
        out["layer_rotary"] = (False,) * n_layers
    return out


def _attn_temperature(header: GgufHeader, arch: str, spec: ArchSpec) -> dict[str, Any]:
    """llama.cpp's query temperature (``llm_graph_input_attn_temp``) where the
    architecture reads ``attention.temperature_scale`` and the file sets it: its
    length is YaRN's original context (``n_ctx_orig_yarn``: the key, else the context
    length), with no offset."""
    key = f"{arch}.attention.temperature_scale"
    scale = _float(header, key, 0.0) if spec.attn_temperature else 0.0
    if scale == 0.0:
        return {}
    length = header.integer(f"{arch}.rope.scaling.original_context_length", default=0)
    length = length or header.integer(f"{arch}.context_length")
    if length < 1:
        raise UnsupportedModel(header.paths[0], f"a temperature length of {length}", key=key)
    return {"attn_temp_scale": float(np.float32(scale)), "attn_temp_length": length}


def _rope(header: GgufHeader, arch: str, head_dim: int, spec: ArchSpec) -> RopeConfig:
    path = header.paths[0]
    neox = spec.rope_neox
    n_dims = header.integer(f"{arch}.rope.dimension_count", default=head_dim)
    rotary_within_heads(header, arch, spec, head_dim, n_dims)
    type_key = f"{arch}.rope.scaling.type"
    scaling = header.string(type_key) if header.has(type_key) else "linear"
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModel(path, f"rope scaling {scaling!r} is not supported", key=type_key)
    # as llama.cpp: the older rope.scale_linear only where rope.scaling.factor is absent
    # (a factor of 0 present means no scaling)
    factor_key = f"{arch}.rope.scaling.factor"
    if not header.has(factor_key):
        factor_key = f"{arch}.rope.scale_linear"
    factor = _float(header, factor_key, 0.0)
    # negative, or so small that positions times 1 / factor pass float32's largest
    if factor < 0.0 or (factor > 0.0 and 1.0 / factor > float(np.finfo(np.float32).max)):
        raise UnsupportedModel(path, f"rope scaling factor {factor}", key=factor_key)
    one = np.float32(1.0)
    freq_scale = one if scaling == "none" or factor == 0.0 else one / np.float32(factor)
    attn_key = f"{arch}.rope.scaling.attn_factor"
    attn_factor = np.float32(_float(header, attn_key, 1.0))
    if not attn_factor > 0.0:
        raise UnsupportedModel(path, f"rope attention factor {attn_factor}", key=attn_key)
    context_key = f"{arch}.rope.scaling.original_context_length"
    orig_context = header.integer(context_key, default=0)
    betas = {}
    log_mul = 0.0
    if spec.yarn_keys:
        for name in ("beta_fast", "beta_slow"):
            key = f"{arch}.rope.scaling.yarn_{name}"
            if header.has(key):
                betas[name] = float(np.float32(_float(header, key, None)))
                if not betas[name] > 0.0:  # turns: ln(context / (turns 2 pi))
                    raise UnsupportedModel(path, f"YaRN turns of {betas[name]}", key=key)
        log_mul = _float(header, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
    if scaling == "yarn":
        orig_context = orig_context or header.integer(f"{arch}.context_length")
        if orig_context < 1:
            raise UnsupportedModel(path, f"original context {orig_context}", key=context_key)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            attn_factor = yarn_attn_factor(freq_scale, np.float32(log_mul)) * attn_factor
        if not (np.isfinite(attn_factor) and attn_factor > 0.0):  # get_mscale(, mul) <= 0
            raise UnsupportedModel(
                path,
                f"a YaRN attention factor of {attn_factor} (log multiplier {log_mul})",
                key=f"{arch}.rope.scaling.yarn_log_multiplier",
            )
    return RopeConfig(
        n_dims=n_dims,
        freq_base=_float(header, f"{arch}.rope.freq_base", 10000.0),
        freq_scale=float(freq_scale),
        neox=neox,
        ext_factor=1.0 if scaling == "yarn" else 0.0,
        attn_factor=float(attn_factor),
        orig_context=orig_context if scaling == "yarn" else 0,
        **betas,
    )


def yarn_attn_factor(freq_scale: np.float32, log_mul: np.float32) -> np.float32:
    """llama.cpp's ``cparams.yarn_attn_factor`` under YaRN (``llama-context.cpp``), in
    its float32 operations, with ``factor = 1 / freq_scale``: ``get_mscale(factor, 1)``,
    divided by ``get_mscale(factor, log_mul)`` where the file sets a log multiplier,
    then by ``1 + 0.1 ln factor`` (ggml's rope multiplies that back in)."""
    one, tenth = np.float32(1.0), np.float32(0.1)
    factor = one / freq_scale
    log = log_f32(factor)

    def get_mscale(mscale: np.float32) -> np.float32:
        return one if factor <= one else np.float32(tenth * mscale * log + one)

    attn = get_mscale(one)
    if log_mul != 0.0:
        attn = np.float32(attn / get_mscale(log_mul))
    return np.float32(attn * (one / (one + tenth * log)))
