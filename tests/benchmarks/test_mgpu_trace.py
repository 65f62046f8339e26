"""benchmarks/profile/mgpu_trace.py: the per-region summary of a Mosaic GPU in-kernel profile (the
profile itself needs a GPU; its Chrome-trace format is what the summary reads)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.profile import mgpu_trace  # noqa: E402


def _program(rng, sm, tid, t0):
    """One program's events: an outer region with two nested ones, then a tail region; returns
    (events, {region: duration})."""
    d = {k: float(rng.uniform(0.5, 3.0)) for k in ("mm", "put", "store")}
    gap = float(rng.uniform(0.0, 0.5))
    outer = d["mm"] + gap + d["put"]
    times = [
        ("inverse", "B", t0),
        ("mm", "B", t0),
        ("mm", "E", t0 + d["mm"]),
        ("put", "B", t0 + d["mm"] + gap),
        ("put", "E", t0 + outer),
        ("inverse", "E", t0 + outer),
        ("store", "B", t0 + outer),
        ("store", "E", t0 + outer + d["store"]),
    ]
    evs = [dict(name=n, ph=ph, ts=t, pid=sm, tid=tid) for n, ph, t in times]
    return evs, dict(d, inverse=outer), outer + d["store"]


def test_summary_of_nested_regions_over_programs():
    rng = np.random.default_rng()
    events, durs, totals, starts = [], [], [], []
    for p in range(5):  # SMs 1, 2, 1, 2, 1: three programs on SM 1
        t0 = float(rng.uniform(0, 10))
        evs, d, total = _program(rng, 1 + p % 2, p + 1, t0)
        events += evs
        durs.append(d)
        totals.append(total)
        starts.append(t0)
    s = mgpu_trace.summarize({"traceEvents": events})
    assert s["programs"] == 5 and s["sms"] == 2 and s["max_programs_per_sm"] == 3
    assert s["program_us"]["mean"] == pytest.approx(np.mean(totals))
    assert s["program_us"]["max"] == pytest.approx(max(totals))
    ends = [a + b for a, b in zip(starts, totals)]
    assert s["span_us"] == pytest.approx(max(ends) - min(starts))
    for name in ("inverse", "mm", "put", "store"):
        got = s["regions"][name]
        vals = [d[name] for d in durs]
        assert got["count"] == 5
        assert got["mean"] == pytest.approx(np.mean(vals))
        assert got["median"] == pytest.approx(np.median(vals))
        assert got["share"] == pytest.approx(np.mean(vals) / np.mean(totals))
    # the two top-level regions tile each program: their shares add to one
    assert s["regions"]["inverse"]["share"] + s["regions"]["store"]["share"] == pytest.approx(1.0)


def test_variants_are_checked_by_name():
    import argparse

    from benchmarks import bench_tree_gdn_mgpu as bench

    ap = argparse.ArgumentParser()
    assert bench.parse_variants(ap, "mgpu64_sq,mgpu64_sq_p2") == ["mgpu64_sq", "mgpu64_sq_p2"]
    assert all(bench.VARIANTS[v] for v in bench.parse_variants(ap, bench.DEFAULT_VARIANTS))
    for bad in ("mgpu64_sq,nope", ""):
        with pytest.raises(SystemExit):
            bench.parse_variants(ap, bad)


@pytest.mark.parametrize("rows", [None, 1, 3])
def test_pending_rows_fold_to_the_deepest_nodes_state(rows):
    """--pending: the rows handed to the profiled verify, folded into the state, give each
    request's state at its deepest node (the reference commit of the same factors); with
    --pending-rows L, L rows and the state at the node of that path length on the deepest
    node's path."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_tree_gdn as btg
    from benchmarks.bench_tree_gdn_mgpu import point_inputs
    from bole_jax.pallas import tree_gdn_ref
    from bole_jax.pallas.tree_gdn_commit import apply_pending, commit_state

    parents, tree, (x,) = point_inputs(2, 8, int.from_bytes(os.urandom(2), "little"), 1)
    pend = mgpu_trace.pending_rows(x, parents, tree, 8, rows)
    _, fac = tree_gdn_ref.tree_gdn_closed_form(*x, parents, tree=tree)
    node = btg.deepest_nodes(parents)
    if rows is not None:  # its ancestor with a root path of min(rows, depth) nodes
        par = np.asarray(parents)

        def depth(r, i):
            return 1 + (depth(r, par[r, i]) if par[r, i] >= 0 else 0)

        full = [depth(r, node[r]) for r in range(len(node))]
        for r in range(len(node)):
            while depth(r, node[r]) > rows:
                node[r] = int(par[r, node[r]])
        assert (np.asarray(pend.count) == np.minimum(rows, full)).all()
    with jax.default_matmul_precision("highest"):
        want = commit_state(x[5], fac, parents, jnp.asarray(node), backend="reference")
        got = apply_pending(x[5], pend)
    assert pend.k.shape[1] == (min(btg.MAX_DEPTH, 8) if rows is None else rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
