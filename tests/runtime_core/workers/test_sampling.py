"""Sampling in the last stage: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runplan import SamplingConfig
from runtime_core.ieee_math import exp64
from runtime_core.workers import device_sampling
from runtime_core.workers.sampling import Sampler
from tests.support.strategies import logits_vectors, sampling_configs


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def nucleus(logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """Every token that top-k then top-p may keep: ties at a boundary on either side,
    and top-p read generously (a superset of what the sampler keeps)."""
    order = sorted(range(logits.size), key=lambda i: (-logits[i], i))
    if 0 < top_k < logits.size:
        kth = logits[order[top_k - 1]]
        order = [i for i in order if logits[i] >= kth]
    probs = softmax(logits[order])
    cum = np.cumsum(probs)
    n = int(np.searchsorted(cum, top_p + 1e-9)) + 1
    last = logits[order[min(n, len(order)) - 1]]
    return {i for i in order if logits[i] >= last}


@given(logits=logits_vectors(), config=sampling_configs)
def test_greedy_takes_the_first_largest_logit(logits: np.ndarray, config: SamplingConfig) -> None:
    greedy = attrs.evolve(config, temperature=0.0)
    assert Sampler(greedy).sample(logits) == int(np.flatnonzero(logits == logits.max())[0])
    top1 = attrs.evolve(config, top_k=1)  # one candidate: any temperature is greedy
    assert Sampler(top1).sample(logits) == int(np.argmax(logits))


@given(logits=logits_vectors(), config=sampling_configs)
def test_a_sampled_token_is_one_top_k_and_top_p_keep(
    logits: np.ndarray, config: SamplingConfig
) -> None:
    sampler = Sampler(config)
    for _ in range(5):
        token = sampler.sample(logits)
        assert 0 <= token < logits.size
        if config.temperature > 0:
            assert token in nucleus(logits, config.top_k, config.top_p)


@given(logits=logits_vectors(), config=sampling_configs)
def test_the_same_seed_and_logits_sample_the_same_tokens(
    logits: np.ndarray, config: SamplingConfig
) -> None:
    a, b = Sampler(config), Sampler(config)
    assert [a.sample(logits) for _ in range(10)] == [b.sample(logits) for _ in range(10)]


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_a_temperature_so_small_the_logits_over_it_overflow_takes_the_largest(
    temperature: float,
) -> None:
    """The limit of a temperature going to 0 is greedy. Before, the logits over 1e-308
    overflowed to infinity, the softmax's inf - inf was NaN and the draw landed on the
    last candidate: the least likely token, every time (a request's 1e-308 passes the
    server's checks)."""
    logits = np.array([1.0, 5.0, 3.0, -2.0, 5.0], dtype=np.float32)
    config = SamplingConfig(temperature=temperature, seed=7)
    sampler = Sampler(config)
    assert [sampler.sample(logits) for _ in range(4)] == [1] * 4
    assert sampler.draws == 4  # a draw a token, as at any temperature: streams stay aligned
    assert device_sampling.sample(np, logits, config, 0.999) == 1
    assert device_sampling.sample(np, logits[::-1].copy(), config, 0.0) == 0  # ties: low id


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax_of_logits_over_temperature(temperature: float) -> None:
    # Every expected count is at least 80, as a chi-square test needs.
    logits = np.array([1.5, 1.0, 0.5, 0.0, -0.5, -1.0], dtype=np.float32)
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=1234))
    n = 20_000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=logits.size)
    expected = softmax(logits / temperature) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_top_p_draws_only_from_the_nucleus_in_proportion() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.8, seed=7))
    n = 20_000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=4)
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 reaches 0.8
    assert abs(counts[0] / n - 0.625) < 0.02  # 0.5 / 0.8


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=-1.0),
        SamplingConfig(temperature=float("nan")),
        SamplingConfig(top_k=-1),
        SamplingConfig(top_p=0.0),
        SamplingConfig(top_p=1.5),
    ],
)
def test_settings_no_run_can_have_are_refused(config: SamplingConfig) -> None:
    with pytest.raises(ValueError):
        Sampler(config)


