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


def _table(cfg, chain_ms: float) -> dict:
    """A hand-made calibration table of the tiny preset: at batch 8 and KV 256, ar at 1 ms a
    step and a depth-1 chain at `chain_ms`."""
    from bole_jax.measure import calibrate
    from bole_jax.spec_decode import budget

    ident = dict(model="tiny", drafter="synthetic p=0.5000")
    rows = [
        dict(mode="ar", nodes=1, depth=0, topk=1, step_ms=1.0),
        dict(mode="chain", nodes=2, depth=1, topk=1, step_ms=chain_ms),
    ]
    return dict(
        format=budget.TABLE_FORMAT,
        device=budget.device_name(),
        jax="x",
        identity=ident,
        key="k",
        model=calibrate.model_signature(cfg, "float32"),
        drafter="synthetic p=0.5000",
        depths=[1, 2],
        entries=[dict(batch=8, kv=256, context=256, candidates=rows)],
    )


@pytest.mark.parametrize("chain_ms, same_as", [(1.0, None), (100.0, "ar")])
def test_capacity_bench_engine_row(tmp_path, chain_ms, same_as):
    """--calibration: the engine row is the table's choice at --max-batch and --context (what
    `bole-jax serve` decodes with), at the batch that configuration admits under the budget:
    timed on its own where it is none of the grid's configurations (a depth-1 chain against the
    grid's depth 2), else the grid row of the same configuration (ar)."""
    from bole_jax.model.presets import preset

    cap = _load()
    (tmp_path / "t.json").write_text(json.dumps(_table(preset("tiny", mtp=True), chain_ms)))
    out = tmp_path / "cap"
    argv = ["--preset", "tiny", "--memory-gb", "0.004", "--context", "256", "--fractions", "1"]
    argv += ["--accept-mean", "2.5", "--nodes", "4", "--depth", "2", "--topk", "2"]
    argv += ["--steps", "2", "--warm", "1", "--prompt-len", "8", "--max-batch", "8"]
    argv += ["--modes", "ar", "chain", "--compile-workers", "2", "--compile-cache", "none"]
    argv += ["--calibration", str(tmp_path / "t.json"), "--out", str(out), "--no-plots"]
    assert cap.main(argv) == 0
    (row,) = json.loads((out / "capacity_tiny.json").read_text())["rows"]
    e = row["engine"]
    assert e["same_as"] == same_as
    if same_as is None:
        assert e["choice"] == dict(mode="chain", nodes=2, depth=1, topk=1, budget=None)
        # a depth-1 chain's verify holds fewer state snapshots than the grid's depth 2
        assert e["request_mib"] < row["chain"]["request_mib"]
        assert e["admitted"] >= row["chain"]["admitted"]
        assert e["tokens_per_s"] > 0 and e["tokens_per_s"] != row["chain"]["tokens_per_s"]
    else:
        assert e["choice"]["mode"] == "ar"
        for k in ("admitted", "batch", "request_mib", "tokens_per_s", "step_ms"):
            assert e[k] == row["ar"][k], k
    assert e["batch"] == min(e["admitted"], 8) and e["error"] is None


def test_the_engine_row_looks_its_choice_up_again_at_the_slots_admitted():
    """As the server does: the choice at --max-batch (ar, at the 64-row bucket), then, since ar's
    admitted slots are a smaller bucket, the choice there (the depth-1 chain at 16 rows), kept
    where it admits a request; with room for none of the chain, ar stays."""
    from bole_jax.model.presets import preset
    from bole_jax.spec_decode.acceptance import synthetic_accept_prob

    cap = _load()
    cfg = preset("tiny", mtp=True)
    t = _table(cfg, 1.0)
    fast, slow = t["entries"][0]["candidates"]
    t["entries"] = [
        dict(batch=16, kv=256, context=256, candidates=[fast, slow]),
        dict(batch=64, kv=256, context=256, candidates=[fast, dict(slow, step_ms=9.0)]),
    ]
    a = cap.parse(["--preset", "tiny", "--context", "256", "--max-batch", "64", "--depth", "2"])
    p = synthetic_accept_prob(2.5, 2)
    table = cap.calibrate.rescore_synthetic(t, cap.expected_tokens_per_step(p, 2))
    gen = 1 + (a.warm + a.steps) * 3
    ar = cap.admitted(cfg, a, p, "float32", 2**21, gen, {"ar": None})["ar"]
    assert 1 <= ar[0] <= 16  # ar admits a 16-row bucket's worth at 2 MiB
    e = cap.engine_plan(table, a, p, cfg, "float32", 2**21, gen)
    assert e["choice"]["mode"] == "chain" and e["choice"]["depth"] == 1, e["choice"]
    assert 1 <= e["plan"][0] < ar[0]  # the chain's verify snapshots cost more per request
    # at the 64-row bucket alone (enough memory for 64 requests) the choice is ar
    big = cap.engine_plan(table, a, p, cfg, "float32", 2**30, gen)
    assert big["choice"]["mode"] == "ar" and big["plan"][0] == 64
    # room for ar's request but not for the chain's: ar stays
    ar_bytes, chain_bytes = (
        sum(cap.admitted(cfg, a, p, "float32", 2**30, gen, {"x": s})["x"][2].values())
        for s in (None, cap.engine_choice(table, a, p, 16)[1])
    )
    assert chain_bytes > ar_bytes
    tight = cap.engine_plan(table, a, p, cfg, "float32", int(2 * ar_bytes + 1), gen)
    assert tight["choice"]["mode"] == "ar" and tight["plan"][0] == 1


def test_capacity_bench_refuses_a_table_of_other_dims(tmp_path):
    from bole_jax.model.presets import preset

    cap = _load()
    t = _table(preset("tiny", mtp=True), 1.0)
    t["model"] = dict(t["model"], hidden_size=1)
    (tmp_path / "t.json").write_text(json.dumps(t))
    argv = ["--preset", "tiny", "--memory-gb", "0.004", "--context", "256"]
    with pytest.raises(SystemExit, match="other model dims"):
        cap.main([*argv, "--calibration", str(tmp_path / "t.json"), "--out", str(tmp_path)])
