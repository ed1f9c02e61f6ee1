"""Tokenizer behaviour beyond the recorded ids: typed errors, chat templates and
properties over arbitrary text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import given
from hypothesis import strategies as st

from runtime_core.chat import ChatTemplateError, NoChatTemplate
from runtime_core.tokenizer import (
    Tokenizer,
    TokenizerError,
    UnknownPreTokenizer,
    UnknownTokenizerModel,
)
from tests.fixtures.gguf_models import ModelShape, bytes_to_unicode, write_model
from tests.fixtures.gguf_vocab import SPECS, VocabSpec, write_vocab
from tests.runtime_core.conftest import CHAT_FIXTURE, fixture
from tests.support.strategies import tokenizer_texts

Write = Callable[[VocabSpec], Path]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def vocab_tokenizers(vocab_path: Write) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_gguf(vocab_path(spec)) for name, spec in SPECS.items()}


# -- typed errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pre", "why"),
    [
        ("no-such-pre", "neither llama.cpp nor this package knows it"),
        ("gemma4", "llama.cpp knows it, but it is not implemented here"),
    ],
)
def test_an_unknown_pre_tokenizer_is_a_typed_error_naming_it(
    vocab_path: Write, pre: str, why: str
) -> None:
    path = vocab_path(VocabSpec(f"pre-{pre}", pre=pre))
    with pytest.raises(UnknownPreTokenizer) as info:
        Tokenizer.from_gguf(path)
    assert info.value.pre == pre
    assert info.value.path == str(path)
    assert repr(pre) in str(info.value)
    assert why in str(info.value)
    assert isinstance(info.value, TokenizerError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("model", ["bert", "t5", "no-such-model"])
def test_an_unknown_tokenizer_model_is_a_typed_error_naming_it(
    vocab_path: Write, model: str
) -> None:
    path = vocab_path(VocabSpec(f"model-{model}", model=model, pre=None))
    with pytest.raises(UnknownTokenizerModel) as info:
        Tokenizer.from_gguf(path)
    assert info.value.model == model
    assert repr(model) in str(info.value)


def test_a_bpe_file_without_a_pre_tokenizer_uses_the_default_one(vocab_path: Write) -> None:
    # llama.cpp warns and falls back to "default"; so do we.
    without = Tokenizer.from_gguf(vocab_path(VocabSpec("no-pre", pre=None, add_bos=False)))
    default = Tokenizer.from_gguf(vocab_path(SPECS["bpe-default"]))
    text = "x=1;y=22 333 4444 it's <|im_start|>"
    assert without.encode(text) == default.encode(text)


def test_adding_bos_without_a_bos_id_is_refused(vocab_path: Write) -> None:
    # SentencePiece defaults bos to id 1; a two-token vocabulary leaves it out of range.
    from gguf import GGUFWriter

    path = vocab_path(SPECS["spm-llama"]).parent / "tiny-spm.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerError, match="add_bos_token is true, but bos_token_id"):
        Tokenizer.from_gguf(path)


def test_a_phi3_file_without_the_tokens_llama_cpp_needs_is_refused(vocab_path: Write) -> None:
    # llama.cpp fails to load a model named phi-3 whose vocabulary lacks </s>.
    with pytest.raises(TokenizerError, match="needs the token '</s>'"):
        Tokenizer.from_gguf(vocab_path(VocabSpec("bpe-phi-3", pre="gpt-2")))


@pytest.mark.parametrize("text", [None, b"Hi", 3])
def test_encoding_what_is_not_a_str_is_a_type_error_naming_it(
    smollm2: Tokenizer, text: object
) -> None:
    with pytest.raises(TypeError, match=f"text must be a str, not {type(text).__name__}"):
        smollm2.encode(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        ("abc", "ids must be an iterable of token ids, not str"),
        (b"ab", "ids must be an iterable of token ids, not bytes"),
        (None, "ids must be an iterable of token ids, not NoneType"),
        ([1, 1.0], "token id 1.0 is a float, not an integer"),
        ([1, "2"], "token id '2' is a str, not an integer"),
    ],
)
def test_decoding_what_is_not_token_ids_is_a_type_error_naming_it(
    smollm2: Tokenizer, ids: object, says: str
) -> None:
    with pytest.raises(TypeError, match=says):
        smollm2.decode(ids)  # type: ignore[arg-type]
    assert smollm2.decode([np.int64(1)]) == smollm2.decode([1])  # numpy's integers are ids


def test_decoding_an_id_outside_the_vocabulary_is_a_typed_error(smollm2: Tokenizer) -> None:
    for bad in (-1, smollm2.n_vocab):
        with pytest.raises(TokenizerError, match=str(bad)):
            smollm2.decode([1, bad])


def test_a_file_without_a_chat_template_raises_no_chat_template(
    vocab_tokenizers: dict[str, Tokenizer],
) -> None:
    tok = vocab_tokenizers["bpe-qwen2"]
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplate) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.path == tok.vocab.path
    assert "tokenizer.chat_template" in str(info.value)


# -- chat templates -------------------------------------------------------------------
def test_invalid_utf8_in_the_name_or_the_chat_template_refuses_only_the_chat(
    tmp_path: Path,
) -> None:
    """As llama.cpp and the planner: ``general.name`` is shown only (invalid UTF-8
    replaced), and ``tokenizer.chat_template`` is read when rendered. Before, either
    refused the whole model, even a run without ``--chat``."""
    path = write_model(
        tmp_path / "m.gguf",
        ModelShape(),
        override_keys={
            "general.name": (b"tiny\xff\xfe", GGUFValueType.STRING),
            "tokenizer.chat_template": (b"{{ messages }}\xff", GGUFValueType.STRING),
        },
    )
    tok = Tokenizer.from_gguf(path)
    assert tok.decode(tok.encode("hi there")).endswith("hi there")
    with pytest.raises(ChatTemplateError, match=r"'tokenizer\.chat_template'.*not valid UTF-8"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_smollm2_chat_template_renders_as_llama_cpp_python_renders_it(
    smollm2: Tokenizer,
) -> None:
    data = fixture(CHAT_FIXTURE)
    assert data["bos_token"] == smollm2.token_text(smollm2.bos_id or 0)
    for case in data["rendered"]:
        got = smollm2.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"]
        )
        assert got == case["jinja"]
        if case["messages"][0]["role"] == "system":
            # llama.cpp's built-in ChatML agrees once the conversation names its own
            # system prompt (SmolLM2's template otherwise adds a default one).
            assert got == case["llama_chat_apply_template"]


def test_smollm2_chat_template_structure(smollm2: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with_prompt = smollm2.apply_chat_template(messages, add_generation_prompt=True)
    without = smollm2.apply_chat_template(messages, add_generation_prompt=False)
    assert without.startswith("<|im_start|>system\n")  # the template's default system turn
    assert without.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n")
    assert with_prompt == without + "<|im_start|>assistant\n"
    ids = smollm2.encode(with_prompt)
    im_start = smollm2.encode("<|im_start|>", add_special=False)
    assert len(im_start) == 1
    assert ids.count(im_start[0]) == 4  # parsed as control tokens, not spelt out


def test_a_template_sees_bos_eos_and_extra_variables(vocab_path: Write) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
        "{{ extra }}"
    )
    spec = VocabSpec("chat", pre="qwen2", add_bos=False, chat_template=template)
    tok = Tokenizer.from_gguf(vocab_path(spec))
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], extra="!")
    assert out == '<|endoftext|>[user]"é"[assistant]<|im_end|>!'
    out = tok.apply_chat_template([], add_generation_prompt=False, extra="")
    assert out == "<|endoftext|><|im_end|>"


@pytest.mark.parametrize(("add_bos", "add_eos"), [(True, True), (True, False), (False, False)])
def test_a_chat_prompt_has_the_bos_and_eos_its_template_or_flags_give_once(
    vocab_path: Write, add_bos: bool, add_eos: bool
) -> None:
    """A template that writes ``bos_token`` (Llama 3's, Gemma's) on a file that adds BOS
    gave two BOS tokens; as llama.cpp's server, the template's own BOS at the start (and
    EOS at the end) is left out where the flags add one."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}"
    spec = VocabSpec(
        f"chat-bos-{add_bos}-{add_eos}", pre="qwen2", add_bos=add_bos, add_eos=add_eos,
        chat_template=template,
    )  # fmt: skip
    tok = Tokenizer.from_gguf(vocab_path(spec))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode_chat(text)
    bos, eos = tok.vocab.bos_id, tok.vocab.eos_id
    assert ids[:2].count(bos) == 1 and ids[0] == bos, ids
    assert ids[-2:].count(eos) == 1 and ids[-1] == eos, ids
    assert ids[1:-1] == tok.encode("[hi]", add_special=False, parse_special=True)
    gemma = Tokenizer.from_gguf(vocab_path(SPECS["spm-gemma3"]))
    prompt = gemma.encode_chat(gemma.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert prompt[0] == gemma.vocab.bos_id != prompt[1]


def test_raise_exception_and_broken_templates_are_chat_template_errors(vocab_path: Write) -> None:
    raising = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tok = Tokenizer.from_gguf(vocab_path(VocabSpec("raise", pre="qwen2", chat_template=raising)))
    assert tok.apply_chat_template([{"role": "user", "content": ""}]) == ""
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": ""}])
    with pytest.raises(ChatTemplateError, match="not a mapping with a 'role'"):
        tok.apply_chat_template([{"content": "no role"}])
    broken = Tokenizer.from_gguf(vocab_path(VocabSpec("broken", chat_template="{% for %}")))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": ""}])
    sandboxed = Tokenizer.from_gguf(
        vocab_path(VocabSpec("sandbox", chat_template="{{ messages.__class__.__mro__ }}"))
    )
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([{"role": "user", "content": ""}])


# -- properties -----------------------------------------------------------------------


@given(text=tokenizer_texts, add_special=st.booleans(), parse_special=st.booleans())
def test_encode_never_raises_and_ids_are_in_range(
    vocab_tokenizers: dict[str, Tokenizer],
    smollm2: Tokenizer,
    text: str,
    add_special: bool,
    parse_special: bool,
) -> None:
    for tok in (smollm2, *vocab_tokenizers.values()):
        ids = tok.encode(text, add_special=add_special, parse_special=parse_special)
        assert all(0 <= i < tok.n_vocab for i in ids)


@given(text=tokenizer_texts)
def test_smollm2_loses_only_the_bytes_it_has_no_token_for(smollm2: Tokenizer, text: str) -> None:
    # SmolLM2 (smollm) does not clean spaces up and its merges are all tokens, so
    # byte-level BPE gives back every byte of the text but those the vocabulary has no
    # token for (21, such as 0xF1; llama.cpp drops them too). (The generated
    # vocabularies hold a merge that is no token on purpose, which drops more.)
    stand_in = bytes_to_unicode()
    kept = bytes(b for b in text.encode() if stand_in[b] in smollm2.vocab.ids)
    ids = smollm2.encode(text, add_special=False, parse_special=False)
    assert smollm2.decode_bytes(ids) == kept
    # Parsed control tokens come back with special=True.
    assert smollm2.decode_bytes(smollm2.encode(text, add_special=False), special=True) == kept


@given(text=st.text(st.characters(codec="utf-8", exclude_characters="<\u2581")))
def test_sentencepiece_round_trips_text_without_special_tokens(
    vocab_tokenizers: dict[str, Tokenizer], text: str
) -> None:
    # The space prefix is added before the first piece and dropped again by decode;
    # characters with no piece go through <0xXX> byte tokens and come back. ("<"
    # starts every special token; a literal "▁" would decode as a space.)
    for name in ("spm-llama", "spm-llama-noprefix"):
        tok = vocab_tokenizers[name]
        assert tok.decode(tok.encode(text, add_special=False)) == text


@given(data=st.data())
def test_decode_never_raises_on_ids_in_range(
    vocab_tokenizers: dict[str, Tokenizer], smollm2: Tokenizer, data: st.DataObject
) -> None:
    for tok in (smollm2, *vocab_tokenizers.values()):
        ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=16))
        flags = data.draw(st.tuples(st.booleans(), st.booleans()))
        raw = tok.decode_bytes(ids, special=flags[0], remove_special=flags[1])
        assert tok.decode(ids, special=flags[0], remove_special=flags[1]) == raw.decode(
            "utf-8", "replace"
        )


