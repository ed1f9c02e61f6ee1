"""The vocabulary of a GGUF file as llama.cpp reads it.

``Vocab.from_header`` applies llama.cpp's loading rules: default special-token ids
per tokenizer model, ids from the file when in range, ``add_bos`` / ``add_eos`` /
``add_space_prefix`` defaults overridden by the file's keys, token types turned into
attributes, and the tokens llama.cpp recognises by their text (end-of-turn,
fill-in-the-middle, ...) marked as control tokens, and the whitespace-stripping
special tokens of a few models named in the file (Phi-3, jina-v2, modern-bert).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from attrs import field, frozen

from runplan.end_tokens import (
    EOG_EXCEPTIONS,
    EOG_TEXTS,
    FIM_TEXTS,
    end_of_generation_ids,
    fim_key_id,
)
from runplan.gguf_error import GgufError
from runplan.gguf_facts import SPECIAL_TOKEN_DEFAULTS, special_token_id
from runplan.gguf_header import GgufHeader
from runplan.picklable_error import PicklableError
from runtime_core.tokenizer_pre import LLAMA_CPP_ONLY, PRE_TOKENIZERS, PreTokenizer


class TokenizerError(ValueError):
    """A GGUF file whose tokenizer cannot be built, or a call that cannot be served."""


class UnknownTokenizerModel(PicklableError, TokenizerError):
    """``tokenizer.ggml.model`` names a tokenizer this package does not implement."""

    def __init__(self, path: str, model: str) -> None:
        self.path = path
        self.model = model
        known = ", ".join(sorted(SUPPORTED_MODELS))
        super().__init__(
            f"{path}: unknown tokenizer model {model!r} (tokenizer.ggml.model); supported: {known}"
        )


class UnknownPreTokenizer(PicklableError, TokenizerError):
    """``tokenizer.ggml.pre`` names a pre-tokenizer this package does not implement."""

    def __init__(self, path: str, pre: str) -> None:
        self.path = path
        self.pre = pre
        why = (
            "llama.cpp knows it, but it is not implemented here"
            if pre in LLAMA_CPP_ONLY
            else "neither llama.cpp nor this package knows it"
        )
        super().__init__(
            f"{path}: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre): {why}; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )


class Attr:
    """llama.cpp's token attributes (``llama_token_attr``): bit flags, kept as plain
    ints because the vocabulary holds one per token."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7  # cut out of text with the whitespace before it
    RSTRIP = 1 << 8  # ... with the whitespace after it


# GGUF token type (tokenizer.ggml.token_type) -> attribute.
_TYPE_ATTR = {
    1: Attr.NORMAL,
    2: Attr.UNKNOWN,
    3: Attr.CONTROL,
    4: Attr.USER_DEFINED,
    5: Attr.UNUSED,
    6: Attr.BYTE,
}

SUPPORTED_MODELS = ("gpt2", "llama")
assert set(SPECIAL_TOKEN_DEFAULTS) == set(SUPPORTED_MODELS)

# Tokens llama.cpp always renders as text (gpt-oss's channel markers).
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


