"""Tree GDN verify: closed form vs the per-branch recurrence, Pallas kernel vs reference.

CPU only: the kernel runs in Pallas interpret mode (fp32 dots, so tolerances are tight), and a
lowering test builds the Triton IR for the GPU. Random inputs are fresh every run (seed printed
in every failure message) plus fixed seeds.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_gdn_ref as ref
from bole_jax.pallas.factors import PendingCommit, PendingPath, TreeFactors
from bole_jax.pallas.options import KernelOptions
from bole_jax.pallas.testing import random_gdn_inputs, random_parents, random_trees
from bole_jax.pallas.tree_gdn import TreeGDNConfig, tree_gdn_verify
from bole_jax.pallas.tree_gdn_commit import (
    accepted_rows,
    apply_pending,
    commit_state,
    gather_pending_path,
    pending_commit,
)
from bole_jax.pallas.tree_utils import accepted_path, check_parents, tree_structure

jax.config.update("jax_default_matmul_precision", "highest")

SEEDS = [0, RUN_SEED]
sequential = ref.tree_gdn_sequential
closed_form = ref.tree_gdn_closed_form
states_from_factors = ref.node_states_from_factors


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


FACTORS = ("u", "keys", "k_scale", "gamma")  # what a commit reads of `TreeFactors`


def factor(f, name):
    """A factor by name; "keys": the normalised keys the state is built from."""
    return f.keys() if name == "keys" else getattr(f, name)


def _inputs(seed, batch, n, hk, hv, dk, dv, kinds, ragged=False, dtype=np.float32):
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, batch, n, kinds, ragged=ragged)
    x = random_gdn_inputs(rng, batch, n, hk, hv, dk, dv, dtype)
    return x, parents, num_nodes


def _args(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"]


def _valid(num_nodes, n):
    return np.arange(n)[None, :] < np.asarray(num_nodes)[:, None]


# ------------------------------------------------------------------------------ structure


@pytest.mark.parametrize("kind", ["chain", "star", "deep", "bushy", "forest", "random"])
def test_tree_structure_matches_parent_walk(kind):
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, 3, 37, (kind,), ragged=True)
    check_parents(parents, num_nodes)
    t = tree_structure(parents, num_nodes)
    for b in range(3):
        want = np.zeros((37, 37), bool)
        for i in range(num_nodes[b]):
            j = i
            while j >= 0:
                want[i, j] = True
                j = parents[b, j]
        np.testing.assert_array_equal(np.asarray(t.anc[b]) != 0, want, err_msg=f"seed {RUN_SEED}")
        depth = want.sum(1)
        assert int(t.path_len[b]) == depth.max(), RUN_SEED
        np.testing.assert_array_equal(
            np.asarray(t.depth[b])[: num_nodes[b]], depth[: num_nodes[b]] - 1
        )


def test_check_parents_rejects_bad_order():
    with pytest.raises(ValueError, match="parent < index"):
        check_parents(np.array([[-1, 2, 0]]))


# ------------------------------------------------------- closed form vs sequential recurrence

# (N, Hk, HV, dk, dv, tree kinds): covers N in {1, 2, 7, 16, 64, 128}, HV/Hk in {1, 2, 3, 4},
# dk, dv in {16, 64, 128}, chains/stars/deep/bushy/forests, ragged batches.
REF_CASES = [
    (1, 1, 1, 16, 16, ("random",)),
    (2, 2, 4, 16, 64, ("chain", "forest")),
    (7, 1, 3, 64, 16, ("star", "deep", "random")),
    (16, 2, 2, 16, 16, ("bushy", "forest")),
    (64, 1, 4, 16, 16, ("random", "deep")),
    (128, 1, 2, 16, 16, ("chain", "random")),
    (24, 1, 1, 128, 128, ("random",)),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: f"N{c[0]}-r{c[2] // c[1]}-{c[3]}x{c[4]}")
def test_closed_form_matches_sequential(case, seed):
    n, hk, hv, dk, dv, kinds = case
    x, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds, ragged=True)
    o_seq, states = sequential(*_args(x), parents, num_nodes)
    states = np.asarray(states)
    tree = tree_structure(parents, num_nodes)
    m = _valid(num_nodes, n)
    for inverse in ("solve", "neumann"):
        o, f = closed_form(*_args(x), parents, num_nodes, tree=tree, inverse=inverse)
        msg = f"seed {seed} inverse {inverse}"
        assert rel(o, o_seq) <= 1e-4, msg
        rebuilt = np.asarray(states_from_factors(x["state"], f, tree))
        # every node separately (a small state must not hide behind a large one)
        for b, i in zip(*np.nonzero(m)):
            assert rel(rebuilt[b, i], states[b, i]) <= 1e-4, f"{msg} node ({b}, {i})"
        assert not np.any(np.asarray(o)[~m]) and not np.any(np.asarray(f.u)[~m]), msg


# ---------------------------------------------------------------- Pallas kernel vs reference

KERNEL_CASES = [
    # N, Hk, HV, dk, dv, kinds, dtype, config
    (1, 1, 2, 16, 16, ("random",), np.float32, TreeGDNConfig(block_v=16, inverse="neumann")),
    (
        2,
        2,
        4,
        16,
        32,
        ("chain", "forest"),
        np.float32,
        TreeGDNConfig(block_v=16, heads_per_program=2),
    ),
    (
        7,
        1,
        3,
        64,
        16,
        ("star", "deep", "random"),
        np.float32,
        TreeGDNConfig(block_v=16, heads_per_program=3, inverse="neumann"),
    ),
    (16, 2, 4, 16, 64, ("bushy", "forest"), jnp.bfloat16, TreeGDNConfig(block_v=32)),
    (37, 1, 2, 16, 16, ("deep", "random"), np.float32, TreeGDNConfig(block_v=16, depth_bound=37)),
    (
        64,
        1,
        1,
        128,
        128,
        ("random",),
        jnp.bfloat16,
        TreeGDNConfig(block_v=64, depth_bound=8, inverse="neumann"),
    ),
    (128, 1, 2, 16, 16, ("chain", "random"), np.float32, TreeGDNConfig(block_v=16)),
    (20, 1, 2, 24, 40, ("random", "forest"), np.float32, TreeGDNConfig(inverse="neumann")),
    (
        33,
        2,
        4,
        16,
        64,
        ("random", "deep", "forest"),
        np.float32,
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix", heads_per_program=2),
    ),
    (
        12,
        1,
        2,
        16,
        32,
        ("chain", "bushy"),
        jnp.bfloat16,
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="squaring", depth_bound=12),
    ),
    (64, 1, 1, 16, 16, ("chain",), np.float32, TreeGDNConfig(inverse="matrix", depth_bound=64)),
    (
        24,
        2,
        4,
        32,
        32,
        ("random", "bushy"),
        jnp.bfloat16,  # bf16 operands (the GPU default)
        TreeGDNConfig(block_v=16, num_warps=2, bf16_qk=True, bf16_state=True),
    ),
    (
        40,
        1,
        2,
        16,
        32,
        ("random", "deep"),
        np.float32,
        TreeGDNConfig(block_v=32, inverse="matrix", bf16_qk=True, bf16_state=True),
    ),
    (
        24,
        1,
        2,
        32,
        32,
        ("random", "deep"),
        jnp.bfloat16,  # tree_gdn_nodes="fp32": node dots ~fp32, state dots bf16
        TreeGDNConfig(block_v=16, inverse="matrix", bf16_state=True, precise_nodes=True),
    ),
    (
        9,
        2,
        4,
        16,
        32,
        ("random", "forest"),
        jnp.bfloat16,  # the state tile loaded first
        TreeGDNConfig(block_v=16, inverse="squaring", prefetch_state=True, depth_bound=9),
    ),
]


@pytest.mark.parametrize(
    "case", KERNEL_CASES, ids=lambda c: f"N{c[0]}-r{c[2] // c[1]}-{c[3]}x{c[4]}-{c[7].inverse}"
)
def test_kernel_matches_reference(case):
    n, hk, hv, dk, dv, kinds, dtype, cfg = case
    if cfg.depth_bound is not None and "random" not in kinds and n > cfg.depth_bound:
        pytest.skip("depth bound below tree depth")
    seed = RUN_SEED
    x, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds, ragged=True, dtype=dtype)
    if cfg.depth_bound is not None:  # a static bound must cover the trees it is used with
        assert int(tree_structure(parents, num_nodes).path_len.max()) <= cfg.depth_bound
    o_ref, f_ref = tree_gdn_verify(*_args(x), parents, num_nodes, backend="reference")
    o, f = tree_gdn_verify(
        *_args(x), parents, num_nodes, backend="pallas", interpret=True, config=cfg
    )
    msg = f"seed {seed} cfg {cfg}"
    assert o.dtype == x["v"].dtype and o.shape == o_ref.shape, msg
    # o is rounded to v.dtype: bf16 rounding dominates there.
    # bf16 operands (q, k, state rounded for the K K^T, Q K^T, K S, Q S dots): ~1e-3 on u.
    bf16_ops = cfg.bf16_qk or cfg.bf16_state
    assert rel(o, o_ref) <= (1e-5 if dtype == np.float32 and not bf16_ops else 1e-2), msg
    for name in FACTORS:
        got, want = factor(f, name), factor(f_ref, name)
        assert got.dtype == jnp.float32 and got.shape == want.shape, (name, msg)
        assert rel(got, want) <= (5e-3 if bf16_ops and name == "u" else 2e-5), (name, msg)
    # the factor k is the caller's keys, not a copy the kernel wrote
    np.testing.assert_array_equal(np.asarray(f.k), x["k"], err_msg=msg)
    m = _valid(num_nodes, n)
    for arr in (o, f.u, f.keys(), f.k_scale, f.gamma):
        assert not np.any(np.asarray(arr, np.float32)[~m]), f"padding not zero: {msg}"


@pytest.mark.parametrize("inverse", ["matrix", "squaring", "neumann"])
def test_depth_bound_broken_is_nan(inverse):
    """A request whose tree is deeper than the static depth bound gets NaN outputs and u (a
    wrong bound is loud); the requests within it are exact."""
    rng = np.random.default_rng(RUN_SEED)
    n, bound = 12, 4
    parents = np.stack([random_parents(rng, n, kind) for kind in ("chain", "star", "deep")]).astype(
        np.int32
    )
    num_nodes = np.array([3, n, n], np.int32)  # chain of 3 and a star: within; deep: beyond
    x = random_gdn_inputs(rng, 3, n, 1, 2, 16, 16)
    plen = np.asarray(tree_structure(jnp.asarray(parents), jnp.asarray(num_nodes)).path_len)
    assert plen[0] <= bound and plen[1] <= bound and plen[2] > bound, plen
    o_ref, f_ref = tree_gdn_verify(*_args(x), parents, num_nodes, backend="reference")
    o, f = tree_gdn_verify(
        *_args(x),
        parents,
        num_nodes,
        backend="pallas",
        interpret=True,
        config=TreeGDNConfig(block_v=16, inverse=inverse, depth_bound=bound),
    )
    for r in (0, 1):
        m = slice(0, num_nodes[r])
        assert rel(o[r, m], o_ref[r, m]) <= 1e-5 and rel(f.u[r, m], f_ref.u[r, m]) <= 2e-5, r
    assert np.isnan(np.asarray(o[2])).all() and np.isnan(np.asarray(f.u[2])).all()


def test_kernel_state_reconstruction_every_node():
    """Factors from the kernel rebuild every node's state of the recurrence."""
    seed = RUN_SEED
    x, parents, num_nodes = _inputs(seed, 2, 16, 1, 2, 16, 16, ("random", "forest"))
    states = np.asarray(sequential(*_args(x), parents, num_nodes)[1])
    _, f = tree_gdn_verify(
        *_args(x),
        parents,
        num_nodes,
        backend="pallas",
        interpret=True,
        config=TreeGDNConfig(block_v=16),
    )
    rebuilt = np.asarray(states_from_factors(x["state"], f, tree_structure(parents, num_nodes)))
    for b in range(2):
        for i in range(16):
            assert rel(rebuilt[b, i], states[b, i]) <= 1e-4, f"seed {seed} node ({b}, {i})"


