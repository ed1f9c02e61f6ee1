"""The CUDA worker's program on the kernels' twins (``TwinWorker``) against the NumPy
reference worker and llama.cpp: what the CUDA worker computes, checked on a CPU.

- Interface: ``tests/runtime_core/workers/test_worker_contract.py`` runs the CUDA worker
  itself on the emulated CuPy; here, what it runs and refuses (architectures, options,
  rows and heads its kernels cannot take).
- ``matvec="f32"`` (dequantized weights times float32 activations) gives the reference
  worker's tokens and logits within 2e-4 on llama (normal rotary, GQA, untied head),
  qwen2 (NeoX rotary, Q/K/V biases, tied head), llama3 rotary factors with linear
  scaling, mixed weight types in one block (Q, K, V not fused), and IQ4_NL and IQ4_XS
  (the non-linear 4-bit types: a nibble indexes 16 signed values).
- Both modes, on llama.cpp's tiny fixtures of every type: the reference worker's
  thresholds (prompt logits cosine >= 0.99999 on F32 / F16 and >= 0.9995 otherwise,
  the same largest logit, greedy tokens up to the first near-tie, and all 16 for F32,
  F16, BF16).
- Splits: 1, 2 and 3 stages with f32 edges give identical logits; f16 edges the same
  tokens and logits cosine >= 0.9999.
- SmolLM2 (the real file: Q4_1 blocks, a tied Q8_0 embedding), 8-bit mode: the first
  three greedy tokens are llama.cpp's and the prompt logits within cosine 0.999.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runplan import (
    NodePool,
    NodeSpec,
    PlanRejection,
    RuntimeConfig,
    model_facts_from_gguf,
    plan_run,
)
from runplan.config import REFERENCE_ARCHITECTURES
from runplan.quant_types import QUANT_TYPES
from runtime_core.errors import UnsupportedModel
from runtime_core.workers.interface import TokenOutput, Worker, WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_cupy.cuda.kernels import ATTENTION_MAX_HEAD_DIM, source
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES, CudaWorker
from tests.fixtures.gguf_models import (
    FIXTURE_SHAPES,
    LATER_ARCHITECTURES,
    ModelShape,
    write_model,
)
from tests.fixtures.llamacpp_fixtures import load_doc, load_logits, model_file, runnable_by
from tests.support.chain import Chain, provisions
from tests.support.numerics import (
    common_prefix,
    cosine,
    first_near_tie,
    same_pick_up_to_a_near_tie,
)
from tests.support.random_model import RandomModel, write_random_model
from tests.support.twin_stage import TwinWorker

PROMPT = [5, 77, 300, 12, 9]
TINY = load_doc("tiny")
TINY_LOGITS = load_logits("tiny")
N_TOKENS: int = TINY["greedy_tokens"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("twin-models")


def run(path: Path, make: Any, stages: int = 1, n: int = 8, **kwargs: Any) -> list[TokenOutput]:
    if kwargs.get("dtype", "f32") != "f32":  # planned as the runtime plans the CUDA worker
        kwargs.setdefault("worker", CUDA_CAPABILITIES)
    chain = Chain.bind(provisions(path, stages, max_seq_len=64, **kwargs), make)
    try:
        return chain.generate(PROMPT, n)
    finally:
        chain.release()


# ---- the worker interface ------------------------------------------------------------------


def test_the_cuda_worker_runs_every_architecture_in_the_reference_types() -> None:
    worker: Worker = TwinWorker()
    assert worker.capabilities.name == "cuda"
    assert set(CudaWorker.capabilities.quant_types) == set(QUANT_TYPES)
    assert {"IQ4_NL", "IQ4_XS"} <= set(CudaWorker.capabilities.quant_types)
    assert len(CudaWorker.capabilities.quant_types) == 15
    assert CudaWorker.capabilities.architectures == REFERENCE_ARCHITECTURES
    assert TwinWorker.capabilities == CudaWorker.capabilities


@pytest.mark.parametrize("arch", LATER_ARCHITECTURES)
def test_the_later_architectures_are_planned_and_bound_for_the_cuda_worker(
    folder: Path, arch: str
) -> None:
    """Once refused by name, they are planned for the CUDA worker and bind."""
    path = write_model(folder / f"planned-{arch}.gguf", FIXTURE_SHAPES[arch])
    config = RuntimeConfig(run_id="r", max_tokens=1, worker=CudaWorker.capabilities)
    pool = NodePool("orch", (NodeSpec("gpu0", 2**34),))
    plan = plan_run(model_facts_from_gguf(path), config, pool, stage_count=1)
    assert not isinstance(plan, PlanRejection), plan
    provision = provisions(path, 1)[0]
    worker = TwinWorker()
    worker.configure(provision)
    worker.bind(provision.gguf_source)
    worker.release()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="matvec"):
        CudaWorker(matvec="int4")
    with pytest.raises(ValueError, match="kv_dtype"):
        CudaWorker(kv_dtype="f8")


def test_rows_the_kernels_cannot_read_are_refused_at_bind(folder: Path) -> None:
    path = write_model(folder / "h48.gguf", ModelShape(n_layers=1, hidden=48, heads=4, heads_kv=2))
    w = TwinWorker()
    w.configure(provisions(path)[0])
    with pytest.raises(WorkerError, match="rows 32 elements at a time"):
        w.bind(provisions(path)[0].gguf_source)


def test_a_head_larger_than_the_attention_kernel_takes_is_refused_at_bind(folder: Path) -> None:

    path = write_model(
        folder / "h512.gguf", ModelShape(n_layers=1, hidden=512, heads=1, heads_kv=1)
    )
    w = TwinWorker()
    w.configure(provisions(path)[0])
    with pytest.raises(WorkerError, match="head size 512") as info:
        w.bind(provisions(path)[0].gguf_source)
    assert isinstance(info.value.__cause__, UnsupportedModel)
    # 256, the largest the kernel takes, binds.
    ok = write_model(folder / "h256.gguf", ModelShape(n_layers=1, hidden=256, heads=1, heads_kv=1))
    w.configure(provisions(ok)[0])
    w.bind(provisions(ok)[0].gguf_source)
    w.release()


def test_the_largest_head_size_is_the_attention_kernel_s() -> None:
    text = source("attention.cu")
    per_lane = re.search(r"#define ATT_MAX_PER_LANE (\d+)", text)
    assert per_lane is not None
    assert 32 * int(per_lane.group(1)) == ATTENTION_MAX_HEAD_DIM


# ---- against the reference worker ---------------------------------------------------------

MIXED = RandomModel(
    n_layers=2,
    qtype="Q4_0",
    embed_qtype="Q6_K",
    head_qtype="Q5_K",
    seed=7,
    overrides=(
        ("blk.0.attn_k.weight", "Q6_K"),
        ("blk.0.attn_v.weight", "Q8_0"),
        ("blk.1.ffn_up.weight", "Q5_1"),
        ("blk.1.ffn_down.weight", "Q3_K"),
        ("blk.1.attn_output.weight", "F16"),
        ("blk.1.attn_q.weight", "BF16"),
    ),
)
#: IQ4_XS block matrices (256-element super-blocks); IQ4_NL (32-element blocks) for the
#: embedding, the head and two block matrices.
IQ4 = RandomModel(
    n_layers=2,
    qtype="IQ4_XS",
    embed_qtype="IQ4_NL",
    head_qtype="IQ4_NL",
    seed=9,
    overrides=(("blk.0.attn_v.weight", "IQ4_NL"), ("blk.1.ffn_down.weight", "IQ4_NL")),
)
NAMES = ["llama-F32-untied", "qwen2-Q4_K", "llama-Q8_0-rope", "mixed-types", "llama-IQ4"]


@pytest.fixture(scope="module")
def shapes(folder: Path) -> dict[str, Path]:
    rope = ModelShape(n_layers=2, quant="Q8_0", rope_freqs=True, rope_scaling_factor=4.0, seed=6)
    qwen2 = RandomModel(arch="qwen2", n_layers=2, qtype="Q4_K", tied=True, seed=5)
    return {
        "llama-F32-untied": write_model(folder / "f32.gguf", ModelShape(n_layers=3, tied=False)),
        "qwen2-Q4_K": write_random_model(folder / "qwen2-q4k.gguf", qwen2),
        "llama-Q8_0-rope": write_model(folder / "rope.gguf", rope),
        "mixed-types": write_random_model(folder / "mixed.gguf", MIXED),
        "llama-IQ4": write_random_model(folder / "iq4.gguf", IQ4),
    }


@pytest.mark.parametrize("name", NAMES)
def test_float_mode_gives_the_reference_workers_tokens_and_logits(
    shapes: dict[str, Path], name: str
) -> None:
    ref = run(shapes[name], ReferenceWorker)
    ours = run(shapes[name], lambda: TwinWorker(matvec="f32"))
    assert [o.token_id for o in ours] == [o.token_id for o in ref]
    for a, b in zip(ours, ref, strict=True):
        assert a.logits is not None and b.logits is not None
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_8bit_mode_stays_close_to_the_reference(shapes: dict[str, Path], name: str) -> None:
    ref = run(shapes[name], ReferenceWorker, n=1)
    ours = run(shapes[name], lambda: TwinWorker(matvec="q8"), n=1)
    assert ours[0].logits is not None and ref[0].logits is not None
    assert cosine(ours[0].logits, ref[0].logits) >= 0.999


# ---- against llama.cpp --------------------------------------------------------------------

#: The fixtures the CUDA worker runs (every architecture's).
MODELS: list[dict[str, Any]] = runnable_by(TINY, CudaWorker.capabilities)


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("entry", MODELS, ids=[m["name"] for m in MODELS])
def test_llamacpp_fixtures_pass_the_reference_workers_thresholds(
    entry: dict[str, Any], mode: str, folder: Path
) -> None:
    path = model_file(entry, folder)
    chain = Chain.bind(provisions(path, 1, max_seq_len=64), lambda: TwinWorker(matvec=mode))
    outs = chain.generate(TINY["prompt"], N_TOKENS)
    exact = entry["type"] in ("F32", "F16")
    threshold = 0.99999 if exact else 0.9995
    prompt = outs[0].logits
    assert prompt is not None
    theirs = TINY_LOGITS[f"{entry['name']}/prompt"]
    assert cosine(prompt, theirs) >= threshold
    assert same_pick_up_to_a_near_tie(prompt, theirs)
    ours = [o.token_id for o in outs]
    near_tie = first_near_tie(entry["gaps"], N_TOKENS)
    if entry["type"] in ("F32", "F16", "BF16") and near_tie == N_TOKENS:
        assert ours == entry["greedy"][:N_TOKENS]  # the reference worker's rule
    assert common_prefix(ours, entry["greedy"]) >= near_tie
    if ours == entry["greedy"][:N_TOKENS]:
        last = outs[-1].logits
        assert last is not None
        assert cosine(last, TINY_LOGITS[f"{entry['name']}/last_step"]) >= threshold


# ---- splits --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rope_model(folder: Path) -> Path:
    entry = next(m for m in MODELS if m["name"] == "tiny-llama-rope-F32")
    assert FIXTURE_SHAPES["llama-rope"].n_layers == 3
    return model_file(entry, folder)


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_stages_with_f32_edges_compute_what_one_stage_computes(rope_model: Path, mode: str) -> None:
    runs = [run(rope_model, lambda: TwinWorker(matvec=mode), s, n=10) for s in (1, 2, 3)]
    for other in runs[1:]:
        assert [o.token_id for o in other] == [o.token_id for o in runs[0]]
        for a, b in zip(other, runs[0], strict=True):
            assert a.logits is not None and b.logits is not None
            np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_stages_with_2_byte_edges_keep_the_tokens(rope_model: Path, dtype: str) -> None:
    one = run(rope_model, TwinWorker, 1, n=10, dtype=dtype)
    three = run(rope_model, TwinWorker, 3, n=10, dtype=dtype)
    assert [o.token_id for o in three] == [o.token_id for o in one]
    for a, b in zip(three, one, strict=True):
        assert a.logits is not None and b.logits is not None
        assert cosine(a.logits, b.logits) >= 0.9999


# ---- SmolLM2 --------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_first_tokens_are_llamacpps(smollm2_path: str) -> None:
    doc, logits = load_doc("smollm2"), load_logits("smollm2")
    prompt = doc["prompts"][3]
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=64), TwinWorker)
    outs = chain.generate(prompt["token_ids"], 3)
    assert [o.token_id for o in outs] == prompt["greedy"][:3]
    assert outs[0].logits is not None
    assert cosine(outs[0].logits, logits[f"q4_1/{prompt['name']}"]) >= 0.999
