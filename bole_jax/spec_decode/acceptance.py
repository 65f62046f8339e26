"""Lossless acceptance over a verified draft tree.

Walk from the root. At the current node the target distribution p is the node's own output row
(after temperature / top-k / top-p: `bole_jax.sampling.target_probs`). Its children are tried in
index order with a *residual* r (initially p):

    accept child c with probability r(c) / sum(r);  on rejection set r(c) = 0.

If a child is accepted, descend into it; otherwise emit the bonus token sampled from r / sum(r)
and stop. Draft children here are deterministic (top-k of the draft distribution, not samples),
so this is the "target-only" multi-candidate rule that treats each tried draft as a one-hot
proposal. It is exactly lossless: P(emit x) = p(x) for every token x, by induction over the
tried children (each is accepted with its share of the remaining mass). Greedy requests
(temperature 0) have a one-hot p, so the same rule accepts exactly the child equal to the
target argmax and the bonus is the argmax: the greedy case needs no separate maths, only a
cheaper path that skips the softmax/sort (`accept_greedy`).

`accept_simulated` is not an acceptance rule but a benchmark device (SpecConfig.simulate_accept):
it accepts a random-length prefix of one root path of the tree whatever the target says, so that
random-weight models, which no drafter predicts, run at a chosen acceptance rate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.sampling import (
    SamplingParams,
    greedy_or_sampled,
    sample_from_probs,
    target_probs,
    uniform,
)
from bole_jax.spec_decode.drafter import unroll_levels
from bole_jax.spec_decode.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    path: jax.Array  # [B, D+1] int32 node indices along the accepted path (path[0] = root)
    num_accepted: jax.Array  # [B] int32 nodes on the path, root included (>= 1)
    bonus: jax.Array  # [B] int32 token sampled at the last accepted node
    tokens: jax.Array  # [B, D+1] int32 tokens to emit: accepted drafts then the bonus

    @property
    def last(self) -> jax.Array:
        """[B] the last accepted node (whose state is committed)."""
        return jnp.take_along_axis(self.path, (self.num_accepted - 1)[:, None], axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NodeLogits:
    """The verify's fp32 logits of a packed verify (`verify.RowPacking`), left packed: rows [P, V]
    the verified nodes' logits, dest [B, N] the row of node (b, i) (P where it is not verified:
    read as zeros, as `RowPacking.unpack` gives). The acceptance reads a few nodes' rows
    (`node_rows`) and the argmax of every node (`node_argmax`), so the [B, N, V] array (B x N x V x
    4 bytes written and read again) is never formed. Everything here also takes plain [B, N, V]
    logits."""

    rows: jax.Array
    dest: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.dest.shape, self.rows.shape[-1])


def node_rows(logits: jax.Array | NodeLogits, nodes: jax.Array) -> jax.Array:
    """[B, K, V] logits of nodes [B, K] (node indices per request)."""
    if isinstance(logits, NodeLogits):
        idx = jnp.take_along_axis(logits.dest, nodes, axis=1)
        return jnp.take(logits.rows, idx, axis=0, mode="fill", fill_value=0)
    return jnp.take_along_axis(logits, nodes[:, :, None], axis=1)


def node_argmax(logits: jax.Array | NodeLogits) -> jax.Array:
    """[B, N] int32 argmax token of every node (0 at a node not verified of a packed verify)."""
    if isinstance(logits, NodeLogits):
        ids = jnp.argmax(logits.rows, axis=-1).astype(jnp.int32)
        return jnp.take(ids, logits.dest, axis=0, mode="fill", fill_value=0)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _children(tree: Tree, node: jax.Array, max_children: int) -> tuple[jax.Array, jax.Array]:
    """First `max_children` children of `node [B]` in index order: (idx [B, C], valid [B, C])."""
    n = tree.parents.shape[1]
    is_child = (tree.parents == node[:, None]) & tree.valid
    key = jnp.where(is_child, jnp.arange(n)[None], n + jnp.arange(n)[None])
    idx = jnp.argsort(key, axis=-1)[:, :max_children]
    return idx, jnp.take_along_axis(is_child, idx, axis=-1)


def _finish(tree: Tree, path, num, bonus) -> Accepted:
    d1 = path.shape[1]
    drafts = jnp.take_along_axis(tree.tokens, path, axis=1)
    j = jnp.arange(d1)[None]
    shifted = jnp.concatenate([drafts[:, 1:], jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(
        j < num[:, None] - 1, shifted, jnp.where(j == num[:, None] - 1, bonus[:, None], 0)
    )
    return Accepted(path=path, num_accepted=num, bonus=bonus, tokens=tokens.astype(jnp.int32))


def _walk(level, max_depth: int, carry, unroll: bool):
    """The acceptance walk's `max_depth` levels, `level(d, carry) -> carry`: unrolled, or one
    `lax.fori_loop`. On the GPU a loop body runs outside XLA's command buffers, every one of its
    kernels launched on its own, each trip (in the demo model's step at B = 1 the greedy walk's 8
    trips were 56 of the accept stage's 66 kernels; one H100, 45bb410); unrolled they join the
    step's command buffers, but only outside a `lax.cond`: unrolled inside the cond's branch of
    `accept`, the same step took 1.12-1.22 ms against the loop's 1.02 (docs/design-decisions.md,
    "A static greedy program"). `accept` unrolls the walk of a static greedy batch where the
    drafter unrolls its levels (`drafter.unroll_levels`) and keeps the loop under the cond."""
    if unroll:
        for d in range(max_depth):
            carry = level(d, carry)
        return carry
    return jax.lax.fori_loop(0, max_depth, level, carry)


def accept_greedy(
    tree: Tree, target_tok: jax.Array, max_depth: int, unroll: bool = False
) -> Accepted:
    """Greedy acceptance. target_tok [B, N] = argmax of the target at every node; `unroll`: the
    walk's levels unrolled (`_walk`)."""
    b, n = tree.tokens.shape
    path = jnp.zeros((b, max_depth + 1), jnp.int32)

    def body(d, carry):
        path, num, cur, alive = carry
        want = jnp.take_along_axis(target_tok, cur[:, None], axis=1)  # [B, 1]
        match = (tree.parents == cur[:, None]) & tree.valid & (tree.tokens == want)
        hit = jnp.any(match, axis=1) & alive
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)  # first matching child
        cur = jnp.where(hit, nxt, cur)
        path = path.at[:, d + 1].set(jnp.where(hit, nxt, 0))
        return path, num + hit.astype(jnp.int32), cur, hit

    path, num, cur, _ = _walk(
        body,
        max_depth,
        (path, jnp.ones((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)),
        unroll,
    )
    bonus = jnp.take_along_axis(target_tok, cur[:, None], axis=1)[:, 0]
    return _finish(tree, path, num, bonus)


def accept_stochastic(
    tree: Tree,
    logits: jax.Array | NodeLogits,
    sp: SamplingParams,
    key: jax.Array,
    max_depth: int,
    max_children: int,
    unroll: bool = False,
) -> Accepted:
    """Multi-candidate tree speculative sampling (module docstring). logits [B, N, V] or
    NodeLogits; `unroll`: the walk's levels unrolled (`_walk`)."""
    b, n, _ = logits.shape
    path = jnp.zeros((b, max_depth + 1), jnp.int32)

    def level(d, carry):
        path, num, cur, alive, resid, key = carry
        key, k_try = jax.random.split(key)
        row = node_rows(logits, cur[:, None])[:, 0]  # [B, V]
        r = target_probs(row, sp)
        kids, kid_ok = _children(tree, cur, max_children)
        kid_tok = jnp.take_along_axis(tree.tokens, kids, axis=1)  # [B, C]
        u = uniform(k_try, sp, kid_ok.shape)  # per row: independent of the batch (sampling.py)
        acc_any = jnp.zeros((b,), bool)
        acc_idx = jnp.zeros((b,), jnp.int32)
        for c in range(max_children):  # children in index order, residual updated on rejection
            tok = kid_tok[:, c]
            pc = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
            try_it = kid_ok[:, c] & ~acc_any
            ok = try_it & (u[:, c] * jnp.sum(r, axis=1) < pc)
            acc_idx = jnp.where(ok, kids[:, c], acc_idx)
            acc_any |= ok
            reject = try_it & ~ok
            r = jnp.where(reject[:, None] & (jnp.arange(r.shape[1])[None] == tok[:, None]), 0.0, r)
        hit = acc_any & alive
        # The residual at the node where the walk stops is what the bonus token is drawn from.
        resid = jnp.where((alive & ~hit)[:, None], r, resid)
        cur = jnp.where(hit, acc_idx, cur)
        path = path.at[:, d + 1].set(jnp.where(hit, acc_idx, 0))
        return path, num + hit.astype(jnp.int32), cur, hit, resid, key

    v = logits.shape[-1]
    key, k_bonus = jax.random.split(key)
    carry = (
        path,
        jnp.ones((b,), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), bool),
        jnp.zeros((b, v), jnp.float32),
        key,
    )
    path, num, cur, alive, resid, _ = _walk(level, max_depth, carry, unroll)
    # Walks that reached max_depth still alive stop at a leaf-by-depth: sample from its full p.
    row = node_rows(logits, cur[:, None])[:, 0]
    resid = jnp.where(alive[:, None], target_probs(row, sp), resid)
    bonus = sample_from_probs(resid, k_bonus, sp)
    return _finish(tree, path, num, bonus)