def test_padding_nodes_change_nothing():
    """A ragged batch (garbage, even NaN, in padding rows) gives each request exactly what it
    gets alone without padding."""
    seed = RUN_SEED
    n = 24
    x, parents, num_nodes = _inputs(seed, 2, n, 1, 2, 16, 16, ("deep", "forest"), ragged=True)
    m = _valid(num_nodes, n)
    dirty = {key: np.array(val) for key, val in x.items()}
    for key in ("q", "k", "v", "g", "beta"):
        dirty[key][~m] = np.nan
    cfg = TreeGDNConfig(block_v=16)
    o, f = tree_gdn_verify(
        *_args(dirty), parents, num_nodes, backend="pallas", interpret=True, config=cfg
    )
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(f.u)))
    # the factor k holds the caller's NaN rows; its scale is 0 there and keys() zeroes them
    assert np.all(np.isnan(np.asarray(f.k)[~m])) and not np.any(np.asarray(f.k_scale)[~m])
    keys = np.asarray(f.keys())
    assert np.all(np.isfinite(keys)) and not np.any(keys[~m])
    # a commit at the deepest real node reads only real rows
    depth = np.asarray(tree_structure(parents, num_nodes).depth)
    accepted = np.array([int(np.argmax(np.where(m[r], depth[r], -1))) for r in range(2)], np.int32)
    committed = commit_state(x["state"], f, parents, accepted, backend="pallas", interpret=True)
    for b in range(2):
        nb = int(num_nodes[b])
        one = {
            key: (val[b : b + 1, :nb] if key != "state" else val[b : b + 1])
            for key, val in x.items()
        }
        o1, f1 = tree_gdn_verify(
            *_args(one), parents[b : b + 1, :nb], None, backend="pallas", interpret=True, config=cfg
        )
        msg = f"seed {seed} request {b} num_nodes {nb}"
        assert rel(o[b, :nb], o1[0]) <= 1e-6, msg
        assert rel(f.u[b, :nb], f1.u[0]) <= 1e-6, msg
        assert rel(f.gamma[b, :nb], f1.gamma[0]) <= 1e-6, msg
        assert rel(keys[b, :nb], f1.keys()[0]) <= 1e-6, msg
        c1 = commit_state(
            one["state"],
            f1,
            parents[b : b + 1, :nb],
            accepted[b : b + 1],
            backend="pallas",
            interpret=True,
        )
        assert rel(committed[b], c1[0]) <= 1e-6, msg


