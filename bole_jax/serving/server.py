"""OpenAI-compatible HTTP server over the continuous-batching `Scheduler` (standard library only).

    bole-jax serve --model DIR [--spec MODE] [--host 127.0.0.1] [--port 8000] [--max-batch N]
                   [--max-context N] [--prefill-chunk N] [--prefix-block N] [--prefix-cache-gb G]
                   [--memory-gb G]

Endpoints: POST /v1/completions, POST /v1/chat/completions (`stream: true` -> server-sent events,
`data: {...}` chunks then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus
text). See docs/serving.md for the supported request fields.

Threads: `ThreadingHTTPServer` runs one thread per connection; those threads only parse, tokenise,
render chat templates and wait on their request's event queue. The engine thread (`Scheduler`)
owns the device. A client that disconnects (a failed write, or a closed socket noticed while
waiting) has its requests cancelled, which frees their slots.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bole_jax.serving.scheduler import Delta, Request, RequestError, RequestParams, Scheduler
from bole_jax.spec_decode.budget import device_name

log = logging.getLogger("bole_jax.serving")

MAX_BODY_BYTES = 32 * 2**20
POLL_S = 0.25  # how often a waiting handler checks that its client is still connected

_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


class ApiError(Exception):
  """An error answered as JSON in the OpenAI shape: {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, type_: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


# ------------------------------------------------------------------ chat template
class ChatTemplate:
  """Renders chat messages to a prompt string.

  Uses the model folder's tokenizer_config.json "chat_template" (Jinja, rendered in a sandbox as
  transformers does) when jinja2 is importable, else ChatML. `stop_token_ids`: tokens that end an
  assistant turn (the config's eos_token and the usual turn-end tokens present in the vocab); chat
  requests stop on them even when the model's EOS differs.
  """

  def __init__(self, source: str | None, tokenizer, bos_token: str = "", eos_token: str = ""):
    self.source = source
    self.bos_token, self.eos_token = bos_token, eos_token
    self._template = None
    if source is not None:
      try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
      except ImportError:
        log.warning("jinja2 is not installed: chat prompts use ChatML instead of the model's "
                    "chat template (pip install jinja2)")
      else:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self._template = env.from_string(source)
    ids = set()
    for tok in (eos_token, *_TURN_END_TOKENS):
      i = tokenizer.token_to_id(tok) if (tok and tokenizer is not None) else None
      if i is not None:
        ids.add(int(i))
    self.stop_token_ids = tuple(sorted(ids))

  @property
  def kind(self) -> str:
    return "model" if self._template is not None else "chatml"

  @classmethod
  def from_folder(cls, folder: Path | None, tokenizer) -> "ChatTemplate":
    source, bos, eos = None, "", ""
    cfg_path = folder / "tokenizer_config.json" if folder is not None else None
    if cfg_path is not None and cfg_path.exists():
      cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
      source = cfg.get("chat_template")
      if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
      bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    jinja_file = folder / "chat_template.jinja" if folder is not None else None
    if source is None and jinja_file is not None and jinja_file.exists():
      source = jinja_file.read_text(encoding="utf-8")
    return cls(source if isinstance(source, str) else None, tokenizer, bos, eos)

  def render(self, messages: list[dict]) -> str:
    if self._template is None:
      return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                     for m in messages) + "<|im_start|>assistant\n"
    from jinja2 import TemplateError

    try:
      return self._template.render(messages=messages, add_generation_prompt=True,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
    except TemplateError as e:
      raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None


def _token_text(tok) -> str:
  if isinstance(tok, dict):
    tok = tok.get("content")
  return tok if isinstance(tok, str) else ""


def _tojson(x, indent=None, ensure_ascii=False):
  return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)


def _raise_template_error(message):
  from jinja2 import TemplateError

  raise TemplateError(message)


# ------------------------------------------------------------------ request parsing
def _field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
  """body[name] checked against JSON types `kinds` (bool never counts as a number)."""
  v = body.get(name, default)
  if v is None:
    return default
  ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
  if float in kinds and isinstance(v, int) and not isinstance(v, bool):
    ok = True
  if not ok:
    names = "/".join({str: "string", int: "integer", float: "number", bool: "boolean",
                      list: "array", dict: "object"}[k] for k in kinds)
    raise ApiError(400, f"'{name}' must be a {names}, got {json.dumps(v)[:80]}", name)
  return v


