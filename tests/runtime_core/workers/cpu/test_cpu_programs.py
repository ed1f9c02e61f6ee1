"""Step programs (``_kernels.Program``, ``csrc/program.c``): a stage's kernel calls for a
shape of step, recorded once and run again at every step of that shape by one call.

A chain of CPU workers running several runs (prefills in chunks beside other runs'
decode rows, past a sliding window) computes with its programs exactly what it computes
making every call from Python: tokens, logits and each stage's output rows, bit for bit,
on every architecture's optional steps. A program refuses what its calls refuse, at
every run (positions past the rotations or the ring, a cache of other heads, a token id
outside the table) and before any of its calls is made.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from runplan import SamplingConfig
from runtime_core import activations
from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.ops import CpuOps
from runtime_core.workers.cpu.worker import CpuWorker
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model
from tests.support.chain import Chain, provisions

#: the architectures' optional steps: Q/K/V biases (qwen2), per-head Q/K norms (qwen3),
#: a sliding block, post-norms, GELU gating, the embedding scale and a logit soft cap
#: (gemma3), fused products and partial rotary (phi3)
#: (of two blocks: one per stage)
SHAPES = {
    name: attrs.evolve(FIXTURE_SHAPES[name], n_layers=2)
    for name in ("llama", "qwen2", "qwen3", "phi3")
}
SHAPES["gemma3"] = attrs.evolve(FIXTURE_SHAPES["gemma3"], final_logit_softcap=30.0)
#: float weights, whose activations are rounded to half or bfloat16 (``_kernels.round``)
SHAPES["llama-F16"] = attrs.evolve(SHAPES["llama"], quant="F16")
SHAPES["llama-BF16"] = attrs.evolve(SHAPES["llama"], quant="BF16")
PROGRAM = CpuOps.program
#: prompts of 14, 16 and 18 tokens: past gemma3's window of 12
PROMPTS = [[(5 * k + 3 * j) % 200 + 1 for j in range(14 + 2 * k)] for k in range(3)]


def three_runs(path: Path, programs: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    """Each run's 5 (token, logits bits) and the first stage's output rows on a 2-stage chain,
    the runs joining one batch after another with prompts in chunks of 3 (run 1 samples);
    and how many steps ran a program."""
    used = [0]

    def counted(self: CpuOps, *args: Any) -> Any:
        made = PROGRAM(self, *args) if programs else None
        used[0] += made is not None
        return made

    monkeypatch.setattr(CpuOps, "program", counted)
    provs = {
        k: provisions(path, 2, max_seq_len=40, run_id=f"run-{k}", max_concurrent_runs=4,
                      sampling=SamplingConfig(temperature=0.8, seed=k) if k == 1 else None)
        for k in range(3)
    }  # fmt: skip
    chain = Chain.bind(provs[0], lambda: CpuWorker(threads=2))
    chain.activations = {}
    try:
        for p in provs.values():
            chain.open(p)
        join = {f"run-{k}": k for k in range(3)}
        prompts = {f"run-{k}": PROMPTS[k] for k in range(3)}
        outs = chain.generate_batched(prompts, 5, 3, join)
    finally:
        chain.release()
    got = {
        run: [(o.token_id, np.asarray(o.logits).view(np.uint32)) for o in out]
        for run, out in outs.items()
    }
    return (got, chain.activations), used[0]


@pytest.mark.parametrize("name", list(SHAPES))
def test_step_programs_compute_what_the_calls_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    path = write_model(tmp_path / f"{name}.gguf", SHAPES[name])
    (calls, rows), none = three_runs(path, False, monkeypatch)
    (recorded, recorded_rows), used = three_runs(path, True, monkeypatch)
    assert none == 0 and used > 10  # most steps (both stages') ran a program
    assert calls.keys() == recorded.keys() and rows.keys() == recorded_rows.keys()
    for run, outs in calls.items():
        assert [t for t, _ in recorded[run]] == [t for t, _ in outs], run
        for (_, got), (_, want) in zip(recorded[run], outs, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=run)
    for key, want_rows in rows.items():
        for got_row, want_row in zip(recorded_rows[key], want_rows, strict=True):
            np.testing.assert_array_equal(
                np.asarray(got_row).view(np.uint8), np.asarray(want_row).view(np.uint8), str(key)
            )


# -- a program's checks ---------------------------------------------------------------------

N_HEADS, N_KV, HD = 2, 1, 8
WIDTH = N_HEADS * HD + 2 * N_KV * HD  # a row of Q, K, V


def heads(ring: int, half: bool = False, n_kv: int = N_KV) -> tuple[int, int, int, int, int, bool]:
    return (N_HEADS, n_kv, HD, HD, ring, half)


def arrays(ring: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((N_KV, ring, HD), np.float32), np.zeros((N_KV, ring, HD), np.float32)


def cache(ring: int, layers: int = 1) -> _kernels.KvCache:
    kv = [arrays(ring) for _ in range(layers)]
    return _kernels.KvCache([k for k, _ in kv], [v for _, v in kv], [heads(ring)] * layers)


@attrs.frozen
class OneRow:
    """Rotary and attention of one row (block 0 of segment 0) recorded into ``program``
    at position 0 of a cache of ``ring`` positions: its input ``qkv`` and output ``out``."""

    program: _kernels.Program
    qkv: np.ndarray
    rot: np.ndarray
    out: np.ndarray


def one_row(ring: int, rot_positions: int) -> OneRow:
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, WIDTH)).astype(np.float32)
    angle = rng.uniform(0, 6.3, (rot_positions, HD // 2))
    rot = np.stack([np.cos(angle), np.sin(angle)], -1).reshape(rot_positions, HD).astype(np.float32)
    k, v = arrays(ring)
    out = np.zeros((1, N_HEADS * HD), np.float32)
    p = _kernels.Program()
    p.rope_kv(qkv, 1, None, rot, 0, heads(ring), HD, False, k, v, 1, slot=(0, 0))
    p.attention(qkv, 1, k, v, 0, heads(ring), 0.5, out, 1, slot=(0, 0))
    return OneRow(p, qkv, rot, out)


def test_a_program_takes_each_runs_position_and_cache() -> None:
    """Two runs' rows in turn through one program, each at its position and in its own
    cache: the outputs and caches the module's functions give those rows, bit for bit."""
    row = one_row(8, 16)
    assert len(row.program) == 2 and row.program.segments == 1
    rng = np.random.default_rng(1)
    runs = [arrays(8) for _ in range(2)]
    tables = [_kernels.KvCache([k], [v], [heads(8)]) for k, v in runs]
    eager = [arrays(8) for _ in range(2)]
    for pos in range(8):  # a row attends to positions 0 .. pos of its run's cache
        for r in range(2):
            row.qkv[:] = rng.standard_normal((1, WIDTH))
            qkv, out = row.qkv.copy(), np.zeros_like(row.out)
            assert row.program.run([pos], [tables[r]]) == []
            k, v = eager[r]
            _kernels.rope_kv(qkv, 1, None, row.rot, pos, heads(8), HD, False, k, v, 1)
            _kernels.attention(qkv, 1, k, v, pos, heads(8), 0.5, out, 1)
            np.testing.assert_array_equal(row.out.view(np.uint32), out.view(np.uint32))
            for got, want in zip(runs[r], eager[r], strict=True):
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(runs[0][0], runs[1][0])  # two runs, two caches
    with pytest.raises(ValueError, match=r"rows 1 at 8 see positions from 0: a ring of 8"):
        row.program.run([8], [tables[0]])  # a global block's ring of 8 holds 8 positions
    with pytest.raises(ValueError, match=r"rows 1 at 20: rotations for 16 positions"):
        row.program.run([20], [cache(32)])
    with pytest.raises(ValueError, match=r"segment 0 at position 4611686018427387904 \(0\.\."):
        row.program.run([2**62], [cache(32)])