def test_shared_tree_structure_and_auto_backend():
    x, parents, num_nodes = _inputs(RUN_SEED, 2, 9, 1, 1, 16, 16, ("random",), ragged=True)
    tree = tree_structure(parents, num_nodes)
    o1, _ = tree_gdn_verify(
        *_args(x),
        parents,
        num_nodes,
        tree=tree,
        backend="pallas",
        interpret=True,
        config=TreeGDNConfig(block_v=16),
    )
    o2, _ = tree_gdn_verify(*_args(x), parents, num_nodes)  # "auto" = reference on CPU
    assert rel(o1, o2) <= 1e-5, RUN_SEED


# ------------------------------------------------- lazy commit: pending rows folded by the kernel


def _random_pending(rng, b, length, hk, hv, dk, dv, count):
    """A PendingCommit with realistic ranges (unit keys, w and p_sel in (0, 1]), rows past count
    weighing 0; and the same with NaN in those rows (a kernel must never read them)."""
    k = rng.standard_normal((b, length, hk, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    live = np.arange(length)[None, :] < np.asarray(count)[:, None]  # [B, L]
    pend = PendingCommit(
        k=jnp.asarray(k, jnp.float32),
        u=jnp.asarray(rng.standard_normal((b, length, hv, dv)), jnp.float32),
        w=jnp.asarray(
            np.where(live[:, :, None], rng.uniform(0.05, 1.0, (b, length, hv)), 0.0), jnp.float32
        ),
        p_sel=jnp.asarray(rng.uniform(0.05, 1.0, (b, hv)), jnp.float32),
        count=jnp.asarray(count, jnp.int32),
    )
    dirty = PendingCommit(
        k=jnp.where(live[:, :, None, None], pend.k, jnp.nan),
        u=jnp.where(live[:, :, None, None], pend.u, jnp.nan),
        w=pend.w,
        p_sel=pend.p_sel,
        count=pend.count,
    )
    return pend, dirty


PENDING_CASES = [
    # N, Hk, HV, dk, dv, kinds, L, count per request, config (GQA, heads and tiles per program,
    # non power-of-two head dims, a pending as long as the tree, nothing pending)
    (
        9,
        2,
        4,
        16,
        32,
        ("chain", "forest", "random"),
        9,
        (9, 0, 4),
        TreeGDNConfig(block_v=16, heads_per_program=2),
    ),
    (
        20,
        1,
        2,
        24,
        40,
        ("random", "deep", "bushy"),
        3,
        (1, 3, 0),
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix"),
    ),
    # the dot fold loads every row, NaN ones past count included: they must not leak
    (9, 2, 4, 16, 32, ("chain", "random"), 5, (5, 0, 2), TreeGDNConfig(block_v=16, fold="dot")),
    (
        20,
        1,
        2,
        24,
        40,
        ("random", "deep", "bushy"),
        16,
        (16, 3, 0),
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix", fold="dot"),
    ),
    # the unrolled fold, too, reads every row (NaN past count)
    (
        9,
        2,
        4,
        16,
        32,
        ("chain", "random"),
        5,
        (5, 0, 2),
        TreeGDNConfig(block_v=16, heads_per_program=2, fold="unroll"),
    ),
    (
        20,
        1,
        2,
        24,
        40,
        ("random", "deep", "bushy"),
        9,
        (9, 3, 0),
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix", fold="unroll"),
    ),
    # the rows' loads issued before the N x N work (NaN past count still never leaks)
    (
        9,
        2,
        4,
        16,
        32,
        ("chain", "random"),
        5,
        (5, 0, 2),
        TreeGDNConfig(block_v=32, fold="unroll", prefetch_fold=True),
    ),
    (
        20,
        1,
        2,
        24,
        40,
        ("random", "deep", "bushy"),
        16,
        (16, 3, 0),
        TreeGDNConfig(block_v=64, fold="dot", prefetch_fold=True, prefetch_state=True),
    ),
    # ... and by the dot from a block wider than the rows present (masked loads)
    (
        9,
        2,
        4,
        16,
        32,
        ("chain", "random"),
        5,
        (5, 0, 2),
        TreeGDNConfig(block_v=32, fold="dot", prefetch_fold=True),
    ),
]


@pytest.mark.parametrize(
    "case", PENDING_CASES, ids=lambda c: f"N{c[0]}-r{c[2] // c[1]}-{c[3]}x{c[4]}-L{c[6]}"
)
def test_kernel_with_pending_matches_reference(case):
    """The kernel folding the pending rows into its state tiles = apply_pending + the closed
    form: outputs, factors and the returned state (rows past count are NaN in the kernel's
    input: never read). count 0 with p_sel 1 leaves that request's state bit-exact."""
    n, hk, hv, dk, dv, kinds, length, count, cfg = case
    seed = RUN_SEED
    x, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds, ragged=True)
    pend, dirty = _random_pending(np.random.default_rng(seed + 1), 3, length, hk, hv, dk, dv, count)
    empty = np.asarray(count) == 0
    dirty = dataclasses.replace(dirty, p_sel=jnp.where(empty[:, None], 1.0, dirty.p_sel))
    pend = dataclasses.replace(pend, p_sel=dirty.p_sel)
    s_ref = apply_pending(x["state"], pend)
    o_ref, f_ref = closed_form(*_args(x)[:5], s_ref, parents, num_nodes)
    o, f, s = tree_gdn_verify(
        *_args(x), parents, num_nodes, backend="pallas", interpret=True, config=cfg, pending=dirty
    )
    msg = f"seed {seed} cfg {cfg}"
    assert s.dtype == jnp.float32 and s.shape == x["state"].shape, msg
    assert rel(s, s_ref) <= 1e-6, msg
    np.testing.assert_array_equal(np.asarray(s)[empty], x["state"][empty], err_msg=msg)
    assert rel(o, o_ref) <= 1e-5, msg
    for name in FACTORS:
        assert rel(factor(f, name), factor(f_ref, name)) <= 2e-5, (name, msg)
    m = _valid(num_nodes, n)
    for arr in (o, f.u, f.keys(), f.k_scale, f.gamma):
        assert not np.any(np.asarray(arr)[~m]), f"padding not zero: {msg}"


@pytest.mark.parametrize(
    "n,hk,hv,dk,dv,length,callers_path",
    [
        (9, 2, 4, 16, 32, 9, False),  # GQA 2, L = N (not a power of two)
        (20, 1, 2, 24, 40, 3, False),  # padded head dims, a cut path
        (33, 2, 2, 16, 16, 8, True),  # no GQA, the caller's path (junk past count)
    ],
)
def test_pending_gather_kernel_matches_reference(n, hk, hv, dk, dv, length, callers_path):
    """pending_commit's Pallas gather (interpret mode) = its XLA gathers, bit for bit: rows,
    weights (0 past count), p_sel (1 for accepted -1) and count, for the deepest node, the
    root and -1."""
    seed = RUN_SEED
    rng = np.random.default_rng(seed)
    x, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, ("random", "deep"), ragged=True)
    _, f = closed_form(*_args(x), parents, num_nodes)
    depth = np.asarray(tree_structure(parents, num_nodes).depth)
    accepted = np.array([int(np.argmax(depth[0, : num_nodes[0]])), -1, 0], np.int32)
    kw = {}
    if callers_path:
        walk = np.asarray(accepted_path(parents, accepted, length))
        count = (walk >= 0).sum(1).astype(np.int32)
        path = rng.integers(-3, n + 3, (3, length)).astype(np.int32)  # junk past count
        for r in range(3):
            path[r, : count[r]] = walk[r, : count[r]][::-1]
        kw = dict(path=jnp.asarray(path), count=jnp.asarray(count))
    want = pending_commit(f, parents, accepted, length, backend="reference", **kw)
    got = pending_commit(f, parents, accepted, length, backend="pallas", interpret=True, **kw)
    for name in ("k", "u", "w", "p_sel", "count"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, name)),
            np.asarray(getattr(want, name)),
            err_msg=f"{name} seed {seed}",
        )


