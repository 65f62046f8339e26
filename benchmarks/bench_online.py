"""Online agent-replay benchmark: TTFT / TPOT / latency under Poisson load, per decoding mode.

    python benchmarks/bench_online.py --quick                       # CPU smoke run, demo model
    python benchmarks/bench_online.py --model DIR --modes bole pernode ar --rates 0.5 1 2 4 \
        --duration 180 --server-arg=--max-batch=64 --out benchmarks/results/online_h200
    python benchmarks/bench_online.py --url http://127.0.0.1:8000 --rates 1 2   # a running server
    python benchmarks/bench_online.py --modes pernode --merge ...   # add a mode to an earlier run
    python benchmarks/bench_online.py --model DIR --server-arg=--memory-gb=4 \
        --mode-server-arg='pernode=--tree-nodes 64'   # SGLang-style fixed trees for pernode only
    python benchmarks/bench_online.py --preset qwen3.5-27b --simulate-accept-mean 3.5 ...
        # random weights at 27B dims, simulated acceptance (docs/serving.md; outputs meaningless)

Workload: benchmarks/data/agent_sessions.jsonl (see build_agent_sessions.py): BFCL multi-turn
tool-use sessions (a long system prompt with tool descriptions shared by every call of a
session and by all sessions with the same tools, tool outputs, many calls) and Spec-Bench
two-turn chats.

Method:
- Per mode, `python -m bole_jax serve --spec MODE [--model DIR | --preset NAME]
  [--simulate-accept-mean X] [--server-arg ...] [that mode's --mode-server-arg ...]` runs as a
  subprocess (log in OUT/server_<tag>_<mode>.log; mode `engine`: no --spec, the server's own
  choice); /health is awaited, a few requests of growing prompt length warm up the prefill
  shapes, then every rate is replayed on that server, lowest first.
- Sessions arrive as a Poisson process at RATE sessions/s for --duration seconds (at most
  --max-sessions). Inside a session the agent waits for its model: each LLM call is sent when
  the previous one has finished (plus --think-time). A call is a streaming chat completion whose
  messages are the whole history so far, so a prefix cache can serve all but the newest part.
  Recorded assistant messages (tool calls) enter the history whatever the model generated (the
  tool outputs after them stay true); the others keep the generated text. Greedy by default, so
  the replay is the same in every lossless mode (up to low-precision near-ties). A call over the server's context limit ends its
  session (counted in `ctx_end`); a call still streaming 5 s after the drain window is cut by the
  replay (counted in `cut`, not in `errors`). Each rate replays its own slice of the (seeded)
  session order;
  all modes see the same sessions at the same arrival times. The server, and its prefix cache,
  stays warm from one rate to the next (the same for every mode).
- TTFT: sent -> first content delta; TPOT: (last delta - first delta) / (completion_tokens - 1);
  latency: sent -> end of stream. p50 / p90 / p99 over the calls of a (mode, rate). Output
  throughput: completion tokens / wall time of the rate. Prefix-cache hit rate: sum of
  usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens (when the server reports it);
  server metrics whose name contains "prefix" are kept as deltas. Accepted length: tokens per
  decode step per active request, from /metrics counters (bole_decode_tokens_total /
  bole_decode_slot_steps_total; 1 for ar).
Prints one table (a row per mode and rate) and bole's change vs pernode and ar, writes
OUT/online_<tag>.json (command, git commit, device, jax version, server commands, every call)
and OUT/online_<tag>.png (TTFT / TPOT / throughput vs rate per mode). With --merge, the modes
can be run in separate invocations (e.g. one per time-limited GPU command) into one result.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

# The server subprocess gets the caller's environment; this process only does HTTP and must never
# initialise a GPU backend (JAX would take 75% of the device memory from the server).
_CHILD_ENV = dict(os.environ)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bole_jax.measure import bench  # noqa: E402  (tables, JSON; importing it initialises no backend)

DEFAULT_SESSIONS = os.path.join(HERE, "data", "agent_sessions.jsonl")
MODES = ("bole", "pernode", "chain", "ar", "engine")
# "engine": a server started without --spec, which decodes what its calibration table chooses at
# --max-batch and --max-context (`--server-arg=--calibration=TABLE`; on an accelerator without a
# table it calibrates on first use, on CPU it decodes ar); the mode it chose is recorded from its
# /v1/models card (`spec_mode`).
PCTS = (50, 90, 99)
QUICK = dict(
    rates=[0.5, 2.0],
    duration=8.0,
    max_sessions=3,
    max_calls=3,
    max_tokens=16,
    tool_docs="compact",
    warmup=3,
    server_args=["--max-batch 4 --max-context 3968"],
    progress_interval=10.0,
    drain_timeout=600.0,
)


# ============================================================================ sessions
@dataclasses.dataclass
class Session:
    """One replayable conversation. messages: [{role, content}], content None on assistant
    messages without a recorded answer (the generated text is kept instead)."""

    id: str
    source: str
    system: str
    messages: list[dict]

    @property
    def num_calls(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


def render_tools(functions: list[dict], fmt: str) -> str:
    """Tool descriptions for the system prompt: "json" (one JSON object per line, as BFCL's prompt
    has them) or "compact" (one signature line per function, for short-context models)."""
    if fmt == "json":
        return "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    if fmt != "compact":
        raise ValueError(f"unknown tool format {fmt!r}: expected 'json' or 'compact'")
    lines = []
    for f in functions:
        props = (f.get("parameters") or {}).get("properties", {})
        required = set((f.get("parameters") or {}).get("required", []))
        args = ", ".join(
            f"{k}: {v.get('type', 'any')}" + ("" if k in required else " = ...")
            for k, v in props.items()
        )
        desc = f.get("description", "").split("Tool description:")[-1].strip()
        lines.append(f"- {f['name']}({args}): {desc}")
    return "\n".join(lines)


def load_sessions(
    path: str = DEFAULT_SESSIONS, *, sources: tuple[str, ...] | None = None, tool_docs: str = "json"
) -> list[Session]:
    """Sessions of an agent_sessions.jsonl file, system prompts rendered with their tools."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no session file {path}: run benchmarks/build_agent_sessions.py")
    tools: dict[str, list[dict]] = {}
    raw = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("type")
            if kind == "tools":
                tools[rec["name"]] = rec["functions"]
            elif kind == "session":
                raw.append(rec)
            elif kind != "meta":
                raise ValueError(f"{path}:{n}: unknown record type {kind!r}")
    out = []
    for rec in raw:
        if sources and rec["id"].split("/")[0] not in sources:
            continue
        missing = [c for c in rec["tools"] if c not in tools]
        if missing:
            raise ValueError(f"{path}: session {rec['id']} uses undescribed tools {missing}")
        excluded = set(rec.get("exclude", []))
        funcs = [f for c in rec["tools"] for f in tools[c] if f["name"] not in excluded]
        system = rec["system"] + ("\n" + render_tools(funcs, tool_docs) if funcs else "")
        out.append(Session(rec["id"], rec["source"], system, rec["messages"]))
    if not out:
        raise ValueError(f"{path}: no sessions (sources {sources})")
    return out


