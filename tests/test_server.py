"""The continuous-batching scheduler and the OpenAI-compatible server, on a tiny model (CPU).

One server per module (spec="ar", 4 slots); one bole server for the speculative path. Greedy
outputs are compared with `LLM.generate` on the same weights.
"""

import http.client
import json
import re
import socket
import threading
import time

import pytest

from bole_jax import LLM
from bole_jax.serving import cli
from bole_jax.serving.scheduler import (IncrementalDetokenizer, RequestParams, Scheduler,
                                        StopMatcher, plan_slots, slot_bytes)
from bole_jax.serving.server import ChatTemplate, OpenAIServer, build_server
from bole_jax.spec_decode.step import SpecConfig

PROMPTS = ["def add(a, b):", "Hello world", "import numpy as np\n"]
CHAT = [{"role": "user", "content": "Write a haiku."}]
MAX_TOKENS = 12
MAX_CONTEXT = 127  # + 1 -> KV capacity 128 per slot (ar)


@pytest.fixture(scope="module")
def llm(model_dir):
  return LLM(model_dir)


@pytest.fixture(scope="module")
def chat_ids(model_dir, llm):
  text = ChatTemplate.from_folder(model_dir, llm.tokenizer).render(CHAT)
  assert text == "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n"
  return llm.tokenizer.encode(text)


@pytest.fixture(scope="module")
def reference(llm, chat_ids):
  """LLM.generate's greedy outputs for PROMPTS and the chat prompt (one batch: one compile)."""
  outs = llm.generate(PROMPTS + [chat_ids], max_new_tokens=MAX_TOKENS, spec="ar")
  return outs


@pytest.fixture(scope="module")
def server(model_dir, llm):
  srv = build_server(llm=llm, spec="ar", port=0, max_batch=4, max_context=MAX_CONTEXT,
                     segment_steps=4, served_model_name="tiny")
  srv.start()
  yield srv
  srv.shutdown()


# ------------------------------------------------------------------ HTTP helpers
def _request(srv, method, path, body=None, raw=None):
  conn = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  payload = resp.read().decode()
  conn.close()
  ctype = resp.getheader("Content-Type", "")
  if ctype.startswith("application/json"):
    return resp.status, json.loads(payload)
  return resp.status, payload


def _stream(srv, path, body):
  """POST with stream=true; returns the decoded `data:` payloads ([DONE] as the string)."""
  status, text = _request(srv, "POST", path, {**body, "stream": True})
  assert status == 200, text
  events = [e[len("data: "):] for e in text.split("\n\n") if e]
  assert events[-1] == "[DONE]"
  return [json.loads(e) for e in events[:-1]] + ["[DONE]"]


def _wait_for(pred, timeout=30.0):
  t0 = time.time()
  while time.time() - t0 < timeout:
    if pred():
      return True
    time.sleep(0.02)
  return False


@pytest.fixture
def slow_engine(server):
  """Slow each decode segment down so that requests are still running when the test acts."""
  sched = server.scheduler
  fast = sched._segment

  def slow(*args):
    time.sleep(0.05)
    return fast(*args)

  sched._segment = slow
  yield sched
  sched._segment = fast


# ------------------------------------------------------------------ host-side text
def test_incremental_detokenizer_never_splits_utf8(llm):
  text = "héllo 日本語 😀 naïve — ok"
  ids = llm.tokenizer.encode(text)
  det = IncrementalDetokenizer(llm.tokenizer)
  deltas = [det.push(t) for t in ids] + [det.flush()]
  assert all("\ufffd" not in d for d in deltas)
  assert "".join(deltas) == llm.tokenizer.decode(ids) == text
  assert sum(bool(d) for d in deltas) < len(ids)  # some tokens were partial characters


def test_stop_matcher_across_deltas():
  m = StopMatcher(["END", "xyz"])
  assert m.push("abcE") == ("abc", False)  # "E" may start "END": held back
  assert m.push("N") == ("", False)
  assert m.push("Dtail") == ("", True)
  m = StopMatcher(["END"])
  assert m.push("aE") == ("a", False)
  assert m.push("x") == ("Ex", False)  # not a stop after all: released
  assert m.push("EN") == ("", False) and m.flush() == "EN"
  assert StopMatcher([]).push("anything") == ("anything", False)


