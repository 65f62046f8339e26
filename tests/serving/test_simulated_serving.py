"""`bole-jax serve --preset tiny --simulate-accept-mean 2.5`: random weights at a preset's
dimensions behind the demo tokenizer, simulated acceptance (benchmarks only). The server answers
chat completions (plain and streamed), says that its outputs are simulated (/v1/models, /health,
the start-up log), and decodes at about the chosen tokens per step (/metrics)."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import wait_until_healthy

from bole_jax.llm import DEFAULT_MODEL_DIR, Tokenizer
from bole_jax.serving.simulate import UNKNOWN_TOKEN_TEXT, SimulatedTokenizer
from bole_jax.spec_decode.acceptance import synthetic_accept_prob

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEAN, DEPTH = 2.5, 3
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("sim_server") / "server.log"
    out = open(log, "w")
    # topk 2, depth 3, 11 nodes: the tree holds the whole draft pool, so it reaches depth 3.
    args = [
        *(sys.executable, "-m", "bole_jax", "serve", "--preset", "tiny"),
        *("--simulate-accept-mean", str(MEAN), "--spec", "bole", "--port", str(port)),
        *("--max-batch", "2", "--max-context", "240", "--segment-steps", "4"),
        *("--tree-topk", "2", "--tree-depth", str(DEPTH), "--tree-nodes", "11"),
        *("--prefix-block", "16", "--prefill-chunk", "64"),
    ]
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log, timeout=600, poll=0.5)
    yield {"port": port, "log": log}
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    out.close()


def _request(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(method, path, json.dumps(body) if body is not None else None)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    ctype = resp.getheader("content-type") or ""
    return resp.status, (json.loads(data) if "json" in ctype else data)


def test_reports_simulated(server):
    status, health = _request(server["port"], "GET", "/health")
    assert status == 200 and health == {"status": "ok", "error": None, "simulated": True}
    status, models = _request(server["port"], "GET", "/v1/models")
    card = models["data"][0]
    assert status == 200 and card["id"] == "random-tiny" and card["spec_mode"] == "bole"
    sim = card["simulated"]
    assert sim["weights"] == "random, preset tiny" and "simulated" in sim["note"]
    acc = sim["acceptance"]
    assert acc["depth"] == DEPTH and acc["mean_tokens_per_step"] == pytest.approx(MEAN)
    assert acc["accept_prob"] == pytest.approx(synthetic_accept_prob(MEAN, DEPTH))
    assert "SIMULATED OUTPUTS" in server["log"].read_text()


def test_chat_completion_plain_and_streamed(server):
    port = server["port"]
    body = dict(messages=CHAT, max_tokens=48, temperature=0)
    status, r = _request(port, "POST", "/v1/chat/completions", body)
    assert status == 200, r
    text = r["choices"][0]["message"]["content"]
    assert isinstance(text, str) and r["usage"]["completion_tokens"] >= 1
    assert r["choices"][0]["finish_reason"] in ("stop", "length")

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(dict(body, stream=True)))
    resp = conn.getresponse()
    assert resp.status == 200
    raw = resp.read().decode()
    conn.close()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    # (not the plain answer's text: the simulated lengths come from the engine's random stream)
    assert isinstance(streamed, str) and len(chunks) >= 2
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    # Decoding ran at the simulated acceptance, not the random drafter's (about 1 token per step).
    _, metrics = _request(port, "GET", "/metrics")
    value = lambda name: float(re.search(rf"^{name} ([0-9.eE+-]+)$", metrics, re.M).group(1))
    steps = value("bole_decode_slot_steps_total")
    assert steps >= 4 and value("bole_decode_tokens_total") / steps > 1.6


def test_simulated_tokenizer_folds_and_replaces():
    tok = Tokenizer(DEFAULT_MODEL_DIR / "tokenizer.json")
    sim = SimulatedTokenizer(tok, 256)
    ids = sim.encode("hello world, how are you today?")
    assert ids == [i % 256 for i in tok.encode("hello world, how are you today?")]
    assert max(tok.encode("hello world")) >= 256  # (the folding did something)
    big = SimulatedTokenizer(tok, 300_000)
    hello = tok.encode("hello")
    assert big.decode(hello + [250_000] + hello) == "hello" + UNKNOWN_TOKEN_TEXT + "hello"
    assert big.decode([-1, 10**9]) == UNKNOWN_TOKEN_TEXT * 2
    assert big.token_to_id("<|im_end|>") == tok.token_to_id("<|im_end|>")
