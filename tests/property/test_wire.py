"""Wire codec: every message round-trips; anything else raises ``WireError`` only."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runplan import RunPlan, plan_run, provision_all
from runplan.messages import StageReady
from runplan.wire import MESSAGE_TYPES, OPTIONAL_KEYS, WireError, dumps, loads
from tests.support.strategies import PlanInputs, message_strategies, small_plan, valid_plan_inputs


@st.composite
def plans(draw: st.DrawFn) -> RunPlan:
    inputs: PlanInputs = draw(valid_plan_inputs(max_layers=12))
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan)
    return plan


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """A plan, one of its provisions, or any other control message about it."""
    plan = draw(plans())
    kind = draw(st.sampled_from(MESSAGE_TYPES))
    if kind is RunPlan:
        return plan
    return draw(message_strategies(plan)[kind])


def test_every_message_type_is_generated() -> None:
    plan = small_plan(2)
    assert set(MESSAGE_TYPES) == {RunPlan, *message_strategies(plan)}
    assert {type(m) for m in provision_all(plan)} <= set(MESSAGE_TYPES)


@given(messages())
def test_every_message_round_trips(msg: Any) -> None:
    data = dumps(msg)
    assert isinstance(data, bytes)
    assert loads(data) == msg
    assert dumps(loads(data)) == data  # canonical: one encoding per message


@given(st.binary(max_size=512))
def test_loads_on_random_bytes_raises_only_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        loads(data)


_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, Any]:
    """A message's JSON with one node replaced, removed, or a key added."""
    msg = draw(messages())
    tree = json.loads(dumps(msg))
    path = draw(st.sampled_from(_paths(tree)[1:]))
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(["replace", "delete", "add_key"]))
    if action == "replace":
        parent[path[-1]] = draw(_JSON_LEAVES | st.lists(_JSON_LEAVES, max_size=2))
    elif action == "delete":
        del parent[path[-1]]
    else:
        target = parent[path[-1]] if isinstance(parent[path[-1]], dict) else parent
        if isinstance(target, dict):
            target[draw(st.text(min_size=1, max_size=6))] = draw(_JSON_LEAVES)
    return json.dumps(tree).encode(), msg


@given(mutated())
def test_loads_on_mutated_messages_raises_only_wire_error(case: tuple[bytes, Any]) -> None:
    data, _original = case
    try:
        result = loads(data)
    except WireError:
        return
    # A mutation may still be a well-formed message (another number, say): then it is
    # one of the message types and encodes again.
    assert isinstance(result, MESSAGE_TYPES)
    assert loads(dumps(result)) == result


@given(messages(), st.data())
def test_loads_on_truncated_or_flipped_bytes_raises_only_wire_error(
    msg: Any, data: st.DataObject
) -> None:
    raw = bytearray(dumps(msg))
    cut = data.draw(st.integers(0, len(raw) - 1))
    try:
        loads(bytes(raw[:cut]))
        raise AssertionError("a truncated message was accepted")
    except WireError:
        pass
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        result = loads(bytes(raw))
        assert isinstance(result, MESSAGE_TYPES)
    except WireError:
        pass


def test_enum_and_nested_union_values_are_checked() -> None:
    plan = small_plan(1)
    cases = [
        (dumps(provision_all(plan)[0]), b'"kind":"TOKEN_IN"', b'"kind":"TOKEN_SIDEWAYS"'),
        (dumps(plan), b'"type":"OrchestratorEndpoint"', b'"type":"Nobody"'),
        (b'{"reason":"COMPLETED","run_id":"r","type":"StopRun"}', b"COMPLETED", b"FINISHED"),
    ]
    for good, old, new in cases:
        assert old in good
        loads(good)
        with pytest.raises(WireError):
            loads(good.replace(old, new, 1))


def test_a_lone_surrogate_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        loads(b'{"node_id":"n","run_id":"\\ud800","stage_index":0,"type":"StageReady"}')


def test_a_key_twice_in_an_object_is_a_wire_error() -> None:
    """``dumps`` never writes one; a reader taking the last (as ``json`` does) let a
    message say two things."""
    base = b'{"node_id":"n","run_id":"a","stage_index":0,"type":"StageReady"'
    assert loads(base + b"}") is not None
    with pytest.raises(WireError, match="'run_id' appears twice"):
        loads(base + b',"run_id":"b"}')


def test_unknown_type_and_extra_keys_are_wire_errors() -> None:
    for data in (b'{"type": "LaunchMissiles"}', b'{"type": 3}', b"{}", b"[]", b"null"):
        try:
            loads(data)
            raise AssertionError(f"{data!r} accepted")
        except WireError as exc:
            assert "type" in str(exc) or "object" in str(exc)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_dumps_of_a_number_json_cannot_hold_is_a_wire_error(value: float) -> None:
    plan = small_plan(2)
    bad = attrs.evolve(plan, sampling=attrs.evolve(plan.sampling, temperature=value))
    with pytest.raises(WireError, match="RunPlan"):
        dumps(bad)


# Text with and without lone surrogates, integers in and far outside the wire's range.
_texts = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "a\udfff", "\udc80x"]))
_ints = st.one_of(st.integers(0, 2**64 - 1), st.integers(max_value=-1), st.integers(2**64))


@given(run_id=_texts, stage_index=_ints, node_id=_texts)
def test_what_dumps_encodes_loads_takes_back(run_id: str, stage_index: int, node_id: str) -> None:
    """``dumps`` refuses what no peer's ``loads`` would take, rather than sending a
    message the peer must drop (it once encoded a lone surrogate as ``\\ud800`` and an
    integer of any size)."""
    msg = StageReady(run_id=run_id, stage_index=stage_index, node_id=node_id)
    try:
        data = dumps(msg)
    except WireError as exc:
        assert "StageReady cannot be encoded" in str(exc)
        bad_int = not 0 <= stage_index <= 2**64 - 1
        bad_text = any("\ud800" <= c <= "\udfff" for c in run_id + node_id)
        assert bad_int or bad_text
        return
    assert loads(data) == msg


def _object_keys(raw: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every key of every object in ``raw`` (decoded JSON)."""
    found: list[tuple[Any, ...]] = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            found.append((*path, key))
            found += _object_keys(value, (*path, key))
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found += _object_keys(value, (*path, i))
    return found


@given(messages(), st.data())
def test_a_missing_key_is_a_wire_error_even_where_its_field_has_a_default(
    msg: Any, data: st.DataObject
) -> None:
    """``dumps`` writes every field: a message without one is malformed, sampling,
    timeouts, end tokens and the like included, but for the KV cache's width that
    messages written before it lack (``OPTIONAL_KEYS``)."""
    raw = json.loads(dumps(msg))
    path = data.draw(st.sampled_from([p for p in _object_keys(raw) if p[-1] != "type"]))
    holder = raw
    for step in path[:-1]:
        holder = holder[step]
    del holder[path[-1]]
    damaged = json.dumps(raw).encode()
    if path[-1] in OPTIONAL_KEYS:
        assert loads(damaged) is not None
    else:
        with pytest.raises(WireError, match=f"lacks the key {path[-1]!r}"):
            loads(damaged)
