"""The CUDA worker, whole, with its kernels' real source on the SIMT emulator.

- SmolLM2-135M (Q4_1) through the process runtime: two stage processes of the emulated
  CUDA worker (``tests/support/simt_stage.SimtHost``: ``cuda/backend.py`` and ``ops.py``
  on the emulated CuPy, 8-bit products, f16 activations between the stages as a CUDA run
  plans them, the kernels' threads in a seeded random order). On llama.cpp's recorded
  "france" prompt (5 tokens; llama.cpp's first near-tie at step 5:
  ``numerics.first_near_tie``) it gives the NumPy reference worker's 5 greedy tokens,
  every token up to that near-tie and no more (what the check needs: a token past a
  near-tie may differ by right), and its prompt logits meet the reference worker's
  thresholds against llama.cpp's (cosine >= 0.999, the same largest logit). Each row
  costs a decode step's emulation (the one-row kernels, some 6 million emulated CUDA
  threads for SmolLM2), so the shortest prompt with a near-tie is the one run here: 5
  prompt rows and 4 decode steps, about 20 s of CPU (measured under load). Longer
  prompts and all 16 tokens of every prompt are the GPU test's (``test_gpu_worker.py``);
  the prefill path over many rows, the device-stage tests'
  (``test_twins_device_stage.py``) and the tiny fixtures' below.
- llama.cpp's tiny fixtures of every architecture the CUDA worker runs, in every type it
  has (15 for llama and qwen2), in one process: the GPU test of the same name
  (``test_gpu_worker.test_tiny_fixtures_in_every_type``: llama.cpp's thresholds, and
  prompt logits within cosine 0.99999 of the NumPy twin worker's) on the emulated CuPy,
  its greedy tokens up to llama.cpp's first near-tie (all 16 where there is none; past
  a near-tie a token may differ by right, so only the GPU run goes on to the last
  step's logits), in float mode for every fixture and in 8-bit mode for every type with
  an 8-bit product (``quant_types.uses_q8``). A float type's weights take the float products in
  both modes (``backend._matvec``), so its 8-bit-mode run launches the kernels of its
  float-mode run plus the 8-bit rows nothing reads, which the 8-bit types' runs and
  ``test_simt_kernels.py`` check.
- The 6-block gemma3 fixture (sliding windows past which the run goes, post-norms, GELU)
  split 3 + 3 across two emulated stage processes with float32 activations, its kernels'
  threads in reverse order: the tokens and logits of one stage in this process, bit for
  bit (every row takes the one-row kernels, whose bits depend on neither the thread
  order nor the step's rows), and llama.cpp's prompt logits within its F32 thresholds.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tests.runtime_cupy.cuda.test_gpu_worker as gw
from runplan.quant_types import uses_q8
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_cupy.cuda.worker import CudaWorker
from tests.fixtures.llamacpp_fixtures import load_doc, load_logits, model_file
from tests.support.chain import Chain, provisions
from tests.support.emulated_cupy import DEVICE_OPS, DEVICE_STAGE, EmulatedKernels, FakeCupy
from tests.support.numerics import common_prefix, cosine, first_near_tie
from tests.support.simt.loader import REVERSE, random_order
from tests.support.simt_stage import SimtHost, run_emulated

if shutil.which("g++") is None:
    pytest.skip("the SIMT emulator needs a host C++ compiler (g++)", allow_module_level=True)

SMOLLM2 = {p["name"]: p for p in load_doc("smollm2")["prompts"]}
SMOLLM2_LOGITS = load_logits("smollm2")
#: (prompt, tokens): the shortest recorded prompt with a near-tie (llama.cpp's top two
#: logits within ``numerics.NEAR_TIE`` at step 5), and its tokens up to that near-tie.
RUNS = (("france", 5),)


@pytest.fixture(scope="module")
def emulated_smollm2(smollm2_path: str) -> dict[str, Any]:
    """Each prompt's run through two emulated CUDA stage processes."""
    host = SimtHost(order=random_order(11))
    return {
        name: run_emulated(
            smollm2_path, SMOLLM2[name]["token_ids"], stages=2, max_tokens=n, host=host
        )
        for name, n in RUNS
    }