def deepest_path(tree: Tree, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """The root path to the tree's deepest node (ties: the best draft score rho, then the lowest
    index): (path [B, D+1] node indices, path[0] = the root, 0 past the node; its depth [B])."""
    b = tree.tokens.shape[0]
    valid = tree.valid
    depth = jnp.max(jnp.where(valid, tree.depth, -1), axis=1)  # >= 0: the root is always valid
    deepest = valid & (tree.depth == depth[:, None])
    score = jnp.where(deepest, jnp.maximum(tree.score, jnp.finfo(jnp.float32).min), -jnp.inf)
    cur = jnp.argmax(score, axis=1).astype(jnp.int32)  # first of the best: the lowest index
    path = jnp.zeros((b, max_depth + 1), jnp.int32)
    for d in range(max_depth, -1, -1):  # from the node up to the root
        on = d <= depth
        path = path.at[:, d].set(jnp.where(on, cur, 0))
        parent = jnp.take_along_axis(tree.parents, cur[:, None], axis=1)[:, 0]
        cur = jnp.where(on, jnp.maximum(parent, 0), cur)
    return path, depth


def accept_simulated(
    tree: Tree,
    logits: jax.Array | NodeLogits,
    sp: SamplingParams,
    key: jax.Array,
    accept_prob: float,
    max_depth: int,
) -> Accepted:
    """Simulated acceptance (benchmarks only, SpecConfig.simulate_accept): not lossless.

    Per request, the drafted tokens along `deepest_path` are accepted level by level, each next
    level with probability `accept_prob` (independent draws per request: `sampling.uniform`), up
    to the path's end: L accepted drafts with P(L >= d) = accept_prob**d for d <= the path's depth.
    The bonus is the target's own token at the last accepted node (its argmax for greedy rows, a
    sample of its distribution otherwise). The result has the form of a real acceptance of that
    path, so the commit, the KV and the GDN state updates are those of a real step. Expected
    tokens per step with a tree of depth D: 1 + p + ... + p**D (`expected_tokens_per_step` below).
    """
    b, n = tree.tokens.shape
    k_len, k_bonus = jax.random.split(key)
    path, depth = deepest_path(tree, max_depth)
    u = uniform(k_len, sp, (b, max_depth))
    run = jnp.sum(jnp.cumprod((u < accept_prob).astype(jnp.int32), axis=1), axis=1)
    num = 1 + jnp.minimum(run, depth).astype(jnp.int32)
    path = jnp.where(jnp.arange(max_depth + 1)[None] < num[:, None], path, 0)
    last = jnp.take_along_axis(path, (num - 1)[:, None], axis=1)  # [B, 1]

    def greedy():  # the argmax at every node, as accept_greedy computes it (the same cost)
        return jnp.take_along_axis(node_argmax(logits), last, axis=1)[:, 0]

    def sampled():
        row = node_rows(logits, last)[:, 0]
        return sample_from_probs(target_probs(row, sp), k_bonus, sp)

    return _finish(tree, path, num, greedy_or_sampled(sp, greedy, sampled))


def accept(
    tree: Tree,
    logits: jax.Array | NodeLogits,
    sp: SamplingParams,
    key: jax.Array,
    *,
    max_depth: int,
    max_children: int,
) -> Accepted:
    """Greedy fast path when the whole batch is greedy, the stochastic rule otherwise: statically
    for a batch marked greedy on the host (`SamplingParams.greedy`: no `lax.cond`, the walk
    unrolled where the drafter's levels are), else under a `lax.cond` on the temperatures, the
    walk in its loop (`greedy_or_sampled`)."""
    return greedy_or_sampled(
        sp,
        lambda: accept_greedy(tree, node_argmax(logits), max_depth, sp.greedy and unroll_levels()),
        lambda: accept_stochastic(tree, logits, sp, key, max_depth, max_children),
    )


# ---------------------------------------------------------------- synthetic acceptance rates


def expected_tokens_per_step(p: float, drafts: int) -> float:
    """Synthetic drafter: tokens emitted per step (accepted drafts + the bonus) when the correct
    chain of `drafts` tokens is in the tree and each depth is kept with probability p."""
    return 1.0 + sum(p**d for d in range(1, drafts + 1))


def synthetic_accept_prob(mean_tokens: float, depth: int) -> float:
    """p with expected_tokens_per_step(p, depth) = mean_tokens (bisection)."""
    if not 1.0 < mean_tokens < depth + 1:
        raise ValueError(
            f"mean tokens per step must lie in (1, depth + 1 = {depth + 1}), got {mean_tokens}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, depth) < mean_tokens else (lo, mid)
    return (lo + hi) / 2
