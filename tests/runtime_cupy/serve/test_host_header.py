"""A server on a loopback address answers only requests whose ``Host`` is a loopback
name (``serve.host_header``): a web page whose name DNS rebinding made resolve to
127.0.0.1 sends its own name, and was answered (a keyless server's completions and
``/metrics``, read by the page as same-origin)."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime_cupy.serve.host_header import LOOPBACK_NAMES, LoopbackHosts, loopback_names


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


def test_only_a_loopback_address_checks_hosts() -> None:
    assert loopback_names("127.0.0.1") == LOOPBACK_NAMES
    assert loopback_names("localhost") == LOOPBACK_NAMES
    assert loopback_names("::1") == LOOPBACK_NAMES
    assert loopback_names("127.0.0.5") == LOOPBACK_NAMES | {"127.0.0.5"}
    for address in ("0.0.0.0", "::", "192.168.1.7", "my-host.lan"):
        assert loopback_names(address) is None
