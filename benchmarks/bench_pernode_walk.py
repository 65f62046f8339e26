#!/usr/bin/env python
"""TREE-PERNODE verify by node walk: what its reloads cost, and what the depth-first walk's
indirect loads cost.

Per point (B, N) and launch: the benchmark's random trees walked in index order ("index") and
depth-first ("dfs", the order computed once outside the call, as a decode step does); the same
trees relabelled so that depth-first order is index order ("relabel": the depth-first walk's
reloads with the index walk's direct loads); and a chain ("chain": the tree kernel on
parents[i] = i - 1, which never reloads). Each variant's output is checked against the jnp
closed form of its own tree first. Qwen3-Next dims as bench_tree_gdn.py; device time from the
same timer. Prints a table and writes <out>/bench_pernode_walk.json.

    PYTHONPATH=. python benchmarks/bench_pernode_walk.py --out DIR --B 1,16 --N 8,64 \
        --configs "bv=8,w=1,ns=3;bv=16,w=1,ns=2"
    PYTHONPATH=. python benchmarks/bench_pernode_walk.py --out /tmp/x --cpu-dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from bole_jax.pallas import tree_gdn_ref, tree_pernode  # noqa: E402
from bole_jax.pallas.tree_utils import dfs_order, tree_structure  # noqa: E402

VARIANTS = ("index", "dfs", "relabel", "chain")


def relabel(parents: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The trees with node order[b, j] renamed j: index order becomes depth-first order."""
    out = np.empty_like(parents)
    for b, (p, o) in enumerate(zip(parents, order)):
        pos = np.empty_like(o)
        pos[o] = np.arange(len(o))
        out[b, pos] = np.where(p >= 0, pos[np.maximum(p, 0)], -1)
    return out


def bench_point(b, n, cfgs, timer, seed) -> dict:
    rng = np.random.default_rng(seed * 1000 + b * 100 + n)
    parents = btg.make_trees(rng, b, n)
    num_nodes = jnp.full((b,), n, jnp.int32)
    order = np.asarray(dfs_order(jnp.asarray(parents), num_nodes))
    trees = dict(
        index=parents,
        dfs=parents,
        relabel=relabel(parents, order),
        chain=np.broadcast_to(np.arange(n, dtype=np.int32) - 1, (b, n)).copy(),
    )
    r = btg.pernode_set_count(b, n, btg.input_set_count(b, n, cap=16))
    sets = btg.make_sets(jax.random.PRNGKey(seed + b * 1000 + n), b, n, r)
    point = dict(
        B=b,
        N=n,
        input_sets=r,
        reloads=dict(
            index=btg.reloads(parents),
            dfs=btg.reloads(parents, order),
            relabel=btg.reloads(trees["relabel"]),
            chain=0.0,
        ),
        rows=[],
    )
    # each tree's reference output, once for all launches ("dfs" walks the "index" trees)
    o_refs = {
        var: tree_gdn_ref.tree_gdn_closed_form(
            *sets[0],
            jnp.asarray(trees[var]),
            num_nodes,
            tree=tree_structure(jnp.asarray(trees[var]), num_nodes),
        )[0]
        for var in VARIANTS
        if var != "dfs"
    }
    o_refs["dfs"] = o_refs["index"]
    print(
        f"B={b} N={n}: reloads per request "
        + ", ".join(f"{k} {v:.1f}" for k, v in point["reloads"].items()),
        flush=True,
    )
    for cfg in cfgs:
        row = dict(config=btg.cfg_str(cfg))
        for var in VARIANTS:
            par = jnp.asarray(trees[var])
            c = dataclasses.replace(cfg, order="dfs" if var == "dfs" else "index")
            ordv = jnp.asarray(order) if var == "dfs" else None
            fn = jax.jit(
                lambda *a, par=par, c=c, ordv=ordv: tree_pernode.tree_pernode_verify(
                    *a,
                    par,
                    num_nodes,
                    backend="pallas",
                    interpret=btg.INTERPRET,
                    config=c,
                    order=ordv,
                )
            )
            try:
                o = fn(*sets[0])[0]
                err = btg.rel(o, o_refs[var])
                del o
                row[f"{var}_err_o"] = err
                if not err <= btg.TOL["o"]:
                    row[f"{var}_error"] = f"output error {err:.2e} over {btg.TOL['o']}"
                    continue
                row[var] = timer(fn, sets)
            except Exception as e:  # noqa: BLE001
                row[f"{var}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        point["rows"].append(row)
        print(
            f"  {row['config']:24s} "
            + "  ".join(
                f"{v} {row[v]['us']:8.1f}" if v in row else f"{v} {'FAIL':>8s}" for v in VARIANTS
            ),
            flush=True,
        )
    return point


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="1,16")
    ap.add_argument("--N", default="8,64")
    ap.add_argument(
        "--configs",
        default="bv=8,w=1,ns=3;bv=16,w=1,ns=2",
        help='";"-separated PERNODE launches (bench_tree_gdn.py keys; ord is set per variant)',
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="test this script without a GPU: interpret mode, tiny head dims",
    )
    a = ap.parse_args(argv)
    if a.cpu_dry_run:
        btg.HK, btg.HV, btg.DK, btg.DV, btg.INTERPRET = 1, 2, 16, 128, True
        a.reps, a.warmup = min(a.reps, 2), min(a.warmup, 1)
    cfgs = [btg.parse_pernode(s) for s in a.configs.split(";") if s.strip()]
    if not cfgs:
        ap.error("--configs: no launch given")
    bs = [int(x) for x in a.B.split(",")]
    ns = [int(x) for x in a.N.split(",")]
    os.makedirs(a.out, exist_ok=True)
    timer = btg.Timer("wall" if a.cpu_dry_run else "auto", a.reps, a.warmup)
    t0 = time.perf_counter()
    result = dict(btg.run_info(__file__), variants=VARIANTS, points=[])
    print(f"device {result['device']}, jax {result['jax_version']}", flush=True)
    path = os.path.join(a.out, "bench_pernode_walk.json")
    for b in bs:
        for n in ns:
            result["points"].append(bench_point(b, n, cfgs, timer, a.seed))
            with open(path, "w") as f:  # after every point: a timeout keeps what was measured
                json.dump(result, f, indent=1)
    print(
        "\n  B    N | launch                   | "
        + " | ".join(f"{v:>8s}" for v in VARIANTS)
        + " | reloads index / dfs"
    )
    for p in result["points"]:
        for row in p["rows"]:
            cells = " | ".join(
                f"{row[v]['us']:8.1f}" if v in row else f"{'-':>8s}" for v in VARIANTS
            )
            print(
                f"{p['B']:3d} {p['N']:4d} | {row['config']:24s} | {cells} | "
                f"{p['reloads']['index']:.1f} / {p['reloads']['dfs']:.1f}"
            )
    result["total_s"] = time.perf_counter() - t0
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path} ({result['total_s']:.0f} s)")
    failed = [r for p in result["points"] for r in p["rows"] for v in VARIANTS if v not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
