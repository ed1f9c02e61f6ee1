"""``runtime_cupy.generate``: real stage processes give the simulator's tokens, stream
them, stop at EOS and ``max_tokens``, and leave nothing behind. Every comparison of
tokens names its worker: the reference worker (``numpy``) computes what the simulator
computes; the default CPU worker rounds activations to 8 bits as llama.cpp does, so it
is compared with the simulator running the CPU worker, and with its own in-process chain
(``tests/runtime_core/workers/cpu/``)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runtime_cupy
import runtime_sim
from runtime_cupy import generate
from tests.fixtures.llamacpp_fixtures import load_doc
from tests.support.hygiene import alive, run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _assert_clean(result: runtime_cupy.GenerateResult) -> None:
    assert len(result.stages) == result.plan.stage_count
    for stage in result.stages:
        assert stage.returncode is not None, f"stage {stage.stage_index} not reaped"
        assert not alive(stage.pid)
    assert run_resources(result.chain_id) == []


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_logits_are_the_simulators(tiny: str, stages: int) -> None:
    prompt = [5, 17, 42, 9]
    sim = runtime_sim.generate(tiny, prompt, stages=stages, max_tokens=8, return_logits=True)
    real = generate(tiny, prompt, stages=stages, max_tokens=8, return_logits=True, worker="numpy")
    assert real.outcome == sim.outcome == "completed"
    assert real.tokens == sim.tokens and len(real.tokens) == 8
    assert real.text == sim.text
    assert real.logits is not None and sim.logits is not None
    for a, b in zip(real.logits, sim.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert all(s.returncode == 0 for s in real.stages)  # each stopped on StopRun
    _assert_clean(real)


def test_the_simulator_running_the_cpu_worker_gives_the_process_runtimes_tokens(
    tiny: str,
) -> None:
    # The same worker on the same plan (f32 edges, one KV cache length) computes the same
    # bits in one simulated thread as in stage processes: its results depend on neither
    # the thread count nor the process, so logits are compared exactly.
    prompt = [5, 17, 42, 9]
    kwargs = {"stages": 2, "max_tokens": 8, "return_logits": True, "worker": "cpu"}
    sim = runtime_sim.generate(tiny, prompt, **kwargs)  # type: ignore[arg-type]
    real = generate(tiny, prompt, **kwargs)  # type: ignore[arg-type]
    assert real.outcome == sim.outcome == "completed"
    assert real.tokens == sim.tokens and len(real.tokens) == 8
    assert real.logits is not None and sim.logits is not None
    for a, b in zip(real.logits, sim.logits, strict=True):
        np.testing.assert_array_equal(a, b)
    sampled = {"stages": 3, "max_tokens": 10, "temperature": 1.3, "top_k": 40, "seed": 5}
    sim = runtime_sim.generate(tiny, [3, 4], worker="cpu", **sampled)  # type: ignore[arg-type]
    real = generate(tiny, [3, 4], worker="cpu", **sampled)  # type: ignore[arg-type]
    assert real.tokens == sim.tokens
    _assert_clean(real)


def test_sampled_tokens_are_the_simulators(tiny: str) -> None:
    kwargs = {"stages": 2, "max_tokens": 10, "temperature": 1.3, "top_k": 40, "top_p": 0.95}
    sim = runtime_sim.generate(tiny, [3, 4], seed=11, **kwargs)  # type: ignore[arg-type]
    real = generate(tiny, [3, 4], seed=11, worker="numpy", **kwargs)  # type: ignore[arg-type]
    assert real.tokens == sim.tokens
    other = generate(tiny, [3, 4], seed=12, worker="numpy", **kwargs)  # type: ignore[arg-type]
    assert other.tokens != real.tokens  # the seed does reach the last stage's sampler
    _assert_clean(real)


def test_smollm2_through_three_processes_is_the_simulators(smollm2_path: str) -> None:
    (france,) = [p for p in load_doc("smollm2")["prompts"] if p["name"] == "france"]
    sim = runtime_sim.generate(smollm2_path, france["token_ids"], stages=3, max_tokens=8)
    real = generate(smollm2_path, france["token_ids"], stages=3, max_tokens=8, worker="numpy")
    assert real.outcome == "completed"
    assert real.tokens == sim.tokens and len(real.tokens) == 8
    assert real.text.startswith(" Paris.")
    _assert_clean(real)


def test_eos_ends_the_run_and_is_not_returned(tiny: str) -> None:
    # A seed for which the simulator samples EOS before max_tokens (searched, not
    # assumed); the process runtime must stop at the same place.
    kwargs = {"stages": 2, "max_tokens": 40, "temperature": 4.0}
    prompt = [1, 2]
    for seed in range(60):
        sim = runtime_sim.generate(tiny, prompt, seed=seed, **kwargs)  # type: ignore[arg-type]
        if len(sim.tokens) < 40:
            break
    else:
        pytest.fail("no seed in 0..59 samples EOS within 40 tokens")
    eos = sim.plan.model.eos_token_id
    streamed: list[int] = []
    real = generate(
        tiny,
        prompt,
        seed=seed,
        on_token=streamed.append,
        worker="numpy",
        **kwargs,  # type: ignore[arg-type]
    )
    assert real.outcome == "completed"
    assert real.tokens == sim.tokens and eos not in real.tokens
    assert streamed == list(real.tokens)
    _assert_clean(real)


def test_tokens_stream_as_they_arrive_and_max_tokens_holds(tiny: str) -> None:
    seen: list[int] = []
    result = generate(tiny, [1, 2, 3], stages=2, max_tokens=5, on_token=seen.append)
    assert seen == list(result.tokens) and len(seen) == 5
    assert result.ttft_us is not None and result.tpot_us is not None and result.tpot_us > 0
    assert result.load_s is not None and 0 < result.load_s < result.wall_s


def test_stage_processes_are_recognisable_in_ps(tiny: str) -> None:
    pids: list[int] = []
    cmdlines: dict[int, str] = {}

    def on_event(kind: str, fields: dict[str, object]) -> None:
        if kind == "spawned":
            pids.append(int(str(fields["pid"])))

    def on_token(_token: int) -> None:  # every stage process is running by now
        for pid in pids:
            cmdlines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    result = generate(tiny, [1], stages=2, max_tokens=2, on_event=on_event, on_token=on_token)
    assert sorted(cmdlines) == sorted(s.pid for s in result.stages)
    for line in cmdlines.values():
        assert "runtime_cupy" in line and "stage" in line
        assert "-m runtime_cupy.process.stage_process" in line


def test_generate_has_the_simulators_signature_and_result() -> None:
    sim = inspect.signature(runtime_sim.generate).parameters
    real = inspect.signature(runtime_cupy.generate).parameters
    for name, param in sim.items():
        if name == "timing":  # the simulator's timing model: nothing to model here
            continue
        assert name in real, name
        if name != "worker":  # each runtime's default: the simulator's is the reference
            assert real[name].default == param.default, name
        assert real[name].kind == param.kind, name
    assert list(real)[: len(sim) - 1] == [n for n in sim if n != "timing"]
    shared = {"tokens", "text", "outcome", "logits", "fault", "plan", "wall_s", "trace"}
    sim_fields = {f.name for f in runtime_sim.GenerateResult.__attrs_attrs__}
    real_fields = {f.name for f in runtime_cupy.GenerateResult.__attrs_attrs__}
    assert shared <= sim_fields and shared <= real_fields
    assert "wall_decode_tokens_per_s" in sim_fields & real_fields


def test_more_stages_than_layers_is_a_plan_rejection(tiny: str) -> None:
    with pytest.raises(runtime_cupy.PlanRejected) as err:
        generate(tiny, [1], stages=5)
    assert err.value.rejection.code == "invalid_stage_count"


@pytest.mark.parametrize("stages", [0, -1])
def test_fewer_than_one_stage_is_a_plan_rejection_naming_the_count(tiny: str, stages: int) -> None:
    with pytest.raises(runtime_cupy.PlanRejected) as err:
        generate(tiny, [1], stages=stages)
    assert err.value.rejection.code == "invalid_stage_count"
    assert err.value.rejection.stage_count == stages
    assert f"stage_count {stages}:" in str(err.value)


def test_the_cuda_worker_without_cupy_is_a_typed_error(tiny: str) -> None:
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("CuPy is installed here")
    with pytest.raises(runtime_cupy.WorkerUnavailable, match="CuPy"):
        generate(tiny, [1], stages=1, worker="cuda")


def test_an_end_of_turn_other_than_eos_ends_the_answer(smollm2_path: str, tmp_path: Path) -> None:
    """A chat model whose ``eos_token_id`` is not the token that ends its turns (Phi-3's
    ``<|endoftext|>`` beside ``<|end|>``; here SmolLM2 with its eos set to
    ``<|endoftext|>``, its turns still ending with ``<|im_end|>``): the answer ends at
    the end of turn, as llama.cpp's does (it once ran on into a made-up dialogue)."""
    import shutil

    from gguf import GGUFReader

    from runtime_core.tokenizer import Tokenizer

    changed = tmp_path / "eos0.gguf"
    shutil.copyfile(smollm2_path, changed)
    reader = GGUFReader(changed, "r+")
    reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0] = 0  # <|endoftext|>
    del reader
    tok = Tokenizer.from_gguf(changed)
    assert tok.token_text(0) == "<|endoftext|>" and tok.eos_id == 0
    prompt = tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    stock = generate(smollm2_path, prompt, max_tokens=40)
    assert stock.outcome == "completed" and len(stock.tokens) < 40  # ended at <|im_end|>
    ours = generate(changed, prompt, max_tokens=40)
    assert ours.outcome == "completed"
    assert ours.tokens == stock.tokens
    assert tok.eog_ids >= {0, tok.vocab.ids["<|im_end|>"]}
    assert ours.plan.model.end_token_ids == tok.eog_ids
    _assert_clean(ours)


@pytest.mark.parametrize("prompt", [[], [1, 10**8]], ids=["empty", "outside"])
def test_a_prompt_no_run_can_take_is_refused_before_any_stage_starts(
    tiny: str, prompt: list[int]
) -> None:
    """An empty prompt or an id outside the vocabulary: ``PromptError`` before a stage
    process starts (it started every stage, then killed them after seconds)."""
    from runplan.fsm.orchestrator_machine import PromptError
    from runtime_cupy.hosts.local import LocalProcessHost

    class Counting(LocalProcessHost):
        started = 0

        def start(self, launch: Any, secret: bytes) -> Any:
            Counting.started += 1
            return super().start(launch, secret)

    with pytest.raises(PromptError):
        generate(tiny, prompt, host=Counting())
    assert Counting.started == 0
