#!/usr/bin/env python
"""GDN tree verify + commit: Bole (closed form + factors) vs TREE-PERNODE (per-node states).

One GDN layer at Qwen3-Next dims (Hk=16, HV=32, dk=dv=128), bf16 q/k/v, fp32 state, random trees
with at most 4 children and at most 8 nodes on a root path, on a grid of batch B x nodes N.

    PYTHONPATH=. python benchmarks/bench_tree_gdn.py --out benchmarks/results/tree_gdn_h200
    PYTHONPATH=. python benchmarks/bench_tree_gdn.py --out /tmp/x --quick
    PYTHONPATH=. python benchmarks/bench_tree_gdn.py --out /tmp/x --B 16 --N 64 \
        --bole-configs "bv=64,w=8,inv=squaring;bv=32,w=4,inv=neumann" --pernode-configs "bv=32,w=4"

What it does, in order:
1. measures the device copy bandwidth (XLA elementwise read+write of 1 GiB);
2. checks every kernel on the device against its jnp reference (fp32, HIGHEST precision) at a
   small size: Bole verify (each swept config, also folding a lazy commit), commit_state,
   TREE-PERNODE verify + commit, CHAIN,
   tree conv, per-node conv. Relative errors are printed; the script exits with status 1 (after
   writing the JSON) if any is above its tolerance, unless --no-fail;
3. for each grid point: sweeps the Bole launch configs and the TREE-PERNODE configs (each timed
   config is also checked against the reference at that point; configs that fail are not
   eligible as "best"), times both commits and Bole's lazy commit ("bole-lazy": the best
   config's verify folding the previous verify's accepted path rows, plus the `pending_commit`
   gathers; "direct": the same verify reading those rows from the previous factors itself, a
   `PendingPath`, so the lazy step is that one launch), and reports verify / commit / sum,
   speedups, the bytes floor, transient memory and SGLang's measured numbers (docs/benchmarks.md)
   side by side;
4. prints a table, writes <out>/bench_tree_gdn.json (command, git commit, GPU, jax version, every
   number) and <out>/bench_tree_gdn.png (if matplotlib imports).

Timing: separate calls of a jitted function (one kernel launch each, outputs blocked on every
call), warm-up first, inputs rotated among R device-resident input sets whose total size exceeds
the L2 cache several times. Device time comes from the JAX profiler (the union of GPU kernel
intervals per call, median over calls); if the profiler gives no GPU events, the per-call
wall-clock time is used instead ("timer" in the JSON says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", message=".*Triton.*deprecat.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bole_jax.pallas import tree_conv, tree_gdn_mgpu, tree_gdn_ref, tree_pernode  # noqa: E402
from bole_jax.pallas.factors import PendingPath  # noqa: E402
from bole_jax.pallas.testing import random_parents, tree_depth  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig, mosaic_launch, tree_gdn_verify  # noqa: E402
from bole_jax.pallas.tree_gdn_commit import (  # noqa: E402
    accepted_rows,
    commit_state,  # noqa: E402
    gather_pending_path,
    pending_commit,
)
from bole_jax.pallas.tree_pernode import PernodeConfig  # noqa: E402
from bole_jax.pallas.tree_utils import dfs_order, tree_structure  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next GDN at TP1
CONV_C = 2 * HK * DK + HV * DV
MAX_CHILDREN, MAX_DEPTH = 4, 8
L2_BYTES = 50 * 2**20  # H200 L2 cache (rotation target: several times this)
REF_BW = 4.3e12  # the H200's measured copy bandwidth (PyTorch copy; docs/benchmarks.md)
INTERPRET = False  # --cpu-dry-run: interpret mode and tiny dims, to test this script on CPU
LAZY_CFGS = None  # --lazy-configs: the lazy commit's launches (default: the best verify's, 3 folds)

# SGLang 0.5.23 tree verify on an H200, as measured (docs/benchmarks.md):
# (B, N) -> (tree depth, verify us, commit us, bytes floor us, scratch MiB, factors MiB)
SGLANG = {
    (1, 8): (4, 85, 25, 0.5, 16, 0.2),
    (1, 16): (6, 73, 20, 0.6, 32, 0.4),
    (1, 32): (8, 119, 39, 0.7, 64, 0.8),
    (1, 64): (8, 105, 27, 1.0, 128, 1.5),
    (4, 8): (4, 146, 43, 2.2, 64, 0.8),
    (4, 16): (7, 132, 36, 2.4, 128, 1.5),
    (4, 32): (7, 120, 34, 2.9, 256, 3.0),
    (4, 64): (8, 275, 34, 3.9, 512, 6.0),
    (16, 8): (6, 94, 98, 8.8, 256, 3.0),
    (16, 16): (5, 233, 99, 9.8, 512, 6.0),
    (16, 32): (8, 511, 99, 11.7, 1024, 12.1),
    (16, 64): (8, 1618, 99, 15.7, 2048, 24.1),
    (64, 8): (5, 464, 342, 35.1, 1024, 12.1),
    (64, 16): (6, 1517, 342, 39.1, 2048, 24.1),
    (64, 32): (8, 3275, 343, 46.9, 4096, 48.2),
    (64, 64): (8, 10166, 342, 62.7, 8192, 96.5),
}

DEFAULT_BOLE = [  # the sweep, default config first (see docs/kernels.md for the reasoning)
    "auto",  # TreeGDNConfig.auto: the winners of the last full sweep, per (B, N), plus the
    #          Mosaic GPU verify where the engine's auto launch takes it (`mosaic_launch`)
    "bv=32,w=4,inv=squaring",  # fp32 operands: the accuracy reference point
    "bv=32,w=2,inv=squaring,qk=1,st=1",  # many small programs: B = 1 latency
    "bv=64,w=2,inv=matrix,qk=1,st=1",  # half a value head, T formed once: B >= 16, N <= 32
    "bv=128,w=4,inv=matrix,qk=1,st=1",  # a whole value head: N = 64
]
FULL_EXTRA_BOLE = [
    "bv=16,w=4,inv=squaring",
    "bv=32,tpp=4,w=8,inv=matrix,qk=1",
    "bv=64,w=4,inv=matrix,qk=1,st=1",
    "bv=128,w=8,inv=matrix,qk=1,st=1",
    "bv=64,w=8,inv=squaring",
    "bv=32,w=4,inv=neumann",
    "bv=64,w=8,inv=neumann",
    "bv=32,w=4,inv=squaring,qk=1",
    "bv=32,tpp=2,w=4,inv=matrix",
    "bv=64,tpp=2,w=8,inv=matrix,qk=1",
    "bv=32,tpp=4,w=8,inv=matrix,qk=1,st=1",
    "bv=32,tpp=4,w=8,inv=matrix,hg=2,qk=1",
    "bv=32,w=4,inv=squaring,db=8",
    "bv=32,w=4,inv=squaring,prec=tf32x3",
]
# One warp, the transposed "vk" scratch and the committed tile held won every point measured;
# the depth-first walk (ord=dfs) wins above 8 nodes at B >= 2 (`PernodeConfig.auto`,
# docs/kernels.md, launch table). The full sweep keeps their neighbourhood, the old layout and
# launch, and candidates for the points where the verify is still slower than SGLang's.
DEFAULT_PERNODE = ["bv=16,w=1,ns=2", "bv=8,w=1,ns=3", "bv=8,w=1,ns=3,ord=dfs"]
FULL_EXTRA_PERNODE = [
    "bv=16,w=1,ns=3",
    "bv=8,w=1,ns=2",
    "bv=16,w=2,ns=2",
    "bv=32,w=2,ns=2",
    "bv=32,w=1,ns=2,root=1",
    "bv=16,w=1,ns=2,ev=evict_first",
    "bv=8,w=1,ns=3,ev=evict_first",
    "bv=8,w=1,ns=3,root=0",
    "bv=32,w=2,ns=2,lay=kv",
    "bv=32,w=4,lay=kv",
]

TOL = dict(o=2e-2, u=5e-3, k=1e-4, gamma=1e-4, state=5e-3, conv=2e-2, copy=0.0)
# (CPU emulation of TF32 dots at these dims: o 4e-4 (1.7e-3 after bf16 rounding), u 2e-5;
#  with bf16 q/k/state dots: o 2.4e-3, u 1e-4.)


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    """A launch of the Mosaic GPU verify (`tree_gdn_mgpu.tree_gdn_verify_mgpu` keywords) in the
    bole sweep; --bole-configs "mosaic[,bv=64,inv=squaring,p=1,ax=1,ab=0]" (ax: approx_math,
    ab: auto_barriers). The defaults are the engine's launch (`mosaic_launch`)."""

    block_v: int = 64
    inverse: str = "squaring"
    products: int = 1
    approx_math: bool = True
    auto_barriers: bool = False


