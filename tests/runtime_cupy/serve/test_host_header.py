"""A server on a loopback address answers only requests whose ``Host`` is a loopback
name (``serve.host_header``): a web page whose name DNS rebinding made resolve to
127.0.0.1 sends its own name, and was answered (a keyless server's completions and
``/metrics``, read by the page as same-origin)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime_cupy.serve.host_header import (
    LOOPBACK_NAMES,
    LoopbackHosts,
    host_name,
    loopback_names,
)
from tests.support.servers import ServerProcess


def _client(names: frozenset[str]) -> TestClient:
    async def hello(_request: object) -> PlainTextResponse:
        return PlainTextResponse("served")

    app = Starlette(
        routes=[Route("/metrics", hello)], middleware=[Middleware(LoopbackHosts, names=names)]
    )
    return TestClient(app)


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:8000", "127.0.0.1:18452", "[::1]:8000", "[::1]"]
)
def test_a_loopback_host_is_served(host: str) -> None:
    response = _client(LOOPBACK_NAMES).get("/metrics", headers={"Host": host})
    assert (response.status_code, response.text) == (200, "served")


@pytest.mark.parametrize(
    "host", ["rebind.attacker.example:18452", "attacker.example", "127.0.0.2", "[::2]:80", ""]
)
def test_another_host_is_refused_with_an_openai_error(host: str) -> None:
    response = _client(LOOPBACK_NAMES).get("/metrics", headers={"Host": host})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_host" and "DNS rebinding" in error["message"]
    assert "served" not in response.text


def test_a_refused_host_is_named_as_it_was_sent() -> None:
    """A ``Host`` written in UTF-8 is quoted back as written, bytes that are no UTF-8
    as escapes. (Read as Latin-1, ``bücher.example`` came back as ``bÃ¼cher.example``.)"""
    response = _client(LOOPBACK_NAMES).get("/metrics", headers={"Host": "bücher.example".encode()})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("the Host header names 'bücher.example':"), message
    assert host_name(b"B\xfccher.example:80") == "b\\xfccher.example"


def test_only_a_loopback_address_checks_hosts() -> None:
    assert loopback_names("127.0.0.1") == LOOPBACK_NAMES
    assert loopback_names("localhost") == LOOPBACK_NAMES
    assert loopback_names("::1") == LOOPBACK_NAMES
    assert loopback_names("127.0.0.5") == LOOPBACK_NAMES | {"127.0.0.5"}
    for address in ("0.0.0.0", "::", "192.168.1.7", "my-host.lan"):
        assert loopback_names(address) is None


@pytest.mark.process
@pytest.mark.parametrize("spelled", ["127.1", "LOCALHOST"])
def test_a_server_bound_to_loopback_however_spelled_checks_the_host(
    tiny_chat: str, tmp_path: Path, spelled: str
) -> None:
    """``--host 127.1`` binds 127.0.0.1 as well; the check once went by the flag's
    text, which it could not read as loopback, and checked nothing."""
    args = ["--model", tiny_chat, "--stages", "1", "--port", "0", "--context", "64"]
    server = ServerProcess([*args, "--host", spelled], tmp_path / "server.log")
    try:
        server.wait_listening()
        evil = httpx2.get(f"{server.base_url}/health", headers={"Host": "evil.example"})
        assert evil.status_code == 400 and "invalid_host" in evil.text
        assert httpx2.get(f"{server.base_url}/health").status_code in (200, 503)
    finally:
        server.stop()