def arrival_times(
    rate: float, duration: float, max_sessions: int | None, rng: np.random.Generator
) -> list[float]:
    """Poisson arrivals (exponential gaps, mean 1/rate) in [0, duration), at most max_sessions."""
    if rate <= 0:
        raise ValueError(f"rates must be > 0 sessions/s, got {rate}")
    times, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration or (max_sessions is not None and len(times) >= max_sessions):
            return times
        times.append(t)


# ============================================================================ statistics
def percentiles(values, pcts=PCTS) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of the non-None values (None if empty);
    linear interpolation between order statistics (numpy's default)."""
    a = np.asarray([v for v in values if v is not None], np.float64)
    if a.size == 0:
        return {**{f"p{p}": None for p in pcts}, "mean": None}
    return {**{f"p{p}": float(np.percentile(a, p)) for p in pcts}, "mean": float(a.mean())}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summarize(calls: list[dict], wall_s: float, deltas: dict[str, float] | None = None) -> dict:
    """One row of the results table from the calls of one (mode, rate)."""
    ok = [c for c in calls if c["error"] is None]
    prompt = sum(c["prompt_tokens"] or 0 for c in ok)
    reported = [c for c in ok if c["cached_tokens"] is not None]
    row = dict(
        calls=len(calls),
        ok=len(ok),
        errors=sum(c["error"] is not None and c["status"] not in ("context", "cut") for c in calls),
        cut=sum(c["status"] == "cut" for c in calls),
        ctx_end=sum(c["status"] == "context" for c in calls),
        wall_s=wall_s,
        req_per_s=len(ok) / wall_s if wall_s > 0 else None,
        out_tok_per_s=sum(c["completion_tokens"] or 0 for c in ok) / wall_s if wall_s > 0 else None,
        prompt_tokens_mean=prompt / len(ok) if ok else None,
        completion_tokens_mean=float(np.mean([c["completion_tokens"] or 0 for c in ok]))
        if ok
        else None,
        prefix_hit_rate=(
            sum(c["cached_tokens"] for c in reported)
            / max(sum(c["prompt_tokens"] or 0 for c in reported), 1)
        )
        if reported
        else None,
    )
    for name in ("ttft", "tpot", "latency"):
        for k, v in percentiles([c[name] for c in ok]).items():
            row[f"{name}_{k}"] = v
    deltas = deltas or {}
    steps = deltas.get("bole_decode_slot_steps_total", 0.0)
    row["tokens_per_step"] = (
        deltas.get("bole_decode_tokens_total", 0.0) / steps if steps > 0 else None
    )
    # Server side (docs/serving.md names): cached / looked-up prompt tokens, in token units.
    q = deltas.get("bole_prefix_cache_query_tokens_total", 0.0)
    row["server_prefix_hit_rate"] = (
        deltas.get("bole_prefix_cache_cached_tokens_total", 0.0) / q if q > 0 else None
    )
    row["server_prefix_metrics"] = {k: v for k, v in deltas.items() if "prefix" in k} or None
    return row


def reductions(rows: list[dict], base: str, mode: str = "bole") -> list[dict]:
    """Per rate: mode / base - 1 for TTFT and TPOT p50 / p90 / p99 (negative = `mode` is faster;
    the paper reports TTFT -67.6%, TPOT -49.9% vs the tree baseline)."""
    out = []
    by = {(r["mode"], r["rate"]): r for r in rows}
    for (m, rate), r in sorted(by.items(), key=lambda x: x[0][1]):
        b = by.get((base, rate))
        if m != mode or b is None:
            continue
        red = dict(mode=mode, rate=rate, vs=base)
        for name in ("ttft", "tpot"):
            for p in PCTS:
                x, y = r[f"{name}_p{p}"], b[f"{name}_p{p}"]
                red[f"{name}_p{p}"] = (x / y - 1.0) if (x is not None and y) else None
        out.append(red)
    return out


# ============================================================================ HTTP client
def _split_url(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"--url must look like http://HOST:PORT, got {url!r}")
    return u.hostname, u.port or 80


def http_json(url: str, path: str, timeout: float = 10.0) -> tuple[int, Any]:
    host, port = _split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(body) if "json" in ctype else body
    finally:
        conn.close()


def scrape_metrics(url: str) -> dict[str, float]:
    try:
        status, text = http_json(url, "/metrics")
    except OSError:
        return {}
    return parse_prometheus(text) if status == 200 and isinstance(text, str) else {}


class Connections:
    """The sockets of open streaming calls, so that a deadline or Ctrl-C can cut them (which also
    makes the server cancel their requests). Sockets, not connections: http.client drops a
    connection's socket once a response says `Connection: close`, and the response reads on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: set = set()

    def add(self, sock) -> None:
        with self._lock:
            self._open.add(sock)

    def discard(self, sock) -> None:
        with self._lock:
            self._open.discard(sock)

    def close_all(self) -> None:
        with self._lock:
            socks = list(self._open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _sse_events(resp) -> Iterator[str]:
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip().decode("utf-8")


def chat_stream(url: str, body: dict, timeout: float, conns: Connections | None = None) -> dict:
    """One streaming chat completion. Returns timings (seconds, perf_counter), text, usage and
    status: "ok", "context" (over the server's context limit), "http" or "error" (the replay marks
    an error of a call it cut at the end of the drain window "cut")."""
    host, port = _split_url(url)
    res = dict(
        t_send=time.perf_counter(),
        t_first=None,
        t_last=None,
        t_end=None,
        text="",
        prompt_tokens=None,
        completion_tokens=None,
        cached_tokens=None,
        finish_reason=None,
        status="ok",
        error=None,
        chunks=0,
    )
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    sock = None
    try:
        payload = json.dumps(body).encode()
        conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        if conns is not None:
            sock = conn.sock
            conns.add(sock)
        resp = conn.getresponse()
        if resp.status != 200:
            err = resp.read().decode("utf-8", "replace")
            try:
                e = json.loads(err)["error"]
                code, msg = e.get("code"), e.get("message", err)
            except (ValueError, KeyError, TypeError):
                code, msg = None, err
            res.update(
                status="context" if code == "context_length_exceeded" else "http",
                error=f"HTTP {resp.status}: {msg[:300]}",
            )
            return res
        parts = []
        for data in _sse_events(resp):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.update(status="error", error=str(chunk["error"].get("message"))[:300])
                break
            for ch in chunk.get("choices", []):
                text = (ch.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    res["t_first"] = res["t_first"] or now
                    res["t_last"] = now
                    res["chunks"] += 1
                    parts.append(text)
                if ch.get("finish_reason"):
                    res["finish_reason"] = ch["finish_reason"]
            usage = chunk.get("usage")
            if usage:
                res["prompt_tokens"] = usage.get("prompt_tokens")
                res["completion_tokens"] = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    res["cached_tokens"] = details["cached_tokens"]
        res["text"] = "".join(parts)
        if res["finish_reason"] is None and res["error"] is None:
            res.update(status="error", error="the stream ended without a finish_reason")
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
    finally:
        res["t_end"] = time.perf_counter()
        if conns is not None and sock is not None:
            conns.discard(sock)
        conn.close()
    return res


# ============================================================================ server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m bole_jax serve` in its own process group, stopped with SIGINT (the server's
    clean shutdown), then SIGTERM / SIGKILL if it does not exit."""

    def __init__(
        self,
        mode: str,
        model: str | None,
        server_args: list[str],
        log_path: str,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "bole_jax",
            "serve",
            *([] if mode == "engine" else ["--spec", mode]),  # engine: the server's own choice
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if model:
            self.cmd += ["--model", model]
        self.cmd += server_args
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float) -> "ServerProcess":
        env = dict(_CHILD_ENV)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._log = open(self.log_path, "w")
        print(f"  $ {shlex.join(self.cmd)}  (log: {self.log_path})", flush=True)
        # A new session: the terminal's Ctrl-C reaches only the benchmark, which stops the server.
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        t0, last, stage = time.monotonic(), 0.0, None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.proc.returncode} during start-up; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            try:
                # The socket accepts before the engine has compiled; a request waits in the backlog
                # until then, so a short timeout would only leave broken pipes in the server log.
                status, health = http_json(self.url, "/health", timeout=120.0)
                if status == 200:
                    print(f"  server up after {time.monotonic() - t0:.0f} s", flush=True)
                    return self
                if isinstance(health, dict):
                    stage = health.get("stage") or stage
            except OSError:
                pass
            waited = time.monotonic() - t0
            if waited > timeout:
                raise RuntimeError(
                    f"the server did not answer /health within {timeout:.0f} s "
                    f"(--startup-timeout); last lines of {self.log_path}:\n{self.tail()}"
                )
            if waited - last >= 30:
                last = waited
                what = f"compiling {stage}" if stage else "loading and compiling"
                print(f"  waiting for the server ({waited:.0f} s: {what})", flush=True)
            time.sleep(1.0)

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until the server has no running or waiting request (cut streams take a segment to free)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = scrape_metrics(url)
        if m.get("bole_active_slots", 0) == 0 and m.get("bole_queue_depth", 0) == 0:
            return
        time.sleep(0.5)