def test_a_lone_surrogate_is_encoded_as_the_replacement_character(smollm2: Tokenizer) -> None:
    assert smollm2.encode("a\ud800b") == smollm2.encode("a\ufffdb")


def test_tokens_that_are_not_utf8_keep_their_bytes(tmp_path: Path) -> None:
    """llama.cpp keeps a token's text as bytes: two SentencePiece tokens of bytes that
    are not UTF-8 are two tokens, each decoding to its own bytes (before: both read as
    U+FFFD, the file refused for a "duplicate token"; one alone decoded as EF BF BD)."""
    more = (b"\xe4\xb8", b"\xe4\xb9")
    tok = Tokenizer.from_gguf(write_vocab(tmp_path / "v.gguf", SPECS["spm-llama"], more))
    first, second = tok.n_vocab - 2, tok.n_vocab - 1
    assert tok.decode_bytes([first]) == b"\xe4\xb8"
    assert tok.decode_bytes([second]) == b"\xe4\xb9"
    continued = tok.vocab.ids["<0xAD>"]
    assert tok.decode_bytes([first, continued]) == "\u4e2d".encode()
    assert tok.decode([first, continued]) == "\u4e2d"
    assert tok.encode("\u4e2d", add_special=False)  # no text merges into them
    assert tok.longest_token_bytes >= 2
    # a character of no token of its own is its bytes' tokens, never the file's last
    # ids (the symbols made for the text's merges once took their ids)
    plain = Tokenizer.from_gguf(write_vocab(tmp_path / "plain.gguf", SPECS["spm-llama"]))
    for text in ("\u00fc", "a\u00fcb", "\u4e2d"):
        ids = tok.encode(text, add_special=False)
        assert ids == plain.encode(text, add_special=False)
        assert first not in ids and second not in ids
        assert tok.decode_bytes(ids) == plain.decode_bytes(ids)


