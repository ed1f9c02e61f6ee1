"""The request bodies' parser (``serve.requests``) refuses every body it does not take
with a ``RequestError`` whose error object can always be encoded, whatever the body:
any JSON value in any field (integers past every float, lone surrogates, deep
nesting), any key, any bytes. Nothing else is ever raised (a 500 is a bug)."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime_core.tokenizer import Tokenizer
from runtime_cupy.serve.prompts import chat_text
from runtime_cupy.serve.requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_DEPTH,
    NEUTRAL,
    RequestError,
    parse_chat,
    parse_completion,
)

PARSERS = {"chat": parse_chat, "completion": parse_completion}
# Text with what UTF-8 cannot hold (lone surrogates), and keys the API knows.
TEXT = st.text(st.characters(codec=None, categories=None), max_size=6)
KEYS = st.one_of(st.sampled_from(sorted({*CHAT_FIELDS, *COMPLETION_FIELDS, *NEUTRAL})), TEXT)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)


def _nested(field: str, depth: int) -> bytes:
    """A chat body whose ``field`` is 0.5 inside ``depth`` arrays (written out: too deep
    for ``json.dumps`` here)."""
    value = b"[" * depth + b"0.5" + b"]" * depth
    return b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "%s": %s}' % (
        field.encode(),
        value,
    )


def _assert_refused_cleanly(endpoint: str, body: bytes) -> None:
    try:
        PARSERS[endpoint](body)
    except RequestError as exc:
        error = exc.body()["error"]
        # What the app sends: JSON of the error object, as UTF-8.
        json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")
        assert isinstance(error["message"], str) and error["message"]
        assert 400 <= exc.status < 500


@given(endpoint=st.sampled_from(sorted(PARSERS)), fields=st.dictionaries(KEYS, VALUES, max_size=6))
def test_any_json_object_is_taken_or_refused_with_an_encodable_error(
    endpoint: str, fields: dict[str, Any]
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x", **fields}
    if endpoint == "chat":
        body.pop("prompt", None)
    else:
        body.pop("messages", None)
    data = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates as \ud800
    _assert_refused_cleanly(endpoint, data)


@given(endpoint=st.sampled_from(sorted(PARSERS)), data=st.binary(max_size=64))
def test_any_bytes_are_taken_or_refused_with_an_encodable_error(endpoint: str, data: bytes) -> None:
    _assert_refused_cleanly(endpoint, data)


BIG = 10**400
SURROGATE_KEY = b'{"model": "m", "prompt": "x", "\\ud800": 1}'


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "words"),
    [
        ("chat", {"temperature": BIG}, "temperature", "in [0, 2]"),
        ("chat", {"top_p": BIG}, "top_p", "in (0, 1]"),
        ("completion", {"temperature": -BIG}, "temperature", "in [0, 2]"),
        ("chat", _nested("temperature", 961), None, f"deeper than {MAX_DEPTH}"),
        ("chat", _nested("temperature", 962), None, f"deeper than {MAX_DEPTH}"),
        ("chat", _nested("stop", MAX_DEPTH), None, f"deeper than {MAX_DEPTH}"),
        ("chat", _nested("stop", 10**5), None, f"deeper than {MAX_DEPTH}"),
        ("completion", SURROGATE_KEY, "\\ud800", "Unrecognized request argument"),
    ],
)
def test_the_bodies_that_were_500s_are_400s_naming_the_field(
    endpoint: str, body: dict[str, Any] | bytes, param: str | None, words: str
) -> None:
    if isinstance(body, dict):
        base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        if endpoint == "completion":
            base = {"model": "m", "prompt": "x"}
        data = json.dumps({**base, **body}).encode()
    else:
        data = body
    with pytest.raises(RequestError) as info:
        PARSERS[endpoint](data)
    assert info.value.status == 400
    assert info.value.param == param
    assert words in info.value.message
    json.dumps(info.value.body(), ensure_ascii=False).encode("utf-8")


#: An assistant message as the openai client holds it (``ChatCompletionMessage``'s
#: ``model_dump()``): the fields an answer of this server never sets, empty.
DUMPED_ASSISTANT = {
    "role": "assistant",
    "content": "Hi!",
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": None,
}


def _chat(*messages: dict[str, Any]) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def test_an_assistant_message_sent_back_as_the_client_holds_it_is_taken() -> None:
    user = {"role": "user", "content": "Hello"}
    plain = parse_chat(_chat(user, {"role": "assistant", "content": "Hi!"}, user))
    for dumped in (DUMPED_ASSISTANT, {**DUMPED_ASSISTANT, "tool_calls": [], "annotations": []}):
        assert parse_chat(_chat(user, dumped, user)).messages == plain.messages


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        ({**DUMPED_ASSISTANT, "refusal": "no"}, "messages[1].refusal", "hold none"),
        ({**DUMPED_ASSISTANT, "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls", "no tools"),
        ({**DUMPED_ASSISTANT, "tool_calls": False}, "messages[1].tool_calls", "hold none"),
        ({"role": "user", "content": "x", "refusal": None}, "messages[1].refusal", "Unrecognized"),
        # OpenAI's refusal part: its type is what this server cannot read, not its key
        (
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            "messages[1].content[0].type",
            "text parts only",
        ),
        # a tool's answer: named by its role, not by the tool_call_id this server never reads
        ({"role": "tool", "content": "4", "tool_call_id": "c"}, "messages[1].role", "'tool'"),
    ],
)
def test_what_an_answer_of_this_server_never_holds_is_refused_naming_it(
    message: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse_chat(_chat({"role": "user", "content": "Hello"}, message))
    assert info.value.param == param and words in info.value.message, info.value.message


def test_what_newer_clients_send_that_changes_no_answer_is_taken() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "safety_identifier": "user-1234",
        "prompt_cache_key": "k",
    }
    request = parse_chat(json.dumps(body).encode())
    assert request.include_usage and request.stream
    body["stream_options"] = {"include_obfuscation": "yes"}
    with pytest.raises(RequestError) as info:
        parse_chat(json.dumps(body).encode())
    assert info.value.param == "stream_options.include_obfuscation"


class _Template:
    """A tokenizer's chat template that writes each message's name where it has one."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "".join(f"{m.get('name', m['role'])}: {m['content']}\n" for m in messages)


