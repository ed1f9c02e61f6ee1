"""A model split into stages computes what the whole model computes in one stage.

With float32 activations between stages, 1, 2 (15 + 15 blocks) and 3 (1 + 28 + 1
blocks) stages of SmolLM2 give the same greedy tokens and logits within 1e-5 at every
one of 16 steps; so do 1 and 3 stages of the three-block rope-scaled llama fixture
and of the qwen3, gemma3 (six blocks: two sliding ones per stage, the global one
last) and phi3 fixtures of three or more blocks, whose tokens are llama.cpp's (up to
a near-tie llama.cpp shows) and whose last-step logits are within cosine 0.99999 of
llama.cpp's. With float16 or bfloat16 activations the edges carry that dtype,
``(rows, hidden)``, and the logits of a 3-stage run stay within cosine 0.99999 (f16)
or 0.9999 (bf16) of llama.cpp's, with the same largest logit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime_core.workers.interface import TokenOutput
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.llamacpp_fixtures import load_doc, load_logits, model_file
from tests.support.chain import Chain, provisions
from tests.support.numerics import common_prefix, cosine, first_near_tie

SMOLLM2 = load_doc("smollm2")
TINY = load_doc("tiny")
TINY_LOGITS = load_logits("tiny")
ROPE_ENTRY: dict[str, Any] = next(m for m in TINY["models"] if m["name"] == "tiny-llama-rope-F32")
N_TOKENS = 16
SMOLLM2_PROMPT: list[int] = SMOLLM2["prompts"][3]["token_ids"]  # a chat prompt


@pytest.fixture(scope="module")
def smollm2_whole_run(smollm2_chain: Chain) -> list[TokenOutput]:
    return smollm2_chain.generate(SMOLLM2_PROMPT, N_TOKENS)


def assert_same_run(a: list[TokenOutput], b: list[TokenOutput]) -> None:
    assert [o.token_id for o in a] == [o.token_id for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logits is not None and y.logits is not None
        np.testing.assert_allclose(x.logits, y.logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranges", [[(0, 15), (15, 30)], [(0, 1), (1, 29), (29, 30)]], ids=["2-even", "3-uneven"]
)
def test_smollm2_split_matches_one_stage(
    smollm2_whole_run: list[TokenOutput], smollm2_path: str, ranges: list[tuple[int, int]]
) -> None:
    split = Chain.bind(provisions(smollm2_path, ranges, max_seq_len=96))
    try:
        assert_same_run(smollm2_whole_run, split.generate(SMOLLM2_PROMPT, N_TOKENS))
    finally:
        split.release()


@pytest.fixture(scope="module")
def rope_model(model_dir: Path) -> Path:
    return model_file(ROPE_ENTRY, model_dir)


def test_rope_scaled_llama_split_in_three_matches_one_stage_and_llamacpp(
    rope_model: Path,
) -> None:
    runs = []
    for stages in (1, 3):
        chain = Chain.bind(provisions(rope_model, stages, max_seq_len=64))
        runs.append(chain.generate(TINY["prompt"], N_TOKENS))
        chain.release()
    assert_same_run(runs[0], runs[1])
    assert [o.token_id for o in runs[1]] == ROPE_ENTRY["greedy"]
    assert runs[1][-1].logits is not None
    assert cosine(runs[1][-1].logits, TINY_LOGITS[f"{ROPE_ENTRY['name']}/last_step"]) >= 0.99999


SPLIT_ENTRIES = [m for m in TINY["models"] if m["shape"] in ("qwen3-3", "gemma3-6", "phi3-3")]


@pytest.mark.parametrize("entry", SPLIT_ENTRIES, ids=[m["name"] for m in SPLIT_ENTRIES])
def test_later_architectures_split_in_three_match_one_stage_and_llamacpp(
    entry: dict[str, Any], model_dir: Path
) -> None:
    path = model_file(entry, model_dir)
    runs = []
    for stages in (1, 3):
        chain = Chain.bind(provisions(path, stages, max_seq_len=64))
        assert len(chain.workers) == stages
        runs.append(chain.generate(TINY["prompt"], N_TOKENS))
        chain.release()
    assert_same_run(runs[0], runs[1])
    ours, theirs = [o.token_id for o in runs[1]], entry["greedy"]
    assert common_prefix(ours, theirs) >= first_near_tie(entry["gaps"], N_TOKENS)
    if ours == theirs:
        last = runs[1][-1].logits
        assert last is not None
        assert cosine(last, TINY_LOGITS[f"{entry['name']}/last_step"]) >= 0.99999


@pytest.mark.parametrize(
    ("dtype", "np_dtype", "min_cosine"),
    [("f16", np.float16, 0.99999), ("bf16", np.uint16, 0.9999)],
)
def test_low_precision_edges_carry_their_dtype(
    rope_model: Path, dtype: str, np_dtype: type[np.generic], min_cosine: float
) -> None:
    provs = provisions(rope_model, 3, dtype=dtype, max_seq_len=64)
    workers = []
    for p in provs:
        w = ReferenceWorker()
        w.configure(p)
        w.bind(p.gguf_source)
        workers.append(w)
    prompt = np.array(TINY["prompt"], dtype=np.uint32)
    edge = workers[0].execute_step(0, prompt)
    assert isinstance(edge, np.ndarray)
    assert edge.dtype == np_dtype and edge.shape == (len(prompt), 256)
    edge = workers[1].execute_step(0, edge)
    assert isinstance(edge, np.ndarray)
    assert edge.dtype == np_dtype and edge.shape == (len(prompt), 256)
    out = workers[2].execute_step(0, edge)
    assert isinstance(out, TokenOutput) and out.logits is not None
    theirs = TINY_LOGITS[f"{ROPE_ENTRY['name']}/prompt"]
    assert cosine(out.logits, theirs) >= min_cosine
    assert out.token_id == int(np.argmax(theirs))
