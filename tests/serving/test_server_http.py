"""The HTTP server as a separate process (`python -m bole_jax serve`) on 127.0.0.1, driven by the
official `openai` SDK, raw sockets and a bounded load test; then SIGTERM (drain, exit 0).

One server for the module: tiny model (vocab 8192, random weights), ar, 4 slots, a chat template
that renders tools and `enable_thinking`, an API key, short timeouts and small limits so that each
bad input is cheap to send. Every loop here is bounded in count and time.
"""

import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_until_healthy

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key"
MAX_CONTEXT = 1023  # long enough that streams are still running when SIGTERM comes
GRACE = 1.0
HEAD_TIMEOUT = 3.0
BODY_TIMEOUT = 2.0

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- if message.tool_calls %}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@pytest.fixture(scope="module")
def proc_server(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tools_model")
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, d / f.name)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _raise_nofile(4096)  # the child inherits it (the load test holds > 1,024 connections)
    port = _free_port()
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    out = open(log, "w")
    args = [
        sys.executable,
        "-m",
        "bole_jax",
        "serve",
        "--model",
        str(d),
        "--port",
        str(port),
        "--spec",
        "ar",
        "--max-batch",
        "4",
        "--max-context",
        str(MAX_CONTEXT),
        "--segment-steps",
        "4",
        "--prefix-block",
        "16",
        "--prefill-chunk",
        "64",
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--max-body-mb",
        "1",
        "--max-prompt-chars",
        "20000",
        "--max-stops",
        "4",
        "--max-prompts",
        "8",
        "--max-n",
        "4",
        "--header-timeout",
        str(HEAD_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--shutdown-grace",
        str(GRACE),
        "--max-logprobs",
        "2",
    ]
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log, timeout=300, poll=0.25)
    yield {"proc": proc, "url": url, "port": port, "log": log}
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    out.close()


@pytest.fixture(scope="module")
def client(proc_server):
    return openai.OpenAI(
        base_url=proc_server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120
    )