def test_a_message_name_reaches_the_chat_template() -> None:
    """A participant's ``name`` is the template's to use (Hugging Face's
    ``apply_chat_template`` hands it on); it was checked and then dropped."""
    request = parse_chat(
        _chat({"role": "user", "content": "Hi", "name": "ann"}, {"role": "user", "content": "Yo"})
    )
    assert [m.name for m in request.messages] == ["ann", None]
    assert chat_text(cast(Tokenizer, _Template()), request.messages) == "ann: Hi\nuser: Yo\n"
    with pytest.raises(RequestError) as info:
        parse_chat(_chat({"role": "user", "content": "Hi", "name": 7}))
    assert info.value.param == "messages[0].name"


@pytest.mark.parametrize("prompt", [[["a"]], [[["a"]]], [[[1, 2]]], [["a", "b"]]])
def test_a_prompt_nested_past_one_array_is_refused(prompt: Any) -> None:
    """OpenAI's prompt is text, token ids, or an array of those; ``[["a"]]`` and deeper
    were read as the text ``a`` at any depth."""
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    with pytest.raises(RequestError) as info:
        parse_completion(body)
    assert info.value.param == "prompt[0]", info.value.message
    assert parse_completion(json.dumps({"model": "m", "prompt": ["a"]}).encode()).prompt == "a"


def test_best_of_below_n_is_refused_as_openai_refuses_it() -> None:
    """``best_of: 1`` (the one value served: no candidates beyond the choices) with
    ``n: 2`` asked for two choices picked from one; it was answered with two."""
    body = json.dumps({"model": "m", "prompt": "x", "n": 2, "best_of": 1}).encode()
    with pytest.raises(RequestError, match="must be at least n") as info:
        parse_completion(body)
    assert info.value.param == "best_of"
    for fine in ({"n": 1, "best_of": 1}, {"n": 2, "best_of": None}, {"n": 2}):
        body = json.dumps({"model": "m", "prompt": "x", **fine}).encode()
        assert parse_completion(body).n == fine["n"]


@pytest.mark.parametrize("seed", [-2, -(2**63)])
def test_a_negative_seed_other_than_minus_one_names_what_is_taken(seed: int) -> None:
    body = json.dumps({"model": "m", "prompt": "x", "seed": seed}).encode()
    with pytest.raises(RequestError, match=r"or -1 \(or null\) for a random seed") as info:
        parse_completion(body)
    assert info.value.param == "seed"
    for random in (-1, None):
        assert (
            parse_completion(
                json.dumps({"model": "m", "prompt": "x", "seed": random}).encode()
            ).seed
            is None
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "x", "stop": [None]}, "stop[0] must be a string, not null"),
        ({"prompt": [None]}, "prompt[0] must be a token id (an integer), not null"),
        ({"prompt": [1, "2"]}, 'prompt[1] must be a token id (an integer), not string "2"'),
    ],
)
def test_a_value_of_the_wrong_type_is_named_once(fields: dict[str, Any], message: str) -> None:
    """Its type, then the value; a null is both (once "not null null")."""
    with pytest.raises(RequestError) as info:
        parse_completion(json.dumps({"model": "m", **fields}).encode())
    assert info.value.message == message


def _body(endpoint: str, **fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if endpoint == "completion":
        base = {"model": "m", "prompt": "x"}
    return json.dumps({**base, **fields}).encode()


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_an_integer_sent_as_a_whole_float_is_that_integer(endpoint: str) -> None:
    """A JSON number is a float to many clients: 16.0 (Python's ``json.dumps`` of a
    float) is the integer 16; 16.5 and true are no integers, named."""
    request = PARSERS[endpoint](_body(endpoint, max_tokens=16.0))
    assert request.max_tokens == 16 and type(request.max_tokens) is int
    for bad, words in ((16.5, "number 16.5"), (True, "boolean true")):
        with pytest.raises(RequestError) as info:
            PARSERS[endpoint](_body(endpoint, max_tokens=bad))
        assert info.value.param == "max_tokens"
        assert info.value.message == f"max_tokens must be an integer, not {words}"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("user", [5, ["u"], {"id": "u"}, False])
def test_a_user_that_is_not_a_string_is_refused_naming_it(endpoint: str, user: Any) -> None:
    """``user`` changes no answer, but it is a string (or null)."""
    for taken in ("user-1234", None):
        assert PARSERS[endpoint](_body(endpoint, user=taken)).max_tokens is None
    with pytest.raises(RequestError) as info:
        PARSERS[endpoint](_body(endpoint, user=user))
    assert info.value.status == 400 and info.value.param == "user"
    assert info.value.message.startswith("user must be a string, not ")
