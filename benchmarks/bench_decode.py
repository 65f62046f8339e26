"""Autoregressive decode throughput of a random-weight model vs its HBM floor.

    python benchmarks/bench_decode.py --preset qwen3.5-9b --batch 1 32 --out benchmarks/results

For each batch size: prefill random prompts, time the jitted AR loop, and compare the measured
step time with the floor = (weights + cache bytes one step must move) / measured copy bandwidth.
Prints a table and writes <out>/decode_<preset>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bole_jax.llm import LLM  # noqa: E402
from bole_jax.measure import bench  # noqa: E402
from bole_jax.measure.env import copy_bandwidth, environment  # noqa: E402
from bole_jax.model import init_params  # noqa: E402
from bole_jax.model.presets import preset  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    env = environment()
    bw = copy_bandwidth()
    cfg = preset(a.preset, mtp=False)
    params = init_params(cfg, jax.random.key(0), "bfloat16")
    llm = LLM(cfg, params=params, max_batch_size=max(a.batch))
    rng = np.random.default_rng(0)
    rows = []
    for b in a.batch:
        ids = rng.integers(0, cfg.vocab_size, (b, a.prompt_len)).tolist()
        r, state = bench.run_mode(llm, ids, "ar", a.steps + 16, 8, a.steps)
        floor = bench.ar_step_floor_bytes(cfg, params, state.cache, b)
        r.update(
            floor_gb=floor / 1e9,
            floor_ms=1e3 * floor / bw,
            ratio_to_floor=r["step_ms"] / (1e3 * floor / bw),
            achieved_tb_s=floor / (r["step_ms"] / 1e3) / 1e12,
        )
        rows.append(r)
        del state
    print(f"\n{a.preset} AR decode, bf16, {env['device']}, copy bandwidth {bw / 1e12:.2f} TB/s")
    table = bench.print_table(
        rows,
        [
            "batch",
            "step_ms",
            "tokens_per_s",
            "floor_gb",
            "floor_ms",
            "ratio_to_floor",
            "achieved_tb_s",
        ],
    )
    os.makedirs(a.out, exist_ok=True)
    bench.write_json(
        os.path.join(a.out, f"decode_{a.preset}.json"),
        dict(
            command="python " + " ".join(sys.argv),
            env=env,
            copy_bandwidth_bytes_s=bw,
            config=cfg,
            rows=rows,
            table=table,
        ),
    )


if __name__ == "__main__":
    main()
