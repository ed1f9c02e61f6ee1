"""The slice cache where users expect it (``$GGUF_PIPELINE_CACHE``, else
``$XDG_CACHE_HOME/gguf-pipeline``, else ``~/.cache/gguf-pipeline``), its size limit with
least-recently-used eviction, ``python -m runtime_cupy cache list|clear``, and a cache
folder that is not this user's alone refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from runplan.gguf_header import GgufHeader
from runplan.shards import ShardKeys, SliceParts
from runtime_cupy.cli.main import main
from runtime_cupy.slices.cache import (
    CacheError,
    SliceCache,
    default_limit,
    default_root,
    key_folder,
)
from runtime_cupy.slices.fetch import SliceTransferFailed
from runtime_cupy.slices.transfer_log import TRANSFER_LOG, append
from tests.runtime_cupy.test_slices import TIED, UNTIED, Source

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
    # room for two entries of about this size (the last holds the head), not 3
    limit = 2 * max(e.bytes for e in entries) + 2**16
    fetcher = source.fetcher(cache)
    fetcher.cache = SliceCache(cache, limit=limit)
    source.resolve(fetcher, PARTS[2])
    kept = [e.parts for e in SliceCache(cache, limit=None).entries()]
    assert sorted(kept, key=lambda p: p.layer_start) == [PARTS[0], PARTS[2]]
    assert SliceCache(cache, limit=None).total_bytes() <= limit
    with pytest.raises(CacheError, match="does not fit the cache's limit"):
        SliceCache(cache, limit=10).make_room(11)


def test_a_slice_that_copies_from_an_entry_leaves_the_cache_within_its_limit(
    tmp_path: Path,
) -> None:
    """The last stage's slice of a tied model copies the embedding from the first
    stage's entry, which is kept while the slice is received; once the slice is in, the
    entry it copied from goes (least recently used) where both do not fit the limit. The
    cache once ended over its limit, by the entry kept."""
    (tmp_path / "src").mkdir()
    tied = Source(tmp_path / "src", TIED)
    first, last = SliceParts(0, 2, True, False), SliceParts(2, 4, False, True)
    try:
        sizes = tmp_path / "sizes"  # the two entries' sizes, with no limit
        for stage, parts in enumerate((first, last)):
            tied.resolve(tied.fetcher(sizes, stage=stage), parts)
        size = {e.parts: e.bytes for e in SliceCache(sizes, limit=None).entries()}
        limit = size[last] + size[first] // 2  # the last slice fits, not both
        cache = tmp_path / "host"
        tied.resolve(tied.fetcher(cache, stage=0), first)
        fetcher = tied.fetcher(cache, stage=1)
        fetcher.cache = SliceCache(cache, limit=limit)
        tied.resolve(fetcher, last)
        assert fetcher.last["tensor_bytes_copied"] > 0, "the embedding was copied"
    finally:
        tied.server.close()
    left = SliceCache(cache, limit=None)
    assert [e.parts for e in left.entries()] == [last]
    assert left.total_bytes() <= limit


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
    assert (cache / TRANSFER_LOG).exists()
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 1
    assert SliceCache(cache, limit=None).entries() == []
    assert not (cache / TRANSFER_LOG).exists(), "clear removes the transfer log"


def test_the_transfer_log_keeps_its_newest_lines(tmp_path: Path) -> None:
    """Past its bound the log is written again with its newest whole lines in half of
    it: a line on every resolve (cache hits too) once grew it without end."""
    lines = [{"n": n, "pad": "x" * 50} for n in range(200)]
    for line in lines:
        append(tmp_path, line, limit=4000)
        assert (tmp_path / TRANSFER_LOG).stat().st_size <= 4000 + 100
    kept = [json.loads(x) for x in (tmp_path / TRANSFER_LOG).read_text().splitlines()]
    assert 20 < len(kept) < 70 and kept == lines[-len(kept) :]
    assert list(tmp_path.iterdir()) == [tmp_path / TRANSFER_LOG], "no file left beside it"


def test_a_damaged_entry_is_listed_never_used_and_cleared(
    source: Source,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An entry whose manifest does not read (a crash, an edit) holds its bytes: ``cache
    list`` shows it, ``clear`` removes it (it once left it, unseen), and so does making
    room under the limit."""
    cache = tmp_path / "host"
    source.resolve(source.fetcher(cache), PARTS[1])
    entry = SliceCache(cache, limit=None).entry(source.key, PARTS[1])
    assert entry is not None
    entry.manifest.write_text('{"trunc')
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(cache))
    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["entries"] == []
    (damaged,) = doc["damaged"]
    assert damaged["path"] == str(entry.path) and damaged["bytes"] > source.slice_bytes(PARTS[1])
    assert doc["total_bytes"] == damaged["bytes"]
    assert main(["cache", "list"]) == 0
    assert "(damaged)" in capsys.readouterr().out
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 1
    assert not entry.path.exists()
    source.resolve(source.fetcher(cache), PARTS[1])  # damaged again, then room is made
    entry.manifest.write_text("{}")
    SliceCache(cache, limit=10**9).make_room(1)
    assert not entry.path.exists()
    entry.path.write_bytes(b"a stray file where an entry goes")
    assert SliceCache(cache, limit=None).clear() == (1, 32)
    assert not entry.path.exists()


