"""The SIMT emulator (``tests/support/simt``) against CUDA's documented rules.

Collectives give what the CUDA C++ Programming Guide says they give (shuffles of every
mode and width against a NumPy model written from the guide's words, not from the
emulator's PTX formula); what CUDA leaves undefined is an error naming the rule and the
place: a barrier in a branch, a lane outside a shuffle's mask, a mask naming an exited
lane or one the block lacks, divergent collectives, a deadlock, too much shared memory,
a block beyond ``__launch_bounds__``; a write past a shared array is reported (and any
access outside one under ASan, in a process of its own). A missing ``__syncthreads``
shows as a result that depends on the thread order, and a kernel with its barrier gives
the same bits in every order.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime_core.activations import float32_to_bf16

if shutil.which("g++") is None:
    pytest.skip("the SIMT emulator needs a host C++ compiler (g++)", allow_module_level=True)

from tests.support.simt import loader
from tests.support.simt.loader import (
    FORWARD,
    REVERSE,
    SimtError,
    SimtModule,
    ThreadOrder,
    compile_cu,
    random_order,
)

SOURCE = Path(__file__).with_name("emulator_kernels.cu")
ORDERS = [FORWARD, REVERSE, random_order(1), random_order(2)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def m() -> SimtModule:
    return compile_cu(SOURCE)


# ---- collectives ------------------------------------------------------------------------------


def cuda_shuffle(values: np.ndarray, kind: str, arg: int, width: int) -> np.ndarray:
    """The CUDA C++ Programming Guide's warp shuffle functions, for one warp."""
    out = np.empty_like(values)
    for lane in range(32):
        group = lane // width * width
        if kind == "idx":  # srcLane outside [0, width): srcLane modulo width, in the group
            src = group + arg % width
        elif kind == "up":  # from lane - delta; below the group: unchanged
            src = lane - arg if lane - arg >= group else lane
        elif kind == "down":  # from lane + delta; past the group: unchanged
            src = lane + arg if lane + arg < group + width else lane
        else:  # xor: a later group is out of reach (unchanged); earlier groups are not
            src = lane ^ arg
            src = lane if src >= group + width else src
        out[lane] = values[src]
    return out


@pytest.mark.parametrize("kind", ["idx", "up", "down", "xor"])
@pytest.mark.parametrize("width", [32, 16, 8, 4, 2, 1])
def test_shuffles_follow_cuda_s_rules(m: SimtModule, kind: str, width: int) -> None:
    values = np.arange(100, 132, dtype=np.int32)
    code = ["idx", "up", "down", "xor"].index(kind)
    for arg in (0, 1, 3, 7, 16, 31, 35):
        out = np.zeros(32, np.int32)
        m.launch("shuffles", 1, 32, [values, out, code, arg, width])
        np.testing.assert_array_equal(
            out, cuda_shuffle(values, kind, arg % 32 if kind != "idx" else arg, width),
            err_msg=f"{kind} {arg} width {width}",
        )  # fmt: skip


def test_a_shuffle_moves_8_byte_values(m: SimtModule) -> None:
    v = np.linspace(-1, 1, 64)
    out = np.zeros(64)
    m.launch("shuffle_doubles", 1, 64, [v, out])
    expected = np.concatenate(
        [cuda_shuffle(v[w * 32 : w * 32 + 32], "down", 3, 32) for w in (0, 1)]
    )
    np.testing.assert_array_equal(out, expected)


