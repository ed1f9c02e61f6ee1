"""Each block's attention in the facts (window, rotary base) as llama.cpp reads them,
and the planner's memory check counting a sliding block's KV cache at its window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from gguf import GGUFValueType

from runplan import (
    GgufError,
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    WorkerCapabilities,
    plan_run,
)
from runplan import model_facts_from_gguf as facts_of
from runplan.cli import main
from runplan.memory import plan_stage_memory
from tests.fixtures.gguf_models import ModelShape, write_model

GEMMA3 = ModelShape(
    arch="gemma3",
    n_layers=7,
    sliding_window=8,
    rope_freq_base=1e6,
    context_length=512,
    seed=11,
)


def gemma3(tmp_path: Path, shape: ModelShape = GEMMA3, **kwargs: Any) -> ModelFacts:
    return facts_of(write_model(tmp_path / "g.gguf", shape, **kwargs), max_seq_len=100)


def test_without_a_pattern_gemma3_blocks_slide_but_every_sixth(tmp_path: Path) -> None:
    """llama.cpp's period for gemma3 is 6: blocks 0-4 slide, block 5 is global, block 6
    slides; sliding blocks rotate with the default base 10000 (no ``freq_base_swa``)."""
    f = gemma3(tmp_path)
    assert f.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert f.layer_rope_freq_bases == (1e4, 1e4, 1e4, 1e4, 1e4, 1e6, 1e4)
    assert f.layer_kv_positions() == (8, 8, 8, 8, 8, 100, 8)


def test_gemma2_blocks_slide_every_other_one_with_the_global_base(tmp_path: Path) -> None:
    """llama.cpp's gemma2 (``models/gemma2.cpp``): period 2 (blocks 0, 2, 4, 6 slide),
    and its sliding blocks rotate with the global base unless ``freq_base_swa`` says
    otherwise."""
    f = gemma3(tmp_path, attrs.evolve(GEMMA3, arch="gemma2"))
    assert f.layer_windows == (8, 0, 8, 0, 8, 0, 8)
    assert f.layer_rope_freq_bases == (1e6,) * 7
    swa = attrs.evolve(GEMMA3, arch="gemma2", rope_freq_base_swa=1e4)
    f = facts_of(write_model(tmp_path / "swa.gguf", swa), max_seq_len=100)
    assert f.layer_rope_freq_bases == (1e4, 1e6, 1e4, 1e6, 1e4, 1e6, 1e4)


def test_a_gemma2_file_without_a_window_slides_in_4096_positions(tmp_path: Path) -> None:
    """gemma2's window defaults to 4096 (gemma3 without the key: no block slides)."""
    f = gemma3(tmp_path, attrs.evolve(GEMMA3, arch="gemma2", sliding_window=0))
    assert f.layer_windows == (4096, 0, 4096, 0, 4096, 0, 4096)
    g = facts_of(write_model(tmp_path / "g3.gguf", attrs.evolve(GEMMA3, sliding_window=0)))
    assert g.layer_windows == (0,) * 7


def test_gemma_ignores_the_sliding_keys_as_llamacpp_does(tmp_path: Path) -> None:
    """llama.cpp's first gemma (``models/gemma.cpp``) reads no sliding window, pattern
    or sliding rotary base: every block attends to all positions with the one base."""
    shape = attrs.evolve(GEMMA3, arch="gemma", sliding_window_pattern=2, rope_freq_base_swa=1e4)
    f = gemma3(tmp_path, shape)
    assert f.layer_windows == (0,) * 7
    assert f.layer_rope_freq_bases == (1e6,) * 7
    assert f.layer_kv_positions() == (100,) * 7


@pytest.mark.parametrize(
    ("pattern", "windows"),
    [
        (3, (8, 8, 0, 8, 8, 0, 8)),
        (1, (0,) * 7),  # every block global
        (0, (8,) * 7),  # every block slides
        ([True, False, True, True, False, False, True], (8, 0, 8, 8, 0, 0, 8)),
    ],
    ids=["period-3", "period-1", "period-0", "per-block-array"],
)
def test_a_pattern_key_says_which_blocks_slide(
    tmp_path: Path, pattern: int | list[bool], windows: tuple[int, ...]
) -> None:
    shape = attrs.evolve(GEMMA3, rope_freq_base_swa=5e4)
    f = gemma3(tmp_path, shape, extra_keys={"gemma3.attention.sliding_window_pattern": pattern})
    assert f.layer_windows == windows
    assert f.layer_rope_freq_bases == tuple(5e4 if w else 1e6 for w in windows)


def test_a_pattern_of_the_wrong_length_is_a_gguf_error_naming_it(tmp_path: Path) -> None:
    key = "gemma3.attention.sliding_window_pattern"
    with pytest.raises(GgufError, match=key):
        gemma3(tmp_path, extra_keys={key: [True, False]})


@pytest.mark.parametrize(
    ("window", "vtype"), [(2**32, GGUFValueType.UINT64), (-1, GGUFValueType.INT32)]
)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_window_outside_uint32_is_a_gguf_error_naming_it(
    tmp_path: Path, arch: str, window: int, vtype: GGUFValueType
) -> None:
    """llama.cpp holds the window as a ``uint32_t``: 2**63 reached the CPU worker's
    attention kernel, whose first step failed with an untyped OverflowError. A window
    that no UINT32 holds is stored as another type, which llama.cpp refuses, and so is
    it here (``key_types``), naming the type and the value."""
    key = f"{arch}.attention.sliding_window"
    with pytest.raises(GgufError, match=rf"found a {vtype.name} \({window}\)") as info:
        gemma3(tmp_path, attrs.evolve(GEMMA3, arch=arch), override_keys={key: (window, vtype)})
    assert info.value.key == key
    largest = attrs.evolve(GEMMA3, arch=arch)
    f = gemma3(tmp_path, largest, override_keys={key: (2**32 - 1, GGUFValueType.UINT32)})
    assert f.layer_windows[0] == 2**32 - 1


