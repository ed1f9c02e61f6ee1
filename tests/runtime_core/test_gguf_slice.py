"""Loading one stage's slice of a GGUF model: exactly its tensors, typed errors for
files it cannot run, nothing half-loaded, other stages' tensors never touched."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGUFValueType
from hypothesis import given
from hypothesis import strategies as st

from runplan import GgufError, GgufSource, PlanRejection, model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runplan.shards import read_manifest
from runplan.split import split_model, split_plan
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.workers.interface import WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import provisions
from tests.support.strategies import layer_ranges

N_LAYERS = 4
SHAPES = {
    "tied": ModelShape(n_layers=N_LAYERS),
    "untied": ModelShape(n_layers=N_LAYERS, tied=False, arch="qwen2", seed=5),
    "rope_freqs": ModelShape(n_layers=N_LAYERS, rope_freqs=True, seed=6),
    "qwen3": ModelShape(arch="qwen3", n_layers=N_LAYERS, key_length=32, seed=7),
    "gemma3": ModelShape(arch="gemma3", n_layers=N_LAYERS, sliding_window=4, seed=8),
    "gemma2": ModelShape(arch="gemma2", n_layers=N_LAYERS, sliding_window=4, seed=10),
    "gemma": ModelShape(arch="gemma", n_layers=N_LAYERS, key_length=32, seed=11),
    "smollm3": ModelShape(arch="smollm3", n_layers=N_LAYERS, tied=False, seed=12),
    "phi3": ModelShape(arch="phi3", n_layers=N_LAYERS, rope_dims=8, tied=False, seed=9),
    "qwen3moe": ModelShape(arch="qwen3moe", n_layers=N_LAYERS, experts=4, experts_used=2, seed=13),
    "llama-moe": ModelShape(n_layers=N_LAYERS, experts=4, experts_used=2, seed=14),
    "qwen2moe": ModelShape(
        arch="qwen2moe",
        n_layers=N_LAYERS,
        tied=False,
        experts=4,
        experts_used=2,
        shared_ffn=96,
        seed=15,
    ),
}
MOE = SHAPES["qwen3moe"]
QWEN2MOE = SHAPES["qwen2moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("slice")
    return {key: write_model(d / f"{key}.gguf", shape) for key, shape in SHAPES.items()}


def expected_tensors(path: Path, start: int, end: int) -> set[str]:
    """Blocks ``start..end-1``; the embedding on the first stage; the output norm and
    the head on the last (``token_embd`` when there is no ``output``); ``rope_freqs``
    (if any) on every stage."""
    names = set(GgufHeader.read(path).tensors)
    want = {n for n in names if n.startswith("blk.") and start <= int(n.split(".")[1]) < end}
    if start == 0:
        want.add("token_embd.weight")
    if end == N_LAYERS:
        want.add("output_norm.weight")
        want.add("output.weight" if "output.weight" in names else "token_embd.weight")
    return want | ({"rope_freqs.weight"} & names)


@given(key=st.sampled_from(sorted(SHAPES)), layers=layer_ranges(N_LAYERS))
def test_a_stage_owns_exactly_its_blocks_and_its_ends(
    models: dict[str, Path], key: str, layers: tuple[int, int]
) -> None:
    start, end = layers
    with open_stage_slice(
        models[key], start, end, is_first=start == 0, is_last=end == N_LAYERS
    ) as stage:
        assert set(stage.tensors) == expected_tensors(models[key], start, end)
        if end == N_LAYERS:
            tied = key not in ("untied", "phi3", "smollm3", "qwen2moe")
            assert stage.head == ("token_embd.weight" if tied else "output.weight")
        else:
            assert stage.head is None
        for name, info in stage.tensors.items():
            array = stage.dequantize(name)
            assert array.dtype == np.float32
            assert array.shape == tuple(reversed(info.shape))
            assert array.flags.c_contiguous and array.flags.owndata


def test_a_split_set_loads_like_one_file(tmp_path: Path) -> None:
    shape = ModelShape(n_layers=3, quant="Q8_0")
    single = write_model(tmp_path / "one.gguf", shape)
    first = write_model(tmp_path / "parts.gguf", shape, split_max_tensors=7)
    assert first.name == "parts-00001-of-00005.gguf"
    for start, end in [(0, 1), (1, 2), (2, 3), (0, 3)]:
        kwargs: dict[str, Any] = {"is_first": start == 0, "is_last": end == 3}
        with (
            open_stage_slice(single, start, end, **kwargs) as a,
            open_stage_slice(first, start, end, **kwargs) as b,
        ):
            assert set(a.tensors) == set(b.tensors)
            for name in a.tensors:
                np.testing.assert_array_equal(a.dequantize(name), b.dequantize(name))


def _unsupported(tensor: str | None = None, key: str | None = None) -> dict[str, Any]:
    return {"error": UnsupportedModel, "tensor": tensor, "key": key}


def _ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


# (what the file lacks or has wrong, the stage that loads it, what it raises)
BROKEN: dict[str, tuple[dict[str, Any], tuple[int, int], dict[str, Any]]] = {
    "missing block tensor": (
        {"drop_tensors": ("blk.1.ffn_up.weight",)},
        (1, 2),
        _unsupported(tensor="blk.1.ffn_up.weight"),
    ),
    "missing output norm": (
        {"drop_tensors": ("output_norm.weight",)},
        (2, 4),
        _unsupported(tensor="output_norm.weight"),
    ),
    "wrong shape": (
        {"transpose_tensors": ("blk.2.attn_k.weight",)},
        (2, 3),
        _unsupported(tensor="blk.2.attn_k.weight"),
    ),
    "wrong embedding shape": (
        {"transpose_tensors": ("token_embd.weight",)},
        (0, 1),
        _unsupported(tensor="token_embd.weight"),
    ),
    "unknown quant type id": (
        {"raw_type_ids": {"blk.0.attn_q.weight": 200}},
        (0, 1),
        {"error": GgufError, "tensor": None, "key": None},
    ),
    "quant type the worker does not run": (
        {"tensor_types": {"blk.3.ffn_up.weight": "MXFP4"}},
        (3, 4),
        _unsupported(tensor="blk.3.ffn_up.weight"),
    ),
    "architecture we do not run": (
        {"shape": ModelShape(arch="falcon", n_layers=N_LAYERS)},
        (0, 4),
        _unsupported(key="general.architecture"),
    ),
    "mixture-of-experts architecture": (
        {"shape": ModelShape(arch="phimoe", n_layers=N_LAYERS)},
        (0, 4),
        _unsupported(key="general.architecture"),
    ),
    "missing qwen3 query norm": (
        {"shape": SHAPES["qwen3"], "drop_tensors": ("blk.2.attn_q_norm.weight",)},
        (2, 3),
        _unsupported(tensor="blk.2.attn_q_norm.weight"),
    ),
    "qwen3 with an output bias llama.cpp does not load": (
        {"shape": SHAPES["qwen3"], "extra_tensors": {"blk.1.attn_output.bias": _ones(64)}},
        (1, 2),
        _unsupported(tensor="blk.1.attn_output.bias"),
    ),
    # llama.cpp refuses it ("wrong number of tensors"); it once ran here, the bias added
    "qwen2 with an output bias llama.cpp does not load": (
        {"shape": SHAPES["untied"], "extra_tensors": {"blk.1.attn_output.bias": _ones(64)}},
        (1, 2),
        _unsupported(tensor="blk.1.attn_output.bias"),
    ),
    "qwen2 with a feed-forward bias llama.cpp does not load": (
        {"shape": ModelShape(arch="qwen2"), "extra_tensors": {"blk.1.ffn_down.bias": _ones(64)}},
        (1, 2),
        _unsupported(tensor="blk.1.ffn_down.bias"),
    ),
    "llama feed-forward bias of the wrong width": (
        {"extra_tensors": {"blk.0.ffn_gate.bias": _ones(64)}},
        (0, 1),
        _unsupported(tensor="blk.0.ffn_gate.bias"),
    ),
    "a tensor outside the blocks that llama.cpp does not load": (
        {"extra_tensors": {"token_embd_norm.weight": _ones(64)}},
        (2, 3),
        _unsupported(tensor="token_embd_norm.weight"),
    ),
    "qwen3 with llama3's rope_freqs": (
        {"shape": attrs.evolve(SHAPES["qwen3"], rope_freqs=True)},
        (1, 2),
        _unsupported(tensor="rope_freqs.weight"),
    ),
    "missing gemma3 post-norm": (
        {"shape": SHAPES["gemma3"], "drop_tensors": ("blk.3.post_ffw_norm.weight",)},
        (3, 4),
        _unsupported(tensor="blk.3.post_ffw_norm.weight"),
    ),
    "gemma2 with an output tensor (llama.cpp's gemma2 head is the embedding)": (
        {"shape": attrs.evolve(SHAPES["gemma2"], tied=False)},
        (0, 1),
        _unsupported(tensor="output.weight"),
    ),
    "gemma2 with gemma3's per-head query norm": (
        {"shape": SHAPES["gemma2"], "extra_tensors": {"blk.1.attn_q_norm.weight": _ones(16)}},
        (1, 2),
        _unsupported(tensor="blk.1.attn_q_norm.weight"),
    ),
    "gemma with an output tensor (llama.cpp's gemma head is the embedding)": (
        {"shape": attrs.evolve(SHAPES["gemma"], tied=False)},
        (3, 4),
        _unsupported(tensor="output.weight"),
    ),
    "gemma with gemma2's post-attention norm": (
        {
            "shape": SHAPES["gemma"],
            "extra_tensors": {"blk.2.post_attention_norm.weight": _ones(64)},
        },
        (2, 3),
        _unsupported(tensor="blk.2.post_attention_norm.weight"),
    ),
    "smollm3 with an output bias llama.cpp does not load": (
        {"shape": SHAPES["smollm3"], "extra_tensors": {"blk.3.attn_output.bias": _ones(64)}},
        (3, 4),
        _unsupported(tensor="blk.3.attn_output.bias"),
    ),
    "smollm3 with llama3's rope_freqs": (
        {"shape": attrs.evolve(SHAPES["smollm3"], rope_freqs=True)},
        (1, 2),
        _unsupported(tensor="rope_freqs.weight"),
    ),
    "a negative gemma2 attention soft cap": (
        {"shape": SHAPES["gemma2"], "extra_keys": {"gemma2.attn_logit_softcapping": -50.0}},
        (0, 1),
        {"error": GgufError, "tensor": None, "key": "gemma2.attn_logit_softcapping"},
    ),
    "a gemma2 logit soft cap past float32's range": (
        {
            "shape": SHAPES["gemma2"],
            "override_keys": {"gemma2.final_logit_softcapping": (1e300, GGUFValueType.FLOAT64)},
        },
        (3, 4),
        {"error": GgufError, "tensor": None, "key": "gemma2.final_logit_softcapping"},
    ),
    "gemma3 sliding blocks of another head size": (
        {"shape": SHAPES["gemma3"], "extra_keys": {"gemma3.attention.key_length_swa": 8}},
        (0, 1),
        _unsupported(key="gemma3.attention.key_length_swa"),
    ),
    "phi3 with a gate beside its fused gate/up": (
        {"shape": SHAPES["phi3"], "extra_tensors": {"blk.0.ffn_gate.weight": _ones(128, 64)}},
        (0, 1),
        _unsupported(tensor="blk.0.ffn_gate.weight"),
    ),
    "phi3 with a separate query beside its fused attn_qkv": (
        {"shape": SHAPES["phi3"], "extra_tensors": {"blk.2.attn_q.weight": _ones(64, 64)}},
        (2, 3),
        _unsupported(tensor="blk.2.attn_q.weight"),
    ),
    "LongRoPE factors on an architecture llama.cpp loads none for": (
        {"shape": SHAPES["qwen3"], "extra_tensors": {"rope_factors_long.weight": _ones(16)}},
        (1, 2),
        _unsupported(tensor="rope_factors_long.weight"),
    ),
    "phi3 LongRoPE factors of another length than the rotary pairs": (
        {"shape": SHAPES["phi3"], "extra_tensors": {"rope_factors_short.weight": _ones(5)}},
        (1, 2),
        _unsupported(tensor="rope_factors_short.weight"),
    ),
    "mixture of experts in an architecture without": (
        {"shape": ModelShape(arch="qwen2"), "extra_keys": {"qwen2.expert_count": 8}},
        (0, 4),
        _unsupported(key="qwen2.expert_count"),
    ),
    "llama with an expert count and a dense feed-forward": (
        {"extra_keys": {"llama.expert_count": 8, "llama.expert_used_count": 2}},
        (0, 4),
        _unsupported(tensor="blk.0.ffn_gate.weight"),
    ),
    "qwen3moe without its router": (
        {"shape": MOE, "drop_tensors": ("blk.2.ffn_gate_inp.weight",)},
        (2, 3),
        _unsupported(tensor="blk.2.ffn_gate_inp.weight"),
    ),
    "qwen3moe with a dense feed-forward beside its experts": (
        {"shape": MOE, "extra_tensors": {"blk.1.ffn_down.weight": _ones(64, 128)}},
        (1, 2),
        _unsupported(tensor="blk.1.ffn_down.weight"),
    ),
    "qwen3moe experts of the wrong count": (
        {"shape": MOE, "override_keys": {"qwen3moe.expert_count": (5, GGUFValueType.UINT32)}},
        (0, 1),
        _unsupported(tensor="blk.0.ffn_gate_inp.weight"),
    ),
    "qwen3moe without an expert count": (
        {"shape": MOE, "drop_keys": ("qwen3moe.expert_count",)},
        (0, 4),
        {"error": GgufError, "tensor": None, "key": "qwen3moe.expert_count"},
    ),
    "more experts used than the mixture has": (
        {"shape": MOE, "override_keys": {"qwen3moe.expert_used_count": (5, GGUFValueType.UINT32)}},
        (0, 4),
        {"error": GgufError, "tensor": None, "key": "qwen3moe.expert_used_count"},
    ),
    "qwen2moe without its shared expert's gate": (
        {"shape": QWEN2MOE, "drop_tensors": ("blk.3.ffn_gate_inp_shexp.weight",)},
        (3, 4),
        _unsupported(tensor="blk.3.ffn_gate_inp_shexp.weight"),
    ),
    "qwen2moe without its output tensor (llama.cpp takes no embedding in its place)": (
        {"shape": attrs.evolve(QWEN2MOE, tied=True)},
        (N_LAYERS - 1, N_LAYERS),
        _unsupported(tensor="output.weight"),
    ),
    "qwen2moe with two shared experts": (
        {"shape": QWEN2MOE, "extra_keys": {"qwen2moe.expert_shared_count": 2}},
        (0, 4),
        _unsupported(key="qwen2moe.expert_shared_count"),
    ),
    "expert groups (DeepSeek's)": (
        {"shape": MOE, "extra_keys": {"qwen3moe.expert_group_count": 2}},
        (0, 4),
        _unsupported(key="qwen3moe.expert_group_count"),
    ),
    "shared experts": (
        {"shape": MOE, "extra_keys": {"qwen3moe.expert_shared_count": 1}},
        (0, 4),
        _unsupported(key="qwen3moe.expert_shared_count"),
    ),
    "an expert gating other than the softmax": (
        {"shape": MOE, "extra_keys": {"qwen3moe.expert_gating_func": 2}},
        (0, 4),
        _unsupported(key="qwen3moe.expert_gating_func"),
    ),
    "rope scaling we do not run": (
        {"extra_keys": {"llama.rope.scaling.type": "dynamic"}},
        (0, 4),
        _unsupported(key="llama.rope.scaling.type"),
    ),
    "mistral3 YaRN turns that are not positive": (
        {
            "shape": ModelShape(arch="mistral3", rope_scaling_factor=4.0, rope_scaling="yarn"),
            "extra_keys": {"mistral3.rope.scaling.yarn_beta_slow": -1.0},
        },
        (0, 4),
        _unsupported(key="mistral3.rope.scaling.yarn_beta_slow"),
    ),
    "a mistral3 YaRN log multiplier that makes the attention factor negative": (
        {
            "shape": ModelShape(arch="mistral3", rope_scaling_factor=4.0, rope_scaling="yarn"),
            "extra_keys": {"mistral3.rope.scaling.yarn_log_multiplier": -1e30},
        },
        (0, 4),
        _unsupported(key="mistral3.rope.scaling.yarn_log_multiplier"),
    ),
    "granite without its logit scale (llama.cpp requires it)": (
        {"shape": ModelShape(arch="granite")},
        (0, 4),
        {"error": GgufError, "tensor": None, "key": "granite.logit_scale"},
    ),
    "granite with a logit scale of 0": (
        {
            "shape": ModelShape(arch="granite", logit_scale=16.0),
            "override_keys": {"granite.logit_scale": (0.0, GGUFValueType.FLOAT32)},
        },
        (0, 4),
        _unsupported(key="granite.logit_scale"),
    ),
    "a rope attention factor that is not positive": (
        {"extra_keys": {"llama.rope.scaling.attn_factor": 0.0}},
        (0, 4),
        _unsupported(key="llama.rope.scaling.attn_factor"),
    ),
    "rope scaling factor whose reciprocal float32 cannot hold": (
        {"extra_keys": {"llama.rope.scaling.factor": 1e-39}},
        (0, 4),
        _unsupported(key="llama.rope.scaling.factor"),
    ),
    "an odd rotary dimension count": (
        {"override_keys": {"llama.rope.dimension_count": (7, GGUFValueType.UINT32)}},
        (1, 2),
        _unsupported(key="llama.rope.dimension_count"),
    ),
    # llama.cpp refuses it ("invalid n_rot: 8, expected 16"): llama rotates whole heads
    "a llama rotary dimension count below its head size": (
        {"shape": ModelShape(n_layers=N_LAYERS, rope_dims=8)},
        (1, 2),
        _unsupported(key="llama.rope.dimension_count"),
    ),
    # once named head_count_kv (whose 2 heads are fine): "0 attention heads cannot share
    # 2 key/value heads"
    "a head count of 0": (
        {"override_keys": {"llama.attention.head_count": (0, GGUFValueType.UINT32)}},
        (0, 1),
        {"error": GgufError, "tensor": None, "key": "llama.attention.head_count"},
    ),
    "an embedding length of 0": (
        {"override_keys": {"llama.embedding_length": (0, GGUFValueType.UINT32)}},
        (0, 1),
        {"error": GgufError, "tensor": None, "key": "llama.embedding_length"},
    ),
    "a negative key head size": (
        {"override_keys": {"llama.attention.key_length": (-16, GGUFValueType.INT32)}},
        (2, 3),
        {"error": GgufError, "tensor": None, "key": "llama.attention.key_length"},
    ),
    "a context length past llama.cpp's 32 bits": (
        {"override_keys": {"llama.context_length": (2**40, GGUFValueType.UINT64)}},
        (3, 4),
        {"error": GgufError, "tensor": None, "key": "llama.context_length"},
    ),
    "tensor outside the architecture": (
        {"extra_tensors": {"blk.0.ffn_gate_inp.weight": np.ones((8, 64), np.float32)}},
        (0, 1),
        _unsupported(tensor="blk.0.ffn_gate_inp.weight"),
    ),
}


def write_broken(tmp_path: Path, case: str) -> Path:
    kwargs = dict(BROKEN[case][0])
    shape = kwargs.pop("shape", ModelShape(n_layers=N_LAYERS))
    return write_model(tmp_path / "broken.gguf", shape, **kwargs)


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_file_the_stage_cannot_run_raises_a_typed_error_naming_it(
    tmp_path: Path, case: str
) -> None:
    path = write_broken(tmp_path, case)
    _, (start, end), want = BROKEN[case]
    with pytest.raises(want["error"]) as info:
        open_stage_slice(path, start, end, is_first=start == 0, is_last=end == N_LAYERS)
    message = str(info.value)
    assert str(path) in message
    if isinstance(info.value, UnsupportedModel):
        assert (info.value.tensor, info.value.key) == (want["tensor"], want["key"])
    elif isinstance(info.value, GgufError) and want["key"] is not None:
        assert info.value.key == want["key"]  # not only in the message: head_count_kv holds it
    named = want["tensor"] or want["key"]
    if named is not None:
        assert named in message


#: Cases of ``BROKEN`` whose tensor lies past the first file of a split set of files of
#: 7 tensors (blocks 2 and 3; ``extra_tensors`` are written last).
IN_A_LATER_FILE = [
    "wrong shape",
    "quant type the worker does not run",
    "tensor outside the architecture",
    "a tensor outside the blocks that llama.cpp does not load",
    "gemma with gemma2's post-attention norm",
]


@pytest.mark.parametrize("case", IN_A_LATER_FILE)
def test_an_error_about_a_tensor_names_the_file_of_a_split_set_that_holds_it(
    tmp_path: Path, case: str
) -> None:
    """Not the set's first file, which the error named whatever file held the tensor."""
    kwargs = dict(BROKEN[case][0])
    shape = kwargs.pop("shape", ModelShape(n_layers=N_LAYERS))
    first = write_model(tmp_path / "parts.gguf", shape, split_max_tensors=7, **kwargs)
    _, (start, end), want = BROKEN[case]
    header = GgufHeader.read(first)
    holder = header.paths[header.tensors[want["tensor"]].file_index]
    assert holder != str(first)
    for layers in ((start, end), (0, N_LAYERS)):
        with pytest.raises(UnsupportedModel) as info:
            open_stage_slice(first, *layers, is_first=layers[0] == 0, is_last=end == N_LAYERS)
        assert (info.value.path, info.value.tensor) == (holder, want["tensor"])
        assert str(info.value).startswith(f"{holder} (tensor {want['tensor']!r})")


