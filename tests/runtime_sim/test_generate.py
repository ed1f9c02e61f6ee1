"""``runtime_sim.generate``: real text from a simulated pipeline, the same tokens in any
number of stages, and llama.cpp's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_sim import PlanRejected, generate
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.fixtures.llamacpp_fixtures import load_doc

NEAR_TIE = 0.1  # llama.cpp's top-2 logit gap below which its 8-bit activations may flip


@pytest.fixture(scope="module")
def france() -> dict:  # type: ignore[type-arg]
    (entry,) = [p for p in load_doc("smollm2")["prompts"] if p["name"] == "france"]
    return entry  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("sim") / "tiny.gguf", ModelShape(n_layers=4))


@pytest.mark.slow
def test_smollm2_through_three_stages_matches_one_stage_and_llama_cpp(
    smollm2_path: str,
    france: dict,  # type: ignore[type-arg]
) -> None:
    one = generate(smollm2_path, france["token_ids"], stages=1, max_tokens=16, return_logits=True)
    three = generate(smollm2_path, france["token_ids"], stages=3, max_tokens=16, return_logits=True)
    assert one.outcome == three.outcome == "completed"
    assert one.tokens == three.tokens and len(one.tokens) == 16
    assert one.logits is not None and three.logits is not None
    for a, b in zip(one.logits, three.logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # llama.cpp's greedy tokens, up to its first near-tie.
    gaps = france["gaps"]
    agree = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
    assert agree >= 5
    assert list(one.tokens[:agree]) == france["greedy"][:agree]
    assert one.text.startswith(" Paris.")


def test_streamed_tokens_are_the_result(tiny: Path) -> None:
    seen: list[int] = []
    result = generate(tiny, [1, 2, 3], stages=2, max_tokens=6, on_token=seen.append)
    assert seen == list(result.tokens)
    assert len(result.plan.stages) == 2


def test_the_same_seed_samples_the_same_tokens(tiny: Path) -> None:
    kwargs = {"stages": 2, "max_tokens": 8, "temperature": 1.5, "top_k": 40}
    a = generate(tiny, [5, 6], seed=7, **kwargs)  # type: ignore[arg-type]
    b = generate(tiny, [5, 6], seed=7, **kwargs)  # type: ignore[arg-type]
    others = {generate(tiny, [5, 6], seed=s, **kwargs).tokens for s in range(8, 12)}  # type: ignore[arg-type]
    assert a.tokens == b.tokens
    assert others - {a.tokens}  # other seeds sample something else


def test_logits_are_raw_and_one_per_token(tiny: Path) -> None:
    result = generate(tiny, [1], max_tokens=4, return_logits=True)
    assert result.logits is not None and len(result.logits) == len(result.tokens)
    for token, logits in zip(result.tokens, result.logits, strict=True):
        assert logits.dtype == np.float32 and logits.shape == (result.plan.model.vocab_size,)
        assert int(np.argmax(logits)) == token  # greedy


def test_more_stages_than_layers_is_a_plan_rejection(tiny: Path) -> None:
    with pytest.raises(PlanRejected) as err:
        generate(tiny, [1], stages=5)
    assert err.value.rejection.code == "invalid_stage_count"


@pytest.mark.parametrize("stages", [0, -1, -7])
def test_fewer_than_one_stage_is_a_plan_rejection_naming_the_count(tiny: Path, stages: int) -> None:
    with pytest.raises(PlanRejected) as err:
        generate(tiny, [1], stages=stages)
    assert err.value.rejection.code == "invalid_stage_count"
    assert err.value.rejection.stage_count == stages
    assert f"stage_count {stages}:" in str(err.value)


def test_a_prompt_past_the_context_is_refused(tiny: Path) -> None:
    with pytest.raises(ValueError, match="context length"):
        generate(tiny, [1] * 250, max_tokens=10)


@pytest.mark.parametrize("bad", [True, False, 1.0, "1"])
def test_a_prompt_token_that_is_no_token_id_is_refused_naming_it(tiny: Path, bad: object) -> None:
    """``True`` and ``False`` once ran as tokens 1 and 0 (``operator.index`` takes bools)."""
    from runtime_sim.api import generate_runs

    for run in (generate, lambda *a, **k: generate_runs(*a, runs=2, **k)):
        with pytest.raises(TypeError) as info:
            run(tiny, [5, bad], max_tokens=2)
        assert str(info.value) == f"prompt token 1 is {bad!r}, not a token id"


@pytest.mark.parametrize("worker", ["numpy", "cpu"])
def test_sampled_runs_through_one_chain_each_sample_as_they_would_alone(
    tiny: Path, worker: str
) -> None:
    from runtime_sim.api import generate_runs

    prompt = [1, 2, 3, 4, 5]
    options = {"stages": 2, "max_tokens": 6, "temperature": 0.8, "worker": worker}
    many = generate_runs(tiny, prompt, runs=3, seed=5, **options)  # type: ignore[arg-type]
    assert [r.outcome for r in many.runs] == ["completed"] * 3
    for i, run in enumerate(many.runs):  # run i samples with seed 5 + i
        alone = generate(tiny, prompt, seed=5 + i, **options)  # type: ignore[arg-type]
        assert run.tokens == alone.tokens and len(run.tokens) == 6
    assert len({r.tokens for r in many.runs}) > 1  # the seeds differ, and so do the runs


@pytest.mark.parametrize("max_tokens", [np.int64(2), 2.0, True])
def test_a_max_tokens_that_is_no_int_is_refused_naming_it(tiny: Path, max_tokens: object) -> None:
    """``np.int64(2)`` was refused naming ``max_seq_len``, which the caller never gave."""
    with pytest.raises(TypeError, match=r"^max_tokens must be an int, not "):
        generate(tiny, [1], max_tokens=max_tokens)  # type: ignore[arg-type]


def test_run_seeds_wrap_past_the_last_seed(tiny: Path) -> None:
    """Run ``i`` samples with ``seed + i`` modulo 2**64: a seed of 2**64 - 1 once made
    run 1's 2**64, which the planner refused; a seed out of range is still refused."""
    from runtime_sim.api import generate_runs

    options = {"max_tokens": 4, "temperature": 0.9}
    top = 2**64 - 1
    many = generate_runs(tiny, [1, 2], runs=2, seed=top, **options)  # type: ignore[arg-type]
    assert [r.outcome for r in many.runs] == ["completed"] * 2
    for run, seed in zip(many.runs, (top, 0), strict=True):
        assert run.tokens == generate(tiny, [1, 2], seed=seed, **options).tokens  # type: ignore[arg-type]
    for bad in (-1, 2**64):
        with pytest.raises(PlanRejected, match=rf"sampling.seed = {bad}:"):
            generate_runs(tiny, [1, 2], runs=2, seed=bad, **options)  # type: ignore[arg-type]


