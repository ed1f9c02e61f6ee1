"""Sliding-window blocks in the CPU worker (gemma3): each block's KV cache holds what the
planner counts for it (a sliding block's window, not the sequence), and a ring that
wraps computes, bit for bit, what one long prefill computes; a prefill longer than
the window, split across stages, leaves the ring as decoding needs it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runplan import model_facts_from_gguf
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.workers.cpu.ops import CpuOps
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.stage_weights import load_weights
from runtime_core.workers.stage_worker import BackendSpec
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model
from tests.support.chain import Chain, provisions

PROMPT = [257, 84, 104, 101, 32, 113, 117, 105, 99, 107, 300, 12, 45, 99, 200, 7]


class _Mapped:
    def raw(self, data: np.ndarray) -> np.ndarray:
        return data

    def f32(self, data: np.ndarray) -> np.ndarray:
        return np.array(data, np.float32)


@pytest.fixture(scope="module", params=["gemma3", "gemma3-6"])
def gemma3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cpu-swa")
    return write_model(folder / f"{request.param}.gguf", FIXTURE_SHAPES[request.param])


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("max_seq_len", [8, 40])
def test_each_block_holds_the_kv_cache_the_planner_counts(
    gemma3: Path, max_seq_len: int, kv: str
) -> None:
    facts = model_facts_from_gguf(gemma3, max_seq_len=max_seq_len)
    n = facts.num_layers
    spec = BackendSpec(True, True, np.dtype(np.float32), kv, "q8")
    with open_stage_slice(
        gemma3, 0, n, is_first=True, is_last=True, capabilities=CpuWorker.capabilities
    ) as stage:
        ops = CpuOps(load_weights(stage, _Mapped(), max_seq_len, join_parts=False), spec,
                     max_seq_len, 1)  # fmt: skip
    cache = ops.new_cache(max_seq_len)  # a run of max_seq_len positions
    held = [k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v, strict=True)]
    assert tuple(held) == facts.layer_kv_bytes(2 if kv == "f16" else 4)
    # a window shorter than the sequence: those blocks hold less than the global ones
    assert any(w and w < max_seq_len for w in facts.layer_windows) == (max_seq_len == 40)


def test_decode_steps_past_the_window_compute_one_long_prefill(gemma3: Path) -> None:
    """Decoding wraps the sliding blocks' rings; prefilling the same tokens in one step
    (which wraps them too, holding its own keys beside the ring) masks the window. Both
    read every position in order: the last position's logits are the same bits."""
    chain = Chain.bind(provisions(gemma3, 1, max_seq_len=48), CpuWorker)
    outs = chain.generate(PROMPT, 24)
    tokens = PROMPT + [o.token_id for o in outs[:-1]]
    whole = chain.step(0, np.array(tokens, dtype=np.uint32))
    chain.release()
    facts = model_facts_from_gguf(gemma3)
    assert len(tokens) > max(facts.layer_windows) and 0 in facts.layer_windows
    assert outs[-1].logits is not None and whole.logits is not None
    np.testing.assert_array_equal(whole.logits, outs[-1].logits)


def test_a_prefill_longer_than_the_window_then_decode_computes_one_prefill(gemma3: Path) -> None:
    """A prefill that itself wraps the ring (in stages, where the model has several
    blocks) keeps the positions decoding needs."""
    long_prompt = (PROMPT * 3)[:40]
    stages = 2 if "6" in gemma3.stem else 1
    chain = Chain.bind(provisions(gemma3, stages, max_seq_len=48), CpuWorker)
    outs = chain.generate(long_prompt, 4)
    whole = chain.step(0, np.array(long_prompt + [o.token_id for o in outs[:-1]], np.uint32))
    chain.release()
    assert outs[-1].logits is not None and whole.logits is not None
    np.testing.assert_array_equal(whole.logits, outs[-1].logits)
