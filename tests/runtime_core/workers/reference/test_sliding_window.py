"""Sliding-window blocks in the reference model: a block's KV cache holds what the
planner counts for it, and a ring that wraps gives what one long step computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runplan import model_facts_from_gguf
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.workers.reference.model import StageModel
from runtime_core.workers.reference.weights import StageWeights
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model
from tests.support.chain import Chain, provisions

PROMPT = [257, 84, 104, 101, 32, 113, 117, 105, 99, 107, 300, 12, 45, 99, 200, 7]


@pytest.fixture(scope="module", params=["gemma3", "gemma3-6"])
def gemma3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("swa")
    return write_model(folder / f"{request.param}.gguf", FIXTURE_SHAPES[request.param])


@pytest.mark.parametrize("max_seq_len", [8, 40])
def test_each_block_caches_what_the_planner_counts(gemma3: Path, max_seq_len: int) -> None:
    facts = model_facts_from_gguf(gemma3, max_seq_len=max_seq_len)
    n = facts.num_layers
    with open_stage_slice(gemma3, 0, n, is_first=True, is_last=True) as stage:
        model = StageModel(StageWeights.load(stage), max_seq_len)
    held = [k.nbytes + v.nbytes for k, v in zip(model.k_cache, model.v_cache, strict=True)]
    assert tuple(held) == facts.layer_kv_bytes(4)
    assert any(w and w < max_seq_len for w in facts.layer_windows) == (max_seq_len == 40)


def test_decode_steps_past_the_window_match_one_long_prefill(gemma3: Path) -> None:
    """Decoding wraps the sliding blocks' rings; prefilling the same tokens in one step
    masks the window instead. The last position's logits agree."""
    chain = Chain.bind(provisions(gemma3, 1, max_seq_len=48))
    outs = chain.generate(PROMPT, 24)
    tokens = PROMPT + [o.token_id for o in outs[:-1]]
    whole = chain.step(0, np.array(tokens, dtype=np.uint32))
    chain.release()
    assert outs[-1].logits is not None and whole.logits is not None
    np.testing.assert_allclose(whole.logits, outs[-1].logits, rtol=0, atol=1e-4)
    assert whole.token_id == outs[-1].token_id


def test_a_prefill_longer_than_the_window_then_decode_matches_one_prefill(
    gemma3: Path,
) -> None:
    """A prefill that itself wraps the ring keeps the right positions for decoding."""
    long_prompt = (PROMPT * 3)[:40]
    chain = Chain.bind(provisions(gemma3, 2 if "6" in gemma3.stem else 1, max_seq_len=48))
    outs = chain.generate(long_prompt, 4)
    whole = chain.step(0, np.array(long_prompt + [o.token_id for o in outs[:-1]], np.uint32))
    chain.release()
    assert outs[-1].logits is not None and whole.logits is not None
    np.testing.assert_allclose(whole.logits, outs[-1].logits, rtol=0, atol=1e-4)