def probe_environment() -> dict:
    """measure.env.environment() (device, jax, git commit) from a short-lived subprocess, without
    preallocating device memory, so this process never holds the GPU."""
    env = dict(_CHILD_ENV, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    code = "import json; from bole_jax.measure.env import environment; print(json.dumps(environment()))"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - best effort: the results are still worth writing
        return dict(error=f"environment probe failed: {e}")


# ============================================================================ replay
class Replay:
    """Replays sessions against one server at one arrival rate (threads: one per session)."""

    def __init__(self, url: str, a, label: str):
        self.url, self.a, self.label = url, a, label
        self.calls: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.conns = Connections()
        self.started = self.finished = 0
        self.t0 = 0.0
        self.cut_t: float | None = None  # when the calls still running past the window were cut

    def run_session(self, idx: int, s: Session, deadline: float) -> None:
        a = self.a
        history: list[dict] = []
        call = 0
        try:
            for m in s.messages:
                if m["role"] != "assistant":
                    history.append({"role": m["role"], "content": m["content"]})
                    continue
                if (
                    self.stop.is_set()
                    or time.perf_counter() > deadline
                    or (a.max_calls is not None and call >= a.max_calls)
                ):
                    return
                body = dict(
                    messages=[{"role": "system", "content": s.system}] + history,
                    max_tokens=a.max_tokens,
                    temperature=a.temperature,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                r = chat_stream(self.url, body, a.request_timeout, self.conns)
                cut = self.cut_t  # read once: set by run() before it closes the connections
                if r["status"] == "error" and cut is not None and r["t_end"] >= cut:
                    r.update(status="cut", error="still running at the end of the drain window")
                rec = dict(
                    session=s.id,
                    arrival=idx,
                    call=call,
                    t_send=r["t_send"] - self.t0,
                    status=r["status"],
                    error=r["error"],
                    finish_reason=r["finish_reason"],
                    prompt_tokens=r["prompt_tokens"],
                    cached_tokens=r["cached_tokens"],
                    completion_tokens=r["completion_tokens"],
                    chunks=r["chunks"],
                    ttft=None,
                    tpot=None,
                    latency=r["t_end"] - r["t_send"],
                )
                if r["status"] == "ok":
                    if r["t_first"] is not None:
                        rec["ttft"] = r["t_first"] - r["t_send"]
                    n = r["completion_tokens"]
                    if n is not None and n > 1 and r["t_first"] is not None:
                        rec["tpot"] = (r["t_last"] - r["t_first"]) / (n - 1)
                with self.lock:
                    self.calls.append(rec)
                if r["status"] != "ok":
                    return
                history.append(
                    {
                        "role": "assistant",
                        "content": m["content"] if m["content"] is not None else r["text"],
                    }
                )
                call += 1
                if a.think_time > 0:
                    time.sleep(a.think_time)
        finally:
            with self.lock:
                self.finished += 1

    def progress(self) -> str:
        with self.lock:
            calls = list(self.calls)
            started, finished = self.started, self.finished
        ok = [c for c in calls if c["status"] == "ok"]
        recent = [c["ttft"] for c in ok[-50:]]
        p = percentiles(recent)["p50"]
        return (
            f"  [{self.label}] {time.perf_counter() - self.t0:6.0f} s  sessions "
            f"{started} started / {finished} done  calls {len(ok)} ok / "
            f"{len(calls) - len(ok)} not  in flight {started - finished}  TTFT p50 (last 50) "
            + (f"{p:.3f} s" if p is not None else "-")
        )

    def run(self, sessions: list[Session], arrivals: list[float]) -> tuple[list[dict], float]:
        a = self.a
        self.t0 = time.perf_counter()
        deadline = self.t0 + a.duration + a.drain_timeout
        threads = []
        next_report = a.progress_interval
        try:
            for i, (t_arr, s) in enumerate(zip(arrivals, sessions)):
                while True:
                    now = time.perf_counter() - self.t0
                    if now >= next_report:
                        print(self.progress(), flush=True)
                        next_report += a.progress_interval
                    if now >= t_arr:
                        break
                    time.sleep(min(t_arr - now, 0.05))
                th = threading.Thread(target=self.run_session, args=(i, s, deadline), daemon=True)
                with self.lock:
                    self.started += 1
                th.start()
                threads.append(th)
            for th in threads:
                while th.is_alive():
                    th.join(timeout=0.2)
                    now = time.perf_counter()
                    if now - self.t0 >= next_report:
                        print(self.progress(), flush=True)
                        next_report += a.progress_interval
                    if now > deadline + 5:  # calls still running past the drain window: cut them
                        if self.cut_t is None:
                            self.cut_t = now
                        self.stop.set()
                        self.conns.close_all()
        except BaseException:
            self.stop.set()
            self.conns.close_all()
            raise
        wall = time.perf_counter() - self.t0
        print(self.progress(), flush=True)
        return sorted(self.calls, key=lambda c: c["t_send"]), wall


def warm_up(url: str, a) -> None:
    """Compile the prefill shapes before timing: prompts of growing length (the engine compiles a
    prefill program per prompt-piece bucket), a few decode segments each. The text shares no
    prefix with the sessions, so a prefix cache gains nothing from it."""
    if a.warmup <= 0:
        return
    t0 = time.perf_counter()
    filler = "The quick brown fox jumps over the lazy dog. " * 400  # ~18k characters
    for i in range(a.warmup):
        chars = max(int(len(filler) * 2.0 ** (i - a.warmup + 1)), 16)  # ..., 1/4, 1/2, all of it
        body = dict(
            messages=[{"role": "user", "content": filler[:chars]}],
            max_tokens=min(a.max_tokens, 16),
            temperature=a.temperature,
            stream=True,
        )
        r = chat_stream(url, body, a.request_timeout)
        if r["status"] not in ("ok", "context"):  # over the context limit is fine here
            raise RuntimeError(f"warm-up request failed: {r['error']}")
    print(f"  warm-up: {a.warmup} requests in {time.perf_counter() - t0:.1f} s", flush=True)


def bench_server(url: str, mode: str, a, sessions: list[Session], schedules) -> list[dict]:
    """Every rate on one running server. Returns one row per rate (calls attached)."""
    warm_up(url, a)
    rows = []
    for rate, (order, arrivals) in zip(a.rates, schedules):
        wait_idle(url)
        label = f"{mode} @ {rate:g}/s"
        print(f"\n== {label}: {len(arrivals)} sessions over {a.duration:g} s", flush=True)
        before = scrape_metrics(url)
        calls, wall = Replay(url, a, label).run([sessions[j] for j in order], arrivals)
        deltas = metric_deltas(before, scrape_metrics(url))
        row = dict(mode=mode, rate=rate, sessions=len(arrivals), **summarize(calls, wall, deltas))
        row["calls_detail"] = calls
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows


def _ms(v):
    return None if v is None else 1e3 * v


def _row_line(r: dict) -> str:
    f = lambda v, s="": "-" if v is None else f"{v:.3g}{s}"  # noqa: E731
    return (
        f"  {r['ok']}/{r['calls']} calls ok, {f(r['req_per_s'])} req/s, "
        f"{f(r['out_tok_per_s'])} out tok/s, TTFT p50 {f(_ms(r['ttft_p50']))} ms, TPOT p50 "
        f"{f(_ms(r['tpot_p50']))} ms, tokens/step {f(r['tokens_per_step'])}"
    )


TABLE_COLS = [
    "mode",
    "rate",
    "sessions",
    "ok",
    "errors",
    "cut",
    "ctx_end",
    "req_per_s",
    "out_tok_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tpot_p99_ms",
    "latency_p50_s",
    "latency_p99_s",
    "prefix_hit",
    "srv_prefix_hit",
    "tok_per_step",
]


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in sorted(
        rows, key=lambda r: (r["rate"], MODES.index(r["mode"]) if r["mode"] in MODES else 9)
    ):
        t = {
            k: r[k]
            for k in (
                "mode",
                "rate",
                "sessions",
                "ok",
                "errors",
                "ctx_end",
                "req_per_s",
                "out_tok_per_s",
            )
        }
        t["cut"] = r.get("cut", 0)  # rows of runs before the column: 0
        for name in ("ttft", "tpot"):
            for p in PCTS:
                t[f"{name}_p{p}_ms"] = _ms(r[f"{name}_p{p}"])
        t["latency_p50_s"], t["latency_p99_s"] = r["latency_p50"], r["latency_p99"]
        t["prefix_hit"], t["srv_prefix_hit"] = r["prefix_hit_rate"], r["server_prefix_hit_rate"]
        t["tok_per_step"] = r["tokens_per_step"]
        out.append({k: ("-" if v is None else v) for k, v in t.items()})
    return out


def plot(rows: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not importable: no plot)", flush=True)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("ttft", "TTFT (ms)", 1e3), ("tpot", "TPOT (ms)", 1e3))
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    modes += sorted({r["mode"] for r in rows} - set(modes))  # labelled variants (e.g. merged runs)
    rates = [r["rate"] for r in rows]
    xscale = "log" if max(rates) >= 4 * min(rates) else "linear"
    for ax, (name, label, scale) in zip(axes, panels):
        for i, m in enumerate(modes):
            pts = sorted(
                (r["rate"], r[f"{name}_p50"], r[f"{name}_p99"])
                for r in rows
                if r["mode"] == m and r[f"{name}_p50"] is not None
            )
            if pts:
                x, p50, p99 = zip(*pts)
                ax.plot(x, np.array(p50) * scale, marker="o", color=f"C{i}", label=f"{m} p50")
                ax.plot(
                    x, np.array(p99) * scale, marker="x", ls="--", color=f"C{i}", label=f"{m} p99"
                )
        ax.set(xlabel="session arrival rate (1/s)", ylabel=label, yscale="log", xscale=xscale)
        ax.legend(fontsize=7)
    for i, m in enumerate(modes):
        pts = sorted(
            (r["rate"], r["out_tok_per_s"])
            for r in rows
            if r["mode"] == m and r["out_tok_per_s"] is not None
        )
        if pts:
            axes[2].plot(*zip(*pts), marker="o", color=f"C{i}", label=m)
    axes[2].set(xlabel="session arrival rate (1/s)", ylabel="output tokens / s", xscale=xscale)
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(sorted(set(rates)), [f"{r:g}" for r in sorted(set(rates))])
        ax.xaxis.set_minor_locator(plt.NullLocator())
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ============================================================================ main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="model folder the servers load (default: the embedded demo model)",
    )
    src.add_argument(
        "--preset",
        default=None,
        help="the servers serve random weights with this preset's dimensions (`bole-jax "
        "serve --preset`, e.g. qwen3.5-27b; outputs are not a model's): with "
        "--simulate-accept-mean, large-model timings without a trained drafter",
    )
    src.add_argument(
        "--url",
        default=None,
        help="benchmark a running server (http://HOST:PORT) instead of starting one "
        "per mode; its mode comes from /v1/models",
    )
    ap.add_argument(
        "--simulate-accept-mean",
        type=float,
        default=None,
        metavar="X",
        help="every server's speculative modes accept X tokens per step on average "
        "(`bole-jax serve --simulate-accept-mean`: simulated outputs, the cost of a real "
        "step at that acceptance) (default: the real acceptance)",
    )
    ap.add_argument("--modes", nargs="+", default=["bole", "pernode", "ar"], choices=MODES)
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="session arrival rates, sessions/s (Poisson) (default 0.25 0.5 1 2)",
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals per rate (default 120); running sessions then "
        "finish within --drain-timeout",
    )
    ap.add_argument("--max-sessions", type=int, default=None, help="sessions per rate, at most")
    ap.add_argument("--max-calls", type=int, default=None, help="LLM calls per session, at most")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="max_tokens of every call (default 128)"
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds between an answer and the session's next call",
    )
    ap.add_argument("--sessions-file", default=DEFAULT_SESSIONS)
    ap.add_argument(
        "--sources",
        nargs="+",
        default=None,
        choices=["bfcl", "spec_bench"],
        help="session sources to replay (default: all, interleaved)",
    )
    ap.add_argument(
        "--tool-docs",
        default=None,
        choices=["json", "compact"],
        help="tool descriptions in the system prompt (default json; compact for "
        "short-context models)",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=None,
        help="extra `bole-jax serve` flags, e.g. --server-arg=--max-batch=32 or "
        "--server-arg='--max-context 8000' (repeatable)",
    )
    ap.add_argument(
        "--mode-server-arg",
        action="append",
        default=[],
        metavar="MODE=FLAGS",
        help="`bole-jax serve` flags for one mode's server only, after the common "
        "--server-arg ones, e.g. --mode-server-arg='pernode=--tree-nodes 64' (a fixed "
        "tree per request, as SGLang's tree baseline) while bole keeps its batch-wide "
        "budget (repeatable)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per server (6)")
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds after the arrival window for running sessions to finish; calls "
        "not started by then are dropped, calls still running 5 s later are cut "
        "(default: max(duration, 30))",
    )
    ap.add_argument("--progress-interval", type=float, default=None, help="seconds (default 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 rates x 8 s, 3 sessions of <= 3 calls, 16 tokens, compact "
        "tools, --max-batch 4 --max-context 3968 (unspecified options only)",
    )
    ap.add_argument("--out", default="benchmarks/results/online")
    ap.add_argument(
        "--tag",
        default=None,
        help="names OUT/online_<tag>.json (default: demo, the model folder, or url)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the other modes' rows of an existing OUT/online_<tag>.json (run the "
        "modes in separate invocations, same replay settings)",
    )
    ap.add_argument("--no-plots", action="store_true")
    return ap


