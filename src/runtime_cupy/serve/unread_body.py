"""A request answered before its body was read whole closes its connection.

A refusal can go out before the body has come (413 for a ``Content-Length`` over the
bound, or a chunked body that grows past it; 408 for one that does not come in time;
401, 415, ``invalid_host``: checked first). On a keep-alive connection uvicorn then
went on reading the rest of the body, to throw it away, before the next request: a
client sending a large or endless body, the server reading it for nothing, the
connection left lingering. ``ClosesUnreadBodies`` marks such an answer ``Connection:
close``, so that uvicorn closes the connection once it is sent (and the client knows
not to send more on it).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLOSE = (b"connection", b"close")


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers announce a body: a ``Content-Length`` other than 0,
    or a ``Transfer-Encoding`` (chunked)."""
    for name, value in headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
    return False


class ClosesUnreadBodies:
    """ASGI middleware: the answer to a request whose body was not read to its end is
    sent with ``Connection: close``; the others pass as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        read = False

        async def receiving() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read = True  # the body's end, or the client gone: nothing more comes
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = list(message.get("headers", []))
                if all(name.lower() != b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, CLOSE]}
            await send(message)

        await self.app(scope, receiving, sending)
