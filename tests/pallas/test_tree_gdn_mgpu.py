"""The Mosaic GPU tree verify (`pallas/tree_gdn_mgpu.py`) vs the jnp closed form, in
Mosaic GPU interpret mode on the CPU. Needs jax >= 0.11 (the GPU image's version); skipped under
0.10.2, whose interpret mode cannot run the kernel (docs/kernels.md section 2b)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_gdn_mgpu, tree_gdn_ref
from bole_jax.pallas.factors import PendingCommit
from bole_jax.pallas.testing import random_gdn_inputs, random_trees
from bole_jax.pallas.tree_gdn_commit import apply_pending, pending_commit
from bole_jax.pallas.tree_utils import tree_structure

pytestmark = pytest.mark.skipif(
    not tree_gdn_mgpu.AVAILABLE, reason=tree_gdn_mgpu.UNAVAILABLE_REASON or "unavailable"
)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize(
    "n,hk,hv,kinds,ragged,block_v,inverse,products",
    [
        (64, 1, 2, ("random",), False, 128, "neumann", 3),
        (64, 2, 2, ("deep", "bushy"), True, 64, "neumann", 3),
        (16, 1, 3, ("star", "forest"), True, 128, "neumann", 3),
        (7, 1, 1, ("random", "deep"), True, 64, "neumann", 3),
        (1, 1, 2, ("random",), False, 128, "neumann", 3),
        (33, 2, 4, ("random",), True, 64, "neumann", 3),
        (64, 1, 2, ("deep", "random"), True, 128, "squaring", 3),
        (20, 1, 2, ("chain", "bushy"), True, 64, "squaring", 3),
        (5, 1, 1, ("star",), False, 64, "squaring", 3),
        (33, 4, 12, ("random", "bushy"), True, 64, "squaring", 3),  # gates in two 8-head boxes
        # fewer bf16 products per fp32 one: the left operand (2), then both (1) rounded to bf16
        (64, 1, 2, ("deep", "bushy"), True, 64, "squaring", 2),
        (48, 2, 4, ("random", "chain"), True, 128, "squaring", 2),
        (64, 1, 2, ("random", "deep"), True, 64, "neumann", 2),
        (40, 1, 2, ("bushy", "deep"), True, 64, "squaring", 1),
        (64, 1, 1, ("random",), False, 64, "neumann", 1),
    ],
)
def test_mgpu_verify_matches_closed_form(n, hk, hv, kinds, ragged, block_v, inverse, products):
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, 2, n, kinds, ragged=ragged)
    x = random_gdn_inputs(rng, 2, n, hk, hv, 128, 128, jnp.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    if ragged:  # garbage in padding nodes must not leak
        pad = np.arange(n)[None, :] >= num_nodes[:, None]
        args = (
            jnp.where(pad[:, :, None, None], jnp.nan, args[0]),
            jnp.where(pad[:, :, None, None], jnp.inf, args[1]),
            jnp.where(pad[:, :, None, None], jnp.inf, args[2]),
            jnp.where(pad[:, :, None], -jnp.inf, args[3]),
            jnp.where(pad[:, :, None], jnp.inf, args[4]),
            args[5],
        )
    o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes)
    depth = max(1, int(np.max(tree_structure(parents, num_nodes).path_len)))
    o, f = tree_gdn_mgpu.tree_gdn_verify_mgpu(
        *args,
        parents,
        num_nodes,
        depth_bound=depth,
        block_v=block_v,
        inverse=inverse,
        products=products,
        interpret=True,
    )
    msg = f"seed {RUN_SEED} block_v {block_v} {inverse} products {products} depth {depth}"
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype, msg
    assert rel(o, o_ref) <= 1e-2, msg  # bf16 output rounding
    # bf16 operands; u's error, measured (random trees, N = 64): 0.95e-4 / 1.24e-4 / 1.40e-4
    # at 3 / 2 / 1 products (the Triton verify's: 1.1-2.3e-4 at B = 1-64)
    assert rel(f.u, f_ref.u) <= 1e-3, msg
    assert rel(f.keys(), f_ref.keys()) <= 1e-6 and rel(f.gamma, f_ref.gamma) <= 1e-6, msg
    assert rel(f.k_scale, f_ref.k_scale) <= 1e-6, msg
    if ragged:
        m = np.arange(n)[None, :] < num_nodes[:, None]
        assert not np.any(np.asarray(f.u)[~m]) and not np.any(np.asarray(o, np.float32)[~m]), msg


def test_mgpu_verify_too_deep_is_nan_and_bad_shapes_raise():
    rng = np.random.default_rng(RUN_SEED)
    parents = np.stack([np.arange(8) - 1, np.r_[-1, np.zeros(7, int)]]).astype(np.int32)
    x = random_gdn_inputs(rng, 2, 8, 1, 2, 128, 128, jnp.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*args, parents)
    for inverse in ("neumann", "squaring"):
        o, f = tree_gdn_mgpu.tree_gdn_verify_mgpu(
            *args, parents, depth_bound=2, inverse=inverse, interpret=True
        )
        assert np.all(np.isnan(np.asarray(f.u[0]))), "a chain of 8 is deeper than the bound 2"
        assert np.all(np.isnan(np.asarray(o[0], np.float32)))
        assert rel(f.keys(), f_ref.keys()) <= 1e-6 and rel(f.gamma, f_ref.gamma) <= 1e-6  # exact
        assert rel(f.u[1], f_ref.u[1]) <= 1e-3, "the star (2 levels) fits the bound"
    with pytest.raises(ValueError, match="dk = dv"):
        y = random_gdn_inputs(rng, 1, 8, 1, 1, 64, 128, jnp.bfloat16)
        tree_gdn_mgpu.tree_gdn_verify_mgpu(
            y["q"], y["k"], y["v"], y["g"], y["beta"], y["state"], parents[:1], depth_bound=8
        )
    with pytest.raises(ValueError, match="block_v"):
        tree_gdn_mgpu.tree_gdn_verify_mgpu(*args, parents, depth_bound=8, block_v=32)
    with pytest.raises(ValueError, match="inverse"):
        tree_gdn_mgpu.tree_gdn_verify_mgpu(*args, parents, depth_bound=8, inverse="solve")
    with pytest.raises(ValueError, match="products"):
        tree_gdn_mgpu.tree_gdn_verify_mgpu(*args, parents, depth_bound=8, products=4)
    with pytest.raises(ValueError, match="nodes"):
        y = random_gdn_inputs(rng, 1, 65, 1, 1, 128, 128, jnp.bfloat16)
        tree_gdn_mgpu.tree_gdn_verify_mgpu(
            y["q"],
            y["k"],
            y["v"],
            y["g"],
            y["beta"],
            y["state"],
            np.arange(65)[None] - 1,
            depth_bound=8,
        )


def _pending(x, parents, num_nodes, length):
    """The lazy commit a previous verify of inputs x leaves: request 0 accepted a deep node
    (its path up to `length` rows), request 1 only its root (count 1)."""
    _, f_prev = tree_gdn_ref.tree_gdn_closed_form(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], parents, num_nodes
    )
    accepted = np.array([min(length - 1, int(num_nodes[0]) - 1), 0], np.int32)
    return pending_commit(f_prev, parents, accepted, length)


@pytest.mark.parametrize(
    "n,hk,hv,block_v,products,length",
    [
        (24, 1, 2, 64, 1, 9),
        (40, 2, 4, 128, 3, 5),
        (64, 1, 12, 64, 1, 9),  # the weights in two 8-head boxes
    ],
)
def test_mgpu_verify_folds_a_pending_commit(n, hk, hv, block_v, products, length):
    """The lazy commit: the verify folds the previous step's path rows into the state it loads
    (p_sel S + sum_{m < count} w_m k_m u_m^T, fp32), verifies from it and returns it. One
    request accepts a deep node, one only its root (count 1); rows past the count hold NaN,
    which must not leak."""
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, 2, n, ("deep", "random"), ragged=True)
    x = random_gdn_inputs(rng, 2, n, hk, hv, 128, 128, jnp.bfloat16)
    state = x["state"]
    pend = _pending(x, parents, num_nodes, length)
    want_state = apply_pending(state, pend)
    pad = np.arange(length)[None, :] >= np.asarray(pend.count)[:, None]
    pend = PendingCommit(
        k=jnp.where(pad[:, :, None, None], jnp.nan, pend.k),
        u=jnp.where(pad[:, :, None, None], jnp.nan, pend.u),
        w=jnp.where(pad[:, :, None], jnp.nan, pend.w),
        p_sel=pend.p_sel,
        count=pend.count,
    )
    y = random_gdn_inputs(rng, 2, n, hk, hv, 128, 128, jnp.bfloat16)
    args = (y["q"], y["k"], y["v"], y["g"], y["beta"])
    o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*args, want_state, parents, num_nodes)
    depth = max(1, int(np.max(tree_structure(parents, num_nodes).path_len)))
    o, f, new_state = tree_gdn_mgpu.tree_gdn_verify_mgpu(
        *args,
        state,
        parents,
        num_nodes,
        depth_bound=depth,
        block_v=block_v,
        inverse="squaring",
        products=products,
        pending=pend,
        interpret=True,
    )
    msg = f"seed {RUN_SEED} counts {np.asarray(pend.count)}"
    assert pad.any(), msg  # (rows past the count exist: their NaN is tested)
    assert new_state.shape == state.shape and new_state.dtype == jnp.float32
    assert rel(new_state, want_state) <= 1e-6, msg  # fp32 rank-1 updates
    assert rel(o, o_ref) <= 1e-2 and rel(f.u, f_ref.u) <= 1e-3, msg
    with pytest.raises(ValueError, match="pending rows"):
        bad = PendingCommit(
            k=pend.k, u=pend.u[:, :, :1], w=pend.w, p_sel=pend.p_sel, count=pend.count
        )
        tree_gdn_mgpu.tree_gdn_verify_mgpu(
            *args, state, parents, num_nodes, depth_bound=depth, pending=bad, interpret=True
        )


@pytest.mark.parametrize(
    "n,inverse,products,pending_rows",
    [(64, "squaring", 1, 0), (40, "neumann", 3, 0), (64, "squaring", 1, 9)],
)
def test_mgpu_verify_own_barriers_match_automatic_ones(n, inverse, products, pending_rows):
    """auto_barriers=False (the kernel's own warpgroup barriers instead of Pallas's around
    every store) computes the same thing: outputs equal to the automatic-barrier launch's bit
    for bit, and close to the reference. (Interpret mode runs a warpgroup as one thread, so it
    cannot see a race between its warps: the GPU check is bench_tree_gdn_mgpu.py
    --repeat-check, which calls the launch repeatedly and compares bit for bit.)"""
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, 2, n, ("deep", "bushy"), ragged=True)
    x = random_gdn_inputs(rng, 2, n, 1, 2, 128, 128, jnp.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    pend = _pending(x, parents, num_nodes, pending_rows) if pending_rows else None
    depth = max(1, int(np.max(tree_structure(parents, num_nodes).path_len)))
    outs = [
        jax.tree.leaves(
            tree_gdn_mgpu.tree_gdn_verify_mgpu(
                *args,
                parents,
                num_nodes,
                depth_bound=depth,
                block_v=64,
                inverse=inverse,
                products=products,
                pending=pend,
                auto_barriers=auto,
                interpret=True,
            )
        )
        for auto in (True, False)
    ]
    msg = f"seed {RUN_SEED} {inverse} products {products} pending {pending_rows}"
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)
    if not pending_rows:
        o_ref, f_ref = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes)
        assert rel(outs[1][0], o_ref) <= 1e-2, msg


def _smem_estimates():
    """Pallas's shared-memory estimate of each Mosaic kernel lowered inside the block (bytes),
    read by wrapping its private estimator; None where this jax has no such hook."""
    try:
        from jax._src.pallas.mosaic_gpu import lowering

        orig = lowering._estimate_resources
    except (ImportError, AttributeError):
        return None, None
    depth, found = [0], []

    def wrapped(ctx, jaxpr):
        depth[0] += 1
        try:
            res = orig(ctx, jaxpr)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            found.append(int(res.smem_scratch_bytes))
        return res

    def restore():
        lowering._estimate_resources = orig

    lowering._estimate_resources = wrapped
    return found, restore


# (hk, hv): one key head with 2 value heads (the gates padded to an 8-head box), and the
# Qwen3-Next ratio at 16 / 32 (4 boxes, no padding). The last two: exp / rsqrt approximated,
# then also the kernel's own barriers (the engine's launch, `tree_gdn.mosaic_launch`).
@pytest.mark.parametrize(
    "block_v,inverse,hk,hv,products,kw",
    [
        (128, "neumann", 1, 2, 3, {}),
        (64, "neumann", 1, 2, 3, {}),
        (64, "squaring", 1, 2, 3, {}),
        (64, "squaring", 16, 32, 3, {}),
        (128, "squaring", 16, 32, 3, {}),
        (64, "squaring", 16, 32, 2, {}),
        (64, "neumann", 16, 32, 1, {}),
        (64, "squaring", 16, 32, 1, dict(approx_math=True)),
        (64, "squaring", 16, 32, 1, dict(approx_math=True, auto_barriers=False)),
    ],
)
def test_mgpu_verify_lowers_for_cuda(block_v, inverse, hk, hv, products, kw):
    _lower_and_check_smem(block_v, inverse, hk, hv, products, pending_rows=0, **kw)


@pytest.mark.parametrize("products,auto_barriers", [(1, False), (3, True)])
def test_mgpu_verify_with_pending_lowers_for_cuda(products, auto_barriers):
    """The lazy variant at Qwen3-Next heads and a decode step's 9 path rows keeps two programs
    per SM too (its rows cost ~8 KiB of shared memory in the prologue)."""
    _lower_and_check_smem(
        64, "squaring", 16, 32, products, pending_rows=9, auto_barriers=auto_barriers
    )


def _lower_and_check_smem(block_v, inverse, hk, hv, products, pending_rows, **kw):
    """Layout inference and the shared-memory budget are checked when lowering (no GPU needed).
    The 64-column launch must keep two programs per SM (<= 113 KiB each of the H200's 228)."""
    rng = np.random.default_rng(RUN_SEED)
    parents, _ = random_trees(rng, 2, 64, ("random",))
    x = random_gdn_inputs(rng, 2, 64, hk, hv, 128, 128, jnp.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    pend = None if not pending_rows else PendingCommit.empty(2, pending_rows, hk, 128, hv, 128)
    f = jax.jit(
        lambda *a: tree_gdn_mgpu.tree_gdn_verify_mgpu(
            *a[:7],
            depth_bound=8,
            block_v=block_v,
            inverse=inverse,
            products=products,
            pending=a[7],
            interpret=False,
            **kw,
        )
    )
    found, restore = _smem_estimates()
    try:
        txt = (
            f.trace(*args, jnp.asarray(parents), pend).lower(lowering_platforms=("cuda",)).as_text()
        )
    finally:
        if restore:
            restore()
    assert "bole_tree_gdn_verify_mgpu" in txt or "mosaic_gpu" in txt
    if found:  # (one kernel per lowering)
        assert len(found) == 1 and found[0] <= (113 if block_v == 64 else 227) * 1024, found