# ------------------------------------------------------------------ scheduler
def test_memory_admission(llm):
  cfg = llm.cfg
  ar = slot_bytes(cfg, 1024, 1000, None, "float32")
  bole = slot_bytes(cfg, 1024, 1000, SpecConfig.for_mode("bole"), "float32")
  per_token_kv = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * len(cfg.attention_layers)
  assert ar["attention_kv"] == 1024 * per_token_kv
  assert sum(bole.values()) > sum(ar.values()) and bole["drafter"] > 0

  class Dev:
    def __init__(self, limit, used):
      self.stats = {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
      return self.stats

  assert plan_slots(100, 64, Dev(10_000, 0), memory_fraction=1.0)[0] == 64  # capped by max_batch
  assert plan_slots(100, 64, Dev(2_000, 1_000), memory_fraction=1.0)[0] == 9  # 10 fit, 1 kept
  with pytest.raises(ValueError, match="lower --max-context"):
    plan_slots(1000, 8, Dev(1_500, 0))


def test_scheduler_stop_tokens_seed_and_cancel(server, slow_engine, reference, llm):
  sched = slow_engine
  ids = llm.tokenizer.encode(PROMPTS[0])
  ref = reference[0].token_ids
  # A per-request stop token: generation ends before it, finish_reason "stop".
  r = sched.submit(ids, RequestParams(max_tokens=MAX_TOKENS, stop_token_ids=(ref[3],))).result(60)
  assert r.finish_reason == "stop" and r.token_ids == ref[:ref.index(ref[3])]
  # The seed fixes the first sampled token (its own prefill key).
  firsts = {sched.submit(ids, RequestParams(max_tokens=1, temperature=1.0, seed=7)).result(60)
            .token_ids[0] for _ in range(2)}
  assert len(firsts) == 1
  # Cancellation: of a running request and of one waiting for a slot (4 slots, 6 requests).
  reqs = [sched.submit(ids, RequestParams(max_tokens=100)) for _ in range(6)]
  assert _wait_for(lambda: sched.active_slots == 4)
  reqs[0].cancel()
  reqs[5].cancel()
  assert reqs[0].result(30).finish_reason == "cancelled"
  assert reqs[5].result(30).finish_reason == "cancelled" and reqs[5].t_first is None
  assert _wait_for(lambda: reqs[4].t_first is not None)  # took the freed slot
  for r in reqs[1:5]:
    r.cancel()
  assert _wait_for(lambda: sched.active_slots == 0 and sched.queue_depth == 0)
  assert all(r.finish_reason == "cancelled" for r in reqs)


def test_scheduler_rejects_bad_requests(server):
  sched = server.scheduler
  with pytest.raises(ValueError, match="maximum context length is 127"):
    sched.submit([5] * 100, RequestParams(max_tokens=28))
  with pytest.raises(ValueError, match="empty"):
    sched.submit([], RequestParams(max_tokens=4))
  with pytest.raises(ValueError, match="out of range"):
    sched.submit([8192], RequestParams(max_tokens=4))
  with pytest.raises(ValueError, match="top_p"):
    sched.submit([5], RequestParams(max_tokens=4, top_p=1.5))


# ------------------------------------------------------------------ HTTP API
def test_health_models_metrics(server):
  assert _request(server, "GET", "/health") == (200, {"status": "ok", "error": None})
  status, models = _request(server, "GET", "/v1/models")
  assert status == 200 and models["data"][0]["id"] == "tiny"
  assert models["data"][0]["max_model_len"] == MAX_CONTEXT
  status, text = _request(server, "GET", "/metrics")
  assert status == 200
  sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? '
                      r'[-+0-9.eE]+$')
  for line in text.strip().splitlines():
    assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
  for name in ("bole_time_to_first_token_seconds_bucket", "bole_time_per_output_token_seconds_sum",
               "bole_tokens_per_step_count", "bole_queue_depth", "bole_active_slots",
               "bole_state_bytes", "bole_slot_bytes"):
    assert re.search(rf"^{name}[ {{]", text, re.M), name
  assert "# TYPE bole_time_to_first_token_seconds histogram" in text


def test_greedy_completions_match_generate(server, reference):
  for prompt, ref in zip(PROMPTS, reference):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, out = _request(server, "POST", "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert out["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                            "completion_tokens": len(ref.token_ids),
                            "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
  # Several prompts in one request, and token-id prompts.
  body = {"prompt": [PROMPTS[1], reference[2].prompt_token_ids], "max_tokens": MAX_TOKENS,
          "temperature": 0}
  status, out = _request(server, "POST", "/v1/completions", body)
  assert status == 200 and [c["text"] for c in out["choices"]] == [reference[1].text,
                                                                    reference[2].text]


def test_stop_string(server, reference):
  ref = reference[0].text
  stop = ref[4:7]
  body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop]}
  status, out = _request(server, "POST", "/v1/completions", body)
  assert status == 200
  assert out["choices"][0] == {"index": 0, "text": ref[:ref.find(stop)], "logprobs": None,
                               "finish_reason": "stop"}
  chunks = _stream(server, "/v1/completions", body)
  assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ref[:ref.find(stop)]