def _stop_strings(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise ApiError(400, "'stop' must be a non-empty string or an array of non-empty strings",
                   "stop")
  return tuple(stop)


def _reject_unsupported(body: dict) -> None:
  n = _field(body, "n", (int,), 1)
  if n != 1:
    raise ApiError(400, f"only n=1 is supported, got n={n}", "n")
  if _field(body, "best_of", (int,), 1) != 1:
    raise ApiError(400, "best_of is not supported", "best_of")
  if body.get("echo"):
    raise ApiError(400, "echo is not supported", "echo")
  if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
    raise ApiError(400, "logprobs are not supported", "logprobs")
  if body.get("suffix") is not None:
    raise ApiError(400, "suffix is not supported", "suffix")
  for pen in ("presence_penalty", "frequency_penalty"):
    if _field(body, pen, (float,), 0.0) != 0.0:
      raise ApiError(400, f"{pen} is not supported (only 0)", pen)
  if body.get("logit_bias"):
    raise ApiError(400, "logit_bias is not supported", "logit_bias")
  if body.get("tools"):
    raise ApiError(400, "tools / function calling are not supported", "tools")
  rf = body.get("response_format")
  if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
    raise ApiError(400, "only response_format {'type': 'text'} is supported", "response_format")


# ------------------------------------------------------------------ the server
class OpenAIServer:
  """The HTTP front end of a `Scheduler`.

  Args:
    scheduler: the engine (started by `start()`).
    model_name: the id clients use in "model" (requests naming another model get 404).
    chat_template: a `ChatTemplate` (default: ChatML).
    generation_defaults: temperature / top_p / top_k used when a request omits them
      (default: OpenAI's, temperature 1 and top_p 1).
  """

  def __init__(self, scheduler: Scheduler, *, model_name: str = "bole-jax",
               chat_template: ChatTemplate | None = None, host: str = "127.0.0.1",
               port: int = 8000, generation_defaults: dict | None = None):
    self.scheduler = scheduler
    self.tokenizer = scheduler.tokenizer
    if self.tokenizer is None:
      raise ValueError("the model folder has no tokenizer.json: the server needs one")
    self.model_name = model_name
    self.chat = chat_template or ChatTemplate(None, self.tokenizer)
    self.defaults = dict(temperature=1.0, top_p=1.0, top_k=0)
    self.defaults.update({k: v for k, v in (generation_defaults or {}).items()
                          if k in self.defaults and v is not None})
    self.created = int(time.time())
    self.http_counts: collections.Counter = collections.Counter()
    self._lock = threading.Lock()
    handler = type("Handler", (_Handler,), {"app": self})
    self.httpd = ThreadingHTTPServer((host, port), handler)
    self.httpd.daemon_threads = True
    self._thread: threading.Thread | None = None

  @property
  def host(self) -> str:
    return self.httpd.server_address[0]

  @property
  def port(self) -> int:
    return self.httpd.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self) -> "OpenAIServer":
    """Start the engine and serve HTTP on a background thread."""
    self.scheduler.start()
    self._start_http()
    return self

  def _start_http(self) -> None:
    self._thread = threading.Thread(target=self.httpd.serve_forever, name="bole-http",
                                    daemon=True)
    self._thread.start()

  def serve_forever(self, on_ready=None) -> None:
    """Serve HTTP at once (/health answers 503 "starting" while the engine compiles), start the
    engine, call `on_ready()`, and block until KeyboardInterrupt."""
    self._start_http()
    try:
      self.scheduler.start()
      if on_ready is not None:
        on_ready()
      while self._thread.is_alive():
        self._thread.join(0.5)
    except KeyboardInterrupt:
      pass
    finally:
      self.shutdown()

  def shutdown(self) -> None:
    if self._thread is not None:
      self.httpd.shutdown()
      self._thread.join()
      self._thread = None
    self.httpd.server_close()
    self.scheduler.stop()

  # ---------------------------------------------------------------- request building
  def check_model(self, body: dict) -> None:
    name = _field(body, "model", (str,))
    if name is not None and name != self.model_name:
      raise ApiError(404, f"the model {name!r} does not exist: this server serves "
                     f"{self.model_name!r}", "model", "model_not_found")

  def sampling(self, body: dict, max_tokens_key: str, prompt_len: int,
               stop_token_ids: tuple[int, ...] = ()) -> RequestParams:
    d = self.defaults
    top_k = _field(body, "top_k", (int,), d["top_k"])
    max_tokens = _field(body, max_tokens_key, (int,))
    if max_tokens is None:  # like vLLM: the rest of the context
      max_tokens = max(self.scheduler.max_context - prompt_len, 1)
    return RequestParams(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (float,), d["temperature"])),
        top_p=float(_field(body, "top_p", (float,), d["top_p"])),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        seed=_field(body, "seed", (int,), 0) & 0xFFFFFFFF,
        stop=_stop_strings(body),
        stop_token_ids=tuple(stop_token_ids) + tuple(_token_ids(body, "stop_token_ids") or ()))

  def completion_prompts(self, body: dict) -> list[list[int]]:
    if "prompt" not in body:
      raise ApiError(400, "missing required field 'prompt'", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
      items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in p):
      items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
      items = p
    else:
      raise ApiError(400, "'prompt' must be a string, an array of strings, an array of token ids "
                     "or an array of token-id arrays (non-empty)", "prompt")
    out = []
    for x in items:
      if isinstance(x, str):
        out.append(self.tokenizer.encode(x))
      elif all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        out.append(list(x))
      else:
        raise ApiError(400, "token-id prompts must be arrays of integers", "prompt")
    return out

  def chat_prompt(self, body: dict) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
      raise ApiError(400, "'messages' must be a non-empty array of {role, content} objects",
                     "messages")
    norm = []
    for i, m in enumerate(msgs):
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
      c = m.get("content")
      if isinstance(c, list):
        if not all(isinstance(part, dict) and part.get("type") == "text"
                   and isinstance(part.get("text"), str) for part in c):
          raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                         "messages")
        c = "".join(part["text"] for part in c)
      elif c is None:
        c = ""
      elif not isinstance(c, str):
        raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                       "messages")
      norm.append({**m, "content": c})
    return self.tokenizer.encode(self.chat.render(norm))

  def submit_all(self, prompts: list[list[int]], params: RequestParams,
                 events: queue.Queue) -> list[Request]:
    reqs: list[Request] = []
    try:
      for i, ids in enumerate(prompts):
        reqs.append(self.scheduler.submit(ids, params, events=events, index=i))
    except RequestError as e:
      for r in reqs:
        r.cancel()
      raise ApiError(400, str(e), e.param, e.code) from None
    except OverflowError as e:
      for r in reqs:
        r.cancel()
      raise ApiError(503, str(e), code="overloaded") from None
    except RuntimeError as e:
      raise ApiError(503, str(e), code="engine_stopped") from None
    return reqs

  def render_metrics(self) -> str:
    lines = ["# HELP bole_http_requests_total HTTP requests by path and status.",
             "# TYPE bole_http_requests_total counter"]
    with self._lock:
      for (path, status), n in sorted(self.http_counts.items()):
        lines.append(f'bole_http_requests_total{{path="{path}",status="{status}"}} {n}')
    return self.scheduler.render_prometheus() + "\n".join(lines) + "\n"