def resolve_args(a) -> None:
    defaults = dict(
        rates=[0.25, 0.5, 1.0, 2.0],
        duration=120.0,
        max_tokens=128,
        tool_docs="json",
        warmup=6,
        server_args=[],
        progress_interval=15.0,
    )
    if a.quick:
        defaults.update(QUICK)
    a.server_args = a.server_arg
    for k, v in defaults.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.server_args = [x for s in a.server_args for x in shlex.split(s)]
    a.mode_server_args = {}
    for item in a.mode_server_arg:
        mode, sep, flags = item.partition("=")
        if not sep or mode not in MODES:
            raise ValueError(
                f"--mode-server-arg wants MODE=FLAGS with MODE in {list(MODES)}, got {item!r}"
            )
        a.mode_server_args.setdefault(mode, []).extend(shlex.split(flags))
    if a.url and a.simulate_accept_mean is not None:
        raise ValueError("--simulate-accept-mean starts servers: it does not go with --url")
    if a.simulate_accept_mean is not None and not a.simulate_accept_mean > 1:
        raise ValueError(f"--simulate-accept-mean must be > 1, got {a.simulate_accept_mean}")
    if a.drain_timeout is None:
        a.drain_timeout = max(a.duration, 30.0)
    if a.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    a.rates = sorted(a.rates)


