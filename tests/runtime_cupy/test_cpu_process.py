"""The CPU worker in stage processes: the default worker of ``runtime_cupy.generate`` and
of ``python -m runtime_cupy``; through processes it computes what it computes in one
process; each stage process is told its share of the host's cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import numpy as np
import pytest

from runtime_core.workers.cpu.worker import CPU_CAPABILITIES, CpuWorker
from runtime_cupy import generate
from runtime_cupy.cli.main import build_parser
from runtime_cupy.cli.main import main as cli_main
from runtime_cupy.workers import capabilities
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import provisions, run

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cpu-process") / "q8.gguf"
    return str(write_model(path, ModelShape(n_layers=4, quant="Q8_0", seed=4)))


def test_the_cpu_worker_is_the_default() -> None:
    assert build_parser().parse_args(["--prompt", "hi"]).worker == "cpu"
    assert generate.__kwdefaults__ is not None and generate.__kwdefaults__["worker"] == "cpu"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A mixture of experts (qwen3moe: 4 experts, 2 per row), its 3-d tensors sliced."""
    path = tmp_path_factory.mktemp("cpu-process") / "moe.gguf"
    shape = ModelShape(arch="qwen3moe", n_layers=4, quant="Q8_0", experts=4, experts_used=2)
    return str(write_model(path, shape))


@pytest.mark.parametrize("model", ["q8_model", "moe_model"])
def test_stage_processes_compute_what_one_process_computes(
    model: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model)
    prompt = [5, 17, 42, 9]
    result = generate(path, prompt, stages=2, max_tokens=6, return_logits=True, worker="cpu")
    assert result.outcome == "completed"
    ours = run(provisions(path, 2, max_seq_len=len(prompt) + 6), CpuWorker, prompt, 6)
    assert list(result.tokens) == [o.token_id for o in ours]
    assert result.logits is not None
    for a, b in zip(result.logits, ours, strict=True):
        assert b.logits is not None
        np.testing.assert_array_equal(a, b.logits)


def test_a_float16_kv_cache_is_planned_and_held_as_such_through_processes(q8_model: str) -> None:
    """``kv_dtype="f16"``: the plan counts the caches at 2 bytes an element, and each
    stage process's CPU worker holds them in float16: the bits of one process's workers
    on that plan."""
    prompt = [5, 17, 42, 9]
    result = generate(q8_model, prompt, stages=2, max_tokens=6, return_logits=True,
                      kv_dtype="f16")  # fmt: skip
    assert result.outcome == "completed"
    assert result.plan.model.kv_dtype_width_bytes == 2
    half = attrs.evolve(CPU_CAPABILITIES, kv_bytes_per_element=2)
    ours = run(provisions(q8_model, 2, max_seq_len=len(prompt) + 6, worker=half), CpuWorker,
               prompt, 6)  # fmt: skip
    assert list(result.tokens) == [o.token_id for o in ours]
    assert result.logits is not None
    for a, b in zip(result.logits, ours, strict=True):
        assert b.logits is not None
        np.testing.assert_array_equal(a, b.logits)


def test_the_kv_dtype_flag_halves_the_planned_caches_and_is_refused_where_not_held(
    q8_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def kv_bytes(*flags: str) -> list[int]:
        assert cli_main(["plan", "--model", q8_model, "--stages", "2", "--json", *flags]) == 0
        return [s["kv_bytes"] for s in json.loads(capsys.readouterr().out)["stages"]]

    half = [2 * n for n in kv_bytes("--kv-dtype", "f16")]
    assert kv_bytes() == kv_bytes("--kv-dtype", "f32") == half
    assert capabilities("cpu", "f16").kv_bytes_per_element == 2
    with pytest.raises(ValueError, match="numpy worker holds its KV cache in f32, not f16"):
        capabilities("numpy", "f16")
    with pytest.raises(SystemExit) as exited:
        cli_main(["--prompt", "hi", "--worker", "numpy", "--kv-dtype", "f16"])
    assert exited.value.code == 2
    assert "--kv-dtype: the numpy worker holds its KV cache in f32" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_each_stage_process_is_given_its_share_of_the_cores(
    q8_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pids: list[int] = []
    environs: list[dict[str, str]] = []

    def on_event(kind: str, fields: dict[str, object]) -> None:
        if kind == "spawned":
            pids.append(int(str(fields["pid"])))

    def on_token(_token: int) -> None:
        if not environs:  # every stage process is running by now
            for pid in pids:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                environs.append(dict(e.decode().split("=", 1) for e in raw if b"=" in e))

    generate(q8_model, [1, 2], stages=2, max_tokens=2, on_event=on_event, on_token=on_token)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert [env.get("OMP_NUM_THREADS") for env in environs] == [share, share]
