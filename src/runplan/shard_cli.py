"""The command lines of shards: ``python -m runplan split MODEL --stages N [--nodes ...]
[--placement ...] --out DIR`` (``runplan.split``), and what ``python -m runplan facts``
says of a shard file (what it holds, and the manifest that names it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from runplan.arguments import human_bytes, parse_nodes, positive_int
from runplan.gguf_facts import model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runplan.json_errors import (
    USAGE_ERROR,
    error_json,
    print_json,
    rejection_fields,
    rejection_json,
)
from runplan.models import resolve_model
from runplan.rejections import PlanRejection
from runplan.shards import (
    MANIFEST_NAME,
    ManifestError,
    ShardKeys,
    SliceParts,
    model_id_problem,
    read_manifest,
)
from runplan.split import _Bars, missing_folders, removed_if_empty, split_model, split_plan
from runplan.tensor_names import block_index
from runplan.terminal import labelled, plain_console

EXIT_REJECTED = 2


def add_split_parser(sub: Any, model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """``split`` on ``python -m runplan``'s parser."""
    p = sub.add_parser(
        "split",
        help="cut a model into one GGUF file per stage of a plan, and a manifest",
        description="Write one GGUF file per stage of the plan (each holding what that "
        "stage loads) and DIR/manifest.json naming them; then run with --model DIR.",
    )
    model_args(p)
    p.add_argument(
        "--stages", type=positive_int, default=None, help="stages (default: one per node)"
    )
    p.add_argument(
        "--nodes",
        type=parse_nodes,
        default=None,
        help="plan against this pool, NODE=SIZE[@DEVICE],... as 'plan' takes it (default: "
        "--stages nodes of unbounded memory)",
    )
    p.add_argument(
        "--placement",
        choices=("even", "memory"),
        default="even",
        help="split layers evenly (default), or in proportion to node memory (with --nodes)",
    )
    p.add_argument("--out", type=_out_folder, required=True, help="the folder to write into")
    p.set_defaults(func=cmd_split)


def _out_folder(text: str) -> Path:
    """``--out``: a folder. An empty one (an unset variable) is refused: ``Path("")`` is
    the current folder, which split then wrote into."""
    if not text:
        raise argparse.ArgumentTypeError("'' names no folder (give '.' for this one)")
    return Path(text)


def _usage_error(args: argparse.Namespace, message: str) -> int:
    """A command line ``split`` cannot run: one line on standard error (and, with
    ``--json``, the error object of type ``UsageError``), exit status 2."""
    line = f"python -m runplan split: error: {message}"
    sys.stderr.write(line + "\n")
    if args.json:
        print_json(error_json(USAGE_ERROR, line))
    return EXIT_REJECTED


class OutputFolderError(OSError):
    """``--out`` names no folder that can be made or written (one line, exit status 1,
    as a file that cannot be read)."""


