"""A warm chain's arguments refused at the call, typed and naming the argument
(``serve.chain.WarmChain``): before, ``stages=-2`` was named "stage_count 0",
``stages=True`` ran one stage, ``context='64'`` and ``max_concurrent='2'`` gave "'<' not
supported", ``prefill_chunk=2.5`` and ``kv_budget_bytes=3e7`` an attrs ``TypeError`` from
inside ``RuntimeConfig`` (the latter naming ``max_concurrent_runs``), ``spares=[1]`` an
``AttributeError``, ``on_token=5`` started its run (its
first token cancelled it), ``on_run=5`` raised only once its run was submitted, and a
prompt token ``True`` ran as token 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime_cupy.serve.chain import WarmChain

PROMPT = [5, 77, 30, 12, 9]


@pytest.mark.parametrize(
    ("argument", "error", "message"),
    [
        ({"stages": -2}, ValueError, "stages -2 is not at least 1"),
        ({"stages": 0}, ValueError, "stages 0 is not at least 1"),
        ({"stages": True}, TypeError, "stages must be an integer, not True"),
        ({"stages": 2.0}, TypeError, "stages must be an integer, not 2.0"),
        ({"context": "64"}, TypeError, "context must be an integer, not '64'"),
        ({"max_concurrent": "2"}, TypeError, "max_concurrent must be an integer, not '2'"),
        ({"max_concurrent": 0}, ValueError, "max_concurrent 0 is not at least 1"),
        ({"spares": [1]}, TypeError, "spares holds 1, not a NodeSpec"),
        ({"prefill_chunk": 2.5}, TypeError, "prefill_chunk must be an integer, not 2.5"),
        ({"prefill_chunk": "16"}, TypeError, "prefill_chunk must be an integer, not '16'"),
        ({"kv_budget_bytes": 3e7}, TypeError, "kv_budget_bytes must be an integer, not 30000000.0"),
        ({"kv_budget_bytes": 0}, ValueError, "kv_budget_bytes 0 is not at least 1"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(
    tiny: str, argument: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        WarmChain(tiny, **{"stages": 2, **argument})
    assert str(info.value) == message


@pytest.fixture(scope="module")
def chain(tiny: str) -> Iterator[WarmChain]:
    with WarmChain(tiny, stages=1, context=32) as c:
        yield c


@pytest.mark.process
@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"on_token": 5}, "on_token must be callable or None, not 5"),
        ({"on_run": 5}, "on_run must be callable or None, not 5"),
        ({"on_logits": "x"}, "on_logits must be callable or None, not 'x'"),
    ],
)
def test_a_callback_that_cannot_be_called_is_refused_before_its_run(
    chain: WarmChain, argument: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError) as info:
        chain.generate(PROMPT, max_tokens=2, **argument)
    assert str(info.value) == message
    assert chain.in_flight == 0


@pytest.mark.process
def test_a_prompt_token_that_is_a_bool_is_refused(chain: WarmChain) -> None:
    with pytest.raises(TypeError) as info:
        chain.generate([5, True, 3], max_tokens=2)
    assert str(info.value) == "prompt token 1 is True, not a token id"
    assert chain.in_flight == 0