def test_pending_gather_kernel_lowers_to_triton():
    """The gather lowers for cuda at Qwen3-Next head dims with a decode step's 9-row path."""
    b, n, hk, hv, d = 2, 64, 2, 4, 128
    f = TreeFactors(
        k=jnp.zeros((b, n, hk, d)), u=jnp.zeros((b, n, hv, d)), gamma=jnp.zeros((b, n, hv))
    )
    fn = jax.jit(
        lambda f, p, a, c: pending_commit(
            f, p, a, 9, jnp.zeros((b, 9), jnp.int32), c, backend="pallas", interpret=False
        )
    )
    text = (
        fn.trace(
            f, jnp.zeros((b, n), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.int32)
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "bole_pending_gather" in text


@pytest.mark.parametrize("form", ["rows", "path"])
def test_lazy_commit_equals_commit_then_verify(form):
    """Two decode steps through one jitted verify that donates the state (the fold writes it in
    place): step 1 with nothing pending returns the state untouched; step 2 folds step 1's
    commit and gives what commit_state followed by a plain verify gives (GQA 2, two heads per
    program, ragged trees, the deepest node, accepted -1). form "rows": the commit gathered
    (`pending_commit`, the rank-1 loop folds it); "path": kept as step 1's own factors and
    accepted paths (`PendingPath`, the unrolled fold reads them)."""
    seed = RUN_SEED
    rng = np.random.default_rng(seed)
    b, n, hk, hv, dk, dv = 3, 12, 1, 2, 16, 32
    cfg = TreeGDNConfig(
        block_v=16, heads_per_program=2, fold="loop" if form == "rows" else "unroll"
    )
    x1, parents1, nn1 = _inputs(seed, b, n, hk, hv, dk, dv, ("deep", "random"), ragged=True)
    x2, parents2, nn2 = _inputs(seed + 1, b, n, hk, hv, dk, dv, ("random", "forest"), ragged=True)

    @functools.partial(jax.jit, donate_argnums=5)
    def step(q, k, v, g, beta, state, parents, num_nodes, pending):
        return tree_gdn_verify(
            q,
            k,
            v,
            g,
            beta,
            state,
            parents,
            num_nodes,
            backend="pallas",
            interpret=True,
            config=cfg,
            pending=pending,
        )

    msg = f"seed {seed} form {form}"
    empty = (
        PendingCommit.empty(b, n, hk, dk, hv, dv)
        if form == "rows"
        else PendingPath.empty(b, n, n, hk, dk, hv, dv, k_dtype=jnp.float32)
    )
    o1, f1, s1 = step(*_args(x1)[:5], jnp.array(x1["state"]), parents1, nn1, empty)
    np.testing.assert_array_equal(np.asarray(s1), x1["state"], err_msg=msg)
    o1_ref, f1_ref = closed_form(*_args(x1), parents1, nn1)
    assert rel(o1, o1_ref) <= 1e-5 and rel(f1.u, f1_ref.u) <= 2e-5, msg

    depth = np.asarray(tree_structure(parents1, nn1).depth)
    accepted = np.array(
        [int(np.argmax(depth[0, : nn1[0]])), -1, int(rng.integers(0, nn1[2]))], np.int32
    )
    msg += f" accepted {accepted}"
    if form == "rows":
        pend = pending_commit(f1, parents1, accepted, n)  # L = N: any path, uncut
    else:
        path, count = accepted_rows(parents1, accepted, n)
        pend = PendingPath(factors=f1, path=path, sel=jnp.asarray(accepted), count=count)
    committed = commit_state(x1["state"], f1, parents1, accepted, backend="reference")
    o, f, s = step(*_args(x2)[:5], s1, parents2, nn2, pend)
    assert rel(s, committed) <= 1e-6, msg
    np.testing.assert_array_equal(np.asarray(s)[1], x1["state"][1], err_msg=msg)
    o_ref, f_ref = closed_form(*_args(x2)[:5], committed, parents2, nn2)
    assert rel(o, o_ref) <= 1e-5, msg
    for name in FACTORS:
        assert rel(factor(f, name), factor(f_ref, name)) <= 2e-5, (name, msg)


PATH_CASES = [
    # previous tree M nodes, this tree N, Hk, HV, dk, dv, path rows L, caller's root-first path
    # (junk past count) or the walk (accepted first), config
    (9, 12, 2, 4, 16, 32, 9, False, TreeGDNConfig(block_v=16, heads_per_program=2)),
    (
        20,
        7,
        1,
        2,
        24,
        40,
        5,
        True,
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix"),
    ),
    (12, 12, 2, 4, 16, 32, 5, True, TreeGDNConfig(block_v=16, fold="dot")),
    (
        33,
        16,
        1,
        2,
        24,
        40,
        9,
        False,
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix", fold="dot"),
    ),
    (12, 9, 2, 4, 16, 32, 5, True, TreeGDNConfig(block_v=16, heads_per_program=2, fold="unroll")),
    (
        20,
        20,
        1,
        2,
        24,
        40,
        9,
        False,
        TreeGDNConfig(block_v=16, tiles_per_program=2, inverse="matrix", fold="unroll"),
    ),
    # the rows' loads issued before the N x N work
    (
        12,
        9,
        1,
        2,
        16,
        32,
        5,
        True,
        TreeGDNConfig(block_v=32, fold="unroll", prefetch_fold=True, prefetch_state=True),
    ),
    (20, 12, 2, 4, 24, 40, 9, False, TreeGDNConfig(block_v=64, fold="dot", prefetch_fold=True)),
]


def _pending_path(seed, b, m, hk, hv, dk, dv, length, callers_path):
    """A `PendingPath` from a real previous verify of m nodes (reference factors, bf16 keys as
    a model passes them): accepted = the deepest node, nothing (-1), a random node. Factor rows
    of nodes off every path are NaN (a kernel must read only the path's rows); the caller's
    path (root first, as a decode step holds it) has out-of-range junk past count."""
    rng = np.random.default_rng(seed)
    x, parents, nn = _inputs(seed, b, m, hk, hv, dk, dv, ("deep", "random"), ragged=True)
    x = dict(x, k=np.asarray(jnp.asarray(x["k"], jnp.bfloat16).astype(jnp.float32)))
    _, f = closed_form(*_args(x), parents, nn)
    f = dataclasses.replace(f, k=jnp.asarray(x["k"], jnp.bfloat16))
    depth = np.asarray(tree_structure(parents, nn).depth)
    fits = [np.flatnonzero(depth[r, : nn[r]] < length) for r in range(b)]  # whole path in L rows
    accepted = np.array(
        [int(fits[0][np.argmax(depth[0, fits[0]])]), -1]
        + [int(rng.choice(fits[r])) for r in range(2, b)],
        np.int32,
    )
    walk, count = (np.asarray(a) for a in accepted_rows(parents, accepted, length))
    on_path = np.zeros((b, m), bool)
    for r in range(b):
        on_path[r, walk[r, : count[r]]] = True
    # Nothing accepted (-1, request 1): every row of that request is NaN, node 0 too, which a
    # clipped -1 names (each fold must zero or skip the rows past count 0, not weigh them by 0).
    nan = lambda a: jnp.where(
        on_path.reshape(on_path.shape + (1,) * (a.ndim - 2)),  # noqa
        a,
        jnp.nan,
    ).astype(a.dtype)
    f = TreeFactors(k=nan(f.k), u=nan(f.u), gamma=nan(f.gamma), k_scale=nan(f.k_scale))
    path = walk
    if callers_path:
        path = rng.integers(-3, m + 3, (b, length)).astype(np.int32)
        for r in range(b):
            path[r, : count[r]] = walk[r, : count[r]][::-1]
    return (
        PendingPath(
            factors=f, path=jnp.asarray(path), sel=jnp.asarray(accepted), count=jnp.asarray(count)
        ),
        x,
        parents,
        accepted,
    )


@pytest.mark.parametrize(
    "case", PATH_CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-r{c[3] // c[2]}-L{c[6]}-{c[8].fold}"
)
def test_kernel_with_pending_path_matches_reference(case):
    """A `PendingPath` (the previous verify's factors and accepted path, no gather) folds to
    commit_state's state at the accepted node, and o and the factors are the closed form's from
    it; the reference backend and the gathered rows agree; nothing pending (-1) leaves that
    request's state bit-exact."""
    m, n, hk, hv, dk, dv, length, callers_path, cfg = case
    seed = RUN_SEED
    b = 3
    pend, x_prev, parents_prev, accepted = _pending_path(
        seed, b, m, hk, hv, dk, dv, length, callers_path
    )
    x, parents, num_nodes = _inputs(
        seed + 1, b, n, hk, hv, dk, dv, ("random", "bushy"), ragged=True
    )
    f_prev = closed_form(*_args(x_prev), parents_prev)[1]
    s_ref = commit_state(
        x["state"], f_prev, parents_prev, accepted, backend="reference", precision="highest"
    )
    msg = f"seed {seed} cfg {cfg} accepted {accepted}"
    gathered = gather_pending_path(pend, backend="reference")
    assert rel(apply_pending(x["state"], gathered), s_ref) <= 1e-6, msg
    o_ref, f_ref = closed_form(*_args(x)[:5], s_ref, parents, num_nodes)
    for backend in ("pallas", "reference"):
        o, f, s = tree_gdn_verify(
            *_args(x), parents, num_nodes, backend=backend, interpret=True, config=cfg, pending=pend
        )
        bmsg = f"{backend}: {msg}"
        assert s.dtype == jnp.float32 and s.shape == x["state"].shape, bmsg
        assert rel(s, s_ref) <= 1e-6, bmsg
        np.testing.assert_array_equal(np.asarray(s)[1], x["state"][1], err_msg=bmsg)
        assert rel(o, o_ref) <= 1e-5, bmsg
        for name in FACTORS:
            assert rel(factor(f, name), factor(f_ref, name)) <= 2e-5, (name, bmsg)


def test_pending_path_gather_kernel_matches_reference():
    """gather_pending_path's Pallas gather (the Mosaic route's) = its XLA gathers, bit for bit,
    for the caller's root-first path with junk past count and nothing pending (-1)."""
    pend = _pending_path(RUN_SEED, 3, 20, 2, 4, 16, 32, 9, True)[0]
    want = gather_pending_path(pend, backend="reference")
    got = gather_pending_path(pend, backend="pallas", interpret=True)
    for name in ("k", "u", "w", "p_sel", "count"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, name)),
            np.asarray(getattr(want, name)),
            err_msg=f"{name} seed {RUN_SEED}",
        )
    np.testing.assert_array_equal(np.asarray(got.p_sel)[1], 1.0)


def test_bad_shapes_raise():
    x, parents, _ = _inputs(0, 1, 4, 2, 3, 16, 16, ("random",))
    with pytest.raises(ValueError, match="multiple of Hk"):
        tree_gdn_verify(*_args(x), parents)
    x, parents, _ = _inputs(0, 1, 4, 1, 2, 16, 16, ("random",))
    with pytest.raises(ValueError, match="heads_per_program"):
        tree_gdn_verify(
            *_args(x), parents, backend="pallas", config=TreeGDNConfig(heads_per_program=3)
        )
    pend = PendingCommit.empty(1, 3, 1, 16, 2, 8)  # dv 8 != 16
    with pytest.raises(ValueError, match="pending"):
        tree_gdn_verify(*_args(x), parents, backend="pallas", pending=pend)


# ------------------------------------------------------------------- Triton lowering (GPU IR)


@pytest.mark.parametrize(
    "n,cfg",
    [
        (8, TreeGDNConfig(block_v=64, num_warps=4)),
        (
            64,
            TreeGDNConfig(
                block_v=32,
                heads_per_program=2,
                inverse="squaring",
                bf16_qk=True,
                bf16_state=True,
                num_warps=8,
            ),
        ),
        (32, TreeGDNConfig(block_v=64, precision="tf32x3")),
        (32, TreeGDNConfig(block_v=64, bf16_state=True, precise_nodes=True, depth_bound=9)),
        (16, TreeGDNConfig(block_v=128, depth_bound=8, inverse="squaring", precision="highest")),
        (64, TreeGDNConfig(block_v=32, tiles_per_program=4, inverse="matrix", num_warps=8)),
    ],
)
def test_kernel_lowers_to_triton(n, cfg, d=128):
    """The kernel traces through the Pallas->Triton lowering (catches unsupported ops, non
    power-of-two blocks, non 2-D dots). Does not run Triton's own compiler."""
    b, hk, hv = 2, 2, 4
    q = jnp.zeros((b, n, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, n, hv, d), jnp.bfloat16)
    gate = jnp.zeros((b, n, hv), jnp.float32)
    state = jnp.zeros((b, hv, d, d), jnp.float32)
    parents = jnp.zeros((b, n), jnp.int32)
    fn = jax.jit(lambda *a: tree_gdn_verify(*a, backend="pallas", interpret=False, config=cfg))
    text = (
        fn.trace(q, q, v, gate, gate, state, parents).lower(lowering_platforms=("cuda",)).as_text()
    )
    assert "bole_tree_gdn" in text
    assert "output_operand_alias" not in text  # the plain verify has no state output


@pytest.mark.parametrize(
    "n,d,cfg",
    [
        (
            64,
            128,
            TreeGDNConfig(
                block_v=32,
                tiles_per_program=4,
                heads_per_program=2,
                inverse="matrix",
                bf16_qk=True,
                bf16_state=True,
                num_warps=8,
            ),
        ),
        (20, 100, TreeGDNConfig(block_v=32)),
        (
            64,
            128,
            TreeGDNConfig(
                block_v=128,
                num_warps=4,
                inverse="matrix",
                bf16_qk=True,
                bf16_state=True,
                fold="dot",
            ),
        ),
        (
            8,
            128,
            TreeGDNConfig(
                block_v=64,
                num_warps=2,
                inverse="matrix",
                bf16_qk=True,
                bf16_state=True,
                fold="unroll",
            ),
        ),
        # the measured table's lazy launches (unrolled folds with a depth bound, the loop at B > 4
        # with 8 nodes, the dot and the loop without a bound)
        (8, 128, TreeGDNConfig.auto(1, 8, 9)),
        (32, 128, TreeGDNConfig.auto(4, 32, 9)),
        (16, 128, TreeGDNConfig.auto(16, 16, 9)),
        (8, 128, TreeGDNConfig.auto(16, 8, 9)),
        (32, 128, TreeGDNConfig.auto(4, 32)),
        (16, 128, TreeGDNConfig.auto(16, 16)),
    ],
)
def test_kernel_with_pending_lowers_to_triton(n, d, cfg):
    """The folding variant lowers for cuda, its state output aliases the state input, and a jit
    that donates the state hands that buffer to the output (the in-place fold)."""
    _lowered_with_pending(n, d, cfg, PendingCommit.empty(2, 5, 2, d, 4, d))


@pytest.mark.parametrize(
    "n,cfg",
    [
        (32, TreeGDNConfig.auto(1, 32, 9)),
        (16, TreeGDNConfig.auto(4, 16, 9)),
        (16, TreeGDNConfig.auto(1, 16, 9)),  # the state prefetched as well
        (16, TreeGDNConfig.auto(16, 16, 9)),
        (32, TreeGDNConfig.auto(16, 32, 9)),
        (
            8,
            TreeGDNConfig(
                block_v=64,
                num_warps=2,
                inverse="matrix",
                bf16_qk=True,
                bf16_state=True,
                fold="unroll",
            ),
        ),
        (32, dataclasses.replace(TreeGDNConfig.auto(1, 32, 9), prefetch_fold=True)),
        (16, dataclasses.replace(TreeGDNConfig.auto(4, 16, 9), fold="unroll", prefetch_fold=True)),
    ],
)
def test_kernel_with_pending_path_lowers_to_triton(n, cfg):
    """The variant that reads a `PendingPath` (indirect row loads at the path's node ids)
    lowers for cuda at Qwen3-Next head dims, its state output aliased to the donated state, and
    no gather launch beside it."""
    text = _lowered_with_pending(n, 128, cfg, PendingPath.empty(2, n, 9, 2, 128, 4, 128))
    assert "bole_pending_gather" not in text


def _lowered_with_pending(n, d, cfg, pend):
    """The cuda lowering text of a state-donating jitted verify (B 2, Hk 2, HV 4, bf16 q/k/v)
    folding `pend`; checks the kernel's state output aliases the donated state."""
    b, hk, hv = 2, 2, 4
    q = jnp.zeros((b, n, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, n, hv, d), jnp.bfloat16)
    gate = jnp.zeros((b, n, hv), jnp.float32)
    state = jnp.zeros((b, hv, d, d), jnp.float32)
    parents = jnp.zeros((b, n), jnp.int32)
    fn = jax.jit(
        lambda *a: tree_gdn_verify(
            *a[:7], backend="pallas", interpret=False, config=cfg, pending=a[7]
        ),
        donate_argnums=5,
    )
    text = (
        fn.trace(q, q, v, gate, gate, state, parents, pend)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "bole_tree_gdn" in text and "output_operand_alias" in text
    assert "tf.aliasing_output = 5" in text  # outputs: o, k, u, gamma, k_scale, state
    return text


def test_prefetch_state_needs_one_tile():
    x, parents, num_nodes = _inputs(RUN_SEED, 1, 4, 1, 2, 16, 32, ("random",))
    for cfg in (
        TreeGDNConfig(block_v=16, tiles_per_program=2, prefetch_state=True),
        TreeGDNConfig(block_v=16, heads_per_program=2, prefetch_state=True),
        TreeGDNConfig(block_v=16, tiles_per_program=2, prefetch_fold=True, fold="dot"),
    ):
        with pytest.raises(ValueError, match="prefetch_state / prefetch_fold"):
            tree_gdn_verify(
                *_args(x), parents, num_nodes, backend="pallas", interpret=True, config=cfg
            )
    with pytest.raises(ValueError, match="prefetch_fold needs fold"):
        tree_gdn_verify(
            *_args(x),
            parents,
            num_nodes,
            backend="pallas",
            interpret=True,
            config=TreeGDNConfig(block_v=16, prefetch_fold=True),
        )


@pytest.mark.parametrize("d", [128, 64, 32])
def test_auto_configs_are_legal(d):
    """Every launch of the measured table is accepted by the wrapper and lowers for cuda, at
    Qwen3-Next's head size and at narrower heads (the demo model's 64: the table's two 64-column
    tiles per program at B > 4 above 16 nodes were refused there)."""
    for b in (1, 4, 16, 64):
        for n in (1, 8, 24, 33, 64, 128):
            test_kernel_lowers_to_triton(n, TreeGDNConfig.auto(b, n, dv=d), d)
    assert TreeGDNConfig.auto(16, 32, dv=64).tiles_per_program == 1
    assert TreeGDNConfig.auto(16, 32, dv=128).tiles_per_program == 2


def test_auto_operand_dtype_switch():
    """KernelOptions(tree_gdn_bf16=False) keeps the measured launch shapes with fp32 operands;
    the default is bf16 operands."""
    for b, n in ((1, 64), (16, 64), (64, 8)):
        fast = TreeGDNConfig.auto(b, n, 9)
        assert fast.bf16_qk and fast.bf16_state and fast.depth_bound == 9
        strict = TreeGDNConfig.auto(b, n, 9, KernelOptions(tree_gdn_bf16=False))
        assert not strict.bf16_qk and not strict.bf16_state
        assert dataclasses.replace(strict, bf16_qk=True, bf16_state=True) == fast
    # the lazy folds measured fastest (docs/kernels.md, launch table). Without a depth bound:
    # the TF32x3 dot at B <= 4, the loop above. With a decode step's: unrolled, its loads
    # issued first at B <= 4; the loop above B = 4 at 8 nodes.
    assert [TreeGDNConfig.auto(b, 16).fold for b in (1, 4, 16, 64)] == [
        "dot",
        "dot",
        "loop",
        "loop",
    ]
    got = [
        (TreeGDNConfig.auto(b, n, 9).fold, TreeGDNConfig.auto(b, n, 9).prefetch_fold)
        for b, n in ((1, 8), (4, 32), (16, 8), (16, 16), (64, 64), (1, 128))
    ]
    assert got == [
        ("unroll", True),
        ("unroll", True),
        ("loop", False),
        ("unroll", False),
        ("unroll", False),
        ("unroll", False),
    ]
    assert TreeGDNConfig.auto(4, 16, 17).fold == "dot"  # too many rows to unroll
    # the state tile loaded first: measured faster at B = 1 up to 16 nodes only
    assert [
        TreeGDNConfig.auto(b, n, 9).prefetch_state
        for b, n in ((1, 8), (1, 16), (1, 32), (4, 8), (4, 16))
    ] == [True, True, False, False, False]


def test_mosaic_launch_where_measured_faster(monkeypatch):
    """`mosaic_launch`: the Mosaic GPU verify only for bf16 v, dk = dv = 128, 64 nodes, a
    static depth bound, the bf16-operand family, both options on and a jax that has it."""
    import bole_jax.pallas.tree_gdn as tg

    monkeypatch.setattr(tg.tree_gdn_mgpu, "AVAILABLE", True)
    bf = jnp.bfloat16
    want = dict(block_v=64, inverse="squaring", products=1, approx_math=True, auto_barriers=False)
    for b in (1, 4, 16, 64):
        assert tg.mosaic_launch(b, 64, 128, 128, bf, 9) == want
    for args in (
        (1, 32, 128, 128, bf, 9),
        (4, 33, 128, 128, bf, 9),
        (64, 48, 128, 128, bf, 9),
        (1, 63, 128, 128, bf, 9),
        (1, 65, 128, 128, bf, 9),
        (1, 64, 64, 128, bf, 9),
        (1, 64, 128, 64, bf, 9),
        (1, 64, 128, 128, jnp.float32, 9),
        (1, 64, 128, 128, bf, None),
    ):
        assert tg.mosaic_launch(*args) is None, args
    for off in (KernelOptions(mosaic=False), KernelOptions(tree_gdn_bf16=False)):
        assert tg.mosaic_launch(1, 64, 128, 128, bf, 9, off) is None, off
    monkeypatch.setattr(tg.tree_gdn_mgpu, "AVAILABLE", False)
    assert tg.mosaic_launch(1, 64, 128, 128, bf, 9) is None


def test_auto_verify_dispatches_to_mosaic(monkeypatch):
    """On a device (interpret off, no config) tree_gdn_verify hands a point that
    `mosaic_launch` takes to the Mosaic kernel with that launch, the tree, the bound and the
    pending commit (the lazy verify); with interpret mode, a config or
    KernelOptions(mosaic=False) it stays on the Triton kernel."""
    import bole_jax.pallas.tree_gdn as tg

    monkeypatch.setattr(tg.tree_gdn_mgpu, "AVAILABLE", True)
    calls = []

    def spy(*args, **kw):
        calls.append(kw)
        return "mosaic"

    monkeypatch.setattr(tg.tree_gdn_mgpu, "tree_gdn_verify_mgpu", spy)
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, 2, 64, ("random",), ragged=True)
    x = random_gdn_inputs(rng, 2, 64, 1, 2, 128, 128, jnp.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], parents, num_nodes)
    tree = tree_structure(parents, num_nodes)
    assert (
        tree_gdn_verify(*args, backend="pallas", interpret=False, tree=tree, depth_bound=9)
        == "mosaic"
    )
    launch = dict(
        depth_bound=9,
        scale=128**-0.5,
        tree=tree,
        interpret=False,
        block_v=64,
        inverse="squaring",
        products=1,
        approx_math=True,
        auto_barriers=False,
    )
    assert calls == [dict(launch, pending=None)]
    _, f_prev = ref.tree_gdn_closed_form(*args, tree=tree)
    pend = pending_commit(f_prev, parents, np.array([5, 0], np.int32), 9)
    assert (
        tree_gdn_verify(
            *args, backend="pallas", interpret=False, tree=tree, depth_bound=9, pending=pend
        )
        == "mosaic"
    )
    assert len(calls) == 2 and calls[1].pop("pending") is pend and calls[1] == launch
    o, _ = tree_gdn_verify(*args, backend="pallas", interpret=True, tree=tree, depth_bound=9)
    assert len(calls) == 2 and o.shape == x["v"].shape
    monkeypatch.setattr(tg, "_tree_gdn_pallas", lambda *a, **kw: ("triton",) * 5)
    assert (
        tree_gdn_verify(
            *args,
            backend="pallas",
            interpret=False,
            tree=tree,
            depth_bound=9,
            config=TreeGDNConfig.auto(2, 64, 9),
            pending=pend,
        )[0]
        == "triton"
    )
    assert (
        tree_gdn_verify(
            *args,
            backend="pallas",
            interpret=False,
            tree=tree,
            depth_bound=9,
            options=KernelOptions(mosaic=False),
        )[0]
        == "triton"
    )
    assert len(calls) == 2
    assert len(calls) == 2
