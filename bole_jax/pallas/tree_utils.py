"""Tree structure shared by every GDN layer of one verify step, and the kernels' shape helpers.

A draft tree of N nodes is given by `parents [B, N] int32`: nodes are in topological order
(parent[i] < i) and parent -1 means "hangs off the committed state", so forests are allowed.
`num_nodes [B]` marks nodes >= num_nodes[b] as padding (ragged trees in one fixed-shape batch).

Everything here depends on the tree only, not on the layer, so a model computes it once per step
(`tree_structure`) and hands it to all GDN layers (and to the attention tree mask).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

L2_EPS = 1e-6  # q/k L2 norm: x * rsqrt(sum x^2 + L2_EPS), as in Qwen3-Next / FLA


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeStructure:
    """Ancestor relation of a batch of (ragged) trees.

    anc[b, i, j] is True iff node j is node i or one of its ancestors (A* = A + I); rows and
    columns of padding nodes are all False (also the attention tree mask). depth[b, i] = number
    of strict ancestors (a node with parent -1 has depth 0; padding: 0). path_len[b] = nodes on
    the longest root path = max depth + 1 (0 for an empty tree): the strictly lower G of the
    closed form has G^path_len = 0.
    """

    anc: jax.Array  # [B, N, N] bool
    depth: jax.Array  # [B, N] int32
    path_len: jax.Array  # [B] int32
    valid: jax.Array  # [B, N] bool


def resolve_backend(backend: str, interpret: bool | None) -> tuple[str, bool]:
    """("pallas" | "reference", interpret). "auto" = Pallas on GPU, reference elsewhere;
    interpret=None = interpret on anything but GPU."""
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    if backend not in ("pallas", "reference"):
        raise ValueError(f"backend must be 'auto', 'pallas' or 'reference', got {backend!r}")
    return backend, (not on_gpu) if interpret is None else bool(interpret)


def node_validity(parents: jax.Array, num_nodes: jax.Array | None) -> jax.Array:
    """[B, N] bool: True for real nodes (index < num_nodes[b]); all True when num_nodes is None."""
    b, n = parents.shape
    if num_nodes is None:
        return jnp.ones((b, n), bool)
    return jnp.arange(n, dtype=jnp.int32)[None, :] < jnp.asarray(num_nodes, jnp.int32)[:, None]


@jax.jit
def tree_structure(parents: jax.Array, num_nodes: jax.Array | None = None) -> TreeStructure:
    """Ancestor-or-self masks, depths and longest root path of a batch of trees.

    Transitive closure of the parent relation by repeated squaring: ceil(log2 N) batched N x N
    matmuls (0/1 entries and counts <= N are exact in fp32), instead of an N-step sequential walk.
    """
    parents = jnp.asarray(parents, jnp.int32)
    b, n = parents.shape
    valid = node_validity(parents, num_nodes)
    ids = jnp.arange(n, dtype=jnp.int32)
    edge = (parents[:, :, None] == ids[None, None, :]) & valid[:, :, None] & valid[:, None, :]
    reach = (edge | (jnp.eye(n, dtype=bool)[None] & valid[:, :, None])).astype(jnp.float32)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        reach = jnp.minimum(
            jnp.einsum("bij,bjk->bik", reach, reach, precision=jax.lax.Precision.HIGHEST), 1.0
        )
    anc = reach > 0.5
    path = jnp.sum(anc, axis=-1, dtype=jnp.int32)  # nodes on the root path, self included
    depth = jnp.maximum(path - 1, 0)
    return TreeStructure(anc=anc, depth=depth, path_len=jnp.max(path, axis=-1), valid=valid)


@jax.jit
def dfs_order(
    parents: jax.Array, num_nodes: jax.Array | None = None, anc: jax.Array | None = None
) -> jax.Array:
    """[B, N] int32: each tree's nodes in depth-first preorder (children, and the roots of a
    forest, in index order), padding nodes last in index order. order[b, j] is the j-th node
    visited. Every node comes after its parent, and a node's parent is the node just before it
    whenever the node is a first child: a walk in this order leaves a branch only at its leaves
    (what a per-node-state kernel must reload from its scratch), where index order leaves one
    at every node whose parent is not its predecessor.

    Vectorised, no walk: with size(s) the subtree size of s (a column sum of the ancestor-or-
    self mask) and c(a) = 1 + sum of size(s) over the earlier siblings s of a, node i's preorder
    position is sum of c(a) over its ancestors-or-self a, minus one. `anc` (tree_structure's)
    is recomputed when not given."""
    parents = jnp.asarray(parents, jnp.int32)
    b, n = parents.shape
    valid = node_validity(parents, num_nodes)
    if anc is None:
        anc = tree_structure(parents, num_nodes).anc
    a = anc.astype(jnp.float32)  # (sizes and positions <= N: exact in fp32)
    size = jnp.sum(a, axis=1)  # [B, N]: nodes whose ancestor-or-self is j
    ids = jnp.arange(n, dtype=jnp.int32)
    sib = (
        (parents[:, None, :] == parents[:, :, None])
        & (ids[None, None, :] < ids[None, :, None])
        & valid[:, None, :]
        & valid[:, :, None]
    )  # [B, a, s]: s an earlier sibling of a
    c = 1.0 + jnp.einsum(
        "bas,bs->ba", sib.astype(jnp.float32), size, precision=jax.lax.Precision.HIGHEST
    )
    pos = jnp.einsum("bia,ba->bi", a, c, precision=jax.lax.Precision.HIGHEST) - 1.0
    pos = jnp.where(valid, jnp.round(pos).astype(jnp.int32), ids[None, :])
    # order = pos^-1, as a one-hot sum (N <= a few hundred)
    hit = pos[:, :, None] == ids[None, None, :]  # [B, i, j]: node i at position j
    return jnp.sum(jnp.where(hit, ids[None, :, None], 0), axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("width",))
def conv_window_indices(parents: jax.Array, width: int) -> jax.Array:
    """[B, N, width] int32: rows of concat([conv_state (width-1 rows), x (N rows)]) forming each
    node's causal conv window, oldest first.

    Node i's window is the last `width` entries of
    [committed inputs..., x of its root path..., x_i]:
    its width-1 nearest ancestors (nearest last) and itself, topped up from the committed conv
    state (row width-2 = newest) when the root path is shorter. Padding nodes get a valid but
    meaningless window (callers mask them).
    """
    parents = jnp.asarray(parents, jnp.int32)
    _, n = parents.shape
    c = width - 1
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), parents.shape)
    used = jnp.zeros_like(cur)  # committed rows consumed so far
    cols = [c + cur]
    for _ in range(c):
        nxt = jnp.take_along_axis(parents, jnp.clip(cur, 0, n - 1), axis=1)
        cur = jnp.where(cur >= 0, jnp.minimum(nxt, n - 1), -1)
        cols.append(jnp.where(cur >= 0, c + cur, c - 1 - used))
        used = used + (cur < 0)
    return jnp.stack(cols[::-1], axis=-1)


def accepted_path(parents, accepted, length: int):
    """[B, length] int32: node `accepted`, its parent, grandparent, ... (-1 past the root).

    A walk up the parent pointers (fused gathers), so no ancestor mask is needed.
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[1]
    cur = jnp.asarray(accepted, jnp.int32)
    out = []
    for _ in range(length):
        out.append(cur)
        nxt = jnp.take_along_axis(parents, jnp.clip(cur, 0, n - 1)[:, None], axis=1)[:, 0]
        cur = jnp.where(cur >= 0, nxt, -1)
    return jnp.stack(out, axis=1)


def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes and dot dims."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `x` at the end of `axis` to `size` (no-op if already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    assert extra > 0, (x.shape, axis, size)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def check_parents(parents, num_nodes=None) -> None:
    """Eager validation of a parents array (host side); raises ValueError naming the fix."""
    p = np.asarray(parents)
    if p.ndim != 2:
        raise ValueError(f"parents must be [B, N], got shape {p.shape}")
    n = p.shape[1]
    nn = np.full(p.shape[0], n) if num_nodes is None else np.asarray(num_nodes)
    for b in range(p.shape[0]):
        row = p[b, : int(nn[b])]
        bad = np.nonzero((row < -1) | (row >= np.arange(len(row))))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"parents[{b}, {i}] = {int(row[i])}: every real node needs -1 <= parent < index "
                "(nodes in topological order; -1 = child of the committed state)"
            )