def test_a_window_longer_than_the_run_holds_the_run(tmp_path: Path) -> None:
    f = attrs.evolve(gemma3(tmp_path), max_seq_len=5)
    assert f.layer_kv_positions() == (5,) * 7


@pytest.mark.parametrize("arch", ["phi3", "llama", "qwen3"])
def test_architectures_llama_cpp_runs_without_a_window_ignore_the_key(
    tmp_path: Path, arch: str
) -> None:
    """phi3 files carry ``attention.sliding_window``; llama.cpp disables it."""
    shape = ModelShape(arch=arch, n_layers=3, sliding_window=16, rope_freq_base=5e5)
    f = facts_of(write_model(tmp_path / "m.gguf", shape))
    assert f.layer_windows == (0, 0, 0)
    assert f.layer_rope_freq_bases == (5e5, 5e5, 5e5)


def test_qwen3_heads_wider_than_hidden_over_heads(tmp_path: Path) -> None:
    shape = ModelShape(arch="qwen3", n_layers=2, hidden=64, heads=4, key_length=32)
    f = facts_of(write_model(tmp_path / "q.gguf", shape), max_seq_len=10)
    assert (f.head_dim_k, f.head_dim_v) == (32, 32)
    assert f.layer_kv_bytes(4) == (10 * 2 * 64 * 4,) * 2  # 2 kv heads of 32 + 32


def test_the_memory_check_counts_a_sliding_block_at_its_window(tmp_path: Path) -> None:
    f = gemma3(tmp_path)
    per_position = f.head_count_kv * (f.head_dim_k + f.head_dim_v) * 4
    pool = NodePool("orch", (NodeSpec("a", 2**34), NodeSpec("b", 2**34)))
    plan = plan_run(f, RuntimeConfig(run_id="r", max_tokens=1), pool, stage_count=2, placement=None)
    assert isinstance(plan, RunPlan)
    memory = plan_stage_memory(f, WorkerCapabilities(), plan)
    assert [(s.layer_start, s.layer_end_exclusive) for s in plan.stages] == [(0, 4), (4, 7)]
    assert memory[0].kv_bytes == 4 * 8 * per_position
    assert memory[1].kv_bytes == (8 + 100 + 8) * per_position
    # Had every block held max_seq_len positions, the first stage would not fit here.
    weights = memory[0].weight_bytes + memory[0].ring_bytes
    tight = weights + 4 * 8 * per_position
    assert tight < weights + 4 * 100 * per_position
    fits = plan_run(
        f,
        RuntimeConfig(run_id="r", max_tokens=1),
        NodePool("orch", (NodeSpec("a", tight), NodeSpec("b", 2**34))),
        stage_count=2,
        placement=Placement.even(["a", "b"]),
    )
    assert isinstance(fits, RunPlan)
    short = plan_run(
        f,
        RuntimeConfig(run_id="r", max_tokens=1),
        NodePool("orch", (NodeSpec("a", tight - 1), NodeSpec("b", 2**34))),
        stage_count=2,
        placement=Placement.even(["a", "b"]),
    )
    assert isinstance(short, PlanRejection) and short.code == "insufficient_memory"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_windows": (8, 0)}, "layer_windows"),
        ({"layer_rope_freq_bases": (1.0,) * 3}, "layer_rope_freq_bases"),
        ({"layer_windows": (8, 8, 8, 8, 8, -1, 8)}, "layer_windows[5]"),
    ],
)
def test_facts_whose_blocks_disagree_are_rejected(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    f = attrs.evolve(gemma3(tmp_path), **change)
    pool = NodePool("orch", (NodeSpec("a", 2**34),))
    result = plan_run(f, RuntimeConfig(run_id="r", max_tokens=1), pool, stage_count=1)
    assert isinstance(result, PlanRejection) and result.code == "inconsistent_model_facts"
    assert field in str(result)


def test_facts_cli_shows_each_kind_of_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(write_model(tmp_path / "g.gguf", GEMMA3))
    assert main(["facts", path, "--max-seq-len", "100"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, however rich wraps it
    assert "sliding window of 8" in out and "6 blocks (0-4, 6)" in out
    assert "rope base 10000" in out and "rope base 1e+06" in out
    assert "KV cache 8 positions" in out and "KV cache 100 positions" in out
    assert main(["facts", path, "--json"]) == 0
    facts = capsys.readouterr().out
    assert '"layer_windows": [8, 8, 8, 8, 8, 0, 8]' in facts


def test_plan_cli_counts_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = str(write_model(tmp_path / "g.gguf", GEMMA3))
    argv = ["plan", path, "--nodes", "a=1GiB,b=1GiB", "--max-seq-len", "100", "--json"]
    assert main(argv) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    f = gemma3(tmp_path)
    kv = f.layer_kv_bytes(4)
    assert [m["kv_bytes"] for m in memory] == [sum(kv[:4]), sum(kv[4:])]
