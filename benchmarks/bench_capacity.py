"""Offline throughput at a fixed device-memory budget: each mode at the largest batch it admits.

    python benchmarks/bench_capacity.py --preset qwen3.5-27b --context 4096 --out DIR
    python benchmarks/bench_capacity.py --preset qwen3.5-9b --context 16384 --fractions 1 0.5
    python benchmarks/bench_capacity.py --preset tiny --memory-gb 0.05 --context 256 --quick  # CPU
    python benchmarks/bench_capacity.py --merge RUN1.json RUN2.json --out DIR  # one table

The serving engine's memory plan (`bole_jax.serving.memory`: per request the KV cache at
--context tokens, the GDN and conv states, the drafter's cache, and each mode's verify transient:
bole's token-level factors (also for the bole chain), pernode's and chain's full state per node)
decides, for each mode and
each budget, how many requests fit: budget = (free device memory after the weights) x 0.9 x
fraction, or --memory-gb. Each mode is then timed at its own largest batch (capped by
--max-batch) with `bole-jax bench`'s harness, one decode state on the device at a time, the KV of
every request filled to --context (filler rows that attention reads like real context). A mode
admitting n requests is timed at batch n, its state laid out with exactly n rows (as the serving
engine's slots; no power-of-two padding); bole and pernode share one batch-wide budget (--budget).
The plan is an estimate: every row also records the compiled loop's temporaries (XLA's memory
analysis) and whether the admitted batch still fits the budget with them (`fits`; the serving
engine re-plans its slots from the same number, `Scheduler._fit_step_memory`). Random
weights and the synthetic-acceptance drafter (--accept-mean). Prints one table per acceptance and
writes <out>/capacity_<preset>.json (command, git commit, GPU, jax version, every row) and a plot.

With --calibration TABLE (a `bole-jax calibrate --preset` table, re-weighed at each
--accept-mean) the `engine` row is what `bole-jax serve` runs under the same budget: the table's
choice over ar / chain / bole at --max-batch and the KV capacity of --context (the server's
lookup; again at the slots that choice admits where those are a smaller batch bucket, as the
server does), at the largest batch that configuration admits. Where the choice is one of the timed
modes' configurations its row is that mode's (`same_as`); otherwise it is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

from bole_jax.measure import bench, calibrate  # noqa: E402
from bole_jax.measure.env import environment  # noqa: E402
from bole_jax.model import parallel  # noqa: E402
from bole_jax.model.presets import preset  # noqa: E402
from bole_jax.pallas.tree_utils import next_pow2  # noqa: E402
from bole_jax.serving import cli  # noqa: E402
from bole_jax.serving.memory import plan_memory, slot_bytes  # noqa: E402
from bole_jax.spec_decode import budget as budget_mod  # noqa: E402
from bole_jax.spec_decode.acceptance import (  # noqa: E402
    expected_tokens_per_step,
    synthetic_accept_prob,
)
from bole_jax.spec_decode.step import SpecConfig  # noqa: E402

MODES = ("ar", "chain", "pernode", "bole", "bole-chain")
UNCAPPED = 1 << 20  # the plan's batch cap when counting what a budget admits
# bole-chain: the chain's shape (one child per node, depth + 1 nodes) verified by bole: the chain's
# draft and acceptance, bole's factors instead of the chain's per-position state snapshots.


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset", default="qwen3.5-27b", help="model dims (bole_jax/model/presets.py)"
    )
    ap.add_argument("--context", type=int, default=4096, help="KV tokens per request (power of 2)")
    ap.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[1.0, 0.5],
        help="budgets as fractions of the free memory after the weights (x 0.9)",
    )
    ap.add_argument(
        "--memory-gb", type=float, help="the full budget in GiB (default: the device's free memory)"
    )
    ap.add_argument("--accept-mean", type=float, nargs="+", default=[3.5, 6.4])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--nodes", type=int, default=16, help="bole / pernode tree width N")
    ap.add_argument("--depth", type=int, default=8, help="draft depth")
    ap.add_argument("--topk", type=int, default=4, help="bole / pernode: children per node")
    ap.add_argument("--max-batch", type=int, default=128, help="largest batch timed")
    ap.add_argument(
        "--budget",
        default="512",
        help="bole and pernode: verified nodes across the batch (the batch-wide budget), or "
        "'none' (N per request)",
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="a `bole-jax calibrate --preset` table (synthetic drafter): adds the engine row, the "
        "server's choice at --max-batch and --context under the same budget",
    )
    ap.add_argument("--prompt-len", type=int, default=64, help="real prompt tokens per request")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per point")
    ap.add_argument("--warm", type=int, default=2, help="warm-up steps per point")
    ap.add_argument("--draft-vocab", type=int, default=None, help="drafter vocabulary (bench's)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds per acceptance")
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--compile-cache", default=None, help="persistent XLA cache ('none' = off)")
    ap.add_argument("--quick", action="store_true", help="bench's smoke settings")
    ap.add_argument("--out", default="benchmarks/results/capacity")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="print and plot the rows of earlier runs' capacity JSONs together (one preset and "
        "context; runs on separate machines or calls) into <out>; default: off, run the grid",
    )
    a = ap.parse_args(argv)
    try:
        bench.check_context(a.context)
    except ValueError as e:
        ap.error(str(e))
    if not all(0 < f <= 1 for f in a.fractions):
        ap.error("--fractions must lie in (0, 1]")
    if a.max_batch < 1 or a.nodes < 2:
        ap.error("--max-batch must be >= 1 and --nodes >= 2")
    return a


def free_bytes(cfg, dtype) -> int | None:
    """The device's memory left once the weights are in (None: the backend reports none)."""
    free = parallel.device_free_bytes()
    if free is None:
        return None
    shapes = jax.eval_shape(lambda k: parallel.init_params(cfg, k, dtype), jax.random.key(0))
    return free - bench.tree_bytes(shapes)