def test_a_cache_not_made_yet_is_listed_empty_and_not_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "none" / "yet"
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(root))
    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["entries"], doc["damaged"], doc["total_bytes"]) == ([], [], 0)
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 0
    assert not (tmp_path / "none").exists()  # `cache list` once made the folders


def test_what_unfinished_fetches_hold_is_listed(
    source: Source,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "host"
    source.resolve(source.fetcher(cache), PARTS[1])
    partial = SliceCache(cache, limit=None).new_partial(source.key, PARTS[2])
    (partial / "shard.gguf").write_bytes(bytes(3000))  # a fetch killed part-way
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(cache))
    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["partial_bytes"] == 3000
    assert doc["total_bytes"] == doc["entries"][0]["bytes"] + 3000
    assert main(["cache", "list"]) == 0
    assert "of fetches not finished" in capsys.readouterr().out


def test_what_a_removal_killed_part_way_left_goes_at_the_next_fetch(
    source: Source, tmp_path: Path
) -> None:
    """An entry removed (replaced, evicted, cleared) is renamed to ``tmp/gone-*`` first,
    then removed: one killed part-way stayed there for good, counted as a fetch's
    partial bytes, since a fetch removed only its own source's leftovers."""
    cache = tmp_path / "host"
    store = SliceCache(cache, limit=None)
    gone = store.folder(store.tmp) / "gone-0123456789ab"
    gone.mkdir()
    (gone / "shard.gguf").write_bytes(bytes(3000))
    other = store.new_partial("sha256:" + "f" * 64, PARTS[2])  # another source's fetch
    source.resolve(source.fetcher(cache), PARTS[1])
    assert sorted(os.listdir(store.tmp)) == [other.name]
    assert store.partial_bytes() == 0


def test_an_entry_holding_other_parts_than_its_name_is_not_used(
    source: Source, tmp_path: Path
) -> None:
    """An entry moved under another slice's name (by hand, a bad copy) said it held
    those parts and was served on every run; the stage then failed to bind it. It is no
    entry of those parts: the slice is received again, and the entry replaced."""
    cache = tmp_path / "host"
    source.resolve(source.fetcher(cache), PARTS[0])
    store = SliceCache(cache, limit=None)
    moved = store.entry_path(source.key, PARTS[1])
    os.rename(store.entry_path(source.key, PARTS[0]), moved)
    assert store.entry(source.key, PARTS[1]) is None
    assert [path for path, _ in store.damaged()] == [moved]
    source.resolve(source.fetcher(cache), PARTS[1])
    entry = store.entry(source.key, PARTS[1])
    assert entry is not None and entry.parts == PARTS[1]
    assert store.damaged() == []


