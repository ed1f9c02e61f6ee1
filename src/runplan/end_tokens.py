"""The tokens that end generation, as llama.cpp finds them in a GGUF header: the
end-of-sequence id, the end-of-turn and end-of-message ids the file names, the tokens
llama.cpp knows by their text (``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``, ...),
and the fill-in-the-middle pad, repo and separator tokens. A chat model's answer ends
at the first of them, whichever ``tokenizer.ggml.eos_token_id`` names (Phi-3's is
``<|endoftext|>``, its turns end with ``<|end|>``).

The tokenizer (``runtime_core.tokenizer_vocab``) marks the same texts as control
tokens; both read the texts from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from runplan.gguf_header import GgufHeader

#: Tokens llama.cpp marks as control by their text, whatever their type in the file, and
#: takes as ends of generation.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
#: Fill-in-the-middle markers by their key, and the texts llama.cpp finds them by when
#: the file does not name them (also marked control).
FIM_TEXTS = {
    "tokenizer.ggml.fim_pre_token_id": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
        "▁<PRE>", "<|code_prefix|>", "<|prefix|>",
    ),
    "tokenizer.ggml.fim_suf_token_id": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
        "▁<SUF>", "<|code_suffix|>", "<|suffix|>",
    ),
    "tokenizer.ggml.fim_mid_token_id": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
        "▁<MID>", "<|code_middle|>", "<|middle|>",
    ),
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}  # fmt: skip
#: Old names of three of the keys above.
FIM_OLD_KEYS = {
    "tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id",
}
#: llama.cpp's exceptions: an end-of-generation text it takes out of the set (and
#: renders as text again) when these others are in it (gpt-oss's ``<|end|>`` ends a
#: message, not the answer; ``</s>`` beside ``<|tool_response>``).
EOG_EXCEPTIONS = (
    ("<|end|>", (frozenset({"<|return|>", "<|call|>"}), frozenset({"<|calls|>", "<|flush|>"}))),
    ("</s>", (frozenset({"<|tool_response>"}),)),
)


def key_id(header: GgufHeader, key: str, old: str | None, n: int) -> int | None:
    """The id under ``key`` (or its ``old`` name), ``None`` outside ``0..n-1``."""
    value = header.integer(key if header.has(key) else str(old))
    return value if 0 <= value < n else None


def fim_key_id(header: GgufHeader, key: str, n: int) -> int | None:
    """The id the file names under a fill-in-the-middle ``key`` (or its old name),
    ``None`` where it names none in ``0..n-1``: then llama.cpp finds the token by its
    text (``FIM_TEXTS``), as for a key the file lacks."""
    old = FIM_OLD_KEYS.get(key)
    if header.has(key) or (old is not None and header.has(old)):
        return key_id(header, key, old, n)
    return None


def end_of_generation_ids(
    header: GgufHeader, tokens: Sequence[str], ids: Mapping[str, int], eos_id: int | None
) -> frozenset[int]:
    """The ids that end generation in a vocabulary of ``tokens`` (``ids``: text -> id),
    whose end-of-sequence id is ``eos_id``."""
    eog: set[int | None] = {ids.get(text) for text in EOG_TEXTS}
    for key, texts in FIM_TEXTS.items():
        if not key.endswith(("pad_token_id", "rep_token_id", "sep_token_id")):
            continue
        named = fim_key_id(header, key, len(tokens))
        if named is not None:
            eog.add(named)
        else:  # no key, or one outside the vocabulary: by its text
            eog.update(ids.get(text) for text in texts)
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if header.has(key):
            eog.add(key_id(header, key, None, len(tokens)))
    eog.add(eos_id)
    eog.discard(None)
    texts_in = {tokens[i] for i in eog if i is not None}
    for text, beside in EOG_EXCEPTIONS:
        if text in texts_in and any(others <= texts_in for others in beside):
            eog.discard(ids[text])
    return frozenset(i for i in eog if i is not None)


def header_end_of_generation_ids(
    header: GgufHeader, eos_id: int | None, n_vocab: int
) -> tuple[int, ...]:
    """``end_of_generation_ids`` of the header's own tokens (sorted, each below
    ``n_vocab``); the end-of-sequence id alone when the file holds no token list."""
    if not header.has("tokenizer.ggml.tokens"):
        return () if eos_id is None else (eos_id,)
    tokens = header.strings("tokenizer.ggml.tokens", keep_bytes=True)  # as the tokenizer
    ids: dict[str, int] = {}
    for i, text in enumerate(tokens):
        ids.setdefault(text, i)  # the first of equal texts (the tokenizer refuses those)
    found = end_of_generation_ids(header, tokens, ids, eos_id)
    return tuple(sorted(i for i in found if i < n_vocab))
