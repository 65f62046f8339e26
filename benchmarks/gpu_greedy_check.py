"""Greedy losslessness on the GPU in bf16: every spec mode vs autoregressive, token by token.

    python benchmarks/gpu_greedy_check.py --preset qwen3.5-4b --new 256 --out benchmarks/results

Random weights with a random MTP head; each spec mode runs twice: with the MTP drafter and with
the synthetic-acceptance drafter (AR continuation in the tree, each depth kept with p = 0.8) so
that long accepted runs exercise the commit. Reports the fraction of identical tokens and the
first divergence per prompt, and the top-2 logit gap of AR at that position (a near-tie in bf16
explains a flip: the tree kernels sum in another order than the recurrent decode).
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
from bole_jax.measure.env import environment  # noqa: E402
from bole_jax.model import init_params  # noqa: E402
from bole_jax.model.presets import peaked_lm_head, preset  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.5-4b")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["bole", "pernode", "chain"])
    ap.add_argument("--drafters", nargs="+", default=["synthetic"], choices=["synthetic", "mtp"])
    ap.add_argument(
        "--independent-lm-head",
        action="store_true",
        help="untied presets: keep an independent random lm_head (near-tie logits)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    env = environment()
    cfg = preset(a.preset, mtp=True)
    params = init_params(cfg, jax.random.key(0), "bfloat16")
    if not a.independent_lm_head:
        params = peaked_lm_head(params, cfg)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 64, 101, 12)[: a.prompts]]
    ar = LLM(cfg, params=params).generate(ids, max_new_tokens=a.new, spec="ar")
    rows = []
    for mode in a.modes:
        drafters = {
            "mtp": ("mtp", {}),
            "synthetic": ("synthetic p=0.8", dict(synthetic_accept=0.8)),
        }
        for drafter, opts in (drafters[d] for d in a.drafters):
            llm = LLM(cfg, params=params, spec_options=opts)
            out = llm.generate(
                ids,
                max_new_tokens=a.new,
                spec=mode,
                oracle=[o.token_ids for o in ar] if opts else None,
            )
            for i, (o, r) in enumerate(zip(out, ar)):
                same = [x == y for x, y in zip(o.token_ids, r.token_ids)]
                first = next((j for j, s in enumerate(same) if not s), None)
                row = dict(
                    mode=mode,
                    drafter=drafter,
                    prompt=i,
                    tokens=len(r.token_ids),
                    identical_frac=float(np.mean(same)) if same else 1.0,
                    first_divergence=first if first is not None else "-",
                    tokens_per_step=o.stats["tokens_per_step"],
                )
                if first is not None:
                    row["ar_top2_gap_at_divergence"] = bench.ar_top2_gap(
                        llm, ids[i], r.token_ids, first
                    )
                rows.append(row)
    print(f"\ngreedy spec vs AR, {a.preset} dims, random weights, bf16, {env['device']}")
    table = bench.print_table(
        rows,
        [
            "mode",
            "drafter",
            "prompt",
            "tokens",
            "identical_frac",
            "first_divergence",
            "ar_top2_gap_at_divergence",
            "tokens_per_step",
        ],
    )
    os.makedirs(a.out, exist_ok=True)
    bench.write_json(
        os.path.join(a.out, f"greedy_check_{a.preset}.json"),
        dict(command="python " + " ".join(sys.argv), env=env, config=cfg, rows=rows, table=table),
    )


if __name__ == "__main__":
    main()