def model_server_args(a) -> list[str]:
    """The `bole-jax serve` flags choosing what every server runs: --model, or --preset (random
    weights), and --simulate-accept-mean."""
    args = ["--model", a.model] if a.model else []
    if a.preset:
        args += ["--preset", a.preset]
    if a.simulate_accept_mean is not None:
        args += ["--simulate-accept-mean", repr(a.simulate_accept_mean)]
    return args


def schedules_for(a, n_sessions: int) -> list[tuple[list[int], list[float]]]:
    """Per rate: (session indices, arrival times). Seeded: every mode replays the same thing.
    Rates take consecutive slices of one shuffled order (wrapping when it runs out)."""
    rng = np.random.default_rng(a.seed)
    order = list(rng.permutation(n_sessions))
    out, pos = [], 0
    for i, rate in enumerate(a.rates):
        arr = arrival_times(rate, a.duration, a.max_sessions, np.random.default_rng([a.seed, i]))
        idx = [int(order[(pos + k) % n_sessions]) for k in range(len(arr))]
        if pos + len(arr) > n_sessions:
            print(
                f"note: rate {rate:g} wraps around the {n_sessions} sessions (a prefix cache may "
                "still hold the repeated ones)",
                flush=True,
            )
        pos += len(arr)
        out.append((idx, arr))
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        resolve_args(a)
    except ValueError as e:  # bad option values: say which, exit 2, no traceback
        ap.error(str(e))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the server too, like Ctrl-C
    sessions = load_sessions(
        a.sessions_file, sources=tuple(a.sources) if a.sources else None, tool_docs=a.tool_docs
    )
    schedules = schedules_for(a, len(sessions))
    os.makedirs(a.out, exist_ok=True)
    tag = a.tag or (
        "url"
        if a.url
        else a.preset
        if a.preset
        else "demo"
        if not a.model
        else os.path.basename(os.path.normpath(a.model))
    )
    if a.simulate_accept_mean is not None and not a.tag:
        tag += f"_sim{a.simulate_accept_mean:g}"
    command = "python " + shlex.join(
        [os.path.relpath(__file__, ROOT)] + (sys.argv[1:] if argv is None else list(argv))
    )
    print(
        f"online replay: {len(sessions)} sessions ({a.tool_docs} tool docs), rates {a.rates} "
        f"sessions/s, {a.duration:g} s each, max_tokens {a.max_tokens}",
        flush=True,
    )
    env = probe_environment()
    servers, rows = {}, []
    interrupted = None
    server = None
    try:
        if a.url:
            status, models = http_json(a.url, "/v1/models")
            card = models["data"][0] if status == 200 else {}
            mode = card.get("spec_mode", "unknown")
            servers[mode] = dict(url=a.url, model_card=card, metrics_at_start=scrape_metrics(a.url))
            rows += bench_server(a.url, mode, a, sessions, schedules)
        else:
            for mode in a.modes:
                print(f"\n### mode {mode}", flush=True)
                server = ServerProcess(
                    mode,
                    None,
                    model_server_args(a) + a.server_args + a.mode_server_args.get(mode, []),
                    os.path.join(a.out, f"server_{tag}_{mode}.log"),
                )
                servers[mode] = dict(command=shlex.join(server.cmd))
                try:
                    server.start(a.startup_timeout)
                    _, models = http_json(server.url, "/v1/models")
                    servers[mode].update(
                        model_card=models["data"][0], metrics_at_start=scrape_metrics(server.url)
                    )
                    if mode == "engine":
                        chosen = models["data"][0].get("spec_mode")
                        servers[mode]["chosen_mode"] = chosen
                        print(f"  the engine's choice: {chosen}", flush=True)
                    rows += bench_server(server.url, mode, a, sessions, schedules)
                except (RuntimeError, OSError) as e:  # one mode failing must not lose the others
                    servers[mode]["error"] = str(e)
                    print(f"error: mode {mode}: {e}", file=sys.stderr, flush=True)
                finally:
                    server.stop()
                    server = None
    except KeyboardInterrupt as e:
        interrupted = f"KeyboardInterrupt {e}".strip()
        print("\ninterrupted: stopping the server, writing what was measured", flush=True)
    finally:
        if server is not None:
            server.stop()
    if not rows:
        print("nothing measured", flush=True)
        return 1
    run = dict(
        command=command,
        env=env,
        interrupted=interrupted,
        modes=sorted(servers),
        # what the servers ran: random weights (preset) and / or simulated acceptance
        simulated=None
        if a.preset is None and a.simulate_accept_mean is None
        else dict(preset=a.preset, simulate_accept_mean=a.simulate_accept_mean),
        config={k: v for k, v in vars(a).items() if k not in ("server_arg", "mode_server_arg")},
    )
    path = os.path.join(a.out, f"online_{tag}.json")
    runs = [run]
    if a.merge and os.path.exists(path):
        rows, servers, runs = merge_result(path, a, rows, servers, runs)
    report(rows, servers, runs, a, tag, path, env)
    return 130 if interrupted else 0


