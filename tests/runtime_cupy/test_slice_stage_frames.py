"""The frames a stage sends the slice server, as the server reads them: a frame that
is not what it should be is refused naming its field (the transfer failed with the bare
text of a ``KeyError``, ``'source'``, or a ``TypeError``, ``'int' object is not
iterable``, before)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from runplan import GgufSource
from runplan.shards import SliceParts
from runtime_cupy.process.keys import new_secret, slice_key
from runtime_cupy.slices.digests import DigestStore
from runtime_cupy.slices.protocol import TransferError, open_as_stage
from runtime_cupy.slices.server import SliceServer
from runtime_cupy.slices.stage_frames import BadFrame, SliceRequest, done_bytes, wanted_tensors
from tests.fixtures.gguf_models import ModelShape, write_model

PARTS = SliceParts(1, 3, False, False)
GOOD = SliceRequest(("/models/m.gguf",), "sha256:" + "0" * 64, PARTS)


def _with(**fields: Any) -> dict[str, Any]:
    return {**GOOD.frame(), **fields}


def _parts(**fields: Any) -> dict[str, Any]:
    return {**GOOD.frame()["parts"], **fields}


def test_a_request_reads_back_as_the_stage_wrote_it() -> None:
    assert SliceRequest.read(GOOD.frame()) == GOOD


@pytest.mark.parametrize(
    ("frame", "named"),
    [
        ({}, "has no 'source', 'source_key', 'parts'"),
        ({"source": ["/m.gguf"], "parts": _parts()}, "has no 'source_key'"),
        (_with(extra=1), "has 'extra', no field it may have"),
        (_with(source=5), "'source' is 5, not a list of paths"),
        (_with(source=["/m.gguf", 7]), "'source' is \\['/m.gguf', 7\\], not a list of paths"),
        (_with(source_key=1), "'source_key' is 1, not a string"),
        (_with(parts=[]), "'parts' is \\[\\], not an object"),
        (_with(parts={"layer_start": 1}), "'parts' has no 'layer_end_exclusive', 'embedding'"),
        (_with(parts=_parts(x=1)), "'parts' has 'x', no field it may have"),
        (_with(parts=_parts(layer_start="a")), "'parts.layer_start' is 'a', not int"),
        (_with(parts=_parts(layer_end_exclusive=True)), "'parts.layer_end_exclusive' is True"),
        (_with(parts=_parts(output=1)), "'parts.output' is 1, not bool"),
    ],
)
def test_a_request_that_is_not_one_is_refused_naming_its_field(
    frame: dict[str, Any], named: str
) -> None:
    with pytest.raises(BadFrame, match=named):
        SliceRequest.read(frame)


def test_a_want_and_a_done_name_what_is_wrong() -> None:
    assert wanted_tensors({"tensors": ["a", "b"]}) == {"a", "b"}
    assert wanted_tensors({"error": "gave up"}) is None
    for bad in (5, [["a"]], "ab"):
        with pytest.raises(BadFrame, match=r"'tensors' is .*, not a list of tensor names"):
            wanted_tensors({"tensors": bad})
    assert done_bytes({"ok": True, "bytes": 12}) == 12
    assert done_bytes({"ok": False, "error": "no room"}) is None
    for frame in ({"ok": True}, {"ok": True, "bytes": -1}, {"ok": True, "bytes": True}):
        with pytest.raises(BadFrame, match=r"DONE 'bytes' is .*, not a count of bytes"):
            done_bytes(frame)


def test_the_stage_and_the_servers_record_are_told_the_field(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", ModelShape(n_layers=4, hidden=64, ffn=128))
    server = SliceServer("127.0.0.1", DigestStore(tmp_path / "digests"))
    try:
        content = server.offer(GgufSource((str(path),)))
        key = slice_key(new_secret(), "node1")
        server.expect(1, "node1", key, "host1", parts=PARTS)
        request = SliceRequest((str(path),), content, PARTS).frame()
        del request["source"]
        link = open_as_stage(server.address, 1, key)
        try:
            link.send(request)
            with pytest.raises(TransferError, match=r"the slice request has no 'source'$"):
                link.receive()
        finally:
            link.close()
        for _ in range(100):  # the server records the transfer as its thread ends
            if server.transfers()[0].state == "failed":
                break
            time.sleep(0.05)
        assert server.transfers()[0].error == "the slice request has no 'source'"
    finally:
        server.close()