@pytest.fixture(scope="module")
def longest_ids(vocab_tokenizers: dict[str, Tokenizer], smollm2: Tokenizer) -> dict[int, list[int]]:
    """Per tokenizer (by id()), the ids of its 8 longest tokens."""
    out = {}
    for tok in (smollm2, *vocab_tokenizers.values()):
        by_size = sorted(range(tok.n_vocab), key=lambda i: -len(tok.token_text(i).encode()))
        out[id(tok)] = by_size[:8]
    return out


@given(data=st.data())
def test_min_token_count_is_a_lower_bound_on_the_tokens(
    vocab_tokenizers: dict[str, Tokenizer],
    smollm2: Tokenizer,
    longest_ids: dict[int, list[int]],
    data: st.DataObject,
) -> None:
    # Texts that come close to the bound: the vocabulary's longest tokens (and any
    # others) written out, special ones included, with the pieces tokenizers treat
    # specially (whitespace runs beside special tokens, which phi-3's take along).
    for tok in (smollm2, *vocab_tokenizers.values()):
        ids = st.one_of(st.sampled_from(longest_ids[id(tok)]), st.integers(0, tok.n_vocab - 1))
        drawn = data.draw(st.lists(ids, max_size=48))
        text = tok.decode(drawn, special=True) + data.draw(tokenizer_texts)
        bound = tok.min_token_count(text)
        for parse_special in (True, False):
            assert bound <= len(tok.encode(text, add_special=False, parse_special=parse_special))


