"""The online benchmark's pieces without a model: session data and builder, statistics, and the
streaming client + session replay against a stub SSE server (benchmarks/bench_online.py)."""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
    ),
)

import bench_online as bo  # noqa: E402
import build_agent_sessions as bas  # noqa: E402


# ------------------------------------------------------------------ data
@pytest.fixture(scope="module")
def sessions():
    return bo.load_sessions(bo.DEFAULT_SESSIONS, tool_docs="compact")


def test_committed_sessions_file(sessions):
    assert os.path.getsize(bo.DEFAULT_SESSIONS) < 2 * 2**20
    by_source = {}
    for s in sessions:
        by_source.setdefault(s.id.split("/")[0], []).append(s)
        assert s.num_calls >= 1
        roles = {m["role"] for m in s.messages}
        assert roles <= {"user", "assistant", "tool"}
        assert s.messages[0]["role"] == "user" and s.messages[-1]["role"] == "assistant"
    assert len(by_source["bfcl"]) == 200 and len(by_source["spec_bench"]) == 80
    # Every recorded tool call is followed by its (executed) output, and no call failed to run.
    for s in by_source["bfcl"]:
        for m, nxt in zip(s.messages, s.messages[1:]):
            if m["role"] == "assistant" and m["content"] is not None:
                assert m["content"].startswith("[") and nxt["role"] == "tool"
                assert not nxt["content"].startswith("Error during execution")


def test_tool_docs_render_and_exclusions():
    full = bo.load_sessions(bo.DEFAULT_SESSIONS, sources=("bfcl",), tool_docs="json")
    s = next(x for x in full if x.id == "bfcl/multi_turn_base_0")  # excludes GorillaFileSystem.cp
    assert '"name": "mv"' in s.system and '"name": "cp"' not in s.system
    compact = bo.load_sessions(bo.DEFAULT_SESSIONS, sources=("bfcl",), tool_docs="compact")
    c = next(x for x in compact if x.id == s.id)
    assert "\n- mv(source: string, destination: string): " in c.system
    assert "\n- cp(" not in c.system and len(c.system) < len(s.system) / 3
    with pytest.raises(ValueError, match="unknown tool format"):
        bo.render_tools([], "xml")


def test_builder_parses_and_executes_calls_without_eval(tmp_path):
    assert bas.parse_call("mv(source='a', destination=\"b\")") == (
        "mv",
        [],
        dict(source="a", destination="b"),
    )
    assert bas.parse_call("sort('f.txt')") == ("sort", ["f.txt"], {})
    for bad in ("os.system('x')", "f(g(1))", "1 + 2", "f(**kw)"):
        with pytest.raises(ValueError):
            bas.parse_call(bad)

    class Api:
        def add(self, a, b=0):
            return {"sum": a + b}

        def _private(self):
            return "no"

    inst = {"Api": Api()}
    assert json.loads(bas.execute_call("add(1, b=2)", inst)) == {"sum": 3}
    assert bas.execute_call("_private()", inst).startswith("Error during execution")
    assert bas.execute_call("nope()", inst).startswith("Error during execution")
    assert bas.clip("x" * 10, 4) == "xxxx ... [6 chars cut]"

    q = tmp_path / "q.jsonl"
    q.write_text(
        json.dumps(dict(question_id=1, category="writing", turns=["a", "b"]))
        + "\n"
        + json.dumps(dict(question_id=2, category="qa", turns=["c"]))
        + "\n"
    )
    (s,) = bas.spec_bench_sessions(str(q))
    assert [m["role"] for m in s["messages"]] == ["user", "assistant", "user", "assistant"]
    assert s["messages"][1]["content"] is None


