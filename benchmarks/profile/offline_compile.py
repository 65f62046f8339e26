"""Compile the Bole verify kernel for sm_90 without a GPU: registers, spills, shared memory, SASS.

The GPU image compiles Pallas kernels inside XLA (no line info, nothing to read back), so this
lowers the kernel here, takes the Triton module that `pallas_call(debug=True)` prints, strips its
location annotations, and compiles it with a separately installed Triton (its own Python: Triton
is not a dependency of this project) and that Triton's `ptxas` / `cuobjdump`:

    python benchmarks/profile/offline_compile.py --triton-python /path/to/venv/bin/python \\
        --B 16 --N 64 --config '{"block_v": 128, "num_warps": 4, "inverse": "matrix",
        "bf16_qk": true, "bf16_state": true, "depth_bound": 8}' [--pending [path]] [--out DIR]

`--kernel commit` compiles the selected-state commit (`tree_gdn_commit.commit_state_pallas`) instead,
with the accepted path handed in as the decode step does; --config then takes its launch
(`{"block_v": null, "num_warps": 4, "fold": "auto"}`, the defaults: `tree_gdn_commit.commit_launch`).
`--kernel commit_states --layers L` compiles one launch of the eager commit of L GDN layers
(`commit_states_pallas`, a switch over L copies of the commit; `--hv 48` for Qwen3.5-27B's value
heads), printing how long Triton and ptxas took:

    python benchmarks/profile/offline_compile.py --triton-python PY --kernel commit_states \
        --layers 8 --hv 48 --B 32 --N 16

Prints shared memory, registers, spill bytes, the SASS instruction count and its most frequent
opcodes. A proxy only: the Triton version differs from XLA's (with Triton 3.6 here, XLA's
build gave the B = 1 launch 234 registers where this gives 252), and nothing here is timed.
Qwen3-Next dims (bench_tree_gdn.py's): Hk 16, HV 32, dk = dv 128, bf16 q/k/v, fp32 state.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
k = triton.compile(sys.argv[1], target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=int(sys.argv[2]), num_stages=int(sys.argv[3])))
open(sys.argv[4], "w").write(k.asm["ptx"])
print(getattr(k.metadata, "global_scratch_size", 0) + getattr(k.metadata, "profile_scratch_size", 0))
print(k.metadata.shared)
bin_dir = __import__("os").path.join(__import__("os").path.dirname(triton.__file__),
                                     "backends", "nvidia", "bin")
print(bin_dir)
"""


def triton_modules(b: int, n: int, cfg, pending) -> list[str]:
    """The verify's Triton modules as text, as pallas_call(debug=True) prints them (one per
    launch)."""
    return _lower(b, n, cfg, pending)[0]


def _attribute_helpers_to_callers():
    """Debug locations name the innermost user frame; make it the kernel's line that called a
    triton_ops helper (dot, load, store), not the helper's own line. jax internals: best
    effort."""
    try:
        from jax._src import source_info_util

        from bole_jax.pallas import triton_ops

        source_info_util.register_exclusion(triton_ops.__file__)
    except (ImportError, AttributeError):  # pragma: no cover - a jax without the hook
        print("note: triton_ops lines stay in the locations (no source_info_util hook)")


@contextlib.contextmanager
def _pallas_call_replaced(wrap):
    """tree_gdn's `pl.pallas_call` replaced by wrap(the original) inside the block."""
    import bole_jax.pallas.tree_gdn as tg

    orig = tg.pl.pallas_call
    tg.pl.pallas_call = wrap(orig)
    try:
        yield
    finally:
        tg.pl.pallas_call = orig


