"""Draft-tree structure: nodes, parents, depths, positions, and selection from a candidate pool.

A verification tree per request holds N node slots in topological order (parent < index):
node 0 is the *root*, the last emitted token that the target has not processed yet; nodes
1..num_nodes-1 are draft tokens; slots >= num_nodes are padding (parent -1, depth 0, never
accepted). Node i sits at sequence position `cache_len + depth[i]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.pallas.tree_utils import tree_structure


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: jax.Array  # [B, N] int32
    parents: jax.Array  # [B, N] int32, -1 for the root and padding
    depth: jax.Array  # [B, N] int32, root 0
    num_nodes: jax.Array  # [B] int32, >= 1
    score: jax.Array  # [B, N] f32 draft log-score rho (root 0, padding -inf)

    @property
    def valid(self) -> jax.Array:
        """[B, N] bool: real (non-padding) nodes."""
        n = self.tokens.shape[1]
        return jnp.arange(n)[None, :] < self.num_nodes[:, None]


def depths(parents: jax.Array, num_nodes: jax.Array | None = None) -> jax.Array:
    """Depth of every node [B, N] int32 (root = 0, padding 0)."""
    return tree_structure(parents, num_nodes).depth


def select_from_pool(
    root_token: jax.Array,
    cand_tokens: jax.Array,
    cand_parents: jax.Array,
    cand_scores: jax.Array,
    num_select: jax.Array | int,
    n: int,
) -> Tree:
    """Keep the best `num_select[b]` (<= n - 1) candidates of each request's pool as a tree.

    root_token [B]; cand_* [B, M] with the pool in breadth order (a candidate's parent precedes it;
    cand_parents index the pool, -1 = child of the root); scores are cumulative draft log-probs rho,
    which never increase down a path. Selection sorts by (-rho, pool index) with a stable sort, so
    ties go to the shallower (earlier) candidate and every selected node's parent is selected too:
    the selection is prefix-connected. The tree keeps pool order (topological).
    """
    b, m = cand_tokens.shape
    num_select = jnp.broadcast_to(jnp.asarray(num_select, jnp.int32), (b,))
    num_select = jnp.minimum(num_select, min(n - 1, m))
    # One sort of the pool; the rank and the compaction are scatters (an argsort of the order
    # and one of the chosen positions did the same with two more sorts over the pool).
    rows = jnp.arange(b)[:, None]
    order = jnp.argsort(-cand_scores, axis=-1, stable=True)  # [B, M]
    rank = jnp.zeros((b, m), jnp.int32).at[rows, order].set(jnp.arange(m, dtype=jnp.int32)[None])
    chosen = (rank < num_select[:, None]) & jnp.isfinite(cand_scores)
    # New index of each chosen candidate: 1 + number of chosen candidates before it in pool order.
    csum = jnp.cumsum(chosen, axis=-1, dtype=jnp.int32)
    new_idx = jnp.where(chosen, csum, -1)  # root is 0
    k = min(n - 1, m)
    # Pool positions of the chosen candidates, in pool order: [B, k] (0 beyond the chosen ones)
    pos = (
        jnp.zeros((b, k), jnp.int32)
        .at[rows, jnp.where(chosen, csum - 1, k)]
        .set(jnp.arange(m, dtype=jnp.int32)[None], mode="drop")
    )
    sel_valid = jnp.arange(k)[None] < jnp.sum(chosen, axis=-1, keepdims=True)
    tok = jnp.take_along_axis(cand_tokens, pos, axis=-1)
    ppos = jnp.take_along_axis(cand_parents, pos, axis=-1)
    par = jnp.where(ppos < 0, 0, jnp.take_along_axis(new_idx, jnp.maximum(ppos, 0), axis=-1))
    sc = jnp.take_along_axis(cand_scores, pos, axis=-1)
    pad = n - 1 - k
    tokens = jnp.concatenate(
        [root_token[:, None], jnp.where(sel_valid, tok, 0), jnp.zeros((b, pad), jnp.int32)], axis=1
    )
    parents = jnp.concatenate(
        [
            jnp.full((b, 1), -1, jnp.int32),
            jnp.where(sel_valid, par, -1),
            jnp.full((b, pad), -1, jnp.int32),
        ],
        axis=1,
    )
    score = jnp.concatenate(
        [jnp.zeros((b, 1)), jnp.where(sel_valid, sc, -jnp.inf), jnp.full((b, pad), -jnp.inf)],
        axis=1,
    ).astype(jnp.float32)
    num_nodes = 1 + jnp.sum(chosen, axis=-1).astype(jnp.int32)
    return Tree(
        tokens=tokens.astype(jnp.int32),
        parents=parents.astype(jnp.int32),
        depth=depths(parents, num_nodes),
        num_nodes=num_nodes,
        score=score,
    )


def chain_tree(tokens: jax.Array, num_nodes: jax.Array, score: jax.Array | None = None) -> Tree:
    """A chain (root + drafts in order): tokens [B, N], parent[i] = i - 1."""
    b, n = tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = idx[None] < num_nodes[:, None]
    parents = jnp.where(valid, idx[None] - 1, -1).astype(jnp.int32)
    if score is None:
        score = jnp.where(valid, 0.0, -jnp.inf)
    return Tree(
        tokens=tokens,
        parents=parents,
        depth=jnp.where(valid, idx[None], 0),
        num_nodes=num_nodes,
        score=score.astype(jnp.float32),
    )


def truncate(tree: Tree, room: jax.Array) -> Tree:
    """Cut each request's tree to at most `room[b]` (>= 1) nodes: keeps a prefix in topological
    order, which is prefix-connected. Used when a request's KV capacity is nearly exhausted."""
    n = tree.tokens.shape[1]
    num = jnp.clip(jnp.minimum(tree.num_nodes, room), 1, n)
    valid = jnp.arange(n)[None] < num[:, None]
    return Tree(
        tokens=jnp.where(valid, tree.tokens, 0),
        parents=jnp.where(valid, tree.parents, -1),
        depth=jnp.where(valid, tree.depth, 0),
        num_nodes=num,
        score=jnp.where(valid, tree.score, -jnp.inf),
    )
