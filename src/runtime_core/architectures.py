"""What differs between the architectures we run, as data: one ``ArchSpec`` each.

Read from llama.cpp's loaders and graph builders (``src/models/{llama,qwen2,qwen3,
exaone,gemma,gemma2,gemma3,granite,granite-moe,mistral3,phi3,qwen2moe,qwen3moe,
smollm3}.cpp``,
``llama-model.cpp``, ``llama-graph.cpp``). Every architecture here is the same pre-norm
transformer block; the spec says where one departs from it:

    x = embed(token) * embedding_scale
    per block:
        h = rms_norm(x, attn_norm)
        q, k, v = h @ Wq, h @ Wk, h @ Wv   (+ biases)   or h @ Wqkv split [q; k; v]
        q, k = rms_norm per head (attn_q_norm, attn_k_norm)        if qk_norm
        q, k = rope(q), rope(k)            (normal or NeoX pairs; the block's own base;
                                            none in smollm3's every fourth block)
        a = attention(q * query_scale, k, v)   (causal; within the window if sliding)
                                            (gemma*, phi3 scale q; the others the scores;
                                             scores = cap * tanh(scores / cap) before the
                                             softmax if the attention softcap is set)
        a = a @ Wo                          (+ bias)
        a = rms_norm(a, post_attention_norm)                       if post_norms
        x = x + a
        h = rms_norm(x, ffn_norm)
        g, u = h @ Wgate, h @ Wup (+ biases) or h @ Wup split [gate; up]
        f = (act(g) * u) @ Wdown (+ bias)   act: SiLU or GELU (tanh)
            or, with experts (llama's optional, qwen3moe's): p = softmax(h @ Wrouter),
            the top k experts e_j of p, w_j = p[e_j] / sum p[e_j] (qwen2moe: p[e_j]),
            f = sum_j w_j * (silu(h @ Wgate[e_j]) * (h @ Wup[e_j])) @ Wdown[e_j]
            [qwen2moe: + sigmoid(h . w_shexp) * the shared expert's ffn(h)]
        f = rms_norm(f, post_ffw_norm)                             if post_norms
        x = x + f
    logits = rms_norm(x, output_norm) @ Whead  (output, or token_embd when tied)
    logits = softcap * tanh(logits / softcap)                      if softcap is set

Consumers: ``model_config`` (hyperparameters), ``gguf_slice`` (which tensors a block
has, and their shapes) and every worker's forward pass. Nothing here depends on how
a worker computes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import frozen

from runplan.config import REFERENCE_ARCHITECTURES


class Presence(enum.Enum):
    REQUIRED = "required"
    OPTIONAL = "optional"
    ABSENT = "absent"  # a file that has it is refused


class QkvLayout(enum.Enum):
    SEPARATE = "separate"  # attn_q, attn_k, attn_v (each with an optional bias)
    FUSED = "fused"  # attn_qkv: rows [q; k; v], split by the config's q / k / v sizes


class FfnLayout(enum.Enum):
    SEPARATE = "separate"  # ffn_gate and ffn_up
    FUSED = "fused"  # ffn_up alone, (hidden, 2 * ffn): rows [gate; up]


class Activation(enum.Enum):
    SILU = "silu"  # x * sigmoid(x)
    GELU_TANH = "gelu_tanh"  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


class EmbeddingScale(enum.Enum):
    NONE = "none"
    SQRT_HIDDEN = "sqrt_hidden"  # embeddings times sqrt(hidden), in float32


class QueryScale(enum.Enum):
    """What the attention scores are divided by, as a square root."""

    KEY_LENGTH = "key_length"  # 1 / sqrt(head_dim_k)
    # gemma3: 1 / sqrt(head_dim_k), except for the 62-block model (Gemma 3 27B), whose
    # queries are scaled by 1 / sqrt(hidden / heads) (llama.cpp keys it on the size).
    GEMMA3 = "gemma3"
    # gemma2: the same rule, for its 46-block model (Gemma 2 27B).
    GEMMA2 = "gemma2"


@frozen
class ArchSpec:
    name: str  # general.architecture
    rope_neox: bool  # rotary pairs (i, i + n/2) when True, (2i, 2i+1) when False
    qkv_layouts: tuple[QkvLayout, ...]  # the layouts a file may use
    qkv_bias: Presence  # attn_q/k/v.bias (attn_qkv.bias when fused)
    output_bias: Presence  # attn_output.bias
    ffn_bias: Presence  # ffn_gate.bias, ffn_up.bias, ffn_down.bias (each optional alone)
    qk_norm: bool  # attn_q_norm, attn_k_norm: (head_dim_k,) each, before rotary
    post_norms: bool  # post_attention_norm, post_ffw_norm: (hidden,) each
    ffn: FfnLayout
    activation: Activation
    embedding_scale: EmbeddingScale
    query_scale: QueryScale
    # Where llama.cpp's graph applies the query scale: to the rotated queries (then
    # attention scales by 1), or to the scores. The same product, rounded differently.
    queries_scaled: bool
    sliding_window: bool  # reads attention.sliding_window (runplan.layer_attention)
    # final_logit_softcapping: None, not read (no cap); else the cap where the key is
    # absent (0.0: none)
    final_logit_softcap: float | None
    # attn_logit_softcapping, the same way: scores capped before the softmax
    attn_logit_softcap: float | None
    rope_freqs: bool  # may carry llama3's rope_freqs.weight
    # may carry LongRoPE's rope_factors_long / rope_factors_short.weight (phi3)
    longrope: bool = False
    # rotates whole heads: rope.dimension_count other than the key head size is refused,
    # as llama.cpp's loader refuses it ("invalid n_rot") for llama (and deci, falcon,
    # llama-embed, which we do not run), and its graph for every other architecture here
    # but the gemmas and phi3 (``GGML_ASSERT(n_embd_head == n_rot)`` in
    # ``models/{qwen2,qwen3,smollm3,mistral3,granite,exaone,qwen2moe,qwen3moe}.cpp``: the
    # process aborts); False: partial rotary allowed (phi3's; the gemmas')
    whole_head_rotary: bool = False
    # the query and the attention output are embedding_length wide: llama.cpp's loader
    # sizes attn_q (attn_qkv's query rows) and attn_output by it, not by head_count *
    # key_length (qwen2, qwen2moe, phi3), so a file whose heads are another width is
    # refused there by its tensors' shapes, and here by its keys (``model_config``)
    hidden_wide_attention: bool = False
    # output.weight: OPTIONAL (the embedding where absent), REQUIRED (qwen2moe: llama.cpp
    # loads no fallback), ABSENT (the head is always the embedding; a file with one is
    # refused, as llama.cpp's tensor count refuses it)
    head: Presence = Presence.OPTIONAL
    # llama.cpp's n_no_rope_layer_step: block i (from 0) rotates no query or key where
    # (i + 1) % no_rope_period == 0 ("NoPE" blocks); 0: every block rotates
    no_rope_period: int = 0
    # reads rope.scaling.yarn_beta_fast / yarn_beta_slow / yarn_log_multiplier (else
    # llama.cpp's defaults, 32 and 1 turns, no multiplier)
    yarn_keys: bool = False
    # reads attention.temperature_scale: queries multiplied after rotary by
    # 1 + scale * ln(floor(pos / L) + 1), L the YaRN original context (Llama 4's)
    attn_temperature: bool = False
    # granite's multipliers from its keys: embedding_scale on the embeddings,
    # residual_scale on each block's attention and feed-forward outputs before their
    # residual sums, attention.scale on the scores (for 1 / sqrt(head)), logits divided
    # by logit_scale (required); and rope.scaling.finetuned false: no block rotates
    granite_scales: bool = False
    # a mixture of experts in place of the feed-forward matrices (``{arch}.expert_count``
    # experts, ``expert_used_count`` of them per row): REQUIRED (qwen3moe), OPTIONAL
    # (llama: Mixtral's files are ``llama`` with experts), ABSENT (a file with experts
    # is refused)
    experts: Presence = Presence.ABSENT
    # each expert's feed-forward size: ``expert_feed_forward_length`` (else
    # ``feed_forward_length / expert_used_count``: llama.cpp's n_ff_exp, qwen3moe's), or
    # ``feed_forward_length`` itself (llama's and granitemoe's experts)
    expert_ffn_length: bool = False
    # the chosen experts' weights divided by their sum (llama.cpp's norm_w); False: the
    # softmax's own (qwen2moe)
    expert_weights_norm: bool = True
    # a shared expert beside the routed ones, gated per row by sigmoid(h . w)
    # (qwen2moe: ffn_{gate,up,down}_shexp of expert_shared_feed_forward_length, else
    # feed_forward_length; ffn_gate_inp_shexp the gate's w)
    shared_expert: bool = False


_BASE = ArchSpec(
    name="llama",
    rope_neox=False,
    qkv_layouts=(QkvLayout.SEPARATE,),
    qkv_bias=Presence.OPTIONAL,
    output_bias=Presence.OPTIONAL,
    ffn_bias=Presence.OPTIONAL,
    qk_norm=False,
    post_norms=False,
    ffn=FfnLayout.SEPARATE,
    activation=Activation.SILU,
    embedding_scale=EmbeddingScale.NONE,
    query_scale=QueryScale.KEY_LENGTH,
    queries_scaled=False,
    sliding_window=False,
    final_logit_softcap=None,
    attn_logit_softcap=None,
    rope_freqs=True,
    # llama.cpp's llama loader takes rope_factors_long / _short where the file's rope
    # scaling is LongRoPE (as granite's; those of llama's shape below take none)
    longrope=True,
    whole_head_rotary=True,
    experts=Presence.OPTIONAL,
)


def _like_llama(**changes: Any) -> ArchSpec:
    return attrs.evolve(
        _BASE,
        **{"experts": Presence.ABSENT, "longrope": False, **changes},
    )


_GEMMA3 = _like_llama(
    name="gemma3",
    rope_neox=True,
    output_bias=Presence.ABSENT,
    ffn_bias=Presence.ABSENT,
    qk_norm=True,
    post_norms=True,
    activation=Activation.GELU_TANH,
    embedding_scale=EmbeddingScale.SQRT_HIDDEN,
    query_scale=QueryScale.GEMMA3,
    queries_scaled=True,
    sliding_window=True,
    final_logit_softcap=0.0,
    rope_freqs=False,
    whole_head_rotary=False,
)

#: The architectures the NumPy reference worker runs. Mistral and Llama 3.x files are
#: ``llama``, and so are Mixtral's (``llama`` with experts). The other mixture-of-experts
#: architectures (``MOE_ARCHITECTURES``) are refused by name. Q/K/V biases are optional
#: wherever llama.cpp's loader takes them (``create_tensor_qkv``), each alone: qwen2's
#: too (Qwen2's own files have all three; a file without some runs in llama.cpp, each
#: absent bias zero); an output bias only llama (and
#: mistral3 and granite, loaded as llama) may have: llama.cpp loads none for the others
#: (qwen2's neither: "wrong number of tensors"), so a file with one is not theirs.
#: Feed-forward biases (gate, up, down, each optional) llama's (and mistral3's and
#: granite's), as llama.cpp's loader takes them (``TENSOR_NOT_REQUIRED``).
ARCHITECTURES: Mapping[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        _BASE,
        _like_llama(
            name="qwen2",
            rope_neox=True,
            hidden_wide_attention=True,
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            rope_freqs=False,
        ),
        _like_llama(
            name="qwen3",
            rope_neox=True,
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            qk_norm=True,
            rope_freqs=False,
        ),
        _GEMMA3,
        # Gemma 2: gemma3 without per-head Q/K norms, with both soft caps (llama.cpp's
        # defaults where a file has no key: 50 on the scores, 30 on the logits), every
        # other block sliding (period 2, a 4096-position window by default, the global
        # rotary base: runplan.layer_attention), and its head always the embedding
        # (llama.cpp loads no output.weight: a file with one is refused).
        attrs.evolve(
            _GEMMA3,
            name="gemma2",
            qk_norm=False,
            query_scale=QueryScale.GEMMA2,
            final_logit_softcap=30.0,
            attn_logit_softcap=50.0,
            head=Presence.ABSENT,
        ),
        # Gemma (the first): gemma3's block without per-head Q/K norms, post-norms or
        # sliding blocks, with no soft cap; the queries scaled by the key length (Gemma
        # 7B's heads are 256 wide where hidden / heads is 192); its head always the
        # embedding, as gemma2's (``models/gemma.cpp``).
        attrs.evolve(
            _GEMMA3,
            name="gemma",
            qk_norm=False,
            post_norms=False,
            query_scale=QueryScale.KEY_LENGTH,
            sliding_window=False,
            final_logit_softcap=None,
            head=Presence.ABSENT,
        ),
        # SmolLM3: llama's block, its every fourth block without rotary embedding (llama.cpp
        # fixes the period at 4 for smollm3: no key sets it), no output or feed-forward
        # biases and no rope_freqs (``models/smollm3.cpp`` loads none), normal pairs.
        _like_llama(
            name="smollm3",
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            rope_freqs=False,
            no_rope_period=4,
        ),
        # Mistral 3 (Ministral 3): llama's block, its YaRN keys read (beta turns and the
        # log multiplier of the attention factor), and its queries' temperature past the
        # original context (``models/mistral3.cpp``, ``llama-graph.cpp``).
        _like_llama(name="mistral3", yarn_keys=True, attn_temperature=True),
        # Granite (IBM Granite 3.x dense): llama's block with its four multipliers
        # (``models/granite.cpp``, ``llama-graph.cpp``'s ``build_inp_embd``).
        _like_llama(name="granite", longrope=True, granite_scales=True),
        # EXAONE 3.x (LG): llama's block with NeoX pairs, no output or feed-forward
        # biases (``models/exaone.cpp`` loads none), llama3's rope_freqs allowed.
        _like_llama(
            name="exaone", rope_neox=True, output_bias=Presence.ABSENT, ffn_bias=Presence.ABSENT
        ),
        # Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention, every block's
        # feed-forward a mixture of experts (``models/qwen3moe.cpp``): the router's
        # softmax, the top ``expert_used_count`` experts' weights renormalized.
        _like_llama(
            name="qwen3moe",
            rope_neox=True,
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            qk_norm=True,
            rope_freqs=False,
            experts=Presence.REQUIRED,
            expert_ffn_length=True,
        ),
        # Qwen1.5-MoE, Qwen2-MoE (Qwen2-57B-A14B): qwen2's attention (Q/K/V biases
        # optional, as llama.cpp's loader takes them), a mixture whose chosen weights are
        # the softmax's own, and a shared expert gated per row (``models/qwen2moe.cpp``).
        _like_llama(
            name="qwen2moe",
            rope_neox=True,
            hidden_wide_attention=True,
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            rope_freqs=False,
            experts=Presence.REQUIRED,
            expert_ffn_length=True,
            expert_weights_norm=False,
            shared_expert=True,
            head=Presence.REQUIRED,  # models/qwen2moe.cpp: output.weight, no fallback
        ),
        # Granite 3.x MoE (1B-A400M, 3B-A800M): granite's multipliers, every block's
        # feed-forward a mixture of experts of feed_forward_length, the mixture's output
        # scaled by residual_scale as the dense block's (``models/granite.cpp``; its
        # shared-expert variant, granitemoeshared's expert_shared_feed_forward_length, is
        # refused).
        _like_llama(
            name="granitemoe", longrope=True, granite_scales=True, experts=Presence.REQUIRED
        ),
        _like_llama(
            name="phi3",
            rope_neox=True,
            hidden_wide_attention=True,
            qkv_layouts=(QkvLayout.FUSED, QkvLayout.SEPARATE),
            output_bias=Presence.ABSENT,
            ffn_bias=Presence.ABSENT,
            ffn=FfnLayout.FUSED,
            queries_scaled=True,
            rope_freqs=False,
            longrope=True,
            whole_head_rotary=False,
        ),
    )
}
assert tuple(ARCHITECTURES) == REFERENCE_ARCHITECTURES, "runplan's defaults name these"

#: Mixture-of-experts architectures, refused by name with that reason.
MOE_ARCHITECTURES: tuple[str, ...] = (
    "phimoe",
    "mixtral",
    "llama4",
    "deepseek2",
    "gpt-oss",
)

# llama.cpp caps the attention scores before its softmax's scale (``build_attn_mha``):
# the workers cap q.k * scale, the same only where the queries carry the scale.
assert all(s.queries_scaled for s in ARCHITECTURES.values() if s.attn_logit_softcap is not None)