@pytest.mark.parametrize("text", ["\x04" * 2000, "a" + "\x06\x13\x14\x16\x1d" * 1000 + "b"])
def test_min_token_count_leaves_out_bytes_that_are_no_token(smollm2: Tokenizer, text: str) -> None:
    """SmolLM2 has no token for the bytes 0x04, 0x06, 0x13, 0x14, 0x16 and 0x1d: they come
    out as nothing (as llama.cpp's), but were counted, so 2,000 of them made a "lower
    bound" of 13 tokens for none, and a server refused such a prompt as too long."""
    assert smollm2.min_token_count(text) <= len(smollm2.encode(text, add_special=False))


def test_min_token_count_leaves_out_the_bytes_a_merge_made_symbol_drops(tmp_path: Path) -> None:
    """A byte-level vocabulary of the 256 bytes whose merges make "ĠĠ" and "ĠĠĠĠ", no
    tokens: llama.cpp emits such a symbol as its ASCII bytes' tokens, so a run of spaces
    comes out as nothing at all (as llama.cpp's), but was counted (8 spaces: at least
    4 tokens)."""
    from gguf import GGUFWriter

    path = tmp_path / "v.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    table = bytes_to_unicode()
    writer.add_token_list([table[b] for b in range(256)])
    writer.add_token_merges(["\u0120 \u0120", "\u0120\u0120 \u0120\u0120"])
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(path)
    for text in (" " * 8, "a" + " " * 2000 + "b"):
        assert tok.min_token_count(text) <= len(tok.encode(text, add_special=False))
    assert tok.encode(" " * 8) == []