def parse_bole(spec: str) -> TreeGDNConfig | MosaicLaunch | str:
    """A config string ("bv=32,w=4,inv=squaring,..."), "auto" (`TreeGDNConfig.auto` for each
    point's (B, N), and the Mosaic verify where `mosaic_launch` takes it) or "mosaic[,bv=..,
    inv=..,p=..,ax=0|1,ab=0|1]" (the Mosaic GPU verify at every point of <= 64 nodes);
    "auto,fold=unroll" (any config items after "auto"): each point's `TreeGDNConfig.auto` with
    those fields replaced (no Mosaic launch), as ("auto", fields)."""
    if spec.strip() == "auto":
        return "auto"
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if items and items[0] == "auto":
        return "auto", _config_fields(items[1:])
    if items and items[0] == "mosaic":
        keys = dict(bv="block_v", inv="inverse", p="products", ax="approx_math", ab="auto_barriers")
        kw = {}
        for item in items[1:]:
            k, _, v = (x.strip() for x in item.partition("="))
            if k not in keys or not v:
                raise ValueError(
                    f"bad Mosaic launch item {item!r} in {spec!r}: use "
                    "mosaic[,bv=64|128][,inv=neumann|squaring][,p=1|2|3]"
                    "[,ax=0|1][,ab=0|1]"
                )
            kw[keys[k]] = v if k == "inv" else bool(int(v)) if k in ("ax", "ab") else int(v)
        return MosaicLaunch(**kw)
    return TreeGDNConfig(**_config_fields(items))


def _config_fields(items) -> dict:
    """TreeGDNConfig fields of "key=value" items (bv=32, w=4, inv=squaring, ...)."""
    keys = dict(
        bv="block_v",
        tpp="tiles_per_program",
        hg="heads_per_program",
        w="num_warps",
        ns="num_stages",
        inv="inverse",
        db="depth_bound",
        qk="bf16_qk",
        st="bf16_state",
        prec="precision",
        pn="precise_nodes",
        fold="fold",
        pf="prefetch_state",
        pff="prefetch_fold",
    )
    kw = {}
    for item in items:
        k, v = item.split("=")
        name = keys[k.strip()]
        v = v.strip()
        if v in ("none", "None"):
            kw[name] = None
        elif name in ("inverse", "precision", "fold"):
            kw[name] = v
        elif name in ("bf16_qk", "bf16_state", "precise_nodes", "prefetch_state", "prefetch_fold"):
            kw[name] = v in ("1", "true", "True")
        else:
            kw[name] = int(v)
    return kw


def resolve_bole(cfgs, b: int, n: int) -> list:
    """The point's configs: "auto" replaced by `TreeGDNConfig.auto(b, n, MAX_DEPTH)` (the
    trees' depth bound, as a decode step passes its tree shape's) and the engine's Mosaic
    launch where it takes one (never in interpret mode: too slow); Mosaic launches only at
    N <= 64; duplicates dropped."""
    out = []
    for c in cfgs:
        if c == "auto":
            launch = None if INTERPRET else mosaic_launch(b, n, DK, DV, jnp.bfloat16, MAX_DEPTH)
            cs = [TreeGDNConfig.auto(b, n, MAX_DEPTH)] + (
                [MosaicLaunch(**launch)] if launch else []
            )
        elif isinstance(c, tuple):  # ("auto", fields); a fold as `TreeGDNConfig.with_fold`
            auto = TreeGDNConfig.auto(b, n, MAX_DEPTH)
            fields = dict(c[1])
            if "fold" in fields:
                auto = auto.with_fold(fields.pop("fold"))
            cs = [dataclasses.replace(auto, **fields)]
        elif isinstance(c, MosaicLaunch):
            cs = [c] if n <= tree_gdn_mgpu.NP else []
        else:
            cs = [c]
        out += [x for x in cs if x not in out]
    return out


def step_args(parents, num_nodes, tree, accepted, path, count, order=None) -> dict:
    """What a decode step holds once for all its layers (the trees, their node counts and
    structure, the accepted nodes and their root paths, PERNODE's walk order), handed to every
    timed jit as an ARGUMENT. Closed over, they would be constants of the jit, and XLA
    materialises a splat constant (all-equal entries, such as full node counts) with a
    broadcast kernel on every call (~0.7 us each at B >= 4),
    which a decode step, passing arrays, never runs."""
    return dict(
        parents=parents,
        num_nodes=num_nodes,
        tree=tree,
        accepted=accepted,
        path=path,
        count=count,
        order=order,
    )


def bind(fn, ctx, **jit_kw):
    """f(*a, **kw) = jax.jit(fn)(ctx, *a, **kw): `step_args` passed as the jit's first
    argument (donate_argnums count it)."""
    jfn = jax.jit(fn, **jit_kw)
    return lambda *a, **kw: jfn(ctx, *a, **kw)


def bole_verify(cfg, ctx):
    """The bole verify of one launch (a Triton config or a MosaicLaunch) as f(q, k, v, g, beta,
    state, pending=None) -> (o, factors[, the folded state with a pending commit]); ctx: the
    step's `step_args`."""
    parents, num_nodes, tree = ctx["parents"], ctx["num_nodes"], ctx["tree"]
    if isinstance(cfg, MosaicLaunch):
        return lambda *a, pending=None: tree_gdn_mgpu.tree_gdn_verify_mgpu(
            *a,
            parents,
            num_nodes,
            tree=tree,
            depth_bound=MAX_DEPTH,
            interpret=INTERPRET,
            pending=pending,
            **dataclasses.asdict(cfg),
        )
    return lambda *a, pending=None: tree_gdn_verify(
        *a,
        parents,
        num_nodes,
        tree=tree,
        backend="pallas",
        interpret=INTERPRET,
        config=cfg,
        pending=pending,
    )


def without_keys(out):
    """A verify's outputs (o, factors[, state]) with the factor k dropped, for a timed jit: the
    factor k is the caller's keys array, and a jit that returns an argument returns a copy of
    it (XLA copies an undonated parameter it outputs). A decode step never pays that: its
    commit reads the keys inside the same jit."""
    o, f, *state = out
    return (o, dataclasses.replace(f, k=None), *state)


def timed_verify(cfg, ctx):
    """`bole_verify` jitted as it is timed (`without_keys`; the step's arrays as arguments)."""
    return bind(
        lambda c, *a, pending=None: without_keys(bole_verify(cfg, c)(*a, pending=pending)), ctx
    )


def parse_pernode(spec: str) -> PernodeConfig:
    """ "bv=32,w=1,ns=2[,lay=kv][,root=0|1][,ev=evict_first][,ord=dfs]" (lay: the scratch
    layout, "vk" by default; root: hold the committed tile in registers, automatic by default;
    ev: the scratch stores' cache hint; ord: the node walk's order, "index" by default)."""
    keys = dict(
        bv="block_v",
        w="num_warps",
        ns="num_stages",
        lay="layout",
        root="hold_root",
        ev="scratch_eviction",
        ord="order",
    )
    return PernodeConfig(
        **{
            keys[k]: (v if k in ("lay", "ev", "ord") else int(v))
            for k, v in (item.split("=") for item in filter(None, spec.split(",")))
        }
    )