@given(bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_logits_that_are_not_finite_are_refused(bad: float) -> None:
    logits = np.zeros(8, dtype=np.float32)
    logits[3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        Sampler(SamplingConfig(temperature=1.0)).sample(logits)


@given(
    st.lists(logits_vectors(max_size=32), min_size=2, max_size=8),
    sampling_configs,
    st.integers(0, 8),
)
def test_a_sampler_made_with_k_draws_continues_where_one_that_drew_k_would(
    steps: list[np.ndarray], config: SamplingConfig, k: int
) -> None:
    """Issue 25 replays an interrupted run from its token k: ``Sampler(config, draws)``
    with the draws counted so far samples the tokens the uninterrupted sampler samples."""
    whole = Sampler(config)
    tokens = [whole.sample(logits) for logits in steps]
    k = min(k, len(steps))
    head = Sampler(config)
    for logits in steps[:k]:
        head.sample(logits)
    assert head.draws == (k if config.temperature > 0.0 else 0)  # one per sampled token
    resumed = Sampler(config, draws=head.draws)
    assert [resumed.sample(logits) for logits in steps[k:]] == tokens[k:]
    assert resumed.draws == whole.draws


@pytest.mark.parametrize("draws", [-1, 1.0, True])
def test_a_draw_count_that_is_not_a_count_is_refused(draws: object) -> None:
    with pytest.raises(ValueError, match="draws"):
        Sampler(SamplingConfig(), draws=draws)  # type: ignore[arg-type]


@given(
    st.lists(logits_vectors(max_size=32), min_size=2, max_size=8),
    sampling_configs,
    st.integers(0, 8),
)
def test_a_sampler_resumed_after_k_tokens_samples_the_rest_of_the_stream(
    steps: list[np.ndarray], config: SamplingConfig, k: int
) -> None:
    """``Sampler.resumed(config, k)``: seeded sampling takes one draw per token, greedy
    none; so a run that delivered ``k`` tokens is continued by counting its tokens
    alone. ``Sampler.for_run`` resumes after ``config.tokens_delivered``."""
    whole = Sampler(config)
    tokens = [whole.sample(logits) for logits in steps]
    k = min(k, len(steps))
    resumed = Sampler.resumed(config, k)
    assert [resumed.sample(logits) for logits in steps[k:]] == tokens[k:]
    assert resumed.draws == whole.draws
    for_run = Sampler.for_run(attrs.evolve(config, tokens_delivered=k))
    assert [for_run.sample(logits) for logits in steps[k:]] == tokens[k:]


@pytest.mark.parametrize("tokens", [-1, 1.0, True])
def test_a_token_count_that_is_not_a_count_is_refused(tokens: object) -> None:
    with pytest.raises(ValueError, match="tokens_delivered"):
        Sampler.resumed(SamplingConfig(temperature=1.0), tokens)  # type: ignore[arg-type]


class _Drawn(Sampler):
    """A sampler whose next draw is ``u`` (to place draws on a boundary of its cdf)."""

    def __init__(self, config: SamplingConfig, u: float) -> None:
        super().__init__(config)
        self.u = u

    def uniform(self) -> float:
        self.draws += 1
        return self.u


def test_the_workers_sampler_picks_the_references_token_at_each_boundary_of_its_cdf() -> None:
    """``device_sampling.sample`` (the CPU worker's, and the GPU's with CuPy) picks
    ``Sampler``'s token for the same draw even where the draw lies next to a boundary
    of the cumulative probabilities, so its exponentials must be the same bits
    (``ieee_math.exp64``): NumPy's ``np.exp`` is another function on each processor
    (AVX-512's vector code differs from it in the last bit for about 1 in 9 values),
    and a draw next to a boundary then picks another token on another host. Draws
    within a few units of the last place of each boundary, on 200 random vectors: with
    ``np.exp`` 165 of the 27349 draws disagreed here (Intel Xeon with AVX-512)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        logits = rng.uniform(-5.0, 5.0, int(rng.integers(2, 64))).astype(np.float32)
        config = SamplingConfig(
            temperature=float(rng.uniform(0.1, 2.0)), top_k=int(rng.integers(0, 40)),
            top_p=float(rng.choice([1.0, rng.uniform(0.3, 1.0)])), seed=0,
        )  # fmt: skip
        order = device_sampling.descending_order(np, logits)
        k = config.top_k if 0 < config.top_k < logits.size else logits.size
        scaled = logits[order[:k]].astype(np.float64) / config.temperature
        e = exp64(scaled - scaled.max())
        cdf = np.cumsum(e / e.sum())
        for edge in cdf[:-1] / cdf[-1]:
            for u in np.linspace(edge - 4e-16, edge + 4e-16, 9):
                if 0.0 <= u < 1.0:
                    want = _Drawn(config, float(u)).sample(logits)
                    assert device_sampling.sample(np, logits, config, float(u)) == want, u


@pytest.mark.parametrize("u", [0.0, 0.25, 0.5, 0.75, 0.999])
def test_top_p_keeps_tokens_until_their_probability_reaches_it(u: float) -> None:
    """As llama.cpp: the smallest set whose cumulative probability is at least top_p.
    Logits [0, 0] are probabilities [0.5, 0.5], and top_p 0.5 keeps token 0 alone, so
    both samplers take it whatever the draw."""
    logits = np.zeros(2, np.float32)
    config = SamplingConfig(temperature=1.0, top_p=0.5, seed=0)
    assert _Drawn(config, u).sample(logits) == 0
    assert device_sampling.sample(np, logits, config, u) == 0
