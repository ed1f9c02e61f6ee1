"""A request whose target is in absolute form (``GET http://localhost:8000/v1/models
HTTP/1.1``: what a client writes to a proxy, and which a server MUST accept, RFC 9112
§3.2.2) is served as the path it names, with the target's authority as its ``Host``
(the RFC: the ``Host`` header is then ignored), so that the ``Host`` check
(``host_header``) reads the name the request was sent to, not the header beside it.

uvicorn hands such a target on as the path (``http://localhost:8000/v1/models``),
which matched no route: a 404 for a request to this very server.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.types import ASGIApp, Receive, Scope, Send

SCHEMES = (b"http", b"https")


def origin_form(scope: Scope) -> Scope:
    """``scope`` with an absolute-form target as its path and its authority as the
    ``Host`` header; any other scope as it is."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8")
    scheme, sep, rest = raw.partition(b"://")
    if not sep or scheme.lower() not in SCHEMES:
        return scope
    authority, slash, path = rest.partition(b"/")
    raw_path = slash + path or b"/"
    headers = [(k, v) for k, v in scope["headers"] if k != b"host"]
    return {
        **scope,
        "scheme": scheme.lower().decode("ascii"),
        "raw_path": raw_path,
        "path": unquote(raw_path.decode("latin-1")),
        "headers": [*headers, (b"host", authority)],
    }


class AbsoluteTargets:
    """ASGI middleware: an absolute-form target becomes the path and ``Host`` it
    names (``origin_form``) for the application behind it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = origin_form(scope)
        await self.app(scope, receive, send)
