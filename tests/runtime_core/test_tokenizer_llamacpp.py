"""Our tokenizer against llama.cpp's recorded output on the same files.

Every recorded case is asserted exactly: the ids of ``encode`` for each
``add_special`` / ``parse_special`` pair, the bytes of ``decode`` for each
``remove_special`` / ``special`` pair (and its text, invalid UTF-8 replaced), the
round trip where llama.cpp round-trips, the file facts llama.cpp reported, and the
chat templates (SmolLM2's, Qwen3's, Gemma 3's, Phi-3.5's) as llama.cpp's Jinja path
renders them, with llama.cpp's ids of the rendered prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from runplan.end_tokens import header_end_of_generation_ids
from runplan.gguf_header import GgufHeader
from runtime_core.tokenizer import ChatTemplateError, Tokenizer
from tests.fixtures.gguf_vocab import SPECS
from tests.runtime_core.conftest import MAIN_FIXTURES, alias_names, recorded

# Recorded cases we do not match, (fixture, text) -> why. A case listed here that
# matches fails the test, so the list cannot go stale. Empty: every case matches.
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}

ALL_FILES = [*MAIN_FIXTURES, *alias_names()]

Get = Callable[[str], Tokenizer]


def _bytes(value: str | dict[str, str]) -> bytes:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value.encode()


def _flags(key: str) -> tuple[bool, bool]:
    return key[0] == "1", key[1] == "1"


def _check(name: str, mismatches: dict[str, list[str]]) -> None:
    """Fail on a mismatch not listed as expected, and on an expected one that matches."""
    unexpected = [
        line for text, lines in mismatches.items() if (name, text) not in EXPECTED_FAILURES
        for line in lines
    ]  # fmt: skip
    fixed = [
        text for (fname, text) in EXPECTED_FAILURES
        if fname == name and text not in mismatches
    ]  # fmt: skip
    assert not unexpected, f"{len(unexpected)} mismatches with llama.cpp:\n" + "\n".join(
        unexpected[:20]
    )
    assert not fixed, f"listed as expected failures but now match llama.cpp: {fixed}"


@pytest.mark.parametrize("name", ALL_FILES)
def test_encode_matches_llama_cpp(name: str, recorded_tokenizer: Get) -> None:
    tok = recorded_tokenizer(name)
    data = recorded(name)
    mismatches: dict[str, list[str]] = {}
    for case in data["cases"]:
        for key, want in case["ids"].items():
            add_special, parse_special = _flags(key)
            got = tok.encode(case["text"], add_special=add_special, parse_special=parse_special)
            if got != want:
                mismatches.setdefault(case["text"], []).append(
                    f"encode({case['text']!r}, add_special={add_special}, "
                    f"parse_special={parse_special}) = {got}, llama.cpp: {want}"
                )
    assert len(data["cases"]) >= 20
    _check(name, mismatches)


@pytest.mark.parametrize("name", ALL_FILES)
def test_decode_matches_llama_cpp(name: str, recorded_tokenizer: Get) -> None:
    tok = recorded_tokenizer(name)
    data = recorded(name)
    mismatches: dict[str, list[str]] = {}

    def compare(label: str, ids: list[int], flags: str, want: bytes) -> None:
        remove_special, special = _flags(flags)
        got = tok.decode_bytes(ids, special=special, remove_special=remove_special)
        text = tok.decode(ids, special=special, remove_special=remove_special)
        if got != want or text != want.decode("utf-8", "replace"):
            mismatches.setdefault(label, []).append(
                f"decode({ids}, remove_special={remove_special}, special={special}) = "
                f"{got!r}, llama.cpp: {want!r}"
            )

    for case in data["cases"]:
        for key, want in case["decode"].items():
            ids_key, flags = key.split("/")
            compare(case["text"], case["ids"][ids_key], flags, _bytes(want))
    for case in data["decodes"]:
        for flags, want in case["decode"].items():
            compare(str(case["ids"]), case["ids"], flags, _bytes(want))
    _check(name, mismatches)


@pytest.mark.parametrize("name", ALL_FILES)
def test_round_trip_where_llama_cpp_round_trips(name: str, recorded_tokenizer: Get) -> None:
    tok = recorded_tokenizer(name)
    trips = [
        case["text"]
        for case in recorded(name)["cases"]
        if _bytes(case["decode"]["00/00"]) == case["text"].encode()
    ]
    assert trips, "llama.cpp round-trips no recorded text"
    # As recorded: no BOS / EOS, control tokens written in the text left as text.
    failed = [
        t for t in trips if tok.decode(tok.encode(t, add_special=False, parse_special=False)) != t
    ]
    assert not failed


@pytest.mark.parametrize("name", MAIN_FIXTURES)
def test_file_facts_match_llama_cpp(name: str, recorded_tokenizer: Get) -> None:
    tok = recorded_tokenizer(name)
    meta: dict[str, Any] = recorded(name)["meta"]
    assert tok.n_vocab == meta["n_vocab"]
    assert (tok.vocab.add_bos, tok.vocab.add_eos) == (meta["add_bos"], meta["add_eos"])
    assert tok.bos_id == (meta["bos_id"] if meta["bos_id"] >= 0 else None)
    assert tok.eos_id == (meta["eos_id"] if meta["eos_id"] >= 0 else None)
    assert sorted(tok.eog_ids) == meta["eog_ids"]
    # the planner's reading of the same header (what ends a run) is llama.cpp's too
    header = GgufHeader.read(tok.vocab.path)
    eos = meta["eos_id"] if meta["eos_id"] >= 0 else None
    assert list(header_end_of_generation_ids(header, eos, meta["n_vocab"])) == meta["eog_ids"]


def test_the_fixtures_cover_every_model_and_required_pre_tokenizer() -> None:
    seen = {(recorded(n)["model"], recorded(n)["pre"]) for n in ALL_FILES}
    for pre in ("default", "llama3", "llama-bpe", "qwen2", "smollm", "gpt-2"):
        assert ("gpt2", pre) in seen
    assert ("llama", None) in seen
    assert recorded("smollm2-135m")["pre"] == "smollm"


CHAT_FIXTURES = ["smollm2-135m", *(name for name, spec in SPECS.items() if spec.chat_template)]


@pytest.mark.parametrize("name", CHAT_FIXTURES)
def test_chat_templates_render_and_encode_as_llama_cpp_does(
    name: str, recorded_tokenizer: Get
) -> None:
    """Each conversation renders as llama-cpp-python's Jinja2 formatter renders it (or
    raises where the template raises), and the rendered prompt encodes to llama.cpp's
    ids (specials parsed, none added: the template writes them)."""
    tok = recorded_tokenizer(name)
    chat = recorded(f"{name}.chat")
    assert chat["tokenizer_digest"] == recorded(name)["tokenizer_digest"]
    assert (chat["bos_token"], chat["eos_token"]) == (
        tok.token_text(tok.bos_id or 0),
        tok.token_text(tok.eos_id or 0),
    )
    for case in chat["rendered"]:
        kwargs = {"add_generation_prompt": case["add_generation_prompt"], **case["variables"]}
        if "error" in case:
            with pytest.raises(ChatTemplateError, match=re.escape(case["error"])):
                tok.apply_chat_template(case["messages"], **kwargs)
            continue
        text = tok.apply_chat_template(case["messages"], **kwargs)
        assert text == case["jinja"]
        assert tok.encode(text, add_special=False, parse_special=True) == case["ids"]


def test_the_chat_fixtures_cover_each_later_architecture() -> None:
    sources = {recorded(f"{name}.chat")["source"] for name in CHAT_FIXTURES}
    assert {"bpe-qwen3", "spm-gemma3", "spm-phi-3.5"} <= sources
    gemma = recorded("spm-gemma3")
    assert gemma["meta"]["add_bos"] and gemma["spec"]["add_space_prefix"] is False
    assert any("error" in case for case in recorded("spm-gemma3.chat")["rendered"])
