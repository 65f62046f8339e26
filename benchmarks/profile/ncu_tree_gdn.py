"""Launch each GDN tree kernel exactly once, for Nsight Compute to profile.

Every variant is compiled ahead of time (`.lower().compile()`: no launch), then run once, so
under `ncu -k regex:'bole|pernode'` each kernel of interest is one profiled launch. Qwen3-Next
dims (H = 16, HV = 32, dk = dv = 128), bench_tree_gdn.py's random trees and inputs.

    ncu --clock-control none --import-source yes --set full -k regex:'bole|pernode' \\
        -o /tmp/r python benchmarks/profile/ncu_tree_gdn.py --B 16 --N 64
    ncu --import /tmp/r.ncu-rep --page details > details.txt

Variants: the verify (`--bole-configs`, default `auto`), the commit kernel (folds loop, dot,
unroll), the lazy verify (the same folds, gathered rows), the one-launch lazy step (each
Triton launch of `--bole-configs` reading a `PendingPath`, the bench's "direct") and
TREE-PERNODE. It prints each variant's name in launch order, so the report's kernels can be
matched to them. Without ncu it is a smoke test of the kernels (it checks nothing:
bench_tree_gdn.py does).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from bole_jax.pallas import tree_pernode  # noqa: E402
from bole_jax.pallas.factors import PendingPath  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig, tree_gdn_verify  # noqa: E402
from bole_jax.pallas.tree_gdn_commit import (
    commit_state,  # noqa: E402
    pending_commit,  # noqa: E402
)
from bole_jax.pallas.tree_pernode import PernodeConfig  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument(
        "--bole-configs",
        default="auto",
        help="';'-separated bench_tree_gdn config specs (default auto)",
    )
    ap.add_argument("--no-pernode", action="store_true", help="skip TREE-PERNODE")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    b, n = args.B, args.N
    parents = btg.make_trees(np.random.default_rng(args.seed), b, n)
    parents_d, num_nodes, tree, accepted, path, count = btg.tree_context(parents)
    length = path.shape[1]
    q, k, v, g, beta, state = btg.make_sets(jax.random.PRNGKey(args.seed), b, n, 1)[0]
    runs = []  # (name, compiled, args)

    def add(name, fn, *a, donate=()):
        runs.append((name, jax.jit(fn, donate_argnums=donate).lower(*a).compile(), a))

    cfgs = btg.resolve_bole([btg.parse_bole(s) for s in args.bole_configs.split(";")], b, n)
    for cfg in cfgs:
        verify = btg.bole_verify(cfg, btg.step_args(parents_d, num_nodes, tree, None, None, None))
        add(
            f"verify {btg.cfg_str(cfg)}",
            lambda *a, verify=verify: btg.without_keys(verify(*a)),
            q,
            k,
            v,
            g,
            beta,
            state,
        )
    # the commit's factors and the lazy folds: the first Triton launch (Mosaic has no folds here)
    cfg = next(
        (c for c in cfgs if isinstance(c, TreeGDNConfig)), TreeGDNConfig.auto(b, n, btg.MAX_DEPTH)
    )
    fac = tree_gdn_verify(
        q, k, v, g, beta, state, parents_d, num_nodes, tree=tree, backend="pallas", config=cfg
    )[1]
    for fold in ("loop", "dot", "unroll"):

        def commit(s, f, fold=fold):
            return commit_state(
                s,
                f,
                parents_d,
                accepted,
                backend="pallas",
                block_v=32,
                num_warps=4,
                path=path,
                count=count,
                fold=fold,
            )

        add(f"commit bv32 w4 fold={fold}", commit, jnp.copy(state), fac, donate=(0,))
    pend = pending_commit(fac, parents_d, accepted, length, path, count)
    for fold in ("loop", "dot", "unroll"):
        lcfg = cfg.with_fold(fold)

        def lazy(q, k, v, g, beta, s, p, lcfg=lcfg):
            return tree_gdn_verify(
                q,
                k,
                v,
                g,
                beta,
                s,
                parents_d,
                num_nodes,
                tree=tree,
                backend="pallas",
                config=lcfg,
                pending=p,
            )

        add(
            f"lazy verify {btg.cfg_str(lcfg)}",
            lazy,
            q,
            k,
            v,
            g,
            beta,
            jnp.copy(state),
            pend,
            donate=(5,),
        )
    # the one-launch lazy step (the bench's "direct"): the verify reads the accepted path's
    # rows from the previous factors itself (`PendingPath`); each Triton launch given
    ppath = PendingPath(factors=fac, path=path, sel=accepted, count=count)
    for lcfg in [c for c in cfgs if isinstance(c, TreeGDNConfig)]:

        def direct(q, k, v, g, beta, s, p, lcfg=lcfg):
            return btg.without_keys(
                tree_gdn_verify(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    s,
                    parents_d,
                    num_nodes,
                    tree=tree,
                    backend="pallas",
                    config=lcfg,
                    pending=p,
                )
            )

        add(
            f"direct verify {btg.cfg_str(lcfg)}",
            direct,
            q,
            k,
            v,
            g,
            beta,
            jnp.copy(state),
            ppath,
            donate=(5,),
        )
    if not args.no_pernode:

        def pernode(q, k, v, g, beta, s):
            return tree_pernode.tree_pernode_verify(
                q,
                k,
                v,
                g,
                beta,
                s,
                parents_d,
                num_nodes,
                backend="pallas",
                config=PernodeConfig(block_v=32, num_warps=4),
            )

        add("pernode bv32 w4", pernode, q, k, v, g, beta, state)
    jax.block_until_ready(fac)
    print(f"B={b} N={n} depth={max(btg.tree_depth(p) for p in parents)}; launch order:", flush=True)
    for i, (name, fn, a) in enumerate(runs):
        jax.block_until_ready(fn(*a))
        print(f"  {i}: {name}", flush=True)


if __name__ == "__main__":
    main()