# Replay settings that must match for rows of several runs to be compared (--merge).
SAME = (
    "rates",
    "duration",
    "max_sessions",
    "max_calls",
    "max_tokens",
    "temperature",
    "think_time",
    "sources",
    "tool_docs",
    "seed",
    "preset",
    "simulate_accept_mean",
)


def load_result(path: str, a) -> tuple[list[dict], dict, list[dict]]:
    """Rows (calls attached), servers and runs of an earlier online_<tag>.json (--merge)."""
    with open(path) as f:
        old = json.load(f)
    runs = old.get("runs", [])
    for r in runs:
        diff = {k: r["config"].get(k) for k in SAME if r["config"].get(k) != getattr(a, k, None)}
        if diff:
            print(
                f"warning: --merge with {path}: its run of {r['modes']} used other settings {diff}",
                flush=True,
            )
    rows = [
        dict(r, calls_detail=old["calls"].get(f"{r['mode']}@{r['rate']:g}", []))
        for r in old["rows"]
    ]
    return rows, old.get("servers", {}), runs


def merge_result(path: str, a, rows: list[dict], servers: dict, runs: list[dict]):
    """This run's rows, servers and runs with those of the other modes in `path`."""
    old_rows, old_servers, old_runs = load_result(path, a)
    return (
        [r for r in old_rows if r["mode"] not in servers] + rows,
        {**{m: v for m, v in old_servers.items() if m not in servers}, **servers},
        old_runs + runs,
    )


