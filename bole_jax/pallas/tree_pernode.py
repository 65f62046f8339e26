"""Baselines that keep a full recurrent state per tree node (docs/kernels.md, baselines).

TREE-PERNODE (SGLang's tree mode, topk > 1): one program per (request, value head, value tile)
walks the nodes in topological order. Node i starts from its parent's full state tile, reloaded
from a per-node scratch buffer (or the committed state for parent -1), does the gated delta step
    S *= exp(g_i);  v' = b_i (v_i - S^T k_i);  S += k_i v'^T;  o_i = S^T (s q_i)
and stores its own full state into the scratch [B, N, HV, dk, dv] fp32. The commit copies the
accepted node's state into the request's slot. Memory: N full states per request per GDN layer.

Kept honest (it is the yardstick of the speedups): the [dk, block_v] state tile lives in
registers, is reused without a reload when the parent is the previous node (chain segments),
q/k normalisation is fused, loads/stores are masked, launch parameters are tunable.

CHAIN (vLLM style, topk = 1): the same kernel for a chain (parent i-1): the state never leaves
registers; one snapshot per position; the commit gathers snapshot `accepted`.

`tree_pernode_conv` is the baseline's conv handling: each node convolves its window and stores
its own (K-1)-row window into a per-node conv scratch [B, N, K-1, C]; commit = copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas import tree_conv, tree_gdn_ref
from bole_jax.pallas.tree_utils import L2_EPS, dfs_order, next_pow2, pad_axis, resolve_backend

__all__ = [
    "PernodeConfig",
    "tree_pernode_verify",
    "chain_verify",
    "commit_pernode",
    "commit_pernode_state",
    "commit_chain",
    "scratch_layout",
    "tree_pernode_conv",
    "commit_pernode_conv",
]


@dataclasses.dataclass(frozen=True)
class PernodeConfig:
    """Launch parameters: value tile (power of two >= 8 dividing dv; no dot in this kernel, so
    SGLang's narrow tiles are allowed), warps (1 keeps the reductions over dk inside a warp),
    pipeline stages of the node loop (> 1 lets Triton prefetch the next node's q, k, v)."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1
    layout: str = "vk"
    # Hold the committed tile in registers for the whole node loop (a root child then costs no
    # load, and in "vk" no transpose per node): 0 never, 1 always, None when it is at most 64
    # floats per thread.
    hold_root: int | None = None
    # Cache hint on the scratch stores ("evict_first": stream them past L2; None: default).
    # Off in the measured launches (docs/kernels.md, launch table).
    scratch_eviction: str | None = None
    # The order the program walks the nodes in: "index" (0, 1, ..., as SGLang's kernel) or
    # "dfs" (depth-first preorder, `tree_utils.dfs_order`): the walk then leaves a branch only
    # at its leaves, so fewer nodes reload their parent's state from the scratch (random
    # 64-node trees of the benchmark: 32 reloads instead of 57 on average).
    order: str = "index"

    @staticmethod
    def auto(b: int, n: int) -> "PernodeConfig":
        """The launch `tree_pernode_verify` / `chain_verify` use when given none: the winners on
        the H200 at Qwen3-Next dims (docs/kernels.md, launch table). One warp, the "vk" scratch,
        the committed tile held; above 8 nodes at B >= 2 the depth-first walk with 8 columns and
        three stages; at B = 1 the index walk with 8 columns and three stages (the walk's
        indirect loads cost more than its saved reloads there); at N <= 8 and B >= 2, the index
        walk with 16 columns and two stages."""
        if b <= 1:
            return PernodeConfig(block_v=8, num_warps=1, num_stages=3)
        if n <= 8:
            return PernodeConfig(block_v=16, num_warps=1, num_stages=2)
        return PernodeConfig(block_v=8, num_warps=1, num_stages=3, order="dfs")

    def holds_root(self, dk: int, dv: int) -> bool:
        if self.hold_root is not None:
            return bool(self.hold_root)
        return next_pow2(dk) * min(self.block_v, next_pow2(dv)) <= 64 * 32 * self.num_warps

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"PernodeConfig.layout={self.layout!r}: expected one of {LAYOUTS}")
        if self.scratch_eviction not in (None, "evict_first", "evict_last"):
            raise ValueError(
                f"PernodeConfig.scratch_eviction={self.scratch_eviction!r}: "
                "expected None, 'evict_first' or 'evict_last'"
            )
        if self.order not in ORDERS:
            raise ValueError(f"PernodeConfig.order={self.order!r}: expected one of {ORDERS}")


LAYOUTS = ("vk", "kv")
ORDERS = ("index", "dfs")


def scratch_layout(states, layout: str):
    """Per-node states [..., dk, dv] (the pool's layout, the sequential reference's) in the
    scratch's `layout`; the swap is its own inverse, so it also takes a "vk" slot back."""
    return jnp.swapaxes(states, -1, -2) if layout == "vk" else states


def _pernode_kernel(
    nn_ref, par_ref, *refs, n_real, scale, chain, vk, hold_root, eviction, interpret, ordered
):
    # Blocks: par [N]; (ordered: the walk's order [N]); q, k [N, dk]; v [N, bv]; g, beta [N];
    # s [dk, bv]; o [N, bv]; scr [N, bv, dk] ("vk": the tile is held transposed, as stored) or
    # [N, dk, bv] ("kv"). Per node: scalar loads and [dk] / [bv] row vectors.
    ord_ref = refs[0] if ordered else None
    q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, scr_ref = refs[1:] if ordered else refs
    nn = jnp.minimum(nn_ref[...], n_real)
    kax = 1 if vk else 0  # the key axis of the held tile

    def unit(x):
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.sum(x * x) + L2_EPS)

    def pool(mask=None):
        t = s_ref[...] if mask is None else pltriton.load(s_ref, mask=mask, other=0.0)
        return t.T if vk else t

    def along_k(x):  # a [dk] vector broadcast against the held tile
        return x[None, :] if vk else x[:, None]

    def along_v(x):  # a [bv] vector broadcast against the held tile
        return x[:, None] if vk else x[None, :]

    root = pool()

    def node(j, carry):
        # ordered: the carry also holds the previous node's index (-1 before the first)
        s_prev, prev = carry if ordered else (carry, j - 1)
        i = ord_ref[j] if ordered else j  # the j-th node of the walk
        if chain:
            s = s_prev
        else:
            # The carry holds the previous node's state (the committed state before the first,
            # whose "index" is -1), so a parent equal to it costs no reload: chain segments of
            # the tree stay in registers.
            par = par_ref[i]
            reuse = par == prev
            from_pool = jnp.logical_and(par < 0, jnp.logical_not(reuse))
            from_scratch = jnp.logical_and(par >= 0, jnp.logical_not(reuse))
            from_scr = pltriton.load(scr_ref.at[jnp.maximum(par, 0)], mask=from_scratch, other=0.0)
            if hold_root:
                loaded = jnp.where(from_pool, root, from_scr)
            else:
                loaded = pool(from_pool) + from_scr
            s = jnp.where(reuse, s_prev, loaded)
        k, q = unit(k_ref[i]), unit(q_ref[i]) * scale  # [dk]
        s = s * jnp.exp(g_ref[i])
        kv = jnp.sum(s * along_k(k), axis=kax)  # [bv] = S^T k
        vnew = beta_ref[i] * (v_ref[i].astype(jnp.float32) - kv)
        s = s + along_k(k) * along_v(vnew)
        o_ref[i] = jnp.sum(s * along_k(q), axis=kax).astype(o_ref.dtype)
        if eviction is None:
            scr_ref[i] = s
        else:
            pltriton.store(scr_ref.at[i], s, eviction_policy=eviction)
        if not chain and not interpret:
            # A later node may reload this state through other threads of the program.
            pltriton.debug_barrier()
        return (s, i) if ordered else s

    jax.lax.fori_loop(0, nn, node, (root, jnp.int32(-1)) if ordered else root)

    def zero(i, c):
        o_ref[i] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)
        return c

    jax.lax.fori_loop(nn, n_real, zero, 0)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret", "chain"))
