"""Tree verification forward of the hybrid target, and the commit of the accepted path.

verify_forward runs every node of each request's draft tree through the target in ONE forward:
  * GDN layers: the tree causal conv, then the tree gated delta rule from the ONE committed state
    (`bole`: closed form, returns token-level factors; `pernode`: the SGLang-style baseline with
    one full state per node; `chain`: one snapshot per position, chains only);
  * attention layers: the node keys/values are written after each request's committed prefix
    (slot lengths + i), and each node attends to the prefix plus its ancestors-or-self;
  * positions are lengths + depth.
Nothing committed is modified (the KV rows after the prefix are scratch). `commit` then folds in
the accepted path: GDN state and conv state at the last accepted node, KV rows of the path moved
to consecutive slots, lengths advanced.

Lazy commit (bole, when the cache's GDN layers carry a `pending`: model/cache.py). The commit
does not rebuild the state: it keeps the step's factors and accepted path in the cache
(`PendingPath`: no kernel at all; or, with `KernelOptions.lazy_rows` "gather", the path's rows
gathered by `tree_gdn_commit.pending_commit`), and the next step's verify folds the path's rows
into the state tile it loads anyway (`tree_gdn_verify(pending=...)`) and puts that state into the cache, the pending
then being cleared: one read + write of the fp32 state per step instead of the eager commit's
read + write plus the verify's read. The committed state is `committed_state` throughout.
Without a pending (eager bole, pernode, chain) everything is as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from bole_jax.model import logits as lm_logits
from bole_jax.model import parallel
from bole_jax.model.blocks import attention_layer, mlp_block, take_kv, write_kv
from bole_jax.model.cache import (
    AttnCache,
    Cache,
    GDNCache,
    committed_state,
    empty_pending_like,
    pending_rows,
)
from bole_jax.model.config import LINEAR, ModelConfig
from bole_jax.model.layers import _split_qkv, gdn_in_proj, gdn_out, rms_norm
from bole_jax.pallas import tree_conv, tree_gdn, tree_gdn_commit, tree_pernode
from bole_jax.pallas.factors import PendingPath, TreeFactors
from bole_jax.pallas.tree_utils import TreeStructure, resolve_backend, tree_structure
from bole_jax.spec_decode import state_factors
from bole_jax.spec_decode.acceptance import Accepted, NodeLogits
from bole_jax.spec_decode.tree import Tree
from bole_jax.spec_decode.tree import truncate as tree_truncate

GDN_MODES = ("bole", "pernode", "chain")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNVerifyOut:
    """What one GDN layer's verify leaves for the commit (only one of factors / node_states is set).

    conv_in: [B, N, C] pre-conv inputs of the nodes (bole: the conv commit reads the accepted path).
    factors: TreeFactors (bole): k [B, N, Hk, dk] (the verify's own keys, bf16 in a model) with
      k_scale [B, N, Hk], u [B, N, HV, dv], gamma [B, N, HV].
    node_states: [B, N, HV, dv, dk] fp32 (pernode / chain): the baseline's per-node state scratch,
      transposed (tree_pernode's default "vk" layout, as SGLang's).
    conv_windows: [B, N, K-1, C] (pernode / chain): each node's conv window scratch.
    """

    conv_in: Any = None
    factors: Any = None
    node_states: Any = None
    conv_windows: Any = None


@dataclasses.dataclass(frozen=True)
class RowPacking:
    """The nodes a step verifies, packed into `rows` rows (`pack_rows`).

    The target's matmuls (projections, MLP, lm_head) run over the packed rows, so their work is
    set by the batch-wide budget instead of every request's N node slots; the tree GDN kernels
    and the attention run on the [B, N] layout, unpacked (zeros at nodes not verified).
    src [P]: the flat node index b * N + i of packed row k (0 for spare rows); dest [B, N]: the
    packed row of node (b, i), P where the node is not verified; shape: (B, N)."""

    src: jax.Array
    dest: jax.Array
    shape: tuple[int, int]

    def pack(self, x: jax.Array) -> jax.Array:
        """[B, N, ...] -> [1, P, ...]."""
        b, n = self.shape
        return x.reshape(b * n, *x.shape[2:])[self.src][None]

    def unpack(self, y: jax.Array) -> jax.Array:
        """[1, P, ...] -> [B, N, ...], zeros at the nodes not verified."""
        y = jnp.concatenate([y[0], jnp.zeros((1, *y.shape[2:]), y.dtype)])
        return y[self.dest]


def packed_rows(batch: int, num_nodes: int, budget: int | None) -> int | None:
    """Rows of a packed verify: the batch-wide budget, or the B active roots where it is smaller
    (`budget.select_counts` always verifies them); None (no packing) where that is every slot."""
    if budget is None:
        return None
    rows = max(budget, batch)
    return rows if rows < batch * num_nodes else None


def pack_rows(tree: Tree, active: jax.Array | None, rows: int) -> tuple[Tree, RowPacking]:
    """The tree's nodes of active requests, in request order, packed into `rows` rows.

    A request whose nodes would run past the last row is truncated there (a suffix of its nodes:
    a parent always precedes its children); with `packed_rows` and the budget's selection none
    is. Inactive requests (active False) verify nothing: their rows read zeros."""
    b, n = tree.tokens.shape
    if active is None:
        active = jnp.ones((b,), bool)
    count = jnp.where(active, tree.num_nodes, 0)
    start = jnp.cumsum(count) - count
    tree = tree_truncate(tree, jnp.where(active, rows - start, n))
    keep = (tree.valid & active[:, None]).reshape(-1)
    rank = jnp.cumsum(keep) - 1
    dest = jnp.where(keep, rank, rows).astype(jnp.int32)
    src = (
        jnp.zeros((rows,), jnp.int32).at[dest].set(jnp.arange(b * n, dtype=jnp.int32), mode="drop")
    )
    return tree, RowPacking(src=src, dest=dest.reshape(b, n), shape=(b, n))


def verify_logits(params, cfg: ModelConfig, hidden: jax.Array, packing: RowPacking | None):
    """fp32 logits of the verify's hidden [B, N, H]: [B, N, V], or with a packing the lm_head over
    its packed rows, left packed (`acceptance.NodeLogits`: the acceptance reads them by node)."""
    if packing is None:
        return lm_logits(params, cfg, hidden)
    return NodeLogits(rows=lm_logits(params, cfg, packing.pack(hidden))[0], dest=packing.dest)


def tree_attention_mask(lengths: jax.Array, ts: TreeStructure, capacity: int) -> jax.Array:
    """[B, N, S] bool: node i sees the committed prefix and its ancestors-or-self (at slot L + j)."""
    s = jnp.arange(capacity)[None, None, :]
    rel = s - lengths[:, None, None]  # tree node index of slot s
    n = ts.anc.shape[1]
    in_tree = (rel >= 0) & (rel < n)
    anc = jnp.take_along_axis(
        ts.anc, jnp.clip(rel, 0, n - 1).astype(jnp.int32).repeat(n, axis=1), axis=2
    )
    return (rel < 0) | (in_tree & anc)


def _gdn_tree_core(
    conv_w,
    qkv,
    g,
    beta,
    cache: GDNCache,
    tree: Tree,
    ts: TreeStructure,
    *,
    cfg: ModelConfig,
    mode: str,
    backend: str,
    depth_bound: int | None = None,
):
    """Tree conv + tree gated delta rule of one GDN layer. Returns (o [B, N, HV, dv], GDNVerifyOut,
    state): state [B, HV, dk, dv] fp32 is the committed state the verify started from when the
    cache carried a pending commit (it was folded in: the cache takes it), else None."""
    # A pending commit: bole folds it in inside its verify; the baselines read it materialised.
    settled = cache.pending is not None and mode != "bole"
    state = committed_state(cache) if settled else cache.state
    new_state = state if settled else None
    if mode == "bole":
        y = tree_conv.tree_causal_conv(
            qkv, cache.conv, conv_w, tree.parents, tree.num_nodes, backend=backend
        )
        aux = GDNVerifyOut(conv_in=qkv)
    else:
        y, windows = tree_pernode.tree_pernode_conv(
            qkv, cache.conv, conv_w, tree.parents, tree.num_nodes, backend=backend
        )
        aux = GDNVerifyOut(conv_windows=windows)
    q, k, v = _split_qkv(y, cfg)
    if mode == "bole" and cache.pending is not None:
        # Lazy commit: the verify folds last step's accepted rows into the state it loads.
        o, factors, new_state = tree_gdn.tree_gdn_verify(
            q,
            k,
            v,
            g,
            beta,
            cache.state,
            tree.parents,
            tree.num_nodes,
            backend=backend,
            tree=ts,
            pending=cache.pending,
            depth_bound=depth_bound,
            options=cfg.kernels,
        )
        aux = dataclasses.replace(aux, factors=factors)
    elif mode == "bole":
        o, factors = tree_gdn.tree_gdn_verify(
            q,
            k,
            v,
            g,
            beta,
            state,
            tree.parents,
            tree.num_nodes,
            backend=backend,
            tree=ts,
            depth_bound=depth_bound,
            options=cfg.kernels,
        )
        aux = dataclasses.replace(aux, factors=factors)
    elif mode == "pernode":
        o, states = tree_pernode.tree_pernode_verify(
            q, k, v, g, beta, state, tree.parents, tree.num_nodes, backend=backend, tree=ts
        )
        aux = dataclasses.replace(aux, node_states=states)
    else:
        o, states = tree_pernode.chain_verify(
            q, k, v, g, beta, state, tree.parents, tree.num_nodes, backend=backend
        )
        aux = dataclasses.replace(aux, node_states=states)
    return o, aux, new_state


def _gdn_tree_layer(
    p,
    x,
    cache: GDNCache,
    tree: Tree,
    ts: TreeStructure,
    cfg: ModelConfig,
    mode: str,
    backend: str,
    depth_bound: int | None = None,
    packing: RowPacking | None = None,
):
    """One GDN layer's verify: (output [B, N, H], GDNVerifyOut, the layer's cache afterwards: its
    pending commit, if any, folded into the state and cleared). With a packing, x and the output
    are packed rows [1, P, H]; the conv and the tree kernels run on the [B, N] layout."""
    qkv, z, g, beta = gdn_in_proj(p, x, cfg)
    if packing is not None:
        qkv, g, beta = packing.unpack(qkv), packing.unpack(g), packing.unpack(beta)
    # Tensor parallelism: the kernels run per device on its own heads (parallel.py).
    heads = parallel.split_at(2)
    aux_specs = (
        GDNVerifyOut(
            conv_in=heads, factors=TreeFactors(k=heads, u=heads, gamma=heads, k_scale=heads)
        )
        if mode == "bole"
        else GDNVerifyOut(node_states=heads, conv_windows=parallel.split_at(3))
    )
    lazy = cache.pending is not None
    core = parallel.over_gdn_heads(
        functools.partial(
            _gdn_tree_core,
            cfg=parallel.gdn_local_cfg(cfg),
            mode=mode,
            backend=backend,
            depth_bound=depth_bound,
        ),
        cfg,
        in_specs=(
            parallel.split_at(1),
            heads,
            heads,
            heads,
            parallel.gdn_cache_specs(cfg, pending=cache.pending),
            parallel.REPLICATED,
            parallel.REPLICATED,
        ),
        out_specs=(heads, aux_specs, parallel.split_at(1) if lazy else None),
    )
    o, aux, state = core(p["conv_w"], qkv, g, beta, cache, tree, ts)
    if lazy:  # the pending rows are in `state` now
        cache = GDNCache(conv=cache.conv, state=state, pending=empty_pending_like(cache.pending))
    if packing is not None:
        o = packing.pack(o)
    return gdn_out(p, o.astype(x.dtype), z, cfg), aux, cache


def verify_forward(
    params,
    cfg: ModelConfig,
    tree: Tree,
    cache: Cache,
    *,
    mode: str = "bole",
    backend: str = "auto",
    depth_bound: int | None = None,
    packing: RowPacking | None = None,
):
    """Run all tree nodes through the target.

    Returns hidden [B, N, H] (after the final norm), the cache with the node KV rows written after
    each prefix (lengths unchanged, committed rows untouched; a GDN layer's pending commit, if
    any, is folded into its state and cleared: the committed state is the same), and one
    GDNVerifyOut per GDN layer (None for attention layers). depth_bound: the most nodes on a root
    path of these trees (the tree shape's depth + 1, which no tree of the step exceeds), or None:
    lets the bole kernel unroll its inverse for that depth (`tree_gdn_verify`). packing
    (`pack_rows`, with the tree it returns): the matmuls run over its packed rows; hidden is
    returned unpacked (zeros at the nodes not verified).
    """
    if mode not in GDN_MODES:
        raise ValueError(f"unknown GDN verify mode {mode!r}; expected one of {GDN_MODES}")
    ts = tree_structure(tree.parents, tree.num_nodes)
    positions = cache.lengths[:, None] + tree.depth  # [B, N]
    n = tree.tokens.shape[1]
    slots = jnp.where(tree.valid, cache.lengths[:, None] + jnp.arange(n)[None], 2**30)
    mask = None
    tokens = tree.tokens
    if packing is not None:
        tokens, positions_in = packing.pack(tokens), packing.pack(positions)
    else:
        positions_in = positions
    x = parallel.embed_lookup(params["embed"], tokens, cfg)
    layers, auxs = [], []
    for i, (lp, c) in enumerate(zip(params["layers"], cache.layers)):
        if cfg.layer_types[i] == LINEAR:
            h, aux, c = _gdn_tree_layer(
                lp["gdn"],
                rms_norm(x, lp["input_norm"], cfg.rms_norm_eps),
                c,
                tree,
                ts,
                cfg,
                mode,
                backend,
                depth_bound,
                packing,
            )
            x = mlp_block(lp, x + h, cfg)
        else:
            if mask is None:
                mask = tree_attention_mask(cache.lengths, ts, c.capacity)
            x, c = attention_layer(lp, x, positions_in, c, slots, mask, cfg, packing)
            aux = None
        layers.append(c)
        auxs.append(aux)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if packing is not None:
        hidden = packing.unpack(hidden)
    return hidden, Cache(layers=tuple(layers), lengths=cache.lengths), tuple(auxs)


def _commit_state(state, factors, parents, last, path, count, cfg: ModelConfig | None):
    """tree_gdn_commit.commit_state with the step's accepted path (no walk per layer), per device
    on its own heads under tensor parallelism; the Pallas commit's fold is cfg.kernels.commit_fold
    ("auto" without a cfg)."""
    fold = "auto" if cfg is None else cfg.kernels.commit_fold

    def commit(s, f, p, a, pa, c):  # positional: shard_map maps its in_specs onto these
        return tree_gdn_commit.commit_state(s, f, p, a, path=pa, count=c, fold=fold)

    if cfg is None:
        return commit(state, factors, parents, last, path, count)
    heads = parallel.split_at(1)
    f = parallel.split_at(2)
    rep = parallel.REPLICATED
    return parallel.over_gdn_heads(
        commit,
        cfg,
        in_specs=(heads, TreeFactors(k=f, u=f, gamma=f, k_scale=f), rep, rep, rep, rep),
        out_specs=heads,
    )(state, factors, parents, last, path, count)


def _fused_commit(cfg: ModelConfig | None) -> bool:
    """Whether the eager bole commit of every GDN layer is one launch
    (`KernelOptions.fused_commit`, on the GPU's Pallas backend only: elsewhere each layer
    takes the jnp reference)."""
    return (
        cfg is not None
        and cfg.kernels.fused_commit
        and resolve_backend("auto", None)[0] == "pallas"
    )


def _commit_states(states, factors, last, path, count, cfg: ModelConfig):
    """tree_gdn_commit.commit_states: every GDN layer's commit in one launch, per device on its
    own heads under tensor parallelism."""
    fold = cfg.kernels.commit_fold

    def commit(s, f, a, pa, c):
        return tree_gdn_commit.commit_states(s, f, a, pa, c, fold=fold)

    heads, f = parallel.split_at(1), parallel.split_at(2)
    rep = parallel.REPLICATED
    spec = TreeFactors(k=f, u=f, gamma=f, k_scale=f)
    return parallel.over_gdn_heads(
        commit,
        cfg,
        in_specs=((heads,) * len(states), (spec,) * len(states), rep, rep, rep),
        out_specs=(heads,) * len(states),
    )(tuple(states), tuple(factors), last, path, count)


def _commit_pernode_state(state, node_states, last, cfg: ModelConfig | None):
    """tree_pernode.commit_pernode_state (the baselines' copy of the accepted node's scratch
    state), per device on its own heads under tensor parallelism. Outside shard_map its Pallas
    launch (B >= 2 on GPU) is a custom call XLA cannot partition: it gathered every device's
    scratch (all nodes' states of the layer) before the commit, ~27 ms per step at 80B TP = 2
    B = 4."""
    if cfg is None:
        return tree_pernode.commit_pernode_state(state, node_states, last)
    return parallel.over_gdn_heads(
        tree_pernode.commit_pernode_state,
        cfg,
        in_specs=(parallel.split_at(1), parallel.split_at(2), parallel.REPLICATED),
        out_specs=parallel.split_at(1),
    )(state, node_states, last)


def _pending_rows(factors, parents, last, path, count, length: int, cfg: ModelConfig | None):
    """tree_gdn_commit.pending_commit with the step's accepted path, per device on its own heads under
    tensor parallelism (the rows come out split like the cache's pending:
    `parallel.pending_specs`)."""

    def rows(f, p, a, pa, c):
        return tree_gdn_commit.pending_commit(f, p, a, length, pa, c)

    if cfg is None:
        return rows(factors, parents, last, path, count)
    f = parallel.split_at(2)
    rep = parallel.REPLICATED
    return parallel.over_gdn_heads(
        rows,
        cfg,
        in_specs=(TreeFactors(k=f, u=f, gamma=f, k_scale=f), rep, rep, rep, rep),
        out_specs=parallel.pending_specs(cfg),
    )(factors, parents, last, path, count)


def commit(
    cache: Cache,
    auxs,
    tree: Tree,
    acc: Accepted,
    active: jax.Array,
    *,
    mode: str = "bole",
    cfg: ModelConfig | None = None,
) -> Cache:
    """Fold the accepted path into the cache. Inactive requests (active False) are left unchanged.

    GDN: the state at the last accepted node (bole eager: rebuilt from factors, one gather +
    matmul; bole lazy, when the cache's layer carries a `pending`: the step's factors and accepted
    path kept in it (`PendingPath`; or the path's rows gathered into a `PendingCommit`), for the
    next verify to fold in (module docstring); baselines: a copy of that node's scratch state) and
    the conv state along the accepted path.
    Attention: the path's KV rows move from slot L + path[j] to slot L + j.
    cfg: read under tensor parallelism (cfg.tp > 1: the state commit runs per device) and for
    the commit's fold (`KernelOptions.commit_fold`).
    """
    last = jnp.where(active, acc.last, -1)  # -1: keep the committed state
    num = jnp.where(active, acc.num_accepted, 0)
    d1 = acc.path.shape[1]
    j = jnp.arange(d1)[None]
    src = cache.lengths[:, None] + acc.path
    dst = jnp.where(j < num[:, None], cache.lengths[:, None] + j, 2**30)
    layers = []
    fused = mode == "bole" and _fused_commit(cfg)
    one_launch = []  # (layer index, state, factors) of the GDN layers committed together
    for c, aux in zip(cache.layers, auxs):
        if isinstance(c, GDNCache):
            state, pending = c.state, c.pending  # pending: cleared by verify_forward (now in state)
            if mode != "bole":
                state = _commit_pernode_state(c.state, aux.node_states, last, cfg)
                conv = tree_pernode.commit_pernode(c.conv, aux.conv_windows, last)
            else:
                conv = state_factors.commit_conv_state(c.conv, aux.conv_in, tree.parents, last)
                # The accepted path (root first, num nodes) is the step's: no walk up the parents
                # per layer; inactive requests (last -1) get count 0 and keep their state.
                if pending is None and fused:
                    state = None  # committed below with every other GDN layer, one launch
                    one_launch.append((len(layers), c.state, aux.factors))
                elif pending is None:
                    state = _commit_state(
                        c.state, aux.factors, tree.parents, last, acc.path, num, cfg
                    )
                else:  # lazy: inactive requests (last -1, count 0) leave nothing pending
                    length = pending_rows(pending)
                    assert length >= d1, (
                        f"pending rows ({length}) < nodes on an accepted path ({d1})"
                    )
                    if isinstance(pending, PendingPath):  # the factors themselves: no kernel here
                        path = jnp.pad(acc.path.astype(jnp.int32), ((0, 0), (0, length - d1)))
                        pending = PendingPath(
                            factors=aux.factors,
                            path=path,
                            sel=last.astype(jnp.int32),
                            count=num.astype(jnp.int32),
                        )
                    else:
                        pending = _pending_rows(
                            aux.factors, tree.parents, last, acc.path, num, length, cfg
                        )
            layers.append(GDNCache(conv=conv, state=state, pending=pending))
        else:
            k_rows, v_rows = take_kv(c.k, src), take_kv(c.v, src)
            layers.append(AttnCache(k=write_kv(c.k, k_rows, dst), v=write_kv(c.v, v_rows, dst)))
    if one_launch:
        where, states, factors = zip(*one_launch)
        new = _commit_states(states, factors, last, acc.path, num, cfg)
        for i, state in zip(where, new):
            layers[i] = dataclasses.replace(layers[i], state=state)
    return Cache(layers=tuple(layers), lengths=cache.lengths + num)