def _writable(out: Path) -> None:
    """Make the ``--out`` folder, before any work, or say why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = "is a file, not a folder" if out.exists() else f"cannot be made: {exc}"
        raise OutputFolderError(f"--out {str(out)!r} {what}") from None


def cmd_split(args: argparse.Namespace) -> int:
    if args.stages is None and args.nodes is None:
        return _usage_error(args, "give --stages or --nodes")
    path = resolve_model(args.model)
    facts = model_facts_from_gguf(path, max_seq_len=args.max_seq_len)
    problem = model_id_problem(facts.model_id)
    if problem is not None:  # the shards are named after it
        return _usage_error(args, f"model id {facts.model_id!r} cannot name the shards: {problem}")
    stages = args.stages if args.stages is not None else len(args.nodes)
    plan = split_plan(facts, stages, args.nodes, args.placement)
    err = plain_console(stderr=True, soft_wrap=True)
    if isinstance(plan, PlanRejection):
        if args.json:
            print_json(rejection_json(plan) | {"rejection": rejection_fields(plan)})
        else:
            err.print(labelled("rejected", "bold red", str(plan)), highlight=False)
        return EXIT_REJECTED
    # after the plan: a refused split makes no folder; cancelled or failed before a shard
    # is written (from the moment the folders are made): no empty folder left of it
    with removed_if_empty(missing_folders(args.out)):
        _writable(args.out)
        bars = _Bars(err)
        with bars.progress:
            try:
                result = split_model(path, plan, args.out, placement=args.placement, progress=bars)
            except OSError as exc:  # the source's read or a shard's write: names it
                raise OutputFolderError(
                    f"cannot split into --out {str(args.out)!r}: {exc}"
                ) from None
    manifest = result.manifest
    if args.json:
        doc = {
            "manifest": result.manifest_path,
            "source": manifest.source,
            "model_id": manifest.model_id,
            "shards": [
                {
                    "stage_index": i,
                    "node_id": manifest.nodes[i] if i < len(manifest.nodes) else None,
                    "file": str(Path(args.out) / e.file),
                    "layer_start": e.parts.layer_start,
                    "layer_end_exclusive": e.parts.layer_end_exclusive,
                    "embedding": e.parts.embedding,
                    "output": e.parts.output,
                    "tensor_bytes": e.tensor_bytes,
                    "file_bytes": size,
                }
                for i, (e, size) in enumerate(zip(manifest.shards, result.file_bytes, strict=True))
            ],
        }
        sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
        return 0
    table = Table(title=f"{manifest.model_id}: {len(manifest.shards)} shards", box=box.SIMPLE_HEAD)
    for col in ("stage", "node", "holds", "tensors", "file size", "file"):
        table.add_column(col)
    for i, (e, size) in enumerate(zip(manifest.shards, result.file_bytes, strict=True)):
        table.add_row(
            str(i),
            manifest.nodes[i] if i < len(manifest.nodes) else "-",
            e.parts.describe(),
            human_bytes(e.tensor_bytes),
            human_bytes(size),
            e.file,
        )
    console = plain_console(soft_wrap=True)
    console.print(table)
    console.print(f"manifest: {result.manifest_path} (source {manifest.source})", highlight=False)
    return 0


# -- facts of a shard ----------------------------------------------------------------------


def shard_facts(path: str) -> dict[str, Any] | None:
    """What the shard file at ``path`` holds, or ``None`` if it is not a shard (a plain
    model file, a manifest, a folder). ``GgufError`` for a file that cannot be read."""
    if os.path.isdir(path) or path.endswith(".json"):
        return None
    header = GgufHeader.read(path)
    if not header.has(ShardKeys.LAYER_START):
        return None
    arch = header.string("general.architecture")
    blocks = sorted({b for b in (block_index(n) for n in header.tensors) if b is not None})
    doc: dict[str, Any] = {
        "file": os.path.abspath(path),
        "model_id": header.string(ShardKeys.MODEL_ID, ""),
        "source": header.string(ShardKeys.SOURCE, ""),
        "architecture": arch,
        "block_count": header.integer(f"{arch}.block_count"),
        "layer_start": header.integer(ShardKeys.LAYER_START),
        "layer_end_exclusive": header.integer(ShardKeys.LAYER_END),
        "blocks_held": blocks,
        "embedding": header.boolean(ShardKeys.EMBEDDING, False),
        "output": header.boolean(ShardKeys.OUTPUT, False),
        "tensors": len(header.tensors),
        "tensor_bytes": sum(i.n_bytes for i in header.tensors.values()),
        "manifest": None,
        "stage_index": None,
        "stage_count": None,
    }
    manifest_file = os.path.join(os.path.dirname(doc["file"]), MANIFEST_NAME)
    if os.path.isfile(manifest_file):
        try:
            manifest = read_manifest(manifest_file)
        except ManifestError:
            return doc
        parts = SliceParts(
            doc["layer_start"], doc["layer_end_exclusive"], doc["embedding"], doc["output"]
        )
        for index, entry in enumerate(manifest.shards):
            # the manifest names this shard: its name, and its keys (a file of another
            # model's, or another stage's, at that name is not the shard it names)
            named = entry.file == os.path.basename(path)
            if named and entry.parts == parts and manifest.source == doc["source"]:
                doc["manifest"] = manifest_file
                doc["stage_index"] = index
                doc["stage_count"] = len(manifest.shards)
    return doc


def print_shard_facts(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"shard": doc}, sort_keys=True) + "\n")
        return
    table = Table(title=os.path.basename(doc["file"]), show_header=False, box=box.SIMPLE)
    table.add_column("fact")
    table.add_column("value", overflow="fold")
    first, last = doc["layer_start"], doc["layer_end_exclusive"] - 1
    parts = [f"blocks {first}-{last} of the model's {doc['block_count']}"]
    if doc["embedding"]:
        parts.append("the token embedding")
    if doc["output"]:
        parts.append("the output norm and head")
    where = "no manifest beside it names it"
    if doc["manifest"] is not None:
        where = f"{doc['manifest']} (stage {doc['stage_index']} of {doc['stage_count']})"
    rows = [
        ("a shard of", f"{doc['model_id']} ({doc['architecture']})"),
        ("source", doc["source"]),
        ("holds", ", ".join(parts) + ", and the tensors every stage needs"),
        ("tensors", f"{doc['tensors']} ({human_bytes(doc['tensor_bytes'])})"),
        ("manifest", where),
        ("the whole model", "python -m runplan facts <the manifest's folder>"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    plain_console(soft_wrap=True).print(table)
