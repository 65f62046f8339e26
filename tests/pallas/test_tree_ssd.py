"""Tree SSD (Mamba2) verify: closed form vs the per-branch recurrence, Pallas kernel vs reference,
commit at every node, the Mamba2 operand mapping.

CPU only: the kernel runs in Pallas interpret mode (fp32 dots, so tolerances are tight), and a
lowering test builds the Triton IR for the GPU. Random inputs are fresh every run (the seed is in
every failure message) plus a fixed seed. Kept small: CI runs it on 2 cores.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_ssd_ref as ref
from bole_jax.pallas.testing import random_gdn_inputs, random_trees
from bole_jax.pallas.tree_gdn_commit import commit_state
from bole_jax.pallas.tree_ssd import TreeSSDConfig, tree_ssd_verify
from bole_jax.pallas.tree_utils import tree_structure

jax.config.update("jax_default_matmul_precision", "highest")

SEEDS = [0, RUN_SEED]


def rel(a, b):
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, batch, n, hk, hv, dk, dv, kinds, ragged=True, dtype=np.float32):
    """(args (q, k, v, a, state), parents, num_nodes). The GDN generator's q, k, v, g, state;
    q, k scaled by dk^-1/4 so that q.k is O(1), as Mamba2's C.B."""
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, batch, n, kinds, ragged=ragged)
    x = random_gdn_inputs(rng, batch, n, hk, hv, dk, dv, dtype)
    s = dk**-0.25
    q, k = (np.asarray(jnp.asarray(x[c], jnp.float32) * s).astype(x[c].dtype) for c in "qk")
    return (q, k, x["v"], x["g"], x["state"]), parents, num_nodes


def _case_id(case):
    n, hk, hv, dk, dv = case[:5]
    return f"N{n}-r{hv // hk}-{dk}x{dv}"


def _valid(num_nodes, n):
    return np.arange(n)[None, :] < np.asarray(num_nodes)[:, None]


# ------------------------------------------------------- closed form vs sequential recurrence

# (N, Hk, HV, dk, dv, tree kinds): N in {1, 2, 7, 16, 64}, HV/Hk in {1, 2, 3, 4}, dk, dv in
# {16, 64}; chains, stars, deep, bushy, forests; every batch ragged. Shapes are shared with the
# kernel and commit tests where possible: interpret-mode compiles dominate this file's time.
SHAPE_16 = (16, 2, 4, 16, 64)
SHAPE_64 = (64, 1, 4, 64, 64)
REF_CASES = [
    (1, 1, 1, 16, 16, ("random",)),
    (2, 1, 2, 16, 64, ("chain", "forest")),
    (7, 1, 3, 64, 16, ("star", "deep", "random")),
    SHAPE_16 + (("bushy", "forest", "chain"),),
    SHAPE_64 + (("random", "deep", "star"),),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", REF_CASES, ids=_case_id)
def test_closed_form_matches_sequential(case, seed):
    n, hk, hv, dk, dv, kinds = case
    args, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds)
    o_seq, states = ref.tree_ssd_sequential(*args, parents, num_nodes)
    tree = tree_structure(parents, num_nodes)
    o, f = ref.tree_ssd_closed_form(*args, parents, num_nodes, tree)
    o, o_seq = np.asarray(o), np.asarray(o_seq)
    msg = f"seed {seed}"
    assert rel(o, o_seq) <= 1e-4, msg
    rebuilt, states = np.asarray(ref.node_states_from_factors(args[4], f, tree)), np.asarray(states)
    m = _valid(num_nodes, n)
    for b, i in zip(*np.nonzero(m)):  # every node alone: a small state must not hide
        assert rel(rebuilt[b, i], states[b, i]) <= 1e-4, f"{msg} node ({b}, {i})"
        assert rel(o[b, i], o_seq[b, i]) <= 1e-4, f"{msg} output of node ({b}, {i})"
    for arr in (o, f.k, f.u, f.gamma, rebuilt):
        assert not np.any(np.asarray(arr)[~m]), f"padding not zero: {msg}"


