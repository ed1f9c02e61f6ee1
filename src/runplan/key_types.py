"""The GGUF value type llama.cpp reads each model key as, as data.

llama.cpp's loader (``GGUFMeta::GKV<T>::get_kv`` in ``llama-model-loader.cpp``) reads a
hyperparameter as exactly one GGUF type and refuses a file that stores it as another
("key llama.context_length has wrong type i32 but expected type u32"): its sizes,
counts and token ids are ``uint32_t`` (UINT32 only: not INT32, not UINT64), its
floating-point hyperparameters ``float`` (FLOAT32 only: not FLOAT64, not an integer).
``GgufHeader.integer`` and ``GgufHeader.number`` refuse such a value the same way, so a
file llama.cpp refuses (a token id of INT32 -1, a context length stored as UINT64) is
refused here too, naming the key, instead of being read as another number.

A per-block key (``block_values``) stored as an array is the exception llama.cpp makes
too: an array of INT32 or of UINT32 items. Keys outside this table (``split.*``, this
project's shard keys, ``sliding_window_pattern``) are read as any integer type; so are
keys we read for an architecture whose llama.cpp loader does not read them, where a file
of another type loads there (``expert_gating_func`` and ``expert_shared_count`` of
qwen3moe and qwen2moe, ``expert_shared_feed_forward_length`` of the mixtures without a
shared expert): the table holds only keys llama.cpp reads wherever we read them.
"""

from __future__ import annotations

from gguf import GGUFValueType

#: Keys ``{arch}.<suffix>`` llama.cpp reads as ``uint32_t``.
UINT32_SUFFIXES = frozenset(
    {
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "vocab_size",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "attention.key_length_swa",
        "attention.value_length_swa",
        "attention.sliding_window",
        "rope.dimension_count",
        "rope.dimension_count_swa",
        "rope.scaling.original_context_length",
        "expert_count",
        "expert_used_count",
        "expert_group_count",
        "expert_feed_forward_length",
    }
)
#: Keys ``{arch}.<suffix>`` llama.cpp reads as ``float``.
FLOAT32_SUFFIXES = frozenset(
    {
        "attention.layer_norm_rms_epsilon",
        "attention.scale",
        "attention.temperature_scale",
        "rope.freq_base",
        "rope.freq_base_swa",
        "rope.scale_linear",
        "rope.scaling.factor",
        "rope.scaling.attn_factor",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_log_multiplier",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "logit_scale",
        "residual_scale",
        "embedding_scale",
    }
)
#: Prefixes that name no architecture: their keys are not the table's.
_NOT_ARCHITECTURES = frozenset({"general", "tokenizer", "split", "gguf_pipeline"})


def llamacpp_type(key: str) -> GGUFValueType | None:
    """The one GGUF type llama.cpp reads ``key`` as, ``None`` for a key outside the
    table: ``tokenizer.ggml.*_token_id`` and ``{arch}.<suffix>`` of ``UINT32_SUFFIXES``
    are UINT32, ``{arch}.<suffix>`` of ``FLOAT32_SUFFIXES`` FLOAT32."""
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
        return GGUFValueType.UINT32
    prefix, _, suffix = key.partition(".")
    if prefix in _NOT_ARCHITECTURES:
        return None
    if suffix in UINT32_SUFFIXES:
        return GGUFValueType.UINT32
    if suffix in FLOAT32_SUFFIXES:
        return GGUFValueType.FLOAT32
    return None
