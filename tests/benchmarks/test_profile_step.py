"""benchmarks/profile/profile_step.py: its trace reading and aggregation on a real trace of a small
program (both trace formats), and the whole script on the tiny preset (CPU: host thunk events)."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "profile", "profile_step.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "profile"))

import profile_step as ps  # noqa: E402


def _loop(x, w):
    def body(i, y):
        y = jnp.tanh(y @ w)  # traced on this line: the op table must point here
        return jax.lax.cond(i % 2 == 0, lambda v: v * 2.0, lambda v: v - 1.0, y)

    return jax.lax.fori_loop(0, 4, body, x)


def test_trace_of_a_loop_program(tmp_path):
    """A jitted while loop (a dot, a conditional) traced 3 times beside another program: every
    reader sees the same kernel time, the other program and the control-flow thunks are left out,
    and the dot is a matmul attributed to its source line here."""
    x = jnp.ones((64, 128), jnp.float32)
    w = jnp.full((128, 128), 0.01, jnp.float32)
    exe = jax.jit(_loop).lower(x, w).compile()
    other = jax.jit(lambda a: jnp.sort(a, axis=0))  # an op the loop has not
    jax.block_until_ready((exe(x, w), other(x)))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            jax.block_until_ready(exe(x, w))
        jax.block_until_ready(other(x))

    text = exe.as_text()
    module, ops = ps.parse_hlo(text)
    assert module == "jit__loop" and any(op.opcode == "while" for op in ops.values())
    results = {}
    for reader in ("xplane", "json"):
        how, events = ps.read_trace(str(tmp_path), reader)
        assert how["reader"] == ("ProfileData.from_file" if reader == "xplane" else "trace.json.gz")
        results[reader] = r = ps.summarise(events, 3, text)
        assert r["module"] == module and r["busy_ms_per_rep"] > 0 and r["num_events"] > 0
        assert r["other_modules_ms"] and all(m != module for m in r["other_modules_ms"])
        for table in ("kernels", "hlo_ops", "categories", "sources"):
            assert r[table] and all(row["ms_per_rep"] > 0 for row in r[table]), table
            assert sum(row["share"] for row in r[table]) == pytest.approx(1.0)
        # only this module's ops (the other program's are not in its HLO), no control-flow thunks
        assert all(row["opcode"] for row in r["hlo_ops"])
        assert not {row["opcode"] for row in r["hlo_ops"]} & {"while", "conditional", "call"}
        assert r["attributed_share"] == pytest.approx(1.0)
        matmul = [row for row in r["hlo_ops"] if row["category"] == "matmul"]
        assert matmul and any("test_profile_step.py" in row["source"] for row in matmul)
        # the loop body runs 4 times per call
        assert max(row["calls_per_rep"] for row in matmul) == pytest.approx(4.0)
    assert results["xplane"]["busy_ms_per_rep"] == pytest.approx(results["json"]["busy_ms_per_rep"])


# A GPU trace as jax writes it (no GPU here): one compiled module, whose matmul runs on its own
# and whose fusion runs inside a command buffer (hlo_op: the buffer's call), a runtime memcpy
# with no module on another stream, another program's kernel, the derived "XLA Ops" /
# "XLA Modules" lines repeating the kernels, and a host thunk event.
GPU_HLO = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %loop_add_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_add, \
metadata={op_name="jit(step)/add" source_file="/w/bole_jax/model/layers.py" source_line=30}
  %custom-call.1 = f32[8]{0} custom-call(%p), custom_call_target="__cublas$gemm", \
metadata={op_name="jit(step)/dot_general" source_file="/w/bole_jax/model/layers.py" source_line=100}
  ROOT %call.2 = f32[8]{0} call(%loop_add_fusion.3), to_apply=%command_buffer
}
"""  # (a backslash at the end of a line joins it to the next: one instruction per line)


