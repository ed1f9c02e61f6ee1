"""``python -m runtime_cupy plan --model M [--ray-address ADDR] --stages N ...``: the
plan a run would get, against the live hosts of a Ray cluster (``--ray-address``) or
this host's stage processes, printed as a table (stage, node, host, layers, memory) or,
with ``--json``, as one JSON object. The planner is ``runplan``'s; the cluster query is
this runtime's (``hosts.ray.session``). A rejection prints its code and exits 2; a
cluster that cannot be reached, or a bad input, exits 2 with one line; a model this
host cannot map for want of memory (``GgufUnmapped``) exits 1 with one line, as
``python -m runtime_cupy`` does."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.table import Table

from runplan import SamplingConfig, model_facts_from_gguf, wire
from runplan.arguments import OneLineParser, positive_int
from runplan.cli import human_bytes
from runplan.facts import context_limit
from runplan.json_errors import exception_json
from runplan.memory import plan_stage_memory
from runplan.models import resolve_model
from runplan.terminal import labelled, plain_console
from runtime_core.runs import PlanRejected, facts_for_run
from runtime_cupy.cli.arguments import (
    EXIT_FAULTED,
    INPUT_ERRORS,
    RESOURCE_ERRORS,
    add_cluster,
    add_model,
    add_stages,
    add_worker,
    check_worker_arguments,
)
from runtime_cupy.cli.json_stdout import json_stdout, write_json
from runtime_cupy.hosts.ray.cluster import StageNode
from runtime_cupy.hosts.ray.session import left_at_the_end

EXIT_REJECTED = 2
DEFAULT_SEQ_LEN = 2048


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime_cupy plan",
        description="Print the plan of a run: each stage's node, host, layers and memory, "
        "against the live hosts of a Ray cluster (--ray-address) or this host.",
    )
    add_model(p)
    add_stages(p)
    add_worker(p)
    add_cluster(p)
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=None,
        help="positions of each KV cache (default: 2048, or the model's context if shorter)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    return p


def _plan(args: argparse.Namespace) -> tuple[Any, tuple[StageNode, ...] | None]:
    from runtime_cupy.api import plan_for

    context = context_limit(model_facts_from_gguf(resolve_model(args.model)))
    if args.max_seq_len is None:  # a file that states no context length: the default
        args.max_seq_len = DEFAULT_SEQ_LEN if context is None else min(DEFAULT_SEQ_LEN, context)
    elif context is not None and args.max_seq_len > context:  # the planner's words are a run's
        raise ValueError(
            f"--max-seq-len {args.max_seq_len} is past the model's context length {context}"
        )

    cluster = None
    if args.ray_address is not None:
        from runtime_cupy.hosts.ray import session

        session.connect(args.ray_address)
        cluster = session.stage_nodes(args.worker, args.stages)
    plan, _ = plan_for(
        resolve_model(args.model),
        stages=args.stages,
        prompt_len=0,
        max_tokens=args.max_seq_len,
        sampling=SamplingConfig(),
        return_logits=False,
        worker=args.worker,
        run_id="plan",
        placement=args.placement,
        cluster=cluster,
        kv_dtype=args.kv_dtype,
    )
    return plan, cluster


def _run(args: argparse.Namespace) -> int:
    from runtime_cupy.workers import capabilities

    plan, cluster = _plan(args)
    facts = facts_for_run(resolve_model(args.model), prompt_len=0, max_tokens=args.max_seq_len)
    memory = plan_stage_memory(facts, capabilities(args.worker, args.kv_dtype), plan)
    where = {n.node_id: n for n in cluster or ()}
    rows = []
    for stage, use in zip(plan.stages, memory, strict=True):
        node = where.get(stage.node_id)
        rows.append(
            {
                "stage_index": stage.stage_index,
                "node_id": stage.node_id,
                "host": node.host.label if node else "this host",
                "address": node.host.address if node else None,
                "ray_node_id": node.host.ray_node_id if node else None,
                "device": node.device if node else None,
                "layer_start": stage.layer_start,
                "layer_end_exclusive": stage.layer_end_exclusive,
                "weight_bytes": use.weight_bytes,
                "kv_bytes": use.kv_bytes,
                "ring_bytes": use.ring_bytes,
                "total_bytes": use.total,
                "host_memory_bytes": node.spec.memory_bytes if node else None,
            }
        )
    if args.json:
        write_json({"plan": json.loads(wire.dumps(plan)), "stages": rows})
        return 0
    title = f"{plan.model.model_id}: {plan.stage_count} stages ({args.placement} placement)"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("stage", "node", "host", "layers", "weights", "KV cache", "total", "memory"):
        table.add_column(
            col, justify="right" if col in ("weights", "KV cache", "total") else "left"
        )
    for row in rows:
        memory_text = human_bytes(row["host_memory_bytes"]) if row["host_memory_bytes"] else "-"
        table.add_row(
            str(row["stage_index"]),
            row["node_id"],
            row["host"],
            f"{row['layer_start']}-{row['layer_end_exclusive'] - 1}",
            human_bytes(row["weight_bytes"]),
            human_bytes(row["kv_bytes"]),
            human_bytes(row["total_bytes"]),
            memory_text,
        )
    plain_console(soft_wrap=True).print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_worker_arguments(parser, args)
    with json_stdout(args.json), left_at_the_end():  # Ray's driver prints into stdout
        try:
            return _run(args)
        except RESOURCE_ERRORS as exc:  # the host's fault, caught before INPUT_ERRORS
            _error(args, exc)
            return EXIT_FAULTED
        except INPUT_ERRORS as exc:  # PlanRejected among them
            _error(args, exc)
            return EXIT_REJECTED


def _error(args: argparse.Namespace, exc: Exception) -> None:
    if args.json:
        write_json(exception_json(exc))
    else:
        code = exc.rejection.code if isinstance(exc, PlanRejected) else None
        what = f"rejected ({code})" if code else "error"
        plain_console(stderr=True, soft_wrap=True).print(
            labelled(what, "bold red", str(exc)), highlight=False
        )
