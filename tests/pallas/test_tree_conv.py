"""Tree causal conv: jnp reference and Pallas kernel (interpret mode) vs a naive per-node loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.pallas import tree_conv
from bole_jax.pallas.testing import random_trees


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def naive_tree_conv(x, conv_state, weight, parents, num_nodes):
    """Walk each node's root path in Python; window = last K entries of
    [committed inputs, path inputs]."""
    b_, n, c = x.shape
    width = weight.shape[0]
    y = np.zeros((b_, n, c), np.float64)
    for b in range(b_):
        for i in range(num_nodes[b]):
            path, j = [], i
            while j >= 0:
                path.append(x[b, j])
                j = parents[b, j]
            seq = list(conv_state[b]) + path[::-1]
            acc = (np.stack(seq[-width:]).astype(np.float64) * weight).sum(0)
            y[b, i] = acc / (1.0 + np.exp(-acc))
    return y


def _inputs(seed, b, n, c, width, kinds, dtype=np.float32):
    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, b, n, kinds, ragged=True)
    cast = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype))  # noqa: E731
    x = cast(rng.standard_normal((b, n, c)))
    conv_state = cast(rng.standard_normal((b, width - 1, c)))
    weight = cast(rng.standard_normal((width, c)) * 0.5)
    return x, conv_state, weight, parents, num_nodes


CASES = [  # N, C, K, kinds, dtype, block_c
    (1, 16, 4, ("random",), np.float32, 16),
    (2, 48, 4, ("chain", "forest"), np.float32, 16),
    (7, 64, 4, ("star", "deep", "bushy"), np.float32, 32),
    (16, 40, 4, ("forest", "random"), jnp.bfloat16, 16),
    (64, 32, 4, ("random", "deep"), np.float32, 32),
    (128, 16, 4, ("chain", "random"), np.float32, 16),
    (12, 32, 2, ("deep", "forest"), np.float32, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-C{c[1]}-K{c[2]}")
def test_tree_conv_matches_naive(case):
    n, c, width, kinds, dtype, block_c = case
    seed = RUN_SEED
    x, cs, w, parents, num_nodes = _inputs(seed, 3, n, c, width, kinds, dtype)
    want = naive_tree_conv(
        np.asarray(x, np.float32),
        np.asarray(cs, np.float32),
        np.asarray(w, np.float32),
        parents,
        num_nodes,
    )
    tol = 1e-5 if dtype == np.float32 else 1e-2  # bf16 output rounding
    y_ref = tree_conv.tree_causal_conv(x, cs, w, parents, num_nodes, backend="reference")
    y = tree_conv.tree_causal_conv(
        x, cs, w, parents, num_nodes, backend="pallas", interpret=True, block_c=block_c
    )
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel(y_ref, want) <= tol, f"seed {seed}"
    assert rel(y, want) <= tol, f"seed {seed}"
    assert rel(y, y_ref) <= tol, f"seed {seed}"
    m = np.arange(n)[None, :] < num_nodes[:, None]
    assert not np.any(np.asarray(y, np.float32)[~m]), f"padding not zero, seed {seed}"


def test_padding_nodes_change_nothing():
    seed = RUN_SEED
    x, cs, w, parents, num_nodes = _inputs(seed, 2, 20, 32, 4, ("deep", "forest"))
    m = np.arange(20)[None, :] < num_nodes[:, None]
    dirty = np.array(x)
    dirty[~m] = np.nan
    y = tree_conv.tree_causal_conv(
        dirty, cs, w, parents, num_nodes, backend="pallas", interpret=True, block_c=32
    )
    for b in range(2):
        nb = int(num_nodes[b])
        y1 = tree_conv.tree_causal_conv(
            x[b : b + 1, :nb],
            cs[b : b + 1],
            w,
            parents[b : b + 1, :nb],
            backend="pallas",
            interpret=True,
            block_c=32,
        )
        assert rel(y[b, :nb], y1[0]) <= 1e-6, f"seed {seed} request {b}"


def test_conv_lowers_to_triton():
    b, n, c = 2, 8, 8192
    x = jnp.zeros((b, n, c), jnp.bfloat16)
    cs = jnp.zeros((b, 3, c), jnp.bfloat16)
    w = jnp.zeros((4, c), jnp.bfloat16)
    parents = jnp.zeros((b, n), jnp.int32)
    fn = jax.jit(lambda *a: tree_conv.tree_causal_conv(*a, backend="pallas", interpret=False))
    assert (
        "bole_tree_conv"
        in fn.trace(x, cs, w, parents).lower(lowering_platforms=("cuda",)).as_text()
    )
