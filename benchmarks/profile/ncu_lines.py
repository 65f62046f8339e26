"""Per-source-line totals of an Nsight Compute report's per-instruction metrics.

`ncu --page source --csv` prints the source file without metrics for a cubin launched through
the driver API, so this reads the report through Nsight Compute's own Python module
(`ncu_report`, in the extras/python folder of the Nsight Compute install) and sums every
per-instruction metric (the warp-stall samples, instructions executed, ...) over the
instructions that map to each line of each source file:

    python benchmarks/profile/ncu_lines.py rep.ncu-rep --kernel bole --out lines.csv [--top 40]

Made for the verify kernel's cubin built with line info (`offline_compile.py --lineinfo`,
launched by `cubin_launch.py` under `ncu --set full --import-source yes`), whose instructions map
to lines of bole_jax/pallas/tree_gdn.py. Prints the lines with the most stall samples and writes
every line's totals (one column per metric) as CSV.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import sys


def _import_ncu_report():
    try:
        import ncu_report  # noqa: F401

        return ncu_report
    except ImportError:
        pass
    roots = [
        "/opt/nvidia/nsight-compute",
        "/usr/local/cuda/nsight-compute*",
        "/usr/local/cuda-*/nsight-compute*",
    ]  # searched recursively
    for pattern in roots:
        for root in sorted(glob.glob(pattern), reverse=True):
            for path in glob.glob(os.path.join(root, "**", "ncu_report.py"), recursive=True):
                sys.path.insert(0, os.path.dirname(path))
                import ncu_report as module

                return module
    raise SystemExit("ncu_report not found: add Nsight Compute's extras/python to PYTHONPATH")


def line_totals(action):
    """{(file, line): {metric: total}} over the instructions of one profiled kernel, and the
    metric names summed. A metric counts when it is instanced per instruction (its
    correlation ids are instruction addresses)."""
    totals, names = {}, []
    for name in action.metric_names():
        metric = action.metric_by_name(name)
        try:
            if not metric.has_correlation_ids():
                continue
            ids = metric.correlation_ids()
            count = metric.num_instances()
        except Exception:  # noqa: BLE001 (metrics without instances)
            continue
        if count == 0:
            continue
        used = False
        for i in range(count):
            try:
                pc = ids.as_uint64(i)
                info = action.source_info(pc)
                value = metric.as_double(i)
            except Exception:  # noqa: BLE001
                continue
            if info is None or not value:
                continue
            key = (os.path.basename(info.file_name()), info.line())
            slot = totals.setdefault(key, {})
            slot[name] = slot.get(name, 0.0) + value
            used = True
        if used:
            names.append(name)
    return totals, names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--kernel", default="bole", help="substring of the kernel's name")
    ap.add_argument("--out", default=None, help="CSV of every line's totals")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument(
        "--source", default=None, help="the source file, to print each top line's text beside it"
    )
    args = ap.parse_args(argv)
    ncu_report = _import_ncu_report()
    ctx = ncu_report.load_report(args.report)
    action = None
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            if args.kernel in rng.action_by_idx(a).name():
                action = rng.action_by_idx(a)
                break
        if action is not None:
            break
    if action is None:
        raise SystemExit(f"no kernel matching {args.kernel!r} in {args.report}")
    totals, names = line_totals(action)
    print(f"{action.name()}: {len(totals)} source lines, {len(names)} per-instruction metrics")
    print("metrics:", ", ".join(names))
    if not totals:
        return
    sample = next((n for n in names if n.endswith("pcsamp_sample_count")), None) or next(
        (n for n in names if "pcsamp" in n), names[0]
    )
    stalls = [n for n in names if "issue_stalled" in n and not n.endswith("not_issued")]
    text = {}
    if args.source and os.path.exists(args.source):
        with open(args.source) as f:
            text = {i + 1: line.rstrip() for i, line in enumerate(f)}
    all_samples = sum(t.get(sample, 0.0) for t in totals.values()) or 1.0
    print(f"\ntop lines by {sample} (share of all samples; top 3 stall reasons):")
    ranked = sorted(totals.items(), key=lambda kv: -kv[1].get(sample, 0.0))
    for (fname, line), t in ranked[: args.top]:
        top3 = sorted(((t.get(n, 0.0), n) for n in stalls), reverse=True)[:3]
        why = ", ".join(
            f"{n.split('issue_stalled_')[-1]} {v / max(t.get(sample, 1.0), 1.0):.0%}"
            for v, n in top3
            if v
        )
        src = (
            text.get(line, "").strip()[:70] if fname == os.path.basename(args.source or "") else ""
        )
        print(f"  {fname}:{line:<5d} {t.get(sample, 0.0) / all_samples:6.1%}  {why:60s} {src}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file", "line"] + names)
            for (fname, line), t in sorted(totals.items()):
                w.writerow([fname, line] + [t.get(n, 0.0) for n in names])
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
