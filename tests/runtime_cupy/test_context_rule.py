"""One rule for a prompt against a context, everywhere: a run of a ``P``-token prompt and
``max_tokens`` ``M`` needs ``P + M - 1`` positions (``runplan.config.run_positions``: the
last token generated is never fed back). The planner, the runs' state machines and the
server applied it, while ``generate`` and offline batches asked for ``P + M`` and
refused a run the server took."""

from __future__ import annotations

import pytest

from runplan import model_facts_from_gguf
from runplan.config import run_positions
from runtime_core.runs import PlanRejected, facts_for_run
from runtime_cupy.batch import BatchError, check_prompts
from runtime_sim.api import generate


def test_run_positions_counts_the_prompt_and_every_token_but_the_last() -> None:
    assert run_positions(5, 1) == 5  # one token generated: only the prompt is fed
    assert run_positions(5, 4) == 8
    assert run_positions(0, 4) == 4  # a prompt of unknown length has at least 1 token


def test_generate_and_batches_take_a_run_that_just_fills_the_context(tiny: str) -> None:
    context = model_facts_from_gguf(tiny).context_length
    prompt = [3] * (context - 3)  # with 4 tokens: context - 3 + 4 - 1 = context positions
    assert facts_for_run(tiny, prompt_len=len(prompt), max_tokens=4).max_seq_len == context
    check_prompts([prompt], 4, model_facts_from_gguf(tiny))
    result = generate(tiny, prompt, max_tokens=4)  # the cache of `context` positions holds it
    assert len(result.tokens) == 4


def test_one_position_more_is_refused_by_each(tiny: str) -> None:
    context = model_facts_from_gguf(tiny).context_length
    prompt = [3] * (context - 2)
    with pytest.raises(PlanRejected, match=rf"need {context + 1} positions") as refused:
        facts_for_run(tiny, prompt_len=len(prompt), max_tokens=4)
    assert refused.value.rejection.code == "invalid_config"
    with pytest.raises(BatchError, match=rf"needs {context + 1} positions") as info:
        check_prompts([[1], prompt], 4, model_facts_from_gguf(tiny))
    assert info.value.index == 1