def _pernode_pallas(
    q, k, v, g, beta, state, parents, num_nodes, order, *, scale, cfg, interpret, chain
):
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    ratio = hv // hk
    dkp, dvp = next_pow2(dk), next_pow2(dv)
    bv = min(cfg.block_v, dvp)
    if bv < 8 or bv & (bv - 1) or dvp % bv:
        raise ValueError(f"block_v={bv} must be a power of two >= 8 dividing dv={dvp}")
    q, k = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp)
    v = pad_axis(v, 3, dvp)
    state = pad_axis(pad_axis(state.astype(jnp.float32), 2, dkp), 3, dvp)
    vk = cfg.layout == "vk"
    if vk:
        scr_spec = pl.BlockSpec((None, n, None, bv, dkp), lambda t, h, i: (i, 0, h, t, 0))
        scr_shape = (b, n, hv, dvp, dkp)
    else:
        scr_spec = pl.BlockSpec((None, n, None, dkp, bv), lambda t, h, i: (i, 0, h, 0, t))
        scr_shape = (b, n, hv, dkp, dvp)
    qk_spec = pl.BlockSpec((None, n, None, dkp), lambda t, h, i: (i, 0, h // ratio, 0))
    val_spec = pl.BlockSpec((None, n, None, bv), lambda t, h, i: (i, 0, h, t))
    gate_spec = pl.BlockSpec((None, n, None), lambda t, h, i: (i, 0, h))
    row_spec = pl.BlockSpec((None, n), lambda t, h, i: (i, 0))
    ordered = order is not None and not chain
    o, scratch = pl.pallas_call(
        functools.partial(
            _pernode_kernel,
            n_real=n,
            scale=scale,
            chain=chain,
            vk=vk,
            hold_root=cfg.holds_root(dk, dv),
            eviction=cfg.scratch_eviction,
            interpret=interpret,
            ordered=ordered,
        ),
        grid=(dvp // bv, hv, b),  # tiles fastest: programs sharing q, k run together
        in_specs=[
            pl.BlockSpec((None,), lambda t, h, i: (i,)),
            row_spec,
            *([row_spec] if ordered else []),
            qk_spec,
            qk_spec,
            val_spec,
            gate_spec,
            gate_spec,
            pl.BlockSpec((None, None, dkp, bv), lambda t, h, i: (i, h, 0, t)),
        ],
        out_specs=[val_spec, scr_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, hv, dvp), v.dtype),
            jax.ShapeDtypeStruct(scr_shape, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="chain_verify" if chain else "tree_pernode_verify",
    )(
        num_nodes,
        parents,
        *([order] if ordered else []),
        q,
        k,
        v,
        g.astype(jnp.float32),
        beta.astype(jnp.float32),
        state,
    )
    if (dkp, dvp) != (dk, dv):
        o = o[..., :dv]
        scratch = scratch[..., :dv, :dk] if vk else scratch[..., :dk, :dv]
    return o, scratch


def _verify(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents,
    num_nodes,
    scale,
    backend,
    interpret,
    config,
    chain,
    tree=None,
    order=None,
):
    b, n, _, dk = q.shape
    scale = float(dk**-0.5 if scale is None else scale)
    backend, interpret = resolve_backend(backend, interpret)
    if parents is None:
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
    config = config or PernodeConfig.auto(b, n)
    if backend == "reference":
        o, states = tree_gdn_ref.tree_gdn_sequential(
            q, k, v, g, beta, state, parents, num_nodes, scale=scale
        )
        return o.astype(v.dtype), scratch_layout(states, config.layout)
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    parents = jnp.asarray(parents, jnp.int32)
    num_nodes = jnp.asarray(num_nodes, jnp.int32)
    if chain or config.order == "index":
        order = None
    elif order is None:
        order = dfs_order(parents, num_nodes, None if tree is None else tree.anc)
    else:
        order = jnp.asarray(order, jnp.int32)
    return _pernode_pallas(
        q,
        k,
        v,
        g,
        beta,
        state,
        parents,
        num_nodes,
        order,
        scale=scale,
        cfg=config,
        interpret=interpret,
        chain=chain,
    )


def tree_pernode_verify(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents,
    num_nodes=None,
    *,
    scale=None,
    backend="auto",
    interpret=None,
    config: PernodeConfig | None = None,
    tree=None,
    order=None,
):
    """TREE-PERNODE verify. Same inputs as `tree_gdn.tree_gdn_verify`.

    Returns (o [B, N, HV, dv] in v.dtype, node_states fp32): the state after every node (the
    scratch), [B, N, HV, dv, dk] (transposed) in the default layout "vk", [B, N, HV, dk, dv] with
    `config.layout="kv"`; the reference backend follows the same layout. Padding nodes: zero
    output, undefined state. Commit with `commit_pernode_state(..., layout=)`. `config=None`
    takes `PernodeConfig.auto(B, N)`. With `config.order="dfs"` the kernel walks the nodes in
    `order` ([B, N] int32, `tree_utils.dfs_order`; computed here when None, from `tree`'s
    ancestor mask when given): a decode step computes it once for all its layers. A given
    `order` is trusted: any permutation that lists every node after its parent (padding last)
    gives the same results; one that does not gives wrong states silently.
    """
    return _verify(
        q,
        k,
        v,
        g,
        beta,
        state,
        parents,
        num_nodes,
        scale,
        backend,
        interpret,
        config,
        chain=False,
        tree=tree,
        order=order,
    )


def chain_verify(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents=None,
    num_nodes=None,
    *,
    scale=None,
    backend="auto",
    interpret=None,
    config: PernodeConfig | None = None,
):
    """CHAIN verify: nodes form one chain (parents[i] = i - 1; `parents` is not read by the
    kernel). Returns (o, snapshots): the state after each position, in `config.layout` as for
    `tree_pernode_verify`."""
    return _verify(
        q, k, v, g, beta, state, parents, num_nodes, scale, backend, interpret, config, chain=True
    )


@functools.partial(jax.jit, static_argnames=("transpose",))
def commit_pernode(old, per_node, accepted, transpose=False):
    """Copy the accepted node's slot: old [B, ...], per_node [B, N, ...], accepted [B] int32
    (-1 keeps `old`); `transpose` swaps the slot's last two axes on the way. Used for conv
    windows as is; GDN states go through `commit_pernode_state`."""
    accepted = jnp.asarray(accepted, jnp.int32)
    b, n = per_node.shape[:2]
    picked = per_node[jnp.arange(b), jnp.clip(accepted, 0, n - 1)]
    if transpose:
        picked = jnp.swapaxes(picked, -1, -2)
    keep = (accepted < 0).reshape((b,) + (1,) * (old.ndim - 1))
    return jnp.where(keep, old, picked.astype(old.dtype))


def commit_pernode_state(
    old,
    node_states,
    accepted,
    layout: str = "vk",
    *,
    backend="auto",
    interpret=None,
    block_rows: int = 32,
):
    """The GDN state commit of both baselines: the accepted node's state into the pool's
    [B, HV, dk, dv] slot, transposed back from the scratch's "vk" layout (the default of
    `tree_pernode_verify` / `chain_verify`); -1 keeps `old`.

    "vk" on the Pallas backend ("auto": on GPU for B >= 2; dk, dv powers of two) is one
    in-place launch (the pool aliased, `block_rows` scratch rows of dk floats per program,
    transposed in registers), measured faster on the H200 than XLA's gather + transpose +
    select from B = 4 on; at B = 1 XLA was faster (docs/kernels.md, launch table)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if layout == "kv":
        return commit_pernode(old, node_states, accepted)
    if backend == "auto" and old.shape[0] == 1:
        backend = "reference"
    backend, interpret = resolve_backend(backend, interpret)
    dk, dv = old.shape[-2:]
    if backend == "reference" or dk != next_pow2(dk) or dv != next_pow2(dv):
        return commit_pernode(old, node_states, accepted, transpose=True)
    return _commit_transposed_pallas(
        old,
        node_states,
        jnp.asarray(accepted, jnp.int32),
        block_rows=min(block_rows, dv),
        interpret=interpret,
    )


def _commit_transposed_kernel(acc_ref, scr_ref, old_ref, out_ref):
    # Blocks: scr [N, bt, dk] (the accepted node's rows bt of its transposed state); out / old
    # [dk, bt], aliased: a request that keeps its state (-1) writes nothing.
    del old_ref
    a = acc_ref[...]
    take = a >= 0
    tile = pltriton.load(scr_ref.at[jnp.maximum(a, 0)], mask=take, other=0.0)
    pltriton.store(out_ref, tile.T.astype(out_ref.dtype), mask=take)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def _commit_transposed_pallas(old, node_states, accepted, *, block_rows, interpret):
    b, n, hv, dv, dk = node_states.shape
    if block_rows < 1 or block_rows & (block_rows - 1) or dv % block_rows:
        raise ValueError(f"block_rows={block_rows} must be a power of two dividing dv={dv}")
    accepted = jnp.minimum(accepted, n - 1)
    pool_spec = pl.BlockSpec((None, None, dk, block_rows), lambda t, h, i: (i, h, 0, t))
    return pl.pallas_call(
        _commit_transposed_kernel,
        grid=(dv // block_rows, hv, b),
        in_specs=[
            pl.BlockSpec((None,), lambda t, h, i: (i,)),
            pl.BlockSpec((None, n, None, block_rows, dk), lambda t, h, i: (i, 0, h, t, 0)),
            pool_spec,
        ],
        out_specs=pool_spec,
        out_shape=jax.ShapeDtypeStruct(old.shape, old.dtype),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="pernode_commit_transposed",
    )(accepted, node_states, old)


commit_chain = commit_pernode_state
commit_pernode_conv = commit_pernode


# ----------------------------------------------------------------------------- conv baseline


def _pernode_conv_kernel(
    nn_ref, par_ref, x_ref, cs_ref, w_ref, y_ref, win_ref, *, n_real, width, interpret
):
    # Blocks: par [N]; x [N, bc]; cs [K-1, bc]; w [K, bc]; y [N, bc]; win [N, K-1, bc].
    nn = jnp.minimum(nn_ref[...], n_real)
    c = width - 1
    w = [w_ref[m].astype(jnp.float32) for m in range(width)]

    def node(i, prev):
        par = par_ref[i]
        reuse = par == i - 1  # the carry is node i-1's window (the committed one before node 0)
        from_pool = jnp.logical_and(par < 0, jnp.logical_not(reuse))
        from_scratch = jnp.logical_and(par >= 0, jnp.logical_not(reuse))
        pp = jnp.maximum(par, 0)
        rows = []
        for r in range(c):
            rr = jnp.int32(r)  # (a Python int index breaks masked loads in interpret mode)
            loaded = pltriton.load(cs_ref.at[rr], mask=from_pool, other=0) + pltriton.load(
                win_ref.at[pp, rr], mask=from_scratch, other=0
            )
            rows.append(jnp.where(reuse, prev[r], loaded))
        xi = x_ref[i]
        acc = w[c] * xi.astype(jnp.float32)
        for r in range(c):
            acc = acc + w[r] * rows[r].astype(jnp.float32)
        y_ref[i] = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)
        new = tuple(rows[1:]) + (xi.astype(win_ref.dtype),)
        for r in range(c):
            win_ref[i, r] = new[r]
        if not interpret:
            pltriton.debug_barrier()
        return new

    jax.lax.fori_loop(0, nn, node, tuple(cs_ref[r] for r in range(c)))

    def zero(i, carry):
        y_ref[i] = jnp.zeros(y_ref.shape[1:], y_ref.dtype)
        return carry

    jax.lax.fori_loop(nn, n_real, zero, 0)


@functools.partial(jax.jit, static_argnames=("block_c", "interpret", "num_warps"))
def _pernode_conv_pallas(
    x, conv_state, weight, parents, num_nodes, *, block_c, interpret, num_warps
):
    b, n, ch = x.shape
    width = weight.shape[0]
    cp, bc = tree_conv.channel_tiling(ch, block_c)
    x, conv_state = pad_axis(x, 2, cp), pad_axis(conv_state.astype(x.dtype), 2, cp)
    weight = pad_axis(weight, 1, cp)
    y, win = pl.pallas_call(
        functools.partial(_pernode_conv_kernel, n_real=n, width=width, interpret=interpret),
        grid=(b, cp // bc),
        in_specs=[
            pl.BlockSpec((None,), lambda i, t: (i,)),
            pl.BlockSpec((None, n), lambda i, t: (i, 0)),
            pl.BlockSpec((None, n, bc), lambda i, t: (i, 0, t)),
            pl.BlockSpec((None, width - 1, bc), lambda i, t: (i, 0, t)),
            pl.BlockSpec((width, bc), lambda i, t: (0, t)),
        ],
        out_specs=[
            pl.BlockSpec((None, n, bc), lambda i, t: (i, 0, t)),
            pl.BlockSpec((None, n, width - 1, bc), lambda i, t: (i, 0, 0, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, cp), x.dtype),
            jax.ShapeDtypeStruct((b, n, width - 1, cp), x.dtype),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="tree_pernode_conv",
    )(num_nodes, parents, x, conv_state, weight)
    if cp != ch:
        y, win = y[..., :ch], win[..., :ch]
    return y, win


def tree_pernode_conv(
    x,
    conv_state,
    weight,
    parents,
    num_nodes=None,
    *,
    backend="auto",
    interpret=None,
    block_c: int = 256,
    num_warps: int = 4,
):
    """Baseline tree conv. x [B, N, C] pre-conv inputs; conv_state [B, K-1, C] (newest last);
    weight [K, C]. Returns (y [B, N, C] SiLU(conv), windows [B, N, K-1, C]: the last K-1
    pre-conv inputs along each node's root path = that node's conv state)."""
    backend, interpret = resolve_backend(backend, interpret)
    b, n, _ = x.shape
    if backend == "reference":
        y = tree_conv.tree_causal_conv_ref(x, conv_state, weight, parents, num_nodes)
        return y, tree_conv.node_conv_states_ref(x, conv_state, parents)
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    return _pernode_conv_pallas(
        x,
        conv_state,
        weight,
        jnp.asarray(parents, jnp.int32),
        jnp.asarray(num_nodes, jnp.int32),
        block_c=block_c,
        interpret=interpret,
        num_warps=num_warps,
    )
