"""benchmarks/bench_tree_gdn.py: the launch specs of its bole sweep (Triton configs, "auto" and
the Mosaic GPU verify), resolved per point as the GPU run resolves them (no GPU here)."""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig  # noqa: E402


def test_parse_mosaic_specs():
    assert btg.parse_bole("mosaic") == btg.MosaicLaunch()
    assert btg.parse_bole(" mosaic, bv=128, inv=neumann, p=3, ax=0, ab=1 ") == btg.MosaicLaunch(
        block_v=128, inverse="neumann", products=3, approx_math=False, auto_barriers=True
    )
    assert btg.cfg_str(btg.MosaicLaunch()) == "mosaic,bv=64,inv=squaring,p=1"
    assert btg.cfg_str(btg.MosaicLaunch(approx_math=False, auto_barriers=True)) == (
        "mosaic,bv=64,inv=squaring,p=1,ax=0,ab=1"
    )
    assert btg.parse_bole("auto") == "auto"
    assert btg.parse_bole("bv=32,w=4,inv=squaring") == TreeGDNConfig(
        block_v=32, num_warps=4, inverse="squaring"
    )
    ns = btg.parse_bole("bv=64,w=2,ns=2,fold=unroll")
    assert ns == TreeGDNConfig(block_v=64, num_warps=2, num_stages=2, fold="unroll")
    assert btg.cfg_str(ns) == "bv=64,hg=1,w=2,inv=squaring,ns=2,fold=unroll"
    for bad in ("mosaic,warps=4", "mosaic,bv"):
        with pytest.raises(ValueError, match="bad Mosaic launch item"):
            btg.parse_bole(bad)


def test_resolve_auto_adds_the_engines_mosaic_launch(monkeypatch):
    """ "auto" at a point: the Triton auto config, plus the Mosaic launch exactly where
    `mosaic_launch` takes one (never in interpret mode); an explicit Mosaic spec only at
    N <= 64; duplicates dropped."""
    taken = dict(block_v=64, inverse="squaring", products=1, approx_math=True, auto_barriers=False)
    monkeypatch.setattr(
        btg, "mosaic_launch", lambda b, n, dk, dv, dt, depth: taken if n > 32 else None
    )
    assert btg.resolve_bole(["auto"], 16, 64) == [
        TreeGDNConfig.auto(16, 64, btg.MAX_DEPTH),
        btg.MosaicLaunch(**taken),
    ]
    assert btg.resolve_bole(["auto", "auto"], 16, 16) == [TreeGDNConfig.auto(16, 16, btg.MAX_DEPTH)]
    assert btg.resolve_bole([btg.MosaicLaunch()], 1, 128) == []
    assert btg.resolve_bole(["auto", btg.MosaicLaunch()], 1, 64) == [
        TreeGDNConfig.auto(1, 64, btg.MAX_DEPTH),
        btg.MosaicLaunch(),
    ]
    monkeypatch.setattr(btg, "INTERPRET", True)
    assert btg.resolve_bole(["auto"], 16, 64) == [TreeGDNConfig.auto(16, 64, btg.MAX_DEPTH)]


def test_auto_with_fields():
    """ "auto,fold=unroll": each point's auto config with those fields replaced, no Mosaic."""
    spec = btg.parse_bole("auto, fold=unroll,w=2")
    assert spec == ("auto", dict(fold="unroll", num_warps=2))
    for b, n in ((1, 32), (16, 64)):
        assert btg.resolve_bole([spec], b, n) == [
            dataclasses.replace(TreeGDNConfig.auto(b, n, btg.MAX_DEPTH), fold="unroll", num_warps=2)
        ]
    # a fold the auto launch's prefetch_fold does not allow drops it (`with_fold`)
    (loop,) = btg.resolve_bole([btg.parse_bole("auto,fold=loop")], 1, 32)
    assert TreeGDNConfig.auto(1, 32, btg.MAX_DEPTH).prefetch_fold
    assert loop.fold == "loop" and not loop.prefetch_fold
    assert TreeGDNConfig(fold="dot", prefetch_fold=True).with_fold("unroll").prefetch_fold