def report(rows, servers, runs, a, tag, path, env) -> None:
    """Print the tables, write the JSON and the plot."""
    print(
        f"\nonline agent replay, {tag}, {env.get('device', '?')}, max_tokens {a.max_tokens}, "
        f"{a.tool_docs} tool docs (TTFT/TPOT in ms, latency in s)"
    )
    table = bench.print_table(table_rows(rows), TABLE_COLS)
    comps = []
    for mode in ("bole", "engine"):  # engine: the server's own choice (its mode in the JSON)
        for base in ("pernode", "ar"):
            comps += reductions(rows, base, mode)
    if comps:
        print(
            "\nbole (and the engine's choice) vs the baseline: mode / baseline - 1 (negative = "
            "faster; paper: TTFT -67.6%, TPOT -49.9% vs the tree baseline)"
        )
        bench.print_table(
            [
                {
                    k: (f"{100 * v:+.1f}%" if isinstance(v, float) and k != "rate" else v)
                    for k, v in c.items()
                }
                for c in comps
            ],
            ["mode", "vs", "rate"] + [f"{n}_p{p}" for n in ("ttft", "tpot") for p in PCTS],
        )
    last = runs[-1]
    result = dict(
        command=last["command"],
        env=env,
        interrupted=last["interrupted"],
        config=last["config"],
        simulated=last.get("simulated"),
        runs=runs,
        sessions_file=os.path.relpath(a.sessions_file, ROOT),
        servers=servers,
        rows=[{k: v for k, v in r.items() if k != "calls_detail"} for r in rows],
        reductions=comps,
        table=table,
        calls={f"{r['mode']}@{r['rate']:g}": r["calls_detail"] for r in rows},
    )
    bench.write_json(path, result)
    print(f"\nwrote {path}")
    if not a.no_plots:
        p = plot(
            rows,
            os.path.splitext(path)[0] + ".png",
            f"online agent replay, {tag}, {env.get('device', '?')}",
        )
        if p:
            print(f"wrote {p}")


if __name__ == "__main__":
    sys.exit(main())
