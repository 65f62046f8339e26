"""Merge the rows of several `bole-jax bench` JSON files of one model into one table and plot.

    python benchmarks/merge_e2e.py --out benchmarks/results/e2e_h200/e2e_qwen3.5-9b_all.json \
        first_run/e2e_qwen3.5-9b_b1.json second_run/e2e_qwen3.5-9b_b16.json ...

Device calls are limited to a few minutes each, so one model's batch grid is often measured in
several runs; this keeps each row's source (file, command, git commit) beside it. Refuses files
of different models, dtypes or devices: their rows are not comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bole_jax.measure.bench import plot_e2e, print_table, write_json  # noqa: E402

KEYS = ("dtype",)
ENV_KEYS = ("device", "jax")


def merge(paths: list[str], later_wins: bool = False) -> dict:
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    model = lambda r: r["args"].get("preset") or r["args"].get("model")  # noqa: E731
    for p, r in zip(paths, runs):
        for what, a, b in (
            [("model", model(r), model(first))]
            + [(k, r.get(k), first.get(k)) for k in KEYS]
            + [(k, r["env"].get(k), first["env"].get(k)) for k in ENV_KEYS]
        ):
            if a != b:
                raise SystemExit(f"{p}: {what} {a!r} differs from {paths[0]}'s {b!r}; not merging")
    rows, sources = [], []
    for p, r in zip(paths, runs):
        src = dict(file=p, command=r["command"], git_commit=r["env"].get("git_commit"))
        sources.append(src)
        seen = {(x["batch"], x["mode"]) for x in rows}
        for row in r["rows"]:
            if (row["batch"], row["mode"]) in seen:
                if not later_wins:
                    raise SystemExit(
                        f"{p}: batch {row['batch']} mode {row['mode']} is already in an "
                        "earlier file; pass each point once (or --later-wins)"
                    )
                rows = [x for x in rows if (x["batch"], x["mode"]) != (row["batch"], row["mode"])]
            rows.append(dict(row, source=len(sources) - 1))
    rows.sort(key=lambda x: (x["batch"], x["mode"]))
    breakdown = [dict(b, source=i) for i, r in enumerate(runs) for b in r.get("breakdown") or []]
    return dict(
        model=model(first),
        dtype=first.get("dtype"),
        env=first["env"],
        rows=rows,
        breakdown=breakdown,
        sources=sources,
        merged_by=" ".join(sys.argv),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True, help="merged JSON path (plots beside it)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--later-wins",
        action="store_true",
        help="a point measured in several files: keep the last file's row (a rerun)",
    )
    a = ap.parse_args(argv)
    result = merge(a.files, a.later_wins)
    print_table(
        result["rows"],
        [
            "batch",
            "mode",
            "nodes",
            "tokens_per_step",
            "step_ms",
            "tokens_per_s",
            "speedup_vs_ar",
            "speedup_vs_pernode",
            "ar_agreement",
            "source",
        ],
    )
    write_json(a.out, result)
    if not a.no_plots:
        tag = os.path.splitext(os.path.basename(a.out))[0].removeprefix("e2e_")
        result["plots"] = plot_e2e(result, os.path.dirname(a.out) or ".", tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
