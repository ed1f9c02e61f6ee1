"""What ``python -m runtime_cupy`` prints of a run's result: the ``--json`` object
(``_result_json``: tokens, text, outcome, fault, stages, edges, timings, slices), the
summary on standard output (``_print_summary``: the stages' table, each slice that
travelled, the timings), and the ``--trace`` file (``_write_trace``: one line saying
why it cannot be written, nothing half-written left)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from runtime_core.console import shown_figures
from runtime_core.trace_file import write_trace
from runtime_cupy.api import GenerateResult
from runtime_cupy.cli.arguments import stage_processes
from runtime_cupy.process.tracing import chrome_trace
from runtime_cupy.slices.progress import describe, figures


def _write_trace(path: Path, result: GenerateResult, err: Console) -> str | None:
    """The run's trace in ``path`` (``None``); else one line on ``err`` saying why (and
    returned), nothing half-written left (``runtime_core.trace_file``)."""
    message = write_trace(path, json.dumps(chrome_trace(list(result.trace or ()))))
    if message is not None:
        err.print(f"error: {message}", highlight=False)
    return message


def _round(value: float | None, scale: float, digits: int) -> float | None:
    return None if value is None else round(value * scale, digits)


def _timings(result: GenerateResult, prompt_len: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_len,
        "load_s": _round(result.load_s, 1, 3),
        "ttft_ms": _round(result.ttft_us, 1e-3, 3),
        "tpot_ms": _round(result.tpot_us, 1e-3, 3),
        "decode_tokens_per_s": _round(result.wall_decode_tokens_per_s, 1, 2),
        "wall_s": round(result.wall_s, 3),
    }


def _frames(medium: str, encrypted: bool) -> str | None:
    """How an edge's frames are sealed (``None``: shared memory, which seals none)."""
    if medium != "tcp":
        return None
    return "encrypted" if encrypted else "authenticated"


def _result_json(result: GenerateResult, prompt_len: int) -> dict[str, Any]:
    procs = {s.stage_index: s for s in result.stages}
    return {
        "run_id": result.plan.run_id,
        "chain_id": result.chain_id,
        "tokens": list(result.tokens),
        "text": result.text,
        "outcome": result.outcome,
        "fault": result.fault,
        "interrupted_by": result.interrupted_by,
        "stages": [
            {
                "stage_index": s.stage_index,
                "node_id": s.node_id,
                "layer_start": s.layer_start,
                "layer_end_exclusive": s.layer_end_exclusive,
                "pid": procs[s.stage_index].pid if s.stage_index in procs else None,
                "device": procs[s.stage_index].device if s.stage_index in procs else None,
                "exit_status": procs[s.stage_index].returncode if s.stage_index in procs else None,
                "host": (procs[s.stage_index].host if s.stage_index in procs else None)
                or "this host",
            }
            for s in result.plan.stages
        ],
        "edges": [
            {
                "edge_id": e.edge_id,
                "kind": e.kind.name.lower(),
                "medium": medium,
                "frames": _frames(medium, result.encrypted_edges),
            }
            for e, medium in zip(result.plan.edges, result.media, strict=False)
        ],
        "timings": _timings(result, prompt_len),
        "slices": figures(result.slices),
    }


def _print_summary(console: Console, result: GenerateResult, prompt_len: int, worker: str) -> None:
    console.print(
        f"{result.plan.model.model_id} through {stage_processes(result.plan.stage_count)} "
        f"({worker} worker, edges: {', '.join(sorted(set(result.media))) or '-'})",
        highlight=False,
    )
    procs = {s.stage_index: s for s in result.stages}
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("stage", "node", "host", "layers", "pid", "device"):
        table.add_column(col)
    for s in result.plan.stages:
        proc = procs.get(s.stage_index)
        table.add_row(
            str(s.stage_index),
            s.node_id,
            (proc.host if proc else None) or "this host",
            f"{s.layer_start}-{s.layer_end_exclusive - 1}",
            str(proc.pid) if proc else "-",
            "cpu" if proc is None or proc.device is None else f"gpu {proc.device}",
        )
    console.print(table)
    for transfer in result.slices:
        console.print(describe(transfer), highlight=False)
    t = shown_figures(_timings(result, prompt_len))
    status = result.outcome + (f" ({result.fault})" if result.fault else "")
    console.print(
        f"{len(result.tokens)} tokens, {status}. time to first token {t['ttft_ms']} ms, "
        f"decode {t['decode_tokens_per_s']} tokens/s; load {t['load_s']} s, "
        f"wall {t['wall_s']} s",
        highlight=False,
    )