def test_a_program_refuses_a_cache_that_is_not_its_shape() -> None:
    p = one_row(8, 16).program
    with pytest.raises(ValueError, match=r"1 positions and 2 caches for a program of 1 segments"):
        p.run([0], [cache(8), cache(8)])
    with pytest.raises(TypeError, match=r"caches\[0\]: a KvCache is needed"):
        p.run([0], [np.zeros(8)])
    other = _kernels.KvCache(
        [np.zeros((2, 8, HD), np.float32)], [np.zeros((2, 8, HD), np.float32)], [heads(8, n_kv=2)]
    )
    with pytest.raises(
        ValueError, match=r"block 0: heads 2 / 2 of 8, 8 \(float\), the program's 2 / 1"
    ):
        p.run([0], [other])
    q = _kernels.Program()
    qkv, k = np.zeros((1, WIDTH), np.float32), np.zeros((N_KV, 8, HD), np.float32)
    rot = np.zeros((8, HD), np.float32)
    q.rope_kv(qkv, 1, None, rot, 0, heads(8), HD, False, k, k.copy(), 1, slot=(0, 3))
    with pytest.raises(
        ValueError, match=r"segment 0 at position 0 of a cache of 1 blocks: block 3"
    ):
        q.run([0], [cache(8)])
    with pytest.raises(ValueError, match=r"segment 0 at position -1 \(0\.\."):
        q.run([-1], [cache(8, 4)])


