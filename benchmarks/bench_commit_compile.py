#!/usr/bin/env python
"""Compile time and run time of the eager bole commit of every GDN layer, by layers per launch.

`commit_states_pallas` commits all GDN layers of a decode step in few Pallas launches: a launch
of L layers is one kernel holding a switch over L copies of the per-layer commit. Fewer launches
cost less per step (at Qwen3.5-9B dims, 24 launches -> 1 took the commit stage 0.172 -> 0.120 ms
at B = 1), but the GPU compiles the L copies as one kernel. This script measures both sides at
a model's GDN dims (default Qwen3.5-27B: 48 GDN layers, 16 key / 48 value heads of 128), for each
layers-per-launch value, each in its own process (a compile that passes --timeout is reported as
such, not waited for):

- lower_s / compile_s: tracing and XLA compile of a jitted commit of every layer (states
  donated, as the decode step runs it), per batch size;
- us: wall time of one commit of every layer, waited for (median of --reps calls; the state
  donated from one call to the next, as in the decode loop);
- err: the largest relative error (`bench_tree_gdn.rel`) of any layer's new state against the
  jnp reference commit (the first batch size; fresh random factors, requests accepting
  different depths).

Prints a table and writes <out>/bench_commit_compile.json (command, git commit, GPU, jax version,
every number).

    PYTHONPATH=. python benchmarks/bench_commit_compile.py --out DIR
    PYTHONPATH=. python benchmarks/bench_commit_compile.py --out DIR --per 1 8 48 --batch 1 32
    PYTHONPATH=. python benchmarks/bench_commit_compile.py --out /tmp/c --cpu-dry-run  # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _inputs(rng, layers, b, n, hk, hv, d, path_len):
    import jax.numpy as jnp
    import numpy as np

    from bole_jax.pallas.factors import TreeFactors

    states, factors = [], []
    for _ in range(layers):
        k = rng.standard_normal((b, n, hk, d)).astype(np.float32)
        scale = 1.0 / np.sqrt((k**2).sum(-1) + 1e-6)
        u = 0.1 * rng.standard_normal((b, n, hv, d)).astype(np.float32)
        gamma = -np.cumsum(rng.uniform(0.0, 0.2, (b, n, hv)), axis=1).astype(np.float32)
        factors.append(
            TreeFactors(
                k=jnp.asarray(k, jnp.bfloat16),
                u=jnp.asarray(u),
                gamma=jnp.asarray(gamma),
                k_scale=jnp.asarray(scale),
            )
        )
        states.append(jnp.asarray(0.05 * rng.standard_normal((b, hv, d, d)), jnp.float32))
    # Each request's accepted path: nodes 0..count-1 of a chain-shaped prefix (any node ids
    # < n do; the commit takes the path as given), count from 1 to path_len, one accepting none.
    count = rng.integers(1, path_len + 1, b).astype(np.int32)
    path = np.tile(np.arange(path_len, dtype=np.int32), (b, 1))
    accepted = (count - 1).astype(np.int32)
    if b > 1:
        accepted[-1], count[-1] = -1, 0
    return states, factors, jnp.asarray(accepted), jnp.asarray(path), jnp.asarray(count)


def run_one(args) -> dict:
    """One layers-per-launch value, in this process: every batch size's numbers."""
    import jax
    import numpy as np

    from benchmarks.bench_tree_gdn import rel
    from bole_jax.pallas import tree_gdn_commit as tgc

    interpret = args.cpu_dry_run
    rows = []
    for bi, b in enumerate(args.batch):
        rng = np.random.default_rng(args.seed + b)
        states, factors, acc, path, count = _inputs(
            rng, args.layers, b, args.nodes, args.hk, args.hv, args.d, args.path_len
        )

        def commit(s, f, a, p, c):
            return tgc.commit_states_pallas(
                s, f, a, p, c, interpret=interpret, layers_per_launch=args.per_one
            )

        fn = jax.jit(commit, donate_argnums=0)
        t0 = time.perf_counter()
        low = fn.lower(states, factors, acc, path, count)
        t1 = time.perf_counter()
        comp = low.compile()
        t2 = time.perf_counter()
        row = dict(batch=b, lower_s=t1 - t0, compile_s=t2 - t1)
        if bi == 0:  # against the jnp reference, layer by layer
            want = tgc.commit_states(states, factors, acc, path, count, backend="reference")
            got = comp([jax.numpy.copy(s) for s in states], factors, acc, path, count)
            row["err"] = max(rel(g, w) for g, w in zip(got, want))
        ts = []
        cur = states
        for i in range(args.warmup + args.reps):
            t = time.perf_counter()
            cur = list(comp(cur, factors, acc, path, count))
            jax.block_until_ready(cur)
            if i >= args.warmup:
                ts.append(time.perf_counter() - t)
        row["us"] = float(np.median(ts)) * 1e6
        row["launches"] = -(-args.layers // args.per_one)
        rows.append(row)
    return dict(per_launch=args.per_one, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48, help="GDN layers (Qwen3.5-27B: 48)")
    ap.add_argument("--per", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 48])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--nodes", type=int, default=16, help="tree nodes per request")
    ap.add_argument("--path-len", type=int, default=9, help="accepted path rows (depth + 1)")
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--hv", type=int, default=48)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180, help="seconds per layers-per-launch")
    ap.add_argument("--cpu-dry-run", action="store_true", help="interpret mode, tiny dims")
    ap.add_argument("--per-one", type=int, help=argparse.SUPPRESS)  # the child process's value
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        args.layers, args.hk, args.hv, args.d, args.nodes, args.path_len = 3, 1, 2, 16, 4, 3
        args.reps, args.warmup = 2, 1
    if args.per_one is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0

    from bole_jax.measure.env import environment

    os.makedirs(args.out, exist_ok=True)
    results = []
    for per in args.per:
        cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])]
        cmd += ["--per-one", str(per)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                res = dict(per_launch=per, error=(proc.stderr or proc.stdout)[-2000:])
            else:
                res = json.loads(lines[-1][len("RESULT ") :])
        except subprocess.TimeoutExpired:
            res = dict(per_launch=per, error=f"timeout: over {args.timeout:g} s")
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        for r in res.get("rows", []):
            print(
                f"per launch {per:3d} ({r['launches']:2d} launches)  B {r['batch']:3d}  "
                f"lower {r['lower_s']:6.1f} s  compile {r['compile_s']:7.1f} s  "
                f"commit {r['us']:8.1f} us" + (f"  err {r['err']:.1e}" if "err" in r else ""),
                flush=True,
            )
        if "error" in res:
            print(f"per launch {per:3d}: {res['error'].strip().splitlines()[-1]}", flush=True)
    out = dict(
        command="python " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        env=environment(),
        dims=dict(
            layers=args.layers,
            hk=args.hk,
            hv=args.hv,
            dk=args.d,
            dv=args.d,
            nodes=args.nodes,
            path_len=args.path_len,
        ),
        results=results,
    )
    path = os.path.join(args.out, "bench_commit_compile.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0 if all("rows" in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
