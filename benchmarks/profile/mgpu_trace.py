#!/usr/bin/env python
"""Where the Mosaic GPU verify's time goes inside one program: its in-kernel profile.

Runs `tree_gdn_verify_mgpu(..., profile_dir=...)` once per variant and point (Qwen3-Next dims,
the trees of bench_tree_gdn.py), after a plain warm-up call; Mosaic GPU's profiler writes one
Chrome trace per call with the start and end of each named region (`_region` in
pallas/tree_gdn_mgpu.py) of every program. Per region: the mean and median duration over
programs and its share of a program's time; per call: programs per SM, a program's time from
its first to its last event, and the kernel's span. Prints a table and writes
<out>/mgpu_trace.json (the raw traces are kept beside it, gzipped). `--pending`: the verify
folds a pending lazy commit (the rows of each request's deepest node of a previous verify of
the same inputs, as bench_tree_gdn.py's lazy sweep), its phase "fold" in the profile.

    PYTHONPATH=. python benchmarks/profile/mgpu_trace.py --out DIR --B 1,16 --N 64
    PYTHONPATH=. python benchmarks/profile/mgpu_trace.py --out DIR --B 1,16 --N 64 --pending
    PYTHONPATH=. python benchmarks/profile/mgpu_trace.py --out DIR --B 16 --N 64 --pending --pending-rows 1

GPU only (the profiler's dump is a host callback); jax >= 0.11.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from benchmarks.bench_tree_gdn_mgpu import VARIANTS, parse_variants, point_inputs  # noqa: E402
from bole_jax.pallas import tree_gdn_mgpu, tree_gdn_ref  # noqa: E402
from bole_jax.pallas.tree_gdn_commit import accepted_rows, pending_commit  # noqa: E402
from bole_jax.pallas.tree_utils import accepted_path  # noqa: E402


def summarize(trace: dict) -> dict:
    """Per-region durations (us) over programs, from a Chrome trace of B / E events."""
    per_prog = collections.defaultdict(list)
    for ev in trace["traceEvents"]:
        per_prog[(ev["pid"], ev["tid"])].append(ev)
    regions = collections.defaultdict(list)
    prog_us, starts, ends, sms = [], [], [], collections.Counter()
    for (sm, _), evs in per_prog.items():
        stack = []
        for ev in evs:
            if ev["ph"] == "B":
                stack.append(ev)
            elif stack:
                b = stack.pop()
                regions[b["name"]].append(ev["ts"] - b["ts"])
        prog_us.append(evs[-1]["ts"] - evs[0]["ts"])
        starts.append(evs[0]["ts"])
        ends.append(evs[-1]["ts"])
        sms[sm] += 1
    mean_prog = statistics.fmean(prog_us)
    out = dict(
        programs=len(per_prog),
        sms=len(sms),
        max_programs_per_sm=max(sms.values()),
        program_us=dict(mean=mean_prog, median=statistics.median(prog_us), max=max(prog_us)),
        span_us=max(ends) - min(starts),
        regions={},
    )
    for name, d in regions.items():
        out["regions"][name] = dict(
            mean=statistics.fmean(d),
            median=statistics.median(d),
            p90=float(np.percentile(d, 90)),
            count=len(d),
            share=statistics.fmean(d) * len(d) / len(prog_us) / mean_prog,
        )
    return out


def accepted_at(parents, rows: int):
    """Per request, the node whose root path has min(rows, the deepest path's length) nodes, on
    the deepest node's path (the deepest node when rows reaches it)."""
    walk = np.asarray(accepted_path(parents, btg.deepest_nodes(parents), parents.shape[1]))
    depth = (walk >= 0).sum(axis=1)  # the deepest node first, -1 past the root
    return walk[np.arange(len(walk)), np.maximum(depth - rows, 0)].astype(np.int32)


def pending_rows(x, parents, tree, n, rows: int | None = None):
    """A pending lazy commit for the point: the factor rows of each request's deepest node of
    a verify of the same inputs (the reference closed form), as the decode step's commit
    leaves them (`pending_commit` with the step's accepted path). rows: the commit's row count
    (the kernel unrolls its fold over them), the accepted node then the ancestor at that path
    length (`accepted_at`); None: min(MAX_DEPTH, n), the bench's."""
    _, fac = tree_gdn_ref.tree_gdn_closed_form(*x, parents, tree=tree)
    length = min(btg.MAX_DEPTH, n) if rows is None else rows
    accepted = jnp.asarray(accepted_at(parents, length))
    path, count = accepted_rows(parents, accepted, length)
    return pending_commit(fac, parents, accepted, length, path, count)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="1,16")
    ap.add_argument("--N", default="64")
    ap.add_argument("--variants", default="mgpu64_sq", help=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pending",
        action="store_true",
        help="profile the verify folding a pending lazy commit (the 'fold' phase)",
    )
    ap.add_argument(
        "--pending-rows",
        type=int,
        default=None,
        metavar="L",
        help="with --pending: the commit's rows (default: the bench's, "
        "min(8, N)); e.g. 1 against 8 separates the fold's per-row cost "
        "from what it waits for once",
    )
    args = ap.parse_args(argv)
    if args.pending_rows is not None and (args.pending_rows < 1 or not args.pending):
        ap.error("--pending-rows takes a count >= 1, with --pending")
    variants = parse_variants(ap, args.variants)
    if not tree_gdn_mgpu.AVAILABLE:
        raise SystemExit(tree_gdn_mgpu.UNAVAILABLE_REASON)
    if jax.default_backend() != "gpu":
        raise SystemExit("mgpu_trace.py needs a GPU (the in-kernel profiler)")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for b in (int(x) for x in args.B.split(",")):
        for n in (int(x) for x in args.N.split(",")):
            parents, tree, (x,) = point_inputs(b, n, args.seed, 1)
            pend = pending_rows(x, parents, tree, n, args.pending_rows) if args.pending else None
            for name in variants:
                kw = dict(VARIANTS[name], depth_bound=btg.MAX_DEPTH, tree=tree, pending=pend)
                jax.block_until_ready(tree_gdn_mgpu.tree_gdn_verify_mgpu(*x, parents, **kw))
                d = tempfile.mkdtemp(prefix="mgpu_trace_")
                try:
                    jax.block_until_ready(
                        tree_gdn_mgpu.tree_gdn_verify_mgpu(*x, parents, profile_dir=d, **kw)
                    )
                    files = sorted(
                        glob.glob(os.path.join(d, "**", "*.json*"), recursive=True),
                        key=os.path.getmtime,
                    )
                    if not files:
                        raise RuntimeError(f"no trace written under {d}")
                    with open(files[-1]) as f:
                        trace = json.load(f)
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                raw = os.path.join(args.out, f"trace_{name}_B{b}_N{n}.json.gz")
                with gzip.open(raw, "wt") as f:
                    json.dump(trace, f)
                s = summarize(trace)
                s.update(
                    B=b,
                    N=n,
                    variant=name,
                    trace=os.path.basename(raw),
                    pending_rows=0 if pend is None else int(pend.k.shape[1]),
                )
                results.append(s)
                fold = "" if pend is None else f" + fold ({int(pend.k.shape[1])} rows)"
                print(
                    f"\nB={b} N={n} {name}{fold}: "
                    f"{s['programs']} programs on {s['sms']} SMs "
                    f"(<= {s['max_programs_per_sm']} per SM); program "
                    f"{s['program_us']['mean']:.2f} us mean, {s['program_us']['max']:.2f} max; "
                    f"span {s['span_us']:.2f} us (profiled)",
                    flush=True,
                )
                print(f"  {'region':12s} {'mean':>8s} {'median':>8s} {'p90':>8s} {'share':>6s}")
                for r, v in sorted(s["regions"].items(), key=lambda kv: -kv[1]["mean"]):
                    print(
                        f"  {r:12s} {v['mean']:8.3f} {v['median']:8.3f} {v['p90']:8.3f} "
                        f"{100 * v['share']:5.1f}%"
                    )
    out = dict(
        **btg.run_info(__file__),
        note="durations in us from the in-kernel profiler (globaltimer); the profiled "
        "kernel runs slower than the plain one (one store per event)",
        results=results,
    )
    with open(os.path.join(args.out, "mgpu_trace.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'mgpu_trace.json')}")


if __name__ == "__main__":
    main()
