"""The CPU worker (``CpuWorker``) as a ``Worker``: the interface's rules, what it tells
the planner, how it holds a model, and what it computes however a run is split.

- Capabilities: the 15 types, every architecture of the reference worker, weights
  as stored (the planner's memory check counts the file's bytes, not float32 copies).
- Interface: ``tests/runtime_core/workers/test_worker_contract.py`` (every worker);
  here, rows the kernels cannot read are refused at bind, and any head size binds.
- Memory: binding maps the weights of a type without an x8 layout from the file: the
  process's anonymous memory grows by far less than the slice's bytes, its file-backed
  memory by about the slice.
- Numbers: ``matvec="f32"`` gives the reference worker's logits within 2e-4 (mixed
  types, biases, tied and untied heads, rope factors, qwen3's and phi3's blocks;
  gemma3's within 5e-3: its GELU is llama.cpp's table of halves, the reference's the
  exact function); the same logits bit for bit on 1, 2 or 3 threads, in 1, 2 or 3
  stages with f32 edges (f16 edges: the same tokens), and for a prompt prefilled at
  once or fed one row at a time, on every architecture, and on every instruction set
  (the portable one's bits; ``CpuWorker(isa=...)``, a set this processor lacks skipped
  with the reason, and refused as an option naming it); an f16 KV cache stays within
  cosine 0.9999 of the f32 one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

import runtime_core.workers.cpu.ops as cpu_ops
from runplan.config import REFERENCE_ARCHITECTURES
from runplan.quant_types import QUANT_TYPES
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.backend import CpuBackend
from runtime_core.workers.cpu.worker import CPU_CAPABILITIES, CpuWorker
from runtime_core.workers.interface import BatchStep, TokenOutput, WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_core.workers.stage_worker import BackendSpec, BackendStep
from runtime_cupy.workers import capabilities, make_worker
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model
from tests.fixtures.llamacpp_fixtures import load_doc, model_file
from tests.support.chain import Chain, provisions, run
from tests.support.cpu_isas import HOST_ISAS, isa_params
from tests.support.kernel_spy import KernelSpy
from tests.support.numerics import cosine
from tests.support.random_model import RandomModel, write_random_model

PROMPT = [5, 77, 300, 12, 9]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-models")


def logits(out: TokenOutput) -> np.ndarray:
    assert out.logits is not None
    return out.logits


# ---- what it tells the planner ---------------------------------------------------------------


def test_the_cpu_worker_runs_every_type_and_keeps_weights_as_stored() -> None:
    caps = capabilities("cpu")
    assert caps == CPU_CAPABILITIES and caps.name == "cpu"
    assert set(caps.quant_types) == set(QUANT_TYPES) and len(caps.quant_types) == 15
    assert caps.architectures == REFERENCE_ARCHITECTURES  # every one the reference runs
    assert caps.weight_bytes_per_element == 0  # as stored
    assert caps.kv_bytes_per_element == 0  # the activation dtype
    assert isinstance(make_worker("cpu"), CpuWorker)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="matvec"):
        CpuWorker(matvec="int4")
    with pytest.raises(ValueError, match="kv_dtype"):
        CpuWorker(kv_dtype="f8")
    for threads in (0, -1, True, 2.5, 2.0, "2"):
        # 2.5, 2.0 and "2" passed here, then failed at bind with a bare TypeError
        with pytest.raises(ValueError, match=re.escape(f"threads {threads!r} is not a positive")):
            CpuWorker(threads=threads)  # type: ignore[arg-type]
    assert CpuWorker(threads=np.int64(2)).threads == 2
    known = r"portable, avx2, avxvnni, avx512bw, avx512, avx512-zen4, avx512-intel \("
    with pytest.raises(ValueError, match=f"isa 'avx9000' is not one of {known}"):
        CpuWorker(isa="avx9000")
    for lacking in (n for n in _kernels.KNOWN_ISAS if n not in HOST_ISAS):
        with pytest.raises(ValueError, match=f"isa '{lacking}' is not one this processor runs"):
            CpuWorker(isa=lacking)


def test_the_instruction_set_is_the_best_the_processor_runs_unless_named() -> None:
    assert CpuWorker().isa == HOST_ISAS[-1]
    assert [CpuWorker(isa=n).isa for n in HOST_ISAS] == list(HOST_ISAS)


def _kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Every ``_kernels.linear`` and ``attention`` call of stages bound from now on (made
    at once or recorded into a step program), as (kernel, its ``isa=``)."""
    calls: list[tuple[str, str | None]] = []

    def seen(name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if name in ("linear", "attention"):
            calls.append((name, kw.get("isa")))

    monkeypatch.setattr(cpu_ops, "_kernels", KernelSpy(seen))
    return calls


@pytest.mark.parametrize("isa", [None, *isa_params()])
def test_every_kernel_call_names_the_workers_instruction_set(
    folder: Path, monkeypatch: pytest.MonkeyPatch, isa: str | None
) -> None:
    """The option reaches the kernels (the sets compute the same bits, so only the calls
    show it): built by the registry, as a stage process builds it (``make_worker(name,
    trace)``: the best set, the trace kept), or by hand with ``isa=`` and ``trace=``; on
    the batched interface (``open_run``, ``execute_batch``) and the single-run path."""
    path = write_model(folder / "isa-calls.gguf", ModelShape(n_layers=2))
    (prov,) = provisions(path, 1, max_seq_len=16)
    events: list[str] = []

    def trace(name: str, **fields: Any) -> None:
        events.append(name)

    w = make_worker("cpu", trace) if isa is None else CpuWorker(isa=isa, trace=trace)
    assert isinstance(w, CpuWorker) and w.trace is trace
    expected = HOST_ISAS[-1] if isa is None else isa
    assert w.isa == expected
    calls = _kernel_calls(monkeypatch)
    w.configure(prov)
    w.bind(prov.gguf_source)
    w.open_run(prov)
    (out,) = w.execute_batch([BatchStep(prov.run_id, 0, 0, 1, np.array(PROMPT, np.uint32))])
    assert isinstance(out, TokenOutput)
    w.execute_step(0, np.array(PROMPT[:2], np.uint32))
    w.release()
    assert {kernel for kernel, _ in calls} == {"linear", "attention"}
    assert {named for _, named in calls} == {expected}


def test_the_threads_default_to_the_launchers_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert CpuWorker().threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert CpuWorker().threads >= 1


@pytest.mark.parametrize(("env", "arg", "named"), [("5000", None, "OMP_NUM_THREADS 5000"),
                                                    (None, 2000, "threads 2000")])  # fmt: skip
def test_threads_past_the_kernels_bound_are_refused_at_bind_naming_their_source(
    folder: Path, monkeypatch: pytest.MonkeyPatch, env: str | None, arg: int | None, named: str
) -> None:
    """The kernels run 1..1024 threads: past it, the bind said "threads 5000 is not in
    1..1024", naming neither the variable nor the argument it came from."""
    if env is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    path = write_model(folder / "t.gguf", ModelShape(n_layers=1))
    w = CpuWorker(threads=arg)
    w.configure(provisions(path)[0])
    with pytest.raises(WorkerError, match=f"{named}: the CPU worker runs 1..1024 threads"):
        w.bind(provisions(path)[0].gguf_source)


# ---- the worker interface -------------------------------------------------------------------


def test_rows_the_kernels_cannot_read_are_refused_at_bind(folder: Path) -> None:
    path = write_model(folder / "h48.gguf", ModelShape(n_layers=1, hidden=48, heads=4, heads_kv=2))
    w = CpuWorker()
    w.configure(provisions(path)[0])
    with pytest.raises(WorkerError, match="rows 32 elements at a time"):
        w.bind(provisions(path)[0].gguf_source)


def test_any_head_size_binds(folder: Path) -> None:
    path = write_model(
        folder / "h512.gguf", ModelShape(n_layers=1, hidden=512, heads=1, heads_kv=1)
    )
    ref = run(provisions(path, 1, max_seq_len=16), ReferenceWorker, PROMPT, 2)
    ours = run(provisions(path, 1, max_seq_len=16), CpuWorker, PROMPT, 2)
    assert [o.token_id for o in ours] == [o.token_id for o in ref]


# ---- memory ---------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_binding_maps_the_weights_instead_of_copying_them(folder: Path) -> None:
    """The stage's weights stay the file's mapped pages: what the process comes to hold of
    its own after a bind and a prefill is under a tenth of the file beyond the step
    buffers the backend keeps (written at bind: ``CpuOps.kept_bytes``)."""
    # F16 has no x8 layout (test_cpu_repack.py: every quantized type repacks, a copy)
    path = write_random_model(
        folder / "big.gguf",
        RandomModel(n_layers=4, hidden=1024, ffn=2816, heads=8, heads_kv=2, vocab=4096,
                    qtype="F16", seed=3),
    )  # fmt: skip
    stored = sum(f.stat().st_size for f in [path])  # the whole file: every tensor is this stage's
    anon0, file0 = _status_kib("RssAnon"), _status_kib("RssFile")
    backend = CpuBackend(BackendSpec(True, True, np.dtype(np.float32), "f32", "q8"), 2)
    with open_stage_slice(path, 0, 4, is_first=True, is_last=True,
                          capabilities=CpuWorker.capabilities) as stage:  # fmt: skip
        backend.load(stage, 32, None)
    ids = np.array(PROMPT, np.int32)
    backend.run_batch([BackendStep(backend.new_cache(32), ids, len(ids), 0, True, True)])
    anon, mapped = (_status_kib("RssAnon") - anon0) * 1024, (_status_kib("RssFile") - file0) * 1024
    assert backend.ops is not None
    kept = backend.ops.kept_bytes
    backend.release()
    assert kept > 0  # (written at bind, maybe into pages the process held already)
    assert anon < 0.1 * stored + kept, (anon, kept, stored)
    assert mapped > 0.9 * stored, (mapped, stored)


# ---- numbers ---------------------------------------------------------------------------------

MIXED = RandomModel(
    n_layers=2,
    qtype="Q4_0",
    embed_qtype="Q6_K",
    head_qtype="Q5_K",
    seed=7,
    overrides=(
        ("blk.0.attn_k.weight", "Q6_K"),
        ("blk.0.attn_v.weight", "Q8_0"),
        ("blk.1.ffn_up.weight", "Q5_1"),
        ("blk.1.ffn_down.weight", "Q3_K"),
        ("blk.1.attn_output.weight", "F16"),
        ("blk.1.attn_q.weight", "BF16"),
    ),
)
#: qwen3, gemma3 (five sliding blocks of 20 positions and a global one) and phi3: the
#: fixtures' shapes of several blocks, in Q8_0 (8-bit products of every step)
ARCH_NAMES = ["qwen3-3", "gemma3-6", "phi3-3"]
NAMES = ["llama-F32-untied", "qwen2-Q4_K", "llama-Q8_0-rope", "mixed-types", *ARCH_NAMES]


@pytest.fixture(scope="module")
def shapes(folder: Path) -> dict[str, Path]:
    rope = ModelShape(n_layers=2, quant="Q8_0", rope_freqs=True, rope_scaling_factor=4.0, seed=6)
    qwen2 = RandomModel(arch="qwen2", n_layers=2, qtype="Q4_K", tied=True, seed=5)
    return {
        "llama-F32-untied": write_model(folder / "f32.gguf", ModelShape(n_layers=3, tied=False)),
        "qwen2-Q4_K": write_random_model(folder / "qwen2-q4k.gguf", qwen2),
        "llama-Q8_0-rope": write_model(folder / "rope.gguf", rope),
        "mixed-types": write_random_model(folder / "mixed.gguf", MIXED),
        **{
            name: write_model(
                folder / f"{name}.gguf", attrs.evolve(FIXTURE_SHAPES[name], quant="Q8_0")
            )
            for name in ARCH_NAMES
        },
    }


@pytest.mark.parametrize("name", NAMES)
def test_float_mode_gives_the_reference_workers_tokens_and_logits(
    shapes: dict[str, Path], name: str
) -> None:
    provs = provisions(shapes[name], 1, max_seq_len=64)
    ref = run(provs, ReferenceWorker, PROMPT, 8)
    ours = run(provs, lambda: CpuWorker(matvec="f32"), PROMPT, 8)
    assert [o.token_id for o in ours] == [o.token_id for o in ref]
    atol = 5e-3 if name.startswith("gemma3") else 2e-4  # its GELU: a table of halves
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(logits(a), logits(b), rtol=0, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_8bit_mode_stays_close_to_the_reference(shapes: dict[str, Path], name: str) -> None:
    provs = provisions(shapes[name], 1, max_seq_len=64)
    ref = run(provs, ReferenceWorker, PROMPT, 1)
    ours = run(provs, CpuWorker, PROMPT, 1)
    assert cosine(logits(ours[0]), logits(ref[0])) >= 0.999


@pytest.mark.parametrize("name", NAMES)
def test_the_thread_count_changes_no_bit(shapes: dict[str, Path], name: str) -> None:
    provs = provisions(shapes[name], 1, max_seq_len=64)
    runs = [run(provs, lambda t=t: CpuWorker(threads=t), PROMPT, 6) for t in (1, 2, 3)]
    for other in runs[1:]:
        for a, b in zip(other, runs[0], strict=True):
            assert a.token_id == b.token_id
            np.testing.assert_array_equal(logits(a), logits(b))


@pytest.mark.parametrize("isa", isa_params(portable=False))
@pytest.mark.parametrize("name", NAMES)
def test_the_instruction_set_changes_no_bit(shapes: dict[str, Path], name: str, isa: str) -> None:
    provs = provisions(shapes[name], 1, max_seq_len=64)
    portable = run(provs, lambda: CpuWorker(isa="portable", threads=2), PROMPT, 6)
    ours = run(provs, lambda: CpuWorker(isa=isa, threads=2), PROMPT, 6)
    for a, b in zip(ours, portable, strict=True):
        assert a.token_id == b.token_id
        np.testing.assert_array_equal(logits(a), logits(b))


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_stages_with_f32_edges_compute_what_one_stage_computes(
    shapes: dict[str, Path], name: str, mode: str
) -> None:
    splits = (1, 2, 3) if name in ("llama-F32-untied", *ARCH_NAMES) else (1, 2)  # 3+ blocks
    runs = [
        run(provisions(shapes[name], s, max_seq_len=64), lambda: CpuWorker(matvec=mode), PROMPT, 8)
        for s in splits
    ]
    for other in runs[1:]:
        assert [o.token_id for o in other] == [o.token_id for o in runs[0]]
        for a, b in zip(other, runs[0], strict=True):
            np.testing.assert_array_equal(logits(a), logits(b))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_stages_with_2_byte_edges_keep_the_tokens(folder: Path, dtype: str) -> None:
    entry = next(m for m in load_doc("tiny")["models"] if m["name"] == "tiny-llama-rope-F32")
    path = model_file(entry, folder)  # three blocks, no near-tie in these 8 steps
    one = run(provisions(path, 1, max_seq_len=64, dtype=dtype), CpuWorker, PROMPT, 8)
    three = run(provisions(path, 3, max_seq_len=64, dtype=dtype), CpuWorker, PROMPT, 8)
    assert [o.token_id for o in three] == [o.token_id for o in one]
    for a, b in zip(three, one, strict=True):
        assert cosine(logits(a), logits(b)) >= 0.9999


@pytest.mark.parametrize("name", NAMES)
def test_a_prefill_computes_what_feeding_the_prompt_row_by_row_computes(
    shapes: dict[str, Path], name: str
) -> None:
    (prov,) = provisions(shapes[name], 1, max_seq_len=64)
    whole, rows = CpuWorker(), CpuWorker()
    for w in (whole, rows):
        w.configure(prov)
        w.bind(prov.gguf_source)
    at_once = whole.execute_step(0, np.array(PROMPT, np.uint32))
    out = rows.execute_step(0, np.array(PROMPT[:1], np.uint32))
    for k, token in enumerate(PROMPT[1:], start=1):
        out = rows.execute_step(k, np.array([token], np.uint32))
    assert isinstance(at_once, TokenOutput) and isinstance(out, TokenOutput)
    np.testing.assert_array_equal(logits(out), logits(at_once))


def test_the_kv_cache_is_held_at_the_width_the_plan_counted(shapes: dict[str, Path]) -> None:
    """``kv_dtype="auto"``: the cache in the dtype of the plan's
    ``kv_dtype_width_bytes`` (float16 for a worker planned at 2 bytes a KV element,
    whatever the activations' width): the bits of a worker told ``f16``; a worker
    told a wider dtype than the plan counted is refused at bind (the stage's KV budget
    would not hold it), a narrower one is taken."""
    path = shapes["llama-Q8_0-rope"]
    half = attrs.evolve(CPU_CAPABILITIES, kv_bytes_per_element=2)
    counted_f16 = provisions(path, 2, max_seq_len=64, worker=half)
    counted_f32 = provisions(path, 2, max_seq_len=64, worker=CPU_CAPABILITIES)
    assert [p.model.kv_dtype_width_bytes for p in counted_f16] == [2, 2]
    assert counted_f16[0].kv_bytes * 2 == counted_f32[0].kv_bytes
    auto = run(counted_f16, CpuWorker, PROMPT, 6)
    told = run(counted_f32, lambda: CpuWorker(kv_dtype="f16"), PROMPT, 6)
    wide = run(counted_f32, CpuWorker, PROMPT, 6)
    assert [o.token_id for o in auto] == [o.token_id for o in told]
    for a, b in zip(auto, told, strict=True):
        np.testing.assert_array_equal(logits(a), logits(b))
    assert any(not np.array_equal(logits(a), logits(b)) for a, b in zip(auto, wide, strict=True))
    worker = CpuWorker(kv_dtype="f32")
    worker.configure(counted_f16[0])
    with pytest.raises(WorkerError, match="kv_dtype 'f32' takes 4 bytes an element"):
        worker.bind(counted_f16[0].gguf_source)


@pytest.mark.parametrize("name", ["qwen2-Q4_K", "llama-Q8_0-rope"])
def test_an_f16_kv_cache_stays_close_to_the_f32_one(shapes: dict[str, Path], name: str) -> None:
    # Float activations: 8-bit rounding would amplify the cache's rounding (a change of
    # one unit in the last place anywhere moves later roundings; see test_cpu_llamacpp).
    provs = provisions(shapes[name], 1, max_seq_len=64)
    f32 = run(provs, lambda: CpuWorker(matvec="f32", kv_dtype="f32"), PROMPT, 8)
    chain = Chain.bind(provs, lambda: CpuWorker(matvec="f32", kv_dtype="f16"))
    f16 = [chain.step(0, np.array(PROMPT, np.uint32))]  # fed f32's tokens: same inputs
    f16 += [chain.step(k, np.array([f32[k - 1].token_id], np.uint32)) for k in range(1, 8)]
    chain.release()
    for a, b in zip(f16, f32, strict=True):
        assert cosine(logits(a), logits(b)) >= 0.9999