def test_commit_every_accepted_node():
    """commit (reference einsum and the Pallas commit, interpret mode) for every possible accepted
    node of ragged trees and forests, and -1, against the recurrence's state."""
    seed = RUN_SEED
    n = SHAPE_16[0]
    args, parents, num_nodes = _inputs(seed, 3, *SHAPE_16, ("chain", "star", "forest"))
    _, states = ref.tree_ssd_sequential(*args, parents, num_nodes)
    _, f = ref.tree_ssd_closed_form(*args, parents, num_nodes)
    # One call covers every (request, accepted node): the batch repeated once per choice.
    sel = np.arange(-1, n)
    rep = lambda x: np.repeat(np.asarray(x), len(sel), axis=0)  # noqa: E731
    acc = np.minimum(np.tile(sel, 3), rep(num_nodes) - 1).astype(np.int32)
    fr = jax.tree_util.tree_map(rep, f)
    states, s_pre = np.asarray(states), args[4]
    want = np.where(
        (acc >= 0)[:, None, None, None],
        rep(states)[np.arange(len(acc)), np.maximum(acc, 0)],
        rep(s_pre),
    )
    q, k, v, a, _ = args
    ratio = SHAPE_16[2] // SHAPE_16[1]
    for name, new in (
        ("commit", ref.commit(rep(s_pre), fr, rep(parents), acc)),
        (
            "pallas commit",
            commit_state(
                rep(s_pre), fr, rep(parents), acc, backend="pallas", interpret=True, block_v=64
            ),
        ),
    ):
        new = np.asarray(new)
        for r in range(len(acc)):
            b = r // len(sel)
            msg = f"{name} seed {seed} request {b} accepted {acc[r]}"
            assert rel(new[r], want[r]) <= 1e-4, msg
            if acc[r] < 0:  # nothing accepted: the state is kept bit for bit
                np.testing.assert_array_equal(new[r], s_pre[b], err_msg=msg)
            if acc[r] == 0:  # the root only (node 0 always hangs off S_pre)
                for h in range(SHAPE_16[2]):
                    root = np.exp(a[b, 0, h]) * s_pre[b, h] + np.outer(
                        k[b, 0, h // ratio], v[b, 0, h]
                    )
                    assert rel(new[r, h], root) <= 1e-6, msg


# ---------------------------------------------------------------- Pallas kernel vs reference

KERNEL_CASES = [
    # N, Hk, HV, dk, dv, kinds, dtype, config
    (1, 1, 2, 16, 16, ("random",), np.float32, TreeSSDConfig(block_v=16)),
    (7, 1, 3, 64, 16, ("star", "deep", "random"), jnp.bfloat16, TreeSSDConfig(heads_per_program=3)),
    SHAPE_16 + (("bushy", "forest"), np.float32, TreeSSDConfig(block_v=32)),
    (
        20,
        1,
        2,
        24,
        40,
        ("random", "forest", "chain"),
        np.float32,  # padded dk, dv
        TreeSSDConfig(heads_per_program=2),
    ),
    SHAPE_64 + (("random", "deep"), np.float32, TreeSSDConfig(block_v=32)),
]
PADDED_CASE = KERNEL_CASES[3]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    n, hk, hv, dk, dv, kinds, dtype, cfg = case
    seed = RUN_SEED
    args, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, kinds, dtype=dtype)
    tree = tree_structure(parents, num_nodes)
    o_ref, f_ref = tree_ssd_verify(*args, parents, num_nodes, tree=tree, backend="reference")
    o, f = tree_ssd_verify(
        *args, parents, num_nodes, tree=tree, backend="pallas", interpret=True, config=cfg
    )
    msg = f"seed {seed} cfg {cfg}"
    assert o.dtype == args[2].dtype and o.shape == o_ref.shape, msg
    assert rel(o, o_ref) <= (1e-5 if dtype == np.float32 else 1e-2), msg  # bf16: o is rounded
    for name in ("k", "u", "gamma"):
        got, want = getattr(f, name), getattr(f_ref, name)
        assert got.dtype == jnp.float32 and got.shape == want.shape, (name, msg)
        assert rel(got, want) <= 1e-6, (name, msg)
    m = _valid(num_nodes, n)
    for arr in (o, f.k, f.u, f.gamma):
        assert not np.any(np.asarray(arr, np.float32)[~m]), f"padding not zero: {msg}"