@frozen
class Vocab:
    """Everything the tokenizer needs from the file, as llama.cpp interprets it."""

    path: str
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: PreTokenizer | None  # None for SentencePiece
    pre_name: str
    tokens: tuple[str, ...]
    attrs: tuple[int, ...]  # Attr bits
    scores: tuple[float, ...]
    merges: tuple[tuple[str, str], ...]  # BPE merges, by rank (first one wins a pair)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    ignore_merges: bool
    chat_template: str | None = field(repr=False)
    ids: dict[str, int] = field(repr=False, eq=False)  # token text -> id
    #: why ``tokenizer.chat_template`` cannot be read (not UTF-8, not a string), said
    #: when it is rendered; ``chat_template`` is then ``None``
    chat_template_error: str | None = field(default=None, repr=False)

    @property
    def is_spm(self) -> bool:
        return self.model == "llama"

    @classmethod
    def from_header(cls, header: GgufHeader) -> Vocab:
        path = header.paths[0]
        model = header.string("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise UnknownTokenizerModel(path, model)
        tokens = _tokens(header, path)
        ids = {text: i for i, text in enumerate(tokens)}
        if len(ids) != len(tokens):
            _refuse_duplicates(path, tokens)
        n = len(tokens)
        scores = _numbers(header, "tokenizer.ggml.scores", n, 0.0)
        types = _numbers(header, "tokenizer.ggml.token_type", n, 1)
        attrs = [_TYPE_ATTR.get(t, Attr.UNDEFINED) for t in types]
        pre_name = header.string("tokenizer.ggml.pre", "") if model == "gpt2" else ""

        pre: PreTokenizer | None = None
        merges: tuple[tuple[str, str], ...] = ()
        if model == "gpt2":
            pre = PRE_TOKENIZERS.get(pre_name or "default")
            if pre is None:
                raise UnknownPreTokenizer(path, pre_name)
            merges = _merges(header)
            add_bos, add_eos, add_space_prefix = pre.add_bos, False, False
            clean_spaces, ignore_merges = pre.clean_spaces, pre.ignore_merges
        else:
            add_bos, add_eos, add_space_prefix = True, False, True
            clean_spaces, ignore_merges = False, False
        add_space_prefix = header.boolean("tokenizer.ggml.add_space_prefix", add_space_prefix)
        add_bos = header.boolean("tokenizer.ggml.add_bos_token", add_bos)
        add_eos = header.boolean("tokenizer.ggml.add_eos_token", add_eos)

        bos_id = special_token_id(header, "bos", n)
        eos_id = special_token_id(header, "eos", n)
        unk_id = special_token_id(header, "unk", n)
        if add_bos and bos_id is None:
            raise TokenizerError(f"{path}: add_bos_token is true, but bos_token_id is not set")
        if add_eos and eos_id is None:
            raise TokenizerError(f"{path}: add_eos_token is true, but eos_token_id is not set")

        eog_ids = _mark_by_text(header, tokens, ids, attrs, eos_id)
        _strip_by_name(header, ids, attrs, pre_name)
        try:  # checked when rendered: a file's chat template is not needed to run it
            template, template_error = header.string("tokenizer.chat_template", "") or None, None
        except GgufError as exc:
            template, template_error = None, str(exc)
        return cls(
            path=path,
            model=model,
            pre=pre,
            pre_name=pre_name,
            tokens=tuple(tokens),
            attrs=tuple(attrs),
            scores=tuple(scores),
            merges=merges,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            eog_ids=eog_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            clean_spaces=clean_spaces,
            ignore_merges=ignore_merges,
            chat_template=template,
            chat_template_error=template_error,
            ids=ids,
        )


def _tokens(header: GgufHeader, path: str) -> list[str]:
    # a token's bytes kept (llama.cpp's tokens are bytes): invalid UTF-8 as surrogates
    tokens = header.strings("tokenizer.ggml.tokens", keep_bytes=True)
    if "" in tokens:  # llama.cpp gives empty tokens a placeholder text
        tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
    return tokens


def _refuse_duplicates(path: str, tokens: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, text in enumerate(tokens):
        first = seen.setdefault(text, i)
        if first != i:
            raise TokenizerError(f"{path}: duplicate token {text!r} has ids {first} and {i}")


def _numbers(header: GgufHeader, key: str, n: int, default: float) -> list[Any]:
    if not header.has(key):
        return [default] * n
    values = header.array(key)
    if len(values) < n:
        raise TokenizerError(f"{header.paths[0]}: {key} has {len(values)} values for {n} tokens")
    out: list[Any] = np.asarray(values[:n]).tolist()  # Python ints / floats
    return out


def _merges(header: GgufHeader) -> tuple[tuple[str, str], ...]:
    if not header.has("tokenizer.ggml.merges"):
        raise TokenizerError(f"{header.paths[0]}: a BPE vocabulary without tokenizer.ggml.merges")
    lines = header.strings("tokenizer.ggml.merges")
    if any(line[:1] == " " for line in lines):
        pairs = [_split_merge(line) for line in lines]
    else:
        pairs = [(a, b) if sep else None for a, sep, b in (line.partition(" ") for line in lines)]
    # The first of two equal merges keeps its rank; a line without a space merges nothing.
    return tuple(p for p in dict.fromkeys(pairs) if p is not None)


def _split_merge(line: str) -> tuple[str, str] | None:
    cut = line.find(" ", 1)  # the first part may itself start with a space
    return None if cut < 0 else (line[:cut], line[cut + 1 :])


def _mark_by_text(
    header: GgufHeader, tokens: list[str], ids: dict[str, int], attrs: list[int], eos_id: int | None
) -> frozenset[int]:
    """Mark the tokens llama.cpp recognises by their text; return the end-of-generation
    ids (``runplan.end_tokens``)."""

    def control(found: Iterable[str]) -> None:
        for text in found:
            i = ids.get(text)
            if i is not None:
                attrs[i] |= Attr.CONTROL

    control(EOG_TEXTS)
    for key, texts in FIM_TEXTS.items():
        if fim_key_id(header, key, len(tokens)) is None:  # found by its text
            control(texts)
    for i, attr in enumerate(attrs):
        if attr & Attr.CONTROL and "unused" in tokens[i]:
            attrs[i] = attr | Attr.UNUSED
    for text in _ALWAYS_USER_DEFINED:
        if text in ids:
            attrs[ids[text]] = Attr.USER_DEFINED
    eog = end_of_generation_ids(header, tokens, ids, eos_id)
    for (text, _), shown in zip(EOG_EXCEPTIONS, (Attr.USER_DEFINED, Attr.NORMAL), strict=True):
        if text in ids and ids[text] not in eog:  # llama.cpp's exception took it out
            attrs[ids[text]] = shown
    return eog


def _strip_by_name(header: GgufHeader, ids: dict[str, int], attrs: list[int], pre: str) -> None:
    """The whitespace-stripping attributes llama.cpp gives by model or file name."""
    name = header.string("general.name", "", replace=True).lower()
    arch = header.string("general.architecture", "")

    def mark(text: str, bit: int, on: bool = True, required: bool = False) -> None:
        i = ids.get(text)
        if i is None:
            if required:  # llama.cpp fails to load such a file
                raise TokenizerError(
                    f"{header.paths[0]}: a model named {name!r} needs the token {text!r}"
                )
            return
        attrs[i] = attrs[i] | bit if on else attrs[i] & ~bit

    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        mark("<mask>", Attr.LSTRIP)
    elif "phi-3" in name or "phi3" in name:
        special = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN
        for i, attr in enumerate(attrs):
            if attr & special:
                attrs[i] = attr | Attr.RSTRIP
        mark("</s>", Attr.RSTRIP, required=True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            mark(text, Attr.RSTRIP, on=False, required=True)
    elif "modern-bert" in name:
        mark("[MASK]", Attr.LSTRIP)
