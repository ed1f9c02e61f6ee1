"""What this machine has for stage processes: its memory, each GPU's memory (as
``nvidia-smi`` reports it, else as CuPy reads it), and one node per stage placed on it
(the local host's node pool; a Ray cluster's is ``hosts.ray.cluster``'s)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from runplan import NodeSpec
from runtime_cupy.workers import WorkerUnavailable


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def gpu_memory_bytes() -> dict[int, int]:
    """Total memory of each GPU ``nvidia-smi`` lists (none without it; 0 for a GPU
    whose memory it does not report, such as ``[N/A]``)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    gpus: dict[int, int] = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit():
            gpus[int(index)] = int(mib) * 2**20 if mib.strip().isdigit() else 0
    return gpus


def cupy_gpu_memory_bytes(gpus: Sequence[int]) -> dict[int, int]:
    """Total memory of each of ``gpus`` as CuPy reads it (``cudaGetDeviceProperties``),
    for hosts where ``nvidia-smi`` reports none; ``WorkerUnavailable`` when CuPy cannot
    tell. CuPy numbers the devices this process sees, which are ``nvidia-smi``'s (the
    numbers the launcher hands each stage) only while ``CUDA_VISIBLE_DEVICES`` is unset."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        raise WorkerUnavailable(
            f"cannot tell the memory of GPU {list(gpus)}: nvidia-smi reports none, and "
            "with CUDA_VISIBLE_DEVICES set CuPy's device numbers are not the GPUs' "
            "(unset it, or make nvidia-smi report memory.total)"
        )
    try:
        import cupy

        runtime = cupy.cuda.runtime
        count = int(runtime.getDeviceCount())
        out = {}
        for g in gpus:
            if 0 <= g < count:
                out[g] = int(runtime.getDeviceProperties(g)["totalGlobalMem"])
    except (ImportError, RuntimeError) as exc:  # no CuPy; CUDARuntimeError: no driver
        raise WorkerUnavailable(
            f"cannot tell the memory of GPU {list(gpus)}: nvidia-smi reports none and "
            f"CuPy cannot read it ({type(exc).__name__}: {exc})"
        ) from exc
    return out


def place_stages(
    stages: int, worker: str, gpus: Sequence[int] | None
) -> tuple[tuple[NodeSpec, ...], tuple[int | None, ...]]:
    """One node per stage process. NumPy stages share the host's memory; CUDA stage
    ``i`` runs on ``gpus[i % len(gpus)]`` (every GPU ``nvidia-smi`` lists by default)
    and stages on one GPU share its memory: the GPU's total as ``nvidia-smi`` reports
    it, or else as CuPy reads it. A GPU whose memory neither tells is refused
    (``WorkerUnavailable``), never planned against a guess; GPUs named for a worker
    that runs on the CPU are refused too (``ValueError``), never ignored."""
    if worker != "cuda":
        if gpus:
            raise ValueError(
                f"GPUs {list(gpus)} were named, but the {worker} worker runs on the CPU: "
                "GPUs are the cuda worker's"
            )
        host = host_memory_bytes()
        nodes = tuple(NodeSpec(f"stage-{i}", host, device="host") for i in range(stages))
        return nodes, (None,) * stages
    memory = gpu_memory_bytes()
    chosen = list(gpus) if gpus else sorted(memory)
    if not chosen:
        raise WorkerUnavailable(
            "the CUDA worker needs a GPU; nvidia-smi lists none (name them with gpus=, "
            "--gpus on the command line)"
        )
    missing = [g for g in chosen if g not in memory]
    if missing and memory:
        raise ValueError(f"no GPU {missing} on this host (GPUs: {sorted(memory)})")
    unknown = sorted({g for g in chosen if memory.get(g, 0) <= 0})
    if unknown:
        memory.update(cupy_gpu_memory_bytes(unknown))
        still = [g for g in unknown if memory.get(g, 0) <= 0]
        if still:
            raise WorkerUnavailable(
                f"cannot tell the memory of GPU {still}: neither nvidia-smi nor CuPy "
                "reports it (CuPy sees no such device)"
            )
    devices = tuple(chosen[i % len(chosen)] for i in range(stages))
    nodes = tuple(
        NodeSpec(f"stage-{i}", memory[g], device=f"gpu{g}") for i, g in enumerate(devices)
    )
    return nodes, devices