def test_min_token_count_counts_a_long_text_without_tokenizing_it(smollm2: Tokenizer) -> None:
    longest = max(range(smollm2.n_vocab), key=lambda i: len(smollm2.token_text(i).encode()))
    text = smollm2.decode([longest]) * 1000
    bound = smollm2.min_token_count(text)
    assert bound == -(-len(text.encode()) // smollm2.longest_token_bytes) > 100
    assert bound <= len(smollm2.encode(text, add_special=False))


# -- vocabularies other tools may write --------------------------------------------------
def _string_array(path: Path, key: str) -> list[str]:
    field = GGUFReader(path).fields[key]
    return [bytes(field.parts[i]).decode() for i in field.data]


def test_a_merge_longer_than_every_token_loads_and_merges_as_llama_cpp(
    tmp_path: Path,
) -> None:
    """A merge of two tokens whose result is no token and longer than every token: the
    tokenizers package panics on it (a ``pyo3_runtime.PanicException``, which no
    ``except Exception`` catches), so the file failed with a Rust backtrace. It loads,
    and encodes as llama.cpp 0.3.36 encodes it (the ids below: its ``tokenize`` of this
    file, recorded once): the merge joins words of one pre-token only, its result
    emitted as the tokens of its bytes."""
    base = write_model(tmp_path / "base.gguf", ModelShape())
    merges = _string_array(base, "tokenizer.ggml.merges")
    longest = "Ġparallel"  # the longest word token of this vocabulary
    assert max(map(len, _string_array(base, "tokenizer.ggml.tokens"))) < 2 * len(longest)
    path = write_model(
        tmp_path / "merge.gguf",
        ModelShape(),
        override_keys={
            "tokenizer.ggml.merges": ([*merges, f"{longest} {longest}"], GGUFValueType.ARRAY)
        },
    )
    tok = Tokenizer.from_gguf(path)
    llama_cpp = {
        "hello parallel parallel": [257, 108, 108, 111, 314, 314],
        " parallel parallelparallel": [314, 314, 112, 97, 114, 97, 108, 108, 275],
        "parallelparallel x": [112, 97, 114, 97, 108, 108, 275, 112, 97, 114, 97, 108, 108,
                               275, 32, 120],
    }  # fmt: skip
    assert {text: tok.encode(text, add_special=False) for text in llama_cpp} == llama_cpp


def test_byte_tokens_whose_text_is_not_hex_decode_as_llama_cpp(tmp_path: Path) -> None:
    """Tokens typed BYTE whose text is not ``<0xXX>`` (a file from another tool): the
    run failed at the first one it decoded (``int('ZZ', 16)``, mid-stream). llama.cpp
    reads its byte with ``strtol`` of the text's fourth and fifth bytes; the bytes
    below are llama.cpp 0.3.36's ``detokenize`` of each, recorded once."""
    base = write_model(tmp_path / "base.gguf", ModelShape())
    tokens = _string_array(base, "tokenizer.ggml.tokens")
    field = GGUFReader(base).fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    llama_cpp = {"<0xZZ>": b"\x00", "<0x-1>": b"\xff", "<0x4a>": b"J", "<0>": b"\x00",
                 "<0x+f>": b"\x0f", "<0x a>": b"\n", "Ġstagx": b"\x00"}  # fmt: skip
    ids = range(300, 300 + len(llama_cpp))
    for i, text in zip(ids, llama_cpp, strict=True):
        tokens[i], types[i] = text, 6  # BYTE
    path = write_model(
        tmp_path / "bytes.gguf",
        ModelShape(),
        override_keys={
            "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
            "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY),
        },
    )
    tok = Tokenizer.from_gguf(path)
    assert [tok.token_bytes(i) for i in ids] == list(llama_cpp.values())


def test_a_sentencepiece_token_of_a_million_characters_builds_at_once(tmp_path: Path) -> None:
    """The merges of a SentencePiece vocabulary are its tokens' cuts into two parts that
    are tokens or single characters: every cut of every token was tried, each copying
    and hashing the token, so one forged token of 400,000 characters (a 1.2 MB file)
    took minutes to build. Only cuts into parts of a token's length are tried now, and
    the merges are the same."""
    from tests.fuzz.pipeline import MutantTimeout, time_limit

    long = "\u2581" * 400_000
    path = write_vocab(tmp_path / "v.gguf", SPECS["spm-llama"], (long.encode(),))
    try:
        with time_limit(20.0, "Tokenizer.from_gguf"):
            tok = Tokenizer.from_gguf(path)
    except MutantTimeout as exc:  # the frame it interrupts may be one pytest cannot show
        pytest.fail(str(exc), pytrace=False)
    plain = Tokenizer.from_gguf(write_vocab(tmp_path / "plain.gguf", SPECS["spm-llama"]))
    for text in ("a  b", "   hello world  ", "\u00fc  x"):
        assert tok.encode(text) == plain.encode(text)


def test_a_sentencepiece_vocabulary_of_many_token_lengths_builds_in_near_linear_time(
    tmp_path: Path,
) -> None:
    """~50,000 tokens, one of each length from 1 to 5,000 characters among them (a
    13 MB file): trying each token's cuts at every token length, each cut copied and
    hashed, took time cubic in the number of lengths (a minute); the cuts into parts
    that are tokens are found from the tokens sorted now (0.3 s on an idle machine,
    1 to 2 s on a busy one). The bound is a guard against the cubic search, not a
    measure: fifteen times the busy machine's time, half the cubic search's on the idle
    one."""
    import random

    from runplan.gguf_header import GgufHeader
    from runtime_core.tokenizer_vocab import Vocab
    from tests.fixtures.gguf_vocab import spm_vocab
    from tests.fuzz.pipeline import MutantTimeout, time_limit

    rng = random.Random(0)
    letters = bytes(b"abcdefghijklmnop"[b % 16] for b in range(256))
    taken = set(spm_vocab()[0])
    more: list[bytes] = []
    for n in [*range(1, 5_001), *(rng.randint(3, 8) for _ in range(46_000))]:
        text = rng.randbytes(n).translate(letters)
        if text.decode() not in taken:
            taken.add(text.decode())
            more.append(text)
    vocab = Vocab.from_header(
        GgufHeader.read(write_vocab(tmp_path / "v.gguf", SPECS["spm-llama"], more))
    )
    try:
        with time_limit(30.0, "Tokenizer(vocab)"):
            tok = Tokenizer(vocab)
    except MutantTimeout as exc:  # the frame it interrupts may be one pytest cannot show
        pytest.fail(str(exc), pytrace=False)
    longest = max(more, key=len).decode()
    assert len(longest) == 5_000
    assert tok.decode(tok.encode(longest, add_special=False)) == longest