@pytest.mark.parametrize("case", ["wrong shape", "gemma with gemma2's post-attention norm"])
def test_an_error_about_a_tensor_names_the_shard_that_holds_it(tmp_path: Path, case: str) -> None:
    """Of a model cut in two by ``python -m runplan split`` (blocks 2 and 3 in the second
    shard), read whole through its manifest."""
    path = write_broken(tmp_path, case)
    plan = split_plan(model_facts_from_gguf(path), 2, None, "even")
    assert not isinstance(plan, PlanRejection)
    manifest = split_model(str(path), plan, tmp_path / "cut").manifest_path
    second = os.path.join(tmp_path, "cut", read_manifest(manifest).shards[1].file)
    with pytest.raises(UnsupportedModel) as info:
        open_stage_slice(manifest, 0, N_LAYERS, is_first=True, is_last=True)
    assert (info.value.path, info.value.tensor) == (second, BROKEN[case][2]["tensor"])


@pytest.mark.parametrize(
    "case",
    ["missing block tensor", "wrong shape", "quant type the worker does not run"],
)
def test_other_stages_never_touch_a_broken_tensor(tmp_path: Path, case: str) -> None:
    path = write_broken(tmp_path, case)
    broken_block = BROKEN[case][1][0]
    for start in range(N_LAYERS):
        if start == broken_block:
            continue
        end = start + 1
        with open_stage_slice(path, start, end, is_first=start == 0, is_last=end == N_LAYERS) as s:
            for name in s.tensors:
                assert np.isfinite(s.dequantize(name)).all()


