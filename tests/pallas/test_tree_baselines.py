"""TREE-PERNODE and CHAIN baselines (Pallas, interpret mode) vs the sequential reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_conv, tree_gdn_ref, tree_pernode
from bole_jax.pallas.testing import random_gdn_inputs, random_trees
from bole_jax.pallas.tree_pernode import PernodeConfig
from bole_jax.pallas.tree_utils import dfs_order, tree_structure

jax.config.update("jax_default_matmul_precision", "highest")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, n, hk, hv, dk, dv, kinds, dtype=np.float32, ragged=True):
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, b, n, kinds, ragged=ragged)
    x = random_gdn_inputs(rng, b, n, hk, hv, dk, dv, dtype)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"]), parents, num_nodes


CASES = [  # N, Hk, HV, dk, dv, kinds, dtype, config
    (1, 1, 2, 16, 16, ("random",), np.float32, PernodeConfig(block_v=16)),
    (7, 1, 3, 64, 32, ("star", "deep", "forest"), np.float32, PernodeConfig(block_v=16)),
    (16, 2, 4, 16, 64, ("bushy", "random"), jnp.bfloat16, PernodeConfig(block_v=32)),
    (64, 1, 2, 16, 16, ("random", "deep", "forest"), np.float32, PernodeConfig(block_v=16)),
    (20, 1, 1, 24, 40, ("forest", "random"), np.float32, PernodeConfig(block_v=16)),
    (
        12,
        1,
        2,
        16,
        32,
        ("deep", "bushy"),
        np.float32,
        PernodeConfig(block_v=8, num_warps=1, num_stages=3),
    ),  # SGLang-like launch
    (16, 1, 2, 32, 16, ("bushy", "forest"), np.float32, PernodeConfig(block_v=8, layout="kv")),
    (7, 2, 2, 24, 40, ("random",), jnp.bfloat16, PernodeConfig(block_v=8, layout="kv")),
    # the committed tile reloaded (masked) per node instead of held: both layouts
    (13, 1, 2, 16, 32, ("star", "random"), np.float32, PernodeConfig(block_v=16, hold_root=0)),
    (9, 1, 1, 32, 16, ("forest",), np.float32, PernodeConfig(block_v=8, layout="kv", hold_root=0)),
    (
        11,
        1,
        2,
        16,
        16,
        ("bushy", "deep"),
        np.float32,
        PernodeConfig(block_v=8, num_warps=1, num_stages=2, scratch_eviction="evict_first"),
    ),
    # the walk in depth-first order (ragged requests, forests, both layouts, root held or not)
    (
        16,
        1,
        2,
        16,
        32,
        ("random", "forest", "bushy"),
        np.float32,
        PernodeConfig(block_v=16, order="dfs"),
    ),
    (
        33,
        2,
        4,
        16,
        16,
        ("deep", "star", "random"),
        jnp.bfloat16,
        PernodeConfig(block_v=8, num_warps=1, num_stages=3, order="dfs"),
    ),
    (
        12,
        1,
        1,
        32,
        16,
        ("forest", "bushy"),
        np.float32,
        PernodeConfig(block_v=8, layout="kv", hold_root=0, order="dfs"),
    ),
]


def _in_layout(states, layout):
    """Per-node states from the sequential reference ([..., dk, dv]) in the scratch's layout."""
    return np.swapaxes(np.asarray(states), -1, -2) if layout == "vk" else np.asarray(states)


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"N{c[0]}-r{c[2] // c[1]}-{c[3]}x{c[4]}-{c[7].layout}-root{c[7].hold_root}-{c[7].order}"
    ),
)
def test_pernode_matches_sequential(case):
    n, hk, hv, dk, dv, kinds, dtype, cfg = case
    seed = RUN_SEED
    args, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds, dtype)
    o_want, s_want = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    o, states = tree_pernode.tree_pernode_verify(
        *args, parents, num_nodes, backend="pallas", interpret=True, config=cfg
    )
    m = np.arange(n)[None, :] < num_nodes[:, None]
    msg = f"seed {seed}"
    s_lay = _in_layout(s_want, cfg.layout)
    assert o.dtype == args[2].dtype and states.shape == s_lay.shape, msg
    assert rel(o, o_want) <= (1e-5 if dtype == np.float32 else 1e-2), msg
    assert rel(np.asarray(states)[m], s_lay[m]) <= 1e-5, msg
    assert not np.any(np.asarray(o, np.float32)[~m]), msg
    # The commit copies the accepted node's state (into the pool's [dk, dv] layout): every
    # node, and -1 (keep).
    state = args[5]
    for sel in range(-1, n):
        acc = np.minimum(np.full(3, sel), num_nodes - 1).astype(np.int32)
        new = tree_pernode.commit_pernode_state(state, states, acc, cfg.layout)
        assert new.shape == state.shape, msg
        for b in range(3):
            want = state[b] if acc[b] < 0 else s_want[b, acc[b]]
            assert rel(new[b], want) <= 1e-5, f"{msg} accepted {acc[b]}"