@pytest.fixture(scope="module")
def reference_smollm2(smollm2_path: str) -> dict[str, list[int]]:
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=64), ReferenceWorker)
    try:
        return {
            name: [o.token_id for o in chain.generate(SMOLLM2[name]["token_ids"], n)]
            for name, n in RUNS
        }
    finally:
        chain.release()


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize(("name", "n"), RUNS, ids=[name for name, _ in RUNS])
def test_smollm2_in_two_emulated_cuda_stage_processes(
    emulated_smollm2: dict[str, Any], reference_smollm2: dict[str, list[int]], name: str, n: int
) -> None:
    result = emulated_smollm2[name]
    assert result.finished is not None and result.finished.outcome.value == "COMPLETED", result
    assert len(result.tokens) == n and len(result.logits) == n
    prompt_logits = np.asarray(result.logits[0])
    theirs = SMOLLM2_LOGITS[f"q4_1/{name}"]
    assert cosine(prompt_logits, theirs) >= 0.999
    assert int(np.argmax(prompt_logits)) == int(np.argmax(theirs))
    agree = common_prefix(list(result.tokens), reference_smollm2[name])
    assert agree >= first_near_tie(SMOLLM2[name]["gaps"], n), (
        name,
        result.tokens,
        reference_smollm2[name],
    )


@pytest.fixture
def emulated_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedKernels]:
    kernels = EmulatedKernels()
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    monkeypatch.setitem(sys.modules, "runtime_cupy.cuda.backend", DEVICE_STAGE)
    monkeypatch.setitem(DEVICE_OPS._KERNELS, 0, kernels)
    yield kernels


#: (fixture, mode): every fixture in float mode; in 8-bit mode those whose type has an
#: 8-bit product (a float type's 8-bit mode runs its float mode's products).
TINY_RUNS = [(m, "f32") for m in gw.TINY_MODELS] + [
    (m, "q8") for m in gw.TINY_MODELS if uses_q8(m["type"], "q8")
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "mode"), TINY_RUNS, ids=[f"{m['name']}-{mode}" for m, mode in TINY_RUNS]
)
def test_tiny_fixtures_in_every_type(
    emulated_cupy: EmulatedKernels, entry: dict[str, Any], mode: str, tmp_path: Path
) -> None:
    gw.test_tiny_fixtures_in_every_type(entry, mode, tmp_path, up_to_near_tie=True)
    assert emulated_cupy.python_launches > 0


@pytest.mark.process
def test_a_six_block_gemma3_split_across_two_emulated_stage_processes(
    emulated_cupy: EmulatedKernels, tmp_path: Path
) -> None:
    tiny = load_doc("tiny")
    entry = next(m for m in tiny["models"] if m["name"] == "tiny-gemma3-6-F32")
    path = model_file(entry, tmp_path)
    prompt, n = tiny["prompt"], tiny["greedy_tokens"]
    split = run_emulated(
        path, prompt, stages=2, max_tokens=n, host=SimtHost(order=REVERSE), activation_bytes=4
    )
    assert split.finished is not None and split.finished.outcome.value == "COMPLETED", split
    chain = Chain.bind(provisions(path, 1, max_seq_len=len(prompt) + n), CudaWorker)
    try:
        one = chain.generate(prompt, n)
    finally:
        chain.release()
    assert list(split.tokens) == [o.token_id for o in one]
    for ours, theirs in zip(split.logits, one, strict=True):
        np.testing.assert_array_equal(ours, theirs.logits)
    llamacpp = load_logits("tiny")[f"{entry['name']}/prompt"]
    assert cosine(np.asarray(split.logits[0]), llamacpp) >= 0.99999
    assert int(np.argmax(split.logits[0])) == int(np.argmax(llamacpp))