def _lower(b: int, n: int, cfg, pending):
    """(Triton module texts, launches): each launch's grid and its operands' and outputs'
    [shape, dtype], in the kernel's parameter order. pending: False, True / "rows" (gathered
    rows, `PendingCommit`) or "path" (the previous factors + accepted path, `PendingPath`)."""
    import jax
    import jax.numpy as jnp

    import bole_jax.pallas.tree_gdn as tg
    from benchmarks.bench_tree_gdn import DK, DV, HK, HV, MAX_DEPTH
    from bole_jax.pallas.factors import PendingCommit, PendingPath, TreeFactors
    from bole_jax.pallas.tree_utils import tree_structure

    sd = jax.ShapeDtypeStruct
    q, v = sd((b, n, HK, DK), jnp.bfloat16), sd((b, n, HV, DV), jnp.bfloat16)
    g, state, parents = (
        sd((b, n, HV), jnp.float32),
        sd((b, HV, DK, DV), jnp.float32),
        sd((b, n), jnp.int32),
    )
    # pending: the accepted path's rows, as many as bench_tree_gdn's trees' depth bound
    pend = (
        PendingCommit(
            k=sd((b, MAX_DEPTH, HK, DK), jnp.float32),
            u=sd((b, MAX_DEPTH, HV, DV), jnp.float32),
            w=sd((b, MAX_DEPTH, HV), jnp.float32),
            p_sel=sd((b, HV), jnp.float32),
            count=sd((b,), jnp.int32),
        )
        if pending
        else None
    )
    if pending == "path":  # the previous step's factors of n nodes and its accepted path
        pend = PendingPath(
            factors=TreeFactors(
                k=sd((b, n, HK, DK), jnp.bfloat16),
                u=sd((b, n, HV, DV), jnp.float32),
                gamma=sd((b, n, HV), jnp.float32),
                k_scale=sd((b, n, HK), jnp.float32),
            ),
            path=sd((b, MAX_DEPTH), jnp.int32),
            sel=sd((b,), jnp.int32),
            count=sd((b,), jnp.int32),
        )

    def f(q, k, v, g, beta, s, parents, pend):
        tree = tree_structure(parents, None)
        tree = dataclasses.replace(tree, anc=tree.anc.astype(jnp.int8))
        return tg.tree_gdn_verify(
            q,
            k,
            v,
            g,
            beta,
            s,
            parents,
            None,
            tree=tree,
            backend="pallas",
            interpret=False,
            config=cfg,
            pending=pend,
        )

    return _lower_fn(f, q, q, v, g, g, state, parents, pend)


def _lower_commit(b: int, n: int, commit_cfg: dict, layers: int | None = None, hv=None):
    """As `_lower`, for the commit kernel: factors of bench_tree_gdn's dims (`hv` value heads if
    given), the accepted path handed in ([B, MAX_DEPTH] node ids and their count, as a decode
    step passes them). `layers`: one launch of that many layers (`commit_states_pallas`)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_tree_gdn import DK, DV, HK, HV, MAX_DEPTH
    from bole_jax.pallas.factors import TreeFactors
    from bole_jax.pallas.tree_gdn_commit import commit_state_pallas, commit_states_pallas

    hv = hv or HV
    sd = jax.ShapeDtypeStruct
    fac = TreeFactors(
        k=sd((b, n, HK, DK), jnp.bfloat16),
        u=sd((b, n, hv, DV), jnp.float32),
        gamma=sd((b, n, hv), jnp.float32),
        k_scale=sd((b, n, HK), jnp.float32),
    )
    i32 = jnp.int32
    state = sd((b, hv, DK, DV), jnp.float32)
    path, per_req = sd((b, min(MAX_DEPTH, n)), i32), sd((b,), i32)
    if layers is not None:

        def fs(states, facs, accepted, path, count):
            return commit_states_pallas(
                states, facs, accepted, path, count, layers_per_launch=layers, **commit_cfg
            )

        return _lower_fn(fs, [state] * layers, [fac] * layers, per_req, path, per_req)

    def f(state, fac, parents, accepted, path, count):
        return commit_state_pallas(
            state, fac, parents, accepted, path=path, count=count, **commit_cfg
        )

    return _lower_fn(f, state, fac, sd((b, n), i32), per_req, path, per_req)


def _lower_pernode(b: int, n: int, cfg):
    """As `_lower`, for the TREE-PERNODE baseline's verify (`tree_pernode.tree_pernode_verify`)
    with the PernodeConfig `cfg`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_tree_gdn import DK, DV, HK, HV
    from bole_jax.pallas import tree_pernode

    sd = jax.ShapeDtypeStruct
    q, v = sd((b, n, HK, DK), jnp.bfloat16), sd((b, n, HV, DV), jnp.bfloat16)
    g, state = sd((b, n, HV), jnp.float32), sd((b, HV, DK, DV), jnp.float32)

    def f(q, k, v, g, beta, s, parents):
        return tree_pernode.tree_pernode_verify(
            q, k, v, g, beta, s, parents, backend="pallas", interpret=False, config=cfg
        )

    return _lower_fn(f, q, q, v, g, g, state, sd((b, n), jnp.int32))


