"""Selected-state commit from factors: every possible accepted node (and -1) against the state
the per-branch recurrence reaches; conv-state commit against the per-node windows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_conv, tree_gdn_ref
from bole_jax.pallas.testing import random_gdn_inputs, random_trees
from bole_jax.pallas.tree_gdn_commit import commit_state, commit_states
from bole_jax.spec_decode.state_factors import accepted_path, commit_conv_state

jax.config.update("jax_default_matmul_precision", "highest")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = [  # N, Hk, HV, dk, dv, kinds, max_path
    (1, 1, 1, 16, 16, ("random",), None),
    (5, 2, 4, 16, 32, ("chain", "star"), None),
    (16, 1, 3, 16, 16, ("forest", "bushy", "deep"), None),
    (33, 2, 4, 16, 16, ("random",), 8),
    (64, 1, 2, 16, 16, ("deep", "random"), None),
]


def _check_commit_every_node(seed, n, hk, hv, dk, dv, kinds, **commit_kw):
    """commit_state for every possible accepted node (and -1) vs the recurrence's state."""
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, 3, n, kinds, ragged=True)
    x = random_gdn_inputs(rng, 3, n, hk, hv, dk, dv)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    _, states = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    _, factors = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes)
    states = np.asarray(states)
    for sel in range(-1, n):
        acc = np.minimum(np.full(3, sel), num_nodes - 1).astype(np.int32)
        new = np.asarray(commit_state(x["state"], factors, parents, acc, **commit_kw))
        for b in range(3):
            want = x["state"][b] if acc[b] < 0 else states[b, acc[b]]
            assert rel(new[b], want) <= 1e-4, f"seed {seed} request {b} accepted {acc[b]}"


