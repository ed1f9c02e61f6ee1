"""The CPU worker against llama.cpp's recorded outputs (``tests/fixtures/llamacpp/``).

It rounds activations as llama.cpp's CPU path does for each weight type (Q8_0, Q8_1,
Q8_K blocks, ``csrc/dot.h``; half or bfloat16 for F16 / BF16 weights), so on the tiny
random models of every type it reproduces llama.cpp's logits almost to the last bit:
every logit of every model within 1e-4 (measured: at most 1.4e-6), cosine >= 0.99999
(the reference worker's threshold for F32 / F16; it asks 0.9995 of the others), and all
16 greedy tokens.

SmolLM2 (30 blocks) is another matter. Rounding to 8 bits is not continuous: a change
of one unit in the last place of an activation moves some roundings, which move later
ones, so after a few blocks two 8-bit computations that differ anywhere in the last
bit (llama.cpp's fused multiply-adds, its own exp, its batched prefill) are as far
apart as two independent roundings: cosine ~0.9993 (measured: feeding the prompt
to llama.cpp one token at a time instead of as one batch gives cosine 0.99927 to its
own batched logits, and 3 of the 6 prompts' 16 greedy tokens). Asserted here: the
reference worker's thresholds on the logits (cosine >= 0.999, the same largest logit),
at least the first 5 tokens and every token up to llama.cpp's first near-tie, and at
least 3 of 6 prompts' 16 tokens exactly (the reference worker, which does not round,
gets 4); with ``matvec="f32"`` the reference worker's agreement with llama.cpp on its
own float32 weights (cosine >= 0.99999, every logit within 0.02).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_core.worker import TokenOutput
from runtime_cupy.cpu.worker import CpuWorker
from tests.fixtures.llamacpp_fixtures import load_doc, load_logits, model_file
from tests.runtime_core.chain import provisions
from tests.runtime_core.numerics import common_prefix, cosine, first_near_tie
from tests.runtime_cupy.cpu.chain import Chain, run

TINY = load_doc("tiny")
TINY_LOGITS = load_logits("tiny")
#: The fixtures of the architectures the CPU worker runs.
MODELS: list[dict[str, Any]] = [
    m
    for m in TINY["models"]
    if TINY["shapes"][m["shape"]]["arch"] in CpuWorker.capabilities.architectures
]
N_TOKENS: int = TINY["greedy_tokens"]

SMOL = load_doc("smollm2")
SMOL_LOGITS = load_logits("smollm2")
PROMPTS: list[dict[str, Any]] = SMOL["prompts"]


def logits(out: TokenOutput) -> np.ndarray:
    assert out.logits is not None
    return out.logits


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-llamacpp")


@pytest.mark.parametrize("entry", MODELS, ids=[m["name"] for m in MODELS])
def test_tiny_models_reproduce_llamacpps_logits_and_tokens(
    entry: dict[str, Any], folder: Path
) -> None:
    outs = run(provisions(model_file(entry, folder), 1, max_seq_len=64), CpuWorker,
               TINY["prompt"], N_TOKENS)  # fmt: skip
    name = entry["name"]
    prompt, last = TINY_LOGITS[f"{name}/prompt"], TINY_LOGITS[f"{name}/last_step"]
    assert [o.token_id for o in outs] == entry["greedy"][:N_TOKENS]
    assert int(np.argmax(logits(outs[0]))) == int(np.argmax(prompt))
    for ours, theirs in ((logits(outs[0]), prompt), (logits(outs[-1]), last)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
        assert cosine(ours, theirs) >= 0.99999


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> dict[str, list[TokenOutput]]:
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=96), CpuWorker)
    try:
        return {p["name"]: chain.generate(p["token_ids"], 16) for p in PROMPTS}
    finally:
        chain.release()


@pytest.mark.parametrize("name", [p["name"] for p in PROMPTS])
def test_smollm2_prompt_logits_meet_the_reference_workers_thresholds(
    smollm2: dict[str, list[TokenOutput]], name: str
) -> None:
    ours, theirs = logits(smollm2[name][0]), SMOL_LOGITS[f"q4_1/{name}"]
    assert ours.shape == theirs.shape == (49152,)
    assert cosine(ours, theirs) >= 0.999
    assert int(np.argmax(ours)) == int(np.argmax(theirs))


def test_smollm2_greedy_tokens_part_from_llamacpps_only_at_near_ties(
    smollm2: dict[str, list[TokenOutput]],
) -> None:
    agree = {}
    for p in PROMPTS:
        ours = [o.token_id for o in smollm2[p["name"]]]
        agree[p["name"]] = n = common_prefix(ours, p["greedy"][:16])
        assert n >= 5, (p["name"], ours, p["greedy"][:16])
        assert n >= first_near_tie(p["gaps"], 16), (p["name"], n, p["gaps"])
    assert sum(n == 16 for n in agree.values()) >= 3, agree


def test_smollm2_in_float_mode_is_llamacpp_on_its_float32_weights(smollm2_path: str) -> None:
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=96), lambda: CpuWorker(matvec="f32"))
    try:
        for p in PROMPTS:
            if f"f32/{p['name']}" not in SMOL_LOGITS:
                continue
            ours = logits(chain.step(0, np.array(p["token_ids"], np.uint32)))
            theirs = SMOL_LOGITS[f"f32/{p['name']}"]
            assert cosine(ours, theirs) >= 0.99999
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=0.02)
    finally:
        chain.release()
