"""What hashing a GGUF source on this host found, kept so that it is hashed once: its
content key and tensors' SHA-256 (``runplan.content``), and which slices of which
source its tensors were found to be.

A record holds the identity of the source's files as they are on disk (path, device,
inode, size, modification and change times: ``kept_weights.FileIdentity``), so a file
replaced, touched or written in place is hashed again. Records live in the slice
cache's ``digests/`` (``cache.SliceCache``), one small JSON file per set of paths,
written whole (``runplan.whole_file``: a partial file renamed into place, one a killed
writer left removed by the next write of that record): the record of files since changed is
replaced by that of the files as they are, so the folder holds one record per source
path hashed here, not one per version of it; and each record written removes those of
paths that no longer exist (or of another version of this format), so files deleted or
moved leave no records behind.

- The orchestrator's host keys the source it serves (``content``): every tensor hashed,
  on the first run only.
- A stage's host that has a file at the plan's path checks it against the slice the
  plan's source would send (``matches``): the metadata as stored and the slice's
  tensors' hashes; it hashes only that slice's tensors, and remembers the verdict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from runplan.content import SourceContent, content_key, tensor_sha256
from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runplan.shard_file import recorded_problem
from runplan.whole_file import whole_file
from runtime_core.workers.kept_weights import FileIdentity

_VERSION = 2  # 2: records named by their paths; identities hold ctime
log = logging.getLogger("runtime_cupy.slices")


def identity_of(header: GgufHeader) -> list[dict[str, Any]]:
    """The identity of every file the header was read from (and of its manifest)."""
    paths = dict.fromkeys([*header.source_paths, *header.paths])
    out = []
    for path in paths:
        ident = FileIdentity.of(path)
        out.append(attrs.asdict(ident) if ident is not None else {"path": path})
    return out


class DigestStore:
    """The records in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, identity: list[dict[str, Any]]) -> Path:
        text = json.dumps([ident["path"] for ident in identity])
        return self.folder / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"

    def _load(self, identity: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            doc = json.loads(self._path(identity).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict) or doc.get("version") != _VERSION:
            return {}
        if doc.get("identity") != identity:
            return {}
        return doc

    def _save(self, identity: list[dict[str, Any]], doc: dict[str, Any]) -> None:
        """Write a record whole; a cache that cannot be written only costs hashing again."""
        doc = {**doc, "version": _VERSION, "identity": identity}
        path = self._path(identity)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with whole_file(path) as out:
                out.write(json.dumps(doc, sort_keys=True).encode("utf-8"))
        except OSError:
            return
        self._forget_gone(keep=path)

    def _forget_gone(self, keep: Path) -> None:
        """Remove the records of files that are no longer there, and records this
        version cannot read (another version's, or not a record); what cannot be opened
        or removed stays."""
        for record in self.folder.glob("*.json"):
            if record == keep:
                continue
            try:
                text = record.read_bytes()
            except OSError:
                continue
            try:
                doc = json.loads(text)
                stale = not isinstance(doc, dict) or doc.get("version") != _VERSION
                if not stale:
                    paths = [ident["path"] for ident in doc["identity"]]
                    stale = not all(os.path.exists(p) for p in paths)
            except (ValueError, KeyError, TypeError):
                stale = True
            if stale:
                with contextlib.suppress(OSError):
                    record.unlink()

    def content(self, header: GgufHeader) -> SourceContent:
        """The source's content key and every tensor's hash (hashed now if the record
        of these files lacks them); ``GgufError`` for the shards of a manifest that no
        longer hold what they record (``shard_file.recorded_problem``), which would
        otherwise be served under a key of their own."""
        identity = identity_of(header)
        doc = self._load(identity)
        hashes = doc.get("tensor_sha256") or {}
        key = doc.get("content_key")
        if isinstance(key, str) and isinstance(hashes, dict) and set(hashes) == set(header.tensors):
            content = SourceContent(key, dict(hashes))
        else:
            size = sum(t.n_bytes for t in header.tensors.values())
            log.info(
                "hashing every tensor of %s once (%.2f GiB)", header.source_paths[0], size / 2**30
            )
            hashes = tensor_sha256(header)
            content = SourceContent(content_key(header, hashes), hashes)
            self._save(identity, {**doc, "content_key": content.key, "tensor_sha256": hashes})
        problem = recorded_problem(header, content)
        if problem is not None:
            raise GgufError(header.source_paths[0], problem)
        return content

    def tensor_hashes(self, header: GgufHeader, names: Iterable[str]) -> dict[str, str]:
        """The hashes of ``names`` (those the record lacks hashed now)."""
        identity = identity_of(header)
        doc = self._load(identity)
        known: dict[str, str] = dict(doc.get("tensor_sha256") or {})
        wanted = list(names)
        missing = [n for n in wanted if n not in known]
        if missing:
            known.update(tensor_sha256(header, missing))
            self._save(identity, {**doc, "tensor_sha256": known})
        return {n: known[n] for n in wanted}

    def verified(self, header: GgufHeader, mark: str) -> bool:
        """Whether these files were found to hold what ``mark`` names (a source key and
        the parts of a slice)."""
        return mark in (self._load(identity_of(header)).get("verified") or [])

    def mark_verified(self, header: GgufHeader, mark: str) -> None:
        identity = identity_of(header)
        doc = self._load(identity)
        marks = list(doc.get("verified") or [])
        if mark not in marks:
            self._save(identity, {**doc, "verified": [*marks, mark]})


def hashes_match(local: Mapping[str, str], sent: Mapping[str, str]) -> str | None:
    """``None`` when the hashes agree; else the first tensor that differs."""
    for name in sent:
        if local.get(name) != sent[name]:
            return name
    return None
