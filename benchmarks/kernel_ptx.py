"""What Triton made of the tree kernels: registers, spills, shared memory, tensor-core
instructions, programs per multiprocessor. A static look, no kernel runs.

Each listed kernel is lowered (jax.jit(...).lower on abstract inputs) with Qwen3-Next GDN dims;
the Pallas Triton lowering compiles every kernel to PTX at that point, and this script captures
that PTX (by wrapping jaxlib's `triton.compile`), then:
  * counts instructions in the PTX: wgmma (Hopper warpgroup MMA), mma.sync (the older warp MMA
    path), global loads/stores, barriers;
  * runs `ptxas -v` on it for sm_90a (registers per thread, spill bytes, stack frame);
  * estimates resident programs per SM from registers, shared memory and warps (an H100/H200
    SM: 64K registers, 228 KiB shared memory, 64 warps).

Needs a GPU backend whose jaxlib compiles Pallas Triton kernels at lowering (jaxlib > 0.10.2);
on older jaxlibs XLA compiles them later and nothing is captured (the script says so).

  python benchmarks/kernel_ptx.py --B 16 --N 64 --out benchmarks/results/kernel_ptx.json
  python benchmarks/kernel_ptx.py --B 16 --N 64 --bole-configs "bv=128,w=8,inv=matrix,qk=1,st=1"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SM_REGS, SM_SMEM, SM_WARPS, SM_PROGRAMS = 65536, 228 * 1024, 64, 32

_COUNTS = {
    "wgmma": r"\bwgmma\.mma_async",
    "mma_sync": r"\bmma\.sync",
    "ld_global": r"\bld\.global",
    "st_global": r"\bst\.global",
    "cp_async": r"\bcp\.async",
    "bar_sync": r"\bbar\.sync|\bbarrier\.sync",
    "ld_shared": r"\bld\.shared",
    "st_shared": r"\bst\.shared",
}


def analyse_ptx(ptx: str) -> dict:
    """Static counts from one kernel's PTX text."""
    entry = re.search(r"\.entry\s+([\w$.]+)", ptx)
    target = re.search(r"^\s*\.target\s+(\S+)", ptx, re.M)
    return dict(entry=entry.group(1) if entry else None,
                target=target.group(1).rstrip(",") if target else None,
                ptx_lines=ptx.count("\n"),
                **{k: len(re.findall(p, ptx)) for k, p in _COUNTS.items()})


def parse_ptxas(text: str) -> dict:
    """Registers / spills / stack from `ptxas -v` output (first kernel reported)."""
    out = {}
    for key, pat in (("registers", r"Used (\d+) registers"),
                     ("spill_stores", r"(\d+) bytes spill stores"),
                     ("spill_loads", r"(\d+) bytes spill loads"),
                     ("stack_frame", r"(\d+) bytes stack frame")):
        m = re.search(pat, text)
        if m:
            out[key] = int(m.group(1))
    return out


