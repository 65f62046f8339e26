"""Acceptance of a model's own MTP drafter on held-out prompts (HumanEval code, Spec-Bench prose).

    python benchmarks/acceptance_report.py --model bole_jax/default_model --out benchmarks/results

For each prompt set: greedy generation with `bole` (top-4, depth 8 trees, N nodes per request),
`chain` with depth 1 (the MTP top-1 acceptance rate = tokens per step - 1) and `ar`; reports mean
accepted tokens per step (bonus included), tokens/s, greedy equality with AR, and sample outputs.
With --draft-vocab N..., bole also runs with the drafter restricted to N tokens (rows bole-dvN):
what a cheaper draft costs in acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from bole_jax.llm import LLM  # noqa: E402
from bole_jax.measure import bench  # noqa: E402
from bole_jax.measure.calibrate import measurement_text  # noqa: E402
from bole_jax.measure.env import environment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load_sets(n: int) -> dict[str, list[str]]:
    with open(os.path.join(HERE, "data", "humaneval_prompts.jsonl")) as f:
        # stripped as the bench and the calibration strip them (the demo model reads HumanEval's
        # final bare newline as the end of a file)
        he = [measurement_text(json.loads(x)["prompt"]) for x in f][:n]
    spec_path = os.environ.get(
        "SPEC_BENCH", os.path.join(HERE, "..", "..", "shared", "data", "spec_bench_question.jsonl")
    )
    if not os.path.exists(spec_path):
        spec_path = os.path.join(HERE, "data", "spec_bench_question.jsonl")
    with open(spec_path) as f:
        sb = [measurement_text(json.loads(x)["turns"][0]) for x in f]
    step = max(1, len(sb) // n)  # spread over the 6 categories
    return {"humaneval": he, "spec_bench": sb[::step][:n]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=32, help="prompts per set")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument(
        "--modes", nargs="+", default=["ar", "bole"], choices=["ar", "chain-d1", "bole"]
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        nargs="*",
        default=[],
        help="also run bole with these reduced draft vocabularies (rows bole-dvN)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="acceptance_demo_model.json", help="JSON file name in --out")
    a = ap.parse_args(argv)
    env = environment()
    rows, samples = [], {}
    sets = load_sets(a.n)
    runs = {"ar": {}, "chain-d1": dict(depth=1), "bole": dict(topk=4, depth=8, num_nodes=a.nodes)}
    ar_ids = {}
    labels = list(a.modes)
    for v in a.draft_vocab:
        runs[f"bole-dv{v}"] = runs["bole"]
        labels.append(f"bole-dv{v}")
    draft_source = {}
    for label in labels:  # one LLM per mode: its compiled programs serve both prompt sets
        dv = int(label.split("-dv")[1]) if "-dv" in label else None
        llm = LLM(a.model, max_batch_size=a.n, spec_options=runs[label], draft_vocab=dv)
        if dv is not None:
            draft_source[label] = llm.draft_vocab_source
        mode = label.split("-")[0]
        for name, prompts in sets.items():
            outs = llm.generate(prompts, max_new_tokens=a.new, spec=mode)
            ids = [o.token_ids for o in outs]
            if mode == "ar":
                ar_ids[name] = ids
                samples[name] = [
                    dict(prompt=p[-200:], completion=o.text[:300])
                    for p, o in zip(prompts[:3], outs[:3])
                ]
            tps = float(np.mean([o.stats["tokens_per_step"] for o in outs]))
            gen = sum(o.stats["generated_tokens"] for o in outs)
            rows.append(
                dict(
                    prompts=name,
                    mode=label,
                    n=len(prompts),
                    tokens_per_step=tps,
                    tokens_per_s_incl_compile=gen / outs[0].stats["time_s"],
                    equal_to_ar=float(np.mean([x == y for x, y in zip(ids, ar_ids[name])]))
                    if name in ar_ids
                    else None,
                )
            )
    print(f"\nMTP acceptance, model {a.model or 'default'}, {env['device']}")
    table = bench.print_table(
        rows,
        ["prompts", "mode", "n", "tokens_per_step", "tokens_per_s_incl_compile", "equal_to_ar"],
    )
    os.makedirs(a.out, exist_ok=True)
    bench.write_json(
        os.path.join(a.out, a.name),
        dict(
            command="python " + " ".join(sys.argv),
            env=env,
            rows=rows,
            samples=samples,
            table=table,
            draft_vocab_source=draft_source,
        ),
    )


if __name__ == "__main__":
    main()