def test_votes_and_reductions(m: SimtModule) -> None:
    rng = np.random.default_rng(0)
    v = rng.integers(-5, 5, 64).astype(np.int32)
    out = np.zeros((64, 5), np.uint32)
    m.launch("votes", 1, 64, [v, out])
    for t in range(64):
        warp = v[t // 32 * 32 : t // 32 * 32 + 32]
        half = warp[:16] if t % 32 < 16 else warp[16:]
        ballot = sum(1 << i for i in range(32) if warp[i] > 0)
        assert out[t, 0] == ballot
        assert out[t, 1] == int((half > 0).any())
        assert out[t, 2] == int((half > 0).all())
        assert out[t, 3:].view(np.int32).tolist() == [warp.sum(), half.max()]


# ---- barriers and thread orders ---------------------------------------------------------------


def block_sums(m: SimtModule, x: np.ndarray, with_barrier: int, order: ThreadOrder) -> np.ndarray:
    out = np.full(x.shape[0], np.nan, np.float32)
    m.launch("block_sum", x.shape[0], 256, [x, out, x.shape[1], with_barrier], order=order)
    return out


def test_a_kernel_with_its_barriers_gives_the_same_bits_in_every_order(m: SimtModule) -> None:
    x = np.random.default_rng(1).standard_normal((7, 1000)).astype(np.float32)
    sums = [block_sums(m, x, 1, order) for order in ORDERS]
    for s in sums[1:]:
        np.testing.assert_array_equal(s, sums[0])
    np.testing.assert_allclose(sums[0], x.astype(np.float64).sum(axis=1), rtol=0, atol=1e-4)


def test_a_missing_barrier_shows_under_some_thread_order(m: SimtModule) -> None:
    """Without ``__syncthreads`` warp 0 reads the other warps' partial sums before they
    are written (0xff bytes: NaN) in some order of the threads; the orders disagree."""
    x = np.random.default_rng(1).standard_normal((7, 1000)).astype(np.float32)
    right = block_sums(m, x, 1, FORWARD)
    racy = [block_sums(m, x, 0, order) for order in ORDERS]
    wrong = [o for o, s in zip(ORDERS, racy, strict=True) if not np.array_equal(s, right)]
    assert wrong, "every order gave the right sums without the barrier"
    assert any(np.isnan(s).any() for s in racy)


def test_the_thread_order_decides_which_thread_runs_first(m: SimtModule) -> None:
    runs = {}
    for order in (FORWARD, REVERSE, random_order(7)):
        counter, tickets = np.zeros(1, np.int32), np.full(64, -1, np.int32)
        m.launch("tickets", 2, 32, [counter, tickets], order=order)
        runs[str(order)] = tickets
        assert sorted(tickets) == list(range(64))
    assert runs["forward"].tolist() == list(range(64))
    assert runs["reverse"].tolist() == list(range(63, -1, -1))
    assert runs["random(7)"].tolist() not in (list(range(64)), list(range(63, -1, -1)))


def test_a_barrier_in_a_branch_is_an_error(m: SimtModule) -> None:
    with pytest.raises(SimtError, match=r"divergent __syncthreads.*emulator_kernels\.cu:\d+"):
        m.launch("barrier_in_branch", 1, 64, [np.zeros(64, np.int32)])


def test_threads_that_exit_do_not_hold_a_barrier(m: SimtModule) -> None:
    out = np.full(64, -1, np.int32)
    for order in ORDERS:
        m.launch("early_exit_then_barrier", 1, 64, [out, 40], order=order)
        assert out[:40].tolist() == list(range(39, -1, -1))


# ---- what CUDA leaves undefined is an error ---------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "block", "message"),
    [
        ("shuffle_outside_mask", 32, r"lane 0 reads lane 16, which is not in the mask 0x0000ffff"),
        ("caller_outside_mask", 32, r"lane \d+\) calls it with mask 0x0000ffff, which does not"),
        ("mask_names_an_exited_lane", 32, r"(exits while lanes|have exited)"),
        ("divergent_shuffles", 32, r"divergent warp collectives"),
        ("shuffle_against_barrier", 64, r"__syncthreads.*neither can go on"),
        ("partial_warp_full_mask", 48, r"names lanes the warp does not have"),
        ("trapped", 32, r"__trap\(\) in thread \(5,0,0\)"),
    ],
)  # fmt: skip
def test_undefined_behaviour_is_an_error(
    m: SimtModule, kernel: str, block: int, message: str
) -> None:
    v = np.arange(block, dtype=np.int32)
    args = [v, np.zeros(block, np.int32)] if m.kernels[kernel].kinds == (0, 0) else [v]
    for order in ORDERS:
        with pytest.raises(SimtError, match=message):
            m.launch(kernel, 1, block, args, order=order)


def test_a_write_past_a_shared_array_is_reported(m: SimtModule) -> None:
    m.launch("shared_overflow", 1, 32, [np.zeros(32, np.int32), 32])  # in bounds
    with pytest.raises(SimtError, match="wrote outside shared array s"):
        m.launch("shared_overflow", 1, 64, [np.zeros(64, np.int32), 64])


