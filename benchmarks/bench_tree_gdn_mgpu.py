#!/usr/bin/env python
"""The Mosaic GPU tree verify (`pallas/tree_gdn_mgpu.py`) against the Triton one.

One GDN layer at Qwen3-Next dims (Hk 16, HV 32, dk = dv = 128), bf16 q/k/v, fp32 state, random
trees (<= 4 children, <= 8 nodes on a root path), as bench_tree_gdn.py. Per point: the Triton
verify (its auto Triton launch) and the Mosaic one (`--variants`: 128- and 64-column value
tiles, Neumann or squaring inverse, 3, 2 or 1 bf16 wgmmas per fp32 product, hardware exp /
rsqrt "_ax", the kernel's own barriers "_nb"), each checked on the device against the jnp
closed form (fp32, HIGHEST; `--repeat-check K`: also bitwise reproducible), then timed with the
same profiler timer (device time per call, each kernel's share printed below it; the Mosaic
call includes the XLA work around the kernel: padding for N < 64 since bf3ff68, the gates'
gamma and transposes before). Prints a table and writes <out>/bench_tree_gdn_mgpu.json.

    PYTHONPATH=. python benchmarks/bench_tree_gdn_mgpu.py --out DIR --B 1,16,64 --N 64
    PYTHONPATH=. python benchmarks/bench_tree_gdn_mgpu.py --out /tmp/x --cpu-dry-run   # no GPU

Needs jax >= 0.11 (the kernel's API).
"""

from __future__ import annotations

import argparse
import functools
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
from bole_jax.pallas import tree_gdn, tree_gdn_mgpu, tree_gdn_ref  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig  # noqa: E402
from bole_jax.pallas.tree_utils import tree_structure  # noqa: E402

TOL = dict(o=2e-2, u=5e-3)
# The Mosaic launches timed (mgpu_trace.py profiles the same ones by these names).
# name -> launch; "_pK": K bf16 wgmmas per fp32 product (tree_gdn_verify_mgpu's `products`;
# 3 without the suffix)
VARIANTS = {
    "mgpu": dict(block_v=128, inverse="neumann"),
    "mgpu64": dict(block_v=64, inverse="neumann"),
    "mgpu_sq": dict(block_v=128, inverse="squaring"),
    "mgpu64_sq": dict(block_v=64, inverse="squaring"),
    "mgpu64_sq_p2": dict(block_v=64, inverse="squaring", products=2),
    "mgpu64_sq_p1": dict(block_v=64, inverse="squaring", products=1),
    "mgpu_sq_p2": dict(block_v=128, inverse="squaring", products=2),
    "mgpu64_p1": dict(block_v=64, inverse="neumann", products=1),
    # exp / rsqrt by the hardware approximations
    "mgpu64_sq_p1_ax": dict(block_v=64, inverse="squaring", products=1, approx_math=True),
    # ... and the kernel's own barriers instead of Pallas's automatic ones
    "mgpu64_sq_p1_ax_nb": dict(
        block_v=64, inverse="squaring", products=1, approx_math=True, auto_barriers=False
    ),
}
# (the engine's launch, `tree_gdn.mosaic_launch`, last; the first comparison's set was mgpu64_sq,
# mgpu64_sq_p2, mgpu64_sq_p1, mgpu_sq_p2, mgpu64_p1)
DEFAULT_VARIANTS = "mgpu64_sq_p1,mgpu64_sq_p1_ax,mgpu64_sq_p1_ax_nb"


def parse_variants(ap, text):
    """--variants "a,b": the names, checked against VARIANTS (ap.error on an unknown one)."""
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown or text!r}; known: {', '.join(VARIANTS)}")
    return names


def _mgpu(*args, parents, **kw):
    return tree_gdn_mgpu.tree_gdn_verify_mgpu(*args, parents, **kw)


def point_inputs(b, n, seed, count):
    """A point's random trees (parents, their tree_structure) and `count` input sets, the same
    for a given (b, n, seed) here and in mgpu_trace.py."""
    rng = np.random.default_rng(seed * 1000 + b * 100 + n)
    parents = jnp.asarray(btg.make_trees(rng, b, n))
    return (
        parents,
        tree_structure(parents),
        btg.make_sets(jax.random.PRNGKey(seed + b * 7 + n), b, n, count),
    )


def repeat_check(f, x, count, first):
    """count more calls of f on the same inputs x: the largest |difference| of any output from
    the first call's (0: bitwise reproducible; a race between warps would show here), and
    whether the outputs equal `first` (another launch's, same inputs) bit for bit."""
    ref = jax.tree.leaves(jax.block_until_ready(f(*x)))
    worst = 0.0
    for _ in range(count):
        got = jax.tree.leaves(f(*x))
        worst = max(
            worst,
            max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
                for a, r in zip(got, ref)
            ),
        )
    same = None if first is None else all(bool(jnp.array_equal(a, r)) for a, r in zip(ref, first))
    return worst, same, ref