def test_a_programs_rotary_and_attention_name_their_slot_and_no_step_buffers() -> None:
    p = _kernels.Program()
    qkv, k = np.zeros((2, WIDTH), np.float32), np.zeros((N_KV, 8, HD), np.float32)
    rot = np.zeros((8, HD), np.float32)
    args = (qkv, 2, None, rot, 0, heads(8), HD, False, k, k.copy(), 1)
    with pytest.raises(TypeError, match=r"name their slot=\(segment, block\)"):
        p.rope_kv(*args)
    with pytest.raises(ValueError, match=r"slot \(-1, 0\)"):
        p.rope_kv(*args, slot=(-1, 0))
    step = np.zeros((N_KV, 2, HD), np.float32)
    with pytest.raises(ValueError, match="take no step buffers"):
        p.rope_kv(*args, 1.0, step, step.copy(), slot=(0, 0))
    with pytest.raises(TypeError, match="takes no keywords but slot"):
        p.rope_kv(*args, slot=(0, 0), window=3)
    assert len(p) == 0  # nothing refused was kept


def test_a_kv_cache_is_checked_when_made() -> None:
    k = [np.zeros((N_KV, 8, HD), np.float32)]
    with pytest.raises(ValueError, match=r"1 key, 2 value and 1 heads entries"):
        _kernels.KvCache(k, k * 2, [heads(8)])
    with pytest.raises(ValueError, match=r"k_cache: 64 elements, the call needs 128"):
        _kernels.KvCache(k, k, [heads(16)])
    with pytest.raises(TypeError, match=r"v_cache: a C-contiguous writable array"):
        frozen = np.zeros((N_KV, 8, HD), np.float32)
        frozen.flags.writeable = False
        _kernels.KvCache(k, [frozen], [heads(8)])
    with pytest.raises(TypeError, match=r"k_cache: elements of format e, expected f"):
        _kernels.KvCache([np.zeros((N_KV, 8, HD), np.float16)], k, [heads(8)])
    made = _kernels.KvCache(k, k, [heads(8)])
    assert len(made) == 1
    with pytest.raises(RuntimeError, match="a KvCache is made once"):
        made.__init__(k, k, [heads(8)])  # type: ignore[misc]