def spec_for(mode: str, a, p: float) -> SpecConfig | None:
    if mode == "ar":
        return None
    if mode == "bole-chain":
        return SpecConfig.for_mode(
            "bole", topk=1, depth=a.depth, num_nodes=a.depth + 1, synthetic_accept=p
        )
    return SpecConfig.for_mode(
        mode, topk=a.topk, depth=a.depth, num_nodes=a.nodes, synthetic_accept=p
    )


def engine_choice(table: dict, a, p: float, batch: int) -> tuple[dict, SpecConfig | None]:
    """The table's choice (re-weighed at acceptance p's mean by the caller) at `batch` and the KV
    capacity of --context, as `bole-jax serve --max-context L` looks it up; ar where the table
    chose nothing there (`budget.untabled_mode`). Returns (the choice as a dict, its SpecConfig
    or None)."""
    c = budget_mod.choose(table, batch, a.context)
    if c is None or c.mode == "ar":
        mode = "ar" if c is None else c.mode
        return dict(mode=mode, nodes=1, depth=None, topk=None, budget=None), None
    spec = SpecConfig.for_mode(
        c.mode,
        topk=c.topk,
        depth=c.depth,
        num_nodes=c.num_nodes,
        budget=None if c.mode == "chain" else c.budget,
        synthetic_accept=p,
    )
    shape = spec.shape
    return (
        dict(
            mode=c.mode,
            nodes=shape.num_nodes,
            depth=shape.depth,
            topk=shape.topk,
            budget=spec.budget,
        ),
        spec,
    )


def engine_plan(table: dict, a, p: float, cfg, dtype, budget_bytes: int, gen: int) -> dict:
    """What `bole-jax serve --max-batch B` runs under `budget_bytes`: the table's choice at B,
    the slots its memory admits, and where those are a smaller batch bucket the choice at them
    (kept only where it admits a slot), as `Scheduler` decides. Returns dict(choice, spec, and
    `admitted`'s (timed batch, admitted, parts))."""
    choice, spec = engine_choice(table, a, p, a.max_batch)
    n, slots, parts = admitted(cfg, a, p, dtype, budget_bytes, gen, {"engine": spec})["engine"]
    if n and next_pow2(n) < next_pow2(a.max_batch):
        choice2, spec2 = engine_choice(table, a, p, n)
        again = admitted(cfg, a, p, dtype, budget_bytes, gen, {"engine": spec2})["engine"]
        if again[0]:
            choice, spec, (n, slots, parts) = choice2, spec2, again
    return dict(choice=choice, spec=spec, plan=(n, slots, parts))