# ------------------------------------------------------------------ statistics
def test_percentiles_and_summary():
    p = bo.percentiles([None, 4.0, 1.0, 3.0, 2.0])
    assert p == dict(p50=2.5, p90=pytest.approx(3.7), p99=pytest.approx(3.97), mean=2.5)
    assert bo.percentiles([]) == dict(p50=None, p90=None, p99=None, mean=None)

    def call(ttft, tpot, prompt, cached, comp, status="ok"):
        return dict(
            ttft=ttft,
            tpot=tpot,
            latency=ttft + tpot * (comp - 1),
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=comp,
            status=status,
            error=None if status == "ok" else "x",
        )

    calls = [
        call(0.1, 0.01, 100, 0, 11),
        call(0.3, 0.03, 300, 200, 21),
        call(0, 0, None, None, 0, status="context"),
        call(0, 0, None, None, 0, status="cut"),  # still running when the replay's window ended
        call(0, 0, None, None, 0, status="error"),
    ]
    deltas = bo.metric_deltas(
        {"bole_decode_tokens_total": 10, "bole_decode_slot_steps_total": 5},
        {
            "bole_decode_tokens_total": 40,
            "bole_decode_slot_steps_total": 15,
            "bole_prefix_cache_hits_total": 3,
            "bole_prefix_cache_query_tokens_total": 400,
            "bole_prefix_cache_cached_tokens_total": 100,
        },
    )
    r = bo.summarize(calls, wall_s=2.0, deltas=deltas)
    assert (r["calls"], r["ok"], r["errors"], r["cut"], r["ctx_end"]) == (5, 2, 1, 1, 1)
    assert r["out_tok_per_s"] == 16.0 and r["req_per_s"] == 1.0
    assert r["ttft_p50"] == pytest.approx(0.2) and r["tpot_mean"] == pytest.approx(0.02)
    assert r["prefix_hit_rate"] == 0.5  # 200 of 400 prompt tokens
    assert r["tokens_per_step"] == 3.0
    assert r["server_prefix_hit_rate"] == 0.25 and len(r["server_prefix_metrics"]) == 3
    assert bo.summarize(calls[:1], 1.0)["prefix_hit_rate"] == 0.0
    assert bo.summarize([call(0.1, 0.01, 100, None, 5)], 1.0)["prefix_hit_rate"] is None

    rows = [
        dict(mode=m, rate=1.0, **{f"{n}_p{q}": v for n in ("ttft", "tpot") for q in bo.PCTS})
        for m, v in (("bole", 1.0), ("pernode", 4.0), ("engine", 2.0))
    ]
    (red,) = bo.reductions(rows, "pernode")
    assert red["ttft_p50"] == pytest.approx(-0.75) and red["vs"] == "pernode"
    (red,) = bo.reductions(rows, "pernode", "engine")  # the server's own choice, too
    assert red["ttft_p50"] == pytest.approx(-0.5) and red["mode"] == "engine"


def test_prometheus_parsing_and_arrivals():
    m = bo.parse_prometheus('# HELP x y\nbole_a_total 3\nbole_h_bucket{le="0.5"} 2\nbad line x\n')
    assert m == {"bole_a_total": 3.0, 'bole_h_bucket{le="0.5"}': 2.0}
    t = bo.arrival_times(5.0, 200.0, None, np.random.default_rng(0))
    assert all(0 < a < b < 200 for a, b in zip(t, t[1:]))
    assert len(t) / 200.0 == pytest.approx(5.0, rel=0.1)
    assert len(bo.arrival_times(5.0, 200.0, 7, np.random.default_rng(0))) == 7
    a = SimpleNamespace(seed=0, rates=[1.0, 2.0], duration=10.0, max_sessions=3)
    s1, s2 = bo.schedules_for(a, 5), bo.schedules_for(a, 5)
    assert s1 == s2 and s1[0][0] + s1[1][0] == [s1[0][0][0]] + s1[0][0][1:] + s1[1][0]
    assert len(set(s1[0][0] + s1[1][0][:2])) == 5  # the second rate continues the order


