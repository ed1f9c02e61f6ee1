"""One product of the CPU worker's repacked groups alone in a loop, this checkout's
against another's, side by side.

    python benchmarks/cpu_x8_loop.py [--types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K]
        [--isas avx2,avxvnni,avx512bw,avx512,avx512-intel] [--rows 1,2]
        [--shapes 1024x4096,14336x4096]
        [--passes 0] [--repeat 5] [--baseline DIR] [--json OUT.json]

The kernel the module's ``linear`` takes for the type, instruction set and activation
row count (``ops.c``'s ``linear_x8``: a decode step's kernel of ``q8_x8_rows`` where
the set has one, else two groups at once where it has them, else one), compiled by
``gcc`` with the module's flags into a small program (``benchmarks/csrc/x8_loop.c``,
linked with the kernels' files) that times it on one thread over a matrix of random
groups: no Python, thread pool or quantization of the activations in the way, so that a
change to a kernel shows above this machine's noise (``benchmarks/cpu_repack.py`` times
the module's whole call). Sets this processor does not run (as the module reads its
flags) are skipped, with the reason.
``--baseline DIR``: also builds DIR's kernels (``src/runtime_core/workers/cpu/csrc``
of a checkout of another commit) and runs the two in turn, ``--repeat`` times each;
every figure is the best pass of all. The first shape stays in cache, the second is
read from memory (in 2 MiB pages where the kernel gives them, as the module's repacked
weights); GB/s counts the repacked bytes read. Two builds of the same kernel have
measured up to 1.2x apart on this busy host: compare runs, not one figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import tempfile
from pathlib import Path

from runtime_core.workers.cpu import _kernels

ROOT = Path(__file__).resolve().parent.parent
CSRC = Path("src/runtime_core/workers/cpu/csrc")
LOOP = ROOT / "benchmarks" / "csrc" / "x8_loop.c"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]

#: the types the module repacks (repack.h)
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: the sets whose kernels of repacked groups the loop times (x8_loop.c: the portable
#: set's are its plain C, not timed here)
ISAS = tuple(isa for isa in _kernels.KNOWN_ISAS if isa != "portable")


def runs_here(isa: str) -> bool:
    """Whether this processor runs ``isa``: the module's own reading of its flags
    (module.c), one table of them for the worker and this loop."""
    return isa in _kernels.isas()


def build(csrc: Path, out: Path, opt: str = "-O3") -> Path:
    """The loop linked with ``csrc``'s kernels (every instruction set's file), each
    file compiled in a process of its own (``opt``: the module's -O3 unless a test
    asks for a quicker build)."""
    # the instruction sets' tables name their quantizers, exponentials and tanh
    # (quantize_*.c; ieee32.c, exp32.c in an older checkout; where a checkout has them)
    sources = [
        LOOP,
        *sorted(csrc.glob("dot_*.c")),
        *sorted(csrc.glob("quantize_*.c")),
        *sorted(csrc.glob("ieee32.c")),
        *sorted(csrc.glob("exp32.c")),
        csrc / "repack.c",
    ]
    flags = [opt, *FLAGS[1:], f"-I{csrc}"]
    compiles = {
        src: subprocess.Popen(
            ["gcc", *flags, "-c", str(src), "-o", str(out / f"{src.stem}.o")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for src in sources
    }
    for src, c in compiles.items():
        _, err = c.communicate()
        if c.returncode:
            raise RuntimeError(f"gcc failed on {src}: {err}")
    exe = out / "x8_loop"
    objects = [str(out / f"{src.stem}.o") for src in sources]
    subprocess.run(["gcc", *objects, "-o", str(exe), "-lm"], check=True)
    return exe


def run(
    exe: Path, isa: str, qtype: str, shape: tuple[int, int], rows: int, passes: int
) -> tuple[float, int]:
    """The best pass's milliseconds, and the repacked bytes a pass reads."""
    args = [str(exe), isa, qtype, str(shape[0]), str(shape[1]), str(rows), str(passes)]
    done = subprocess.run(args, check=True, capture_output=True, text=True)
    ms, nbytes, _ = done.stdout.split()
    return float(ms), int(nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--isas", default=",".join(ISAS))
    parser.add_argument("--rows", default="1", help="activation rows, a list (1: decode)")
    parser.add_argument("--shapes", default="1024x4096,14336x4096")
    parser.add_argument("--passes", type=int, default=0, help="passes a run (0: by size)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each build, in turn")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    isas = []
    for isa in args.isas.split(","):
        if isa not in ISAS:
            parser.error(f"--isas: unknown {isa!r} (known: {', '.join(ISAS)})")
        if runs_here(isa):
            isas.append(isa)
        else:
            print(f"{isa}: skipped (this processor runs {', '.join(_kernels.isas())})")
    shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(",")]
    trees = {"this": ROOT / CSRC}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve() / CSRC
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        exes = {}
        for name, tree in trees.items():
            (Path(tmp) / name).mkdir()
            exes[name] = build(tree, Path(tmp) / name)
        for qtype, isa, shape in itertools.product(args.types.split(","), isas, shapes):
            _, nbytes = run(exes["this"], isa, qtype, shape, 1, 1)  # the bytes of a pass
            for rows in (int(r) for r in args.rows.split(",")):
                passes = args.passes or max(3, int(4e8 / nbytes / rows))
                best = dict.fromkeys(exes, float("inf"))
                for _ in range(args.repeat):
                    for name, exe in exes.items():
                        ms, _ = run(exe, isa, qtype, shape, rows, passes)
                        best[name] = min(best[name], ms)
                row = {"type": qtype, "isa": isa, "shape": list(shape), "rows": rows}
                row.update({f"{k}_ms": v for k, v in best.items()})
                figures.append(row)
                line = (
                    f"{shape[0]:5} x {shape[1]} {qtype} {isa:8} {rows:2} row(s): "
                    f"{best['this']:8.4f} ms ({nbytes / best['this'] / 1e6:5.1f} GB/s)"
                )
                if "baseline" in best:
                    was = best["baseline"]
                    line += f", baseline {was:8.4f} ms: x{was / best['this']:.2f}"
                print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
