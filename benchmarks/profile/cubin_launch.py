"""Launch an offline-compiled verify kernel (a cubin) on the GPU, for Nsight Compute's source view.

XLA compiles the Pallas kernels without line info, so ncu's source page shows SASS only. This
runs the same kernel compiled offline by `benchmarks/profile/offline_compile.py --lineinfo --out DIR`
(another Triton than XLA's: the timing is a proxy, printed beside the check) through the CUDA
driver API, on bench_tree_gdn.py's random trees and inputs, so that every SASS instruction maps
to the line of `bole_jax/pallas/tree_gdn.py` it came from:

    # here (no GPU): the cubin and its manifest
    python benchmarks/profile/offline_compile.py --triton-python PY --B 16 --N 64 --lineinfo \\
        --out DIR --config '{"block_v": 128, "num_warps": 4, "inverse": "matrix", ...}'
    # on the GPU machine, at the same commit:
    ncu --set full --import-source yes -k regex:bole -o rep \\
        python benchmarks/profile/cubin_launch.py --dir DIR --reps 1
    python benchmarks/profile/cubin_launch.py --dir DIR --reps 50 --check   # time it, check o and u

A commit cubin (`offline_compile.py --kernel commit`) runs the same way: the deepest node of
each tree accepted, its root path handed in; --check compares the new state with the
reference commit.

The operands are rebuilt here (JAX on the CPU, the wrapper run eagerly up to its pallas_call:
`offline_compile.kernel_operands` / `commit_operands`) and uploaded with cuMemcpy; the kernel's
extra trailing parameters (Triton's scratch pointers) get null. --check compares o and u (the
commit: the new state) with the jnp reference. The verify without a pending fold only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # operands and the reference on the CPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from benchmarks.profile.offline_compile import SRC_DIR, commit_operands, kernel_operands  # noqa: E402

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class Driver:
    """The few CUDA driver calls a launch needs (libcuda through ctypes)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SystemExit(f"no CUDA driver here ({e}): run this on the GPU machine") from e
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), 0)
        self.ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.call("cuCtxSetCurrent", self.ctx)
        self.start, self.stop = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("cuEventCreate", ctypes.byref(self.start), 0)
        self.call("cuEventCreate", ctypes.byref(self.stop), 0)

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed: {rc} {msg.value.decode() if msg.value else ''}")

    def function(self, cubin: str, name: str, shared: int):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("cuModuleLoad", ctypes.byref(mod), cubin.encode())
        self.call("cuModuleGetFunction", ctypes.byref(fn), mod, name.encode())
        if shared > 48 * 1024:
            self.call("cuFuncSetAttribute", fn, _MAX_DYNAMIC_SHARED, shared)
        return fn

    def upload(self, arr: np.ndarray) -> ctypes.c_uint64:
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(max(arr.nbytes, 1)))
        arr = np.ascontiguousarray(arr)
        self.call(
            "cuMemcpyHtoD_v2", ptr, arr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(arr.nbytes)
        )
        return ptr

    def download(self, ptr, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        self.call(
            "cuMemcpyDtoH_v2", out.ctypes.data_as(ctypes.c_void_p), ptr, ctypes.c_size_t(out.nbytes)
        )
        return out

    def launch(self, fn, grid, threads: int, shared: int, params) -> float:
        """One launch; returns its time in us (CUDA events)."""
        start, stop = self.start, self.stop
        slots = [ctypes.c_uint64(p.value if isinstance(p, ctypes.c_uint64) else p) for p in params]
        argv = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self.call("cuEventRecord", start, None)
        self.call(
            "cuLaunchKernel",
            fn,
            *[ctypes.c_uint(g) for g in grid],
            ctypes.c_uint(threads),
            ctypes.c_uint(1),
            ctypes.c_uint(1),
            ctypes.c_uint(shared),
            None,
            argv,
            None,
        )
        self.call("cuEventRecord", stop, None)
        self.call("cuEventSynchronize", stop)
        ms = ctypes.c_float()
        self.call("cuEventElapsedTime", ctypes.byref(ms), start, stop)
        return ms.value * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="offline_compile.py --out DIR (one module)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare o, u (the commit: the state) with the jnp reference",
    )
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    from bole_jax.pallas.tree_gdn import TreeGDNConfig, tree_gdn_verify
    from bole_jax.pallas.tree_gdn_commit import commit_state

    names = [
        n
        for n in ("bole_tree_gdn", "bole_commit_state")
        if os.path.exists(os.path.join(args.dir, f"{n}.json"))
    ]
    if len(names) != 1:
        sys.exit(f"{args.dir}: expected one of bole_tree_gdn.json, bole_commit_state.json")
    with open(os.path.join(args.dir, f"{names[0]}.json")) as f:
        man = json.load(f)
    commit = man.get("kind", "verify") == "commit"
    if man["pending"]:
        sys.exit("cubin_launch.py runs the plain verify only (compiled with --pending)")
    if man.get("scratch_bytes", 0):
        sys.exit(
            f"the kernel wants {man['scratch_bytes']} B of Triton scratch per program: "
            "not supported here"
        )
    if commit:
        operands, inputs = commit_operands(man["B"], man["N"], man["config"], args.seed)
    else:
        cfg = TreeGDNConfig(**man["config"])
        operands, inputs = kernel_operands(man["B"], man["N"], cfg, args.seed)
    got = [[list(a.shape), str(a.dtype)] for a in operands]
    if got != man["inputs"]:
        sys.exit(
            f"operands {got} do not match the compiled kernel's {man['inputs']}: "
            "compile and launch at the same commit"
        )
    if man.get("lineinfo"):  # where the cubin's line info names the kernel source
        os.makedirs(SRC_DIR, exist_ok=True)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        shutil.copy(
            os.path.join(here, "bole_jax", "pallas", "tree_gdn.py"),
            os.path.join(SRC_DIR, "tree_gdn.py"),
        )

    drv = Driver()
    fn = drv.function(os.path.join(args.dir, f"{man['name']}.cubin"), man["kernel"], man["shared"])
    ptrs = [drv.upload(a) for a in operands]
    outs = [
        np.zeros(shape, np.dtype(dtype) if dtype != "bfloat16" else _bf16())
        for shape, dtype in man["outputs"]
    ]
    out_ptrs = [drv.upload(o) for o in outs]
    extra = man["params"] - len(ptrs) - len(out_ptrs)
    if extra < 0:
        sys.exit(
            f"the cubin takes {man['params']} parameters, fewer than the "
            f"{len(ptrs) + len(out_ptrs)} operands"
        )
    params = ptrs + out_ptrs + [0] * extra  # Triton's scratch pointers: none needed
    threads = 32 * man["num_warps"]
    times = [
        drv.launch(fn, man["grid"], threads, man["shared"], params)
        for _ in range(max(args.reps, 1))
    ]
    res = dict(
        manifest=man,
        reps=len(times),
        us=statistics.median(times),
        spread_us=[min(times), max(times)],
    )
    print(
        f"{man['kernel']} B={man['B']} N={man['N']} grid {man['grid']} x {threads} threads, "
        f"{man['shared']} B shared: median {res['us']:.1f} us over {len(times)} launches "
        f"(first {times[0]:.1f})"
    )
    if args.check and commit:
        # every launch read the same state and wrote a fresh output buffer: one commit
        state, fac, parents, accepted, path, count = inputs
        want = np.asarray(
            commit_state(
                state,
                fac,
                parents,
                accepted,
                path=path,
                count=count,
                backend="reference",
                precision="highest",
            ),
            np.float32,
        )
        dk, dv = want.shape[-2:]
        new = drv.download(out_ptrs[0], outs[0])[..., :dk, :dv]
        err = float(np.max(np.abs(new - want)) / max(np.max(np.abs(want)), 1e-30))
        res["err_state"] = err
        print(f"  state: max rel err {err:.2e} against the reference commit")
    elif args.check:
        o_ref, f_ref = tree_gdn_verify(*inputs, backend="reference")
        dv = o_ref.shape[-1]
        o = drv.download(out_ptrs[0], outs[0])[..., :dv].astype(np.float32)
        u = drv.download(out_ptrs[1], outs[1])[..., :dv].astype(np.float32)
        for name, x, ref in (
            ("o", o, np.asarray(o_ref, np.float32)),
            ("u", u, np.asarray(f_ref.u, np.float32)),
        ):
            err = float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))
            res[f"err_{name}"] = err
            print(f"  {name}: max rel err {err:.2e} against the jnp reference")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


if __name__ == "__main__":
    main()