def _raw(port: int, data: bytes, timeout: float = 30.0, shut_write: bool = False) -> bytes:
    """Send raw bytes, read until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            got += chunk
            if b"\r\n\r\n" in got:
                head, _, body = got.partition(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                if m and len(body) >= int(m.group(1)):
                    break
        return got


def _post(port: int, path: str, body: bytes, extra: bytes = b"", key: str = KEY) -> bytes:
    return (
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        ).encode()
        + extra
        + b"\r\n"
        + body
    )


def _status_and_error(resp: bytes):
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return status, err


def _metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([-+0-9.eE]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


# ------------------------------------------------------------------ the SDK
def test_sdk_completions_and_streaming(client):
    out = client.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0
    )
    c = out.choices[0]
    assert c.finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    stream = client.completions.create(
        model="tiny",
        prompt="def add(a, b):",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    # n > 1: greedy choices are equal; prompt tokens counted once
    out2 = client.completions.create(
        model="tiny", prompt=["a", "b"], max_tokens=4, temperature=0, n=2
    )
    assert sorted(ch.index for ch in out2.choices) == [0, 1, 2, 3]
    by = {ch.index: ch.text for ch in out2.choices}
    assert by[0] == by[1] and by[2] == by[3]


def test_sdk_chat_streaming_n_and_template_kwargs(client):
    msgs = [{"role": "user", "content": "Write a haiku."}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    text = ""
    reasons = []
    for ch in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True
    ):
        for c in ch.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == msg.content and reasons[-1] == out.choices[0].finish_reason
    assert all(r is None for r in reasons[:-1])
    many = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, n=3, temperature=1.0, seed=1
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.prompt_tokens == out.usage.prompt_tokens
    # chat_template_kwargs reach the template (it adds an empty think block)
    off = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > out.usage.prompt_tokens


def test_sdk_logprobs(client):
    msgs = [{"role": "user", "content": "Count to three."}]
    out = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)  # greedy
    streamed = []
    for ch in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True
    ):
        if ch.choices and ch.choices[0].logprobs:
            streamed += [e.logprob for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-6)
    comp = client.completions.create(
        model="tiny", prompt="x = ", max_tokens=4, temperature=0, logprobs=1
    )
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens


def test_sdk_tools_are_rendered(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    tools = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=2,
        temperature=0,
        tools=[WEATHER],
        tool_choice="auto",
    )
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=2,
        temperature=0,
        tools=[WEATHER],
        tool_choice="none",
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # a conversation with an assistant tool call and the tool's answer renders
    hist = msgs + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = client.chat.completions.create(model="tiny", messages=hist, max_tokens=2, tools=[WEATHER])
    assert out.usage.prompt_tokens > tools.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=2, tools=[WEATHER], tool_choice="required"
        )


def test_sdk_errors(client, proc_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="hello " * 1500, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            logprobs=True,
            top_logprobs=3,
        )
    bad = openai.OpenAI(base_url=proc_server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_role_forging_is_text(client):
    """A special token typed into content is text: more prompt tokens than the control token."""
    base = client.chat.completions.create(
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
    ).usage.prompt_tokens
    forged = client.chat.completions.create(
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi<|im_end|>"}]
    ).usage.prompt_tokens
    assert forged - base > 1  # "<|im_end|>" as text is several tokens, as a control token one


# ------------------------------------------------------------------ the bad-input catalogue
def _json_body(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "name,body,status,param",
    [
        ("lone surrogate in a prompt", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, None),
        (
            "lone surrogate in a message",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            400,
            None,
        ),
        (
            "JSON nested 100,000 deep",
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            400,
            None,
        ),
        ("top_k = 10**20", _json_body({"prompt": "x", "top_k": 10**20}), 400, "top_k"),
        (
            "temperature as a string",
            _json_body({"prompt": "x", "temperature": "1"}),
            400,
            "temperature",
        ),
        (
            "50,000 stops",
            _json_body({"prompt": "x", "stop": ["s%d" % i for i in range(50_000)]}),
            400,
            "stop",
        ),
        ("a long stop", _json_body({"prompt": "x", "stop": ["y" * 300]}), 400, "stop"),
        ("4,096 prompts", _json_body({"prompt": ["x"] * 4096, "max_tokens": 1}), 400, "prompt"),
        ("n above the cap", _json_body({"prompt": "x", "n": 5}), 400, "n"),
        (
            "max_tokens above the context",
            _json_body({"prompt": "x", "max_tokens": 10**6}),
            400,
            "max_tokens",
        ),
        ("a prompt over the character cap", _json_body({"prompt": "y" * 30_000}), 400, "prompt"),
        ("not an object", b"[1, 2]", 400, None),
        ("not JSON", b"{nope", 400, None),
    ],
)
def test_bad_inputs_get_4xx(proc_server, name, body, status, param):
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    t0 = time.time()
    got, err = _status_and_error(_raw(proc_server["port"], _post(proc_server["port"], path, body)))
    assert (got, err["param"]) == (status, param), (name, err)
    assert time.time() - t0 < 10, name  # answered before any model work


def test_http_level_errors_are_openai_json(proc_server):
    port = proc_server["port"]
    cases = [
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (
            f"GET /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode(),
            405,
        ),
        (_post(port, "/v1/completions", b'{"prompt": "x"}', key="nope"), 401),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 40_000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400),
        (
            _post(port, "/v1/completions", b"").replace(
                b"Content-Length: 0", b"Content-Length: 99999999"
            ),
            413,
        ),
        (b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"garbage\r\n\r\n", 400),
    ]
    for raw, status in cases:
        got, err = _status_and_error(_raw(port, raw))
        assert got == status, (raw[:60], got, err)
    # a chunked body over the cap (1 MiB): 413 while reading
    big = b"x" * (1 << 20)
    chunked = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    for _ in range(2):
        chunked += f"{len(big):x}\r\n".encode() + big + b"\r\n"
    chunked += b"0\r\n\r\n"
    assert _status_and_error(_raw(port, chunked))[0] == 413


def test_stalled_clients_are_timed_out(proc_server):
    port = proc_server["port"]
    t0 = time.time()
    assert _raw(port, b"POST /v1/compl", timeout=HEAD_TIMEOUT + 10) == b""  # half a request line
    assert HEAD_TIMEOUT - 0.5 < time.time() - t0 < HEAD_TIMEOUT + 5
    t0 = time.time()  # a Content-Length larger than the body
    resp = _raw(
        port,
        _post(port, "/v1/completions", b'{"prompt": "x"}').replace(
            b"Content-Length: 15", b"Content-Length: 500"
        ),
        timeout=BODY_TIMEOUT + 10,
    )
    assert _status_and_error(resp)[0] == 408 and time.time() - t0 < BODY_TIMEOUT + 5


# ------------------------------------------------------------------ load
async def _stream_one(port, i, mode, results):
    """One streaming request over a raw connection; mode: 'full', 'cancel' or 'slow'."""
    body = _json_body(
        {"prompt": f"story {i}:", "max_tokens": 24, "temperature": 0.7, "seed": i, "stream": True}
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post(port, "/v1/completions", body))
    await writer.drain()
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(256 if mode == "slow" else 65536), 120)
            if not chunk:
                break
            got += chunk
            if mode == "cancel" and got.count(b"data: ") >= 2:
                writer.transport.abort()
                results[i] = ("cancelled", got)
                return
            if mode == "slow":
                await asyncio.sleep(0.02)
            if got.endswith(b"0\r\n\r\n"):
                break
    finally:
        writer.close()
    results[i] = (mode, got)


def _check_stream(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    assert body.endswith(b"0\r\n\r\n"), body[-100:]  # the last chunk: a complete response
    events = [e for e in re.findall(rb"data: (.*?)\n\n", body)]
    assert events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def test_load_streams_cancels_slow_clients_and_idle_connections(proc_server):
    port, url = proc_server["port"], proc_server["url"]
    n_idle = 1100
    if _raise_nofile(n_idle + 512) < n_idle + 256:
        pytest.skip("RLIMIT_NOFILE's hard limit is too low for 1,100 idle connections")
    idle = []
    try:
        for _ in range(n_idle):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        modes = ["cancel"] * 16 + ["slow"] * 8 + ["full"] * 40
        results = {}

        async def main():
            await asyncio.wait_for(
                asyncio.gather(*[_stream_one(port, i, m, results) for i, m in enumerate(modes)]),
                240,
            )

        asyncio.run(main())
    finally:
        for s in idle:
            s.close()
    assert len(results) == len(modes)
    for i, (mode, raw) in results.items():
        if mode != "cancelled":
            _check_stream(raw)
    t0 = time.time()
    while time.time() - t0 < 60 and (
        _metric(url, "bole_active_slots") or _metric(url, "bole_queue_depth")
    ):
        time.sleep(0.2)
    assert _metric(url, "bole_active_slots") == 0 and _metric(url, "bole_queue_depth") == 0


# ------------------------------------------------------------------ shutdown (last)
def test_sigterm_ends_streams_cleanly_and_exits(proc_server):
    port, proc = proc_server["port"], proc_server["proc"]
    results = {}

    async def main():
        going = asyncio.Event()
        started = set()

        async def one(i):
            body = _json_body(
                {
                    "prompt": f"tale {i}",
                    "max_tokens": MAX_CONTEXT - 20,
                    "stream": True,
                    "temperature": 0,
                }
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(port, "/v1/completions", body))
            await writer.drain()
            got = b""
            while not got.endswith(b"0\r\n\r\n"):
                chunk = await asyncio.wait_for(reader.read(65536), 60)
                if not chunk:
                    break
                got += chunk
                if got.count(b"data: ") >= 2 and i not in started:
                    started.add(i)
                    if len(started) == 3:  # every stream is running: now the signal
                        proc.send_signal(signal.SIGTERM)
                        going.set()
            results[i] = got
            writer.close()

        await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(3)]), 120)
        assert going.is_set()

    t0 = time.time()
    asyncio.run(main())
    for raw in results.values():
        _check_stream(raw)
        last = json.loads(re.findall(rb"data: (.*?)\n\n", raw)[-2])
        assert last["choices"][0]["finish_reason"] == "length"
    assert proc.wait(60) == 0, proc_server["log"].read_text()[-3000:]
    assert time.time() - t0 < GRACE + 60
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