def cfg_str(cfg) -> str:
    if isinstance(cfg, MosaicLaunch):
        return (
            f"mosaic,bv={cfg.block_v},inv={cfg.inverse},p={cfg.products}"
            + ("" if cfg.approx_math else ",ax=0")
            + (",ab=1" if cfg.auto_barriers else "")
        )
    if isinstance(cfg, PernodeConfig):
        return (
            f"bv={cfg.block_v},w={cfg.num_warps},ns={cfg.num_stages}"
            + ("" if cfg.layout == "vk" else f",lay={cfg.layout}")
            + ("" if cfg.hold_root is None else f",root={cfg.hold_root}")
            + ("" if cfg.scratch_eviction is None else f",ev={cfg.scratch_eviction}")
            + ("" if cfg.order == "index" else f",ord={cfg.order}")
        )
    s = f"bv={cfg.block_v},hg={cfg.heads_per_program},w={cfg.num_warps},inv={cfg.inverse}"
    if cfg.tiles_per_program != 1:
        s += f",tpp={cfg.tiles_per_program}"
    if cfg.num_stages != 1:
        s += f",ns={cfg.num_stages}"
    if cfg.depth_bound is not None:
        s += f",db={cfg.depth_bound}"
    if cfg.bf16_qk:
        s += ",qk=1"
    if cfg.bf16_state:
        s += ",st=1"
    if cfg.precision:
        s += f",prec={cfg.precision}"
    if cfg.precise_nodes:
        s += ",pn=1"
    if cfg.fold != "loop":
        s += f",fold={cfg.fold}"
    if cfg.prefetch_state:
        s += ",pf=1"
    if cfg.prefetch_fold:
        s += ",pff=1"
    return s


# ----------------------------------------------------------------------------- timing

_DERIVED_LINES = {
    "XLA Modules",
    "XLA Ops",
    "Steps",
    "Launch Stats",
    "Source code",
    "TensorFlow Ops",
    "Framework Name Scope",
    "Framework Ops",
    "XLA TraceMe",
    "TensorFlow Name Scope",
}


def _gpu_intervals(trace_dir: str, names: dict | None = None) -> list[tuple[int, int]]:
    """Kernel (start, end) ns on the GPU streams; `names` (if given) collects each kernel
    name's total ns."""
    from jax.profiler import ProfileData

    out = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        data = ProfileData.from_file(path)
        for plane in data.planes:
            if "gpu" not in plane.name.lower():
                continue
            lines = list(plane.lines)
            use = [ln for ln in lines if "stream" in ln.name.lower()]
            if not use:
                use = [ln for ln in lines if ln.name not in _DERIVED_LINES]
            for ln in use:
                for ev in ln.events:
                    if ev.duration_ns > 0:
                        out.append((int(ev.start_ns), int(ev.start_ns + ev.duration_ns)))
                        if names is not None:
                            names[ev.name] = names.get(ev.name, 0) + int(ev.duration_ns)
    return sorted(out)


def _per_call_busy(intervals, calls: int):
    """(busy us, span us) per call: the union of kernel intervals, split into `calls` groups at
    the calls-1 widest idle gaps (calls are blocked one by one, so host round trips separate
    them). busy excludes launch gaps between kernels of one call, span includes them."""
    if not intervals:
        return None, None
    merged = [list(intervals[0])]
    for s, e in intervals[1:]:
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    if len(merged) < calls:
        total = sum(e - s for s, e in merged) / calls / 1e3
        return [total] * calls, [total] * calls
    gaps = sorted(range(len(merged) - 1), key=lambda i: merged[i + 1][0] - merged[i][1])
    cuts = sorted(gaps[len(gaps) - (calls - 1) :]) if calls > 1 else []
    busy, span, start = [], [], 0
    for c in cuts + [len(merged) - 1]:
        group = merged[start : c + 1]
        busy.append(sum(e - s for s, e in group) / 1e3)
        span.append((group[-1][1] - group[0][0]) / 1e3)
        start = c + 1
    return busy, span


class Timer:
    """Median per-call device time (us) of fn(*arg_sets[i % R]); see the module docstring."""

    def __init__(self, mode: str, reps: int, warmup: int):
        self.mode, self.reps, self.warmup = mode, reps, warmup
        self.profile_ok = mode in ("auto", "profile")
        self.trace_overhead_s = 0.0

    def __call__(self, fn, arg_sets) -> dict:
        for i in range(self.warmup):
            jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        res = {}
        if self.profile_ok:
            d = tempfile.mkdtemp(prefix="bench_tree_gdn_")
            t_trace = time.perf_counter()
            try:
                jax.profiler.start_trace(d)
                t0 = time.perf_counter()
                for i in range(self.reps):
                    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
                wall = (time.perf_counter() - t0) / self.reps * 1e6
                jax.profiler.stop_trace()
                names = {}
                busy, span = _per_call_busy(_gpu_intervals(d, names), self.reps)
                self.trace_overhead_s += time.perf_counter() - t_trace - wall * self.reps / 1e6
                res["wall_blocked_us"] = wall
                if busy:
                    # mean_us: all kernel time over the calls, which does not depend on
                    # where the calls were split (a misplaced cut shows as a wide spread).
                    res.update(
                        us=statistics.median(busy),
                        span_us=statistics.median(span),
                        mean_us=sum(busy) / len(busy),
                        timer="profile",
                        spread_us=[min(busy), max(busy)],
                        # each kernel's mean us per call, longest first
                        kernels_us={
                            k[:80]: round(v / 1e3 / self.reps, 3)
                            for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:8]
                        },
                    )
                    return res
                if self.mode == "profile":
                    raise RuntimeError("the profiler recorded no GPU kernel events")
                print("  [timer] no GPU events in the profile: wall clock from now on", flush=True)
                self.profile_ok = False
            except Exception as e:  # noqa: BLE001 (fall back to wall clock, say so)
                if self.mode == "profile":
                    raise
                print(
                    f"  [timer] profiler unusable ({type(e).__name__}: {e}); wall clock from "
                    "now on",
                    flush=True,
                )
                self.profile_ok = False
                try:
                    jax.profiler.stop_trace()
                except Exception:  # noqa: BLE001
                    pass
            finally:
                shutil.rmtree(d, ignore_errors=True)
        # Wall clock: async dispatch, block only at the end (or every call when outputs are big).
        out = fn(*arg_sets[0])
        big = sum(x.nbytes for x in jax.tree_util.tree_leaves(out)) > 2**30
        del out
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            last = None
            for i in range(self.reps):
                last = fn(*arg_sets[i % len(arg_sets)])
                if big:
                    jax.block_until_ready(last)
            jax.block_until_ready(last)
            times.append((time.perf_counter() - t0) / self.reps * 1e6)
        res.update(us=statistics.median(times), timer="wall", spread_us=[min(times), max(times)])
        return res


def copy_bandwidth(timer: Timer) -> dict:
    n = 2**22 if INTERPRET else 2**28  # 1 GiB of fp32
    xs = [jnp.full((n,), float(i + 1), jnp.float32) for i in range(2)]
    scale = jnp.float32(1.0000001)
    f = jax.jit(lambda x, c: x * c)
    t = timer(f, [(x, scale) for x in xs])
    bw = 2 * n * 4 / (t["us"] * 1e-6)
    del xs
    return dict(bytes=2 * n * 4, us=t["us"], timer=t["timer"], bandwidth=bw)


# ----------------------------------------------------------------------------- inputs


def make_trees(rng, b, n):
    parents = np.stack(
        [
            random_parents(rng, n, "random", max_children=MAX_CHILDREN, max_depth=MAX_DEPTH)
            for _ in range(b)
        ]
    ).astype(np.int32)
    return parents


class TreeContext(NamedTuple):
    parents: jax.Array
    num_nodes: jax.Array
    tree: object  # tree_utils.TreeStructure
    accepted: jax.Array
    path: jax.Array
    count: jax.Array


def tree_context(parents) -> TreeContext:
    """A decode step's per-step tree data for [B, N] parents (full trees): the device
    parents, node counts, `tree_structure` with int8 ancestors (once per step, shared by all
    layers), each tree's deepest node as the accepted one, and its root path as acceptance
    hands it over (`accepted_rows`, MAX_DEPTH rows)."""
    b, n = parents.shape
    parents_d = jnp.asarray(parents)
    num_nodes = jnp.full((b,), n, jnp.int32)
    tree = tree_structure(parents_d, num_nodes)
    tree = dataclasses.replace(tree, anc=tree.anc.astype(jnp.int8))
    accepted = jnp.asarray(deepest_nodes(np.asarray(parents)))
    path, count = accepted_rows(parents_d, accepted, min(MAX_DEPTH, n))
    return TreeContext(parents_d, num_nodes, tree, accepted, path, count)