@pytest.mark.parametrize("seed", [0, RUN_SEED])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-r{c[2] // c[1]}-{c[5][0]}")
def test_commit_every_node(case, seed):
    *shape, max_path = case
    _check_commit_every_node(seed, *shape, backend="reference", max_path=max_path)


@pytest.mark.parametrize(
    "n,hk,hv,dk,dv,kinds,max_path",
    [
        (1, 1, 1, 16, 16, ("random",), None),
        (9, 2, 4, 16, 32, ("chain", "star", "forest"), None),
        (33, 2, 4, 16, 16, ("random",), 8),
        (40, 1, 2, 24, 16, ("deep", "random", "bushy"), None),
    ],
)
@pytest.mark.parametrize("fold", ["loop", "dot", "unroll"])
def test_commit_kernel_every_node(n, hk, hv, dk, dv, kinds, max_path, fold):
    """The Pallas commit (interpret mode) matches the recurrence's state at every node, with the
    rows added by the rank-1 loop, by the dot and unrolled."""
    _check_commit_every_node(
        RUN_SEED,
        n,
        hk,
        hv,
        dk,
        dv,
        kinds,
        backend="pallas",
        interpret=True,
        block_v=16,
        max_path=max_path,
        fold=fold,
    )


@pytest.mark.parametrize(
    "backend", ["reference", "pallas", "pallas-dot", "pallas-unroll", "pallas-auto"]
)
def test_commit_with_the_callers_path(backend):
    """A decode step hands the accepted path it already holds (root first, like
    `Accepted.path`, junk past count): the same state as the walk up the parents, for every
    node, with a path longer and shorter than the walk's bound."""
    rng = np.random.default_rng(RUN_SEED)
    n, b = 12, 3
    parents, num_nodes = random_trees(rng, b, n, ("random", "deep", "star"), ragged=True)
    x = random_gdn_inputs(rng, b, n, 1, 2, 16, 16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    _, states = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
    _, factors = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes)
    kw = dict(backend=backend.split("-")[0], interpret=True, block_v=16)
    if backend != "reference":  # every kernel fold, explicitly, and the default ("auto")
        kw["fold"] = backend.split("-")[1] if "-" in backend else "loop"
    for sel in range(-1, n):
        acc = np.minimum(np.full(b, sel), num_nodes - 1).astype(np.int32)
        walk = np.asarray(accepted_path(parents, acc, n))  # accepted first, -1 past the root
        count = (walk >= 0).sum(1).astype(np.int32)
        width = int(count.max()) + 2
        path = rng.integers(-5, n + 5, (b, width)).astype(np.int32)  # junk past count
        for r in range(b):
            path[r, : count[r]] = walk[r, : count[r]][::-1]  # root first
        # -1 requests: a nonzero count must still keep the state
        count_in = np.where(acc < 0, 2, count).astype(np.int32)
        new = np.asarray(
            commit_state(x["state"], factors, parents, acc, path=path, count=count_in, **kw)
        )
        for r in range(b):
            want = x["state"][r] if acc[r] < 0 else states[r, acc[r]]
            assert rel(new[r], want) <= 1e-4, f"seed {RUN_SEED} request {r} accepted {acc[r]}"
    with pytest.raises(ValueError, match="together"):
        commit_state(x["state"], factors, parents, acc, path=path, **kw)


@pytest.mark.parametrize(
    "n,path_len,fold",
    [
        (8, None, "loop"),
        (9, 9, "loop"),
        (9, 9, "dot"),
        (7, 3, "dot"),
        (40, None, "dot"),
        (9, 9, "unroll"),
        (40, None, "auto"),
        (64, 9, "auto"),
    ],
)
def test_commit_kernel_lowers_to_triton(n, path_len, fold):
    """The GPU kernel lowers, also for node counts and caller paths (an engine's depth + 1) that
    are not powers of two."""
    b, hk, hv, d = 2, 2, 4, 128
    factors = tree_gdn_ref.TreeFactors(
        k=jnp.zeros((b, n, hk, d)), u=jnp.zeros((b, n, hv, d)), gamma=jnp.zeros((b, n, hv))
    )
    state = jnp.zeros((b, hv, d, d))
    parents = jnp.zeros((b, n), jnp.int32)
    acc = jnp.zeros((b,), jnp.int32)
    kw = (
        {}
        if path_len is None
        else dict(path=jnp.zeros((b, path_len), jnp.int32), count=jnp.ones((b,), jnp.int32))
    )
    fn = jax.jit(lambda *a: commit_state(*a, backend="pallas", interpret=False, fold=fold, **kw))
    assert (
        "bole_commit_state"
        in fn.trace(state, factors, parents, acc).lower(lowering_platforms=("cuda",)).as_text()
    )


@pytest.mark.parametrize(
    "layers,b,n,hk,hv,dk,dv,fold",
    [
        (1, 2, 9, 1, 2, 16, 16, "unroll"),
        (3, 3, 12, 2, 4, 16, 32, "dot"),
        (4, 4, 9, 1, 2, 24, 16, "unroll"),
        (2, 2, 7, 1, 1, 16, 16, "loop"),
    ],
)
def test_commit_of_every_layer_in_one_launch(layers, b, n, hk, hv, dk, dv, fold):
    """`commit_states` (one Pallas launch for all layers, interpret mode) gives each layer the
    state its own recurrence reaches at the accepted node, from the step's shared path: every
    layer with its own random inputs, requests accepting different depths, one accepting
    nothing (-1, count junk: the state kept bit for bit); the reference backend the same."""
    rng = np.random.default_rng(RUN_SEED)
    parents, num_nodes = random_trees(rng, b, n, ("random", "deep", "chain"), ragged=True)
    acc = np.array([rng.integers(0, m) for m in num_nodes], np.int32)
    acc[-1] = -1
    walk = np.asarray(accepted_path(parents, acc, n))
    count = (walk >= 0).sum(1).astype(np.int32)
    path = rng.integers(-3, n + 3, (b, int(count.max()) + 1)).astype(np.int32)  # junk past count
    for r in range(b):
        path[r, : count[r]] = walk[r, : count[r]][::-1]
    count[-1] = 2
    states, factors, wants = [], [], []
    for _ in range(layers):
        x = random_gdn_inputs(rng, b, n, hk, hv, dk, dv)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
        _, per_node = tree_gdn_ref.tree_gdn_sequential(*args, parents, num_nodes)
        _, f = tree_gdn_ref.tree_gdn_closed_form(*args, parents, num_nodes)
        per_node = np.asarray(per_node)
        states.append(jnp.asarray(x["state"]))
        factors.append(f)
        wants.append([x["state"][r] if acc[r] < 0 else per_node[r, acc[r]] for r in range(b)])
    pallas = dict(backend="pallas", interpret=None, block_v=16, fold=fold)
    for kw in (pallas, dict(pallas, layers_per_launch=2), {}):  # 2: launches of 2 (+ 1) layers
        new = commit_states(states, factors, acc, path, count, **kw)
        assert len(new) == layers
        for layer in range(layers):
            for r in range(b - 1):
                err = rel(new[layer][r], wants[layer][r])
                assert err <= 1e-4, f"seed {RUN_SEED} layer {layer} request {r}: {err} ({kw})"
            np.testing.assert_array_equal(new[layer][b - 1], wants[layer][b - 1])


def test_commit_of_every_layer_checks_its_layers():
    rng = np.random.default_rng(0)
    x = random_gdn_inputs(rng, 1, 4, 1, 1, 16, 16)
    parents, _ = random_trees(rng, 1, 4, ("chain",))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    _, f = tree_gdn_ref.tree_gdn_closed_form(*args, parents)
    one = (np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.ones(1, np.int32))
    kw = dict(backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="one factor set per state"):
        commit_states([x["state"]], [f, f], *one, **kw)
    wide = random_gdn_inputs(rng, 1, 4, 1, 2, 16, 16)
    _, g = tree_gdn_ref.tree_gdn_closed_form(
        wide["q"], wide["k"], wide["v"], wide["g"], wide["beta"], wide["state"], parents
    )
    with pytest.raises(ValueError, match="same shapes"):
        commit_states([x["state"], wide["state"]], [f, g], *one, **kw)


def test_commit_of_every_layer_lowers_to_triton():
    """The one-launch commit lowers for the GPU: one custom call for all layers."""
    b, n, hk, hv, d, layers = 2, 9, 2, 4, 128, 3
    factors = tree_gdn_ref.TreeFactors(
        k=jnp.zeros((b, n, hk, d)), u=jnp.zeros((b, n, hv, d)), gamma=jnp.zeros((b, n, hv))
    )
    states = [jnp.zeros((b, hv, d, d))] * layers
    acc, path, count = jnp.zeros(b, jnp.int32), jnp.zeros((b, 9), jnp.int32), jnp.ones(b, jnp.int32)
    for fold in ("unroll", "dot"):
        fn = jax.jit(
            lambda s, f, a, p, c: commit_states(
                s, f, a, p, c, backend="pallas", interpret=False, fold=fold
            )
        )
        text = (
            fn.trace(states, [factors] * layers, acc, path, count)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert text.count("bole_commit_states") >= 1 and 'bole_commit_state"' not in text
    # a launch holds at most layers_per_launch layers: 3 layers in launches of 2 and 1
    fn = jax.jit(
        lambda s, f, a, p, c: commit_states(
            s, f, a, p, c, backend="pallas", interpret=False, layers_per_launch=2
        )
    )
    text = (
        fn.trace(states, [factors] * layers, acc, path, count)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    names = re.findall(r'name = "(bole_commit_states?)"', text)
    assert names == ["bole_commit_states", "bole_commit_state"], names


def test_commit_root_only_and_keep():
    """A request that accepted only node 0 gets S_0 = a_0 (I - b_0 k_0 k_0^T) S + b_0 k_0 v_0^T;
    accepted -1 keeps the state bit for bit."""
    rng = np.random.default_rng(RUN_SEED)
    parents, _ = random_trees(rng, 2, 8, ("random",))
    x = random_gdn_inputs(rng, 2, 8, 1, 2, 16, 16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    _, factors = tree_gdn_ref.tree_gdn_closed_form(*args, parents)
    new = np.asarray(commit_state(x["state"], factors, parents, np.array([0, -1], np.int32)))
    k0 = np.asarray(tree_gdn_ref.l2_normalize(x["k"][0, 0, 0]), np.float64)
    for h in range(2):
        a, b = np.exp(x["g"][0, 0, h]), x["beta"][0, 0, h]
        s = x["state"][0, h].astype(np.float64)
        want = a * (np.eye(16) - b * np.outer(k0, k0)) @ s + b * np.outer(k0, x["v"][0, 0, h])
        assert rel(new[0, h], want) <= 1e-5, RUN_SEED
    np.testing.assert_array_equal(new[1], x["state"][1])


def test_accepted_path_walks_to_root():
    parents = np.array([[-1, 0, 1, 0, 3, -1]], np.int32)
    np.testing.assert_array_equal(accepted_path(parents, np.array([4]), 4), [[4, 3, 0, -1]])
    np.testing.assert_array_equal(accepted_path(parents, np.array([-1]), 2), [[-1, -1]])


@pytest.mark.parametrize(
    "n,kinds", [(1, ("random",)), (6, ("chain", "star")), (40, ("forest", "deep", "bushy"))]
)
def test_commit_conv_state_every_node(n, kinds):
    seed = RUN_SEED
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, 3, n, kinds, ragged=True)
    x = rng.standard_normal((3, n, 24)).astype(np.float32)
    cs = rng.standard_normal((3, 3, 24)).astype(np.float32)
    for sel in range(-1, n):
        acc = np.minimum(np.full(3, sel), num_nodes - 1).astype(np.int32)
        new = np.asarray(commit_conv_state(cs, x, parents, acc))
        for b in range(3):
            if acc[b] < 0:
                want = cs[b]
            else:  # last 3 inputs along the root path, topped up from the old conv state
                path, j = [], acc[b]
                while j >= 0:
                    path.append(x[b, j])
                    j = parents[b, j]
                want = np.stack((list(cs[b]) + path[::-1])[-3:])
            np.testing.assert_array_equal(new[b], want, err_msg=f"seed {seed} node {acc[b]}")
    win = tree_conv.node_conv_states_ref(x, cs, parents)  # the same per node
    acc = (num_nodes - 1).astype(np.int32)
    np.testing.assert_array_equal(
        commit_conv_state(cs, x, parents, acc), np.asarray(win)[np.arange(3), acc]
    )


def test_commit_launch_policy():
    """fold "auto" unrolls a decode step's short paths from B = 4 on and takes the dot at
    B < 4 and for long walks; block_v None: 64 columns for the unrolled fold at B >= 16, else
    32; explicit values win."""
    from bole_jax.pallas.tree_gdn_commit import UNROLL_MAX_ROWS, commit_launch

    assert commit_launch(16, 9) == ("unroll", 64)
    assert commit_launch(4, 9) == ("unroll", 32)
    assert commit_launch(1, 9) == ("dot", 32)
    assert commit_launch(16, UNROLL_MAX_ROWS + 1) == ("dot", 32)
    assert commit_launch(16, 9, "loop") == ("loop", 32)
    assert commit_launch(4, 9, "auto", 16) == ("unroll", 16)
