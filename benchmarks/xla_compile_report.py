"""The Triton kernels as the GPU image's jaxlib builds them: registers, spills, smem, SASS.

`offline_compile.py` compiles the kernels with a separately installed Triton, which is another
version than the one inside jaxlib, and its numbers misled the session-20 choices. On a GPU
with jaxlib > 0.10.2, Pallas compiles each Triton kernel in Python at lowering time, through
`jax._src.lib.triton.compile` (the CUDA plugin's handler), and hands XLA the PTX it returns.
This script wraps that call, lowers the launches for cuda as `offline_compile.py` does (shapes
only, nothing runs), keeps each kernel's PTX, and runs `ptxas -v` and `cuobjdump -sass` on it:

    python benchmarks/xla_compile_report.py --points 1x8,16x8,64x8 --out DIR

Variants per point (`--variants`): "verify" (the eager verify), "direct" (the one-launch lazy
step: the verify folding a `PendingPath`), "commit" (the selected-state commit), all with the
auto launches the bench times (`TreeGDNConfig.auto(B, N, MAX_DEPTH)`,
`tree_gdn.commit_launch`) or the `--bole-configs` given. Prints one table row per kernel and
writes DIR/report.json; the .ptx / .cubin / .sass stay in DIR. Qwen3-Next dims
(bench_tree_gdn.py's).

ptxas: the one jaxlib would use (the `nvidia/cuda_nvcc` package's, else the PATH's); its
version goes in the report. XLA assembles the PTX itself, with its own ptxas or the driver,
so the counts are those of the same PTX, not necessarily of the very same cubin.

Where jaxlib has no Python-side compile (jax 0.11.2 on the GPU image: it hands the Triton
module to XLA, as 0.10.2 does), the script compiles each lowering on the GPU instead, with
`XLA_FLAGS=--xla_dump_to=DIR/xla_dump`, and reads the kernels from the PTX XLA dumps: every
entry whose name matches `--kernel-regex`, its warps from `.maxntid`. That path does not
know the dynamic shared memory (Triton's, given to XLA at launch), so smem is None there
and programs per SM count registers and the warp / block limits only.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks import offline_compile as oc  # noqa: E402

VARIANTS = ("verify", "direct", "commit")


def _ptxas():
    """(ptxas path, cuobjdump path or None, ptxas version line)."""
    cands = []
    try:
        import nvidia.cuda_nvcc as nv  # jaxlib's own CUDA toolchain package, where present
        for base in nv.__path__:
            cands.append(os.path.join(base, "bin", "ptxas"))
    except ImportError:
        pass
    cands.append(shutil.which("ptxas") or "")
    cands.append("/usr/local/cuda/bin/ptxas")
    ptxas = next((c for c in cands if c and os.path.exists(c)), None)
    if ptxas is None:
        sys.exit("no ptxas found (nvidia/cuda_nvcc, PATH, /usr/local/cuda/bin)")
    cuobjdump = (shutil.which("cuobjdump") or
                 next((p for p in ("/usr/local/cuda/bin/cuobjdump",
                                   os.path.join(os.path.dirname(ptxas), "cuobjdump"))
                       if os.path.exists(p)), None))
    ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    return ptxas, cuobjdump, (ver.strip().splitlines() or ["?"])[-1]


class _Capture:
    """Wraps `jax._src.lib.triton.compile`, and any name pallas_call_registration holds for
    that same function: every kernel it compiles, in order."""

    def __init__(self):
        from jax._src.lib import triton
        from jax._src.pallas.triton import pallas_call_registration as pcr
        if not hasattr(triton, "compile"):
            raise RuntimeError("this jax has no Python-side Triton compile: run this on the "
                               "GPU image (jaxlib > 0.10.2)")
        self.kernels, self.orig = [], triton.compile
        self.slots = [(triton, "compile")] + [
            (pcr, name) for name, val in vars(pcr).items() if val is triton.compile]

    def __enter__(self):
        orig, kernels = self.orig, self.kernels

        def compile_(*a, **kw):  # (platform, module bytes, arch, num_warps=, num_ctas=, ...)
            res = orig(*a, **kw)
            kernels.append(dict(arch=a[2] if len(a) > 2 else kw.get("arch_name"),
                                num_warps=kw.get("num_warps"), num_stages=kw.get("num_stages"),
                                smem_bytes=int(getattr(res, "smem_bytes", -1)),
                                ptx=getattr(res, "asm", "")))
            return res

        for mod, name in self.slots:
            setattr(mod, name, compile_)
        return self

    def __exit__(self, *exc):
        for mod, name in self.slots:
            setattr(mod, name, self.orig)


def python_side_compile() -> bool:
    """Whether this jaxlib compiles Pallas's Triton modules in Python (`_Capture` sees them)."""
    from jax._src.lib import triton
    return hasattr(triton, "compile")