def make_sets(key, b, n, count):
    """`count` independent device-resident input sets (q, k, v, g, beta, state)."""
    hk, hv, dk, dv = HK, HV, DK, DV
    sets = []
    for i in range(count):
        kq, kk, kv, kg, kb, ks = jax.random.split(jax.random.fold_in(key, i), 6)
        sets.append(
            (
                jax.random.normal(kq, (b, n, hk, dk), jnp.float32).astype(jnp.bfloat16),
                jax.random.normal(kk, (b, n, hk, dk), jnp.float32).astype(jnp.bfloat16),
                jax.random.normal(kv, (b, n, hv, dv), jnp.float32).astype(jnp.bfloat16),
                -jax.random.uniform(kg, (b, n, hv), jnp.float32, 0.01, 1.0),
                jax.random.uniform(kb, (b, n, hv), jnp.float32, 0.05, 0.95),
                jax.random.normal(ks, (b, hv, dk, dv), jnp.float32) / math.sqrt(dk),
            )
        )
    return sets


def input_set_count(b, n, cap=64):
    """Input sets to rotate among at a point: their total several times the L2 cache."""
    return int(min(cap, max(2, math.ceil(3 * L2_BYTES / set_bytes(b, n)))))


def scratch_bytes_of(b, n):
    """PERNODE's per-node state scratch for one GDN layer (fp32)."""
    return b * n * HV * DK * DV * 4


def pernode_set_count(b, n, r):
    """Of r input sets, how many PERNODE may rotate among: each call leaves a whole scratch."""
    return int(max(1, min(r, (24 * 2**30) // max(scratch_bytes_of(b, n), 1))))


def set_bytes(b, n):
    return 2 * b * n * HK * DK * 2 + b * n * HV * DV * 2 + 2 * b * n * HV * 4 + b * HV * DK * DV * 4


def row_bytes():
    """A node's factors (`TreeFactors`): its bf16 keys as the verify took them with their fp32
    normalising factors, fp32 u and gamma."""
    return HK * DK * 2 + HK * 4 + HV * DV * 4 + HV * 4


def floor_bytes(b, n):
    """The verify's bytes floor (docs/benchmarks.md): read S_pre once per request-head, q, k, v,
    gates; write o, u,
    gamma."""
    return (
        b * HV * DK * DV * 4
        + 2 * b * n * HK * DK * 2
        + b * n * HV * DV * 2
        + 2 * b * n * HV * 4
        + b * n * HV * DV * 2
        + b * n * HV * DV * 4
        + b * n * HV * 4
    )


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reloads(parents, order=None):
    """Mean nodes per request whose parent is neither the node walked just before it nor the
    committed state: the per-node kernel's reloads from its scratch, walking in `order`
    (None: index order)."""
    if order is None:
        order = np.broadcast_to(np.arange(parents.shape[1]), parents.shape)
    out = []
    for p, o in zip(parents, order):
        prev = np.concatenate([[-1], o[:-1]])
        out.append(int(np.sum((p[o] != prev) & (p[o] >= 0))))
    return float(np.mean(out))


def deepest_nodes(parents):
    out = []
    for p in parents:
        d = np.zeros(len(p), np.int64)
        for i, q in enumerate(p):
            d[i] = 1 + (d[q] if q >= 0 else 0)
        out.append(int(np.argmax(d)))
    return np.asarray(out, np.int32)


# ----------------------------------------------------------------------------- checks


def unlaunchable(e: Exception) -> bool:
    """XLA's refusal of a launch that asks for more shared memory than an SM has."""
    return "RESOURCE_EXHAUSTED" in str(e) and "hared memory" in str(e)


def run_checks(bole_cfgs, pernode_cfgs, seed) -> list[dict]:
    """Every kernel vs its reference on the device (fp32 HIGHEST references)."""
    rows = []

    def record(name, err, tol):
        ok = bool(err <= tol) and np.isfinite(err)
        rows.append(dict(check=name, rel_err=err, tol=tol, ok=ok))
        print(
            f"  {'ok  ' if ok else 'FAIL'} {name:58s} rel err {err:.2e} (tol {tol:.0e})", flush=True
        )

    def record_error(name, e):
        """A launch the device cannot run (over its shared memory) is no wrong result: it is
        listed as unlaunchable and its timing, which fails the same way, is not taken."""
        if unlaunchable(e):
            rows.append(dict(check=name, unlaunchable=str(e)[:300], ok=True))
            print(f"  skip {name:58s} unlaunchable: {str(e)[:120]}", flush=True)
        else:
            record(f"{name} raised {type(e).__name__}: {str(e)[:200]}", float("inf"), 0.0)

    rng = np.random.default_rng(seed)
    b, n = 4, 24  # 4 ragged requests
    parents = make_trees(rng, b, n)
    num_nodes = np.array([n, 17, 9, 20], np.int32)
    parents[1, 17:] = -1
    parents[2, 9:] = 5  # garbage in padding
    parents[3, 20:] = -1
    args = make_sets(jax.random.PRNGKey(seed), b, n, 1)[0]
    tree = tree_structure(parents, num_nodes)
    o_seq, states = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes, tree=tree)
    record("reference: closed form vs sequential (o)", rel(o_ref, o_seq), TOL["o"])
    mask = np.arange(n)[None, :] < num_nodes[:, None]
    acc = np.array([n - 1, 16, 0, 19], np.int32)
    want_state = np.asarray(states)[np.arange(b), acc]
    for cfg in resolve_bole(bole_cfgs, b, n):
        try:
            o, f = bole_verify(cfg, step_args(parents, num_nodes, tree, None, None, None))(*args)
            tag = f"bole [{cfg_str(cfg)}]"
            record(f"{tag} o", rel(o, o_ref), TOL["o"])
            record(f"{tag} u", rel(f.u, f_ref.u), TOL["u"])
            record(f"{tag} k", rel(f.keys(), f_ref.keys()), TOL["k"])
            held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(f)) / (b * n)
            record(f"{tag} factor bytes per node vs row_bytes()", abs(held / row_bytes() - 1), 0.0)
            record(f"{tag} gamma", rel(f.gamma, f_ref.gamma), TOL["gamma"])
            pad = float(
                jnp.max(jnp.abs(jnp.where(mask[:, :, None, None], 0.0, f.u.astype(jnp.float32))))
            )
            record(f"{tag} padding rows zero", pad, 0.0)
            for fold in ("loop", "dot", "unroll"):
                new = commit_state(
                    args[5], f, parents, acc, backend="pallas", interpret=INTERPRET, fold=fold
                )
                record(
                    f"{tag} + pallas commit (fold {fold}) vs sequential",
                    rel(new, want_state),
                    TOL["state"],
                )
            if not isinstance(cfg, TreeGDNConfig):
                continue  # (the Mosaic kernel's lazy verify: bench_lazy checks it)
            # Lazy commit: the same inputs verified again with the path rows pending; the
            # kernel's folded state is the accepted node's state of the recurrence.
            pend = pending_commit(f, parents, acc, n)
            o2_ref, _ = tree_gdn_ref.tree_gdn_closed_form(
                *args[:5], want_state, parents, num_nodes, tree=tree
            )
            for fold in ("loop", "dot", "unroll"):
                try:
                    o2, _, s2 = tree_gdn_verify(
                        *args[:5],
                        args[5],
                        parents,
                        num_nodes,
                        tree=tree,
                        backend="pallas",
                        interpret=INTERPRET,
                        config=cfg.with_fold(fold),
                        pending=pend,
                    )
                except Exception as e:  # noqa: BLE001
                    record_error(f"{tag} lazy (fold {fold})", e)
                    continue
                record(
                    f"{tag} lazy (fold {fold}): folded state vs sequential",
                    rel(s2, want_state),
                    TOL["state"],
                )
                record(f"{tag} lazy (fold {fold}): o", rel(o2, o2_ref), TOL["o"])
        except Exception as e:  # noqa: BLE001
            record_error(f"bole [{cfg_str(cfg)}]", e)
    for kw in (
        dict(backend="reference", max_path=None, precision=None),
        dict(backend="reference", max_path=MAX_DEPTH, precision="highest"),
        dict(backend="pallas", interpret=INTERPRET),
    ):
        try:
            new = commit_state(args[5], f_ref, parents, acc, **kw)
            record(f"commit_state {kw} vs sequential", rel(new, want_state), TOL["state"])
        except Exception as e:  # noqa: BLE001
            record(
                f"commit_state {kw} raised {type(e).__name__}: {str(e)[:200]}", float("inf"), 0.0
            )
    for cfg in pernode_cfgs:
        tag = f"pernode [{cfg_str(cfg)}]"
        try:
            o, scratch = tree_pernode.tree_pernode_verify(
                *args, parents, num_nodes, backend="pallas", interpret=INTERPRET, config=cfg
            )
            record(f"{tag} o", rel(o, o_seq), TOL["o"])
            want = np.asarray(tree_pernode.scratch_layout(states, cfg.layout))
            record(f"{tag} node states", rel(np.asarray(scratch)[mask], want[mask]), TOL["state"])
            new = tree_pernode.commit_pernode_state(args[5], scratch, acc, cfg.layout)
            slot = tree_pernode.scratch_layout(
                np.asarray(scratch)[np.arange(b), acc], cfg.layout
            )  # back in the pool's layout
            record(f"{tag} commit copy", rel(new, slot), TOL["copy"])
            record(
                f"{tag} commit vs sequential",
                rel(new, np.asarray(states)[np.arange(b), acc]),
                TOL["state"],
            )
        except Exception as e:  # noqa: BLE001
            record(f"{tag} raised {type(e).__name__}: {str(e)[:200]}", float("inf"), 0.0)
    chain = np.broadcast_to(np.arange(n) - 1, (b, n)).astype(np.int32)
    o_c, st_c = tree_gdn_ref.tree_gdn_sequential(*args, chain, num_nodes)
    try:
        o, snaps = tree_pernode.chain_verify(
            *args, chain, num_nodes, backend="pallas", interpret=INTERPRET, config=pernode_cfgs[0]
        )
        record("chain o", rel(o, o_c), TOL["o"])
        st_c = np.asarray(tree_pernode.scratch_layout(st_c, pernode_cfgs[0].layout))
        record("chain snapshots", rel(np.asarray(snaps)[mask], st_c[mask]), TOL["state"])
    except Exception as e:  # noqa: BLE001
        record(f"chain raised {type(e).__name__}: {str(e)[:200]}", float("inf"), 0.0)
    kx = jax.random.PRNGKey(seed + 1)
    x = jax.random.normal(kx, (b, n, CONV_C), jnp.float32).astype(jnp.bfloat16)
    cs = jax.random.normal(jax.random.fold_in(kx, 1), (b, 3, CONV_C)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(kx, 2), (4, CONV_C)) * 0.5).astype(jnp.bfloat16)
    y_ref = tree_conv.tree_causal_conv_ref(x, cs, w, parents, num_nodes)
    try:
        y = tree_conv.tree_causal_conv(
            x, cs, w, parents, num_nodes, backend="pallas", interpret=INTERPRET
        )
        record("tree conv", rel(y, y_ref), TOL["conv"])
        y2, win = tree_pernode.tree_pernode_conv(
            x, cs, w, parents, num_nodes, backend="pallas", interpret=INTERPRET
        )
        record("pernode conv", rel(y2, y_ref), TOL["conv"])
        win_ref = tree_conv.node_conv_states_ref(x, cs, parents)
        record(
            "pernode conv windows",
            rel(np.asarray(win)[mask], np.asarray(win_ref)[mask]),
            TOL["copy"],
        )
    except Exception as e:  # noqa: BLE001
        record(f"conv raised {type(e).__name__}: {str(e)[:200]}", float("inf"), 0.0)
    return rows