def load_engine_table(path: str, cfg, dtype: str) -> dict:
    """The --calibration table, checked to be a synthetic-drafter table of --preset's dims."""
    try:
        table = budget_mod.load_table(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--calibration: {e}") from None
    if not str(table.get("drafter", "")).startswith("synthetic"):
        raise SystemExit(
            "--calibration: give a `bole-jax calibrate --preset` table (synthetic drafter)"
        )
    if table.get("model") != calibrate.model_signature(cfg, dtype):
        raise SystemExit(f"--calibration: {path} was measured on other model dims or dtype")
    return table


def spec_budget(spec: SpecConfig | None) -> str:
    """`bole-jax bench --budget` for a spec: its batch-wide budget, or 'none'."""
    return "none" if spec is None or spec.budget is None else str(spec.budget)


def admitted(cfg, a, p, dtype, budget_bytes: int, gen: int, specs: dict | None = None) -> dict:
    """{mode: (timed batch, requests the budget admits, bytes per request by part)} under
    `budget_bytes`; the timed batch is the admitted count capped by --max-batch. specs: each
    mode's SpecConfig (default: `spec_for` of every --modes mode)."""
    out = {}
    specs = specs if specs is not None else {m: spec_for(m, a, p) for m in a.modes}
    for m, spec in specs.items():
        parts = slot_bytes(cfg, a.context, gen, spec, dtype)
        try:
            plan = plan_memory(
                sum(parts.values()),
                UNCAPPED,
                memory_gb=budget_bytes / 2**30,
                prefix_cache_gb=0,
                memory_fraction=1.0,
            )
            slots = plan.num_slots
        except ValueError:  # not one request fits
            slots = 0
        # timed at exactly the admitted batch (capped by --max-batch), as the serving engine runs
        # its slots: the state is laid out with that many rows, no power-of-two padding
        out[m] = (min(slots, a.max_batch), slots, parts)
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        return merge(a, argv)
    cfg = preset(a.preset, mtp=True)
    dtype = a.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    free = free_bytes(cfg, dtype)
    if a.memory_gb is not None:
        full = int(a.memory_gb * 2**30)
    elif free is not None:
        full = int(free * 0.9)
    else:
        raise SystemExit("this backend reports no device memory: give --memory-gb")
    table = None if a.calibration is None else load_engine_table(a.calibration, cfg, dtype)
    env = environment()
    results = []
    for acc in a.accept_mean:
        p = synthetic_accept_prob(acc, a.depth)
        specs = {m: spec_for(m, a, p) for m in a.modes}
        depth, rescored = a.depth, None
        if table is not None:
            # one per-level acceptance p for the grid, the table's re-weighing and the engine
            rescored = calibrate.rescore_synthetic(
                table, expected_tokens_per_step(p, max(table["depths"])), a.calibration
            )
            depth = max(depth, max(table["depths"]))
        gen = 1 + (a.warm + a.steps) * (depth + 1)
        plans = {f: admitted(cfg, a, p, dtype, int(full * f), gen, specs) for f in a.fractions}
        # the engine's configuration per budget (the server's choice depends on the slots)
        engines = {
            f: engine_plan(rescored, a, p, cfg, dtype, int(full * f), gen)
            for f in (a.fractions if rescored is not None else ())
        }
        for f, e in engines.items():
            plans[f]["engine"] = e["plan"]
            e["same_as"] = next(
                (m for m in a.modes if same_config(m, a, specs[m], e["spec"])), None
            )
        batch_modes: dict[int, set] = {}
        for f, pl in plans.items():
            for m, (n, _, _) in pl.items():
                if n and m != "engine":
                    batch_modes.setdefault(n, set()).add(m)
        if not batch_modes:
            print(f"acceptance {acc}: no mode fits one request", flush=True)
            continue

        def run(modes, batches, nodes, depth, topk, budget, only) -> dict:
            mean = acc if depth == a.depth else expected_tokens_per_step(p, depth)  # same p
            argv_b = ["bench", "--preset", a.preset, "--dtype", dtype, "--modes", *modes]
            argv_b += ["--batch", *map(str, sorted(batches)), "--context", str(a.context)]
            argv_b += ["--nodes", str(nodes), "--budget", budget, "--depth", str(depth)]
            argv_b += ["--topk", str(topk), "--accept-mean", repr(mean), "--steps", str(a.steps)]
            argv_b += ["--warm", str(a.warm), "--prompt-len", str(a.prompt_len)]
            argv_b += ["--breakdown-batch", "0", "--time-budget", str(a.time_budget), "--no-plots"]
            argv_b += ["--compile-workers", str(a.compile_workers), "--out", a.out]
            argv_b += ["--compile-cache", a.compile_cache] if a.compile_cache else []
            argv_b += ["--draft-vocab", str(a.draft_vocab)] if a.draft_vocab else []
            argv_b += ["--quick"] if a.quick else []
            args = cli.build_parser().parse_args(argv_b)
            args.batch_modes = only
            args.exact_batch = True
            return bench.run_e2e(args)

        res = run(a.modes, batch_modes, a.nodes, a.depth, a.topk, a.budget, batch_modes)
        by = {(r["batch"], r["mode"]): r for r in res["rows"]}
        failed = {(e["batch"], e["mode"]): e["error"] for e in res["errors"]}
        # the engine's points: (batch, fraction) -> row; a grid row where the configuration is
        # the grid's (same admitted batch), else timed on its own, one run per configuration
        eng_rows, eng_errors = {}, {}
        own: dict = {}  # candidate id -> (spec, choice, {batch: [fractions]})
        for f, e in engines.items():
            n = e["plan"][0]
            if not n:
                continue
            if e["same_as"] is not None:
                eng_rows[n, f] = by.get((n, e["same_as"]))
                eng_errors[n, f] = failed.get((n, e["same_as"]))
            else:
                cid = budget_mod.candidate_id(e["choice"])
                own.setdefault(cid, (e["spec"], e["choice"], {}))[2].setdefault(n, []).append(f)
        for sp, choice, batches in own.values():
            m, shape = choice["mode"], sp.shape if sp is not None else None
            res_e = run(
                [m],
                set(batches),
                shape.num_nodes if shape else a.nodes,
                shape.depth if shape else a.depth,
                shape.topk if shape else a.topk,
                spec_budget(sp),
                {n: {m} for n in batches},
            )
            for n, fs in batches.items():
                for f in fs:
                    eng_rows[n, f] = next(
                        (r for r in res_e["rows"] if r["mode"] == m and r["batch"] == n), None
                    )
                    eng_errors[n, f] = next(
                        (x["error"] for x in res_e["errors"] if (x["batch"], x["mode"]) == (n, m)),
                        None,
                    )
        for f, pl in plans.items():
            budget = full * f
            row = dict(accept_mean=acc, fraction=f, budget_gib=budget / 2**30)
            for m, (n, slots, parts) in pl.items():
                r = eng_rows.get((n, f)) if m == "engine" else by.get((n, m))
                fit = compiled_fit(parts, n, r, budget)
                if m == "engine":
                    fit.update(choice=engines[f]["choice"], same_as=engines[f]["same_as"])
                row[m] = dict(
                    batch=n,
                    admitted=slots,
                    request_mib=sum(parts.values()) / 2**20,
                    parts_mib={k: v / 2**20 for k, v in parts.items()},
                    tokens_per_s=r["tokens_per_s"] if r else None,
                    tokens_per_step=r["tokens_per_step"] if r else None,
                    step_ms=r["step_ms"] if r else None,
                    error=eng_errors.get((n, f)) if m == "engine" else failed.get((n, m)),
                    **fit,
                )
            results.append(row)
        print_rows([r for r in results if r["accept_mean"] == acc], shown(a.modes, table))
    record = dict(
        command=" ".join(sys.argv if argv is None else ["bench_capacity.py", *argv]),
        env=env,
        args=vars(a),
        dtype=dtype,
        free_bytes_after_weights=free,
        full_budget_bytes=full,
        rows=results,
        method="benchmarks/bench_capacity.py docstring; docs/benchmarks.md (memory as capacity)",
    )
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"capacity_{a.preset}.json")
    bench.write_json(path, record)
    print(f"wrote {path}")
    if not a.no_plots:
        plot(
            results,
            shown(a.modes, table),
            os.path.join(a.out, f"capacity_{a.preset}.png"),
            a.preset,
        )
    return 0


