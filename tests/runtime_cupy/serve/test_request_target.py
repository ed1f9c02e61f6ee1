"""A request whose target is in absolute form (``GET http://localhost:8000/v1/models``,
which RFC 9112 §3.2.2 says a server must accept) is served as the path it names, and
its host is the one the ``Host`` check reads (``serve.request_target``): it was a 404
(uvicorn hands the whole URL on as the path), and the check read the ``Host`` header
beside it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette

from runtime_cupy.serve.app import build_app
from runtime_cupy.serve.host_header import LOOPBACK_NAMES
from runtime_cupy.serve.request_target import origin_form


def _app() -> Starlette:
    """The server's application (its middleware as ``build_app`` stacks it) over an
    engine that serves one model's name."""
    engine: Any = SimpleNamespace(model_names=("m",))
    return build_app(engine, host_names=LOOPBACK_NAMES)


def _get(target: bytes, host: bytes = b"localhost") -> tuple[int, dict[str, Any]]:
    """``GET target`` with ``Host: host``, as uvicorn hands it on: status, JSON body."""
    raw_path, _, query = target.partition(b"?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": raw_path.decode("ascii"), "raw_path": raw_path,
        "query_string": query, "root_path": "", "headers": [(b"host", host)],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(_app()(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


@pytest.mark.parametrize(
    "target", [b"http://localhost:8000/v1/models", b"HTTP://127.0.0.1/v1/models?x=1"]
)
def test_an_absolute_target_is_served_as_its_path(target: bytes) -> None:
    status, body = _get(target)
    assert status == 200, body
    assert [model["id"] for model in body["data"]] == ["m"]


def test_an_absolute_target_s_host_is_the_one_checked() -> None:
    status, body = _get(b"http://rebind.attacker.example/v1/models", host=b"localhost")
    assert status == 400 and body["error"]["code"] == "invalid_host", body
    assert "rebind.attacker.example" in body["error"]["message"]


@pytest.mark.parametrize(
    ("target", "host"),
    [(b"http://localhost:1@evil.example/v1/models", b"evil.example"),
     (b"/v1/models", b"localhost:1@evil.example")],
)  # fmt: skip
def test_a_host_naming_userinfo_is_refused(target: bytes, host: bytes) -> None:
    """``localhost:1@evil.example`` names the host evil.example: it read as localhost."""
    status, body = _get(target, host=host)
    assert status == 400 and body["error"]["code"] == "invalid_host", body


def test_an_origin_form_target_is_left_as_it_is() -> None:
    scope = {"type": "http", "path": "/v1/models", "raw_path": b"/v1/models",
             "headers": [(b"host", b"localhost")]}  # fmt: skip
    assert origin_form(scope) is scope
    assert origin_form({**scope, "raw_path": b"/http://x/y"})["path"] == "/v1/models"
    assert _get(b"/v1/models")[0] == 200
    assert _get(b"/v1/models", host=b"attacker.example")[0] == 400