# ----------------------------------------------------------------------------- grid point


def sweep(label, cfgs, make_fn, errors, sets, timer):
    """Check, then time, each launch config. errors(out) -> {name: (rel err, tol)}; a config
    over tolerance (or failing) is recorded but never "best". Returns (entries, (entry, cfg))."""
    entries, best = [], None
    for cfg in cfgs:
        entry = dict(config=cfg_str(cfg))
        try:
            fn = make_fn(cfg)
            t0 = time.perf_counter()
            out = fn(*sets[0])
            jax.block_until_ready(out)
            entry["compile_s"] = time.perf_counter() - t0
            errs = errors(out)
            del out
            entry.update({f"err_{k}": e for k, (e, _) in errs.items()})
            entry["ok"] = all(e <= tol for e, tol in errs.values())
            entry.update(timer(fn, sets))
        except Exception as e:  # noqa: BLE001
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        entries.append(entry)
        errs_txt = " ".join(
            f"err {k[4:]} {v:.1e}" for k, v in entry.items() if k.startswith("err_")
        )
        print(
            f"    {label:7s} {entry['config']:48s} {entry.get('us', float('nan')):9.1f} us  "
            f"{errs_txt}{'' if entry.get('ok') else '  (NOT OK) ' + entry.get('error', '')}",
            flush=True,
        )
        if entry.get("ok") and (best is None or entry["us"] < best[0]["us"]):
            best = (entry, cfg)
        gc.collect()
    return entries, best


def timer_in_place(commit, states, per_set, timer, ctx) -> dict:
    """Time commit(state, per_set[i], ctx) -> new state the way a decode step runs it: the jit
    donates the state, so the new state is written over the old one (no XLA copy of the
    state first), and each set's state buffer is replaced by the returned one call by call.
    states[i]: set i's state (copied here, so the caller's arrays stay valid); ctx: the step's
    `step_args`, an argument of the jit."""
    fn = jax.jit(commit, donate_argnums=0)
    states = [jnp.copy(states[i]) for i in range(len(per_set))]  # own buffers to donate

    def call(i):
        states[i] = fn(states[i], per_set[i], ctx)
        return states[i]

    res = timer(call, [(i,) for i in range(len(per_set))])
    res["donated"] = True
    return res


def _rows_of(pend):
    """A PendingCommit's gathered arrays, without the count it was handed."""
    return pend.k, pend.u, pend.w, pend.p_sel


def bench_direct(cfg, sets, fac, ctx, states, s_ref, timer) -> dict:
    """The lazy commit without a gather launch: the verify takes a `PendingPath` (each set's
    previous factors and the step's accepted path) and reads the path rows from the factors
    itself (the Triton kernel; on the Mosaic route `tree_gdn_verify`'s gather runs inside the
    same jit, so its time is the whole lazy step either way). Checked: the folded state is
    commit_state's. `states` are bench_lazy's own (donated) buffers; they are replaced here
    call by call as well."""
    mosaic = isinstance(cfg, MosaicLaunch)  # it folds gathered rows: the gather in the jit

    def verify(c, q, k, v, g, beta, state, f):
        pending = PendingPath(factors=f, path=c["path"], sel=c["accepted"], count=c["count"])
        if mosaic:
            pending = gather_pending_path(pending, interpret=INTERPRET)
        return without_keys(bole_verify(cfg, c)(q, k, v, g, beta, state, pending=pending))

    jverify = bind(verify, ctx, donate_argnums=6)

    def call(i):
        out = jverify(*sets[i][:5], states[i], fac[i])
        states[i] = out[2]
        return out

    # the check: the first set from its own committed state (a fresh copy: states[0] has moved)
    out = jverify(*sets[0][:5], jnp.copy(sets[0][5]), fac[0])
    err = rel(out[2], s_ref)
    del out
    res = dict(err_state_direct=err)
    if err > TOL["state"]:
        return dict(res, direct_ok=False)
    return dict(res, direct_ok=True, direct=timer(call, [(i,) for i in range(len(sets))]))


