"""Matrices of every quantized type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS) repacked 8 rows at a time (``csrc/repack.h``,
``Matrix(repack=True)``) compute the stored rows' bits, and a bound stage keeps them
instead of the file's pages.

- Products: on every instruction set (a parameter each, skipped with the reason where
  the processor lacks it), every row count from 1 to 17 and past (a last group of 1 to
  7 rows padded), 1, 2, 3 and 5 threads, 8-bit and "f32" activations, rows multiplied
  together or one at a time: the same bits as the stored rows on the portable set;
  with other parts beside it (offsets, bias, accumulation) as well.
- The float types do not repack; an embedding lookup of repacked rows is the gguf
  package's dequantization (a repacked row unpacks to its stored bytes).
- Memory: binding a Q4_0 stage grows the process's private memory by at most about
  the repacked tensors' bytes and its file-backed memory by about the other tensors'
  only (the stored pages of a repacked tensor are dropped from the process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from runplan.quant_types import FLOAT_TYPES, Q8_TYPES, block_elems
from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.step_buffers import q_row_stride
from runtime_core.workers.cpu.worker import CpuWorker
from tests.support.chain import provisions
from tests.support.cpu_isas import isa_params
from tests.support.random_blocks import filled_rows, random_rows
from tests.support.random_model import RandomModel, write_random_model


def linear(
    m: _kernels.Matrix, x: np.ndarray, use_q8: bool, threads: int, isa: str, **kw: Any
) -> np.ndarray:
    rows, n = x.shape
    y = kw.get("y", np.zeros((rows, m.n_out), np.float32))
    bias, acc = kw.get("bias"), "y" in kw
    if use_q8:
        q, d = np.zeros((rows, n), np.int8), np.zeros((rows, n // 32), np.float32)
        s, g = d.copy(), np.zeros((rows, n // 16), np.int32)
        _kernels.linear(m, rows, x, q, d, s, g, True, True, y, bias, acc, threads, isa=isa)
    else:
        _kernels.linear(
            m, rows, x, None, None, None, None, False, False, y, bias, acc, threads, isa=isa
        )
    return y


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


#: every quantized type repacks
REPACKED = Q8_TYPES


def width(qtype: str) -> int:
    """13 blocks (a tail past the last 8 of the running sums), or 9 super-blocks."""
    return 256 * 9 if block_elems(qtype) == 256 else 32 * 13


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("qtype", REPACKED)
@pytest.mark.parametrize("use_q8", [True, False], ids=["q8", "f32"])
@pytest.mark.parametrize("n_out", [*range(1, 18), 31, 64, 69])
def test_repacked_rows_compute_the_stored_rows_bits(
    n_out: int, use_q8: bool, qtype: str, isa: str
) -> None:
    rng = np.random.default_rng(n_out)
    n = width(qtype)
    raw = random_rows(rng, qtype, n_out, n, scale=1 / np.sqrt(n))
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[:, :32] *= 20.0
    stored = _kernels.Matrix([(raw, qtype, n_out, n, 0)])
    assert stored.repacked == (False,)
    expected = bits(linear(stored, x, use_q8, 1, "portable"))
    packed = _kernels.Matrix([(raw, qtype, n_out, n, 0)], repack=True, threads=3)
    assert packed.repacked == (True,)
    for threads in (1, 2, 3, 5):
        np.testing.assert_array_equal(bits(linear(packed, x, use_q8, threads, isa)), expected)
    one_by_one = np.concatenate([linear(packed, x[j : j + 1], use_q8, 1, isa) for j in range(6)])
    np.testing.assert_array_equal(bits(one_by_one), expected)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("qtype", REPACKED)
def test_every_row_count_about_the_decode_kernels_limit_computes_the_stored_rows_bits(
    qtype: str, isa: str
) -> None:
    """1 to 9 activation rows multiplied together, about the 4 rows up to which a step
    takes the decode kernels (one group per pass, another set's kernel: ``Isa.q8_x8_rows``) and
    past which it takes a prefill's (two groups per 512-bit vector, tiles), 24 weight
    rows (two groups at once, then one): the same bits as the stored rows."""
    rng = np.random.default_rng(9)
    n = width(qtype)
    raw = random_rows(rng, qtype, 24, n, scale=1 / np.sqrt(n))
    x = rng.standard_normal((9, n)).astype(np.float32)
    stored = _kernels.Matrix([(raw, qtype, 24, n, 0)])
    packed = _kernels.Matrix([(raw, qtype, 24, n, 0)], repack=True)
    for rows in range(1, 10):
        expected = bits(linear(stored, x[:rows], True, 1, "portable"))
        np.testing.assert_array_equal(bits(linear(packed, x[:rows], True, 2, isa)), expected)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("qtype", REPACKED)
def test_a_prefills_tile_of_rows_at_the_extremes_computes_the_stored_rows_bits(
    qtype: str, isa: str
) -> None:
    """37 activation rows (a tile of 32 and one of 5: the tiles' remainders) of every
    quant at its largest or smallest code times activations all of one sign (every 8-bit
    activation +-127): the largest integer sums a kernel forms (the 16-bit pair sums of
    AVX2 and AVX-512 BW among them), and random rows besides; 24 weight rows (two groups
    at once, then one)."""
    rng = np.random.default_rng(5)
    n, rows = width(qtype), 37
    blocks = [filled_rows(qtype, 8, n, fill, 0.01) for fill in (0xFF, 0x00)]
    raw = np.concatenate([*blocks, random_rows(rng, qtype, 8, n, scale=1 / np.sqrt(n))])
    x = np.abs(rng.standard_normal((rows, n))).astype(np.float32) + 1.0
    x[1::2] *= -1.0
    x[::3, :] = 3.0  # every activation of a block equal
    x[2::3, :] = -3.0
    expected = bits(linear(_kernels.Matrix([(raw, qtype, 24, n, 0)]), x, True, 1, "portable"))
    packed = _kernels.Matrix([(raw, qtype, 24, n, 0)], repack=True)
    for threads in (1, 2):
        np.testing.assert_array_equal(bits(linear(packed, x, True, threads, isa)), expected)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("qtype", REPACKED)
def test_rows_of_8_bit_activations_further_apart_give_the_same_bits(qtype: str, isa: str) -> None:
    """The step buffers' rows of 8-bit activations are padded (``q_row_stride``): a
    (rows, n) view of wider rows is written and read as rows that far apart, every
    product the same bits as from packed rows, the padding left as it was; 37 rows (a
    prefill's tile and its remainder), 1 and 2 threads; a view that is not rows of n
    bytes (every other byte) is refused naming ``q``."""
    rng = np.random.default_rng(11)
    n, rows = width(qtype), 37
    raw = random_rows(rng, qtype, 24, n, scale=1 / np.sqrt(n))
    x = rng.standard_normal((rows, n)).astype(np.float32)
    for repack in (False, True):
        m = _kernels.Matrix([(raw, qtype, 24, n, 0)], repack=repack)
        expected = bits(linear(m, x, True, 1, "portable"))
        for threads in (1, 2):
            wide = rng.integers(-128, 128, (rows, q_row_stride(n)), dtype=np.int8)
            pad = wide[:, n:].copy()
            q = wide[:, :n]
            d, g = np.zeros((rows, n // 32), np.float32), np.zeros((rows, n // 16), np.int32)
            s, y = d.copy(), np.zeros((rows, 24), np.float32)
            _kernels.linear(m, rows, x, q, d, s, g, True, True, y, None, False, threads, isa=isa)
            np.testing.assert_array_equal(bits(y), expected)
            np.testing.assert_array_equal(wide[:, n:], pad)
            again = np.zeros_like(y)  # the rows made once, read again (quantize false)
            _kernels.linear(m, rows, x, q, d, s, g, False, True, again, None, False, threads,
                            isa=isa)  # fmt: skip
            np.testing.assert_array_equal(bits(again), expected)
    sparse = np.zeros((rows, 2 * n), np.int8)[:, ::2]
    with pytest.raises(TypeError, match="q: a C-contiguous"):
        _kernels.linear(m, rows, x, sparse, d, s, g, True, True, y, None, False, 1, isa=isa)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize(
    ("qtype", "other"),
    [("Q4_0", "Q5_0"), ("Q4_1", "Q5_1"), ("Q4_K", "Q2_K"), ("Q3_K", "Q6_K")],
)
def test_a_repacked_part_beside_others_writes_its_columns_with_bias_and_accumulation(
    qtype: str, other: str, isa: str
) -> None:
    rng = np.random.default_rng(1)
    n = 256
    a, b = random_rows(rng, qtype, 13, n), random_rows(rng, other, 5, n)
    parts = [(a, qtype, 13, n, 0), (b, other, 5, n, 14)]
    x = rng.standard_normal((3, n)).astype(np.float32)
    bias = rng.standard_normal(19).astype(np.float32)
    start = np.full((3, 19), 1.5, np.float32)
    want = linear(_kernels.Matrix(parts), x, True, 1, "portable", y=start.copy(), bias=bias)
    m = _kernels.Matrix(parts, repack=True)
    assert m.repacked == (True, True)
    got = linear(m, x, True, 2, isa, y=start.copy(), bias=bias)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_every_quantized_type_repacks_and_no_float_type() -> None:
    rng = np.random.default_rng(2)
    for qtype in FLOAT_TYPES:
        n = 256
        raw = random_rows(rng, qtype, 9, n)
        assert _kernels.Matrix([(raw, qtype, 9, n, 0)], repack=True).repacked == (False,)
    for qtype in REPACKED:
        raw = random_rows(rng, qtype, 9, 256)
        assert _kernels.Matrix([(raw, qtype, 9, 256, 0)], repack=True).repacked == (True,)


@pytest.mark.parametrize("qtype", REPACKED)
def test_looking_up_repacked_rows_is_the_gguf_packages_dequantization(qtype: str) -> None:
    rng = np.random.default_rng(3)
    n, rows = (512 if block_elems(qtype) == 256 else 32 * 5), 21
    raw = random_rows(rng, qtype, rows, n, scale=0.3)
    m = _kernels.Matrix([(raw, qtype, rows, n, 0)], repack=True)
    ids = np.array([0, 7, 8, 20, 13, 20], np.int32)
    out = np.zeros((len(ids), n), np.float32)
    _kernels.embed(m, ids, out, 2)
    want = np.asarray(quants.dequantize(raw, GGMLQuantizationType[qtype]), np.float32)[ids]
    np.testing.assert_array_equal(bits(out), bits(want))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_bound_stage_holds_the_repacked_copy_instead_of_the_files_pages(
    tmp_path: Path,
) -> None:
    path = write_random_model(
        tmp_path / "q4_0.gguf",
        RandomModel(n_layers=4, hidden=1024, ffn=2816, heads=8, heads_kv=2, vocab=4096,
                    qtype="Q4_0", embed_qtype="Q8_0", head_qtype="Q8_0", seed=3),
    )  # fmt: skip
    tensors = GGUFReader(path).tensors
    packed = sum(  # every matrix a product reads: the embedding is only looked up
        int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" and len(t.shape) == 2
    )
    other = sum(int(t.n_bytes) for t in tensors) - packed
    assert packed > 2 * other
    (prov,) = provisions(path, 1, max_seq_len=32)
    anon0, file0 = _status_kib("RssAnon"), _status_kib("RssFile")
    w = CpuWorker()
    w.configure(prov)
    w.bind(prov.gguf_source)
    w.execute_step(0, np.array([5, 77, 300, 12, 9], np.uint32))
    anon, mapped = (_status_kib("RssAnon") - anon0) * 1024, (_status_kib("RssFile") - file0) * 1024
    w.release()
    # (no lower bound: the allocator may reuse memory the process already holds)
    assert anon < 1.2 * packed + 0.1 * other, (anon, packed)
    assert mapped < other + 0.1 * packed, (mapped, other, packed)