def test_shared_memory_is_fresh_in_every_block(m: SimtModule) -> None:
    out = np.zeros(4, np.float32)
    m.launch("unwritten_shared", 1, 4, [out])
    assert np.isnan(out).all()  # 0xff bytes: what a kernel reads before writing


def test_dynamic_shared_memory(m: SimtModule) -> None:
    x = np.random.default_rng(2).standard_normal((3, 200)).astype(np.float32)
    out = np.zeros_like(x)
    m.launch("reverse_in_dynamic_shared", 3, 64, [x, out, 200], shared_mem=200 * 4)
    np.testing.assert_array_equal(out, x[:, ::-1])


def test_shared_memory_beyond_48_kib_is_refused(m: SimtModule) -> None:
    out = np.zeros(32, np.float32)
    m.launch("too_much_shared", 1, 32, [out], shared_mem=1024)
    np.testing.assert_array_equal(out, np.full(32, 3.0, np.float32))
    with pytest.raises(SimtError, match="shared memory"):
        m.launch("too_much_shared", 1, 32, [out], shared_mem=24 * 1024)


def test_launch_bounds_and_limits_are_checked(m: SimtModule) -> None:
    x = np.zeros((1, 8), np.float32)
    with pytest.raises(SimtError, match=r"__launch_bounds__\(256\)"):
        m.launch("block_sum", 1, 512, [x, np.zeros(1, np.float32), 8, 1])
    with pytest.raises(SimtError, match="a block of 2048"):
        m.launch("tickets", 1, 2048, [np.zeros(1, np.int32), np.zeros(2048, np.int32)])
    with pytest.raises(SimtError, match="grid of 1 x 65536"):
        m.launch("tickets", (1, 65536), 1, [np.zeros(1, np.int32), np.zeros(1, np.int32)])
    with pytest.raises(SimtError, match="no kernel 'nope'"):
        m.launch("nope", 1, 1, [])


def test_arguments_are_checked_against_the_parameter_types(m: SimtModule) -> None:
    out = np.zeros(4, np.float32)
    m.launch("scalars", 1, 1, [-3, 65535, -(2**40), 2.5, out])
    np.testing.assert_array_equal(out, [-3, 65535, -(2.0**40), 2.5])
    with pytest.raises(TypeError, match="does not fit 8 bits"):
        m.launch("scalars", 1, 1, [200, 1, 1, 1.0, out])
    with pytest.raises(TypeError, match="is an integer"):
        m.launch("scalars", 1, 1, [1.5, 1, 1, 1.0, out])
    with pytest.raises(TypeError, match="is a pointer"):
        m.launch("scalars", 1, 1, [1, 1, 1, 1.0, 7])
    with pytest.raises(TypeError, match="takes 5 arguments"):
        m.launch("scalars", 1, 1, [1, 1, 1, 1.0])


def test_a_deadlock_is_an_error_that_says_who_waits(tmp_path: Path) -> None:
    """Lanes 0, 1 and 2 each wait for the next at a shuffle of their own: none can go on."""
    src = tmp_path / "deadlock.cu"
    src.write_text(
        'extern "C" __global__ void k(int* out) {\n'
        "    int t = threadIdx.x;\n"
        "    if (t == 0) out[t] = __shfl_sync(0x3u, t, 1);\n"
        "    if (t == 1) out[t] = __shfl_sync(0x6u, t, 2);\n"
        "    if (t == 2) out[t] = __shfl_sync(0x5u, t, 0);\n"
        "}\n"
    )
    m = compile_cu(src)
    with pytest.raises(
        SimtError,
        match=r"deadlock in block \(0,0,0\): 3 live threads.*thread 0 "
        r"waits at __shfl_sync \(.*deadlock\.cu:3, mask 0x00000003\)",
    ):
        m.launch("k", 1, 32, [np.zeros(32, np.int32)])


# ---- atomics, indices, intrinsics -------------------------------------------------------------


def test_atomics(m: SimtModule) -> None:
    fsum, umax = np.zeros(1, np.float32), np.zeros(1, np.uint32)
    imin, cas = np.zeros(1, np.int32), np.zeros(1, np.uint64)
    m.launch("atomics", 3, 64, [fsum, umax, imin, cas], order=random_order(3))
    assert fsum[0] == 96.0 and umax[0] == 191 and imin[0] == -191
    assert cas[0] == sum(range(192))