def test_padding_nodes_change_nothing():
    """NaN in the padding rows of a ragged batch changes no result of the kernel (bit for bit),
    and the most padded request gets what the reference gives it alone, without padding."""
    seed = RUN_SEED
    n, hk, hv, dk, dv, _, _, cfg = PADDED_CASE  # its kernel is compiled already
    args, parents, num_nodes = _inputs(seed, 3, n, hk, hv, dk, dv, ("deep", "forest", "star"))
    m = _valid(num_nodes, n)
    dirty = [np.array(x) for x in args]
    for x in dirty[:4]:
        x[~m] = np.nan
    o, f = tree_ssd_verify(*dirty, parents, num_nodes, backend="pallas", interpret=True, config=cfg)
    o_clean, _ = tree_ssd_verify(
        *args, parents, num_nodes, backend="pallas", interpret=True, config=cfg
    )
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (o, f.k, f.u, f.gamma)), seed
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_clean), err_msg=f"seed {seed}")
    b = int(np.argmin(num_nodes))  # the most padded request, alone and unpadded
    nb = int(num_nodes[b])
    one = [x[b : b + 1, :nb] for x in args[:4]] + [args[4][b : b + 1]]
    o1, f1 = ref.tree_ssd_closed_form(*one, parents[b : b + 1, :nb])
    msg = f"seed {seed} request {b} num_nodes {nb}"
    assert rel(o[b, :nb], o1[0]) <= 1e-5, msg
    assert rel(f.gamma[b, :nb], f1.gamma[0]) <= 1e-6, msg


def test_auto_backend_and_bad_inputs():
    args, parents, num_nodes = _inputs(RUN_SEED, 3, *REF_CASES[2])  # compiled already
    tree = tree_structure(parents, num_nodes)
    o_auto, _ = tree_ssd_verify(*args, parents, num_nodes, tree=tree)  # "auto": reference on CPU
    o_ref, _ = ref.tree_ssd_closed_form(*args, parents, num_nodes, tree)
    np.testing.assert_array_equal(np.asarray(o_auto), np.asarray(o_ref))
    q, k, v, a, s = args
    with pytest.raises(ValueError, match="multiple of Hk"):
        tree_ssd_verify(q.repeat(2, axis=2), k.repeat(2, axis=2), v, a, s, parents)
    with pytest.raises(ValueError, match=r"a \("):
        tree_ssd_verify(q, k, v, a[:, :, :1], s, parents)
    with pytest.raises(ValueError, match="heads_per_program"):  # HV / Hk = 3
        tree_ssd_verify(
            *args,
            parents,
            num_nodes,
            tree=tree,
            backend="pallas",
            config=TreeSSDConfig(heads_per_program=2),
        )
    with pytest.raises(ValueError, match="N <= 128"):
        big, bp, _ = _inputs(0, 1, 129, 1, 1, 16, 16, ("chain",), ragged=False)
        tree_ssd_verify(*big, bp, backend="pallas")


# ------------------------------------------------------------------------- Mamba2 mapping