def _gpu_events(reps: int) -> list:
    """(plane, line, name, start_us, dur_us, stats) of `reps` executions, 1 ms apart."""
    gpu, mod = "/device:GPU:0", {"hlo_module": "jit_step"}
    out = []
    for t in (1000.0 * r for r in range(reps)):
        out += [
            (
                gpu,
                "Stream #13(Compute)",
                "nvjet_tst_64x8_64x16",
                t,
                100,
                {"hlo_op": "custom-call.1", **mod},
            ),
            (gpu, "Stream #14(MemcpyD2H)", "MemcpyD2H", t + 100, 20, {}),
            (
                gpu,
                "Stream #13(Compute)",
                "loop_add_fusion_3",
                t + 110,
                50,
                {"hlo_op": "call.2", **mod},
            ),
            (
                gpu,
                "Stream #13(Compute)",
                "copy_fusion",
                t + 300,
                30,
                {"hlo_op": "copy_fusion", "hlo_module": "jit__lambda"},
            ),
            (gpu, "XLA Ops", "custom-call.1", t, 100, {"hlo_op": "custom-call.1", **mod}),
            (gpu, "XLA Modules", "jit_step(7)", t, 160, {}),
            ("/host:CPU", "python", "custom-call.1", t, 5, {"hlo_op": "custom-call.1", **mod}),
        ]
    return out


def _write_both_formats(run, events) -> None:
    """The events as <run>/gpu.trace.json.gz and, through ProfileData's text-proto parser,
    <run>/gpu.xplane.pb."""
    planes = sorted({e[0] for e in events})
    lines = sorted({e[:2] for e in events})
    trace = [
        dict(ph="M", pid=planes.index(p), name="process_name", args=dict(name=p)) for p in planes
    ]
    trace += [
        dict(
            ph="M",
            pid=planes.index(p),
            tid=lines.index((p, ln)),
            name="thread_name",
            args=dict(name=ln),
        )
        for p, ln in lines
    ]
    trace += [
        dict(
            ph="X",
            pid=planes.index(p),
            tid=lines.index((p, ln)),
            name=name,
            ts=ts,
            dur=dur,
            args=stats,
        )
        for p, ln, name, ts, dur, stats in events
    ]
    with gzip.open(run / "gpu.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=trace), f)
    names = sorted({e[2] for e in events} | {k for e in events for k in e[5]})
    text = ""
    for p in planes:
        text += f'planes {{ id: {planes.index(p) + 1} name: "{p}"\n'
        for pl, ln in lines:
            if pl == p:
                text += f'  lines {{ id: {lines.index((pl, ln))} name: "{ln}" timestamp_ns: 0\n'
                for e in events:
                    if e[:2] == (pl, ln):
                        stats = " ".join(
                            f'stats {{ metadata_id: {names.index(k) + 1} str_value: "{v}" }}'
                            for k, v in e[5].items()
                        )
                        text += (
                            f"    events {{ metadata_id: {names.index(e[2]) + 1} "
                            f"offset_ps: {int(e[3] * 1e6)} duration_ps: {int(e[4] * 1e6)} {stats} }}\n"
                        )
                text += "  }\n"
        for i, n in enumerate(names, 1):
            text += f'  event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}\n'
            text += f'  stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}\n'
        text += "}\n"
    xspace = jax.profiler.ProfileData.text_proto_to_serialized_xspace(text)
    (run / "gpu.xplane.pb").write_bytes(xspace)


def test_gpu_shaped_trace(tmp_path):
    """Device path: stream kernels only (not the derived lines, not the host), the other program
    left out, the command-buffer kernel attributed to its fusion through its name, the same
    numbers from both formats."""
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    _write_both_formats(run, _gpu_events(2))
    results = {}
    for reader in ("xplane", "json"):
        results[reader] = r = ps.summarise(ps.read_trace(str(tmp_path), reader)[1], 2, GPU_HLO)
        assert r["events_from"] == "device" and r["module"] == "jit_step"
        assert r["busy_ms_per_rep"] == pytest.approx(0.170)  # 100 + 20 + 50 us
        assert r["active_ms_per_rep"] == pytest.approx(0.160)  # the memcpy overlaps the matmul
        assert r["other_modules_ms"] == {"jit__lambda": pytest.approx(0.060)}
        assert r["attributed_share"] == pytest.approx(150 / 170)
        ops = {row["hlo_op"]: row for row in r["hlo_ops"]}
        assert set(ops) == {"custom-call.1", "loop_add_fusion.3", "(no hlo_op)"}
        assert ops["custom-call.1"]["category"] == "matmul"
        assert ops["custom-call.1"]["source"] == "model/layers.py:100"
        assert ops["custom-call.1"]["calls_per_rep"] == 1.0
        assert ops["loop_add_fusion.3"]["kernels"] == ["loop_add_fusion_3"]
        assert ops["(no hlo_op)"]["category"] == "memcpy / memset"
        assert r["kernels"][0]["kernel"] == "nvjet_tst_64x8_64x16"
    assert results["xplane"] == results["json"]


def test_tensor_parallel_trace_counts_one_device(tmp_path):
    """Under --tp every device runs the same program: the tables count the first device only."""
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    one = _gpu_events(2)
    two = [("/device:GPU:1",) + e[1:] if e[0] == "/device:GPU:0" else e for e in one]
    _write_both_formats(run, one + two)
    r = ps.summarise(ps.read_trace(str(tmp_path), "json")[1], 2, GPU_HLO)
    assert r["busy_ms_per_rep"] == pytest.approx(0.170)
    assert r["other_modules_ms"] == {"jit__lambda": pytest.approx(0.060)}


def test_trace_reading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no profiler run"):
        ps.read_trace(str(tmp_path))
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "h.xplane.pb").write_bytes(b"not a proto")
    with pytest.raises(RuntimeError, match="xplane .*json: no"):
        ps.read_trace(str(tmp_path))