def shown(modes, table) -> list[str]:
    """The row's columns: the modes, then the engine where a table was given."""
    return list(modes) + ([] if table is None else ["engine"])


def timed_budget(m: str, a) -> str | None:
    """The batch-wide budget `bole-jax bench` times mode m with in the grid ('auto': the table's,
    not known here)."""
    if m in ("ar", "chain", "bole-chain"):
        return None
    return None if a.budget == "none" else a.budget


def same_config(m: str, a, spec: SpecConfig | None, engine: SpecConfig | None) -> bool:
    """Is the engine's configuration the one mode m is timed with in the grid (same mode, tree
    shape and batch-wide budget)?"""
    if spec is None or engine is None:
        return spec is None and engine is None
    budget = timed_budget(m, a)
    return (
        spec.mode == engine.mode
        and spec.shape == engine.shape
        and budget != "auto"
        and (None if budget is None else int(budget)) == engine.budget
    )


def merge(a, argv=None) -> int:
    """The rows of several capacity JSONs in one table, JSON and plot; each row keeps its source
    (file, command, commit). Runs of different presets, contexts or dtypes are refused."""
    recs = []
    for path in a.merge:
        with open(path) as f:
            recs.append((path, json.load(f)))
    keys = {(r["args"]["preset"], r["args"]["context"], r["dtype"]) for _, r in recs}
    if len(keys) != 1:
        raise SystemExit(f"--merge: the runs differ in (preset, context, dtype): {sorted(keys)}")
    preset_name = recs[0][1]["args"]["preset"]
    rows, modes = [], set()
    for path, r in recs:
        for row in r["rows"]:
            row = dict(row, source=path, max_batch=r["args"]["max_batch"])
            rows.append(row)
            modes |= {m for m in (*MODES, "engine") if m in row}
    modes = [m for m in (*MODES, "engine") if m in modes]
    rows.sort(key=lambda r: (r["accept_mean"], -r["budget_gib"]))
    for acc in sorted({r["accept_mean"] for r in rows}):
        print_rows([r for r in rows if r["accept_mean"] == acc], modes)
    record = dict(
        command=" ".join(sys.argv if argv is None else ["bench_capacity.py", *argv]),
        sources=[
            dict(path=path, command=r["command"], env=r["env"], args=r["args"]) for path, r in recs
        ],
        env=recs[0][1]["env"],
        dtype=recs[0][1]["dtype"],
        rows=rows,
        method=recs[0][1].get("method"),
    )
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"capacity_{preset_name}.json")
    bench.write_json(path, record)
    print(f"wrote {path}")
    if not a.no_plots:
        plot(rows, modes, os.path.join(a.out, f"capacity_{preset_name}.png"), preset_name)
    return 0


