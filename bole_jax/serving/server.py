"""OpenAI-compatible HTTP server over the continuous-batching `Scheduler`: FastAPI on uvicorn (h11).

    bole-jax serve --model DIR [--spec MODE] [--host 127.0.0.1] [--port 8000] [--max-batch N] ...

Endpoints: POST /v1/completions, POST /v1/chat/completions (`stream: true` -> server-sent events
over chunked encoding, `data: {...}` chunks, a last chunk with the finish_reason, then
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus). docs/serving.md lists the
fields, limits and flags.

Threads: the event loop (one thread) parses, validates and streams; tokenising and chat templates
run in its worker threads; the engine thread (`Scheduler`) owns the device and pushes each
request's deltas onto the loop (`_Sink`). A client that disconnects (the ASGI `http.disconnect`
event) has its requests cancelled, which frees their slots.

What the HTTP layer guards before any model work (each answered in the OpenAI error shape):
the request head (h11 size limit, a deadline for slow heads), the body (Content-Length checked,
size capped while reading, a deadline per piece), strict schemas with bounded fields, then the
server's limits (prompt characters before tokenising, tokens after it, stops, prompts, n,
max_tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import resource
import signal
import socket
import threading
import time
import uuid
from typing import Any

import anyio
from fastapi import (
    Request as HttpRequest,  # module level: FastAPI resolves annotations here
)
from starlette.responses import Response

from bole_jax.serving import simulate
from bole_jax.serving.chat import ChatTemplate, PromptEncoder, TemplateError
from bole_jax.serving.memory import format_plan_table
from bole_jax.serving.protocol import ChatRequest, CompletionRequest, Limits
from bole_jax.serving.requests import Delta, Request, RequestError, RequestParams
from bole_jax.serving.scheduler import Scheduler
from bole_jax.serving.tools import ToolStream, parse_tool_calls
from bole_jax.spec_decode.budget import device_name

log = logging.getLogger("bole_jax.serving")

MAX_TARGET_BYTES = 8192  # request target (path + query) length: 414 beyond
MAX_HEADER_BYTES = 32768  # all headers together: 431 beyond
H11_MAX_EVENT = 65536  # h11's cap on an incomplete request head (414 / 431 beyond)
_KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
# The engine's finish reasons as OpenAI's: a request the server cut (shutdown) ended early, which
# clients know as "length"; "cancelled" reaches a client only in that case.
_FINISH = {"stop": "stop", "length": "length", "cancelled": "length"}


class ApiError(Exception):
    """An error answered as JSON in the OpenAI shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _error_type(status)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _error_type(status: int) -> str:
    return {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def _error_bytes(status: int, message: str, param=None, code=None) -> bytes:
    return json.dumps(ApiError(status, message, param, code).body()).encode()


async def _send_error(
    send, status: int, message: str, code: str | None = None, close: bool = False
) -> None:
    """An OpenAI error answered from raw ASGI (before the application runs)."""
    body = _error_bytes(status, message, code=code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ------------------------------------------------------------------ the HTTP protocol
def _protocol_class(limits: Limits):
    """uvicorn's h11 protocol with a deadline for request heads and OpenAI-shaped 4xx answers to
    malformed requests (uvicorn answers those in plain text)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def _arm_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _head_timeout(self):
            # No request head arrived since the connection opened or its last response: a stalled or
            # slow client holds a descriptor; close it. A request being answered is left alone.
            if (
                self.cycle is None or self.cycle.response_complete
            ) and not self.transport.is_closing():
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
                self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str):
            status, message = 400, "malformed HTTP request"
            buf = bytes(getattr(self.conn, "_receive_buffer", b""))
            if len(buf) > H11_MAX_EVENT:
                status, message = (
                    (414, "request line too long")
                    if b"\r\n" not in buf[:H11_MAX_EVENT]
                    else (431, "request headers too large")
                )
            elif b"content-length" in buf.lower():
                message = "malformed HTTP request (check Content-Length)"
            body = _error_bytes(status, message)
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            try:
                self.transport.write(
                    self.conn.send(h11.Response(status_code=status, headers=headers))
                )
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # h11 cannot answer in its state: raw bytes then
                self.transport.write(
                    f"HTTP/1.1 {status} Bad Request\r\ncontent-type: application/json"
                    f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                    + body
                )
            self.transport.close()

    return Protocol


class _Guard:
    """Raw ASGI middleware in front of the application: target and header sizes, Content-Length,
    the body (read here whole, capped, with a deadline per piece, then replayed to the
    application), draining, the API key, and the HTTP request counter."""

    def __init__(self, app, server: "OpenAIServer"):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv, limits = self.server, self.server.limits
        path = scope["path"]
        label = (
            path
            if path in _KNOWN_PATHS
            else ("/v1/models" if path.startswith("/v1/models/") else "other")
        )

        async def counted_send(message):
            if message["type"] == "http.response.start":
                srv.http_requests.labels(label, str(message["status"])).inc()
            await send(message)

        target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        if target > MAX_TARGET_BYTES:
            return await _send_error(
                counted_send,
                414,
                f"request target longer than {MAX_TARGET_BYTES} bytes",
                close=True,
            )
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            return await _send_error(
                counted_send,
                431,
                f"request headers larger than {MAX_HEADER_BYTES} bytes",
                close=True,
            )
        if srv.api_key is not None and path.startswith("/v1/"):
            auth = next((v for k, v in headers if k == b"authorization"), b"")
            if not _same(auth, b"Bearer " + srv.api_key.encode()):
                return await _send_error(
                    counted_send,
                    401,
                    "missing or wrong API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                )
        if scope["method"] != "POST":
            return await self.app(scope, receive, counted_send)
        if srv.draining:
            return await _send_error(
                counted_send, 503, "the server is shutting down", code="shutting_down", close=True
            )
        lengths = [v for k, v in headers if k == b"content-length"]
        if lengths:
            raw = lengths[0].strip()
            if len(lengths) > 1 or not raw.isdigit():
                return await _send_error(counted_send, 400, "bad Content-Length header", close=True)
            if int(raw) > limits.max_body_bytes:
                return await _send_error(
                    counted_send,
                    413,
                    f"request body too large ({int(raw)} bytes > {limits.max_body_bytes})",
                    close=True,
                )
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), limits.body_timeout_s)
            except asyncio.TimeoutError:
                return await _send_error(
                    counted_send,
                    408,
                    f"the request body did not arrive within {limits.body_timeout_s:g} s",
                    close=True,
                )
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_body_bytes:
                return await _send_error(
                    counted_send,
                    413,
                    f"request body too large (> {limits.max_body_bytes} bytes)",
                    close=True,
                )
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, counted_send)


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


class _Sink:
    """What the engine thread puts a request's deltas into: hands them to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


# ------------------------------------------------------------------ the server
class OpenAIServer:
    """The HTTP front end of a `Scheduler`.

    Args:
      scheduler: the engine (started by `start()` / `serve_forever()`).
      model_name: the id clients use in "model" (requests naming another model get 404).
      chat_template: a `ChatTemplate` (default: ChatML).
      host, port: where to listen (port 0: any free port; see `.port`). Bound at construction.
      generation_defaults: temperature / top_p / top_k used when a request omits them
        (default: OpenAI's, temperature 1 and top_p 1).
      limits: per-request limits and timeouts (`Limits`).
      api_key: when given, /v1/* requests need `Authorization: Bearer <api_key>` (401 otherwise).
      allow_special_tokens: take special-token text in chat contents as control tokens (default:
        as text, so that a client cannot forge turns or roles).
      backlog: listen backlog (bursts of connects beyond it wait for SYN retransmits).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_name: str = "bole-jax",
        chat_template: ChatTemplate | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        generation_defaults: dict | None = None,
        limits: Limits | None = None,
        api_key: str | None = None,
        allow_special_tokens: bool = False,
        backlog: int = 2048,
    ):
        self.scheduler = scheduler
        self.tokenizer = scheduler.tokenizer
        if self.tokenizer is None:
            raise ValueError("the model folder has no tokenizer.json: the server needs one")
        self.model_name = model_name
        self.simulated = simulate.describe(scheduler)  # None: a real model's outputs
        self.chat = chat_template or ChatTemplate(None, self.tokenizer)
        self.encoder = None if allow_special_tokens else PromptEncoder(self.tokenizer)
        self.defaults = dict(temperature=1.0, top_p=1.0, top_k=0)
        self.defaults.update(
            {
                k: v
                for k, v in (generation_defaults or {}).items()
                if k in self.defaults and v is not None
            }
        )
        self.limits = limits or Limits()
        self.api_key = api_key or None
        self.backlog = backlog
        self.created = int(time.time())
        self.draining = False
        self.startup_error: str | None = None
        self._live: set[Request] = set()
        self._cut = False
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._registry, self.http_requests = self._metrics()
        self.app = self._build_app()
        self._sock = self._bind(host, port, backlog)
        self._address = self._sock.getsockname()[:2]

    # ---------------------------------------------------------------- listening
    @staticmethod
    def _bind(host: str, port: int, backlog: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(False)
        return sock

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        return self._address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _config(self):
        import uvicorn

        lim = self.limits
        return uvicorn.Config(
            self.app,
            http=_protocol_class(lim),
            lifespan="off",
            log_level="warning",
            access_log=False,
            backlog=self.backlog,
            timeout_keep_alive=lim.keep_alive_s,
            timeout_graceful_shutdown=lim.shutdown_grace_s + 10,
            h11_max_incomplete_event_size=H11_MAX_EVENT,
            server_header=False,
        )

    def _server(self):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn re-raises the signal after its shutdown, which would kill the process before
                # the engine stops; here the signal starts the drain and serve_forever returns.
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {
                    s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)
                }
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

            def handle_exit(self, sig, frame):
                if not outer.draining:
                    log.warning(
                        "signal %d: not admitting new requests; running ones may go on for %g s",
                        sig,
                        outer.limits.shutdown_grace_s,
                    )
                    outer.begin_drain()
                super().handle_exit(sig, frame)

        return Server(self._config())

    def start(self) -> "OpenAIServer":
        """Start the engine and serve HTTP on a background thread (no signal handling)."""
        self.scheduler.start()
        self._start_http()
        return self

    def _start_http(self) -> None:
        self._uvicorn = self._server()
        self._thread = threading.Thread(
            target=self._uvicorn.run,
            kwargs={"sockets": [self._sock]},
            name="bole-http",
            daemon=True,
        )
        self._thread.start()
        t0 = time.monotonic()
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() - t0 < 30:
            time.sleep(0.01)

    def serve_forever(self, on_ready=None) -> None:
        """Serve HTTP in this thread (/health answers 503 "starting" while the engine compiles on
        another), call `on_ready()` once the engine runs; SIGTERM / SIGINT drain and return."""

        def engine():
            try:
                self.scheduler.start()
            except Exception as e:
                log.exception("the engine failed to start")
                self.startup_error = f"{type(e).__name__}: {e}"
                return
            if on_ready is not None:
                on_ready()

        threading.Thread(target=engine, name="bole-warmup", daemon=True).start()
        self._uvicorn = self._server()
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.scheduler.stop()
            self._sock.close()

    def begin_drain(self) -> None:
        """Stop admitting requests; cut the running ones after `limits.shutdown_grace_s`."""
        self.draining = True
        timer = threading.Timer(self.limits.shutdown_grace_s, self.cut_all)
        timer.daemon = True
        timer.start()

    def cut_all(self) -> None:
        """End every running request now: its stream gets a last chunk (finish_reason "length")
        and [DONE]."""
        self._cut = True
        for r in list(self._live):
            r.cancel()

    def shutdown(self) -> None:
        """Drain (running requests cut at once), stop HTTP and the engine."""
        self.draining = True
        self.cut_all()
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(60)
            self._thread = None
        self._sock.close()
        self.scheduler.stop()

    # ---------------------------------------------------------------- metrics
    def _metrics(self):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            PlatformCollector,
            ProcessCollector,
        )

        from bole_jax.serving.metrics import EngineCollector

        reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        reg.register(EngineCollector(self.scheduler))
        http = Counter(
            "bole_http_requests",
            "HTTP requests by path and status.",
            ["path", "status"],
            registry=reg,
        )
        return reg, http

    def render_metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self._registry)

    # ---------------------------------------------------------------- the application
    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def error(e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(ApiError)
        async def _api_error(_, e: ApiError):
            return error(e)

        @app.exception_handler(HTTPException)
        async def _http_error(request, e: HTTPException):
            msg = {
                404: f"no route {request.url.path}",
                405: f"method {request.method} not allowed for {request.url.path}",
            }.get(e.status_code, str(e.detail))
            return JSONResponse(
                ApiError(e.status_code, msg).body(),
                status_code=e.status_code,
                headers=getattr(e, "headers", None),
            )

        @app.exception_handler(RequestValidationError)
        async def _validation_error(_, e: RequestValidationError):
            return error(_from_validation(e.errors()))

        @app.exception_handler(Exception)
        async def _internal(_, e: Exception):
            log.error("internal error", exc_info=e)
            return error(ApiError(500, "internal server error (see the server log)"))

        @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers
        async def health():
            sched = self.scheduler
            err = sched.error or self.startup_error
            ok = err is None and sched._thread is not None and sched._thread.is_alive()
            if self.draining:
                return JSONResponse({"status": "draining", "error": None}, status_code=503)
            if not ok and err is None:
                return JSONResponse(
                    {"status": "starting", "error": None, "stage": sched.stage}, status_code=503
                )
            body = {"status": "ok" if ok else "error", "error": err}
            if self.simulated is not None:  # benchmark servers say so (/v1/models: what)
                body["simulated"] = True
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(self.render_metrics(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            if name != self.model_name:
                raise ApiError(
                    404, f"the model {name!r} does not exist", "model", "model_not_found"
                )
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            body = _parse(CompletionRequest, await request.body())
            return await self._completions(request, body)

        @app.post("/v1/chat/completions")
        async def chat(request: HttpRequest):
            body = _parse(ChatRequest, await request.body())
            return await self._chat(request, body)

        return _Guard(app, self)

    def _model_card(self) -> dict:
        s = self.scheduler
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "bole-jax",
            "max_model_len": s.max_context,
            "spec_mode": s.mode,
            "device": device_name(),
            "tensor_parallel": s.llm.cfg.tp,
            "simulated": self.simulated,
        }

    # ---------------------------------------------------------------- request building
    def check_common(self, body) -> None:
        lim = self.limits
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist: this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        if body.n > lim.max_n:
            raise ApiError(
                400, f"n = {body.n} is above this server's limit ({lim.max_n}, --max-n)", "n"
            )
        if body.best_of not in (None, 1, body.n):
            raise ApiError(400, "best_of is not supported (only best_of = n)", "best_of")
        stops = body.stops()
        if len(stops) > lim.max_stops:
            raise ApiError(
                400,
                f"{len(stops)} stop strings: this server takes at most "
                f"{lim.max_stops} (--max-stops)",
                "stop",
            )
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        if any(len(s) > lim.max_stop_chars for s in stops):
            raise ApiError(
                400,
                f"a stop string is longer than {lim.max_stop_chars} characters (--max-stop-chars)",
                "stop",
            )
        for pen in ("presence_penalty", "frequency_penalty"):
            if getattr(body, pen) != 0:
                raise ApiError(400, f"{pen} is not supported (only 0)", pen)
        if body.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")
        if body.ignore_eos:
            raise ApiError(400, "ignore_eos is not supported", "ignore_eos")

    def sampling(
        self, body, max_tokens: int | None, prompt_len: int, stop_token_ids: tuple[int, ...] = ()
    ) -> RequestParams:
        d, s = self.defaults, self.scheduler
        cap = self.limits.max_tokens or s.max_context
        if max_tokens is None:
            max_tokens = max(
                min(self.limits.default_max_tokens, s.max_context - prompt_len, cap), 1
            )
        elif max_tokens > cap:
            raise ApiError(
                400, f"max_tokens = {max_tokens} is above this server's limit ({cap})", "max_tokens"
            )
        vocab = s.llm.cfg.vocab_size
        bad = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
        if bad:  # an id outside the vocabulary would never match: the client meant something else
            raise ApiError(
                400, f"stop_token_ids out of range [0, {vocab}): {bad[:5]}", "stop_token_ids"
            )
        top_k = d["top_k"] if body.top_k is None else body.top_k
        seed = 0 if body.seed is None else body.seed
        return RequestParams(
            max_tokens=max_tokens,
            temperature=float(d["temperature"] if body.temperature is None else body.temperature),
            top_p=float(d["top_p"] if body.top_p is None else body.top_p),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
            seed=seed & 0xFFFFFFFF,
            stop=body.stops(),
            stop_token_ids=tuple(stop_token_ids) + tuple(body.stop_token_ids or ()),
        )

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if len(items) > self.limits.max_prompts:
            raise ApiError(
                400,
                f"{len(items)} prompts: this server takes at most "
                f"{self.limits.max_prompts} per request (--max-prompts)",
                "prompt",
            )
        if len(items) * body.n > self.limits.max_prompts * self.limits.max_n:
            raise ApiError(400, "too many choices (prompts x n) in one request", "n")
        chars = self.limits.prompt_chars(self.scheduler.max_context)
        for x in items:
            if isinstance(x, str) and len(x) > chars:
                raise ApiError(
                    400,
                    f"a prompt of {len(x)} characters is above this server's limit "
                    f"({chars}, --max-prompt-chars)",
                    "prompt",
                    "context_length_exceeded",
                )
            if not isinstance(x, str) and len(x) > self.scheduler.max_context:
                raise ApiError(
                    400,
                    f"a prompt of {len(x)} tokens is longer than this server's maximum "
                    f"context length ({self.scheduler.max_context})",
                    "prompt",
                    "context_length_exceeded",
                )
        return [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in items]

    def chat_prompt(self, body: ChatRequest) -> tuple[list[int], bool]:
        """(prompt ids, whether tool calls are parsed from the output)."""
        lim = self.limits
        if len(body.messages) > lim.max_messages:
            raise ApiError(
                400,
                f"{len(body.messages)} messages: this server takes at most "
                f"{lim.max_messages} (--max-messages)",
                "messages",
            )
        tools = body.tools or []
        if len(tools) > lim.max_tools:
            raise ApiError(
                400, f"{len(tools)} tools: this server takes at most {lim.max_tools}", "tools"
            )
        choice = body.tool_choice
        if choice == "required" or (choice is not None and not isinstance(choice, str)):
            raise ApiError(
                400,
                "tool_choice 'required' or a named function is not supported (no "
                "constrained decoding): use 'auto' or 'none'",
                "tool_choice",
            )
        use_tools = bool(tools) and choice != "none"
        if use_tools and not self.chat.supports_tools:
            raise ApiError(400, "this model's chat template does not render tools", "tools")
        texts = [m.text() for m in body.messages]
        chars = sum(map(len, texts)) + sum(len(m.reasoning_content or "") for m in body.messages)
        limit = lim.prompt_chars(self.scheduler.max_context)
        if chars > limit:
            raise ApiError(
                400,
                f"the messages hold {chars} characters, above this server's limit "
                f"({limit}, --max-prompt-chars)",
                "messages",
                "context_length_exceeded",
            )
        msgs = []
        for m, text in zip(body.messages, texts):
            d: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": text,
            }
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            msgs.append(d)
        kwargs = body.chat_template_kwargs or {}
        tool_defs = [t.model_dump(exclude_none=True) for t in tools] if use_tools else None
        try:
            prompt = self.chat.render(msgs, tool_defs, kwargs)
            if self.encoder is None:
                return self.tokenizer.encode(prompt), use_tools
            return self.encoder.encode(prompt, texts), use_tools
        except TemplateError as e:
            raise ApiError(400, str(e), "messages") from None

    def submit_all(
        self, prompts: list[list[int]], params: RequestParams, n: int, sink: _Sink
    ) -> list[Request]:
        """Submit every prompt n times (choice index = prompt * n + copy; copy j samples with seed
        + j, so the choices differ; they share the prompt's cached prefix blocks)."""
        reqs: list[Request] = []
        try:
            for i, ids in enumerate(prompts):
                for j in range(n):
                    p = (
                        params
                        if j == 0
                        else RequestParams(
                            **{**vars(params), "seed": (params.seed + j) & 0xFFFFFFFF}
                        )
                    )
                    reqs.append(self.scheduler.submit(ids, p, events=sink, index=i * n + j))
        except RequestError as e:
            self._cancel(reqs)
            raise ApiError(400, str(e), e.param, e.code) from None
        except OverflowError as e:
            self._cancel(reqs)
            raise ApiError(429, str(e), code="overloaded") from None
        except RuntimeError as e:
            self._cancel(reqs)
            raise ApiError(503, str(e), code="engine_stopped") from None
        self._live.update(reqs)
        if self._cut:  # a drain that began while these were being submitted
            self._cancel(reqs)
        return reqs

    def _cancel(self, reqs) -> None:
        for r in reqs:
            if not r.finished:
                r.cancel()

    # ---------------------------------------------------------------- OpenAI endpoints
    async def _completions(self, request, body: CompletionRequest):
        from starlette.concurrency import run_in_threadpool

        self.check_common(body)
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if body.suffix is not None:
            raise ApiError(400, "suffix is not supported", "suffix")
        prompts = await run_in_threadpool(self.completion_prompts, body)
        params = self.sampling(body, body.max_tokens, max(len(p) for p in prompts))
        params.logprobs = body.logprobs
        sink = _Sink(asyncio.get_running_loop())
        reqs = self.submit_all(prompts, params, body.n, sink)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        opts = body.stream_options

        want_lp = body.logprobs is not None

        def chunks(d: Delta, reason: str | None) -> list[dict]:
            lp = self._completion_logprobs(d.logprobs) if want_lp else None
            return [
                {
                    **head,
                    "choices": [
                        {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": reason}
                    ],
                }
            ]

        if body.stream:
            return self._stream(reqs, sink, chunks, head, bool(opts and opts.include_usage), body.n)
        await self._collect(request, reqs, sink)
        choices = [
            {
                "index": r.index,
                "text": r.text,
                "logprobs": self._completion_logprobs(r.logprobs) if want_lp else None,
                "finish_reason": _FINISH[r.finish_reason],
            }
            for r in reqs
        ]
        return {**head, "choices": choices, "usage": _usage(reqs, body.n)}

    async def _chat(self, request, body: ChatRequest):
        from starlette.concurrency import run_in_threadpool

        self.check_common(body)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        rf = body.response_format
        if rf is not None and rf.get("type") != "text":
            raise ApiError(
                400, "only response_format {'type': 'text'} is supported", "response_format"
            )
        ids, use_tools = await run_in_threadpool(self.chat_prompt, body)
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        params = self.sampling(body, max_tokens, len(ids), self.chat.stop_token_ids)
        params.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        want_lp = body.logprobs
        sink = _Sink(asyncio.get_running_loop())
        try:
            reqs = self.submit_all([ids], params, body.n, sink)
        except ApiError as e:
            if e.param == "logprobs" and self.scheduler.max_logprobs is not None:
                e.param = "top_logprobs"  # the count over the limit is chat's top_logprobs
            raise
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        opts = body.stream_options

        if body.stream:
            splitters = {r.index: ToolStream() for r in reqs} if use_tools else {}

            def chunks(d: Delta, reason: str | None) -> list[dict]:
                out = []
                text, calls = d.text, []
                split = splitters.get(d.index)
                if split is not None:
                    text = split.push(text)
                    if reason is not None:
                        tail, calls = split.finish()
                        text += tail
                lp = self._chat_logprobs(d.logprobs) if want_lp and d.logprobs else None
                choice = lambda delta, fin=None, lp=None: {
                    **head,
                    "choices": [  # noqa: E731
                        {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": fin}
                    ],
                }
                if text or lp:
                    out.append(choice({"content": text}, None, lp))
                if calls:
                    out.append(
                        choice({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                    )
                if reason is not None:
                    out.append(choice({}, "tool_calls" if calls else reason))
                return out

            first = [
                {
                    **head,
                    "choices": [
                        {
                            "index": r.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for r in reqs
            ]
            return self._stream(
                reqs, sink, chunks, head, bool(opts and opts.include_usage), body.n, first
            )
        await self._collect(request, reqs, sink)
        choices = []
        for r in reqs:
            content, calls = parse_tool_calls(r.text) if use_tools else (r.text, [])
            msg = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                msg["tool_calls"] = calls
            choices.append(
                {
                    "index": r.index,
                    "message": msg,
                    "logprobs": self._chat_logprobs(r.logprobs) if want_lp else None,
                    "finish_reason": "tool_calls" if calls else _FINISH[r.finish_reason],
                }
            )
        return {
            **head,
            "object": "chat.completion",
            "choices": choices,
            "usage": _usage(reqs, body.n),
        }

    def _token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    def _chat_logprobs(self, entries) -> dict:
        """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

        def one(tok, lp):
            t = self._token_text(tok)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}

        return {
            "content": [
                {**one(e.token, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
                for e in entries or []
            ],
            "refusal": None,
        }

    def _completion_logprobs(self, entries) -> dict:
        """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
        entries = entries or []
        toks = [self._token_text(e.token) for e in entries]
        offsets, at = [], 0
        for t in toks:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": toks,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    async def _collect(self, request, reqs: list[Request], sink: _Sink) -> None:
        """Wait for every request (non-streaming); a client that leaves cancels them."""

        async def finished():
            left = len(reqs)
            while left:
                d = await sink.queue.get()
                if d.finish_reason == "error":
                    raise ApiError(
                        500, "generation failed (see the server log)", code="engine_error"
                    )
                left -= d.finish_reason is not None

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(finished())
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            self._cancel(reqs)
            self._live.difference_update(reqs)
        if not work.done() or work.cancelled():
            raise ApiError(499, "the client closed the connection")
        work.result()  # raises the engine error, if any

    def _stream(self, reqs, sink, make_chunks, head, include_usage, n, first=()):
        """Server-sent events until every request finished, then the usage chunk (each prompt's
        tokens counted once over its `n` choices) and [DONE]."""
        reasons = {}

        async def events():
            try:
                for c in first:
                    yield _sse(c)
                left = len(reqs)
                while left:
                    d = await sink.queue.get()
                    if d.finish_reason == "error":
                        log.error("generation failed: %s", d.error)
                        yield _sse(
                            ApiError(
                                500, "generation failed (see the server log)", code="engine_error"
                            ).body()
                        )
                        break
                    reason = None
                    if d.finish_reason is not None:
                        left -= 1
                        reason = reasons[d.index] = _FINISH[d.finish_reason]
                    for c in make_chunks(d, reason):
                        yield _sse(c)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(reqs, n)})
                yield b"data: [DONE]\n\n"
            finally:
                self._cancel(reqs)
                self._live.difference_update(reqs)

        return _EventStream(events(), self.limits.body_timeout_s)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _DroppedStreams(logging.Filter):
    """Keeps uvicorn's "ASGI callable returned without completing response." out of the log for
    the streams `_EventStream` drops on purpose (it has logged why): one record per drop, counted
    on the event loop's thread, where both the drop and uvicorn's record happen."""

    MESSAGE = "ASGI callable returned without completing response"

    def __init__(self):
        super().__init__()
        self.pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pending and record.getMessage().startswith(self.MESSAGE):
            self.pending -= 1
            return False
        return True


_DROPPED = _DroppedStreams()
logging.getLogger("uvicorn.error").addFilter(_DROPPED)


class _EventStream(Response):
    """text/event-stream over chunked encoding; the stream is cancelled when the client
    disconnects (its generator's `finally` cancels the requests) or stops reading for
    `write_timeout` seconds (a write that cannot go out for that long: the connection is dropped,
    so that clients that never read cannot hold descriptors and buffered output forever)."""

    def __init__(self, gen, write_timeout: float):  # no Response.__init__: it adds Content-Length
        self.status_code, self.background, self.gen = 200, None, gen
        self.write_timeout = write_timeout
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with anyio.create_task_group() as tg:

            async def watch():
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)

            async def write(body: bytes, more: bool) -> bool:
                with anyio.move_on_after(self.write_timeout) as scope:
                    await send({"type": "http.response.body", "body": body, "more_body": more})
                return not scope.cancelled_caught

            try:
                async for chunk in self.gen:
                    if not await write(chunk, True):
                        log.warning(
                            "a stream's client read nothing for %g s: dropping the connection",
                            self.write_timeout,
                        )
                        _DROPPED.pending += 1
                        return  # uvicorn closes a connection whose response was left incomplete
                await write(b"", False)
            finally:
                await self.gen.aclose()
                tg.cancel_scope.cancel()


def _parse(model, raw: bytes):
    from pydantic import ValidationError

    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _from_validation(e.errors(include_url=False)) from None


_UNION_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}


def _field_path(loc) -> list[str]:
    """An error's location without pydantic's union-branch tags ('constrained-str',
    'list[constrained-int]', 'float', a model's class name): the fields and indices a user wrote."""
    out = []
    for x in loc:
        if x == "body":
            continue
        if isinstance(x, str) and (
            x in _UNION_TAGS or "[" in x or "-" in x or (x[:1].isupper() and x.isidentifier())
        ):
            continue
        out.append(str(x))
    return out


def _from_validation(errors) -> ApiError:
    """A 400 naming the field (the top-level one in `param`). A value that matches no branch of a
    union gets one error per branch; the error of the branch that matched furthest is reported
    (a value out of range in a token-id list, not "should be a valid string"), or, where every
    branch rejected the value's type, the types the field takes."""
    if not errors:
        return ApiError(400, "invalid request")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {e.get('msg')}")
    loc = _field_path(e.get("loc", ()))
    if e.get("type") == "model_type" and not loc:
        return ApiError(400, "the request body must be a JSON object")
    top = loc[0] if loc else None
    same = [x for x in errors if (_field_path(x.get("loc", ())) or [None])[0] == top]
    constraint = [x for x in same if not x.get("type", "").endswith("_type")]
    if constraint:  # a constraint, not the type, failed in some branch: the deepest such
        e = max(constraint, key=lambda x: len(x.get("loc", ())))
        msg = e.get("msg")
    else:
        msgs = list(dict.fromkeys(x.get("msg") for x in same))
        msg = " or ".join([msgs[0]] + [m.replace("Input should be ", "") for m in msgs[1:]])
    where = ".".join(_field_path(e.get("loc", ()))) or "body"
    return ApiError(400, f"{where}: {msg}", top)


def _usage(reqs: list[Request], n: int) -> dict:
    # Choices of one prompt (request indices i * n .. i * n + n - 1) share its prompt tokens:
    # counted once, as OpenAI does for n > 1.
    seen, p, cached = set(), 0, 0
    for r in reqs:
        if r.index // n in seen:
            continue
        seen.add(r.index // n)
        p += len(r.prompt_ids)
        cached += r.cached_tokens
    c = sum(r.completion_tokens for r in reqs)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ------------------------------------------------------------------ construction
def build_server(
    model: str | None = None,
    *,
    spec: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_context: int | None = None,
    dtype: str | None = None,
    segment_steps: int = 8,
    segment_ms: float | None = 100.0,
    served_model_name: str | None = None,
    llm=None,
    prefill_chunk: int = 1024,
    prefix_block: int = 256,
    prefix_cache_gb: float | None = None,
    prefix_checkpoints: str = "sparse",
    memory_gb: float | None = None,
    limits: Limits | None = None,
    api_key: str | None = None,
    allow_special_tokens: bool = False,
    backlog: int = 2048,
    max_logprobs: int | None = None,
    slot_group: int | None = None,
    static_greedy: bool | None = None,
) -> OpenAIServer:
    """Load the model (or use `llm`), build the scheduler and the HTTP server (bound, not started).
    See `Scheduler` for the engine arguments and `Limits` for `limits`."""
    from bole_jax.llm import DEFAULT_MODEL_DIR, LLM

    llm = llm or LLM(model, dtype=dtype)
    folder = llm.path
    # A preset's random weights borrow the demo model's tokenizer, and its chat template with it.
    template_folder = folder if folder is not None else getattr(llm.tokenizer, "folder", None)
    sched = Scheduler(
        llm,
        mode=spec,
        max_batch=max_batch,
        max_context=max_context,
        segment_steps=segment_steps,
        segment_ms=segment_ms,
        prefill_chunk=prefill_chunk,
        prefix_block=prefix_block,
        prefix_cache_gb=prefix_cache_gb,
        prefix_checkpoints=prefix_checkpoints,
        memory_gb=memory_gb,
        max_logprobs=max_logprobs,
        slot_group=slot_group,
        static_greedy=static_greedy,
    )
    defaults = {}
    gen_cfg = folder / "generation_config.json" if folder is not None else None
    if gen_cfg is not None and gen_cfg.exists():
        defaults = json.loads(gen_cfg.read_text(encoding="utf-8"))
    if served_model_name is None:
        served_model_name = (
            "bole-jax-demo" if folder is None or folder == DEFAULT_MODEL_DIR else folder.name
        )
    return OpenAIServer(
        sched,
        model_name=served_model_name,
        chat_template=ChatTemplate.from_folder(template_folder, llm.tokenizer),
        host=host,
        port=port,
        generation_defaults=defaults,
        limits=limits,
        api_key=api_key,
        allow_special_tokens=allow_special_tokens,
        backlog=backlog,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> bool:
    """Log a loud warning when `host` is not a loopback address. True when it warned."""
    if _is_loopback(host):
        return False
    log.warning("=" * 72)
    log.warning(
        "binding %s: this server is reachable beyond this machine%s",
        host,
        "" if api_key else " and has NO API KEY (--api-key)",
    )
    log.warning("=" * 72)
    return True


def raise_open_files_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (each connection holds a descriptor).
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft


def _slot_note(s) -> str:
    """MiB per slot for the start-up line; with decode groups the step transient is held once."""
    if s.memory.shared_bytes:
        return (
            f"{s.memory.slot_bytes / 2**20:.1f} MiB/slot + {s.memory.shared_bytes / 2**20:.1f} "
            "MiB for one decode group's step"
        )
    return f"{sum(s.slot_bytes.values()) / 2**20:.1f} MiB/slot"


def _step_note(s) -> str:
    """The slots as re-planned from the compiled decode step, for the ready line."""
    m = s.step_memory or {}
    groups = len(s._group_rows())
    split = f"{groups} decode groups of {s.group_size} rows" if groups > 1 else ""
    if m.get("compiled_temp_bytes") is None:
        return f" ({split})" if split else ""
    note = f" (compiled step: {m['compiled_temp_bytes'] / 2**20:.1f} MiB of temporaries"
    if m["slots"] != m["planned_slots"]:
        note += f"; {m['slots']} slots, not the {m['planned_slots']} estimated"
    return note + (f"; {split})" if split else ")")


def serve(model: str | None = None, **kwargs) -> None:
    """Blocking: `bole-jax serve`. Returns after SIGTERM / SIGINT once running requests are done
    or cut (see `Limits.shutdown_grace_s`)."""
    exposure_warning(kwargs.get("host", "127.0.0.1"), kwargs.get("api_key"))
    raise_open_files_limit()
    server = build_server(model, **kwargs)
    simulate.startup_warning(server.simulated)
    s = server.scheduler
    pc = s.prefix
    prefix = (
        f"prefix cache {pc.budget_bytes / 2**30:.2f} GiB in {pc.block_tokens}-token blocks "
        f"({pc.checkpoints} checkpoints)"
        if pc.enabled
        else "prefix cache off"
    )
    cap = (
        f", memory cap {s.memory.limit_bytes / 2**30:.2f} GiB"
        if s.memory.limit_bytes is not None
        else ""
    )
    print(
        f"bole-jax: serving {server.model_name!r} (mode {s.mode}, {s.num_slots} slots, "
        f"max context {s.max_context}, KV capacity {s.capacity}/slot, "
        f"{_slot_note(s)}, {prefix}, prefill "
        f"{s.prefill_chunk} tokens/iteration{cap}, chat template: {server.chat.kind}) "
        f"on {server.url}; compiling (/health: 503 starting)",
        flush=True,
    )
    table = format_plan_table(s.plans, s.mode)  # every mode in the same memory, this one marked
    print("\n".join("bole-jax: " + line for line in table.splitlines()), flush=True)
    s.progress = lambda line: print(f"bole-jax: compiling {line}", flush=True)
    server.serve_forever(
        on_ready=lambda: print(f"bole-jax: ready on {server.url}{_step_note(s)}", flush=True)
    )
