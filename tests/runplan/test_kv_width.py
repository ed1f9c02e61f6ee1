"""The KV cache's element width in a plan (``GgufModelPlan.kv_dtype_width_bytes``) and
each stage's provision (``StageModelFacts.kv_dtype_width_bytes``): the width the planner
counted the caches at (the worker's ``kv_bytes_per_element``, else the activations'),
which each stage's worker then holds them in. A plan or provision written without the
field reads the activations' width, as it was counted then; the checker refuses a width
no cache has."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from runplan import (
    NodePool,
    NodeSpec,
    Placement,
    RuntimeConfig,
    WorkerCapabilities,
    model_facts_from_gguf,
    plan_run,
    wire,
)
from runplan.check import check_plan
from runplan.contract import ContractReport, check_contract
from runplan.contract.subject import PlanInputs
from runplan.provision import provision_all
from runplan.rejections import InvalidConfig, InvalidDtypeWidth
from runplan.validate import check_worker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import plan_for

CPU_LIKE = WorkerCapabilities(name="cpu-like", weight_bytes_per_element=0, kv_bytes_per_element=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("kv-width") / "m.gguf", ModelShape(n_layers=4))


@pytest.mark.parametrize(
    ("dtype", "kv_bytes", "width"),
    [("f32", 0, 4), ("f16", 0, 2), ("bf16", 0, 2), ("f32", 2, 2), ("f16", 4, 4), ("f32", 4, 4)],
)
def test_the_plan_carries_the_width_it_counted_the_caches_at(
    model: Path, dtype: str, kv_bytes: int, width: int
) -> None:
    worker = attrs.evolve(CPU_LIKE, kv_bytes_per_element=kv_bytes)
    plan = plan_for(model, 2, dtype=dtype, worker=worker, max_concurrent_runs=2)
    assert plan.model.kv_dtype_width_bytes == width
    assert all(p.model.kv_dtype_width_bytes == width for p in provision_all(plan))
    assert check_plan(plan) == plan
    # the caches counted at that width: half the bytes of float32's at 2
    f32 = plan_for(model, 2, dtype="f32", worker=CPU_LIKE, max_concurrent_runs=2)
    for ours, wide in zip(plan.stages, f32.stages, strict=True):
        assert ours.kv_bytes * 4 == wide.kv_bytes * width
        assert ours.kv_budget_bytes * 4 == wide.kv_budget_bytes * width


def test_a_plan_and_provisions_written_without_it_read_the_activations_width(
    model: Path,
) -> None:
    for dtype, width in (("f32", 4), ("f16", 2)):
        worker = attrs.evolve(CPU_LIKE, kv_bytes_per_element=2 if width == 4 else 4)
        plan = plan_for(model, 2, dtype=dtype, worker=worker)
        assert plan.model.kv_dtype_width_bytes != width  # what the field said
        for message in (plan, *provision_all(plan)):
            doc = json.loads(wire.dumps(message))
            facts = doc["model"]
            del facts["kv_dtype_width_bytes"]
            old = wire.loads(json.dumps(doc).encode())
            assert old.model.kv_dtype_width_bytes == width


@pytest.mark.parametrize("width", [0, 1, 3, 8])
def test_the_checker_refuses_a_width_no_cache_has(model: Path, width: int) -> None:
    plan = plan_for(model, 2, worker=CPU_LIKE)
    bad = attrs.evolve(plan, model=attrs.evolve(plan.model, kv_dtype_width_bytes=width))
    rejection = check_plan(bad)
    assert isinstance(rejection, InvalidDtypeWidth), rejection
    assert "model kv dtype" in str(rejection) and str(width) in str(rejection)


@pytest.mark.parametrize("kv_bytes", [1, 3, 8, -2])
def test_the_planner_refuses_a_worker_whose_kv_element_no_cache_has(
    model: Path, kv_bytes: int
) -> None:
    worker = attrs.evolve(CPU_LIKE, kv_bytes_per_element=kv_bytes)
    rejection = check_worker(model_facts_from_gguf(model), worker)
    assert isinstance(rejection, InvalidConfig), rejection
    assert (rejection.field, rejection.value) == ("worker.kv_bytes_per_element", str(kv_bytes))
    assert f"a KV element of {kv_bytes} bytes" in str(rejection)
    with pytest.raises(AssertionError, match=f"a KV element of {kv_bytes} bytes"):
        plan_for(model, 2, worker=worker)  # the planner's rejection


CLAUSE = "invalid_extent_alignment_dtype_width_or_layout_rejects"


def _problems(report: ContractReport, clause: str) -> tuple[str, ...]:
    return next(v.problems for v in report.verdicts if v.clause.name == clause)


def test_the_contract_finds_a_width_no_cache_has_and_one_its_inputs_did_not_count(
    model: Path,
) -> None:
    facts = model_facts_from_gguf(model, max_seq_len=64)
    config = RuntimeConfig(run_id="kv", max_tokens=8, worker=CPU_LIKE)
    pool = NodePool(orchestrator_node_id="orch", nodes=(NodeSpec("a", 2**40),))
    inputs = PlanInputs(facts, config, pool, 1, Placement.even(("a",)))
    plan = plan_run(facts, config, pool, stage_count=1, placement=Placement.even(("a",)))
    assert check_contract(plan, inputs=inputs).holds
    odd = attrs.evolve(plan, model=attrs.evolve(plan.model, kv_dtype_width_bytes=5))
    assert any("KV cache width 5" in p for p in _problems(check_contract(odd), CLAUSE))
    half = attrs.evolve(plan, model=attrs.evolve(plan.model, kv_dtype_width_bytes=2))
    assert check_plan(half) == half  # a width a cache has: only the inputs tell
    found = _problems(check_contract(half, inputs=inputs), CLAUSE)
    assert any("KV cache width is 2; the config's worker and activations count 4" in p
               for p in found), found  # fmt: skip
