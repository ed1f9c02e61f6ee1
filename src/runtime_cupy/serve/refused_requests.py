"""What the server answers bytes h11 will not read as a request, by h11's reason
(its ``RemoteProtocolError``'s ``error_status_hint``):

- **431** ``request_header_fields_too_large``: a request head (its request line and
  headers; or a chunk's line, a trailer) whose end had not come within the bytes h11
  holds of an incomplete one (``h11_max_incomplete_event_size``, h11's 16 KiB by
  default), RFC 6585 §5;
- **501** ``not_implemented``: a ``Transfer-Encoding`` other than ``chunked`` (RFC 9112
  §6.1: a server SHOULD answer a transfer coding it does not understand so);
- **400** ``invalid_http_request``: anything else (a malformed request line, header or
  chunk, a ``Content-Length`` that is no length, no ``Host``).

Each is an OpenAI error object naming what was wrong. (Every one was a 400 saying the
request was malformed: a request whose headers were only many was told it was not
HTTP/1.1.) ``RecordingConnection`` is h11's connection that keeps the error it raised,
which uvicorn's protocol catches without handing it on.
"""

from __future__ import annotations

import h11

from runtime_cupy.serve.request_errors import RequestError

#: The error of bytes that are no HTTP/1.1 request.
MALFORMED = RequestError(
    "the request is not valid HTTP/1.1 (a malformed request line, header or chunk, a "
    "Content-Length that is no length, or no Host header)",
    code="invalid_http_request",
)


class RecordingConnection(h11.Connection):
    """h11's connection of a server that keeps, in ``refused``, the
    ``RemoteProtocolError`` its ``next_event`` raised (``None`` before)."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.max_incomplete_event_size = max_incomplete_event_size
        self.refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refused = exc
            raise


def refusal(conn: RecordingConnection) -> RequestError:
    """The error to answer the request ``conn`` refused with."""
    exc = conn.refused
    hint = exc.error_status_hint if exc is not None else 400
    if hint == 431:
        return RequestError(
            "the request's head (its request line and headers) is too large: over "
            f"{conn.max_incomplete_event_size} bytes of it came without its end",
            status=431,
            code="request_header_fields_too_large",
        )
    if hint == 501:
        return RequestError(
            f"the request's Transfer-Encoding is not served ({exc}): send its body "
            "with a Content-Length, or chunked",
            status=501,
            code="not_implemented",
            type="server_error",
        )
    return MALFORMED
