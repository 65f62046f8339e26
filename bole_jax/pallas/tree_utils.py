"""Tree structure shared by every GDN layer of one verify step, and the factors they return.

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
class TreeFactors:
    """Token-level factors of one GDN layer's verify (01-bole-algorithm.md section 3).

    With them, the state after any node `sel` is
    S_sel = exp(gamma_sel) S_pre + sum_{j in anc*(sel)} exp(gamma_sel - gamma_j) k_j u_j^T.
    where k_j are the L2-normalised keys (`keys()`). A GDN verify keeps the keys as it took them
    (`k`, the caller's array: bf16 in a model) with one fp32 factor per row (`k_scale`, the
    rsqrt the verify normalised with), not a normalised fp32 copy: k_j = k_scale_j * k_j
    exactly as the verify formed it. At Qwen3-Next dims a node's factors then take 4 KiB of
    keys (16 key heads, bf16) + 16 KiB of u instead of 8 + 16 KiB (101x smaller than a per-node
    fp32 state, not 85x), and the verify does not write the keys at all.
    Padding nodes have zero u, gamma and k_scale (their k is whatever the caller passed; `keys()`
    zeroes it). An SSD layer (`tree_ssd`) returns the same type with k = Mamba2's B (k_scale
    None: used as it is) and u = v = dt x (no pseudo values).
    """

    k: jax.Array  # [B, N, Hk, dk] the keys as verify took them (k_scale None: the keys used)
    u: jax.Array  # [B, N, HV, dv] fp32, pseudo values U = (I + G)^-1 diag(b) (V - diag(P) K S_pre)
    gamma: jax.Array  # [B, N, HV] fp32, root-path cumulative log gate
    k_scale: jax.Array | None = None  # [B, N, Hk] fp32, rsqrt(sum k^2 + eps); 0 on padding

    def keys(self) -> jax.Array:
        """[B, N, Hk, dk] fp32: the keys the state is built from (k_scale * k, padding 0)."""
        return scaled_keys(self.k, self.k_scale)


def scaled_keys(k, k_scale):
    """k [..., dk] times its per-row k_scale [...] in fp32, rows of scale 0 zeroed (NaN-safe);
    k as fp32 when k_scale is None. `TreeFactors.keys()`, or any gathered rows of it."""
    k = k.astype(jnp.float32)
    if k_scale is None:
        return k
    s = k_scale.astype(jnp.float32)[..., None]
    return jnp.where(s != 0, k * s, 0.0)


def with_keys(k, outs):
    """(o, u, gamma, k_scale[, state]) of a verify launch -> (o, TreeFactors[, state]) with the
    keys k as the factor k. Called outside the launch's jit: a jit that returns one of its
    arguments returns a copy (XLA copies an undonated parameter it outputs), and the keys are
    the caller's already."""
    o, u, gamma, k_scale, *state = outs
    return (o, TreeFactors(k=k, u=u, gamma=gamma, k_scale=k_scale), *state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCommit:
    """A selected-state commit not yet applied to the state (the lazy commit).

    The accepted node's root-path factor rows, gathered, so that the next verify can fold them
    into the state tile it loads anyway (one state read + write per step instead of the commit's
    read + write plus the verify's read):
        S = p_sel S + sum_{m < count} w_m k_m u_m^T   (value head h uses key head h // (HV/Hk)).
    Rows m >= count weigh 0; count 0 with p_sel 1 is "nothing pending" (`empty`).
    """

    k: jax.Array  # [B, L, Hk, dk] fp32, L2-normalised keys of the path nodes (accepted first)
    u: jax.Array  # [B, L, HV, dv] fp32, their pseudo values
    w: jax.Array  # [B, L, HV] fp32, exp(gamma_sel - gamma_j) (0 past count)
    p_sel: jax.Array  # [B, HV] fp32, exp(gamma_sel) (1: nothing accepted)
    count: jax.Array  # [B] int32, real rows

    @staticmethod
    def empty(batch: int, length: int, hk: int, dk: int, hv: int, dv: int) -> "PendingCommit":
        return PendingCommit(k=jnp.zeros((batch, length, hk, dk), jnp.float32),
                             u=jnp.zeros((batch, length, hv, dv), jnp.float32),
                             w=jnp.zeros((batch, length, hv), jnp.float32),
                             p_sel=jnp.ones((batch, hv), jnp.float32),
                             count=jnp.zeros((batch,), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingPath:
    """The same not-yet-applied commit as `PendingCommit`, kept as the previous verify's factors
    and its accepted path instead of gathered rows: the next verify reads the path's rows
    straight from the factors, so the lazy commit needs no launch of its own (no gather).
        S = p_sel S + sum_{m < count} w_m k_m u_m^T,   row m = node path[m],
        w_m = exp(gamma_sel - gamma_m), p_sel = exp(gamma_sel), gamma_sel = gamma[sel]
    (`tree_gdn_commit.pending_commit` gathers the same rows). Nothing is pending when sel < 0 or
    count is 0 (then p_sel = 1 and no row is read; `empty`).
    """

    factors: TreeFactors  # the previous verify's: k [B, M, Hk, dk], k_scale [B, M, Hk] fp32,
    #                       u [B, M, HV, dv] fp32, gamma [B, M, HV] fp32 (M = its tree's nodes)
    path: jax.Array  # [B, L] int32 node ids (any order; entries past count are not read)
    sel: jax.Array  # [B] int32, the accepted node (-1: nothing)
    count: jax.Array  # [B] int32, nodes on its root path (0: nothing)

    @staticmethod
    def empty(batch: int, nodes: int, length: int, hk: int, dk: int, hv: int, dv: int,
              k_dtype=jnp.bfloat16) -> "PendingPath":
        """Nothing pending, in the layout a decode loop carries (factors of `nodes` nodes, a path
        of `length` rows)."""
        factors = TreeFactors(k=jnp.zeros((batch, nodes, hk, dk), k_dtype),
                              u=jnp.zeros((batch, nodes, hv, dv), jnp.float32),
                              gamma=jnp.zeros((batch, nodes, hv), jnp.float32),
                              k_scale=jnp.zeros((batch, nodes, hk), jnp.float32))
        return PendingPath(factors=factors, path=jnp.zeros((batch, length), jnp.int32),
                           sel=jnp.full((batch,), -1, jnp.int32),
                           count=jnp.zeros((batch,), jnp.int32))

    def live_count(self) -> jax.Array:
        """[B] int32: the rows to fold (0 where nothing is pending)."""
        return jnp.where(self.sel >= 0, jnp.asarray(self.count, jnp.int32), 0)


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
            jnp.einsum("bij,bjk->bik", reach, reach, precision=jax.lax.Precision.HIGHEST), 1.0)
    anc = reach > 0.5
    path = jnp.sum(anc, axis=-1, dtype=jnp.int32)  # nodes on the root path, self included
    depth = jnp.maximum(path - 1, 0)
    return TreeStructure(anc=anc, depth=depth, path_len=jnp.max(path, axis=-1), valid=valid)


@jax.jit
def dfs_order(parents: jax.Array, num_nodes: jax.Array | None = None,
              anc: jax.Array | None = None) -> jax.Array:
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
    sib = ((parents[:, None, :] == parents[:, :, None]) & (ids[None, None, :] < ids[None, :, None])
           & valid[:, None, :] & valid[:, :, None])  # [B, a, s]: s an earlier sibling of a
    c = 1.0 + jnp.einsum("bas,bs->ba", sib.astype(jnp.float32), size,
                         precision=jax.lax.Precision.HIGHEST)
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


def check_pending(pending: PendingCommit, b: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """ValueError unless a pending commit's rows fit a verify of these shapes (any row count)."""
    length = pending.k.shape[1]
    want = dict(k=(b, length, hk, dk), u=(b, length, hv, dv), w=(b, length, hv), p_sel=(b, hv),
                count=(b,))
    got = {name: tuple(jnp.shape(getattr(pending, name))) for name in want}
    if got != want:
        raise ValueError(f"pending rows {got} do not match the verify's shapes: need {want}")


def check_pending_path(pending: PendingPath, b: int, hk: int, hv: int, dk: int,
                       dv: int) -> None:
    """ValueError unless a pending path's factors fit a verify of these shapes (any node count
    M, any path length L)."""
    f = pending.factors
    m, length = f.u.shape[1], jnp.shape(pending.path)[1]
    if f.k_scale is None:
        raise ValueError("a pending path needs GDN factors with k_scale (a verify's)")
    want = dict(k=(b, m, hk, dk), k_scale=(b, m, hk), u=(b, m, hv, dv), gamma=(b, m, hv))
    got = {name: tuple(jnp.shape(getattr(f, name))) for name in want}
    want.update(path=(b, length), sel=(b,), count=(b,))
    got.update({name: tuple(jnp.shape(getattr(pending, name))) for name in ("path", "sel",
                                                                            "count")})
    if got != want:
        raise ValueError(f"pending path {got} does not match the verify's shapes: need {want}")


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
                "(nodes in topological order; -1 = child of the committed state)")


# ----------------------------------------------------------------------------- tree generators
# numpy, host side: used by tests and benchmarks (shapes of trees the drafter produces).


def random_parents(rng: np.random.Generator, n: int, kind: str = "random", *,
                   max_children: int = 4, max_depth: int = 8) -> np.ndarray:
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


def random_trees(rng: np.random.Generator, batch: int, n: int, kinds=("random",), *,
                 ragged: bool = False, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(parents [batch, n] int32, num_nodes [batch] int32). Request b gets tree kind
    kinds[b % len(kinds)]; ragged: request b > 0 keeps only a random prefix of its nodes (the
    rest is padding whose parents are garbage, as an engine's fixed-shape buffers would hold)."""
    parents = np.stack([random_parents(rng, n, kinds[b % len(kinds)], **kw)
                        for b in range(batch)]).astype(np.int32).reshape(batch, n)
    num_nodes = np.full(batch, n, np.int32)
    if ragged and n > 1:
        for b in range(1, batch):
            num_nodes[b] = rng.integers(1, n + 1)
            parents[b, num_nodes[b]:] = rng.integers(-1, n, n - num_nodes[b])
    return parents, num_nodes


def random_gdn_inputs(rng: np.random.Generator, batch: int, n: int, hk: int, hv: int, dk: int,
                      dv: int, dtype=np.float32) -> dict[str, np.ndarray]:
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
