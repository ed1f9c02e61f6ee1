"""The batch policy of a chain's stage (``runtime_core.batching``): at most one record
per run and ``max_batch_rows`` rows a batch; decodes first in load order, then prefill
records that fit; a prefill record left out goes first in the next batch, so neither a
decode nor a prefill record waits for good."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtime_core.batching import BatchScheduler, Candidate


def decode(run: str, loaded: int) -> Candidate:
    return Candidate(run, loaded, 1, prefill=False)


def prefill(run: str, loaded: int, rows: int) -> Candidate:
    return Candidate(run, loaded, rows, prefill=True)


def runs(batch: tuple[Candidate, ...]) -> list[str]:
    return [c.run_id for c in batch]


def test_decodes_come_first_in_load_order_then_prefills_that_fit() -> None:
    s = BatchScheduler(6)
    batch = s.choose([prefill("q", 2, 2), decode("b", 3), decode("a", 1), prefill("p", 0, 4)])
    assert runs(batch) == ["a", "b", "p"]  # q (2 rows, loaded after p) does not fit
    assert s.owed == "q"
    # q was passed over: it goes first now, before the decodes that arrived meanwhile.
    batch = s.choose([prefill("q", 2, 2), decode("a", 7), decode("b", 8), decode("c", 9)])
    assert runs(batch) == ["q", "a", "b", "c"] and s.owed is None


def test_a_long_prefill_never_starves_decodes_nor_is_starved() -> None:
    """Prefill chunks of a whole batch's rows alternate with the decodes."""
    s = BatchScheduler(4)
    kinds = []
    for t in range(6):
        batch = s.choose([prefill("long", t, 4), decode("a", 100 + t), decode("b", 200 + t)])
        kinds.append(runs(batch))
    assert kinds == [["a", "b"], ["long"]] * 3


def test_a_queue_of_prompts_whose_chunks_fill_a_batch_does_not_hold_a_decode() -> None:
    """Three prompts of two whole-batch chunks each beside a decode: the decode waits
    behind one chunk at most (it waited behind all six: each owed chunk led a batch of
    its own, and the next owed one was taken from the others left out)."""
    s = BatchScheduler(8)
    chunks = {r: 2 for r in "ABC"}
    loaded = {r: i for i, r in enumerate("ABC")}
    order, t = [], 10
    while any(chunks.values()):
        t += 1
        offered = [decode("d", t)] + [prefill(r, loaded[r], 8) for r in "ABC" if chunks[r]]
        batch = s.choose(offered)
        order.append(runs(batch))
        for c in batch:
            if c.prefill:
                chunks[c.run_id] -= 1
                loaded[c.run_id] = t
    assert all("d" in a or "d" in b for a, b in itertools.pairwise(order)), order
    assert sum(r != ["d"] for r in order) == 6  # every chunk ran


def test_a_candidate_of_more_rows_than_a_batch_is_never_chosen() -> None:
    s = BatchScheduler(3)
    assert s.choose([prefill("big", 0, 4)]) == ()
    with pytest.raises(ValueError, match="one candidate per run"):
        s.choose([decode("a", 0), decode("a", 1)])
    with pytest.raises(ValueError, match="at least 1"):
        BatchScheduler(0)


def test_a_run_that_is_gone_is_owed_nothing() -> None:
    s = BatchScheduler(2)
    s.choose([decode("a", 0), decode("b", 1), prefill("p", 2, 2)])
    assert s.owed == "p"
    s.forget("p")
    assert s.owed is None


candidates = st.lists(
    st.builds(
        Candidate,
        st.sampled_from("abcdefgh"),
        st.integers(0, 1000),
        st.integers(1, 8),
        st.booleans(),
    ).map(lambda c: Candidate(c.run_id, c.loaded, c.rows if c.prefill else 1, c.prefill)),
    unique_by=lambda c: c.run_id,
    max_size=8,
)


@given(st.integers(1, 8), st.lists(candidates, min_size=1, max_size=6))
def test_every_batch_holds_one_record_per_run_within_max_batch_rows(
    max_rows: int, rounds: list[list[Candidate]]
) -> None:
    s = BatchScheduler(max_rows)
    for offered in rounds:
        batch = s.choose(offered)
        assert len({c.run_id for c in batch}) == len(batch)
        assert sum(c.rows for c in batch) <= max_rows
        assert set(batch) <= set(offered)
        fitting = [c for c in offered if c.rows <= max_rows]
        assert bool(batch) == bool(fitting)  # never idle while something can run
        decodes = [c.loaded for c in batch if not c.prefill]
        assert decodes == sorted(decodes)  # first loaded, first served


@given(
    st.integers(1, 8),
    st.lists(st.lists(st.tuples(st.sampled_from("pqrs"), st.integers(1, 8)), max_size=4)),
)
def test_a_decode_offered_every_batch_never_misses_two_in_a_row(
    max_rows: int, prefills: list[list[tuple[str, int]]]
) -> None:
    s = BatchScheduler(max_rows)
    missed = 0
    for t, offered in enumerate(prefills):
        chunks = {run: prefill(run, t, min(rows, max_rows)) for run, rows in offered}
        batch = s.choose([decode("d", 1000 + t), *chunks.values()])
        missed = 0 if "d" in runs(batch) else missed + 1
        assert missed < 2


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.lists(st.tuples(st.sampled_from("pqrs"), st.integers(1, 8)), max_size=4),
        ),
        max_size=12,
    ),
)
@example(4, 4, [(1, [("p", 4)])] * 6)  # the oldest prompt left out must be the one owed
def test_a_prefill_offered_every_batch_never_misses_four_in_a_row(
    max_rows: int, rows: int, offers: list[tuple[int, list[tuple[str, int]]]]
) -> None:
    """The prompt "o" beside decodes and newer prompts waits three batches at most: a
    prompt owed before it may go first (on the decodes' turn, then leading a batch),
    and then "o" is owed, and may wait the decodes' turn before it leads. Its record
    stays the one loaded first until it is chosen; the next chunk is loaded then."""
    s = BatchScheduler(max_rows)
    mine = prefill("o", 0, min(rows, max_rows))
    missed = 0
    for t, (decodes, offered) in enumerate(offers, start=1):
        others = {run: prefill(run, t, min(n, max_rows)) for run, n in offered}
        ds = [decode(f"d{i}", 1000 + 10 * t + i) for i in range(decodes)]
        batch = s.choose([*ds, mine, *others.values()])
        if "o" in runs(batch):
            missed = 0
            mine = prefill("o", t, mine.rows)  # its next chunk, loaded now
        else:
            missed += 1
        assert missed < 4