def _planted_entry(source: Source, folder: Path) -> Path:
    """An entry of another user's making in ``folder``: the slice under the source's
    key, one tensor of other weights and its SHA-256 in the header to match."""
    made = folder.parent / "made"
    source.resolve(source.fetcher(made), PARTS[1])
    entry = SliceCache(made, limit=None).entry(source.key, PARTS[1])
    assert entry is not None
    header = GgufHeader.read(entry.shard)
    name = "blk.2.attn_q.weight"
    old = dict(zip(header.tensors, header.strings(ShardKeys.TENSOR_SHA256), strict=True))[name]
    info = header.tensors[name]
    other = bytes(info.n_bytes)
    data = bytearray(entry.shard.read_bytes())
    data[info.offset : info.offset + info.n_bytes] = other
    data = data.replace(old.encode(), hashlib.sha256(other).hexdigest().encode(), 1)
    entry.shard.write_bytes(bytes(data))
    target = folder / entry.path.relative_to(made)
    shutil.copytree(entry.path, target)
    return target


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files of another user")
def test_a_cache_folder_another_user_can_write_in_is_refused(
    source: Source, tmp_path: Path
) -> None:
    stranger = 4242
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # past the umask
    planted = _planted_entry(source, shared)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, shared / "transfers.jsonl")
    for path in [shared, *shared.rglob("*")]:
        os.lchown(path, stranger, stranger)
    with pytest.raises(SliceTransferFailed) as refused:
        source.resolve(source.fetcher(shared), PARTS[1])
    text = str(refused.value)
    assert f"the cache folder {shared} is a folder of uid {stranger}, mode 0777" in text, text
    assert "not this user's alone" in text, text
    assert victim.read_text() == "mine\n"  # nothing written through the stranger's link
    assert planted.is_dir()  # neither used nor touched
    # A link of another user on the way to the cache (in a folder open to all, sticky).
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    (tmp_path / "mine").mkdir(mode=0o700)
    os.symlink(tmp_path / "mine", sticky / "cache")
    os.lchown(sticky / "cache", stranger, stranger)
    with pytest.raises(SliceTransferFailed, match=f"{sticky / 'cache'} is a symbolic link of uid"):
        source.resolve(source.fetcher(sticky / "cache"), PARTS[1])
    assert list((tmp_path / "mine").iterdir()) == []


def test_the_cache_folder_is_made_private_and_one_open_to_others_is_refused(
    source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "made" / "here"
    source.resolve(source.fetcher(cache), PARTS[1])
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    os.chmod(cache, 0o755)  # a cache an older version made: others cannot write in it
    source.resolve(source.fetcher(cache), PARTS[1])
    os.chmod(cache, 0o775)
    with pytest.raises(SliceTransferFailed, match=r"mode 0775, not this user's alone"):
        source.resolve(source.fetcher(cache), PARTS[1])
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(cache))
    assert main(["cache", "list"]) == 2  # one line naming it, no traceback
    # Made under a umask that opens what it makes to all: private all the same.
    deeper = tmp_path / "open" / "umask" / "cache"
    before = os.umask(0)
    try:
        source.resolve(source.fetcher(deeper), PARTS[1])
    finally:
        os.umask(before)
    for folder in (deeper, deeper.parent, deeper.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_lock_file_that_cannot_be_made_is_a_transfer_failure_naming_it(
    source: Source, tmp_path: Path
) -> None:
    """The lock file's open failing (a file system out of inodes: ENOSPC; here a folder
    at its name: EISDIR) is the cache's error, as a folder that cannot be made is: the
    usual ``SliceTransferFailed``, not a raw ``OSError`` out of ``resolve``."""
    cache = tmp_path / "cache"
    fetcher = source.fetcher(cache)
    lock = cache / "locks" / f"{key_folder(fetcher.origin.source_key)}.lock"
    lock.mkdir(parents=True)
    with pytest.raises(SliceTransferFailed) as failed:
        source.resolve(fetcher, PARTS[1])
    text = str(failed.value)
    assert f"the cache: cannot make the lock file {lock}: Is a directory" in text, text
    assert text.endswith("no cache entry was made"), text
    assert isinstance(failed.value.__cause__, CacheError)
