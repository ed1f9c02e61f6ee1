"""The slice cache where users expect it (``$GGUF_PIPELINE_CACHE``, else
``$XDG_CACHE_HOME/gguf-pipeline``, else ``~/.cache/gguf-pipeline``), its size limit with
least-recently-used eviction, and ``python -m runtime_cupy cache list|clear``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from runplan.shards import SliceParts
from runtime_cupy.cli.main import main
from runtime_cupy.slices.cache import CacheError, SliceCache, default_limit, default_root
from tests.runtime_cupy.test_slices import UNTIED, Source

PARTS = [
    SliceParts(0, 2, True, False),
    SliceParts(2, 4, False, False),
    SliceParts(4, 6, False, True),
]


@pytest.fixture
def source(tmp_path: Path) -> Iterator[Source]:
    (tmp_path / "src").mkdir()
    s = Source(tmp_path / "src", UNTIED)
    yield s
    s.server.close()


def test_the_cache_is_where_users_expect_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GGUF_PIPELINE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home" / ".cache" / "gguf-pipeline"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "gguf-pipeline"
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(tmp_path / "moved"))
    assert default_root() == tmp_path / "moved"
    monkeypatch.setenv("GGUF_PIPELINE_CACHE_LIMIT", "1.5GiB")
    assert default_limit() == 3 * 2**29
    monkeypatch.setenv("GGUF_PIPELINE_CACHE_LIMIT", "lots")
    with pytest.raises(CacheError, match="GGUF_PIPELINE_CACHE_LIMIT='lots' is not a size"):
        default_limit()


def test_least_recently_used_entries_go_first_past_the_limit(
    source: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    for parts in PARTS[:2]:
        source.resolve(source.fetcher(cache), parts)
    entries = SliceCache(cache, limit=None).entries()
    assert [e.parts for e in entries] == PARTS[:2]  # least recently used first
    # The first is used again: the second is now the least recently used.
    os.utime(entries[1].manifest, (entries[0].last_used - 10,) * 2)
    source.resolve(source.fetcher(cache), PARTS[0])
    limit = sum(e.bytes for e in entries) + 1024  # room for two entries of this size, not 3
    fetcher = source.fetcher(cache)
    fetcher.cache = SliceCache(cache, limit=limit)
    source.resolve(fetcher, PARTS[2])
    kept = [e.parts for e in SliceCache(cache, limit=None).entries()]
    assert sorted(kept, key=lambda p: p.layer_start) == [PARTS[0], PARTS[2]]
    with pytest.raises(CacheError, match="does not fit the cache's limit"):
        SliceCache(cache, limit=10).make_room(11)


def test_cache_list_and_clear(
    source: Source,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "host"
    source.resolve(source.fetcher(cache), PARTS[1])
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(cache))
    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root"] == str(cache) and doc["limit_bytes"] is None
    (entry,) = doc["entries"]
    assert (entry["layer_start"], entry["layer_end_exclusive"]) == (2, 4)
    assert entry["source"] == source.key and entry["model_id"] == "model"
    assert doc["total_bytes"] == entry["bytes"] > source.slice_bytes(PARTS[1])
    assert main(["cache", "list"]) == 0
    assert "blocks 2-3" in capsys.readouterr().out
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 1
    assert SliceCache(cache, limit=None).entries() == []
