"""The HTTP API, a Starlette application over an ``Engine``:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI's bodies
  (``requests``), answered whole or, with ``stream: true``, as server-sent events
  (``openai_format``). A client that goes away (mid-stream, or while it waits for a
  whole answer or in the queue) cancels its request; the stages stay warm.
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model served.
- ``GET /health``: 200 once every stage is up, bound and heard, 503 before and while
  the chain is not whole (a stage broken, gone or silent: ``detail`` names it) until
  it is started again, saying what it waits for (``waiting_for``: each stage's slice of
  the model still travelling to its host, with bytes, rate and time left; else the
  stages to start and bind).
- ``GET /metrics``: Prometheus's text format (``metrics``).

Every error is an OpenAI error object with a status: 400 for a bad body (naming the
field), 401 without the right ``Authorization: Bearer`` key (when the server has one;
``/health`` needs none), 404 for an unknown model or path (one with a trailing slash
too: no redirect), 405, 408 for a body that does not arrive within the client timeout,
413 for a body over ``MAX_BODY_BYTES``, 415 for a body of another type than JSON or of
none (``_check_json_type``: what a web page can make a browser send to localhost
unasked), 429 when the queue is full, 500 / 503 when the pipeline cannot answer, 503
once the server stops (a body still arriving too: ``stopping``); a server on a loopback
address answers 400 ``invalid_host`` to a ``Host`` that is not a loopback name
(``host_header``: DNS rebinding; a target in absolute form,
``GET http://localhost:8000/v1/models``, names the path and the host:
``request_target``); bytes that are no HTTP/1.1 request get a 400
``invalid_http_request`` error object from the protocol (``connections``), a head too
large a 431, a transfer coding not served a 501 (``refused_requests``). A bug is
logged with its traceback and answered 500 without it. An answer sent before the
request's body came whole (a 413, a 408, ...) says ``Connection: close`` and ends its
connection (``unread_body``).

A body is parsed and its prompt tokenized in a thread (``asyncio.to_thread``), never
on the event loop: ``/health`` and the streams of other requests go on meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from runtime_cupy.serve import openai_format as fmt
from runtime_cupy.serve.engine import Engine, QueueFull, ShuttingDown
from runtime_cupy.serve.events import Event, Failed, Finished, Piece
from runtime_cupy.serve.host_header import LoopbackHosts
from runtime_cupy.serve.jobs import SHUTTING_DOWN, Job
from runtime_cupy.serve.request_target import AbsoluteTargets
from runtime_cupy.serve.requests import (
    CompletionRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from runtime_cupy.serve.unread_body import ClosesUnreadBodies

log = logging.getLogger("runtime_cupy.serve")

MAX_BODY_BYTES = 8 << 20
OWNER = "gguf-pipeline"
#: How long a client may take to send a request's body (``build_app`` takes another).
CLIENT_TIMEOUT_S = 10.0


def _check_json_type(content_type: str | None) -> None:
    """A body is JSON: ``application/json`` (or a ``+json`` type). Any other type, and
    none, is a 415: a web page may make the user's browser POST ``text/plain``, form or
    multipart bodies, or a body with no type at all (``fetch`` of a ``Blob`` without
    one), to a server on localhost without asking the server first (CORS lets such
    "simple" requests through unasked), and a server that read them as JSON would run
    that page's requests. (Clients send the type: the OpenAI libraries do, ``curl``
    sends a form's unless told ``-H 'Content-Type: application/json'``.)"""
    if content_type is None:
        raise RequestError(
            "the body has no Content-Type: send JSON as application/json",
            status=415,
            code="unsupported_media_type",
        )
    media = content_type.split(";", 1)[0].strip().lower()
    json_like = media.startswith("application/") and media.endswith("+json")
    if media == "application/json" or json_like:
        return
    raise RequestError(
        f"the body's Content-Type is {media!r}: send JSON as application/json",
        status=415,
        code="unsupported_media_type",
    )


