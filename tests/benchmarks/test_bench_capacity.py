"""benchmarks/bench_capacity.py on CPU: the memory plan decides each mode's batch, every mode
is timed at it, and the JSON records the plan beside the throughput."""

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(__file__)


def _load():
    path = os.path.join(HERE, "..", "..", "benchmarks", "bench_capacity.py")
    spec = importlib.util.spec_from_file_location("bench_capacity", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capacity_bench_tiny(tmp_path):
    cap = _load()
    out = tmp_path / "cap"
    argv = ["--preset", "tiny", "--memory-gb", "0.004", "--context", "256"]
    argv += ["--fractions", "1", "0.5", "--accept-mean", "2.5", "--nodes", "4", "--depth", "2"]
    argv += ["--topk", "2", "--steps", "3", "--warm", "1", "--prompt-len", "8"]
    argv += ["--max-batch", "8", "--compile-workers", "2", "--compile-cache", "none"]
    argv += ["--budget", "none", "--out", str(out), "--no-plots"]
    assert cap.main(argv) == 0
    rec = json.loads((out / "capacity_tiny.json").read_text())
    assert rec["command"] and {"device", "jax", "git_commit"} <= set(rec["env"])
    full, half = rec["rows"]
    assert (full["fraction"], half["fraction"]) == (1.0, 0.5)
    for row in (full, half):
        for m in cap.MODES:
            c = row[m]
            assert c["error"] is None and c["tokens_per_s"] > 0, (m, c)
            # each mode is timed at exactly the batch the budget admits, capped by --max-batch
            assert c["batch"] == min(c["admitted"], 8) and c["batch"] >= 1
            # what the plan admits fits the budget (one request kept back for the prefill), and
            # one more request would not
            budget_mib = row["budget_gib"] * 1024
            assert (c["admitted"] + 1) * c["request_mib"] <= budget_mib + 1e-6
            assert (c["admitted"] + 2) * c["request_mib"] > budget_mib
            # checked against the compiled loop too: its temporaries replace the estimate
            assert c["step_temp_mib"] > 0 and isinstance(c["fits_compiled"], bool), c
            state = c["request_mib"] - c["parts_mib"]["step_transient"]
            need = (c["batch"] + 1) * state + c["parts_mib"]["step_transient"] + c["step_temp_mib"]
            assert c["compiled_need_gib"] == pytest.approx(need / 1024)
            assert c["fits_compiled"] == (need <= row["budget_gib"] * 1024)
        # per-node states cost more than factors: pernode never admits more than bole
        assert row["pernode"]["request_mib"] > row["bole"]["request_mib"]
        assert row["pernode"]["admitted"] <= row["bole"]["admitted"]
        # the bole chain holds factors for depth + 1 nodes, the chain a state per position
        assert row["chain"]["request_mib"] > row["bole-chain"]["request_mib"]
        assert row["chain"]["admitted"] <= row["bole-chain"]["admitted"]
    assert half["pernode"]["admitted"] < full["pernode"]["admitted"]

    # --merge: the rows of separate runs in one table and JSON, each with its source
    other = dict(rec, rows=[half], command="second run")
    (tmp_path / "b.json").write_text(json.dumps(other))
    merged = tmp_path / "merged"
    srcs = [str(out / "capacity_tiny.json"), str(tmp_path / "b.json")]
    argv_m = ["--merge", *srcs, "--out", str(merged), "--no-plots"]
    assert cap.main(argv_m) == 0
    m = json.loads((merged / "capacity_tiny.json").read_text())
    assert [s["command"] for s in m["sources"]] == [rec["command"], "second run"]
    assert [(r["fraction"], r["source"]) for r in m["rows"]] == [
        (1.0, srcs[0]),
        (0.5, srcs[0]),
        (0.5, srcs[1]),
    ]
    assert m["rows"][1]["bole"] == half["bole"]
    # runs of another preset or context are refused
    (tmp_path / "c.json").write_text(json.dumps(dict(rec, args=dict(rec["args"], context=512))))
    with pytest.raises(SystemExit, match="differ"):
        cap.main(["--merge", srcs[0], str(tmp_path / "c.json"), "--out", str(merged)])


def test_capacity_bench_rejects_bad_context():
    cap = _load()
    with pytest.raises(SystemExit):
        cap.parse(["--context", "1000"])
