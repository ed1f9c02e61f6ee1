"""``serve.logprobs.token_logprob`` against a log-softmax computed apart
(``np.logaddexp.reduce`` in float64) and a full sort: the token's log probability, the
``top`` most likely tokens in order, the lower id first on a tie, ties at the cut
included by id; more alternatives asked than the vocabulary holds gives them all."""

from __future__ import annotations

import numpy as np
import pytest

from runtime_cupy.serve.logprobs import token_logprob


def _expected(z: np.ndarray, top: int) -> list[tuple[int, float]]:
    lp = z.astype(np.float64) - np.logaddexp.reduce(z.astype(np.float64))
    order = sorted(range(z.size), key=lambda i: (-float(z[i]), i))[:top]
    return [(i, float(lp[i])) for i in order]


@pytest.mark.parametrize("size", [1, 3, 20, 1000, 49152])
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_the_token_and_its_alternatives_are_the_log_softmax_in_order(size: int, top: int) -> None:
    rng = np.random.default_rng(size * 31 + top)
    z = (rng.standard_normal(size) * 4).astype(np.float32)
    token = int(rng.integers(size))
    got = token_logprob(z, token, top)
    want = _expected(z, size)
    assert got.token_id == token
    assert got.logprob == pytest.approx(dict(want)[token], abs=1e-9)
    assert [i for i, _ in got.top] == [i for i, _ in want[:top]]
    assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want[:top]], abs=1e-9)


def test_ties_go_to_the_lower_ids_at_the_cut_and_within() -> None:
    z = np.zeros(12, np.float32)
    z[[9, 2, 5, 11]] = 3.0  # four equal best, two of them kept
    z[7] = 5.0
    got = token_logprob(z, 11, 3)
    assert [i for i, _ in got.top] == [7, 2, 5]
    assert got.top[1][1] == got.top[2][1] == got.logprob