# ------------------------------------------------------------------ client + replay
class _StubHandler(BaseHTTPRequestHandler):
    """Streams "a", "b", "c" as a chat completion; 400 context_length_exceeded when the history
    has more than `limit` messages."""

    limit = 99
    stall = 0.0  # seconds to wait after the first token (a call the replay has to cut)
    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if len(body["messages"]) > self.limit:
            err = json.dumps({"error": {"message": "too long", "code": "context_length_exceeded"}})
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err.encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        head = {"object": "chat.completion.chunk"}
        events = [
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        ]
        events += [{**head, "choices": [{"index": 0, "delta": {"content": c}}]} for c in "abc"]
        events += [
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
            {
                **head,
                "choices": [],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 4},
                },
            },
        ]
        for i, e in enumerate(events):
            self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.flush()
            if i == 1 and self.stall:
                time.sleep(self.stall)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub():
    handler = type("H", (_StubHandler,), {"seen": [], "limit": 99, "stall": 0.0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def _replay_args(**kw):
    """The replay's settings (bench_online's argparse namespace) for a stub server."""
    base = dict(max_calls=None, max_tokens=3, temperature=0.0, think_time=0.0, progress_interval=60)
    return SimpleNamespace(**base, **kw)


def test_chat_stream_and_session_replay(stub):
    url, handler = stub
    r = bo.chat_stream(url, {"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert (r["status"], r["text"], r["chunks"], r["finish_reason"]) == ("ok", "abc", 3, "length")
    assert (r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"]) == (10, 3, 4)
    assert r["t_send"] <= r["t_first"] <= r["t_last"] <= r["t_end"]

    s = bo.Session(
        "x/1",
        "test",
        "SYS",
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "[f()]"},
            {"role": "tool", "content": "out"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": None},
        ],
    )
    a = _replay_args(request_timeout=10, duration=1.0, drain_timeout=10.0)
    handler.limit = 5  # the third call (6 messages with the system prompt) is over the limit
    calls, wall = bo.Replay(url, a, "t").run([s], [0.0])
    assert [c["status"] for c in calls] == ["ok", "ok", "context"]
    # Recorded answers enter the history as recorded, unrecorded ones as generated.
    hist = handler.seen[-1]["messages"]
    assert [m["role"] for m in hist] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert hist[2]["content"] == "[f()]" and hist[4]["content"] == "abc"
    assert calls[0]["ttft"] > 0 and calls[0]["tpot"] >= 0 and calls[0]["cached_tokens"] == 4
    row = bo.summarize(calls, wall)
    assert (row["ok"], row["ctx_end"], row["prefix_hit_rate"]) == (2, 1, 0.4)


def test_merge_keeps_the_other_modes(tmp_path, stub):
    url, _ = stub
    a = bo.build_parser().parse_args(["--out", str(tmp_path), "--no-plots", "--merge"])
    bo.resolve_args(a)
    s = bo.Session(
        "x/1",
        "test",
        "SYS",
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": None}],
    )
    path = str(tmp_path / "online_t.json")
    for mode in ("pernode", "bole"):  # two invocations, one mode each
        calls, wall = bo.Replay(url, a, mode).run([s], [0.0])
        rows = [
            dict(mode=mode, rate=1.0, sessions=1, **bo.summarize(calls, wall), calls_detail=calls)
        ]
        servers, runs = (
            {mode: {}},
            [
                dict(
                    command="c",
                    env={},
                    interrupted=None,
                    modes=[mode],
                    config={k: getattr(a, k) for k in bo.SAME},
                )
            ],
        )
        if os.path.exists(path):
            rows, servers, runs = bo.merge_result(path, a, rows, servers, runs)
        bo.report(rows, servers, runs, a, "t", path, {})
    out = json.load(open(path))
    assert [r["mode"] for r in out["rows"]] == ["pernode", "bole"] and len(out["runs"]) == 2
    assert set(out["calls"]) == {"pernode@1", "bole@1"}
    assert out["reductions"][0]["vs"] == "pernode"


def test_mode_server_args():
    """--mode-server-arg: flags for one mode's server, after the common --server-arg ones."""
    a = bo.build_parser().parse_args(
        [
            "--server-arg=--memory-gb=4",
            "--mode-server-arg",
            "pernode=--tree-nodes 64",
            "--mode-server-arg=pernode=--max-batch=8",
            "--mode-server-arg",
            "ar=",
        ]
    )
    bo.resolve_args(a)
    assert a.server_args == ["--memory-gb=4"]
    assert a.mode_server_args == {"pernode": ["--tree-nodes", "64", "--max-batch=8"], "ar": []}
    srv = bo.ServerProcess(
        "pernode", None, a.server_args + a.mode_server_args["pernode"], "/dev/null"
    )
    assert srv.cmd[-4:] == ["--memory-gb=4", "--tree-nodes", "64", "--max-batch=8"]
    for bad in ("pernode", "nope=--x"):
        a = bo.build_parser().parse_args(["--mode-server-arg", bad])
        with pytest.raises(ValueError, match="MODE=FLAGS"):
            bo.resolve_args(a)
    with pytest.raises(SystemExit):
        bo.main(["--mode-server-arg", "nope=--x"])


def test_preset_and_simulated_acceptance_reach_every_server():
    """--preset and --simulate-accept-mean go to every mode's `bole-jax serve`, before the
    --server-arg flags; the replay settings that --merge compares include them."""
    a = bo.build_parser().parse_args(
        ["--preset", "qwen3.5-27b", "--simulate-accept-mean", "3.5", "--server-arg=--max-batch=8"]
    )
    bo.resolve_args(a)
    args = bo.model_server_args(a)
    assert args == ["--preset", "qwen3.5-27b", "--simulate-accept-mean", "3.5"]
    srv = bo.ServerProcess("bole", None, args + a.server_args, "/dev/null")
    assert srv.cmd[-5:] == args + ["--max-batch=8"] and "--model" not in srv.cmd
    assert {"preset", "simulate_accept_mean"} <= set(bo.SAME)
    a = bo.build_parser().parse_args(["--model", "DIR", "--simulate-accept-mean", "2"])
    bo.resolve_args(a)
    assert bo.model_server_args(a) == ["--model", "DIR", "--simulate-accept-mean", "2.0"]
    for bad in (
        ["--url", "http://x:1", "--simulate-accept-mean", "2"],
        ["--simulate-accept-mean", "1"],
    ):
        a = bo.build_parser().parse_args(bad)
        with pytest.raises(ValueError, match="simulate-accept-mean"):
            bo.resolve_args(a)
    with pytest.raises(SystemExit):  # one source of weights
        bo.build_parser().parse_args(["--model", "DIR", "--preset", "tiny"])


def test_the_engine_server_makes_its_own_choice():
    """Mode `engine`: the server is started without --spec (it decodes its calibration table's
    choice, `--server-arg=--calibration=T`); every other mode names its --spec."""
    a = bo.build_parser().parse_args(
        ["--modes", "engine", "ar", "--server-arg=--calibration=T.json"]
    )
    bo.resolve_args(a)
    eng = bo.ServerProcess("engine", None, a.server_args, "/dev/null")
    assert "--spec" not in eng.cmd and eng.cmd[-1] == "--calibration=T.json"
    ar = bo.ServerProcess("ar", None, a.server_args, "/dev/null")
    assert ar.cmd[ar.cmd.index("--spec") + 1] == "ar"


def test_calls_cut_at_the_end_of_the_window_are_not_errors(stub):
    """A call still streaming 5 s past the drain window is cut by the replay: counted as "cut",
    not as a server error."""
    url, handler = stub
    handler.stall = 30.0
    s = bo.Session(
        "x/2",
        "test",
        "SYS",
        [{"role": "user", "content": "u"}] * 1 + [{"role": "assistant", "content": None}],
    )
    a = _replay_args(request_timeout=60, duration=0.2, drain_timeout=0.3)
    t0 = time.perf_counter()
    calls, wall = bo.Replay(url, a, "t").run([s], [0.0])
    assert time.perf_counter() - t0 < 20
    assert [(c["status"], c["error"]) for c in calls] == [
        ("cut", "still running at the end of the drain window")
    ]
    row = bo.summarize(calls, wall)
    assert (row["ok"], row["errors"], row["cut"]) == (0, 0, 1)