def test_only_the_last_stage_needs_a_required_head(tmp_path: Path) -> None:
    """A qwen2moe file without ``output.weight``: the stages before the last read no
    head (a host given only their shards has none), so they open it; only the last
    stage refuses it."""
    path = write_broken(
        tmp_path, "qwen2moe without its output tensor (llama.cpp takes no embedding in its place)"
    )
    for start in range(N_LAYERS - 1):
        with open_stage_slice(path, start, start + 1, is_first=start == 0, is_last=False) as s:
            assert s.head is None


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_worker_that_cannot_bind_stays_unbound(
    tmp_path: Path, models: dict[str, Path], case: str
) -> None:
    bad = write_broken(tmp_path, case)
    good = provisions(models["tied"], [(0, N_LAYERS)])[0]
    worker = ReferenceWorker()
    worker.configure(good)
    with pytest.raises(WorkerError) as info:
        worker.bind(GgufSource.single(str(bad)))
    assert isinstance(info.value.__cause__, UnsupportedModel | GgufError)
    with pytest.raises(WorkerError, match="before bind"):
        worker.execute_step(0, np.array([1, 2, 3], dtype=np.uint32))
    worker.bind(good.gguf_source)  # the same worker binds a good file afterwards
    assert worker.execute_step(0, np.array([1, 2, 3], dtype=np.uint32)) is not None


def test_a_layer_range_outside_the_model_is_refused(models: dict[str, Path]) -> None:
    for start, end in [(0, 0), (2, 1), (3, 5), (-1, 2)]:
        with pytest.raises(ValueError, match="not a range"):
            open_stage_slice(models["tied"], start, end, is_first=True, is_last=True)