def test_concurrent_streaming(server, reference):
  """More streams than slots, each from its own thread: every stream equals generate's text."""
  results = {}

  def run(i):
    body = {"prompt": PROMPTS[i % 3], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream_options": {"include_usage": True}}
    results[i] = _stream(server, "/v1/completions", body)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(7)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert len(results) == 7
  for i, chunks in results.items():
    ref = reference[i % 3]
    *body, usage, done = chunks
    assert all(c["object"] == "text_completion" for c in body)
    assert "".join(c["choices"][0]["text"] for c in body) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in body][-1] == ref.finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ref.token_ids)
  assert _wait_for(lambda: server.scheduler.active_slots == 0)


def test_chat_completions_use_the_template(server, reference, chat_ids):
  ref = reference[3]
  body = {"model": "tiny", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
  status, out = _request(server, "POST", "/v1/chat/completions", body)
  assert status == 200, out
  assert out["object"] == "chat.completion"
  assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
  assert out["usage"]["prompt_tokens"] == len(chat_ids)
  chunks = _stream(server, "/v1/chat/completions", body)
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
  text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
  assert text == ref.text and chunks[-2]["choices"][0]["finish_reason"] == ref.finish_reason


def test_chatml_fallback_and_template_errors(llm):
  plain = ChatTemplate(None, llm.tokenizer)
  assert plain.kind == "chatml"
  assert plain.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
  assert llm.tokenizer.token_to_id("<|im_end|>") in plain.stop_token_ids
  strict = ChatTemplate("{{ raise_exception('roles must alternate') }}", llm.tokenizer)
  with pytest.raises(Exception, match="roles must alternate"):
    strict.render(CHAT)


@pytest.mark.parametrize("path,raw,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "top_k": 2.5}', 400, "top_k"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "stop": [""]}', 400, "stop"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": [1, 99999], "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages"),
    ("/v1/nowhere", b"{}", 404, None),
])
def test_bad_requests_get_openai_errors(server, path, raw, status, param):
  got, out = _request(server, "POST", path, raw=raw)
  assert got == status, out
  assert set(out["error"]) == {"message", "type", "param", "code"}
  assert out["error"]["param"] == param and out["error"]["message"]


def test_oversize_prompt_is_400_and_server_keeps_serving(server, reference):
  body = {"prompt": "hello " * 200, "max_tokens": 4}
  status, out = _request(server, "POST", "/v1/completions", body)
  assert status == 400 and out["error"]["code"] == "context_length_exceeded"
  assert "maximum context length is 127" in out["error"]["message"]
  status, out = _request(server, "POST", "/v1/completions",
                         {"prompt": "x", "max_tokens": 2, "stream": True, "n": 3})
  assert status == 400
  status, out = _request(server, "POST", "/v1/completions",
                         {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
  assert status == 200 and out["choices"][0]["text"] == reference[1].text


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_and_frees_the_slot(server, slow_engine, stream):
  sched = slow_engine
  before = sched.stats()["finished"].get("cancelled", 0)
  body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 100, "stream": stream}).encode()
  sock = socket.create_connection((server.host, server.port), timeout=60)
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
  if stream:
    got = b""
    while b"data: " not in got:
      got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
  assert _wait_for(lambda: sched.active_slots == 1)
  sock.close()
  assert _wait_for(lambda: sched.stats()["finished"].get("cancelled", 0) == before + 1, 30)
  assert _wait_for(lambda: sched.active_slots == 0)
  status, text = _request(server, "GET", "/metrics")
  assert re.search(r"^bole_active_slots 0$", text, re.M)
  assert re.search(rf'^bole_requests_finished_total{{finish_reason="cancelled"}} {before + 1}$',
                   text, re.M)


def test_cli_serve_arguments(model_dir, capsys):
  args = cli.build_parser().parse_args(["serve", "--model", str(model_dir), "--port", "0",
                                        "--max-batch", "2", "--spec", "ar"])
  assert args.func is cli._cmd_serve and args.host == "127.0.0.1" and args.max_batch == 2
  assert cli.main(["serve", "--model", str(model_dir), "--max-context", "1"]) == 2
  assert "--max-context" in capsys.readouterr().err


# ------------------------------------------------------------------ speculative decoding
def test_bole_server_greedy_matches_generate(model_dir, reference):
  """The tree-speculative engine behind the server: greedy output is the target's greedy output."""
  llm = LLM(model_dir, spec_options=dict(topk=2, depth=3, num_nodes=8))
  sched = Scheduler(llm, mode="bole", max_batch=2, max_context=64, segment_steps=4)
  srv = OpenAIServer(sched, model_name="tiny", port=0).start()
  try:
    outs = {}

    def run(i):
      outs[i] = _stream(srv, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    for i, ref in enumerate(reference[:3]):
      assert "".join(c["choices"][0]["text"] for c in outs[i][:-1]) == ref.text
    s = sched.stats()
    assert s["mode"] == "bole" and s["slot_steps"] > 0 and s["mean_tokens_per_step"] >= 1.0
    assert s["slot_bytes"]["drafter"] > 0
  finally:
    srv.shutdown()