def test_mamba2_mapping_per_branch():
    """The documented mapping q = C, k = B, v = dt x, a = dt A, with D x added outside, gives on
    every node what Mamba2's own recurrence gives along that node's root path (numpy, fp64,
    Mamba2's layout h [nheads, headdim, d_state])."""
    rng = np.random.default_rng(RUN_SEED)
    bt = 3
    n, groups, heads, dstate, headdim = SHAPE_16  # the kernel of that shape is compiled already
    parents, num_nodes = random_trees(rng, bt, n, ("forest", "random"), ragged=True)
    x = rng.standard_normal((bt, n, heads, headdim)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((bt, n, heads)) - 2.0)).astype(np.float32)
    A = -np.exp(rng.uniform(0.0, 2.5, heads)).astype(np.float32)
    B, C = (rng.standard_normal((bt, n, groups, dstate)).astype(np.float32) / 4 for _ in "BC")
    D = rng.standard_normal(heads).astype(np.float32)
    h0 = rng.standard_normal((bt, heads, headdim, dstate)).astype(np.float32)

    q, k, v, a = ref.from_mamba2(x, dt, A, B, C)
    state = np.swapaxes(h0, -1, -2)  # Mamba2's h is S^T
    o, f = tree_ssd_verify(
        q,
        k,
        v,
        a,
        state,
        parents,
        num_nodes,
        backend="pallas",
        interpret=True,
        config=KERNEL_CASES[2][-1],
    )
    y = np.asarray(o) + D[:, None] * x
    grp = np.arange(heads) // (heads // groups)

    def mamba2_state(b, i):
        """h after node i, token by token along its root path (selective_state_update)."""
        path = []
        while i >= 0:
            path.append(i)
            i = parents[b, i]
        h = h0[b].astype(np.float64)
        for t in path[::-1]:
            dA = np.exp(dt[b, t] * A)[:, None, None]
            dBx = (dt[b, t][:, None] * x[b, t])[:, :, None] * B[b, t, grp][:, None, :]
            h = h * dA + dBx
        return h

    for b in range(bt):
        for i in range(int(num_nodes[b])):
            want = np.einsum("hpn,hn->hp", mamba2_state(b, i), C[b, i, grp]) + D[:, None] * x[b, i]
            assert rel(y[b, i], want) <= 1e-5, f"seed {RUN_SEED} node ({b}, {i})"
    acc = (num_nodes - 1).astype(np.int32)  # commit: the state Mamba2 reaches, transposed
    new = np.asarray(ref.commit(state, f, parents, acc))
    for b in range(bt):
        got = np.swapaxes(new[b], -1, -2)
        assert rel(got, mamba2_state(b, int(acc[b]))) <= 1e-5, f"seed {RUN_SEED} request {b}"


# ------------------------------------------------------------------- Triton lowering (GPU IR)


@pytest.mark.parametrize(
    "n,hg,cfg",
    [
        (8, 1, TreeSSDConfig(num_warps=4)),
        (64, 2, TreeSSDConfig(block_v=32, heads_per_program=2, precision="tf32x3", num_warps=8)),
    ],
)
def test_kernel_lowers_to_triton(n, hg, cfg):
    """The kernel traces through the Pallas->Triton lowering (unsupported ops, non power-of-two
    blocks, non 2-D dots). Does not run Triton's own compiler. Mamba2 dims: dk 128, dv 64."""
    b, hk, hv = 2, 2, 8
    q = jnp.zeros((b, n, hk, 128), jnp.bfloat16)
    v = jnp.zeros((b, n, hv, 64), jnp.bfloat16)
    a = jnp.zeros((b, n, hv), jnp.float32)
    state = jnp.zeros((b, hv, 128, 64), jnp.float32)
    parents = jnp.zeros((b, n), jnp.int32)
    fn = jax.jit(lambda *x: tree_ssd_verify(*x, backend="pallas", interpret=False, config=cfg))
    text = fn.trace(q, q, v, a, state, parents).lower(lowering_platforms=("cuda",)).as_text()
    assert "bole_tree_ssd" in text