class _XlaDump:
    """The PTX files XLA dumps under `--xla_dump_to` (set in XLA_FLAGS before the backend
    starts): `new()` lists those written since the last call."""

    def __init__(self, path):
        self.path, self.seen = path, set()

    @staticmethod
    def flags(path, env=None) -> str:
        return " ".join(x for x in ((env or "").split() + [f"--xla_dump_to={path}"]) if x)

    def new(self) -> list[str]:
        files = sorted(set(glob.glob(os.path.join(self.path, "**", "*.ptx"), recursive=True))
                       - self.seen)
        self.seen.update(files)
        return files


def ptx_entries(ptx: str) -> dict:
    """{entry name: warps per program from its `.maxntid` (None without one)} of a PTX text."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        nxt = ptx.find(".entry", m.end())
        m2 = re.search(r"\.maxntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)",
                       ptx[m.end(): nxt if nxt >= 0 else len(ptx)])
        out[m.group(1)] = (int(m2.group(1)) * int(m2.group(2)) * int(m2.group(3)) // 32
                           if m2 else None)
    return out


def parse_ptxas_entries(info: str) -> dict:
    """{entry name: parse_ptxas of its part} of a `ptxas -v` report over several entries."""
    parts = re.split(r"Compiling entry function '(\w+)'", info)
    return {parts[i]: dict(parse_ptxas(parts[i + 1]), ptxas_info=parts[i + 1].strip())
            for i in range(1, len(parts) - 1, 2)}


def _lowerings(b, n, variants, cfgs, compile=False):
    """[(label, thunk lowering it for cuda)] for the point's variants: offline_compile's
    lowerings (bench_tree_gdn's dims, shapes only). compile: the thunks compile it on this
    process's GPU too (the XLA-dump path)."""
    from benchmarks import bench_tree_gdn as btg
    from bole_jax.pallas.tree_gdn import commit_launch

    out = []
    for cfg in cfgs:
        if "verify" in variants:
            out.append((f"verify {btg.cfg_str(cfg)}", lambda cfg=cfg: oc._lower(b, n, cfg, None, compile)))
        if "direct" in variants:
            out.append((f"direct {btg.cfg_str(cfg)}",
                        lambda cfg=cfg: oc._lower(b, n, cfg, "path", compile)))
    if "commit" in variants:
        fold, block_v = commit_launch(b, min(btg.MAX_DEPTH, n))  # as the engine's commit
        out.append((f"commit fold={fold},bv={block_v}",
                    lambda: oc._lower_commit(b, n, oc.commit_config({}), compile)))
    return out


def programs_per_sm(registers, num_warps, smem_bytes):
    """Resident programs per H100/H200 SM by registers (64K, allocated per warp in units of
    256), shared memory (228 KiB, 1 KiB reserved per block) and the 32-block / 64-warp limits;
    None without a register count."""
    if not registers:
        return None
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = (228 * 1024) // (max(smem_bytes, 0) + 1024)
    return min(by_regs, by_smem, 32, 64 // num_warps)


def parse_ptxas(info: str) -> dict:
    """Registers, spill bytes and stack frame from `ptxas -v`'s report (None where absent)."""
    def num(pat):
        m = re.search(pat, info)
        return int(m.group(1)) if m else None
    return dict(registers=num(r"Used (\d+) registers"),
                spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"),
                stack_frame=num(r"(\d+) bytes stack frame"))


def _assemble(ptxas, cuobjdump, ptx_path, entries=None):
    """ptxas -v (and the SASS) of one PTX file: one report, or {entry: report} for the named
    entries of a multi-kernel file (XLA's module PTX)."""
    cubin = ptx_path[:-4] + ".cubin"
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", cubin],
                         capture_output=True, text=True)
    if res.returncode:
        err = dict(error=res.stderr[-2000:])
        return err if entries is None else {e: err for e in entries}
    reps = ({None: dict(parse_ptxas(res.stderr), ptxas_info=res.stderr.strip())}
            if entries is None else
            {e: r for e, r in parse_ptxas_entries(res.stderr).items() if e in entries})
    for name, rep in reps.items():
        if not cuobjdump:
            continue
        cmd = [cuobjdump, "-sass"] + (["-fun", name] if name else []) + [cubin]
        sass = subprocess.run(cmd, capture_output=True, text=True).stdout
        with open(ptx_path[:-4] + (f".{name}" if name else "") + ".sass", "w") as f:
            f.write(sass)
        ops = oc.sass_opcodes(sass)
        rep.update(sass_instructions=len(ops),
                   sass_top=collections.Counter(ops).most_common(12))
    return reps[None] if entries is None else reps


def _captured(b, n, label, lower):
    """[(kernel dict, PTX text)] through the Python-side compile."""
    with _Capture() as cap:
        lower()
    if not cap.kernels:
        sys.exit(f"B={b} N={n} {label}: no Triton kernel went through triton.compile "
                 f"(here: jax {jax.__version__}, {jax.devices()[0].platform})")
    return cap.kernels


def _row(b, n, label, stem, kern, rep):
    rep = dict(B=b, N=n, variant=label, kernel=kern["name"], file=stem, arch=kern["arch"],
               num_warps=kern["num_warps"], num_stages=kern["num_stages"],
               smem_bytes=kern["smem_bytes"], **rep)
    rep["programs_per_sm"] = occ = programs_per_sm(rep.get("registers"), kern["num_warps"] or 4,
                                                   kern["smem_bytes"] or 0)
    print(f"B={b:<3} N={n:<3} {label:<70} {kern['name']} w={kern['num_warps']} "
          f"ns={kern['num_stages']} regs={rep.get('registers')} "
          f"spill={rep.get('spill_stores')}/{rep.get('spill_loads')} "
          f"smem={kern['smem_bytes']} sass={rep.get('sass_instructions')} "
          f"programs/SM={occ}{'  ' + rep['error'][:200] if 'error' in rep else ''}", flush=True)
    return rep


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="1x8,1x16,4x8,16x8,64x8",
                    help="comma-separated BxN points (default: the issue-3 points under 5x)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--bole-configs", default="auto",
                    help="';'-separated bench_tree_gdn config specs (Triton launches only)")
    ap.add_argument("--kernel-regex", default="bole",
                    help="XLA-dump path: the PTX entries reported (default: the Bole kernels)")
    ap.add_argument("--out", required=True, help="directory for the PTX / cubin / SASS / JSON")
    args = ap.parse_args(argv)
    from benchmarks import bench_tree_gdn as btg
    from bole_jax.pallas.tree_gdn import TreeGDNConfig

    variants = [v for v in args.variants.split(",") if v]
    bad = set(variants) - set(VARIANTS)
    if bad:
        ap.error(f"--variants: unknown {sorted(bad)}; choose from {VARIANTS}")
    try:
        points = [tuple(int(x) for x in p.lower().split("x")) for p in args.points.split(",")]
    except ValueError:
        ap.error(f"--points: expected e.g. 1x8,16x8, got {args.points!r}")
    os.makedirs(args.out, exist_ok=True)
    python_side = python_side_compile()
    dump = None
    if not python_side:  # before the backend starts: XLA reads its flags once
        dump = _XlaDump(os.path.abspath(os.path.join(args.out, "xla_dump")))
        os.environ["XLA_FLAGS"] = _XlaDump.flags(dump.path, os.environ.get("XLA_FLAGS"))
    if jax.default_backend() != "gpu":
        sys.exit(f"no GPU here (jax {jax.__version__}, backend {jax.default_backend()}): the "
                 "kernels are compiled by the GPU image's jaxlib; run this on the GPU "
                 "(offline_compile.py is the CPU-side proxy)")
    ptxas, cuobjdump, ptxas_version = _ptxas()
    print(f"jax {jax.__version__}, devices {jax.devices()}; ptxas {ptxas} ({ptxas_version}); "
          f"kernels from {'triton.compile' if python_side else 'the XLA dump ' + dump.path}")
    kern_re = re.compile(args.kernel_regex)
    rows = []
    for b, n in points:
        cfgs = [c for c in btg.resolve_bole([btg.parse_bole(s) for s in
                                             args.bole_configs.split(";")], b, n)
                if isinstance(c, TreeGDNConfig)]
        for label, lower in _lowerings(b, n, variants, cfgs, compile=not python_side):
            stem0 = f"b{b}_n{n}_{label.split()[0]}"
            if python_side:
                for i, kern in enumerate(_captured(b, n, label, lower)):
                    entry = re.search(r"\.entry\s+(\w+)", kern["ptx"])
                    kern["name"] = entry.group(1) if entry else None
                    stem = f"{stem0}_{i}"
                    ptx_path = os.path.join(args.out, stem + ".ptx")
                    with open(ptx_path, "w") as f:
                        f.write(kern["ptx"])
                    rows.append(_row(b, n, label, stem, kern,
                                     _assemble(ptxas, cuobjdump, ptx_path)))
                continue
            try:
                lower()
            except Exception as e:  # noqa: BLE001 (e.g. a launch over the smem limit)
                print(f"B={b:<3} N={n:<3} {label:<70} did not compile: "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(B=b, N=n, variant=label,
                                 error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            found = 0
            for j, src in enumerate(dump.new()):
                with open(src) as f:
                    ptx = f.read()
                entries = {e: w for e, w in ptx_entries(ptx).items() if kern_re.search(e)}
                if not entries:
                    continue
                stem = f"{stem0}_{j}"
                ptx_path = os.path.join(args.out, stem + ".ptx")
                shutil.copyfile(src, ptx_path)
                reps = _assemble(ptxas, cuobjdump, ptx_path, set(entries))
                for name, warps in entries.items():
                    found += 1
                    kern = dict(name=name, arch="sm_90a", num_warps=warps, num_stages=None,
                                smem_bytes=None)
                    rows.append(_row(b, n, label, stem, kern, reps.get(name, dict(
                        error="ptxas -v did not report this entry"))))
            if not found:
                print(f"B={b:<3} N={n:<3} {label:<70} no PTX entry matching "
                      f"{args.kernel_regex!r} in the XLA dump", flush=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(dict(btg.run_info(__file__), ptxas=ptxas, ptxas_version=ptxas_version,
                       source="triton.compile" if python_side else "xla_dump", rows=rows),
                  f, indent=1)
    print(f"wrote {os.path.join(args.out, 'report.json')}")


if __name__ == "__main__":
    main()
