"""How far each kernel speedup ratio can go: the bytes floors of one verify + commit step, Bole
against TREE-PERNODE, beside what `bench_tree_gdn.py` measured.

Reads a `bench_tree_gdn.json` (no GPU needed) and prints, per grid point:

- the Bole step floor: the fewest bytes any verify + commit that keeps one committed state in
  HBM must move per step: the verify floor (docs/benchmarks.md: read S_pre once, q, k, v, gates;
  write o, u, gamma) plus writing the new state once (a lazy commit folds the accepted path into the
  next verify's read, so S is read once and written once per step);
- the TREE-PERNODE step floor: read S_pre once, write one full state per node (the scratch),
  and the commit's copy of the accepted node's state (read + write), plus the same q, k, v,
  gates, o;
- each measured sum against its floor, the measured ratio, and the ceiling ratio: PERNODE's
  measured sum over the Bole step floor, the most any Bole verify + commit could reach against
  this baseline. A target above the ceiling is out of reach of every kernel, not only of ours.

Floors at the copy bandwidth the run measured (its JSON's copy_bandwidth), as the bench's
x/floor columns. Writes ratio_ceiling.json beside the input (or to --out).

    python benchmarks/ratio_ceiling.py <out>/bench_tree_gdn.json   # a bench_tree_gdn.py result
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_tree_gdn import floor_bytes, scratch_bytes_of  # noqa: E402


def state_bytes(b: int) -> int:
    """One fp32 GDN state per request (a one-node scratch)."""
    return scratch_bytes_of(b, 1)


def step_floors(b: int, n: int) -> dict:
    """Bytes floors of one verify + commit step of a layer (see the module docstring)."""
    io = floor_bytes(b, n) - state_bytes(b)  # q, k, v, gates in; o, u, gamma out
    bole = floor_bytes(b, n) + state_bytes(b)
    pernode = state_bytes(b) * (1 + n + 2) + io
    return dict(bole_bytes=bole, pernode_bytes=pernode)


def best_bole_sum(p: dict) -> tuple[float, str]:
    """The best of the eager (verify + commit), lazy (verify + gather) and direct (the lazy verify
    reading the rows from the previous factors: one launch) sums of a point."""
    sums = [(p["bole_sum_us"], "eager")] if p.get("bole_sum_us") else []
    if p.get("bole_lazy_sum_us"):
        sums.append((p["bole_lazy_sum_us"], "lazy"))
    if p.get("bole_direct_us"):
        sums.append((p["bole_direct_us"], "direct"))
    return min(sums) if sums else (float("nan"), "-")


def ceiling_rows(data: dict) -> list[dict]:
    bw = data["copy_bandwidth"]["bandwidth"]
    rows = []
    for p in data["points"]:
        if not p.get("pernode_sum_us"):
            continue
        b, n = p["B"], p["N"]
        f = step_floors(b, n)
        bole_floor = f["bole_bytes"] / bw * 1e6
        pernode_floor = f["pernode_bytes"] / bw * 1e6
        bole, mode = best_bole_sum(p)
        rows.append(
            dict(
                B=b,
                N=n,
                pernode_us=p["pernode_sum_us"],
                pernode_floor_us=pernode_floor,
                pernode_over_floor=p["pernode_sum_us"] / pernode_floor,
                bole_us=bole,
                bole_mode=mode,
                bole_floor_us=bole_floor,
                bole_over_floor=bole / bole_floor,
                ratio=p["pernode_sum_us"] / bole,
                ceiling=p["pernode_sum_us"] / bole_floor,
                floor_ratio=pernode_floor / bole_floor,
                bole_us_for_5x=p["pernode_sum_us"] / 5,
                bole_us_for_30x=p["pernode_sum_us"] / 30,
            )
        )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a bench_tree_gdn.json")
    ap.add_argument("--out", default=None, help="output JSON (default: beside the input)")
    args = ap.parse_args(argv)
    with open(args.json) as fh:
        data = json.load(fh)
    rows = ceiling_rows(data)
    if not rows:
        raise SystemExit(f"{args.json}: no point with both a Bole and a PERNODE sum")
    print(
        f"{args.json} (commit {data.get('git_commit', '?')[:10]}, "
        f"copy bandwidth {data['copy_bandwidth']['bandwidth'] / 1e12:.2f} TB/s)"
    )
    print(
        "  B   N | pernode us  floor  x floor | bole us        floor  x floor | ratio "
        "ceiling floors | bole us for 5x"
    )
    for r in rows:
        print(
            f"{r['B']:3d} {r['N']:3d} | {r['pernode_us']:10.1f} {r['pernode_floor_us']:6.1f} "
            f"{r['pernode_over_floor']:7.2f}x | {r['bole_us']:7.1f} {r['bole_mode']:5s} "
            f"{r['bole_floor_us']:6.1f} {r['bole_over_floor']:7.2f}x | {r['ratio']:5.1f}x "
            f"{r['ceiling']:6.1f}x {r['floor_ratio']:5.1f}x | {r['bole_us_for_5x']:7.1f}"
        )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(args.json)), "ratio_ceiling.json"
    )
    with open(out, "w") as fh:
        json.dump(
            dict(
                command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                source=os.path.relpath(args.json),
                source_commit=data.get("git_commit"),
                device=data.get("device"),
                jax_version=data.get("jax_version"),
                copy_bandwidth=data["copy_bandwidth"]["bandwidth"],
                rows=rows,
            ),
            fh,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