def _error(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _failed(failed: Failed) -> JSONResponse:
    retry = failed.retry_after_s
    headers = None if retry is None else {"Retry-After": str(retry)}
    return JSONResponse(fmt.error_body(failed), status_code=failed.status, headers=headers)


class _EventStream(StreamingResponse):
    """Server-sent events that end (and so cancel their request) the moment the client
    goes away, whatever the ASGI server's spec version: it always listens."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                task.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            await self.events.aclose()  # its cleanup runs now, wherever it stood


class Api:
    """The routes over ``engine``; ``api_key``: required as a Bearer token."""

    def __init__(
        self, engine: Engine, *, api_key: str | None = None, client_timeout_s: float
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.client_timeout_s = client_timeout_s
        self.model = engine.model_names[0]

    # -- checks ---------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def _unauthorized(self) -> JSONResponse:
        error = RequestError(
            "Incorrect or missing API key: send it as Authorization: Bearer <key>",
            status=401,
            code="invalid_api_key",
        )
        return _error(error, {"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> bytes:
        _check_json_type(request.headers.get("content-type"))
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"the body is over {MAX_BODY_BYTES} bytes", status=413)
        # A stop while the body comes answers 503 at once (``ShuttingDown``): it was held
        # through uvicorn's graceful wait, then cut (a bare 500, an ASGI traceback).
        reading = asyncio.ensure_future(self._read_body(request))
        stopping = asyncio.ensure_future(self.engine.stopping.wait())
        try:
            await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stopping, reading):
                task.cancel()  # (nothing, for the one done)
            await asyncio.gather(stopping, reading, return_exceptions=True)
        if reading.cancelled():
            raise ShuttingDown(SHUTTING_DOWN)
        return reading.result()

    async def _read_body(self, request: Request) -> bytes:
        chunks, total = [], 0
        try:
            async with asyncio.timeout(self.client_timeout_s):
                async for chunk in request.stream():
                    total += len(chunk)
                    if total > MAX_BODY_BYTES:
                        raise RequestError(f"the body is over {MAX_BODY_BYTES} bytes", status=413)
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(
                f"the body did not arrive within {self.client_timeout_s:g} s",
                status=408,
                code="request_timeout",
            ) from None
        return b"".join(chunks)

    def _check_model(self, req: CompletionRequest) -> None:
        if req.model not in self.engine.model_names:
            raise RequestError(
                f"The model {req.model!r} does not exist: this server serves {self.model!r}",
                param="model",
                status=404,
                code="model_not_found",
            )

    # -- completions ----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat", parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion", parse_completion)

    async def _complete(
        self, request: Request, endpoint: str, parse: Callable[[bytes], CompletionRequest]
    ) -> Response:
        if not self._authorized(request):
            self.engine.metrics.request(endpoint, "rejected")
            return self._unauthorized()
        try:
            req = await asyncio.to_thread(parse, await self._body(request))
            self._check_model(req)
            prepared = await asyncio.to_thread(self.engine.prepare, req)
        except RequestError as exc:
            log.info("refused a %s request: %s (%s)", endpoint, exc.message, exc.param)
            self.engine.metrics.request(endpoint, "rejected")
            return _error(exc)
        except ClientDisconnect:
            return Response(status_code=400)
        except ShuttingDown as exc:
            return self._shutting_down(endpoint, exc)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def sink_of(index: int) -> Callable[[Event], None]:
            def sink(event: Event) -> None:
                # A whole answer reads only its end: its pieces do not wake the loop.
                if req.stream or not isinstance(event, Piece):
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return sink

        try:  # each choice is a run of its own (its seed: prompts.choice_seed)
            jobs = self.engine.submit(prepared.choices(), sink_of)
        except QueueFull as exc:
            self.engine.metrics.request(endpoint, "rejected")
            error = RequestError(f"the server is busy: {exc}", status=429, code="queue_full",
                                 type="rate_limit_error")  # fmt: skip
            return _error(error, {"Retry-After": "1"})
        except ShuttingDown as exc:
            return self._shutting_down(endpoint, exc)
        if req.stream:
            return _EventStream(self._stream(jobs, events))
        return await self._whole(request, jobs, events)

    def _shutting_down(self, endpoint: str, exc: ShuttingDown) -> Response:
        self.engine.metrics.request(endpoint, "rejected")
        return _failed(Failed(503, str(exc), "shutting_down"))

    async def _whole(
        self, request: Request, jobs: list[Job], events: asyncio.Queue[tuple[int, Event]]
    ) -> Response:
        async def answer() -> list[Finished] | Failed:
            dones: dict[int, Finished] = {}
            while len(dones) < len(jobs):
                index, event = await events.get()
                if isinstance(event, Failed):
                    return event
                if isinstance(event, Finished):
                    dones[index] = event
            return [dones[i] for i in range(len(jobs))]

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waiting = asyncio.ensure_future(answer())
        watching = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
        if not waiting.done():
            for job in jobs:
                job.cancel()
            waiting.cancel()
            return Response(status_code=499)  # nobody reads it
        done = waiting.result()
        if isinstance(done, Failed):
            for job in jobs:  # the other choices are of no use
                job.cancel()
            return _failed(done)
        tokenizer = self.engine.tokenizer
        if jobs[0].prepared.request.endpoint == "chat":
            return JSONResponse(fmt.chat_response(jobs[0], self.model, done, tokenizer))
        return JSONResponse(fmt.completion_response(jobs[0], self.model, done, tokenizer))

    async def _stream(
        self, jobs: list[Job], events: asyncio.Queue[tuple[int, Event]]
    ) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come, each with its index (and the id of the
        first: one answer); after the last choice's end, the usage and ``[DONE]``."""
        job = jobs[0]
        over = False
        dones: dict[int, Finished] = {}
        tokenizer = self.engine.tokenizer
        try:
            if job.prepared.request.endpoint == "chat":
                yield b"".join(
                    fmt.event(
                        fmt.chat_chunk(
                            job, self.model, {"role": "assistant", "content": ""}, index=i
                        )
                    )
                    for i in range(len(jobs))
                )
            elif prefix := fmt.echoed(job, tokenizer):  # a completion's echoed prompt
                yield b"".join(
                    fmt.event(fmt.completion_chunk(job, self.model, prefix, index=i))
                    for i in range(len(jobs))
                )
            while True:
                index, event = await events.get()
                if isinstance(event, Piece):
                    shown = fmt.logprobs_of(job, tokenizer, event.logprobs)
                    yield fmt.event(fmt.piece_chunk(job, self.model, event.text, index, shown))
                    continue
                if isinstance(event, Finished):
                    dones[index] = event
                    shown = fmt.logprobs_of(job, tokenizer, event.tail)
                    end = fmt.event(fmt.last_chunk(job, self.model, event, index, shown))
                    if len(dones) < len(jobs):
                        yield end
                        continue
                    over = True
                    # The end in one write (each write is a send to the client).
                    if job.prepared.request.include_usage:
                        ordered = [dones[i] for i in range(len(jobs))]
                        end += fmt.event(fmt.usage_chunk(job, self.model, ordered))
                else:
                    over = True
                    for other in jobs:  # the other choices are of no use
                        other.cancel()
                    end = fmt.event(fmt.error_body(event))
                yield end + fmt.DONE
                return
        finally:
            if not over:  # the client went away (or the server stops): the runs go
                for other in jobs:
                    other.cancel()

    # -- the rest -------------------------------------------------------------------------
    def _model(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": OWNER}

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model_info(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        name = request.path_params["name"]
        if name not in self.engine.model_names:
            return _error(RequestError(f"The model {name!r} does not exist", param="model",
                                       status=404, code="model_not_found"))  # fmt: skip
        return JSONResponse(self._model())

    async def health(self, request: Request) -> Response:
        e = self.engine
        if e.ready:
            return JSONResponse({"status": "ok", "model": self.model})
        trouble = e.chain.trouble
        if e.failure:
            status, detail = "unavailable", e.failure
        elif trouble:
            status, detail = "recovering", trouble
        else:
            status, detail = "starting", None
        body = {
            "status": status,
            "model": self.model,
            "detail": detail,
            "waiting_for": [] if e.failure else e.chain.waiting_for(),
        }
        return JSONResponse(body, status_code=503)

    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        return Response(self.engine.metrics.render(), media_type=_metrics_type())


def _metrics_type() -> str:
    from runtime_cupy.serve.metrics import CONTENT_TYPE

    return CONTENT_TYPE


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = {404: "not found", 405: "method not allowed"}.get(exc.status_code, exc.detail)
    message = f"{request.method} {request.url.path}: {what}"
    error = RequestError(message, status=exc.status_code, code=str(what).replace(" ", "_"))
    return _error(error, dict(exc.headers) if exc.headers else None)  # a 405's Allow


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    failed = Failed(500, f"internal error ({type(exc).__name__})", "internal_error")
    return _failed(failed)


def build_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    client_timeout_s: float = CLIENT_TIMEOUT_S,
    host_names: frozenset[str] | None = None,
) -> Starlette:
    """The application; the engine is started and closed by whoever runs it.
    ``host_names``: the ``Host`` names it answers (``host_header``; ``None``: any)."""
    api = Api(engine, api_key=api_key, client_timeout_s=client_timeout_s)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{name:path}", api.model_info, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    checks = [Middleware(ClosesUnreadBodies)]  # first: a refused Host's body is unread too
    checks.append(Middleware(AbsoluteTargets))  # before the Host check: it names the host
    if host_names is not None:
        checks.append(Middleware(LoopbackHosts, names=host_names))
    app = Starlette(
        routes=routes,
        middleware=checks,
        exception_handlers={HTTPException: _http_error, Exception: _bug},
    )
    # A path with a slash too many (/v1/completions/) is a 404 with an error object,
    # not Starlette's bare redirect (307, no body) that a client does not follow.
    app.router.redirect_slashes = False
    return app
