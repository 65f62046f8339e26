"""End-to-end offline decode throughput: bole vs ar vs pernode vs chain, side by side.

    python benchmarks/bench_e2e.py --preset qwen3.5-9b --out benchmarks/results/e2e_h200
    python benchmarks/bench_e2e.py --preset qwen3.5-9b --batch 1 16 --modes ar bole --quick
    python benchmarks/bench_e2e.py --model DIR --prompts-file HumanEval.jsonl.gz --out DIR
    python benchmarks/bench_e2e.py --preset tiny --dtype float32 --batch 1 2 --quick   # CPU

Same as `bole-jax bench` (options: `--help`). Presets use random weights and the synthetic-
acceptance drafter (the AR continuation placed in the tree, each depth kept with probability p,
p chosen so that 1 + p + ... + p^depth = --accept-mean, 6.4 by default); --model uses the
checkpoint's MTP head on real prompts. For each batch size: one shared prefill, then each mode's
jitted decode loop timed after a short warm-up (all programs are compiled ahead, in threads);
the step of one batch is split into draft / select / verify / accept / commit / emit. Prints the
tables and writes <out>/e2e_<preset>.json (command, git commit, GPU, jax version, every number)
and plots when matplotlib imports. Method and caveats: docs/budget.md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bole_jax.serving import cli  # noqa: E402


def main(argv=None) -> int:
    return cli.main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
