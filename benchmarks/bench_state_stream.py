#!/usr/bin/env python
"""How fast can a Pallas (Triton) kernel stream the GDN state? A diagnostic for the commit.

The commit (`commit_state_pallas`) reads every fp32 state tile once and writes it once, and at
N = 8 the verify is little more than one read of the state; both run at 1.6-2.5 TB/s on the
H200 against ~3.9 TB/s for XLA's copy (PERNODE's commit). This script times, in place (state
donated, as the decode step runs them), at Qwen3-Next dims (HV 32, dk = dv 128, fp32):

- `scale[tile]`: o = p[b, h] * s, the commit without its path rows, for several tile shapes
  and warp counts: `[dk, bv]` column tiles (the commit's grid), `[bk, bv]` 2-D tiles, and
  contiguous row blocks of the state viewed as [B * HV * dk, dv];
- `read[tile]`: a read-only pass (each program reduces its tile to one number), the state
  traffic of a verify at small N;
- `xla_scale`: the same maths as one XLA fusion; `pernode_copy`: PERNODE's commit (gather of
  the accepted node's state out of a per-node scratch of 8 nodes);
- `commit[...]`: the real commit kernel (its folds and load orders, deepest node accepted).

Every Pallas variant is first checked against jnp on the device. Prints a table and writes
<out>/bench_state_stream.json (command, git commit, GPU, jax version, every number).

    PYTHONPATH=. python benchmarks/bench_state_stream.py --out DIR [--B 16,64]
    PYTHONPATH=. python benchmarks/bench_state_stream.py --out /tmp/s --cpu-dry-run   # no GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from bole_jax.pallas import tree_pernode  # noqa: E402
from bole_jax.pallas.tree_gdn import tree_gdn_verify  # noqa: E402
from bole_jax.pallas.tree_gdn_commit import (  # noqa: E402
    accepted_rows,
    commit_state,  # noqa: E402
    commit_state_pallas,
)
from bole_jax.pallas.tree_utils import tree_structure  # noqa: E402

HV, DK, DV = 32, 128, 128
INTERPRET = False


def _params(warps):
    return pltriton.CompilerParams(num_warps=warps, num_stages=1)


def _scale_kernel(p_ref, s_ref, o_ref):
    o_ref[...] = p_ref[...] * s_ref[...]


def _read_kernel(s_ref, o_ref):
    o_ref[...] = jnp.sum(s_ref[...])


def scale_cols(s, p, bk, bv, warps):
    """o = p * s with [bk, bv] tiles of each head's [dk, dv] state; grid (dv/bv, dk/bk, HV, B)
    (columns fastest, as the commit's grid)."""
    b, hv, dk, dv = s.shape
    spec = pl.BlockSpec((None, None, bk, bv), lambda t, r, h, i: (i, h, r, t))
    return pl.pallas_call(
        _scale_kernel,
        grid=(dv // bv, dk // bk, hv, b),
        in_specs=[pl.BlockSpec((None, None), lambda t, r, h, i: (i, h)), spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(s.shape, s.dtype),
        input_output_aliases={1: 0},
        interpret=INTERPRET,
        compiler_params=_params(warps),
        name="stream_scale_cols",
    )(p, s)


def scale_rows(s, p, rows, warps):
    """o = p * s over the state viewed as [B * HV * dk, dv]: contiguous blocks of `rows` rows
    (rows * dv * 4 bytes each); p per block's head."""
    b, hv, dk, dv = s.shape
    flat = s.reshape(b * hv * dk, dv)
    per_head = dk // rows
    pf = p.reshape(b * hv)
    spec = pl.BlockSpec((rows, dv), lambda r: (r, 0))
    out = pl.pallas_call(
        _scale_kernel,
        grid=(b * hv * per_head,),
        in_specs=[pl.BlockSpec((None,), lambda r: (r // per_head,)), spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, s.dtype),
        input_output_aliases={1: 0},
        interpret=INTERPRET,
        compiler_params=_params(warps),
        name="stream_scale_rows",
    )(pf, flat)
    return out.reshape(s.shape)


def read_cols(s, bv, warps):
    """Read-only: each program sums its [dk, bv] tile (the verify's state read at small N)."""
    b, hv, dk, dv = s.shape
    return pl.pallas_call(
        _read_kernel,
        grid=(dv // bv, hv, b),
        in_specs=[pl.BlockSpec((None, None, dk, bv), lambda t, h, i: (i, h, 0, t))],
        out_specs=pl.BlockSpec((None, None, None), lambda t, h, i: (i, h, t)),
        out_shape=jax.ShapeDtypeStruct((b, hv, dv // bv), jnp.float32),
        interpret=INTERPRET,
        compiler_params=_params(warps),
        name="stream_read_cols",
    )(s)


def time_in_place(fn, states, extra, timer):
    """fn(state, extra) -> new state, timed in place (state donated) over the sets' states."""
    return btg.timer_in_place(lambda s, e, _: fn(s, e), states, [extra] * len(states), timer, None)


def point(b, n, timer, sets_count, seed, parts=("stream", "commit")):
    key = jax.random.PRNGKey(seed + b)
    states = [
        jax.random.normal(jax.random.fold_in(key, i), (b, HV, DK, DV), jnp.float32)
        for i in range(sets_count)
    ]
    p = jax.random.uniform(jax.random.fold_in(key, 999), (b, HV), jnp.float32, 0.5, 1.0)
    rows = []
    bytes_rw = 2 * b * HV * DK * DV * 4

    def add(name, res, nbytes, **kw):
        res = dict(res, name=name, bytes=nbytes, **kw)
        res["tb_per_s"] = nbytes / (res["us"] * 1e-6) / 1e12
        rows.append(res)
        print(
            f"  B={b:3d} N={n:3d} {name:34s} {res['us']:8.2f} us  {res['tb_per_s']:5.2f} TB/s",
            flush=True,
        )

    # Correctness of every diagnostic kernel once (not in place), then in-place timing.
    s0 = states[0]  # (the timed calls donate copies of the states)
    want = p[:, :, None, None] * s0
    scale_variants = [("cols", DK, bv, w) for bv in (32, 64, 128) for w in (4, 8)]
    scale_variants += [
        ("cols", DK // 2, 64, 4),
        ("cols", DK // 2, 32, 4),
        ("cols", DK // 4, 128, 4),
    ]
    scale_variants += [("rows", r, None, w) for r in (16, 32, 64) for w in (4, 8)]
    if "stream" not in parts:
        scale_variants = []
    for kind, a, bv, w in scale_variants:
        if kind == "cols":
            name = f"scale[{a}x{bv}] w{w}"
            fn = functools.partial(
                lambda s, pp, a, bv, w: scale_cols(s, pp, a, bv, w), a=a, bv=bv, w=w
            )
        else:
            name = f"scale[rows {a}x{DV} contiguous] w{w}"
            fn = functools.partial(lambda s, pp, a, w: scale_rows(s, pp, a, w), a=a, w=w)
        err = float(jnp.max(jnp.abs(jax.jit(fn)(s0, p) - want)))
        if err > 1e-6:
            raise SystemExit(f"{name}: max error {err}")
        add(name, time_in_place(fn, states, p, timer), bytes_rw, err=err)
    if "stream" in parts:
        add(
            "xla_scale",
            time_in_place(lambda s, pp: pp[:, :, None, None] * s, states, p, timer),
            bytes_rw,
        )
    for bv in (32, 64, 128) if "stream" in parts else ():
        for w in (4, 8):
            fn = functools.partial(lambda s, bv, w: read_cols(s, bv, w), bv=bv, w=w)
            got = jax.jit(fn)(s0)
            ref = s0.reshape(b, HV, DK, DV // bv, bv).sum(axis=(2, 4))
            err = float(jnp.max(jnp.abs(got - ref)))
            if err > 1e-2:
                raise SystemExit(f"read[{bv}] w{w}: max error {err}")
            add(f"read[{DK}x{bv}] w{w}", timer(jax.jit(fn), [(s,) for s in states]), bytes_rw // 2)

    # PERNODE's commit: the accepted node's state out of a per-node scratch (8 nodes, the
    # default transposed "vk" layout).
    scr = jnp.stack([tree_pernode.scratch_layout(s0, "vk")] * 8, axis=1)
    acc = jnp.full((b,), 5, jnp.int32)
    add(
        "pernode_copy (8-node scratch)",
        time_in_place(
            lambda s, c: tree_pernode.commit_pernode_state(s, c, acc), states, scr, timer
        ),
        bytes_rw,
    )
    del scr

    # The real commit kernel on real factors.
    rng = np.random.default_rng(seed * 1000 + b * 100 + n)
    parents = jnp.asarray(btg.make_trees(rng, b, n))
    num_nodes = jnp.full((b,), n, jnp.int32)
    tree = tree_structure(parents, num_nodes)
    hk = HV // 2
    kq = jax.random.split(jax.random.fold_in(key, 7), 5)
    q = jax.random.normal(kq[0], (b, n, hk, DK), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kq[1], (b, n, hk, DK), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kq[2], (b, n, HV, DV), jnp.float32).astype(jnp.bfloat16)
    g = -jax.random.uniform(kq[3], (b, n, HV), jnp.float32, 0.01, 1.0)
    beta = jax.random.uniform(kq[4], (b, n, HV), jnp.float32, 0.05, 0.95)
    _, fac = tree_gdn_verify(
        q,
        k,
        v,
        g,
        beta,
        s0,
        parents,
        num_nodes,
        tree=tree,
        backend="pallas" if not INTERPRET else "reference",
        interpret=INTERPRET,
    )
    accepted = jnp.asarray(btg.deepest_nodes(np.asarray(parents)))
    path, count = accepted_rows(parents, accepted, min(btg.MAX_DEPTH, n))
    want = commit_state(s0, fac, parents, accepted, backend="reference", precision="highest")
    commits = [
        dict(block_v=32, num_warps=4, fold="dot"),
        dict(block_v=32, num_warps=4, fold="loop"),
        dict(block_v=32, num_warps=4, fold="unroll"),
        dict(block_v=32, num_warps=8, fold="unroll"),
        dict(block_v=64, num_warps=8, fold="unroll"),
        dict(block_v=64, num_warps=4, fold="unroll"),
        dict(block_v=16, num_warps=4, fold="unroll"),
    ]
    for kw in commits:
        fn = functools.partial(
            lambda s, f, kw: commit_state_pallas(
                s, f, parents, accepted, interpret=INTERPRET, path=path, count=count, **kw
            ),
            kw=kw,
        )
        got = jax.jit(fn)(s0, fac)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        if err > 1e-5:
            raise SystemExit(f"commit {kw}: relative error {err}")
        name = f"commit[{DK}x{kw['block_v']}] w{kw['num_warps']} {kw['fold']}"
        add(name, time_in_place(fn, states, fac, timer), bytes_rw, err=err)
    return rows


def main(argv=None):
    global HV, DK, DV, INTERPRET
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="16,64")
    ap.add_argument("--N", default="64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--parts",
        default="stream,commit",
        help="stream (scale/read/XLA/PERNODE copies), commit (the commit kernels)",
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="interpret mode, tiny dims: tests this script without a GPU",
    )
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        HV, DK, DV, INTERPRET = 4, 64, 128, True
        btg.HK, btg.HV, btg.DK, btg.DV, btg.INTERPRET = 2, 4, 64, 128, True
    timer = btg.Timer(
        "wall" if args.cpu_dry_run else "auto",
        2 if args.cpu_dry_run else args.reps,
        1 if args.cpu_dry_run else 3,
    )
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = []
    for b in [int(x) for x in args.B.split(",")]:
        for n in [int(x) for x in args.N.split(",")]:
            # enough input sets that their states exceed the L2 several times over
            count = (
                2
                if args.cpu_dry_run
                else int(max(2, min(8, -(-3 * btg.L2_BYTES // (b * HV * DK * DV * 4)))))
            )
            results.append(dict(B=b, N=n, rows=point(b, n, timer, count, 0, args.parts.split(","))))
    out = dict(
        command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        git_commit=btg.git_commit(),
        gpu=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        jaxlib=btg._jaxlib_version(),
        dims=dict(HV=HV, dk=DK, dv=DV),
        wall_s=time.time() - t0,
        points=results,
    )
    with open(os.path.join(args.out, "bench_state_stream.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\n| B | N | variant | us | TB/s |\n|---|---|---|---|---|")
    for pt in results:
        for r in pt["rows"]:
            print(f"| {pt['B']} | {pt['N']} | {r['name']} | {r['us']:.1f} | {r['tb_per_s']:.2f} |")


if __name__ == "__main__":
    main()