def bench_lazy(cfg, sets, fac, ctx, timer) -> dict:
    """Bole with the lazy commit: the commit only gathers the accepted path's factor rows
    (`pending_commit`, jitted), and the next verify folds them into the state tiles it loads
    (`tree_gdn_verify(pending=)`). Pending rows come from the accepted (deepest) node of each
    set's own previous verify (`fac`). The verify's jit donates the state, as a decode step
    would, so the kernel writes the folded state in place (without donation XLA would copy the
    state first); each set's state buffer is replaced by the returned one call by call."""
    parents, num_nodes, tree, accepted = (
        ctx[k] for k in ("parents", "num_nodes", "tree", "accepted")
    )
    length = ctx["path"].shape[1]
    res = dict(config=cfg_str(cfg), path_rows=length)

    def gather_fn(backend="auto"):  # (the step's accepted path, as in bole_commit)
        return lambda c, f: pending_commit(
            f, c["parents"], c["accepted"], length, c["path"], c["count"], backend=backend
        )

    try:
        gather = bind(gather_fn(), ctx)  # (one jit for every set)
        pend = [gather(f) for f in fac]
        # (the Mosaic fold writes the state in place too: a mutable ref inside its call)
        verify = bind(
            lambda c, q, k, v, g, beta, state, pending: without_keys(
                bole_verify(cfg, c)(q, k, v, g, beta, state, pending=pending)
            ),
            ctx,
            donate_argnums=6,
        )
        states = [jnp.copy(s[5]) for s in sets]  # own buffers: donated call by call

        def call(i):
            out = verify(*sets[i][:5], states[i], pend[i])
            states[i] = out[2]
            return out

        # Check (first call: compiles): the folded state is commit_state's, o and u the closed
        # form's from that state.
        s_ref = commit_state(
            sets[0][5],
            fac[0],
            parents,
            accepted,
            backend="reference",
            max_path=length,
            precision="highest",
        )
        t0 = time.perf_counter()
        out = call(0)
        jax.block_until_ready(out)
        res["compile_s"] = time.perf_counter() - t0
        o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(
            *sets[0][:5], s_ref, parents, num_nodes, tree=tree
        )
        errs = dict(
            o=(rel(out[0], o_ref), TOL["o"]),
            u=(rel(out[1].u, f_ref.u), TOL["u"]),
            state=(rel(out[2], s_ref), TOL["state"]),
        )
        del out, o_ref, f_ref
        res.update({f"err_{k}": e for k, (e, _) in errs.items()})
        res["ok"] = all(e <= tol for e, tol in errs.values())
        res["verify"] = timer(call, [(i,) for i in range(len(sets))])
        # The gather as timed: its rows only. `count` is the step's own (an input here): a jit
        # returning it would time an XLA copy of it (0.6-0.8 us).
        rows_only = bind(lambda c, f: _rows_of(gather_fn()(c, f)), ctx)
        res["commit"] = timer(rows_only, [(f,) for f in fac])
        # the same rows by XLA's gathers (the reference backend, for comparison)
        gather_xla = bind(lambda c, f: _rows_of(gather_fn("reference")(c, f)), ctx)
        res["commit_xla"] = timer(gather_xla, [(f,) for f in fac])
        res["sum_us"] = res["verify"]["us"] + res["commit"]["us"]
        res.update(bench_direct(cfg, sets, fac, ctx, states, s_ref, timer))
    except Exception as e:  # noqa: BLE001
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    errs_txt = " ".join(f"err {k[4:]} {v:.1e}" for k, v in res.items() if k.startswith("err_"))
    nan = dict(us=float("nan"))
    mean = res.get("verify", {}).get("mean_us", float("nan"))
    print(
        f"    {'lazy':7s} {res['config']:48s} {res.get('verify', nan)['us']:9.1f} us "
        f"(mean {mean:.1f}) + gather {res.get('commit', nan)['us']:7.1f} us "
        f"(XLA {res.get('commit_xla', nan)['us']:.1f}); from the factors "
        f"{res.get('direct', nan)['us']:.1f} us  {errs_txt}"
        f"{'' if res.get('ok') else '  (NOT OK) ' + res.get('error', '')}",
        flush=True,
    )
    gc.collect()
    return res


def bench_point(b, n, timer, bole_cfgs, pernode_cfgs, bw, seed) -> dict:
    rng = np.random.default_rng(seed * 1000 + b * 100 + n)
    parents = make_trees(rng, b, n)
    depth = max(tree_depth(p) for p in parents)
    # Once per decode step, shared by all layers (XLA CSE merges the kernel's bool->int8 cast
    # across layers): hand the kernel bytes here so the per-layer time excludes it. The
    # decode step hands every layer's commit the accepted path that acceptance produced
    # (`Accepted.path`): formed once here too, outside the timed per-layer call.
    parents_d, num_nodes, tree, accepted, path_rows, path_count = tree_context(parents)
    r = input_set_count(b, n)
    sets = make_sets(jax.random.PRNGKey(seed + b * 1000 + n), b, n, r)
    point = dict(B=b, N=n, depth=depth, input_sets=r, bole=[], pernode=[])
    ts = jax.jit(lambda p: tree_structure(p, num_nodes))
    jax.block_until_ready(ts(parents_d))
    t0 = time.perf_counter()
    for _ in range(10):
        jax.block_until_ready(ts(parents_d))
    point["tree_structure_wall_us"] = (time.perf_counter() - t0) / 10 * 1e6  # once per step

    ctx = step_args(parents_d, num_nodes, tree, accepted, path_rows, path_count)
    o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*sets[0], parents_d, num_nodes, tree=tree)
    point["bole"], best = sweep(
        "bole",
        resolve_bole(bole_cfgs, b, n),
        lambda cfg: timed_verify(cfg, ctx),
        lambda out, o_ref=o_ref, f_ref=f_ref: dict(
            o=(rel(out[0], o_ref), TOL["o"]), u=(rel(out[1].u, f_ref.u), TOL["u"])
        ),
        sets,
        timer,
    )
    point["bole_best"] = best[0] if best else None
    del f_ref

    # Bole commit: factors of the best config for every input set.
    if best:
        cfg = best[1]
        fac = [bole_verify(cfg, ctx)(*s)[1] for s in sets]
        point["bole_commit"] = []
        # (The launches never measured fastest are dropped: docs/design-decisions.md; "auto"
        # is the engine's default launch, `tree_gdn_commit.commit_launch`.)
        pallas = dict(backend="pallas", num_warps=4)
        variants = [
            dict(pallas, block_v=32, fold="loop"),
            dict(pallas, block_v=32, fold="dot"),
            dict(pallas, block_v=64, fold="dot"),
            dict(pallas, block_v=None, fold="auto"),
            dict(pallas, block_v=32, fold="unroll"),
            dict(pallas, block_v=64, fold="unroll"),
            dict(backend="reference", precision="highest"),
        ]
        for kw in variants:
            try:
                t = timer_in_place(
                    lambda s, f, c, kw=kw: commit_state(
                        s,
                        f,
                        c["parents"],
                        c["accepted"],
                        interpret=INTERPRET,
                        path=c["path"],
                        count=c["count"],
                        **kw,
                    ),
                    [st[5] for st in sets],
                    fac,
                    timer,
                    ctx,
                )
            except Exception as e:  # noqa: BLE001
                t = dict(us=float("inf"), error=f"{type(e).__name__}: {str(e)[:300]}")
            t.update(kw)
            point["bole_commit"].append(t)
        point["bole_commit_best"] = min(point["bole_commit"], key=lambda t: t["us"])
        # For comparison with the first commit kernel's tables: the default variant, without
        # donation (XLA copies the state before the aliased kernel writes it) and walking the
        # path up the parents inside the call.
        kw = variants[0]
        fn = bind(
            lambda c, s, f: commit_state(
                s, f, c["parents"], c["accepted"], interpret=INTERPRET, **kw
            ),
            ctx,
        )
        point["bole_commit_copied"] = dict(timer(fn, [(s[5], f) for s, f in zip(sets, fac)]), **kw)
        # Lazy commit with the rows folded by the rank-1 loop, the dot and unrolled;
        # "bole_lazy" is the fastest that passed its checks.
        # (--lazy-configs: those launches instead, each with its own fold.)
        # (after a Mosaic best: the Triton auto launch's three folds, then the Mosaic fold)
        base = cfg if isinstance(cfg, TreeGDNConfig) else TreeGDNConfig.auto(b, n, MAX_DEPTH)
        lazy_cfgs = (
            resolve_bole(LAZY_CFGS, b, n)
            if LAZY_CFGS
            else [base.with_fold(fold) for fold in ("loop", "dot", "unroll")]
            + ([cfg] if isinstance(cfg, MosaicLaunch) else [])
        )
        point["bole_lazy_variants"] = [bench_lazy(c, sets, fac, ctx, timer) for c in lazy_cfgs]
        ok = [r for r in point["bole_lazy_variants"] if r.get("ok")]
        point["bole_lazy"] = (
            min(ok, key=lambda r: r["sum_us"]) if ok else point["bole_lazy_variants"][0]
        )
        direct = [r for r in point["bole_lazy_variants"] if r.get("direct_ok")]
        if direct:  # the lazy step without a gather launch (`PendingPath`)
            point["bole_direct"] = min(direct, key=lambda r: r["direct"]["us"])
        del fac

    # TREE-PERNODE verify: sweep (the scratch is huge: fewer input sets when needed).
    scratch_bytes = scratch_bytes_of(b, n)
    r_pn = pernode_set_count(b, n, r)
    # (the per-node output equals the closed form's: same maths)
    # The depth-first walk's order: once per decode step, shared by all layers (as the tree).
    order = dfs_order(parents_d, num_nodes, tree.anc)
    point["reloads"] = dict(index=reloads(parents), dfs=reloads(parents, np.asarray(order)))
    print(
        f"    pernode reloads per request: {point['reloads']['index']:.1f} in index order, "
        f"{point['reloads']['dfs']:.1f} depth-first",
        flush=True,
    )
    ctx_pn = dict(ctx, order=order)
    point["pernode"], best_pn = sweep(
        "pernode",
        pernode_cfgs,
        lambda cfg: bind(
            lambda c, *a: tree_pernode.tree_pernode_verify(
                *a,
                c["parents"],
                c["num_nodes"],
                backend="pallas",
                interpret=INTERPRET,
                config=cfg,
                order=c["order"],
            ),
            ctx_pn,
        ),
        lambda out, o_ref=o_ref: dict(o=(rel(out[0], o_ref), TOL["o"])),
        sets[:r_pn],
        timer,
    )
    del o_ref
    point["pernode_best"] = best_pn[0] if best_pn else None
    if best_pn:
        cfg = best_pn[1]
        r_c = int(max(1, min(r_pn, 2)))
        scr = [
            tree_pernode.tree_pernode_verify(
                *s,
                parents_d,
                num_nodes,
                backend="pallas",
                interpret=INTERPRET,
                config=cfg,
                order=order,
            )[1]
            for s in sets[:r_c]
        ]
        point["pernode_commit"] = timer_in_place(
            lambda s, sc, c: tree_pernode.commit_pernode_state(s, sc, c["accepted"], cfg.layout),
            [st[5] for st in sets],
            scr,
            timer,
            ctx,
        )
        if cfg.layout == "vk":  # the same commit by XLA (gather + transpose + select)
            point["pernode_commit_xla"] = timer_in_place(
                lambda s, sc, c: tree_pernode.commit_pernode_state(
                    s, sc, c["accepted"], cfg.layout, backend="reference"
                ),
                [st[5] for st in sets],
                scr,
                timer,
                ctx,
            )
        print(
            f"    pernode commit [{cfg_str(cfg)}]  {point['pernode_commit']['us']:8.1f} us"
            + (
                f" (XLA {point['pernode_commit_xla']['us']:.1f})"
                if "pernode_commit_xla" in point
                else ""
            ),
            flush=True,
        )
        del scr
    gc.collect()

    fb = floor_bytes(b, n)
    point.update(
        floor_bytes=fb,
        floor_us=fb / bw * 1e6,
        floor_us_at_4p3TBs=fb / REF_BW * 1e6,
        bole_kernel_bytes=fb + b * n * HK * 4 + b * n * n,  # + k_scale, ancestor mask
        commit_floor_bytes=2 * b * HV * DK * DV * 4 + b * MAX_DEPTH * row_bytes(),
        scratch_bytes=scratch_bytes,
        factor_bytes=b * n * row_bytes(),
        sglang=dict(
            zip(
                ("depth", "verify_us", "commit_us", "floor_us", "scratch_mib", "factors_mib"),
                SGLANG[(b, n)],
            )
        )
        if (b, n) in SGLANG
        else None,
    )
    point["memory_ratio"] = point["scratch_bytes"] / point["factor_bytes"]
    if point.get("bole_best") and point.get("pernode_best"):
        bv = point["bole_best"]["us"]
        bc = point["bole_commit_best"]["us"]
        pv, pc = point["pernode_best"]["us"], point["pernode_commit"]["us"]
        point.update(
            bole_sum_us=bv + bc,
            pernode_sum_us=pv + pc,
            speedup_sum=(pv + pc) / (bv + bc),
            speedup_verify=pv / bv,
            bole_over_floor=bv / point["floor_us"],
            bole_achieved_bw=point["bole_kernel_bytes"] / (bv * 1e-6),
        )
        lazy = point.get("bole_lazy") or {}
        if lazy.get("ok"):
            lv, lc = lazy["verify"]["us"], lazy["commit"]["us"]
            point.update(
                bole_lazy_verify_us=lv,
                bole_lazy_commit_us=lc,
                bole_lazy_sum_us=lv + lc,
                speedup_sum_lazy=(pv + pc) / (lv + lc),
                lazy_over_bole_sum=(lv + lc) / (bv + bc),
            )
        if point.get("bole_direct"):
            dv = point["bole_direct"]["direct"]["us"]
            point.update(bole_direct_us=dv, speedup_sum_direct=(pv + pc) / dv)
    return point


