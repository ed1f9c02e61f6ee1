"""``python -m runplan facts MODEL``, ``python -m runplan plan MODEL ...``,
``python -m runplan check PLAN.json`` (in ``runplan.check_cli``) and
``python -m runplan split MODEL ...`` (in ``runplan.shard_cli``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import cattrs
from rich import box
from rich.table import Table

from runplan import wire
from runplan.arguments import (
    OneLineParser,
    add_version,
    human_bytes,
    parse_nodes,
    parse_size,
    positive_int,
)
from runplan.check_cli import add_check_parser
from runplan.config import RuntimeConfig, WorkerCapabilities
from runplan.dtypes import DTYPES_BY_NAME
from runplan.facts import ModelFacts
from runplan.gguf_error import GgufError
from runplan.gguf_facts import model_facts_from_gguf
from runplan.json_errors import exception_json, print_json, rejection_fields, rejection_json
from runplan.models import DEFAULT_MODEL, MODEL_HELP, ModelNotFound, resolve_model
from runplan.placement import Placement
from runplan.plan import RunPlan
from runplan.planner import device_memory, plan_run
from runplan.pool import NodePool
from runplan.rejections import PlanRejection
from runplan.shard_cli import (
    OutputFolderError,
    add_split_parser,
    print_shard_facts,
    shard_facts,
)
from runplan.terminal import labelled, plain_console

EXIT_REJECTED = 2
EXIT_INPUT = 1
__all__ = ["EXIT_INPUT", "EXIT_REJECTED", "build_parser", "human_bytes", "main", "parse_nodes",
           "parse_size"]  # fmt: skip


def _load_facts(args: argparse.Namespace) -> ModelFacts:
    return model_facts_from_gguf(resolve_model(args.model), max_seq_len=args.max_seq_len)


def _cmd_facts(args: argparse.Namespace) -> int:
    shard = shard_facts(resolve_model(args.model))
    if shard is not None:
        print_shard_facts(shard, args.json)
        return 0
    facts = _load_facts(args)
    if args.json:
        print_json({"facts": cattrs.unstructure(facts)})
        return 0
    table = Table(title=facts.model_id, show_header=False, box=box.SIMPLE)
    table.add_column("fact")
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, str]] = [
        ("source", str(facts.gguf_source)),
        ("architecture", facts.architecture),
        ("layers", str(facts.num_layers)),
        ("hidden dim", str(facts.hidden_dim)),
        ("heads / kv heads", f"{facts.head_count} / {facts.head_count_kv}"),
        ("head dim k / v", f"{facts.head_dim_k} / {facts.head_dim_v}"),
        ("vocab size", str(facts.vocab_size)),
        ("eos token id", str(facts.eos_token_id)),
        ("context length", str(facts.context_length or "0 (none stated)")),
        ("max seq len", str(facts.max_seq_len)),
        ("quant types", ", ".join(facts.quant_types)),
        (
            "block bytes",
            f"{human_bytes(sum(facts.block_bytes))} in {facts.num_layers} blocks "
            f"({human_bytes(min(facts.block_bytes, default=0))}"
            f"..{human_bytes(max(facts.block_bytes, default=0))} each)",
        ),
        ("embedding", human_bytes(facts.embedding_bytes)),
        (
            "output norm + head",
            human_bytes(facts.output_bytes)
            + (" (tied to the embedding)" if facts.tied_embeddings else ""),
        ),
        ("shared tensors", human_bytes(facts.shared_bytes)),
        *_attention_rows(facts),
    ]
    for name, value in rows:
        table.add_row(name, value)
    plain_console().print(table)
    return 0


def _attention_rows(facts: ModelFacts) -> list[tuple[str, str]]:
    """Each kind of block (sliding with its window, or global): how many, which, their
    rotary base, and what one block's KV cache holds (positions, bytes at f32)."""
    windows = facts.layer_windows or (0,) * facts.num_layers
    bases = facts.layer_rope_freq_bases
    positions = facts.layer_kv_positions()
    kv = facts.layer_kv_bytes(4)
    kinds: dict[tuple[int, float | None], list[int]] = {}
    for i, window in enumerate(windows):
        kinds.setdefault((window, bases[i] if bases else None), []).append(i)
    rows = []
    for (window, base), blocks in kinds.items():
        kind = f"sliding window of {window}" if window else "global"
        which = "every block" if len(blocks) == facts.num_layers else _block_list(blocks)
        rope = f", rope base {base:g}" if base is not None else ""
        i = blocks[0]
        rows.append(
            (
                f"attention: {kind}",
                f"{which}{rope}; KV cache {positions[i]} positions "
                f"({human_bytes(kv[i])} per block at f32)",
            )
        )
    return rows


