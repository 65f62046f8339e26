#!/usr/bin/env python
"""MoE routed experts on the device: the grouped-matmul kernel vs its reference, and timings of
the experts implementations (layers.moe_experts_gmm / _gather / _sorted).

Qwen3-Next-80B per device at tp=2 by default: 256 local experts, hidden 2048, moe_intermediate
512, top-10, bf16 weights and tokens, softmax routing by a random router (uneven expert loads).

    BOLE_GIT_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python benchmarks/bench_moe.py \
        --out benchmarks/results/moe_h200
    PYTHONPATH=. python benchmarks/bench_moe.py --out /tmp/m --experts 512 --tokens 128,1024 \
        --configs "bm=16,bn=128,bk=64,w=4,s=4;bm=32,bn=64,bk=128,w=4,s=3"
    PYTHONPATH=. python benchmarks/bench_moe.py --out /tmp/m --tiny   # no GPU needed

Per token count:
1. correctness on the device: the kernel's gate_up (fused SwiGLU) and down matmuls against
   `gmm_ref` (fp32, HIGHEST) on the same row layout, rows of used tiles (relative Frobenius
   error), moe_experts_gmm against moe_experts_gather (fp32) where that fits and each extra
   config against the auto one; exit status 1 (after writing the JSON) if any is above
   tolerance, unless --no-fail;
2. timings (bench_tree_gdn's Timer: JAX profiler device time per call, median; wall clock
   fallback) of moe_experts_gmm (auto config, then each --configs entry), moe_experts_gather
   (skipped when pairs x per-pair weight bytes exceed --mem-limit-gb) and moe_experts_sorted
   (ragged_dot; skipped when its dense expansion, estimated E x pairs x max(K, N) x 4 bytes,
   exceeds --mem-limit-gb); also the two kernel launches alone ("kernels us": without the
   sort, row gather and combine); the weight bytes of the used experts and the bandwidth that
   gives (weights of the used experts / gmm time);
3. a table and <out>/bench_moe.json (command, git commit (BOLE_GIT_COMMIT, else git), GPU, jax
   version, every number).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_tree_gdn import Timer, rel  # noqa: E402

from bole_jax.measure.env import environment  # noqa: E402
from bole_jax.model import ModelConfig, layers  # noqa: E402
from bole_jax.pallas import moe_gmm  # noqa: E402

DIMS = dict(experts=256, hidden=2048, inter=512, topk=10)  # Qwen3-Next-80B, tp=2
TINY = dict(experts=8, hidden=64, inter=32, topk=2)
TOKENS, TINY_TOKENS = "16,128,256,1024,4096", "4,32"
TOL = dict(gate_up=1e-2, down=1e-2, moe=2e-2)  # bf16 outputs (the reference is fp32)
CFG_KEYS = dict(bm="block_m", bn="block_n", bk="block_k", w="num_warps", s="num_stages")


def parse_cfg(spec: str) -> moe_gmm.GMMConfig:
    kw = {
        CFG_KEYS[k.strip()]: int(v)
        for k, v in (item.split("=") for item in filter(None, spec.split(",")))
    }
    return moe_gmm.GMMConfig(**kw)


def cfg_str(cfg: moe_gmm.GMMConfig) -> str:
    inv = {v: k for k, v in CFG_KEYS.items()}
    return ",".join(f"{inv[f]}={getattr(cfg, f)}" for f in CFG_KEYS.values())


def make_model(d, seed, dtype):
    """ModelConfig (for moe_route) and MoE params: router fp32, experts in dtype. Host RNG:
    nothing to compile, the same weights on every device."""
    cfg = ModelConfig.tiny(
        "qwen3_next",
        moe=True,
        hidden_size=d["hidden"],
        num_experts=d["experts"],
        num_experts_per_tok=d["topk"],
        moe_intermediate_size=d["inter"],
    )
    rng = np.random.default_rng(seed)
    h, i, e = d["hidden"], d["inter"], d["experts"]

    def normal(shape, scale):
        return jnp.asarray(
            (rng.standard_normal(shape, np.float32) * scale).astype(jnp.dtype(dtype))
        )

    p = {
        "router": normal((h, e), 1.0),
        "w_gate_up": normal((e, h, 2 * i), h**-0.5),
        "w_down": normal((e, i, h), i**-0.5),
    }
    return cfg, p


def bench_point(tokens, d, cfg, p, args, timer, interpret, record) -> dict:
    e, h, i, k = d["experts"], d["hidden"], d["inter"], d["topk"]
    dtype = p["w_gate_up"].dtype
    pairs = tokens * k
    x = jnp.asarray(
        np.random.default_rng(tokens).standard_normal((tokens, h), np.float32).astype(dtype)
    )
    top_w, top_e = jax.jit(lambda x: layers.moe_route(p["router"], x, cfg))(x)
    per_expert = (h * 2 * i + i * h) * dtype.itemsize
    used = len(np.unique(np.asarray(top_e)))
    limit = args.mem_limit_gb * 2**30
    gather_bytes = pairs * per_expert
    sorted_bytes = e * pairs * max(h, 2 * i) * 4
    bm = moe_gmm.GMMConfig.auto(pairs / e).block_m
    auto = (
        moe_gmm.GMMConfig.for_block_m(bm, True, dtype.itemsize),
        moe_gmm.GMMConfig.for_block_m(bm, False, dtype.itemsize),
    )
    point = dict(
        tokens=tokens,
        pairs=pairs,
        used_experts=used,
        weight_bytes=used * per_expert,
        gather_bytes=gather_bytes,
        sorted_dense_bytes=sorted_bytes,
        auto_config=[cfg_str(c) for c in auto],
        configs=[],
    )

    def check(name, got, want, tol, rows=None):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if rows is not None:
            got, want = got[rows], want[rows]
        record(f"T={tokens} {name}", rel(got, want), tol)

    # The two kernel launches alone (auto config, row layout given), checked against gmm_ref
    # on the rows of used tiles, then timed: the rest of moe_experts_gmm is the sort, the row
    # gather and the combine.
    lay = moe_gmm.group_layout(top_e.reshape(-1), e, bm)
    xs = jnp.take(x, lay.row_pair // k, axis=0, mode="fill", fill_value=0)
    rows = np.repeat(np.asarray(lay.tile_expert) < e, bm)
    kern = functools.partial(
        moe_gmm.gmm, tile_expert=lay.tile_expert, backend="pallas", interpret=interpret
    )

    @jax.jit
    def kernels(p, xs):
        hs = kern(xs, p["w_gate_up"], swiglu=True, config=auto[0])
        return hs, kern(hs, p["w_down"], config=auto[1])

    hs, ys = kernels(p, xs)
    check(
        "gate_up+swiglu kernel vs gmm_ref",
        hs,
        moe_gmm.gmm_ref(xs, p["w_gate_up"], lay.tile_expert, swiglu=True),
        TOL["gate_up"],
        rows,
    )
    check(
        "down kernel vs gmm_ref",
        ys,
        moe_gmm.gmm_ref(hs, p["w_down"], lay.tile_expert),
        TOL["down"],
        rows,
    )
    point["kernels_only"] = timer(kernels, [(p, xs)])
    del hs, ys

    # The whole path: auto config (vs gather in fp32 where that fits), then each extra config
    # (vs the auto config's output), timed.
    sets = [(p, x, top_w, top_e)]  # the weights alone are several times the L2 cache
    base = None
    for cfgs in [auto] + [(c, c) for c in args.configs]:
        fn = jax.jit(
            functools.partial(
                layers.moe_experts_gmm, config=cfgs, backend="pallas", interpret=interpret
            )
        )
        entry = dict(config=[cfg_str(c) for c in cfgs])
        try:
            out = fn(*sets[0])
            if base is None:
                base = out
                if 2 * gather_bytes <= limit:
                    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (p, x, top_w))
                    check(
                        "moe_experts_gmm vs gather (fp32)",
                        out,
                        jax.jit(layers.moe_experts_gather)(*f32, top_e),
                        TOL["moe"],
                    )
            else:
                check(f"moe_experts_gmm [{cfg_str(cfgs[0])}] vs auto", out, base, TOL["moe"])
            entry.update(timer(fn, sets))
            entry["weight_bw"] = point["weight_bytes"] / (entry["us"] * 1e-6)
        except Exception as ex:  # noqa: BLE001 (recorded, the other configs still run)
            entry["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            record(f"T={tokens} [{cfg_str(cfgs[0])}] raised", float("inf"), 0.0)
        point["configs"].append(entry)
    timed = [c for c in point["configs"] if "us" in c]
    point["gmm"] = min(timed, key=lambda c: c["us"]) if timed else None
    for name, fn, need in (
        ("gather", layers.moe_experts_gather, gather_bytes),
        ("sorted", layers.moe_experts_sorted, sorted_bytes),
    ):
        if need > limit:
            point[name] = dict(skipped=f"needs ~{need / 2**30:.0f} GiB > --mem-limit-gb")
            continue
        try:
            point[name] = timer(jax.jit(fn), sets)
        except Exception as ex:  # noqa: BLE001 (an OOM is a result too)
            point[name] = dict(error=f"{type(ex).__name__}: {str(ex)[:300]}")
    return point


def print_table(points):
    def us(v):
        return f"{v['us']:10.1f}" if v and "us" in v else f"{'-':>10s}"

    hdr = (
        f"{'tokens':>6s} {'pairs':>6s} {'used E':>6s} | {'gmm us':>10s} {'GB/s':>6s} "
        f"{'kernels us':>10s} {'gather us':>10s} {'sorted us':>10s} | best gmm config "
        "(gate_up; down)"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for p in points:
        g = p["gmm"]
        bw = f"{g['weight_bw'] / 1e9:6.0f}" if g else f"{'-':>6s}"
        best = "; ".join(g["config"]) if g else "-"
        print(
            f"{p['tokens']:6d} {p['pairs']:6d} {p['used_experts']:6d} | {us(g)} {bw} "
            f"{us(p['kernels_only'])} {us(p['gather'])} {us(p['sorted'])} | {best}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (JSON)")
    ap.add_argument("--tokens", default=None, help=f"comma-separated (default {TOKENS})")
    ap.add_argument("--experts", type=int, default=DIMS["experts"], help="local experts")
    ap.add_argument("--hidden", type=int, default=DIMS["hidden"])
    ap.add_argument("--inter", type=int, default=DIMS["inter"], help="moe_intermediate_size")
    ap.add_argument("--topk", type=int, default=DIMS["topk"])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--configs",
        default="",
        help='";"-separated extra gmm configs for both matmuls (keys: bm bn bk w s)',
    )
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        default=20.0,
        help="skip gather / sorted when their estimated memory exceeds this",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timer", choices=("auto", "profile", "wall"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="tiny dims (8 experts, hidden 64, top-2) and tokens 4, 32: a smoke run "
        "that works on CPU (interpret mode)",
    )
    ap.add_argument("--no-fail", action="store_true", help="exit 0 even if a check fails")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.tiny):
        ap.error("no GPU: the Pallas interpret mode at full dims would take hours; use --tiny")
    d = (
        dict(TINY)
        if args.tiny
        else dict(experts=args.experts, hidden=args.hidden, inter=args.inter, topk=args.topk)
    )
    tokens = [int(t) for t in (args.tokens or (TINY_TOKENS if args.tiny else TOKENS)).split(",")]
    args.configs = [parse_cfg(s) for s in args.configs.split(";") if s.strip()]
    interpret = not on_gpu
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "bench_moe.json")
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        **environment(),
        interpret=interpret,
        dims=dict(d, dtype=args.dtype),
        tokens=tokens,
        extra_configs=[cfg_str(c) for c in args.configs],
        reps=args.reps,
        mem_limit_gb=args.mem_limit_gb,
        tolerances=TOL,
        checks=[],
        points=[],
    )
    print(
        f"device {result['device']} ({result['platform']}), jax {jax.__version__}, "
        f"interpret={interpret}, commit {result['git_commit']}, dims {d}",
        flush=True,
    )

    def dump():
        result["elapsed_s"] = time.perf_counter() - t_start
        with open(out_json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)

    def record(name, err, tol):
        ok = bool(np.isfinite(err) and err <= tol)
        row = dict(check=name, rel_err=err, tol=tol, ok=ok)
        result["checks"].append(row)
        print(
            f"  {'ok  ' if ok else 'FAIL'} {name:48s} rel err {err:.2e} (tol {tol:.0e})", flush=True
        )
        return row

    cfg, p = make_model(d, args.seed, jnp.dtype(args.dtype))
    timer = Timer(args.timer, args.reps, args.warmup)
    for t in tokens:
        print(f"tokens={t} ({time.perf_counter() - t_start:.0f} s)", flush=True)
        result["points"].append(bench_point(t, d, cfg, p, args, timer, interpret, record))
        dump()
    print_table(result["points"])
    dump()
    print(f"\nwrote {out_json} ({time.perf_counter() - t_start:.0f} s)")
    if not all(c["ok"] for c in result["checks"]):
        print("\n*** CORRECTNESS CHECK FAILED (see above / JSON 'checks') ***")
        if not args.no_fail:
            sys.exit(1)


if __name__ == "__main__":
    main()
