"""The ``Host`` header of a server that listens on a loopback address.

A web page cannot read the answers of another origin, but with DNS rebinding its own
name comes to resolve to 127.0.0.1: its requests then reach a server on this machine
as same-origin ones, JSON bodies and all, and it reads the answers (a keyless server's
completions, ``/metrics``). Their ``Host`` header still names the page's host, which no
client of a loopback server writes: such a server answers only requests whose ``Host``
is a loopback name (``loopback_names``), any other with 400 ``invalid_host``. A server
on another address is reached by names this process cannot know, and checks none.
"""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime_cupy.serve import openai_format as fmt
from runtime_cupy.serve.events import Failed

#: The names a client of a loopback server writes in ``Host`` (a port aside).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def loopback_names(address: str) -> frozenset[str] | None:
    """The ``Host`` names a server listening on ``address`` answers (``None``: any,
    for an address that is not a loopback one)."""
    if address == "localhost":
        return LOOPBACK_NAMES
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # a name: whatever resolves to it is its clients' business
    if not ip.is_loopback:
        return None
    return LOOPBACK_NAMES | {f"[{ip}]" if ip.version == 6 else str(ip)}


def host_name(value: bytes) -> str:
    """The name of a ``Host`` header's value, its port left out (``[::1]:8000`` ->
    ``[::1]``), in lower case; a value naming userinfo (``localhost:1@evil.example``,
    which RFC 9110 §4.2.4 calls an error: an absolute-form target's authority) whole,
    no loopback name. Its bytes are read as UTF-8, as a client writes a name
    (``bücher.example``), those that are none as escapes (``\\xff``): the refusal quotes
    the name as it was sent (read as Latin-1, a UTF-8 name came back as mojibake,
    ``bÃ¼cher.example``)."""
    text = value.decode("utf-8", "backslashreplace").strip().lower()
    if "@" in text:
        return text
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rpartition(":")[0] if ":" in text else text


class LoopbackHosts:
    """ASGI middleware: requests whose ``Host`` is not one of ``names`` are answered 400
    (an OpenAI error object), the others passed on. A request without ``Host`` (HTTP/1.0
    allows it; no browser sends one) is passed on."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and host_name(host) not in self.names:
                failed = Failed(
                    400,
                    f"the Host header names {host_name(host)!r}: this server listens on a "
                    f"loopback address and answers {', '.join(sorted(self.names))} only "
                    "(a web page's DNS rebinding)",
                    "invalid_host",
                    "invalid_request_error",
                )
                await JSONResponse(fmt.error_body(failed), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)