def bench_point(b, n, timer, seed, interpret, variants, repeats=0):
    depth = btg.MAX_DEPTH
    r = 1 if interpret else max(2, min(16, int(3 * 60e6 // max(btg.set_bytes(b, n), 1)) + 1))
    parents, tree, sets = point_inputs(b, n, seed, r)
    with jax.default_matmul_precision("highest"):
        o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*sets[0], parents)
    point = dict(B=b, N=n, depth=int(np.max(tree.path_len)), input_sets=r)
    fns = {
        "triton": lambda *a: tree_gdn.tree_gdn_verify(
            *a,
            parents,
            backend="pallas",
            interpret=interpret,
            tree=tree,
            config=(
                TreeGDNConfig(depth_bound=depth) if interpret else TreeGDNConfig.auto(b, n, depth)
            ),
        ),
        **{
            name: functools.partial(
                _mgpu,
                parents=parents,
                depth_bound=depth,
                tree=tree,
                interpret=interpret,
                **VARIANTS[name],
            )
            for name in variants
        },
    }
    first = None  # the first Mosaic launch's outputs (repeat check)
    for name, fn in fns.items():
        entry = {}
        try:
            f = jax.jit(lambda *a, fn=fn: btg.without_keys(fn(*a)))
            t0 = time.perf_counter()
            o, fac = jax.block_until_ready(f(*sets[0]))
            entry["compile_s"] = time.perf_counter() - t0
            entry["err_o"] = btg.rel(o, o_ref)
            entry["err_u"] = btg.rel(fac.u, f_ref.u)
            entry["ok"] = entry["err_o"] <= TOL["o"] and entry["err_u"] <= TOL["u"]
            del o, fac
            if repeats and name != "triton":
                worst, same, outs = repeat_check(f, sets[0], repeats, first)
                entry.update(
                    repeat_calls=repeats, repeat_max_abs_diff=worst, bitwise_equal_first_mosaic=same
                )
                entry["ok"] = entry["ok"] and worst == 0.0  # (equality: launches that
                # differ only in synchronisation must agree; others need not)
                first = outs if first is None else first
            entry.update(timer(f, sets))
        except Exception as e:  # noqa: BLE001
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        point[name] = entry
        nan = float("nan")
        print(
            f"B={b:3d} N={n:3d} {name:7s} {entry.get('us', nan):9.1f} us  "
            f"err o {entry.get('err_o', nan):.1e} u {entry.get('err_u', nan):.1e}"
            + (
                f"  repeats {entry['repeat_calls']}: max diff {entry['repeat_max_abs_diff']:.1e}"
                f", equal to the first launch: {entry['bitwise_equal_first_mosaic']}"
                if "repeat_calls" in entry
                else ""
            )
            + f"{'' if entry.get('ok') else '  (NOT OK) ' + entry.get('error', '')}",
            flush=True,
        )
        for kname, kus in entry.get("kernels_us", {}).items():
            print(f"      {kus:8.2f} us  {kname}", flush=True)
    fb = btg.floor_bytes(b, n)
    point["floor_us"] = fb / btg.REF_BW * 1e6
    return point


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="1,4,16,64")
    ap.add_argument("--N", default="64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"Mosaic launches to time (default {DEFAULT_VARIANTS}); known: " + ",".join(VARIANTS),
    )
    ap.add_argument(
        "--repeat-check",
        type=int,
        default=0,
        metavar="K",
        help="call each Mosaic launch K more times on one input set: its outputs must "
        "be bitwise reproducible (a race shows here); also records whether they "
        "equal the first Mosaic launch's bit for bit (launches differing only "
        "in barriers must)",
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="test this script without a GPU: interpret mode, 2 key / 4 value heads",
    )
    args = ap.parse_args(argv)
    variants = parse_variants(ap, args.variants)
    if not tree_gdn_mgpu.AVAILABLE:
        raise SystemExit(tree_gdn_mgpu.UNAVAILABLE_REASON)
    interpret = args.cpu_dry_run
    if interpret:
        btg.HK, btg.HV, btg.INTERPRET = 2, 4, True
    os.makedirs(args.out, exist_ok=True)
    timer = btg.Timer(
        "wall" if interpret else "auto",
        2 if interpret else args.reps,
        1 if interpret else args.warmup,
    )
    t0 = time.perf_counter()
    points = [
        bench_point(b, n, timer, args.seed, interpret, variants, args.repeat_check)
        for b in (int(x) for x in args.B.split(","))
        for n in (int(x) for x in args.N.split(","))
    ]
    widths = [max(9, len(k)) for k in variants]
    print(
        f"\n{'B':>3} {'N':>3} | {'triton':>8} "
        + " ".join(f"{k:>{w}}" for k, w in zip(variants, widths))
        + f" | {'best/triton':>11} {'floor':>6} {'best/floor':>10}   (us)"
    )
    for p in points:
        t = p["triton"].get("us", float("nan"))
        us = [p[k].get("us", float("nan")) if p[k].get("ok") else float("nan") for k in variants]
        best = min((x for x in us if x == x), default=float("nan"))
        print(
            f"{p['B']:3d} {p['N']:3d} | {t:8.1f} "
            + " ".join(f"{x:{w}.1f}" for x, w in zip(us, widths))
            + f" | {best / t:10.2f}x {p['floor_us']:6.1f} {best / p['floor_us']:9.1f}x"
        )
    out = dict(
        **btg.run_info(__file__),
        dims=dict(Hk=btg.HK, HV=btg.HV, dk=btg.DK, dv=btg.DV, max_depth=btg.MAX_DEPTH),
        points=points,
        elapsed_s=time.perf_counter() - t0,
    )
    path = os.path.join(args.out, "bench_tree_gdn_mgpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {path}")
    bad = [
        p for p in points for k in p if isinstance(p[k], dict) and "ok" in p[k] and not p[k]["ok"]
    ]
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
