"""The timing model: the simulator's virtual clock follows it, and it behaves like a
model of a pipeline should."""

from __future__ import annotations

import pytest

from runplan import Timeouts
from runtime_sim.chain_driver import ChainSimulation, RunSpec
from runtime_sim.scenarios import synthetic_facts
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import LinkProfile, NodeProfile, StageCost, TimingModel, stored_stage_costs
from tests.support.synthetic_plans import synthetic_plan


@pytest.mark.parametrize(("layers", "stages", "prompt"), [(8, 1, 4), (32, 4, 16), (80, 16, 64)])
def test_a_fault_free_simulation_runs_at_the_predicted_pace(
    layers: int, stages: int, prompt: int
) -> None:
    facts = synthetic_facts(layers, 8192, 128_256, 400 * 2**20, prompt + 40)
    plan = synthetic_plan(facts, stages, max_tokens=32, timeouts=Timeouts())
    costs = stored_stage_costs(plan, facts.block_bytes, facts.output_bytes)
    workers = [SyntheticWorker(facts.vocab_size, facts.eos_token_id) for _ in range(stages)]
    sim = ChainSimulation([RunSpec(plan, tuple(range(1, prompt + 1)))], workers, costs)
    (result,) = sim.run().runs
    assert result.finished is not None and result.finished.outcome.value == "COMPLETED"
    predicted = sim.settings.timing.predict(plan, costs, prompt)
    times = result.token_times_us
    tpot = (times[-1] - times[0]) / (len(times) - 1)
    assert tpot == pytest.approx(predicted.tpot_us, rel=0.01)
    assert result.ready_us is not None
    assert times[0] - result.ready_us == pytest.approx(predicted.ttft_us, rel=0.01)


def test_decode_is_bound_by_reading_weights_and_prefill_by_compute() -> None:
    model = TimingModel(
        NodeProfile(read_bytes_per_s=1e9, flops_per_s=1e12, step_overhead_us=0),
        LinkProfile(latency_us=0, bytes_per_s=1e12),
    )
    cost = StageCost(read_bytes=10**9, elements=10**9, load_bytes=10**9)
    assert model.step_us(cost, 1) == pytest.approx(1e6)  # 1 GB at 1 GB/s
    assert model.step_us(cost, 1000) == pytest.approx(2e6)  # 2e12 flops at 1e12/s
    assert model.hop_us(10**12) == pytest.approx(1e6)


def test_more_stages_add_hops_but_not_weight_reads() -> None:
    facts = synthetic_facts(32, 4096, 32_000, 100 * 2**20, 64)
    model = TimingModel()
    one = synthetic_plan(facts, 1, max_tokens=4)
    four = synthetic_plan(facts, 4, max_tokens=4)
    p1 = model.predict(one, stored_stage_costs(one, facts.block_bytes, facts.output_bytes), 8)
    p4 = model.predict(four, stored_stage_costs(four, facts.block_bytes, facts.output_bytes), 8)
    hops = 3 * model.hop_us(4096 * 2) + 3 * model.node.step_overhead_us
    assert p4.tpot_us == pytest.approx(p1.tpot_us + hops, rel=1e-6)
    assert p4.load_us < p1.load_us  # each stage loads a quarter
