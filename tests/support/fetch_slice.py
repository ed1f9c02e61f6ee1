"""One stage's slice fetched in a process of its own (for faults that need one: a
process killed halfway, a cache on a disk of its own)::

    python -m tests.support.fetch_slice --server HOST:PORT --source-key KEY \
        --stage-index I --node-id N --source PATH --parts START,END,EMBD,OUT --cache DIR

The stages' secret (hex) is read on standard input. Prints one JSON line: ``{"ok":
true, "path": ..., "last": ...}`` or ``{"ok": false, "error": ..., "last": ...}``, then what the
cache holds (``entries``) and what is left in its ``tmp/``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from runplan import GgufSource
from runplan.shards import SliceParts
from runtime_cupy.process.keys import parse_secret, slice_key
from runtime_cupy.slices.cache import SliceCache
from runtime_cupy.slices.fetch import SliceFetcher, SliceOrigin, SliceTransferFailed


def main() -> int:
    p = argparse.ArgumentParser()
    for flag in ("--server", "--source-key", "--node-id", "--source", "--parts", "--cache"):
        p.add_argument(flag, required=True)
    p.add_argument("--stage-index", type=int, required=True)
    args = p.parse_args()
    secret = parse_secret(sys.stdin.readline())
    start, end, embd, out = (int(x) for x in args.parts.split(","))
    parts = SliceParts(start, end, bool(embd), bool(out))
    cache = SliceCache(Path(args.cache), limit=None)
    fetcher = SliceFetcher(
        SliceOrigin(args.server, args.source_key),
        args.stage_index,
        slice_key(secret, args.node_id),
        cache,
    )
    doc: dict[str, object]
    try:
        source = fetcher.resolve(GgufSource((args.source,)), parts)
        doc = {"ok": True, "path": source.paths[0], "last": fetcher.last}
    except SliceTransferFailed as exc:
        doc = {"ok": False, "error": str(exc), "last": fetcher.last}
    doc["entries"] = [str(e.path) for e in cache.entries()]
    doc["tmp"] = sorted(os.listdir(cache.tmp)) if cache.tmp.exists() else []
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
