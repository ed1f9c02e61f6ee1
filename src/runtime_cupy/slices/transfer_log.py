"""``<cache>/transfers.jsonl``: one JSON line for each slice a stage of this host
resolved (received, found in the cache, or the host's own file; ``fetch.SliceFetcher``),
newest last. The log is kept small: past ``LOG_BYTES`` it is written again with its
newest lines that fit half of that (a new file renamed into place), so it never holds
more than ``LOG_BYTES`` and a line more, and ``cache clear`` removes it.

Stages of one host append at once, each line in one write; a line appended while the
log is trimmed may be lost with the older ones.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from runplan.whole_file import whole_file

TRANSFER_LOG = "transfers.jsonl"
#: The most bytes the log holds before it is trimmed to its newest half.
LOG_BYTES = 2**20


def append(folder: Path, line: dict[str, Any], limit: int = LOG_BYTES) -> None:
    """Append ``line`` to the log in ``folder`` and trim it past ``limit`` bytes; a log
    that cannot be written costs nothing else."""
    path = folder / TRANSFER_LOG
    with contextlib.suppress(OSError):
        with open(path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
        if path.stat().st_size > limit:
            _trim(path, limit // 2)


def _trim(path: Path, keep: int) -> None:
    """Write the log again with its newest whole lines that fit ``keep`` bytes."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - keep))
        tail = f.read()
    start = tail.find(b"\n") + 1 if len(tail) >= keep else 0  # a line cut short goes
    with whole_file(path) as out:
        out.write(tail[start:])