def compiled_fit(parts: dict, n: int, row: dict | None, budget: float) -> dict:
    """The plan checked against the compiled decode loop: the batch's state (every part but the
    step transient, n rows) plus the loop's temporaries (XLA's memory analysis; they hold the
    verify's outputs the estimate counts and the activations it does not), within the budget?
    (One batch-1 request's worth is kept back, as the plan does.) None where no temporaries were
    reported."""
    temp = row.get("step_temp_mib") if row else None
    if temp is None or not n:
        return dict(
            step_temp_mib=temp,
            estimate_transient_mib=None,
            compiled_need_gib=None,
            fits_compiled=None,
        )
    state = sum(v for k, v in parts.items() if k != "step_transient")
    need = (n + 1) * state + parts["step_transient"] + temp * 2**20
    return dict(
        step_temp_mib=temp,
        estimate_transient_mib=n * parts["step_transient"] / 2**20,
        compiled_need_gib=need / 2**30,
        fits_compiled=bool(need <= budget),
    )


def ratio(row, m, ref):
    x, y = row[m]["tokens_per_s"], row.get(ref, {}).get("tokens_per_s")
    return x / y if x and y else None


def print_rows(rows, modes) -> None:
    table = []
    for r in rows:
        for m in modes:
            c = r.get(m)
            if c is None:  # a merged run that did not time this mode
                continue
            table.append(
                dict(
                    acc=r["accept_mean"],
                    budget_gib=r["budget_gib"],
                    mode=m if m != "engine" else f"engine: {budget_mod.candidate_id(c['choice'])}",
                    request_mib=c["request_mib"],
                    admitted=c["admitted"],
                    batch=c["batch"],
                    tokens_per_s=c["tokens_per_s"] or "-",
                    tok_per_step=c["tokens_per_step"] or "-",
                    step_ms=c["step_ms"] or "-",
                    vs_ar=ratio(r, m, "ar") or "-",
                    vs_pernode=ratio(r, m, "pernode") or "-",
                    temp_mib=c.get("step_temp_mib") or "-",
                    fits=fits_word(c, r["budget_gib"]),
                    error=(c["error"] or "")[:40],
                )
            )
    print("\nthroughput at a fixed memory budget (each mode at its largest admitted batch)")
    bench.print_table(table, list(table[0]))


def fits_word(c: dict, budget_gib: float) -> str:
    """'yes', 'no (X GiB)' with the compiled loop's temporaries, '-' where none were reported."""
    if c.get("fits_compiled") is None:
        return "-"
    return (
        "yes" if c["fits_compiled"] else f"no ({c['compiled_need_gib']:.1f} > {budget_gib:.1f} GiB)"
    )


def plot(results, modes, path, tag) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    accs = sorted({r["accept_mean"] for r in results})
    fig, axes = plt.subplots(1, len(accs), figsize=(5 * len(accs), 4), squeeze=False)
    for ax, acc in zip(axes[0], accs):
        rows = sorted(
            (r for r in results if r["accept_mean"] == acc), key=lambda r: r["budget_gib"]
        )
        for m in modes:
            pts = [
                (r["budget_gib"], r[m]["tokens_per_s"])
                for r in rows
                if r.get(m) and r[m]["tokens_per_s"]
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(xlabel="memory budget (GiB)", ylabel="output tokens / s", title=f"{tag}, acc {acc}")
        ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
