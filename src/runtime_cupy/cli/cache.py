"""``python -m runtime_cupy cache list|clear [--json]``: this host's slice cache
(``slices.cache``): where it is, its limit, and each entry (the model, what the slice
holds, its size, when it was last used), each damaged one (a manifest that does not
read or does not match its folder: never used) and the bytes of fetches not finished;
``clear`` removes every entry. A cache not made yet is listed empty, and not made."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from rich import box
from rich.table import Table

from runplan.arguments import OneLineParser, human_bytes
from runplan.json_errors import exception_json, print_json
from runplan.terminal import plain_console
from runtime_cupy.slices.cache import LIMIT_VARIABLE, CacheError, SliceCache


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime_cupy cache",
        description="This host's cache of model slices ($GGUF_PIPELINE_CACHE, else "
        "$XDG_CACHE_HOME/gguf-pipeline, else ~/.cache/gguf-pipeline; size limit: "
        f"${LIMIT_VARIABLE}).",
    )
    p.add_argument("action", choices=("list", "clear"), help="show the entries, or remove them")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cache = SliceCache()
        there = os.path.lexists(cache.root)  # none yet: nothing is made to say so
        if there:
            cache.private_root()
    except CacheError as exc:
        print(f"python -m runtime_cupy cache: error: {exc}", file=sys.stderr)
        if args.json:
            print_json(exception_json(exc))
        return 2
    if args.action == "clear":
        count, size = cache.clear() if there else (0, 0)
        if args.json:
            doc = {"root": str(cache.root), "removed": count, "removed_bytes": size}
            print_json(doc)
        else:
            print(f"removed {count} entries ({human_bytes(size)}) from {cache.root}")
        return 0
    entries = cache.entries() if there else []
    damaged = cache.damaged() if there else []
    partial = cache.partial_bytes() if there else 0
    total = sum(e.bytes for e in entries) + sum(n for _, n in damaged) + partial
    if args.json:
        doc = {
            "root": str(cache.root),
            "limit_bytes": cache.limit,
            "total_bytes": total,
            "partial_bytes": partial,
            "damaged": [{"path": str(path), "bytes": n} for path, n in damaged],
            "entries": [
                {
                    "path": str(e.path),
                    "source": e.source,
                    "model_id": e.model_id,
                    "layer_start": e.parts.layer_start,
                    "layer_end_exclusive": e.parts.layer_end_exclusive,
                    "embedding": e.parts.embedding,
                    "output": e.parts.output,
                    "bytes": e.bytes,
                    "last_used": e.last_used,
                }
                for e in entries
            ],
        }
        print_json(doc)
        return 0
    limit = human_bytes(cache.limit) if cache.limit is not None else f"none (${LIMIT_VARIABLE})"
    broken = f" and {len(damaged)} damaged (never used; clear removes them)" if damaged else ""
    if partial:
        broken += f", {human_bytes(partial)} of fetches not finished"
    title = f"{cache.root}: {len(entries)} entries{broken}, {human_bytes(total)}; limit {limit}"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("model", "holds", "size", "last used", "source"):
        table.add_column(col)
    for e in reversed(entries):  # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        table.add_row(e.model_id, e.parts.describe(), human_bytes(e.bytes), used, e.source[:19])
    for path, n in damaged:
        table.add_row("(damaged)", str(path.relative_to(cache.root)), human_bytes(n), "", "")
    plain_console(soft_wrap=True).print(table)
    return 0
