"""The split-S attention kernel (bole_jax/pallas/attention.py) against the plain-jnp attention on
the device: error on fresh random inputs and time per call, over the shapes a decode step runs
at long context (Qwen3.5-9B dims: 16 query heads, 4 KV heads, head dim 256).

    python benchmarks/bench_attention.py --batch 1 32 --queries 1 4 16 --slots 4096 16448 --out DIR

Queries: 1 = an AR step, 4 = a draft level (top-k 4), 16 = a 16-node tree verify. The mask is a
verify's: a committed prefix of ragged length, then the tree slots of random ancestor sets. The
KV bytes floor (K and V read once at the device's peak bandwidth, `bench.peak_gbps`: 4.8 TB/s
on an H200; none on a device it does not list) is printed beside each time. Prints a table and
writes bench_attention.json (command, git commit, GPU, jax version).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.measure import bench
from bole_jax.measure.bench import print_table, write_json
from bole_jax.measure.env import environment
from bole_jax.pallas.attention import attend_reference, attend_split_s
from bole_jax.pallas.testing import random_attention_inputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--slots", type=int, nargs="+", default=[4096, 16448])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ref = jax.jit(attend_reference)
    ker = jax.jit(lambda *x: attend_split_s(*x, backend="pallas"))
    gbps = bench.peak_gbps()
    rows = []
    for dtype in a.dtypes:
        for s in a.slots:
            for b in a.batch:
                for t in a.queries:
                    rng = np.random.default_rng(len(rows))
                    lens = rng.integers(s // 2, s - t + 1, b)
                    args = random_attention_inputs(
                        rng, lens, t, a.heads, a.kv_heads, s, a.head_dim, dtype
                    )
                    want = np.asarray(ref(*args), np.float32)
                    got = np.asarray(ker(*args), np.float32)
                    kv_bytes = 2 * b * a.kv_heads * s * a.head_dim * jnp.dtype(dtype).itemsize
                    floor = kv_bytes / (gbps * 1e6) if gbps else None
                    # Both ran once above (compiled, warm).
                    r_ms = bench._median_ms(lambda _: ref(*args), a.reps)
                    k_ms = bench._median_ms(lambda _: ker(*args), a.reps)
                    rows.append(
                        dict(
                            dtype=dtype,
                            slots=s,
                            batch=b,
                            queries=t,
                            max_abs_err=float(np.max(np.abs(got - want))),
                            ref_ms=r_ms,
                            kernel_ms=k_ms,
                            speedup=r_ms / k_ms,
                            floor_ms=floor,
                            kernel_x_floor=k_ms / floor if floor else None,
                        )
                    )
                    print(rows[-1], file=sys.stderr, flush=True)
    cols = list(rows[0])
    table = print_table(rows, cols)
    write_json(
        os.path.join(a.out, "bench_attention.json"),
        dict(command="python " + " ".join(sys.argv), env=environment(), rows=rows, table=table),
    )


if __name__ == "__main__":
    main()
