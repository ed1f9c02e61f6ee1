"""A stage's wait on a full outbound ring in the simulator (``Timeouts.edge_wait_ms``,
one wait on a ring, as the process runtime bounds it): a batch's outputs that go out a
few at a time, each within the bound but all of them past it, are so many waits and
fault nothing; a ring that takes no record for the whole bound is a fault of the
chain."""

from __future__ import annotations

from runplan import Timeouts
from runplan.messages import FaultKind as RunFaultKind
from runtime_sim.chain_checker import check
from runtime_sim.chain_driver import ChainResult
from runtime_sim.faults import Fault, FaultKind
from runtime_sim.timing import LinkProfile, NodeProfile, TimingModel
from tests.support.slow_chain import slow_chain

#: A ring may refuse records for 150 ms; every other bound is loose.
TIMEOUTS = Timeouts(ready_ms=5_000, step_ms=1_000, step_row_ms=10, edge_wait_ms=150, stop_ms=500)
#: Slow links: a record takes 50 ms a hop, and its slot is free for the producer 50 ms
#: after the consumer took it (about 100 ms a wait); slow batches (300 ms), during which
#: the next records of several runs arrive and share the next batch.
SLOW_LINKS = TimingModel(
    node=NodeProfile(step_overhead_us=300_000), link=LinkProfile(latency_us=50_000)
)


def longest_output_wait_us(result: ChainResult, node_id: str) -> int:
    """The longest time from the end of a batch of ``node_id`` to its last output out."""
    longest, ended, last = 0, None, None
    for time_us, actor, kind, what, *_ in result.trace.entries:
        if actor != node_id:
            continue
        if (kind, what) == ("sim", "batch_end"):
            ended, last = time_us, None
        elif (kind, what) == ("ring", "publish") and ended is not None:
            last = time_us
            longest = max(longest, last - ended)
    return longest


def test_outputs_going_out_a_few_at_a_time_past_the_bound_fault_nothing() -> None:
    for slots in (1, 2):
        result, sim = slow_chain(
            8, timeouts=TIMEOUTS, timing=SLOW_LINKS, stages=2, max_batch_rows=8, slot_count=slots
        )
        assert [r.outcome for r in result.runs] == ["completed"] * 8, slots
        assert check(sim, result) == []
        # a batch's outputs took longer than one wait's bound to go out
        assert longest_output_wait_us(result, "node-0") > TIMEOUTS.edge_wait_ms * 1000


def test_a_ring_that_takes_no_record_for_the_bound_faults_the_chain() -> None:
    # Hop 1's record of sequence 1 stalls in flight far past every timeout: its slot
    # is never free, and stage 0's next outputs wait on the one-slot ring for good.
    stall = (Fault(FaultKind.EDGE_STALL, stage=1, sequence=1),)
    result, sim = slow_chain(
        4,
        timeouts=TIMEOUTS,
        timing=SLOW_LINKS,
        stages=2,
        max_batch_rows=8,
        slot_count=1,
        faults=stall,
    )
    for run in result.runs:
        assert run.finished is not None, run
        fault = run.finished.fault
        assert fault is not None and fault.kind is RunFaultKind.EDGE_FAULT, fault
        assert fault.detail == "outbound link (hop 1): no free slot within 150 ms"
        assert run.finished.fault_stage == 0
    assert check(sim, result) == []