def test_each_run_of_several_is_reported_as_it_ends(tiny: Path) -> None:
    """``on_run_end(i, result)``: once for each run, its result then the one returned
    at the end (what a Ctrl-C after it leaves the caller)."""
    from runtime_sim.api import GenerateResult, generate_runs

    ended: list[tuple[int, GenerateResult]] = []
    many = generate_runs(
        tiny, [1, 2, 3], runs=3, stages=2, max_tokens=4, temperature=0.8,
        on_run_end=lambda i, r: ended.append((i, r)),
    )  # fmt: skip
    assert sorted(i for i, _ in ended) == [0, 1, 2]
    for i, result in ended:
        final = many.runs[i]
        assert (result.tokens, result.text, result.outcome) == (
            final.tokens, final.text, final.outcome
        )  # fmt: skip
        assert result.outcome == "completed" and result.tokens


def test_several_runs_show_their_stages_load_as_one_run_does(tiny: Path) -> None:
    """``runtime_sim run --runs N`` showed nothing until its runs ended: ``generate_runs``
    took no ``on_load``. Each stage's load is seen, to its end, as ``generate`` sees it."""
    from runtime_sim.api import generate_runs

    def loads(call: Any) -> dict[int, tuple[int, int]]:
        seen: dict[int, tuple[int, int]] = {}
        call(on_load=lambda stage, done, total: seen.__setitem__(stage, (done, total)))
        return seen

    many = loads(lambda **kw: generate_runs(tiny, [1, 2], runs=2, stages=2, max_tokens=2, **kw))
    one = loads(lambda **kw: generate(tiny, [1, 2], stages=2, max_tokens=2, **kw))
    assert many == one and sorted(many) == [0, 1]
    assert all(done == total > 0 for done, total in many.values())