@pytest.mark.parametrize("n,dtype", [(1, np.float32), (9, np.float32), (32, jnp.bfloat16)])
def test_chain_matches_sequential(n, dtype):
    seed = RUN_SEED
    args, _, num_nodes = _inputs(seed, 2, n, 1, 2, 16, 32, ("chain",), dtype)
    parents = np.broadcast_to(np.arange(n) - 1, (2, n)).astype(np.int32)
    o_want, s_want = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    o, snaps = tree_pernode.chain_verify(
        *args,
        parents,
        num_nodes,
        backend="pallas",
        interpret=True,
        config=PernodeConfig(block_v=16),
    )
    m = np.arange(n)[None, :] < num_nodes[:, None]
    assert rel(o, o_want) <= (1e-5 if dtype == np.float32 else 1e-2), f"seed {seed}"
    assert rel(np.asarray(snaps)[m], _in_layout(s_want, "vk")[m]) <= 1e-5, f"seed {seed}"
    acc = (num_nodes - 1).astype(np.int32)
    new = tree_pernode.commit_chain(args[5], snaps, acc)
    assert rel(new, np.asarray(s_want)[np.arange(2), acc]) <= 1e-5, f"seed {seed}"


def _preorder(parents, nn):
    """Depth-first preorder by an explicit walk (children in index order), padding last."""
    kids = {i: [] for i in range(-1, len(parents))}
    for i in range(nn):
        kids[int(parents[i])].append(i)
    out, stack = [], list(reversed(kids[-1]))
    while stack:
        i = stack.pop()
        out.append(i)
        stack.extend(reversed(kids[i]))
    return out + list(range(nn, len(parents)))


@pytest.mark.parametrize("n", [1, 2, 7, 16, 64, 128])
def test_dfs_order_is_the_preorder(n):
    rng = np.random.default_rng(RUN_SEED + n)
    kinds = ("random", "forest", "chain", "star", "bushy", "deep")
    parents, num_nodes = random_trees(rng, 6, n, kinds, ragged=True)
    order = np.asarray(dfs_order(jnp.asarray(parents), jnp.asarray(num_nodes)))
    given = np.asarray(
        dfs_order(
            jnp.asarray(parents), jnp.asarray(num_nodes), tree_structure(parents, num_nodes).anc
        )
    )
    for b in range(6):
        want = _preorder(parents[b], num_nodes[b])
        assert list(order[b]) == want, f"seed {RUN_SEED + n} request {b}"
        assert list(given[b]) == want, f"seed {RUN_SEED + n} request {b}"
        # the point of the order: a parent differs from the node before it only at a leaf's
        # successor, never more often than in index order
        nn = num_nodes[b]
        jumps = sum(parents[b, i] != (want[j - 1] if j else -1) for j, i in enumerate(want[:nn]))
        jumps_index = sum(parents[b, i] != i - 1 for i in range(nn))
        assert jumps <= jumps_index


def test_reference_backend_is_sequential():
    args, parents, num_nodes = _inputs(RUN_SEED, 2, 5, 1, 1, 16, 16, ("random",))
    o, states = tree_pernode.tree_pernode_verify(*args, parents, num_nodes, backend="reference")
    o2, s2 = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    assert rel(o, o2) == 0.0 and rel(states, _in_layout(s2, "vk")) == 0.0
    _, states_kv = tree_pernode.tree_pernode_verify(
        *args, parents, num_nodes, backend="reference", config=PernodeConfig(layout="kv")
    )
    assert rel(states_kv, s2) == 0.0


def test_layout_is_checked():
    assert PernodeConfig(block_v=8, num_warps=1).holds_root(128, 128)  # 32 floats per thread
    assert not PernodeConfig(block_v=32, num_warps=1).holds_root(128, 128)  # 128
    assert not PernodeConfig(block_v=8, num_warps=1, hold_root=0).holds_root(128, 128)
    with pytest.raises(ValueError, match="layout"):
        PernodeConfig(layout="dk_dv")
    with pytest.raises(ValueError, match="scratch_eviction"):
        PernodeConfig(scratch_eviction="evict_sometimes")
    with pytest.raises(ValueError, match="order"):
        PernodeConfig(order="bfs")
    with pytest.raises(ValueError, match="layout"):
        tree_pernode.commit_pernode_state(
            jnp.zeros((1, 1, 2, 2)),
            jnp.zeros((1, 3, 1, 2, 2)),
            jnp.zeros((1,), jnp.int32),
            layout="kk",
        )