# ----------------------------------------------------------------------------- report


def _lazy_cols(p) -> str:
    if "bole_lazy_sum_us" not in p:
        return f"{'(lazy: ' + ('not ok' if p.get('bole_lazy') else 'not run') + ')':42s}"
    return (
        f"{p['bole_lazy_verify_us']:8.1f} {p['bole_lazy_commit_us']:7.1f} "
        f"{p['bole_lazy_sum_us']:7.1f} {p['speedup_sum_lazy']:6.1f}x "
        f"{p['lazy_over_bole_sum']:8.2f}x"
    )


def print_table(points):
    hdr = (
        "  B    N  d | bole ver  commit     sum | pernode ver  commit      sum | speedup "
        "(ver) | lazy ver  gather     sum speedup lazy/bole | direct speedup | floor  "
        "x/floor | sglang ver  "
        "commit | scratch MiB factors MiB  ratio"
    )
    print("\n" + hdr)
    print("-" * len(hdr))
    for p in points:
        if "speedup_sum" not in p:
            print(
                f"{p['B']:3d} {p['N']:4d} {p['depth']:2d} | "
                f"(incomplete: {p.get('note', 'see JSON')})"
            )
            continue
        sg = p["sglang"] or {}
        print(
            f"{p['B']:3d} {p['N']:4d} {p['depth']:2d} | {p['bole_best']['us']:8.1f} "
            f"{p['bole_commit_best']['us']:7.1f} {p['bole_sum_us']:7.1f} | "
            f"{p['pernode_best']['us']:11.1f} {p['pernode_commit']['us']:7.1f} "
            f"{p['pernode_sum_us']:8.1f} | {p['speedup_sum']:6.1f}x ({p['speedup_verify']:5.1f}x)"
            f" | {_lazy_cols(p)} | {p.get('bole_direct_us', float('nan')):6.1f} "
            f"{p.get('speedup_sum_direct', float('nan')):6.1f}x"
            f" | {p['floor_us']:5.1f} {p['bole_over_floor']:6.1f}x | "
            f"{sg.get('verify_us', float('nan')):10.0f} {sg.get('commit_us', float('nan')):7.0f}"
            f" | {p['scratch_bytes'] / 2**20:11.0f} {p['factor_bytes'] / 2**20:11.1f} "
            f"{p['memory_ratio']:6.1f}x"
        )
    print(
        "best launch configs: "
        + "; ".join(
            f"B{p['B']}N{p['N']}: bole[{p['bole_best']['config']}] "
            f"pernode[{p['pernode_best']['config']}]"
            for p in points
            if p.get("bole_best") and p.get("pernode_best")
        )
    )


