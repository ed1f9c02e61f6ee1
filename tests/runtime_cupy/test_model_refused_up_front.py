"""A model file no stage could run is refused by the driver, before any stage process
starts: ``generate``, the serving chain (``WarmChain``) and ``python -m runtime_cupy``
raise (exit 2 with) the stages' own typed error naming the key or tensor, where they
once started the processes and reported a stage's setup fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType

from runplan.gguf_error import GgufError
from runtime_core.errors import UnsupportedModel
from runtime_cupy import generate
from runtime_cupy.cli.main import main
from runtime_cupy.serve.chain import WarmChain
from tests.fixtures.gguf_models import ModelShape, write_model

# (how the file is wrong, the error, the key or tensor it names); each passes the
# planner's facts and is refused by the stages' checks (``open_stage_slice``)
UNRUNNABLE: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "odd rotary dimension count": (
        {"override_keys": {"llama.rope.dimension_count": (7, GGUFValueType.UINT32)}},
        UnsupportedModel,
        "llama.rope.dimension_count",
    ),
    "rope scaling no one runs": (
        {"extra_keys": {"llama.rope.scaling.type": "bogus"}},
        UnsupportedModel,
        "llama.rope.scaling.type",
    ),
    "negative norm epsilon": (
        {
            "override_keys": {
                "llama.attention.layer_norm_rms_epsilon": (-1.0, GGUFValueType.FLOAT32)
            }
        },
        GgufError,
        "llama.attention.layer_norm_rms_epsilon",
    ),
    "feed-forward length the tensors do not have": (
        {"override_keys": {"llama.feed_forward_length": (96, GGUFValueType.UINT32)}},
        UnsupportedModel,
        "blk.0.ffn_gate.weight",
    ),
    # once refused blaming a tensor's shape, not the key
    **{
        f"feed-forward length {name}": (
            {"override_keys": {"llama.feed_forward_length": value}},
            GgufError,
            f"llama.feed_forward_length'): {shown}: it must be in 1..4294967295",
        )
        for name, value, shown in (
            ("0", (0, GGUFValueType.UINT32), "0"),
            ("0 in a block", ([128, 0, 128, 128], GGUFValueType.ARRAY), "block 1's 0"),
            ("-1 in a block", ([128, -1, 128, 128], GGUFValueType.ARRAY), "block 1's -1"),
        )
    },
    # stored as another type than llama.cpp's UINT32, which llama.cpp refuses
    **{
        f"feed-forward length {name}": (
            {"override_keys": {"llama.feed_forward_length": value}},
            GgufError,
            f"llama.feed_forward_length'): expected a UINT32 (llama.cpp reads this key as "
            f"one and refuses another type), found a {value[1].name} ({value[0]})",
        )
        for name, value in (
            ("-1", (-1, GGUFValueType.INT32)),
            ("2**40", (2**40, GGUFValueType.UINT64)),
            ("-2**63", (-(2**63), GGUFValueType.INT64)),
        )
    },
    "missing block tensor of the last stage": (
        {"drop_tensors": ("blk.3.ffn_down.weight",)},
        UnsupportedModel,
        "blk.3.ffn_down.weight",
    ),
}


class NoStarts:
    """A host port that fails the test if asked to start a stage."""

    def start(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a stage process was started")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the host was asked for {name!r}")


def write_unrunnable(tmp_path: Path, case: str) -> str:
    kwargs = UNRUNNABLE[case][0]
    return str(write_model(tmp_path / "unrunnable.gguf", ModelShape(n_layers=4), **kwargs))


@pytest.mark.parametrize("case", sorted(UNRUNNABLE))
def test_generate_refuses_it_before_any_process(tmp_path: Path, case: str) -> None:
    path = write_unrunnable(tmp_path, case)
    _, error, named = UNRUNNABLE[case]
    with pytest.raises(error) as info:
        generate(path, [1, 2, 3], stages=2, max_tokens=2, host=NoStarts())  # type: ignore[arg-type]
    assert named in str(info.value) and path in str(info.value)


@pytest.mark.parametrize(
    "case", ["odd rotary dimension count", "missing block tensor of the last stage"]
)
def test_the_serving_chain_refuses_it_before_any_process(tmp_path: Path, case: str) -> None:
    path = write_unrunnable(tmp_path, case)
    _, error, named = UNRUNNABLE[case]
    with pytest.raises(error, match=named.replace(".", r"\.")):
        WarmChain(path, stages=2, context=32, host=NoStarts())  # type: ignore[arg-type]


def test_the_cli_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_unrunnable(tmp_path, "odd rotary dimension count")
    assert main(["--model", path, "--prompt-ids", "1,2", "--max-tokens", "2", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "UnsupportedModel"
    assert "llama.rope.dimension_count" in error["message"]


def test_rows_the_compiled_workers_cannot_read_are_refused_naming_the_tensor(
    tmp_path: Path,
) -> None:
    """A float model whose feed-forward width (100) is not a multiple of 32: the CPU
    worker makes its activations 8-bit 32 elements at a time, so ``ffn_down``'s rows of
    100 are refused up front (they failed each stage's bind, blaming "the CUDA
    kernels"); the NumPy reference worker, which has no such rule, runs the file."""
    path = str(write_model(tmp_path / "ffn100.gguf", ModelShape(n_layers=2, ffn=100)))
    with pytest.raises(UnsupportedModel, match="rows of 100 elements") as info:
        generate(path, [1, 2, 3], max_tokens=2, worker="cpu", host=NoStarts())  # type: ignore[arg-type]
    assert "blk.0.ffn_down.weight" in str(info.value)
    from runtime_sim.api import generate as simulate

    assert len(simulate(path, [1, 2, 3], max_tokens=2, worker="numpy").tokens) == 2