def _lower_fn(f, *args):
    """Lower f(*args) for cuda with every pallas_call of tree_gdn printing its Triton module:
    (module texts, launches: each one's grid and its operands' and outputs' [shape, dtype] in
    the kernel's parameter order)."""
    import jax

    launches = []

    def debug_call(orig):
        def pallas_call(*a, **kw):
            call = orig(*a, **dict(kw, debug=True))

            def record(*args):
                launches.append(
                    dict(
                        grid=[int(x) for x in kw["grid"]],
                        inputs=[[list(x.shape), str(x.dtype)] for x in args],
                        outputs=[[list(o.shape), str(o.dtype)] for o in _listed(kw["out_shape"])],
                    )
                )
                return call(*args)

            return record

        return pallas_call

    buf = io.StringIO()
    with _pallas_call_replaced(debug_call), contextlib.redirect_stdout(buf):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    parts = buf.getvalue().split("The Triton module for pallas_call")[1:]
    return [part[part.index("\n") + 1 :] for part in parts], launches


def _listed(out_shape) -> list:
    """A pallas_call's out_shape as a list (the commit has one output, not a list)."""
    return list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]


def _bench_inputs(b: int, n: int, seed: int):
    """bench_tree_gdn's random inputs (q, k, v, g, beta, state) and trees (parents) at (b, n)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_tree_gdn as btg

    inputs = btg.make_sets(jax.random.PRNGKey(seed), b, n, 1)[0]
    return inputs, jnp.asarray(btg.make_trees(np.random.default_rng(seed), b, n))


def _recorded_operands(run) -> list:
    """The concrete operands (numpy, the kernel's parameter order) of the one pallas_call of
    tree_gdn that run() makes: run() goes eagerly (jax.disable_jit) up to the pallas_call,
    which is replaced by a recorder returning zeros. Runs on any backend (CPU is enough)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    got = []

    def recorder(orig):
        def pallas_call(*a, **kw):
            def call(*args):
                got.append([np.asarray(x) for x in args])
                outs = [jnp.zeros(o.shape, o.dtype) for o in _listed(kw["out_shape"])]
                return outs if isinstance(kw["out_shape"], (list, tuple)) else outs[0]

            return call

        return pallas_call

    with _pallas_call_replaced(recorder), jax.disable_jit():
        run()
    if len(got) != 1:
        raise RuntimeError(f"expected one launch, recorded {len(got)}")
    return got[0]


def kernel_operands(b: int, n: int, cfg, seed: int = 0):
    """The plain verify's concrete launch operands (numpy, the kernel's parameter order) for
    bench_tree_gdn's random trees and inputs at (b, n), and those inputs
    (q, k, v, g, beta, state, parents); see `_recorded_operands`."""
    import bole_jax.pallas.tree_gdn as tg

    (q, k, v, g, beta, state), parents = _bench_inputs(b, n, seed)
    operands = _recorded_operands(
        lambda: tg.tree_gdn_verify(
            q, k, v, g, beta, state, parents, None, backend="pallas", interpret=False, config=cfg
        )
    )
    return operands, (q, k, v, g, beta, state, parents)


def commit_operands(b: int, n: int, commit_cfg: dict, seed: int = 0):
    """The commit kernel's concrete launch operands (numpy, parameter order) at (b, n), as
    `kernel_operands` does for the verify: bench_tree_gdn's inputs, the closed form's factors,
    the deepest node of each tree accepted (its root path handed in), and those
    (state, factors, parents, accepted, path, count)."""
    from benchmarks import bench_tree_gdn as btg
    from bole_jax.pallas import tree_gdn_commit, tree_gdn_ref

    (q, k, v, g, beta, state), parents = _bench_inputs(b, n, seed)
    _, fac = tree_gdn_ref.tree_gdn_closed_form(q, k, v, g, beta, state, parents, None)
    tc = btg.tree_context(parents)
    accepted, path, count = tc.accepted, tc.path, tc.count
    operands = _recorded_operands(
        lambda: tree_gdn_commit.commit_state_pallas(
            state, fac, parents, accepted, path=path, count=count, **commit_cfg
        )
    )
    return operands, (state, fac, parents, accepted, path, count)


def strip_locations(text: str) -> str:
    """Drop the pretty-printed debug locations (not parseable MLIR) and anything after the
    module."""
    return _rewrite_locations(text, lambda ref: None)


_PY_LOC = re.compile(r'^"?([^":\s]+\.py)"?:(\d+):(\d+)')


def with_source_locations(text: str, root: str | None = None) -> str:
    """The module with each op's pretty-printed debug location resolved to the Python line it
    came from, written inline as `loc("file":line:col)` (standard MLIR that Triton parses), so
    the PTX's line info, and Nsight Compute's source view, point at the kernel's Python source.
    root: make file paths relative to it (cubin_launch.py resolves them in its own checkout)."""
    defs = {}
    for line in text.splitlines():
        if line.startswith("#loc"):
            name, _, value = line.partition(" = ")
            defs[name.strip()] = value.strip()

    def resolve(ref, depth=0):
        value = defs.get(ref)
        if value is None or depth > 50:
            return None
        m = _PY_LOC.match(value)
        if m:
            path = os.path.relpath(m.group(1), root) if root else m.group(1)
            return f'loc("{path}":{m.group(2)}:{m.group(3)})'
        inner = re.search(r"(#loc\d*)", value)
        return resolve(inner.group(1), depth + 1) if inner else None

    return _rewrite_locations(text, resolve)


def _rewrite_locations(text: str, resolve) -> str:
    """The module without its location aliases: an op's trailing location reference becomes
    resolve(ref) inline (None: dropped); every other reference (e.g. on block arguments) is
    dropped; anything after the module is cut."""

    def inline(m):
        loc = resolve(m.group(1))
        return f" {loc}" if loc else ""

    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#loc") or line.strip() == "at":
            continue
        line = re.sub(r' (?:"[^"]*")?\(?(#loc\d*)\)?(?=\s*$)', inline, line.rstrip("\n")) + "\n"
        line = re.sub(r' "[^"]*"\(#loc\d*\)', "", line)
        line = re.sub(r" \(?#loc\d*\)?", "", line)
        lines.append(line.replace(" [unknown]", ""))
        if line.startswith("}"):
            break
    out = "".join(lines)
    return out[out.index("module @") :]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--triton-python",
        required=True,
        help="a Python with Triton installed (e.g. a venv with triton==3.6)",
    )
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument(
        "--kernel", choices=("verify", "commit", "commit_states", "pernode"), default="verify"
    )
    ap.add_argument("--layers", type=int, default=8, help="--kernel commit_states: layers")
    ap.add_argument("--hv", type=int, default=None, help="commit kernels: value heads")
    ap.add_argument(
        "--config",
        default="{}",
        help="TreeGDNConfig fields as JSON (--kernel commit: block_v, num_warps, "
        "fold; --kernel pernode: PernodeConfig fields)",
    )
    ap.add_argument(
        "--pending",
        nargs="?",
        const="rows",
        default=None,
        choices=("rows", "path"),
        help="the lazy-commit (folding) variant: gathered rows (the default) or "
        "'path', the previous factors + accepted path (`PendingPath`)",
    )
    ap.add_argument("--out", default=None, help="keep the .ttir / .ptx / .cubin / .sass here")
    ap.add_argument(
        "--lineinfo",
        action="store_true",
        help="line info for Nsight Compute's source view (through "
        "benchmarks/profile/cubin_launch.py): each op keeps the kernel line it came "
        f"from; the cubin names the file as {SRC_DIR}/tree_gdn.py, where "
        "cubin_launch.py copies bole_jax/pallas/tree_gdn.py",
    )
    args = ap.parse_args(argv)
    from bole_jax.pallas.tree_gdn import TreeGDNConfig
    from bole_jax.pallas.tree_pernode import PernodeConfig

    try:
        if args.kernel == "pernode":
            cfg = PernodeConfig(**json.loads(args.config))
            num_warps, num_stages, stem = cfg.num_warps, cfg.num_stages, "tree_pernode_verify"
        elif args.kernel in ("commit", "commit_states"):
            cfg = commit_config(json.loads(args.config))
            num_warps, num_stages, stem = cfg["num_warps"], 1, "bole_commit_state"
        else:
            cfg = TreeGDNConfig(**json.loads(args.config))
            num_warps = cfg.num_warps or (4 if args.N <= 64 else 8)
            num_stages, stem = cfg.num_stages, "bole_tree_gdn"
    except (TypeError, ValueError) as e:
        ap.error(f"--config: {e}")
    if args.kernel != "verify" and args.pending:
        ap.error("--pending is a verify variant")
    if args.kernel == "pernode" and args.lineinfo:
        ap.error(
            f"--lineinfo names {SRC_DIR}/tree_gdn.py as the source; the PERNODE kernel is "
            "in tree_pernode.py"
        )
    out = args.out or tempfile.mkdtemp(prefix="offline_compile_")
    os.makedirs(out, exist_ok=True)
    print(
        f"{args.kernel} B={args.B} N={args.N} {cfg}"
        f"{f' (pending {args.pending})' if args.pending else ''}"
    )
    if args.lineinfo:
        _attribute_helpers_to_callers()
    if args.kernel == "commit":
        modules, launches = _lower_commit(args.B, args.N, cfg, hv=args.hv)
    elif args.kernel == "commit_states":
        modules, launches = _lower_commit(args.B, args.N, cfg, args.layers, args.hv)
    elif args.kernel == "pernode":
        modules, launches = _lower_pernode(args.B, args.N, cfg)
    else:
        modules, launches = _lower(args.B, args.N, cfg, args.pending)
    for i, (module, launch) in enumerate(zip(modules, launches)):
        name = stem + (f"_{i}" if len(modules) > 1 else "")
        text = with_source_locations(module) if args.lineinfo else strip_locations(module)
        shared, params, scratch, seconds = _compile_one(
            args.triton_python, text, os.path.join(out, name), num_warps, num_stages, args.lineinfo
        )
        manifest = dict(
            name=name,
            kernel=re.search(r"tt\.func public @(\w+)", text).group(1),
            kind=args.kernel,
            num_warps=num_warps,
            num_stages=num_stages,
            shared=shared,
            params=params,
            scratch_bytes=scratch,
            B=args.B,
            N=args.N,
            pending=args.pending,
            config=cfg if args.kernel.startswith("commit") else dataclasses.asdict(cfg),
            layers=args.layers if args.kernel == "commit_states" else None,
            **seconds,
            lineinfo=args.lineinfo,
            **launch,
        )
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    print(f"files: {out}")


