"""The dtype of a run's activations between stages, which the process runtime plans
(``runtime_cupy.workers.activation_dtype``, for ``generate``'s plans and a warm chain's):
float32 on the CPU workers; 2 bytes on the CUDA worker, bfloat16 for the models whose
hidden states pass float16's 65504 (gemma2, gemma3), float16 for the others."""

from __future__ import annotations

import types
from pathlib import Path

import attrs
import pytest

from runplan import DTypeFamily, SamplingConfig, model_facts_from_gguf
from runplan.config import Timeouts
from runtime_cupy import api
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES
from runtime_cupy.hosts import this_machine
from runtime_cupy.serve.chain_plans import ChainPlans
from runtime_cupy.workers import BFLOAT16_EDGE_ARCHITECTURES, activation_dtype
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model

FLOAT, BFLOAT = DTypeFamily.FLOAT, DTypeFamily.BFLOAT


@pytest.mark.parametrize(
    ("worker", "arch", "dtype"),
    [
        ("cpu", "gemma3", (FLOAT, 4)),
        ("numpy", "gemma2", (FLOAT, 4)),
        ("cpu", "llama", (FLOAT, 4)),
        ("cuda", "llama", (FLOAT, 2)),
        ("cuda", "gemma", (FLOAT, 2)),
        ("cuda", "gemma2", (BFLOAT, 2)),
        ("cuda", "gemma3", (BFLOAT, 2)),
    ],
)
def test_the_workers_and_models_activation_dtype(
    worker: str, arch: str, dtype: tuple[DTypeFamily, int]
) -> None:
    assert activation_dtype(worker, arch) == dtype
    assert (dtype[0] is BFLOAT) == (worker == "cuda" and arch in BFLOAT16_EDGE_ARCHITECTURES)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("edge-dtype")
    return {
        "gemma3": write_model(folder / "gemma3.gguf", attrs.evolve(FIXTURE_SHAPES["gemma3"])),
        "llama": write_model(folder / "llama.gguf", ModelShape(n_layers=2)),
    }


@pytest.mark.parametrize(("arch", "family"), [("gemma3", BFLOAT), ("llama", FLOAT)])
def test_a_cuda_runs_plan_carries_a_gemma3_as_bfloat16(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str, family: DTypeFamily
) -> None:
    """``generate``'s plan (two GPUs stood in for) and a warm chain's runs' plans."""
    monkeypatch.setattr(this_machine, "gpu_memory_bytes", lambda: {0: 2**34, 1: 2**34})
    monkeypatch.setattr(api, "capabilities", lambda worker, kv: CUDA_CAPABILITIES)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = str(models[arch])
    plan, devices = api.plan_for(
        path,
        stages=2,
        prompt_len=4,
        max_tokens=4,
        sampling=SamplingConfig(),
        return_logits=False,
        worker="cuda",
    )
    assert devices == (0, 1)
    assert (plan.model.dtype_family, plan.model.dtype_width_bytes) == (family, 2)
    chain = types.SimpleNamespace(
        facts=model_facts_from_gguf(path),
        worker="cuda",
        capabilities=CUDA_CAPABILITIES,
        timeouts=Timeouts(),
        max_concurrent=1,
        kv_budget_bytes=0,
        prefill_chunk=0,
        logprobs=False,
    )
    config = ChainPlans._config(chain, "run-1", 4, SamplingConfig(), 4)  # type: ignore[arg-type]
    assert config.activation_dtype_family is family
    assert config.activation_dtype_width_bytes == 2
