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
too: an array of INT32 or of UINT32 items. Keys outside this table (this project's
shard keys, ``sliding_window_pattern``) are read as any integer type; so are
keys we read for an architecture whose llama.cpp loader does not read them, where a file
of another type loads there (``expert_gating_func`` and ``expert_shared_count`` of
qwen3moe and qwen2moe, ``expert_shared_feed_forward_length`` of the mixtures without a
shared expert): the table holds only keys llama.cpp reads wherever we read them.

Some keys llama.cpp reads of every file, whatever reads them here or whether anything
does (``EVERY_FILE_KEYS``, ``EVERY_FILE_SUFFIXES``: ``general.file_type``, the
tokenizer's flags and special token ids, ``rope.scaling.finetuned``, ...): the facts
check each the file holds (``GgufHeader.check_every_file_types``), so a file llama.cpp
refuses for one is refused here, naming it, by the planner and every runtime. A split
set's ``split.no`` and ``split.count`` are UINT16s in each of its shards
(``SPLIT_KEYS``).
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
#: A split set's keys, which llama.cpp reads of each of its shards as UINT16 (``split.no``
#: only in a set: a file alone may store it of any type).
SPLIT_KEYS: dict[str, GGUFValueType] = {
    "split.no": GGUFValueType.UINT16,
    "split.count": GGUFValueType.UINT16,
}
#: Keys llama.cpp reads of every file whatever its architecture, as exactly one type,
#: refusing a file that stores one as another, whether or not anything here reads the
#: key (``every_file_type``): the loader's file type and split keys
#: (``llama-model-loader.cpp``), the generic hyperparameters of ``load_hparams``, the
#: vocabulary's flags and special token ids (``llama-vocab.cpp``). Checked against
#: llama-cpp-python 0.3.36 (``scripts/check_refusals_llamacpp.py``).
EVERY_FILE_KEYS: dict[str, GGUFValueType] = {
    "general.file_type": GGUFValueType.UINT32,
    "split.count": GGUFValueType.UINT16,
    **{
        f"tokenizer.ggml.{flag}": GGUFValueType.BOOL
        for flag in (
            "add_bos_token",
            "add_eos_token",
            "add_sep_token",
            "add_space_prefix",
            "remove_extra_whitespaces",
        )
    },
    **{
        f"tokenizer.ggml.{name}_token_id": GGUFValueType.UINT32
        for name in [
            "bos",
            "eos",
            "eot",
            "eom",
            "unknown",
            "seperator",
            "padding",
            "mask",
            "fim_pre",
            "fim_suf",
            "fim_mid",
            "fim_pad",
            "fim_rep",
            "fim_sep",
            "prefix",
            "suffix",
            "middle",
        ]
    },
}
#: Keys ``{arch}.<suffix>`` llama.cpp reads of every file, as ``EVERY_FILE_KEYS``.
EVERY_FILE_SUFFIXES: dict[str, GGUFValueType] = {
    "rope.scaling.finetuned": GGUFValueType.BOOL,
    "attention.causal": GGUFValueType.BOOL,
    "pooling_type": GGUFValueType.UINT32,
    "expert_count": GGUFValueType.UINT32,
    "expert_used_count": GGUFValueType.UINT32,
    "expert_group_count": GGUFValueType.UINT32,
    "expert_group_used_count": GGUFValueType.UINT32,
}
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


def every_file_type(key: str, arch: str) -> GGUFValueType | None:
    """The one GGUF type llama.cpp reads ``key`` as in every file of architecture
    ``arch`` (``EVERY_FILE_KEYS``, ``EVERY_FILE_SUFFIXES``), ``None`` for another key."""
    expected = EVERY_FILE_KEYS.get(key)
    if expected is None and key.startswith(f"{arch}."):
        expected = EVERY_FILE_SUFFIXES.get(key[len(arch) + 1 :])
    return expected