def commit_config(fields: dict) -> dict:
    """The commit launch of --config: block_v, num_warps, fold (defaults None, 4, "auto", as
    the engine runs it: `tree_gdn_commit.commit_launch`); other keys are an error."""
    cfg = dict(block_v=None, num_warps=4, fold="auto")
    unknown = set(fields) - set(cfg)
    if unknown:
        raise ValueError(f"commit launches take block_v, num_warps, fold; not {sorted(unknown)}")
    cfg.update(fields)
    return cfg


SRC_DIR = "/tmp/bole_src"  # where cubin_launch.py puts the source that --lineinfo cubins name


def _compile_one(triton_python, ttir_text, stem, num_warps, num_stages, lineinfo=False):
    """Compile one Triton module to sm_90, print its resources and SASS opcode mix; returns
    (shared memory bytes, number of kernel parameters)."""
    ttir, ptx, cubin = (f"{stem}.{e}" for e in ("ttir", "ptx", "cubin"))
    with open(ttir, "w") as f:
        f.write(ttir_text)
    t0 = time.perf_counter()
    res = subprocess.run(
        [triton_python, "-c", _COMPILE, ttir, str(num_warps), str(num_stages), ptx],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_ALWAYS_COMPILE="1"),  # a compile, not Triton's cache, timed
    )
    t1 = time.perf_counter()
    if res.returncode:
        sys.exit(f"Triton compile failed:\n{res.stderr[-3000:]}")
    scratch, shared, bin_dir = res.stdout.split()[-3:]
    with open(ptx) as f:
        ptx_text = f.read()
    entry = ptx_text[ptx_text.index(".entry") :]  # the kernel's parameter list: up to its ")"
    params = len(re.findall(r"^\s*\.param\b", entry.split(")", 1)[0], re.M))
    if lineinfo:
        # Triton files every op's line under the module's own file (the .ttir); the lines are
        # the kernel's (with_source_locations): name the source where cubin_launch.py puts it.
        with open(ptx, "w") as f:
            f.write(
                re.sub(
                    r'(\.file\s+\d+\s+)"[^"]*"',
                    lambda m: f'{m.group(1)}"{SRC_DIR}/tree_gdn.py"',
                    ptx_text,
                )
            )
    ptxas = subprocess.run(
        [
            _ptxas(bin_dir),
            "-arch=sm_90a",
            "-v",
            *(["-lineinfo"] if lineinfo else []),
            ptx,
            "-o",
            cubin,
        ],
        capture_output=True,
        text=True,
    )
    t2 = time.perf_counter()
    if ptxas.returncode:
        sys.exit(f"ptxas failed:\n{ptxas.stderr[-3000:]}")
    info = " ".join(
        re.split(r"ptxas(?:-blackwell)? info\s*:", line)[-1].strip()
        for line in ptxas.stderr.splitlines()
        if "registers" in line or "spill" in line
    )
    sass = subprocess.run(
        [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True
    ).stdout
    with open(f"{stem}.sass", "w") as f:
        f.write(sass)
    ops = sass_opcodes(sass)
    seconds = dict(triton_s=t1 - t0, ptxas_s=t2 - t1)
    print(
        f"[{os.path.basename(stem)}] shared {int(shared)} bytes | {info} | Triton "
        f"{seconds['triton_s']:.1f} s (its Python's start-up included), ptxas "
        f"{seconds['ptxas_s']:.1f} s"
    )
    print(
        f"SASS {len(ops)} instructions; top: "
        + ", ".join(f"{op} {c}" for op, c in collections.Counter(ops).most_common(10))
    )
    return int(shared), params, int(scratch), seconds


def _ptxas(bin_dir: str) -> str:
    """The ptxas of the separate Triton: newer Tritons write PTX that only the CUDA 13 ptxas they
    ship as `ptxas-blackwell` reads (Triton 3.9: PTX 9.4; its `ptxas` is CUDA 12.8's)."""
    newer = os.path.join(bin_dir, "ptxas-blackwell")
    return newer if os.path.exists(newer) else os.path.join(bin_dir, "ptxas")


def sass_opcodes(sass: str) -> list[str]:
    """The opcode of each instruction of a `cuobjdump -sass` listing (predicates and modifier
    suffixes dropped), in order."""
    return [
        m.group(1).split(".")[0]
        for m in re.finditer(
            r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", sass, re.M
        )
    ]


if __name__ == "__main__":
    main()