def test_a_bad_token_id_stops_a_run_before_any_call() -> None:
    """The ids are read where they lie at every run; one outside the table raises, and
    none of the program's calls is made (the norm recorded before it writes nothing)."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10, 32)).astype(np.float32)
    m = _kernels.Matrix([(table.view(np.uint8).reshape(-1), "F32", 10, 32, 0)])
    x, out = np.ones((1, 32), np.float32), np.zeros((1, 32), np.float32)
    ids, rows = np.array([3], np.int32), np.zeros((1, 32), np.float32)
    p = _kernels.Program()
    p.rmsnorm(x, np.ones(32, np.float32), out, 1, 32, 1e-6, 1)
    p.embed(m, ids, rows, 1)
    p.run([], [])
    np.testing.assert_array_equal(rows[0], table[3])
    assert (out > 0.99).all()  # the norm ran
    out[:] = 0.0
    ids[0] = 10
    with pytest.raises(ValueError, match=r"token id 10 outside 0..9"):
        p.run([], [])
    assert (out == 0.0).all()


# A thread flips one token id between a good one and one far outside the table while the
# embedding runs (eagerly, and in a program) without the GIL. Without the read-and-check
# at the use (ops.c's embed_item), this script segfaults in a run or two.
RACING_IDS = """
import sys, threading, numpy as np
from runtime_core.workers.cpu import _kernels
count = 40000
table = _kernels.Matrix([(np.zeros((16, 18), np.uint8), "Q4_0", 16, 32, 0)])
ids, out = np.zeros(count, np.int32), np.zeros((count, 32), np.float32)
program = _kernels.Program()
program.embed(table, ids, out, 1)
stop = False
def writer():
    while not stop:
        ids[count // 2] = 2**31 - 1
        ids[count // 2] = 0
seen = {"ok": 0, "checked": 0, "changed": 0}
sys.setswitchinterval(1e-5)
thread = threading.Thread(target=writer)
thread.start()
try:
    for i in range(600):
        try:
            _kernels.embed(table, ids, out, 1) if i % 2 else program.run([], [])
            seen["ok"] += 1
        except ValueError as e:
            if "changed while the kernels ran" in str(e):
                seen["changed"] += 1
            else:
                assert "token id 2147483647 outside 0..15" in str(e), e
                seen["checked"] += 1
finally:
    stop = True
    thread.join()
print(seen["ok"], seen["checked"], seen["changed"])
"""


def test_a_token_id_changed_by_another_thread_during_a_run_is_an_error_not_a_wild_read() -> None:
    """The ids are checked under the GIL before a run, then read without it: another
    thread may write them in between. Each id is read once and checked again where the
    embedding uses it, so a changed id is a ValueError and nothing outside the table is
    read (the script runs in its own process: a wild read would kill it). Its limit is
    a hang's: under make sanitize-thread the script, the GIL changing hands every 10 µs,
    took 191 s on a loaded 2-core host (120 s was too few)."""
    proc = subprocess.run(
        [sys.executable, "-c", RACING_IDS], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, checked, changed = map(int, proc.stdout.split())
    assert ok + checked + changed == 600


def test_a_program_returns_each_argmax_and_scales_as_numpy() -> None:
    logits = np.array([[0.5, 2.0, np.nan, 2.0], [1.0, -1.0, 3.0, np.inf]], np.float32)
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    want = x * np.float32(0.7071)
    p = _kernels.Program()
    p.scale(x, 0.7071, 2)
    p.argmax(logits[0])
    p.argmax(logits[1])
    assert p.run([], []) == [(1, 1), (2, 1)]
    np.testing.assert_array_equal(x.view(np.uint32), want.view(np.uint32))


def test_sizes_whose_products_would_overflow_are_refused() -> None:
    """No product of a call's sizes wraps around 64 bits past a length check: rings,
    heads, rows and positions beyond the bounds (csrc/calls.h) are refused, by the
    module's functions and by programs alike."""
    k, v = arrays(8)
    with pytest.raises(ValueError, match=r"heads 2 / 1 of 8, 8 in a cache of 2305843009213693952"):
        _kernels.KvCache([k], [v], [(N_HEADS, N_KV, HD, HD, 2**61, False)])
    qkv, rot = np.zeros((1, WIDTH), np.float32), np.zeros((16, HD), np.float32)
    with pytest.raises(ValueError, match=r"rows 1 at 9223372036854775807, 8 rotated dims"):
        _kernels.rope_kv(qkv, 1, None, rot, 2**63 - 1, heads(8), HD, False, k, v, 1)
    with pytest.raises(ValueError, match=r"rows 1 at 1099511627777, window 0"):
        _kernels.attention(qkv, 1, k, v, 2**40 + 1, heads(8), 0.5, np.zeros((1, 16), np.float32), 1)
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match=r"4611686018427387904 rows of 2 \(1\.\.16777216 rows"):
        _kernels.rmsnorm(x, x, x, 2**62, 2, 1e-6, 1)
    with pytest.raises(ValueError, match=r"2 rows of 4611686018427387904"):
        _kernels.swiglu(x, x, 2, 2**62, 1)
    table = np.zeros(34 * 4, np.uint8)
    with pytest.raises(ValueError, match=r"part 0: 4 rows of 4294967296 Q8_0 elements"):
        _kernels.Matrix([(table, "Q8_0", 4, 2**32, 0)])


def test_a_matrix_and_a_cache_are_made_once() -> None:
    """A program holds its matrices and a run its cache while their calls run without
    the GIL: neither is made again in place."""
    rows = np.zeros((4, 32), np.float32)
    m = _kernels.Matrix([(rows.view(np.uint8).reshape(-1), "F32", 4, 32, 0)])
    with pytest.raises(RuntimeError, match="a Matrix is made once"):
        m.__init__([(rows.view(np.uint8).reshape(-1), "F32", 2, 64, 0)])  # type: ignore[misc]
    assert (m.n_out, m.n_in) == (4, 32)


def test_a_matrix_being_made_or_failed_is_taken_by_no_call() -> None:
    """A part's sizes may run Python (an ``__index__``) while the matrix is half made;
    a call recorded then would be checked against sizes the matrix does not end with.
    Such a call is refused, and a matrix whose making failed is never made again (its
    sizes could change under a program that took it): both raise, and nothing runs."""
    rows = np.ones((8, 32), np.float32).view(np.uint8).reshape(-1)
    x, y = np.ones((1, 32), np.float32), np.zeros((1, 8), np.float32)
    p = _kernels.Program()
    m = _kernels.Matrix.__new__(_kernels.Matrix)
    refused: list[str] = []

    class Rows:
        def __index__(self) -> int:
            with pytest.raises(ValueError, match="being made") as info:
                p.linear(m, 1, x, None, None, None, None, False, False, y, None, False, 1)
            refused.append(str(info.value))
            return -1  # the second part is refused: the making fails

    with pytest.raises(ValueError, match="part 1"):
        m.__init__([(rows, "F32", 8, 32, 0), (rows, "F32", Rows(), 32, 8)])  # type: ignore[misc]
    assert len(refused) == 1 and len(p) == 0
    with pytest.raises(RuntimeError, match="a Matrix is made once"):
        m.__init__([(rows, "F32", 8, 32, 0)])  # type: ignore[misc]
    with pytest.raises(ValueError, match="its making failed"):
        p.linear(m, 1, x, None, None, None, None, False, False, y, None, False, 1)


def test_a_matrix_repacking_without_the_gil_is_taken_by_no_other_thread() -> None:
    """Repacking a part lets other threads run; one that records a product with the
    matrix then (its first part in, 8 outputs) is refused, so no program keeps a call
    checked against 8 outputs for a matrix that ends with thousands."""
    n_in = 4096
    row_bytes = n_in // 32 * 34  # Q8_0
    part0, part1 = np.zeros(8 * row_bytes, np.uint8), np.zeros(8192 * row_bytes, np.uint8)
    x, y = np.ones((1, n_in), np.float32), np.zeros((1, 8), np.float32)
    q8 = (np.zeros(n_in, np.int8), np.zeros(n_in // 32, np.float32),
          np.zeros(n_in // 32, np.float32), np.zeros(n_in // 16, np.int32))  # fmt: skip
    m = _kernels.Matrix.__new__(_kernels.Matrix)
    p = _kernels.Program()
    seen: list[str] = []
    stop = threading.Event()

    def record() -> None:
        while not stop.is_set() and not seen:
            if m.n_out == 8:  # the first part made, the second being repacked
                try:
                    p.linear(m, 1, x, *q8, True, True, y, None, False, 1)
                    seen.append("recorded")
                except ValueError as exc:
                    seen.append(str(exc))

    spy = threading.Thread(target=record)
    spy.start()
    try:
        m.__init__([(part0, "Q8_0", 8, n_in, 0), (part1, "Q8_0", 8192, n_in, 8)], repack=True)  # type: ignore[misc]
    finally:
        stop.set()
        spy.join(10)
    assert m.n_out == 8200
    assert seen and "being made" in seen[0], seen
    assert len(p) == 0


def test_a_failing_cache_is_read_by_no_run() -> None:
    """A block's heads may run Python (an ``__index__``) that hands the cache being made
    to a run; the run finds no block of it (the cache's blocks are published once all
    are checked and held), so the failure that releases its arrays frees nothing a run
    reads."""
    heads = (1, 1, HD, HD, 8, False)
    qkv, out = np.ones((1, 3 * HD), np.float32), np.zeros((1, HD), np.float32)
    p = _kernels.Program()
    k = np.zeros((1, 8, HD), np.float32)
    p.attention(qkv, 1, k, k, 0, heads, 0.1, out, 1, slot=(0, 0))
    cache = _kernels.KvCache.__new__(_kernels.KvCache)
    runs: list[str] = []

    class Heads:
        def __index__(self) -> int:
            with pytest.raises(ValueError, match="block 0") as info:
                p.run([0], [cache])
            runs.append(str(info.value))
            return -1

    with pytest.raises(ValueError, match="heads"):
        cache.__init__([k, k], [k, k], [heads, (Heads(), 1, HD, HD, 8, False)])  # type: ignore[misc]
    assert len(runs) == 1 and len(cache) == 0


def test_a_part_or_heads_not_a_tuple_is_a_type_error_naming_it() -> None:
    rows = np.zeros((4, 32), np.float32).view(np.uint8).reshape(-1)
    with pytest.raises(TypeError, match=r"part 0 is a tuple .* not list"):
        _kernels.Matrix([[rows, "F32", 4, 32, 0]])
    k = np.zeros((1, 8, HD), np.float32)
    with pytest.raises(TypeError, match=r"heads is a tuple .* not NoneType"):
        _kernels.KvCache([k], [k], [None])


def test_a_soft_cap_error_shows_its_value() -> None:
    x = np.ones(32, np.float32)
    with pytest.raises(ValueError, match=r"a soft cap of 0: it must be finite and above 0"):
        _kernels.softcap(x, 0.0, 1)
    with pytest.raises(ValueError, match=r"a soft cap of -inf"):
        _kernels.softcap(x, float("-inf"), 1)


def test_a_call_recorded_while_another_is_parsed_is_kept_beside_it() -> None:
    """Parsing an argument may run Python that records into the same program (an
    ``__index__``): both calls are kept, each whole, past the first 64 (the array grows
    when a parsed call is kept, not before)."""
    p = _kernels.Program()
    x, w, out = np.ones((1, 32), np.float32), np.ones(32, np.float32), np.zeros((1, 32), np.float32)
    for _ in range(63):
        p.rmsnorm(x, w, out, 1, 32, 1e-6, 1)

    class Rows:
        def __index__(self) -> int:
            p.rmsnorm(x, w, out, 1, 32, 1e-6, 1)
            return 1

    p.rmsnorm(x, w, out, Rows(), 32, 1e-6, 1)
    assert len(p) == 65
    assert p.run([], []) == []
    assert (out > 0.99).all()


def test_rounding_to_half_and_bfloat16_is_numpys() -> None:
    """F16 / BF16 weights' activations: every float32 class (normal, subnormal halves,
    ties, past half's range, infinities) rounded as NumPy and ``activations`` round them,
    bit for bit, and NaN kept NaN."""
    rng = np.random.default_rng(3)
    nan_bits = np.array([0x7FC00001, 0xFF800001, 0x3F808000, 0x3F818000], np.uint32)
    x = np.concatenate([
        rng.standard_normal(5000) * 10.0 ** rng.integers(-10, 6, 5000),
        (rng.integers(-2048, 2048, 2000) + 0.5) * 2.0**-24,  # ties between subnormal halves
        [65504.0, 65519.99, 65520.0, 1e9, -1e9, np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0],
    ]).astype(np.float32)  # fmt: skip
    x = np.concatenate([x, nan_bits.view(np.float32)])  # NaNs with payloads, bf16 ties
    out = np.zeros_like(x)
    _kernels.round(x, out, "f16", 2)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(x)  # NaN stays NaN, quiet (as F16C's conversion; NumPy keeps a payload)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all() and nan.sum() == 4
    _kernels.round(x, out, "bf16", 2)
    want = activations.bf16_to_float32(activations.float32_to_bf16(x))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="round to f8: f16 or bf16"):
        _kernels.round(x, out, "f8", 1)


def test_a_run_takes_its_positions_and_caches_as_they_were_given() -> None:
    """Converting a position may run Python (an ``__index__``) that empties the list of
    caches: the run holds what it was given (a copy of each sequence) until it ends."""
    row = one_row(8, 16)
    caches = [cache(8)]

    class Position:
        def __index__(self) -> int:
            caches.clear()
            gc.collect()
            return 3

    assert row.program.run([Position()], caches) == []
    assert caches == [] and np.isfinite(row.out).all() and row.out.any()