@pytest.mark.parametrize("n,c,block_c", [(1, 16, 16), (13, 48, 16), (64, 32, 32)])
def test_pernode_conv_matches_reference(n, c, block_c):
    seed = RUN_SEED
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, 3, n, ("random", "forest", "deep"), ragged=True)
    x = rng.standard_normal((3, n, c)).astype(np.float32)
    cs = rng.standard_normal((3, 3, c)).astype(np.float32)
    w = (rng.standard_normal((4, c)) * 0.5).astype(np.float32)
    y, windows = tree_pernode.tree_pernode_conv(
        x, cs, w, parents, num_nodes, backend="pallas", interpret=True, block_c=block_c
    )
    y_ref = tree_conv.tree_causal_conv_ref(x, cs, w, parents, num_nodes)
    win_ref = tree_conv.node_conv_states_ref(x, cs, parents)
    m = np.arange(n)[None, :] < num_nodes[:, None]
    assert rel(y, y_ref) <= 1e-5, f"seed {seed}"
    assert rel(np.asarray(windows)[m], np.asarray(win_ref)[m]) == 0.0, f"seed {seed}"
    for sel in range(-1, n):
        acc = np.minimum(np.full(3, sel), num_nodes - 1).astype(np.int32)
        new = tree_pernode.commit_pernode_conv(cs, windows, acc)
        for b in range(3):
            want = cs[b] if acc[b] < 0 else win_ref[b, acc[b]]
            assert rel(new[b], want) == 0.0, f"seed {seed} accepted {acc[b]}"


@pytest.mark.parametrize(
    "fn,cfg",
    [
        ("tree_pernode_verify", None),
        ("chain_verify", None),
        ("tree_pernode_verify", PernodeConfig(block_v=8, num_warps=1, num_stages=3)),
        ("tree_pernode_verify", PernodeConfig(layout="kv")),
        ("tree_pernode_verify", PernodeConfig(block_v=8, num_warps=1, hold_root=0)),
        (
            "tree_pernode_verify",
            PernodeConfig(block_v=16, num_warps=1, num_stages=2, scratch_eviction="evict_first"),
        ),
        ("tree_pernode_verify", PernodeConfig(block_v=16, num_warps=1, num_stages=2, order="dfs")),
    ],
)
def test_baselines_lower_to_triton(fn, cfg):
    b, n, hk, hv, d = 2, 8, 2, 4, 128
    q = jnp.zeros((b, n, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, n, hv, d), jnp.bfloat16)
    gate = jnp.zeros((b, n, hv), jnp.float32)
    state = jnp.zeros((b, hv, d, d), jnp.float32)
    parents = jnp.zeros((b, n), jnp.int32)
    verify = getattr(tree_pernode, fn)
    f = jax.jit(lambda *a: verify(*a, backend="pallas", interpret=False, config=cfg))
    assert (
        "custom_call"
        in f.trace(q, q, v, gate, gate, state, parents)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )


@pytest.mark.parametrize(
    "b,n,hv,dk,dv,block_rows", [(3, 5, 2, 16, 32, 8), (2, 1, 3, 32, 16, 16), (4, 9, 1, 64, 64, 32)]
)
def test_transposed_commit_kernel(b, n, hv, dk, dv, block_rows):
    """The Pallas "vk" commit (in place, transposed in registers) against XLA's gather +
    transpose, for accepted nodes anywhere in the scratch and -1 (keep)."""
    rng = np.random.default_rng(RUN_SEED)
    old = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    scr = rng.standard_normal((b, n, hv, dv, dk)).astype(np.float32)
    acc = rng.integers(-1, n, size=b).astype(np.int32)
    acc[0] = -1
    want = tree_pernode.commit_pernode(old, scr, acc, transpose=True)
    got = tree_pernode.commit_pernode_state(
        old, scr, acc, backend="pallas", interpret=True, block_rows=block_rows
    )
    for i in range(b):
        ref = old[i] if acc[i] < 0 else np.swapaxes(scr[i, acc[i]], -1, -2)
        assert rel(want[i], ref) == 0.0 and rel(got[i], ref) == 0.0, f"seed {RUN_SEED} b {i}"
    f = jax.jit(
        lambda o, s, a: tree_pernode.commit_pernode_state(
            o, s, a, backend="pallas", interpret=False
        )
    )
    assert "custom_call" in f.trace(old, scr, acc).lower(lowering_platforms=("cuda",)).as_text()