def test_pernode_specs_and_reload_count():
    from bole_jax.pallas.tree_pernode import PernodeConfig

    cfg = btg.parse_pernode("bv=16,w=1,ns=2,ord=dfs")
    assert cfg == PernodeConfig(block_v=16, num_warps=1, num_stages=2, order="dfs")
    assert btg.cfg_str(cfg) == "bv=16,w=1,ns=2,ord=dfs"
    assert btg.cfg_str(btg.parse_pernode("bv=8,w=1,ns=3")) == "bv=8,w=1,ns=3"
    # 0 <- 1, 0 <- 2, 1 <- 3: index order reloads node 2 (parent 0 after node 1) and node 3
    # (parent 1 after node 2); the walk 0, 1, 3, 2 reloads only node 2.
    import numpy as np

    parents = np.array([[-1, 0, 0, 1]])
    assert btg.reloads(parents, np.array([[0, 1, 2, 3]])) == 2.0
    assert btg.reloads(parents, np.array([[0, 1, 3, 2]])) == 1.0


def test_pernode_walk_relabel_makes_preorder_the_index_order():
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_pernode_walk as bpw
    from bole_jax.pallas.testing import random_trees
    from bole_jax.pallas.tree_utils import dfs_order

    rng = np.random.default_rng(7)
    parents, _ = random_trees(rng, 5, 24, ("random", "forest", "bushy", "deep", "star"))
    order = np.asarray(dfs_order(jnp.asarray(parents)))
    new = bpw.relabel(parents, order)
    assert np.all(new < np.arange(24)[None])  # parents first
    assert np.array_equal(
        np.asarray(dfs_order(jnp.asarray(new))), np.broadcast_to(np.arange(24), (5, 24))
    )
    # the same trees: equal numbers of children per node, renamed
    for b in range(5):
        kids = np.bincount(parents[b][parents[b] >= 0], minlength=24)
        kids_new = np.bincount(new[b][new[b] >= 0], minlength=24)
        assert np.array_equal(np.sort(kids), np.sort(kids_new))


def test_ratio_ceiling(tmp_path):
    """benchmarks/ratio_ceiling.py: the step floors counted in states (4 MiB per request at
    HV = 32, dk = dv = 128), the better of eager and lazy, and the JSON it writes."""
    import json

    from benchmarks import ratio_ceiling as rc

    s = 32 * 128 * 128 * 4  # one request's fp32 state
    b, n = 2, 8
    io = btg.floor_bytes(b, n) - b * s
    f = rc.step_floors(b, n)
    assert f["bole_bytes"] == 2 * b * s + io  # read S once, write it once
    assert f["pernode_bytes"] == (n + 3) * b * s + io  # read, N scratch states, commit copy
    point = dict(B=b, N=n, pernode_sum_us=100.0, bole_sum_us=20.0, bole_lazy_sum_us=16.0)
    data = dict(
        git_commit="abc", copy_bandwidth=dict(bandwidth=1e12), points=[point, dict(B=4, N=8)]
    )  # a point without sums is skipped
    src = tmp_path / "bench_tree_gdn.json"
    src.write_text(json.dumps(data))
    rc.main([str(src)])
    (row,) = json.loads((tmp_path / "ratio_ceiling.json").read_text())["rows"]
    assert row["bole_mode"] == "lazy" and row["ratio"] == pytest.approx(100 / 16)
    assert row["bole_floor_us"] == pytest.approx(f["bole_bytes"] / 1e6)
    assert row["ceiling"] == pytest.approx(100 / row["bole_floor_us"])
    assert row["floor_ratio"] == pytest.approx(f["pernode_bytes"] / f["bole_bytes"])


def test_unlaunchable_is_only_the_shared_memory_refusal():
    from benchmarks.bench_tree_gdn import unlaunchable

    assert unlaunchable(
        RuntimeError(
            "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: "
            "requested 317044, available: 232448"
        )
    )
    assert not unlaunchable(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB"))
    assert not unlaunchable(ValueError("shared memory"))  # no XLA status: a bug, not a limit