def plot(points, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib not importable: {e})")
        return None
    bs = sorted({p["B"] for p in points})
    fig, axes = plt.subplots(1, len(bs), figsize=(4 * len(bs), 3.6), squeeze=False)
    for ax, b in zip(axes[0], bs):
        pts = sorted(
            (p for p in points if p["B"] == b and "speedup_sum" in p), key=lambda p: p["N"]
        )
        ns = [p["N"] for p in pts]
        ax.plot(ns, [p["bole_sum_us"] for p in pts], "o-", label="Bole verify+commit")
        lz = [(p["N"], p["bole_lazy_sum_us"]) for p in pts if "bole_lazy_sum_us" in p]
        if lz:
            ax.plot(*zip(*lz), "d-", label="Bole lazy (verify+fold, gathers)")
        ax.plot(ns, [p["pernode_sum_us"] for p in pts], "s-", label="TREE-PERNODE verify+commit")
        sg = [
            (p["N"], p["sglang"]["verify_us"] + p["sglang"]["commit_us"])
            for p in pts
            if p["sglang"]
        ]
        if sg:
            ax.plot(*zip(*sg), "^--", label="SGLang (03-targets)")
        ax.plot(ns, [p["floor_us"] for p in pts], "k:", label="bytes floor (verify)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"B = {b}")
        ax.set_xlabel("tree nodes N")
        ax.set_ylabel("us per GDN layer")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def run_info(script: str) -> dict:
    """The provenance of a benchmark JSON: the command (script relative to the repository, its
    arguments), the commit, the device and the jax / jaxlib versions."""
    dev = jax.devices()[0]
    return dict(
        command="python " + " ".join([os.path.relpath(script, REPO)] + sys.argv[1:]),
        git_commit=git_commit(),
        device=str(dev.device_kind),
        platform=dev.platform,
        jax_version=jax.__version__,
        jaxlib_version=_jaxlib_version(),
    )


def git_commit():
    """BOLE_GIT_COMMIT when set (the GPU machine's copy of the tree has no usable git history:
    git there can read a stale HEAD), else git."""
    if os.environ.get("BOLE_GIT_COMMIT"):
        return os.environ["BOLE_GIT_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (JSON + plot)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="B in {1, 16}, N in {16, 64}, first two configs of each sweep",
    )
    ap.add_argument("--B", default="1,4,16,64")
    ap.add_argument("--N", default="8,16,32,64")
    ap.add_argument(
        "--sweep",
        choices=("none", "default", "full"),
        default="default",
        help="Bole/pernode launch configs per point (none = first of each list)",
    )
    ap.add_argument(
        "--bole-configs",
        default=None,
        help='";"-separated, e.g. "bv=64,w=8,inv=squaring,qk=1;bv=32,w=4" '
        "(keys: bv tpp hg w ns inv db qk st prec pn fold pf pff); replaces "
        "the sweep list",
    )
    ap.add_argument("--pernode-configs", default=None, help='e.g. "bv=32,w=4;bv=64,w=8"')
    ap.add_argument(
        "--lazy-configs",
        default=None,
        help='";"-separated launches of the lazy verify, each with its fold, e.g. '
        '"bv=64,w=2,inv=matrix,qk=1,st=1,fold=loop;auto" (default: the best '
        "verify config with the loop, dot and unrolled folds)",
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timer", choices=("auto", "profile", "wall"), default="auto")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="after this many seconds only the best config so far is timed; after "
        "1.15x it, remaining points are skipped",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--no-fail", action="store_true", help="exit 0 even if a check fails")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="test this script without a GPU: interpret mode, tiny head dims",
    )
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        global HK, HV, DK, DV, CONV_C, INTERPRET
        HK, HV, DK, DV, INTERPRET = 1, 2, 16, 128, True
        CONV_C = 2 * HK * DK + HV * DV
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)

    if args.bole_configs:
        bole_specs = args.bole_configs.split(";")
    else:
        bole_specs = DEFAULT_BOLE + (FULL_EXTRA_BOLE if args.sweep == "full" else [])
    if args.pernode_configs:
        pn_specs = args.pernode_configs.split(";")
    else:
        pn_specs = DEFAULT_PERNODE + (FULL_EXTRA_PERNODE if args.sweep == "full" else [])
    bs = [int(x) for x in args.B.split(",")]
    ns = [int(x) for x in args.N.split(",")]
    if args.quick:
        bs, ns = [1, 16], [16, 64]
        bole_specs, pn_specs = bole_specs[:2], pn_specs[:1]
        args.reps = min(args.reps, 15)
    if args.sweep == "none" and not args.bole_configs:
        bole_specs = bole_specs[:1]
    if args.sweep == "none" and not args.pernode_configs:
        pn_specs = pn_specs[:1]
    bole_cfgs = [parse_bole(s) for s in bole_specs]
    global LAZY_CFGS
    if args.lazy_configs:
        LAZY_CFGS = [parse_bole(s) for s in args.lazy_configs.split(";")]
    pn_cfgs = [parse_pernode(s) for s in pn_specs]

    dev = jax.devices()[0]
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        git_commit=git_commit(),
        device=dev.device_kind,
        platform=dev.platform,
        jax_version=jax.__version__,
        jaxlib_version=_jaxlib_version(),
        dims=dict(
            Hk=HK,
            HV=HV,
            dk=DK,
            dv=DV,
            qkv_dtype="bfloat16",
            state_dtype="float32",
            max_children=MAX_CHILDREN,
            max_depth=MAX_DEPTH,
        ),
        bole_configs=bole_specs,
        pernode_configs=pn_specs,
        reps=args.reps,
        timing=(
            "separate jitted calls, blocked per call, inputs rotated over R sets (R x set "
            "size >= 3 x L2); device time = union of GPU kernel intervals per call from the "
            "JAX profiler, median over calls; wall clock if the profiler gives no events"
        ),
        points=[],
    )
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    if dev.platform != "gpu":
        print("WARNING: not a GPU: Pallas kernels need one (or --cpu-dry-run)")
    timer = Timer(args.timer, args.reps, args.warmup)
    out_json = os.path.join(args.out, "bench_tree_gdn.json")

    def dump():
        result["elapsed_s"] = time.perf_counter() - t_start
        with open(out_json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)

    bw = copy_bandwidth(timer)
    result["copy_bandwidth"] = bw
    print(f"copy bandwidth {bw['bandwidth'] / 1e12:.2f} TB/s ({bw['timer']})", flush=True)

    failed = False
    if not args.skip_check:
        print("correctness on device (vs fp32 references):", flush=True)
        result["checks"] = run_checks(bole_cfgs, pn_cfgs, args.seed)
        failed = not all(c["ok"] for c in result["checks"])
        dump()
        if failed:
            print("\n*** CORRECTNESS CHECK FAILED (see above / JSON 'checks') ***\n", flush=True)
            if not args.no_fail:
                sys.exit(1)

    best_so_far = None
    # The headline target point first (>= 30x at B=16, N=64; docs/benchmarks.md), so a tight time
    # budget never skips it; the table is sorted by (B, N) at the end.
    order = sorted(((b, n) for b in bs for n in ns), key=lambda bn: (bn != (16, 64), bn))
    for b, n in order:
        elapsed = time.perf_counter() - t_start
        if elapsed > 1.15 * args.budget_s:
            result["points"].append(dict(B=b, N=n, depth=-1, note="skipped: time budget"))
            print(f"B={b} N={n}: skipped (time budget)", flush=True)
            continue
        cfgs, pcfgs = bole_cfgs, pn_cfgs
        if elapsed > args.budget_s and best_so_far:
            # Past the budget: the measured winner table for this point (not the previous
            # point's best, which can be far off: bv=64, w=2 took 793 us at B=64 N=64 against
            # 211 us for the auto config) and the best per-node config so far.
            cfgs, pcfgs = ["auto"], [best_so_far[1]]
        print(f"B={b} N={n} ({elapsed:.0f} s)", flush=True)
        try:
            p = bench_point(b, n, timer, cfgs, pcfgs, bw["bandwidth"], args.seed)
        except Exception as e:  # noqa: BLE001
            p = dict(B=b, N=n, depth=-1, note=f"failed: {type(e).__name__}: {str(e)[:300]}")
            print(f"  point failed: {p['note']}", flush=True)
        result["points"].append(p)
        if p.get("bole_best") and p.get("pernode_best"):
            best_so_far = (
                parse_bole(p["bole_best"]["config"]),
                parse_pernode(p["pernode_best"]["config"]),
            )
        dump()
        gc.collect()

    result["trace_overhead_s"] = timer.trace_overhead_s
    result["points"].sort(key=lambda p: (p["B"], p["N"]))
    print_table(result["points"])
    result["plot"] = plot(result["points"], os.path.join(args.out, "bench_tree_gdn.png"))
    dump()
    print(f"\nwrote {out_json} ({time.perf_counter() - t_start:.0f} s)")
    if failed and not args.no_fail:
        sys.exit(1)


if __name__ == "__main__":
    main()