def test_category_patterns():
    assert ps.category("nvjet_tst_128x64_64x8 custom-call.3 custom-call __cublas$gemm") == "matmul"
    assert ps.category("bole_tree_gdn custom-call.1 custom-call __gpu$xla.gpu.triton") == (
        "tree kernels (pallas)"
    )
    assert ps.category("MemcpyD2H while.2 while") == "memcpy / memset"
    assert ps.category("loop_add_fusion_3 loop_add_fusion.3 fusion") == "fusion (other)"
    assert ps.category("ynn_fusion.3 ynn_fusion.3 fusion", "dot_general") == "matmul"
    kernels = ps.kernel_names({"loop_add_fusion.3": None, "input_reduce-fusion": None})
    assert kernels["loop_add_fusion_3"] == "loop_add_fusion.3"
    assert kernels["input_reduce_fusion"] == "input_reduce-fusion"


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--accept-mean", "6.4", "--depth", "3"], "mean tokens per step"),
        (["--preset", "nope", "--programs", "ar"], "unknown preset"),
    ],
)
def test_cli_errors(argv, msg, capsys):
    assert ps.main(["--compile-cache", "none", "--out", "none", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_cli_tp_refuses_stage_programs(capsys):
    with pytest.raises(SystemExit):
        ps.parse_args(["--tp", "2", "--programs", "ar", "verify"])
    assert "only the programs ar and step" in capsys.readouterr().err
    assert ps.parse_args(["--tp", "2", "--programs", "ar", "step"]).tp == 2


def test_cli_mode(capsys):
    assert ps.parse_args(["--programs", "step"]).mode == "bole"
    assert ps.parse_args(["--mode", "pernode", "--programs", "step", "commit"]).mode == "pernode"
    with pytest.raises(SystemExit):
        ps.parse_args(["--mode", "pernode", "--lazy-commit"])
    assert "--lazy-commit is bole's" in capsys.readouterr().err


def test_profile_step_tiny(tmp_path):
    """The script end to end on the tiny preset (AR loop: the cheapest program to compile; the
    spec programs go through the same profile_program)."""
    out, traces = tmp_path / "p.json", tmp_path / "traces"
    # Compile time dominates this test; what the tables hold does not depend on it.
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fast)
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--preset",
            "tiny",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--programs",
            "ar",
            "--reps",
            "2",
            "--warm",
            "1",
            "--draft-vocab",
            "0",
            "--compile-cache",
            "none",
            "--compile-workers",
            "1",
            "--top",
            "5",
            "--out",
            str(out),
            "--trace-dir",
            str(traces),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "by category" in r.stdout and "by HLO op" in r.stdout
    res = json.loads(out.read_text())
    assert res["command"] and {"device", "jax", "git_commit"} <= set(res["env"])
    ((name, prog),) = res["programs"].items()
    assert name == "ar" and prog["module"] == "jit_run_segment" and prog["reps"] == 2
    assert prog["wall_ms_per_rep"] > 0 and prog["busy_ms_per_rep"] > 0
    for table in ("kernels", "hlo_ops", "categories", "sources"):
        assert prog[table] and all(row["ms_per_rep"] > 0 for row in prog[table]), table
    assert any(row["source"].startswith("model/") for row in prog["hlo_ops"])
    assert list(traces.glob("ar/plugins/profile/*/*.xplane.pb"))


def test_stage_of_and_command_buffer_stage():
    assert ps.stage_of("jit(run_segment)/while/body/stage_draft/while/body/dot_general") == "draft"
    assert ps.stage_of("jit(run_segment)/while/body/stage_ar/add") == "ar"
    assert ps.stage_of("jit(run_segment)/while/cond/lt") == ""
    hlo = """HloModule jit_run_segment

%command_buffer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %f.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fa, \
metadata={op_name="jit(run_segment)/while/body/stage_verify/add"}
}

%mixed (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %f.2 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fa, \
metadata={op_name="jit(run_segment)/while/body/stage_draft/add"}
  ROOT %f.3 = f32[8]{0} fusion(%f.2), kind=kLoop, calls=%fa, \
metadata={op_name="jit(run_segment)/while/body/stage_emit/add"}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %call.1 = f32[8]{0} call(%p), to_apply=%command_buffer
  ROOT %call.2 = f32[8]{0} call(%call.1), to_apply=%mixed
}
"""
    _, ops = ps.parse_hlo(hlo)
    assert ops["f.1"].stage == "verify" and ops["call.1"].stage == "verify"
    assert ops["call.2"].stage == "mixed(draft+emit)"
    # kernels per stage: the fusions of the called computations, not the calls or parameters
    assert ps.hlo_stage_counts(hlo) == {
        "draft": {"fusion": 1},
        "emit": {"fusion": 1},
        "verify": {"fusion": 1},
    }


def test_between_stages():
    """A kernel of no stage takes the stage of the kernels on both sides of it where they agree;
    at a stage boundary and at either end it stays unattributed."""
    assert ps.between_stages([]) == []
    assert ps.between_stages(["", "draft", "", "", "draft", "", "verify", "", ""]) == [
        "",
        "draft",
        "draft",
        "draft",
        "draft",
        "",
        "verify",
        "",
        "",
    ]
    assert ps.between_stages(["ar", "", "ar", "mixed(a+b)", "", "ar"]) == [
        "ar",
        "ar",
        "ar",
        "mixed(a+b)",
        "",
        "ar",
    ]


def test_stage_split_sums_to_the_timed_step():
    """With the timed step given (the traced program is a twin compiled for the trace), the idle
    row is that step less the traced busy time and the rows sum to the step; without it, idle is
    the trace's wall - active."""
    r = dict(
        stages=[
            dict(stage="draft", ms_per_rep=2.0, calls_per_rep=40.0),
            dict(stage="verify", ms_per_rep=5.0, calls_per_rep=12.0),
            dict(stage="other", ms_per_rep=0.5, calls_per_rep=3.0),
        ],
        wall_ms_per_rep=12.0,
        busy_ms_per_rep=7.5,
        active_ms_per_rep=7.5,
    )
    rows = {x["stage"]: x for x in ps.stage_split(r, ("draft", "verify"), step_ms=8.0)}
    assert rows["idle"]["ms_per_step"] == pytest.approx(0.5)
    assert [rows[k]["kernels_per_step"] for k in ("draft", "verify", "other")] == [40, 12, 3]
    assert sum(x["ms_per_step"] for x in rows.values()) == pytest.approx(8.0)
    assert rows["verify"]["share_of_wall"] == pytest.approx(5.0 / 8.0)
    rows = {x["stage"]: x for x in ps.stage_split(r, ("draft", "verify"))}
    assert rows["idle"]["ms_per_step"] == pytest.approx(4.5)


def test_stage_floor_is_the_longer_of_bytes_and_flops():
    """A stage's floor time is its bytes at the peak bandwidth, or its matmul flops at the peak
    rate where those take longer (bound "compute"); x_floor is over that floor."""
    r = dict(
        stages=[dict(stage="draft", ms_per_rep=4.0), dict(stage="verify", ms_per_rep=6.0)],
        wall_ms_per_rep=10.0,
        busy_ms_per_rep=10.0,
        active_ms_per_rep=10.0,
    )
    floors = dict(draft=1e9, verify=3e9)  # 1 / 3 GB: 0.25 / 0.75 ms at 4000 GB/s
    flops = dict(draft=1e12, verify=1e12)  # 1 TFLOP: 2 ms at 500 TFLOP/s
    rows = {
        x["stage"]: x
        for x in ps.stage_split(r, ("draft", "verify"), floors, 4000.0, flops=flops, tflops=500.0)
    }
    d, v = rows["draft"], rows["verify"]
    assert d["bound"] == v["bound"] == "compute"
    assert d["floor_ms"] == pytest.approx(2.0) and d["x_floor"] == pytest.approx(2.0)
    assert d["floor_gflop"] == pytest.approx(1000.0)
    flops["verify"] = 1e11  # 0.2 ms of matmuls < 0.75 ms of bytes
    rows = {
        x["stage"]: x
        for x in ps.stage_split(r, ("draft", "verify"), floors, 4000.0, flops=flops, tflops=500.0)
    }
    assert rows["verify"]["bound"] == "bytes"
    assert rows["verify"]["floor_ms"] == pytest.approx(0.75)
    assert rows["verify"]["flop_floor_ms"] == pytest.approx(0.2)
    rows = {x["stage"]: x for x in ps.stage_split(r, ("draft",), floors, 4000.0, flops=flops)}
    assert rows["draft"]["bound"] == "bytes" and "flop_floor_ms" not in rows["draft"]


def test_stage_floor_flops_counts_the_rows_each_stage_multiplies():
    """Draft: B rows at the root's level, B x topk at each level below; verify: B x N rows, or the
    budget's packed rows; both over the weight matrices (vectors left out)."""
    from bole_jax.llm import LLM
    from bole_jax.measure import bench
    from bole_jax.model import ModelConfig, init_params
    from bole_jax.spec_decode.step import SpecConfig

    cfg = ModelConfig.tiny("qwen3_5", mtp_num_layers=1)
    params = init_params(cfg, jax.random.key(0), "float32")
    llm = LLM(cfg, params=params, max_batch_size=4)
    spec = SpecConfig.for_mode("bole", topk=3, depth=4, num_nodes=8, budget=20)
    state = llm.start_batch([[1, 2, 3]] * 4, 8)  # the floors read only its batch rows
    f = bench.stage_floor_flops(cfg, params, state, spec)
    mats = lambda t: sum(x.size for x in jax.tree.leaves(t) if x.ndim >= 2)  # noqa: E731
    target = mats({k: v for k, v in params.items() if k not in ("embed", "mtp")})
    draft_w = mats(params["mtp"]) + (0 if cfg.tie_word_embeddings else params["lm_head"].size)
    assert f["draft"] == 2 * draft_w * 4 * (1 + 3 * 3)
    assert f["verify"] == 2 * target * 20  # packed: the budget's 20 rows, not 4 x 8
    nobudget = SpecConfig.for_mode("bole", topk=3, depth=4, num_nodes=8)
    assert bench.stage_floor_flops(cfg, params, state, nobudget)["verify"] == 2 * target * 32
    assert bench.stage_floor_flops(cfg, params, state, None) == dict(ar=2 * target * 4)
    assert bench.peak_tflops("bfloat16", "NVIDIA H200") == 989.0
    assert bench.peak_tflops("float32", "NVIDIA H200") is None


def test_trace_compiler_options_are_valid():
    """The options the bench compiles its traced twin with are options XLA knows, with values it
    accepts (XLA checks them on any backend: a typo would fail only on the GPU otherwise)."""
    from bole_jax.measure import bench

    low = jax.jit(lambda x: x * 2.0).lower(jnp.ones(3))
    assert bench.TRACE_COMPILER_OPTIONS
    for opts in bench.TRACE_COMPILER_OPTIONS.values():
        assert float(low.compile(compiler_options=opts)(jnp.ones(3))[0]) == 2.0
    with pytest.raises(Exception, match="compile option"):
        low.compile(compiler_options={"xla_gpu_enable_command_bufferz": ""})


def test_loop_stage_split_tiny(tmp_path):
    """The engine's AR and bole loops on the tiny preset (CPU: host thunk events): the split of
    the loop's kernel time covers every stage, the stage rows and "other" sum to the busy time,
    little is left to "other", the idle row is wall - active, and each stage has its floor."""
    out = tmp_path / "p.json"
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fast)
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--preset",
            "tiny",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--nodes",
            "4",
            "--depth",
            "3",
            "--topk",
            "2",
            "--accept-mean",
            "2.5",
            "--programs",
            "ar",
            "step",
            "--reps",
            "3",
            "--warm",
            "1",
            "--draft-vocab",
            "0",
            "--compile-cache",
            "none",
            "--compile-workers",
            "1",
            "--top",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in-loop stage split of step" in r.stdout
    res = json.loads(out.read_text())
    for name, stages in (("ar", ("ar",)), ("step", ps.STAGES)):
        prog = res["programs"][name]
        rows = {row["stage"]: row for row in prog["stage_split"]}
        assert list(rows) == [*stages, "other", "idle"]
        for st in stages:
            assert rows[st]["ms_per_step"] > 0 and rows[st]["floor_mib"] > 0, (name, st)
        busy = sum(rows[st]["ms_per_step"] for st in (*stages, "other"))
        assert busy == pytest.approx(prog["busy_ms_per_rep"], rel=1e-6)
        # Most kernel time is attributed to a stage ("other" is the loop's cond and copies). CPU
        # host-thunk times are noisy under load (0.25 of busy seen on 2 busy cores), so the bound
        # only catches a broken attribution, which leaves nearly everything in "other".
        assert rows["other"]["ms_per_step"] < 0.4 * busy, rows["other"]
        assert rows["idle"]["ms_per_step"] == pytest.approx(
            max(prog["wall_ms_per_rep"] - prog["active_ms_per_rep"], 0.0), abs=1e-9
        )
        assert prog["active_ms_per_rep"] <= prog["wall_ms_per_rep"]