def programs_per_sm(registers: int | None, num_warps: int, smem: int | None) -> int | None:
    """Resident programs per SM allowed by registers (allocated per warp in units of 256),
    shared memory and warps."""
    if not registers:
        return None
    per_warp = -(-registers * 32 // 256) * 256
    limits = [SM_REGS // (per_warp * num_warps), SM_WARPS // num_warps, SM_PROGRAMS]
    if smem:
        limits.append(SM_SMEM // smem)
    return max(0, min(limits))


def find_ptxas() -> str | None:
    cands = [os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"]
    try:
        import triton  # noqa: PLC0415
        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                  "ptxas"))
    except Exception:  # noqa: BLE001
        pass
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def run_ptxas(ptxas: str, ptx: str, arch: str = "sm_90a") -> dict:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=300)
    res = parse_ptxas(p.stdout + p.stderr)
    if p.returncode:
        res["ptxas_error"] = (p.stdout + p.stderr)[-400:]
    return res


class Capture:
    """Wraps jaxlib's Triton compile used by the Pallas lowering; records each kernel's PTX."""

    def __init__(self):
        from jax._src.pallas.triton import pallas_call_registration as reg  # noqa: PLC0415
        self.mod = getattr(reg, "triton", None)
        self.kernels: list[dict] = []
        self.orig = getattr(self.mod, "compile", None)

    def __enter__(self):
        if self.orig is not None:
            def wrapped(*a, **kw):
                res = self.orig(*a, **kw)
                self.kernels.append(dict(ptx=getattr(res, "asm", ""),
                                         smem=getattr(res, "smem_bytes", None),
                                         num_warps=kw.get("num_warps"),
                                         num_stages=kw.get("num_stages")))
                return res
            self.mod.compile = wrapped
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            self.mod.compile = self.orig


def lower_kernels(label: str, fn, args) -> list[dict]:
    jax.clear_caches()  # a config seen before would not be lowered (and captured) again
    with Capture() as cap:
        jax.jit(fn).lower(*args)
    return [dict(label=label, **k) for k in cap.kernels]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--bole-configs", default=None,
                    help='";"-separated bench_tree_gdn config strings (default: the auto config)')
    ap.add_argument("--pernode-configs", default="bv=32,w=4")
    ap.add_argument("--commit-configs", default="bv=32,w=4;bv=64,w=4;bv=128,w=8")
    ap.add_argument("--out", default=None, help="JSON result (default: print only)")
    ap.add_argument("--keep-ptx", default=None, help="directory to write each kernel's PTX")
    args = ap.parse_args(argv)

    import bench_tree_gdn as btg  # noqa: PLC0415
    from bole_jax.pallas import tree_pernode  # noqa: PLC0415
    from bole_jax.pallas.tree_gdn import TreeGDNConfig, tree_gdn_verify  # noqa: PLC0415
    from bole_jax.pallas.tree_utils import TreeFactors  # noqa: PLC0415
    from bole_jax.spec_decode.state_factors import commit_state  # noqa: PLC0415

    b, n, hk, hv, dk, dv = args.B, args.N, btg.HK, btg.HV, btg.DK, btg.DV
    S = jax.ShapeDtypeStruct
    ins = (S((b, n, hk, dk), jnp.bfloat16), S((b, n, hk, dk), jnp.bfloat16),
           S((b, n, hv, dv), jnp.bfloat16), S((b, n, hv), jnp.float32),
           S((b, n, hv), jnp.float32), S((b, hv, dk, dv), jnp.float32),
           S((b, n), jnp.int32), S((b,), jnp.int32))
    cfgs = ([btg.parse_bole(c) for c in args.bole_configs.split(";")] if args.bole_configs
            else [TreeGDNConfig.auto(b, n)])
    kernels = []
    for cfg in cfgs:
        kernels += lower_kernels(f"bole {btg.cfg_str(cfg)}", lambda *a, cfg=cfg: tree_gdn_verify(
            *a, backend="pallas", config=cfg), ins)
    for spec in filter(None, args.pernode_configs.split(";")):
        cfg = btg.parse_pernode(spec)
        kernels += lower_kernels(f"pernode {spec}", lambda *a, cfg=cfg: (
            tree_pernode.tree_pernode_verify(*a, backend="pallas", config=cfg)), ins)
    fac = TreeFactors(k=S((b, n, hk, dk), jnp.float32), u=S((b, n, hv, dv), jnp.float32),
                      gamma=S((b, n, hv), jnp.float32))
    for spec in filter(None, args.commit_configs.split(";")):
        kw = dict(item.split("=") for item in spec.split(","))
        bv, w = int(kw["bv"]), int(kw["w"])
        kernels += lower_kernels(f"commit {spec}", lambda s, f, p, a, bv=bv, w=w: commit_state(
            s, f, p, a, backend="pallas", block_v=bv, num_warps=w, max_path=btg.MAX_DEPTH),
            (ins[5], fac, ins[6], ins[7]))

    if not kernels:
        print("no Triton kernel was compiled at lowering: this jaxlib compiles Pallas kernels "
              "inside XLA (jaxlib <= 0.10.2) or the backend is not a GPU; nothing to report")
        return 1
    ptxas = find_ptxas()
    rows = []
    for k in kernels:
        row = dict(label=k["label"], num_warps=k["num_warps"], num_stages=k["num_stages"],
                   smem=k["smem"], **analyse_ptx(k["ptx"]))
        if ptxas:
            row.update(run_ptxas(ptxas, k["ptx"]))
        row["programs_per_sm"] = programs_per_sm(row.get("registers"), k["num_warps"] or 4,
                                                 k["smem"])
        rows.append(row)
        if args.keep_ptx:
            os.makedirs(args.keep_ptx, exist_ok=True)
            name = re.sub(r"[^\w.=-]+", "_", k["label"])
            with open(os.path.join(args.keep_ptx, f"{name}.ptx"), "w") as f:
                f.write(k["ptx"])

    cols = ("label", "num_warps", "registers", "spill_stores", "stack_frame", "smem",
            "programs_per_sm", "wgmma", "mma_sync", "ld_global", "bar_sync", "target")
    print(f"B={b} N={n}, ptxas: {ptxas or 'not found'}")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))
    if args.out:
        dev = jax.devices()[0]
        res = dict(command="python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                   git_commit=btg.git_commit(), device=dev.device_kind, platform=dev.platform,
                   jax_version=jax.__version__, B=b, N=n, ptxas=ptxas, kernels=rows)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