def _block_list(blocks: list[int]) -> str:
    """``3 blocks (0-1, 5)``: how many, and which as runs of consecutive blocks."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    spans = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    noun = "block" if len(blocks) == 1 else "blocks"
    return f"{len(blocks)} {noun} ({spans})"


def _cmd_plan(args: argparse.Namespace) -> int:
    facts = _load_facts(args)
    family, width = DTYPES_BY_NAME[args.dtype]
    stored = args.weights == "stored"
    kv = {None: 0 if stored else 4, "f32": 4, "f16": 2}[args.kv_dtype]
    config = RuntimeConfig(
        run_id=args.run_id,
        max_tokens=args.max_tokens,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        worker=WorkerCapabilities(
            name="quantized" if stored else "numpy-reference",
            weight_bytes_per_element=0 if stored else 4,
            kv_bytes_per_element=kv,
        ),
    )
    pool = NodePool(orchestrator_node_id=args.orchestrator, nodes=args.nodes)
    stage_count = args.stages if args.stages is not None else len(args.nodes)
    chosen = tuple(n.node_id for n in args.nodes[:stage_count])
    placement = (Placement.even if args.placement == "even" else Placement.by_memory)(chosen)
    result = plan_run(facts, config, pool, stage_count=stage_count, placement=placement)
    if isinstance(result, PlanRejection):
        if args.json:
            print_json(rejection_json(result) | {"rejection": rejection_fields(result)})
        else:
            plain_console(stderr=True, soft_wrap=True).print(
                labelled("rejected", "bold red", str(result)), highlight=False
            )
        return EXIT_REJECTED
    _print_plan(args, facts, pool, config, result)
    return 0


def _print_plan(
    args: argparse.Namespace,
    facts: ModelFacts,
    pool: NodePool,
    config: RuntimeConfig,
    plan: RunPlan,
) -> None:
    nodes = {n.node_id: n for n in pool.nodes}
    # each device's stages against what the planner holds them to
    memory, device_use, device_available = device_memory(facts, config.worker, nodes, plan)
    if args.json:
        stages = []
        for stage, use in zip(plan.stages, memory, strict=True):
            node = nodes[stage.node_id]
            stages.append(
                {
                    "stage_index": stage.stage_index,
                    "node_id": stage.node_id,
                    "device": node.device,
                    "layer_start": stage.layer_start,
                    "layer_end_exclusive": stage.layer_end_exclusive,
                    "weight_bytes": use.weight_bytes,
                    "kv_bytes": use.kv_bytes,
                    "ring_bytes": use.ring_bytes,
                    "total_bytes": use.total,
                    "device_bytes_used": device_use[node.device_key],
                    "device_bytes_available": device_available[node.device_key],
                }
            )
        print_json({"plan": json.loads(wire.dumps(plan)), "memory": stages})
        return
    title = (
        f"{plan.model.model_id}: {plan.stage_count} stages, run {plan.run_id!r}, "
        f"max_seq_len {plan.model.max_seq_len}"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("stage", "node", "layers", "weights", "KV cache", "ring", "total", "use"):
        table.add_column(col, justify="left" if col in ("node", "layers") else "right")
    for stage, use in zip(plan.stages, memory, strict=True):
        node = nodes[stage.node_id]
        share, available = device_use[node.device_key], device_available[node.device_key]
        pct = 100.0 * share / available if available else float("inf")
        where = stage.node_id + (f" @{node.device}" if node.device else "")
        table.add_row(
            str(stage.stage_index),
            where,
            f"{stage.layer_start}-{stage.layer_end_exclusive - 1}",
            human_bytes(use.weight_bytes),
            human_bytes(use.kv_bytes),
            human_bytes(use.ring_bytes),
            human_bytes(use.total),
            f"{pct:.1f}%",
        )
    plain_console().print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m runplan",
        description="Plan pipeline-parallel runs of a GGUF model (reading GGUF headers "
        "only), and check plans against the RunPlan contract.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "model",
            nargs="?",
            default=DEFAULT_MODEL,
            help=MODEL_HELP,
        )
        p.add_argument(
            "--max-seq-len",
            type=positive_int,
            default=None,
            help="positions each stage's KV cache holds (default: the model's context "
            "length; required for a file that states none, context_length 0)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object to stdout")

    facts = sub.add_parser("facts", help="what the GGUF header says about the model")
    model_args(facts)
    facts.set_defaults(func=_cmd_facts)

    plan = sub.add_parser(
        "plan",
        help="plan a run over a node pool",
        description="Plan a run: print each stage's node, layers and memory, or the "
        "rejection (exit status 2).",
    )
    model_args(plan)
    plan.add_argument(
        "--nodes",
        type=parse_nodes,
        required=True,
        help="the node pool: NODE=SIZE[@DEVICE],... e.g. gpu0=80GiB,gpu1=24GiB; nodes that "
        "name one device share its memory",
    )
    plan.add_argument(
        "--stages",
        type=positive_int,
        default=None,
        help="number of stages (default: one per node)",
    )
    plan.add_argument(
        "--placement",
        choices=("even", "memory"),
        default="even",
        help="split layers evenly, or in proportion to node memory (default: even)",
    )
    plan.add_argument(
        "--dtype",
        choices=sorted(k for k in DTYPES_BY_NAME if k != "u32"),
        default="f32",
        help="the activations' dtype (default: f32, as the CPU worker runs); the KV "
        "caches' too with --weights stored and no --kv-dtype",
    )
    plan.add_argument(
        "--weights",
        choices=("f32", "stored"),
        default="f32",
        help="how a worker holds weights and its KV cache: f32 (the NumPy reference worker, "
        "the default) or stored (kept quantized as in the file, KV in the activation dtype, "
        "as the CUDA worker does)",
    )
    plan.add_argument(
        "--kv-dtype",
        choices=("f32", "f16"),
        default=None,
        help="the KV caches' dtype, counted so and carried in the plan "
        "(model.kv_dtype_width_bytes) for the workers to hold them in (default: f32 with "
        "--weights f32, the activations' --dtype with --weights stored)",
    )
    plan.add_argument("--run-id", default="run-1", help="the run id (default: run-1)")
    plan.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    plan.add_argument(
        "--orchestrator",
        default="orchestrator",
        help="the orchestrator's node id (default: %(default)s)",
    )
    plan.set_defaults(func=_cmd_plan)
    add_check_parser(sub)
    add_split_parser(sub, model_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (GgufError, ModelNotFound, OutputFolderError) as exc:
        if getattr(args, "json", False):
            print_json(exception_json(exc))
        else:
            plain_console(stderr=True, soft_wrap=True).print(
                labelled("error", "bold red", str(exc)), highlight=False
            )
        return EXIT_INPUT
    return code
