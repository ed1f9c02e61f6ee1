"""Why the CPU worker's kernels are C: the same product written with Numba, side by side.

    python benchmarks/cpu_engine.py --numba-python PYTHON [--threads 1] [--repeat 3]

``PYTHON`` is an interpreter with Numba and NumPy installed (Numba is not a dependency
of this project: ``python -m venv /tmp/nb && /tmp/nb/bin/pip install numba``). One
Q4_1 x Q8_1 product (SmolLM2's weight type), the block formula of ``csrc/dot.h``, written
straightforwardly with ``@njit(parallel=True, cache=True)`` (Numba has no half floats on
the CPU: the factors are decoded with integer operations), against the C kernel
(``runtime_core.workers.cpu._kernels.linear``) on the same random blocks, for a 1536 x 576
matrix (in cache) and a 49152 x 576 one (SmolLM2's head size, from memory).

Printed: Numba's import time, its first call in a fresh cache folder (compilation) and
in a second process (the cache), and microseconds per product for both engines, each
the best of ``--repeat`` timings, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np

SHAPES = ((1536, 576), (49152, 576))

NUMBA_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import numba
from numba import njit, prange
t_import = time.perf_counter() - t0

@njit(cache=True, inline="always")
def h2f(lo, hi, tmp):
    h = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 0:
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    if e == 31:
        tmp[0] = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    else:
        tmp[0] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    return tmp.view(np.float32)[0]

@njit(cache=True, parallel=True)
def matvec_q4_1(w, n_out, nc, xq, xd, xs, y):
    for r in prange(n_out):
        tmp = np.zeros(1, np.uint32)
        acc = np.zeros(8, np.float32)
        for c in range(nc):
            b = c * 20
            d = h2f(w[r, b], w[r, b + 1], tmp)
            m = h2f(w[r, b + 2], w[r, b + 3], tmp)
            s = np.int32(0)
            for l in range(16):
                q = w[r, b + 4 + l]
                s += (np.int32(q & 15) * np.int32(xq[32 * c + l])
                      + np.int32(q >> 4) * np.int32(xq[32 * c + l + 16]))
            acc[c & 7] += (d * xd[c]) * np.float32(s) + m * xs[c]
        y[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))

args = json.loads(sys.argv[1])
numba.set_num_threads(args["threads"])
out = {"import_s": t_import, "shapes": {}}
for (n_out, n_in), path in zip(args["shapes"], args["weights"]):
    nc = n_in // 32
    w = np.load(path)
    xq = np.load(args["xq"])[:n_in]
    xd, xs = np.full(nc, 0.01, np.float32), np.full(nc, 0.1, np.float32)
    y = np.zeros(n_out, np.float32)
    t0 = time.perf_counter(); matvec_q4_1(w, n_out, nc, xq, xd, xs, y)
    first = time.perf_counter() - t0
    best = 1e9
    for _ in range(args["repeat"]):
        reps = max(3, 20000000 // (n_out * n_in))
        t0 = time.perf_counter()
        for _ in range(reps):
            matvec_q4_1(w, n_out, nc, xq, xd, xs, y)
        best = min(best, (time.perf_counter() - t0) / reps)
    out["shapes"][f"{n_out}x{n_in}"] = {"first_call_s": first, "product_s": best}
print(json.dumps(out))
"""


def c_product_s(w: np.ndarray, n_in: int, threads: int, repeat: int) -> float:
    from runtime_core.workers.cpu import _kernels

    n_out = w.shape[0]
    m = _kernels.Matrix([(w, "Q4_1", n_out, n_in, 0)])
    x = np.random.default_rng(2).standard_normal((1, n_in)).astype(np.float32)
    q, d = np.zeros((1, n_in), np.int8), np.zeros((1, n_in // 32), np.float32)
    s, g, y = d.copy(), np.zeros((1, n_in // 16), np.int32), np.zeros((1, n_out), np.float32)
    _kernels.linear(m, 1, x, q, d, s, g, True, True, y, None, False, threads)
    best = 1e9
    for _ in range(repeat):
        reps = max(3, 20000000 // (n_out * n_in))
        t0 = time.perf_counter()
        for _ in range(reps):
            _kernels.linear(m, 1, x, q, d, s, g, False, True, y, None, False, threads)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numba-python", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="cpu-engine-") as tmp:
        weights = []
        for i, (n_out, n_in) in enumerate(SHAPES):
            nc = n_in // 32
            w = rng.integers(0, 256, (n_out, nc * 20), dtype=np.uint8)
            blocks = w.reshape(n_out, nc, 20)
            blocks[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            blocks[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
            path = os.path.join(tmp, f"w{i}.npy")
            np.save(path, w)
            weights.append((w, path))
        xq = os.path.join(tmp, "xq.npy")
        np.save(xq, rng.integers(-127, 128, 4096).astype(np.int8))
        job = {"shapes": SHAPES, "weights": [p for _, p in weights], "xq": xq,
               "threads": args.threads, "repeat": args.repeat}  # fmt: skip
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(tmp, "numba-cache"))
        script = os.path.join(tmp, "numba_q4_1.py")  # Numba caches functions of files only
        with open(script, "w") as f:
            f.write(NUMBA_CHILD)
        runs = []
        for _ in ("cold", "warm"):
            proc = subprocess.run(
                [args.numba_python, script, json.dumps(job)],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        c_times = {
            f"{w.shape[0]}x{n_in}": c_product_s(w, n_in, args.threads, args.repeat)
            for (w, _), (_, n_in) in zip(weights, SHAPES, strict=True)
        }
    cold, warm = runs
    print(f"Q4_1 x Q8_1 product, {args.threads} thread(s), best of {args.repeat}")
    print(f"  import numba: {cold['import_s']:.2f} s (cold), {warm['import_s']:.2f} s (warm)")
    for name, c_s in c_times.items():
        nb_cold, nb_warm = cold["shapes"][name], warm["shapes"][name]
        print(
            f"  {name:10} first call {nb_cold['first_call_s']:.2f} s compiling, "
            f"{nb_warm['first_call_s']:.2f} s from the cache; product: numba "
            f"{nb_warm['product_s'] * 1e6:.0f} us, C {c_s * 1e6:.0f} us "
            f"(numba / C {nb_warm['product_s'] / c_s:.1f}x)"
        )


if __name__ == "__main__":
    main()
