"""Request types of the serving engine: parameters, the streamed events, and the request a client
holds (iterate, wait, cancel) while the engine thread feeds it tokens."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from typing import Iterator

from bole_jax.serving.text import IncrementalDetokenizer, StopMatcher


class RequestError(ValueError):
    """A request the client got wrong (HTTP 400). `param`/`code` follow the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclasses.dataclass
class Delta:
    """One streamed event of a request: new text (may be empty) and, on the last, finish_reason.

    finish_reason: None while running, then "stop" (EOS, stop string or stop token), "length"
    (max_tokens), "cancelled" or "error" (`error` holds the message).
    logprobs: with RequestParams.logprobs, the `TokenLogprob`s of the tokens generated since the
    previous delta (a token's text may come in a later delta than its entry).
    """

    index: int  # which prompt of its HTTP request (several prompts can share one event queue)
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's target log-probability and the `top` most likely tokens there
    ((token id, log-probability) pairs, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class RequestParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # record TokenLogprobs with this many top tokens (None: off)


class Request:
    """A submitted request: iterate it for `Delta`s, `result()` to wait, `cancel()` to abort.

    Timing fields (time.perf_counter seconds): t_submit, t_first (first token on the host), t_end.
    Prefill progress: `cached_tokens` (prompt tokens restored from the prefix cache), `prefilled`
    (prompt tokens in its cache so far, cached ones included; len(prompt_ids) once it decodes).
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: RequestParams,
        tokenizer,
        *,
        events: queue.Queue | None = None,
        index: int = 0,
        request_id: str | None = None,
        internal: bool = False,
        inbox: queue.Queue | None = None,
    ):
        self.id = request_id or uuid.uuid4().hex
        self.internal = internal  # engine-made (warm-up, dummy rows): kept out of the metrics
        self.prompt_ids = prompt_ids
        self.params = params
        self.index = index
        self.events = events if events is not None else queue.Queue()
        self.token_ids: list[int] = []  # tokens of the completion (stop token / string excluded)
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.steps = 0  # decode steps the request was in a running slot
        self.cached_tokens = 0
        self.prefilled = 0
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(params.stop)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._unsent_logprobs: list[TokenLogprob] = []
        self.first_logprob: TokenLogprob | None = None  # set by the engine with the first token
        self._finished = threading.Event()
        self.cancelled = False
        self._inbox = inbox  # the engine's, to wake it on cancel()

    # ---- client side
    def cancel(self) -> None:
        """Ask the engine to drop this request (its slot is freed before the next segment)."""
        self.cancelled = True
        if self._inbox is not None:
            self._inbox.put(("cancel", self))

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def __iter__(self) -> Iterator[Delta]:
        """The request's deltas until the last one (only when this request owns its event queue)."""
        while True:
            d = self.events.get()
            yield d
            if d.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> "Request":
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    # ---- engine side
    def _consume(self, tok: int, eos: frozenset, lp: TokenLogprob | None = None) -> str | None:
        """Account one generated token; returns a finish reason when it ends the request."""
        p = self.params
        if tok in p.stop_token_ids:
            return "stop"
        self.token_ids.append(tok)
        if self.logprobs is not None and lp is not None:
            lp = dataclasses.replace(lp, top=lp.top[: p.logprobs])
            self.logprobs.append(lp)
            self._unsent_logprobs.append(lp)
        piece = self._detok.push(tok)
        if piece:
            out, stopped = self._stops.push(piece)
            self._send(out)
            if stopped:
                return "stop"
        if tok in eos:
            return "stop"
        if len(self.token_ids) >= p.max_tokens:
            return "length"
        return None

    def _send(self, text: str) -> None:
        if text:
            self.text += text
            self.events.put(Delta(self.index, text, logprobs=self._take_logprobs()))

    def _take_logprobs(self) -> list | None:
        if self.logprobs is None:
            return None
        out, self._unsent_logprobs = self._unsent_logprobs, []
        return out

    def _finish(self, reason: str, error: str | None = None) -> bool:
        """Send the last delta; False when the request had already finished."""
        if self._finished.is_set():
            return False
        tail = ""
        if reason in ("length", "stop") and error is None:
            out, stopped = self._stops.push(self._detok.flush())
            tail = out if stopped else out + self._stops.flush()
            self.text += tail
        self.finish_reason, self.error = reason, error
        self.t_end = time.perf_counter()
        self.events.put(Delta(self.index, tail, reason, error, self._take_logprobs()))
        self._finished.set()
        return True