def test_thread_and_block_indices_in_three_dimensions(m: SimtModule) -> None:
    grid, block = (3, 2, 2), (4, 3, 2)
    out = np.zeros((12, 24, 4), np.uint32)
    m.launch("indices", grid, block, [out])
    for b in range(12):
        bx, by, bz = b % 3, b // 3 % 2, b // 6
        for t in range(24):
            tx, ty, tz = t % 4, t // 4 % 3, t // 12
            assert out[b, t].tolist() == [tx + 16 * ty + 256 * tz, bx + 16 * by + 256 * bz,
                                          4 + 16 * 3 + 256 * 2, 3 + 16 * 2 + 256 * 2]  # fmt: skip


def test_dp4a_half_and_bfloat16(m: SimtModule) -> None:
    rng = np.random.default_rng(4)
    n = 200_000
    a = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    b = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    f = np.concatenate([
        rng.standard_normal(n // 2).astype(np.float32) * np.float32(100),
        rng.integers(0, 2**32, n - n // 2 - 8, np.uint64).astype(np.uint32).view(np.float32),
        np.array([0, -0.0, np.inf, -np.inf, 65504, 65520, 2.0**-25, 3 * 2.0**-26], np.float32),
    ])  # fmt: skip
    dots, halves = np.zeros(n, np.int32), np.zeros(n, np.uint16)
    back, bf = np.zeros(n, np.float32), np.zeros(n, np.uint16)
    m.launch("intrinsics", 64, 128, [a, b, dots, f, halves, back, bf, n])
    ab = a.view(np.int8).reshape(n, 4).astype(np.int64)
    bb = b.view(np.int8).reshape(n, 4).astype(np.int64)
    np.testing.assert_array_equal(dots, ((ab * bb).sum(axis=1) + np.arange(n)).astype(np.int32))
    nan = np.isnan(f)
    with np.errstate(over="ignore"):
        expected = f.astype(np.float16)
    np.testing.assert_array_equal(halves[~nan], expected[~nan].view(np.uint16))
    assert (halves[nan] == 0x7FFF).all()  # the GPU's canonical NaN
    np.testing.assert_array_equal(back[~nan], expected[~nan].astype(np.float32))
    np.testing.assert_array_equal(bf[~nan], float32_to_bf16(f)[~nan])


# ---- the cache, and ASan ----------------------------------------------------------------------


def test_a_changed_source_is_compiled_again_and_an_unchanged_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cache of its own: other builds (the session's kernels, built in the background,
    # or another process's) come and go in the shared one
    monkeypatch.setenv("GGUF_PIPELINE_SIMT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int* out) { out[threadIdx.x] = 1; }\n')
    compile_cu(src)
    entries = set(loader.cache_dir().iterdir())
    compile_cu(src)
    assert set(loader.cache_dir().iterdir()) == entries
    src.write_text('extern "C" __global__ void k(int* out) { out[threadIdx.x] = 2; }\n')
    out = np.zeros(4, np.int32)
    compile_cu(src).launch("k", 1, 4, [out])
    assert out.tolist() == [2, 2, 2, 2]
    assert len(set(loader.cache_dir().iterdir()) - entries) == 1


ASAN_SCRIPT = """
import numpy as np
from tests.support.simt.loader import compile_cu
m = compile_cu({source!r}, asan=True)
m.launch("shared_overflow", 1, 32, [np.zeros(32, np.int32), 32])
print("in bounds: fine", flush=True)
m.launch("shared_overflow", 1, 64, [np.zeros(64, np.int32), 64])
print("not reached", flush=True)
"""


@pytest.mark.skipif(loader.asan_runtime() is None, reason="g++ has no libasan.so")
def test_a_shared_array_overflow_is_caught_by_asan() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", ASAN_SCRIPT.format(source=str(SOURCE))],
        capture_output=True, text=True, env=loader.asan_environment([str(ROOT), *sys.path]),
        cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert "in bounds: fine" in proc.stdout, proc.stderr[-3000:]
    assert "not reached" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "emulator_kernels.cu:" in proc.stderr  # the kernel's own source line
