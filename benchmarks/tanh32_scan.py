"""Every float32 through ``tanh32``: the kernels' bits against the NumPy twin, and the
correct rounding of every input whose double lies near a float32 rounding midpoint.

    python benchmarks/tanh32_scan.py [--first 0] [--last 0xffffffff] [--chunk-bits 20]
        [--window 16] [--sample 20000]

For each bit pattern from ``--first`` to ``--last`` (default all 2^32), in chunks:

- (a) ``runtime_core.ieee_math.tanh32_numpy`` against ``_kernels.tanh32`` on every
  instruction set this host runs (bit for bit, NaNs included);
- (b) for the non-negative patterns (``tanh64`` is odd by construction: the double of
  ``-x`` is minus that of ``x``, and rounding to nearest is symmetric), the double
  ``d = tanh64(x)`` whose float32 rounding is ``tanh32(x)``: where ``d`` lies within
  ``--window`` units of float64's last place of a float32 rounding midpoint, the float32
  ``tanh32`` gives is checked against ``decimal`` (tanh through exp, 60 digits more
  than the input's leading zeros). Elsewhere the double's error (a few units: the last
  step measures it on ``--sample`` random inputs against ``decimal``) cannot move the
  rounding across a midpoint, so ``tanh32`` is the correctly rounded float32.

Printed: the mismatches per set, the inputs near a midpoint and whether each is
correctly rounded, the largest error of the double seen. Exits 1 on any mismatch or
misrounding. About 3 minutes for the 2^32 patterns on one core of an AMD EPYC (Zen 5,
5 sets), and a second or two per 10000 of ``--sample``.
"""

from __future__ import annotations

import argparse
import sys
import time
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from runtime_core.ieee_math import tanh32_numpy, tanh64  # noqa: E402
from runtime_core.workers.cpu import _kernels  # noqa: E402

#: float32 bit patterns of +inf, and the first of the negative ones
POS_INF, NEG = 0x7F800000, 0x80000000


def exact_tanh(x: float) -> Decimal:
    """tanh(x) from Python's ``decimal``: (e^2a - 1) / (e^2a + 1), a = |x|, at 60 digits
    more than a's leading zeros (e^2a - 1 cancels them)."""
    a = abs(Decimal(x))
    if a == 0:
        return Decimal(0)
    with localcontext() as ctx:
        ctx.prec = 60 + max(0, -a.adjusted())
        e = (2 * a).exp()
        t = (e - 1) / (e + 1)
    return t if x > 0 else -t


def nearest_f32(exact: Decimal) -> np.float32:
    near = np.float32(float(exact))
    around = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return min(around, key=lambda c: abs(Decimal(float(c)) - exact))


def midpoint_distance(d: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """How far each double lies from the nearest float32 rounding midpoint, in units of
    its last place (the midpoints beside its float32 rounding, exact in float64)."""
    f = d.astype(np.float32)
    below = np.nextafter(f, np.float32(-np.inf)).astype(np.float64)
    above = np.nextafter(f, np.float32(np.inf)).astype(np.float64)
    f64 = f.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where f is the largest float32
        gap = np.minimum(np.abs(d - (f64 + below) / 2), np.abs(d - (f64 + above) / 2))
        out: npt.NDArray[np.float64] = gap / np.spacing(np.abs(d))
    return out


def scan(first: int, last: int, chunk: int, window: float) -> int:
    isas = _kernels.isas()
    mismatches = dict.fromkeys(isas, 0)
    near: list[tuple[int, float]] = []
    start = time.perf_counter()
    for lo in range(first, last + 1, chunk):
        bits = np.arange(lo, min(lo + chunk, last + 1), dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        with np.errstate(invalid="ignore"):  # signalling NaNs among the patterns
            d = tanh64(x)
        want = d.astype(np.float32).view(np.uint32)
        y = np.empty_like(x)
        for isa in isas:
            _kernels.tanh32(x, y, isa=isa)
            mismatches[isa] += int(np.count_nonzero(y.view(np.uint32) != want))
        finite = bits <= POS_INF  # the non-negative patterns
        if finite.any():
            dist = midpoint_distance(d[finite])
            for i in np.flatnonzero(dist <= window):
                near.append((int(bits[finite][i]), float(dist[i])))
        if (lo // chunk) % 256 == 0:
            print(f"  {lo:#010x}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"patterns {first:#010x}..{last:#010x}: {last - first + 1}")
    for isa, n in mismatches.items():
        print(f"(a) {isa}: {n} differ from tanh32_numpy")
    bad = 0
    print(f"(b) within {window} units of a float32 midpoint: {len(near)}")
    for b, units in near:
        v = float(np.uint32(b).view(np.float32))
        got = tanh32_numpy(np.float32(v))
        want_f = nearest_f32(exact_tanh(v))
        ok = bool(got.view(np.uint32) == want_f.view(np.uint32))
        bad += not ok
        verdict = "correctly rounded" if ok else f"WRONG, want {float(want_f).hex()}"
        print(f"  x={v.hex()} ({b:#010x}) {units:6.2f} units: tanh32 {float(got).hex()} {verdict}")
    print(f"(b) misrounded: {bad}")
    return sum(mismatches.values()) + bad


def double_error(samples: int) -> float:
    """The largest error of ``tanh64`` seen on random inputs (uniform on -10..10 and
    log-uniform from 1e-40 to 10), in units of float64's last place."""
    rng = np.random.default_rng(20261206)
    half = samples // 2
    x = np.concatenate([rng.uniform(-10, 10, half), np.exp(rng.uniform(-92, 2.3, half))])
    x32 = x.astype(np.float32)
    worst = 0.0
    for v, d in zip(x32, tanh64(x32), strict=True):
        exact = exact_tanh(float(v))
        ulp = Decimal(float(np.spacing(np.float64(abs(float(exact))))))
        worst = max(worst, float(abs(Decimal(float(d)) - exact) / ulp))
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--first", type=lambda s: int(s, 0), default=0)
    p.add_argument("--last", type=lambda s: int(s, 0), default=2**32 - 1)
    p.add_argument("--chunk-bits", type=int, default=20)
    p.add_argument("--window", type=float, default=256.0)
    p.add_argument("--sample", type=int, default=20000)
    a = p.parse_args()
    failures = scan(a.first, a.last, 1 << a.chunk_bits, a.window)
    if a.sample:
        print(f"tanh64's largest error on {a.sample} random inputs: "
              f"{double_error(a.sample):.3f} units of the last place")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
