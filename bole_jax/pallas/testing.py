"""Random test inputs for the tree kernels: draft trees of the shapes a drafter produces and GDN
verify inputs with realistic ranges (numpy, host side; used by tests, benchmarks and the budget
calibration)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def random_parents(
    rng: np.random.Generator,
    n: int,
    kind: str = "random",
    *,
    max_children: int = 4,
    max_depth: int = 8,
) -> np.ndarray:
    """One tree of `n` nodes as a parents vector [n] int32 (topological order).

    kind: "chain" (0 <- 1 <- 2 ...), "star" (all children of node 0), "deep" (long random
    branches, no depth limit), "bushy" (breadth first, max_children per node), "forest" (several
    roots hanging off the committed state), "random" (EAGLE-like: at most `max_children` children,
    at most `max_depth` nodes on any root path, extends recent deep nodes preferentially).
    """
    p = np.full(n, -1, np.int32)
    if n == 0:
        return p
    if kind == "chain":
        p[1:] = np.arange(n - 1)
    elif kind == "star":
        p[1:] = 0
    elif kind == "bushy":
        p[1:] = (np.arange(1, n) - 1) // max_children
    elif kind == "deep":
        for i in range(1, n):
            p[i] = i - 1 if rng.random() < 0.8 else rng.integers(0, i)
    elif kind in ("random", "forest"):
        depth = np.zeros(n, np.int32)  # nodes on root path - 1
        kids = np.zeros(n, np.int32)
        roots = 1
        for i in range(1, n):
            if kind == "forest" and rng.random() < 0.2:
                roots += 1
                continue  # p[i] = -1: another tree of the forest
            ok = np.nonzero((kids[:i] < max_children) & (depth[:i] < max_depth - 1))[0]
            if len(ok) == 0:
                continue  # cannot grow within the limits: start a new root
            w = 1.3 ** depth[ok] * (1.0 + ok / i)
            j = int(rng.choice(ok, p=w / w.sum()))
            p[i], depth[i] = j, depth[j] + 1
            kids[j] += 1
    else:
        raise ValueError(f"unknown tree kind {kind!r}")
    return p


def tree_depth(parents: np.ndarray) -> int:
    """Nodes on the longest root path of one tree (numpy, host side)."""
    d = np.zeros(len(parents), np.int64)
    for i, q in enumerate(parents):
        d[i] = 1 + (d[q] if q >= 0 else 0)
    return int(d.max()) if len(d) else 0


def random_trees(
    rng: np.random.Generator, batch: int, n: int, kinds=("random",), *, ragged: bool = False, **kw
) -> tuple[np.ndarray, np.ndarray]:
    """(parents [batch, n] int32, num_nodes [batch] int32). Request b gets tree kind
    kinds[b % len(kinds)]; ragged: request b > 0 keeps only a random prefix of its nodes (the
    rest is padding whose parents are garbage, as an engine's fixed-shape buffers would hold)."""
    parents = (
        np.stack([random_parents(rng, n, kinds[b % len(kinds)], **kw) for b in range(batch)])
        .astype(np.int32)
        .reshape(batch, n)
    )
    num_nodes = np.full(batch, n, np.int32)
    if ragged and n > 1:
        for b in range(1, batch):
            num_nodes[b] = rng.integers(1, n + 1)
            parents[b, num_nodes[b] :] = rng.integers(-1, n, n - num_nodes[b])
    return parents, num_nodes


def random_gdn_inputs(
    rng: np.random.Generator,
    batch: int,
    n: int,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Random GDN verify inputs with realistic ranges: q, k, v in `dtype`; g = log gate in
    [-1, -0.01]; beta in (0, 1); state fp32 of O(1) norm per column."""

    def cast(x):
        return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype))

    return dict(
        q=cast(rng.standard_normal((batch, n, hk, dk))),
        k=cast(rng.standard_normal((batch, n, hk, dk))),
        v=cast(rng.standard_normal((batch, n, hv, dv))),
        g=-rng.uniform(0.01, 1.0, (batch, n, hv)).astype(np.float32),
        beta=rng.uniform(0.05, 0.95, (batch, n, hv)).astype(np.float32),
        state=(rng.standard_normal((batch, hv, dk, dv)) / np.sqrt(dk)).astype(np.float32),
    )


def random_attention_inputs(
    rng: np.random.Generator,
    lengths: np.ndarray,
    t: int,
    hq: int,
    hkv: int,
    s: int,
    d: int,
    dtype=jnp.float32,
):
    """Random inputs of the attention (`pallas/attention.py`) with a tree verify's mask: request
    b's committed prefix of lengths[b] slots, then its T tree slots, each query seeing a random
    subset of them (itself always). Returns q [B, T, Hq, D], k, v [B, Hkv, S, D] in `dtype` and
    mask [B, T, S] bool (jax arrays)."""
    b = len(lengths)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    anc = rng.random((b, t, t)) < 0.4
    anc[:, np.arange(t), np.arange(t)] = True
    tree = np.zeros((b, t, s), bool)
    for i, n in enumerate(lengths):
        tree[i, :, n : n + t] = anc[i]
    mask = (np.arange(s)[None, None] < np.asarray(lengths)[:, None, None]) | tree
    return q, k, v, jnp.asarray(mask)