def _token_ids(body: dict, name: str) -> list[int] | None:
  v = body.get(name)
  if v is None:
    return None
  if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
    raise ApiError(400, f"'{name}' must be an array of integers", name)
  return v


class _Handler(BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server_version = "bole-jax"
  app: OpenAIServer

  def log_message(self, fmt, *args):
    log.debug("%s - " + fmt, self.address_string(), *args)

  # ---------------------------------------------------------------- plumbing
  def _count(self, status: int) -> None:
    path = self.path.split("?")[0]
    if path not in ("/health", "/metrics", "/v1/models", "/v1/completions",
                    "/v1/chat/completions"):
      path = "other"
    with self.app._lock:
      self.app.http_counts[(path, status)] += 1

  def _send(self, status: int, payload: bytes, ctype: str) -> None:
    self._count(status)
    self.send_response(status)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(payload)))
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    self.wfile.write(payload)

  def _json(self, status: int, obj: Any) -> None:
    self._send(status, json.dumps(obj).encode(), "application/json")

  def _error(self, e: ApiError) -> None:
    self._json(e.status, e.body())

  def _body(self) -> dict:
    n = self.headers.get("Content-Length")
    if n is None:
      self.close_connection = True
      raise ApiError(411, "a Content-Length header is required")
    try:
      n = int(n)
    except ValueError:
      self.close_connection = True
      raise ApiError(400, "bad Content-Length header") from None
    if n > MAX_BODY_BYTES:
      self.close_connection = True
      raise ApiError(413, f"request body too large ({n} bytes > {MAX_BODY_BYTES})")
    raw = self.rfile.read(n)
    self._body_read = True
    try:
      body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    return body

  def _client_gone(self) -> bool:
    """True when the peer closed the connection (readable with nothing to read)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
      return True

  def _wait(self, events: queue.Queue, reqs: list[Request]) -> Delta | None:
    """The next event, or None when the client went away (its requests are then cancelled).

    The socket is checked at most every POLL_S seconds, whether or not events keep coming."""
    while True:
      now = time.monotonic()
      if now - getattr(self, "_checked", 0.0) >= POLL_S:
        self._checked = now
        if self._client_gone():
          for r in reqs:
            r.cancel()
          return None
      try:
        return events.get(timeout=POLL_S)
      except queue.Empty:
        pass

  # ---------------------------------------------------------------- routes
  def do_GET(self):
    path = self.path.split("?")[0]
    app = self.app
    if path == "/health":
      sched = app.scheduler
      ok = sched.error is None and sched._thread is not None and sched._thread.is_alive()
      if not ok and sched.error is None and sched.warming_up:
        self._json(503, {"status": "starting", "error": None})
      else:
        self._json(200 if ok else 503, {"status": "ok" if ok else "error", "error": sched.error})
    elif path == "/metrics":
      self._send(200, app.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
    elif path == "/v1/models":
      self._json(200, {"object": "list", "data": [self._model_card()]})
    elif path == f"/v1/models/{app.model_name}":
      self._json(200, self._model_card())
    elif path in ("/v1/completions", "/v1/chat/completions"):
      self._error(ApiError(405, f"use POST for {path}"))
    else:
      self._error(ApiError(404, f"no route {path}"))

  def _model_card(self) -> dict:
    s = self.app.scheduler
    return {"id": self.app.model_name, "object": "model", "created": self.app.created,
            "owned_by": "bole-jax", "max_model_len": s.max_context, "spec_mode": s.mode,
            "device": device_name(), "tensor_parallel": s.llm.cfg.tp}

  def do_POST(self):
    path = self.path.split("?")[0]
    self._body_read = False
    try:
      if path not in ("/v1/completions", "/v1/chat/completions"):
        raise ApiError(404, f"no route {path}")
      body = self._body()
      self.app.check_model(body)
      _reject_unsupported(body)
      if path == "/v1/completions":
        self._completions(body)
      else:
        self._chat(body)
    except ApiError as e:
      if not self._body_read:  # the unread body would be parsed as the next request
        self.close_connection = True
      self._error(e)
    except (BrokenPipeError, ConnectionResetError):
      self.close_connection = True
    except Exception as e:  # keep serving: answer 500 and log
      log.exception("internal error")
      try:
        self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
      except OSError:
        self.close_connection = True

  # ---------------------------------------------------------------- OpenAI endpoints
  def _stream_opts(self, body: dict) -> tuple[bool, bool]:
    stream = bool(_field(body, "stream", (bool,), False))
    opts = _field(body, "stream_options", (dict,), {})
    return stream, bool(opts.get("include_usage", False))

  def _completions(self, body: dict) -> None:
    app = self.app
    stream, include_usage = self._stream_opts(body)
    prompts = app.completion_prompts(body)
    params = app.sampling(body, "max_tokens", max(len(p) for p in prompts))
    events: queue.Queue = queue.Queue()
    reqs = app.submit_all(prompts, params, events)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": app.model_name}

    def choice(d: Delta) -> dict:
      return {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}

    if stream:
      self._sse(reqs, events, lambda d: [{**head, "choices": [choice(d)]}], head, include_usage)
      return
    if not self._collect(reqs, events):
      return
    choices = [{"index": r.index, "text": r.text, "logprobs": None,
                "finish_reason": r.finish_reason} for r in reqs]
    self._json(200, {**head, "choices": choices, "usage": _usage(reqs)})

  def _chat(self, body: dict) -> None:
    app = self.app
    stream, include_usage = self._stream_opts(body)
    ids = app.chat_prompt(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = app.sampling(body, key, len(ids), app.chat.stop_token_ids)
    events: queue.Queue = queue.Queue()
    reqs = app.submit_all([ids], params, events)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": app.model_name}

    def chunks(d: Delta) -> list[dict]:
      out = []
      if d.text:
        out.append({**head, "choices": [{"index": d.index, "delta": {"content": d.text},
                                         "logprobs": None, "finish_reason": None}]})
      if d.finish_reason is not None:
        out.append({**head, "choices": [{"index": d.index, "delta": {}, "logprobs": None,
                                         "finish_reason": d.finish_reason}]})
      return out

    if stream:
      first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
      self._sse(reqs, events, chunks, head, include_usage, first=first)
      return
    if not self._collect(reqs, events):
      return
    r = reqs[0]
    self._json(200, {**head, "object": "chat.completion",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                                  "logprobs": None, "finish_reason": r.finish_reason}],
                     "usage": _usage(reqs)})

  def _collect(self, reqs: list[Request], events: queue.Queue) -> bool:
    """Wait for all requests (non-streaming). False when the client left (nothing to answer)."""
    left = len(reqs)
    while left:
      d = self._wait(events, reqs)
      if d is None:
        self.close_connection = True
        return False
      if d.finish_reason is not None:
        left -= 1
        if d.finish_reason == "error":
          for r in reqs:
            r.cancel()
          raise ApiError(500, f"generation failed: {d.error}", code="engine_error")
    return True

  def _sse(self, reqs, events, make_chunks, head, include_usage, first=None) -> None:
    """Stream `data: {chunk}` events until every request finished, then `data: [DONE]`."""
    self._count(200)
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream; charset=utf-8")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Connection", "close")
    self.end_headers()
    self.close_connection = True

    def write(obj) -> None:
      data = obj if isinstance(obj, str) else json.dumps(obj)
      self.wfile.write(f"data: {data}\n\n".encode())
      self.wfile.flush()

    left = len(reqs)
    try:
      if first is not None:
        write(first)
      while left:
        d = self._wait(events, reqs)
        if d is None:
          return
        if d.finish_reason == "error":
          write(ApiError(500, f"generation failed: {d.error}", code="engine_error").body())
          for r in reqs:
            r.cancel()
          break
        if d.finish_reason is not None:
          left -= 1
        for c in make_chunks(d):
          write(c)
      if include_usage:
        write({**head, "choices": [], "usage": _usage(reqs)})
      write("[DONE]")
    except (BrokenPipeError, ConnectionResetError, OSError):
      for r in reqs:
        r.cancel()


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a valid JSON number")


def _usage(reqs: list[Request]) -> dict:
  p = sum(len(r.prompt_ids) for r in reqs)
  c = sum(r.completion_tokens for r in reqs)
  return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
          "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in reqs)}}


# ------------------------------------------------------------------ construction
def build_server(model: str | None = None, *, spec: str | None = None, host: str = "127.0.0.1",
                 port: int = 8000, max_batch: int = 8, max_context: int | None = None,
                 dtype: str | None = None, segment_steps: int = 8,
                 served_model_name: str | None = None, llm=None, prefill_chunk: int = 1024,
                 prefix_block: int = 256, prefix_cache_gb: float | None = None,
                 memory_gb: float | None = None) -> OpenAIServer:
  """Load the model (or use `llm`), build the scheduler and the HTTP server (not started).
  See `Scheduler` for prefill_chunk, prefix_block, prefix_cache_gb and memory_gb."""
  from bole_jax.llm import DEFAULT_MODEL_DIR, LLM

  llm = llm or LLM(model, dtype=dtype)
  folder = llm.path
  sched = Scheduler(llm, mode=spec, max_batch=max_batch, max_context=max_context,
                    segment_steps=segment_steps, prefill_chunk=prefill_chunk,
                    prefix_block=prefix_block, prefix_cache_gb=prefix_cache_gb,
                    memory_gb=memory_gb)
  defaults = {}
  gen_cfg = folder / "generation_config.json" if folder is not None else None
  if gen_cfg is not None and gen_cfg.exists():
    defaults = json.loads(gen_cfg.read_text(encoding="utf-8"))
  if served_model_name is None:
    served_model_name = ("bole-jax-demo" if folder is None or folder == DEFAULT_MODEL_DIR
                         else folder.name)
  return OpenAIServer(sched, model_name=served_model_name,
                      chat_template=ChatTemplate.from_folder(folder, llm.tokenizer), host=host,
                      port=port, generation_defaults=defaults)


def serve(model: str | None = None, **kwargs) -> None:
  """Blocking: `bole-jax serve`."""
  server = build_server(model, **kwargs)
  s = server.scheduler
  pc = s.prefix
  prefix = (f"prefix cache {pc.budget_bytes / 2**30:.2f} GiB in {pc.block_tokens}-token blocks"
            if pc.enabled else "prefix cache off")
  cap = (f", memory cap {s.memory.limit_bytes / 2**30:.2f} GiB"
         if s.memory.limit_bytes is not None else "")
  print(f"bole-jax: serving {server.model_name!r} (mode {s.mode}, {s.num_slots} slots, "
        f"max context {s.max_context}, KV capacity {s.capacity}/slot, "
        f"{sum(s.slot_bytes.values()) / 2**20:.1f} MiB/slot, {prefix}, prefill "
        f"{s.prefill_chunk} tokens/iteration{cap}, chat template: {server.chat.kind}) "
        f"on {server.url}; compiling (/health: 503 starting)", flush=True)
  server.serve_forever(on_ready=lambda: print(f"bole-jax: ready on {server.url}", flush=True))