def test_bench_e2e_profile_loop(tmp_path, monkeypatch):
    """`bole-jax bench --profile-loop`: every point's row holds the in-loop stage split of its
    loop (ar: the AR step; bole: the six stages), with floors, and the output prints it. Every
    trace is taken after the last timed window (no timed window follows a trace)."""
    from bole_jax.measure import bench
    from bole_jax.serving import cli

    calls = []
    for name in ("timed_segment", "loop_profile"):

        def logged(*args, _f=getattr(bench, name), _name=name, **kw):
            calls.append(_name)
            return _f(*args, **kw)

        monkeypatch.setattr(bench, name, logged)

    args = cli.build_parser().parse_args(
        [
            "bench",
            "--preset",
            "tiny",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--quick",
            "--compile-cache",
            "none",
            "--compile-workers",
            "1",
            "--depth",
            "2",
            "--topk",
            "2",
            "--nodes",
            "4",
            "--budget",
            "none",
            "--accept-mean",
            "2.5",
            "--breakdown-batch",
            "0",
            "--modes",
            "ar",
            "bole",
            "--profile-loop",
            "3",
            "--no-plots",
            "--out",
            str(tmp_path),
        ]
    )
    res = bench.run_e2e(args)
    assert res["errors"] == [] and res["skipped"] == []
    assert calls == ["timed_segment"] * 2 + ["loop_profile"] * 2
    rows = {r["mode"]: r for r in res["rows"]}
    for m, stages in (("ar", ("ar",)), ("bole", ps.STAGES)):
        lp = rows[m]["loop_profile"]
        assert lp["steps"] == 3 and lp["wall_ms_per_step"] > 0
        assert lp["traced"] == "timed program"  # CPU: no twin (no command buffers there)
        split = {x["stage"]: x for x in lp["stage_split"]}
        assert list(split) == [*stages, "other", "idle"]
        assert all(split[st]["ms_per_step"] > 0 and split[st]["floor_mib"] > 0 for st in stages)
        assert all(split[st]["kernels_per_step"] > 0 for st in stages)
        assert lp["top_ops"] and all(op["calls_per_rep"] > 0 for op in lp["top_ops"])
        assert sum(split[st]["ms_per_step"] for st in (*stages, "other")) == pytest.approx(
            lp["busy_ms_per_step"], rel=1e-6
        )
        # the idle row closes the timed step (CPU host threads can be busier than the wall)
        assert lp["step_ms"] == rows[m]["step_ms"]
        assert split["idle"]["ms_per_step"] == pytest.approx(
            max(lp["step_ms"] - lp["busy_ms_per_step"], 0.0)
        )
    # the printed split leads with the timed step its rows sum to; the traced wall comes last
    printed = bench.print_loop_profiles(res["rows"]).splitlines()
    head = [c.strip() for c in printed[0].split("|")]
    assert head[:3] == ["batch", "mode", "step_ms"] and head[-2:] == ["traced_wall_ms", "kernels"]
    assert rows["bole"]["ar_agreement"] == 1.0  # the profiled steps are decode steps too
    saved = json.loads((tmp_path / "e2e_tiny.json").read_text())
    assert saved["rows"][1]["loop_profile"]["stage_split"]
