"""The selected-state commit of a Gated DeltaNet layer: the accepted node's state from the
committed state and the verify's token-level factors, in Pallas (Triton) and in plain jnp.

Verify never forms per-node states. Once acceptance has picked the last accepted node `sel` of
each request, its state follows exactly from the committed state and the layer's factors:
    S_sel = P_sel S_pre + K^T diag(w) U,  w_j = exp(gamma_sel - gamma_j) on anc*(sel), else 0,
with P_sel = exp(gamma_sel): one gather and one batched matmul per GDN layer (`commit_state`).
Rejected branches cost nothing. The lazy commit defers it: `pending_commit` keeps the accepted
path's rows and the next verify folds them into the state tiles it loads (`tree_gdn_verify(
pending=)`, with the folds defined here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.factors import PendingCommit, PendingPath, TreeFactors, scaled_keys
from bole_jax.pallas.tree_utils import accepted_path, next_pow2, pad_axis, resolve_backend
from bole_jax.pallas.triton_ops import PRECISIONS as _PRECISIONS
from bole_jax.pallas.triton_ops import dot as _dot
from bole_jax.pallas.triton_ops import load as _load
from bole_jax.pallas.triton_ops import store as _store

__all__ = [
    "commit_state",
    "commit_state_pallas",
    "commit_states",
    "commit_states_pallas",
    "accepted_rows",
    "commit_path_weights",
    "pending_commit",
    "gather_pending_path",
    "apply_pending",
    "commit_launch",
]

_FOLDS = ("loop", "dot", "unroll")  # the lazy verify's and the commit's


# ------------------------------------------------------------------------- folds of path rows


def _rank1_fold(count, init, row):
    """init + sum_{m < count} w_m k_m u_m^T on one fp32 state tile [dk, bv], row(m) -> (w_m [],
    k_m [dk], u_m [bv]): exact fp32 rank-1 updates in a loop over the real count (no row's
    address depends on another row's data, but each trip's loads issue after the previous
    trip's update: on the GPU the loop is bound by load latency, see `_dot_fold`)."""

    def update(m, acc):
        w, k, u = row(m)
        return acc + (w * k)[:, None] * u[None, :]

    return jax.lax.fori_loop(0, count, update, init)


def _dot_fold(init, w, k, u, live, precision):
    """init + sum_{m: live[m]} w_m k_m u_m^T = init + (w k)^T u as ONE tensor-core dot:
    w [Lp], k [Lp, dk], u [Lp, bv], live [Lp] bool (Lp a power of two >= 16, Triton's smallest
    dot). Every row is loaded at once (no dependent trips as in `_rank1_fold`); rows not live
    are zeroed before the dot, so even NaN there cannot leak in. precision: the commit kernels
    pass "tf32x3" (three TF32 passes with split operands, ~fp32 rounding: the state keeps
    fp32-class accuracy); None in interpret mode (fp32)."""
    kw = jnp.where(live[:, None], w[:, None] * k, 0.0)
    return init + _dot(kw, jnp.where(live[:, None], u, 0.0), precision, trans_a=True)


def _unrolled_fold(count, init, rows):
    """init + sum_{m < count} w_m k_m u_m^T over rows = [(w_m [], k_m [dk], u_m [bv])], already
    loaded (so every row's loads issue before any update; no shared memory, unlike the dot):
    exact fp32 rank-1 updates, unrolled; rows past count are zeroed on both factors, so even
    NaN there cannot leak."""
    acc = init
    for m, (w, k, u) in enumerate(rows):
        live = m < count
        acc = acc + jnp.where(live, w * k, 0.0)[:, None] * jnp.where(live, u, 0.0)[None, :]
    return acc


# ------------------------------------------------------------------------- selected-state commit


def _path_weight(g_sel, gamma):
    """w_j = exp(gamma_sel - gamma_j): the decay from path node j to the accepted node (<= 1 on
    a root path; the clamp keeps rounding and rows past the count from overflowing)."""
    return jnp.exp(jnp.minimum(g_sel - gamma, 0.0))


def _path_scale(count, g_sel):
    """P_sel = exp(gamma_sel), the committed state's decay to the accepted node; 1 when nothing
    was accepted (count 0)."""
    return jnp.where(count > 0, jnp.exp(g_sel), 1.0)


def _path_inputs(count_ref, sel_ref, path_ref, length: int, nodes: int):
    """(count, sel, node(m), path()) of a commit kernel's accepted-path inputs, sanitised in the
    kernel (the caller's arrays go in as it holds them, with no XLA op before the launch):
    count 0 where sel < 0 (nothing accepted), at most `length`; sel and every id clipped into
    [0, nodes); path() the ids as one block (a power of two >= length: ids past the `length`
    present are masked to 0, past count anyway)."""
    sel_raw = sel_ref[...]
    count = jnp.where(sel_raw >= 0, jnp.clip(count_ref[...], 0, length), 0)
    sel = jnp.clip(sel_raw, 0, nodes - 1)

    def node(m):
        return jnp.clip(path_ref[m], 0, nodes - 1)

    def path():
        lb = path_ref.shape[0]
        idx = jnp.arange(lb, dtype=jnp.int32)
        return jnp.clip(_load(path_ref, None if lb == length else idx < length), 0, nodes - 1)

    return count, sel, node, path


def _commit_kernel(
    count_ref,
    sel_ref,
    path_ref,
    gamma_ref,
    k_ref,
    ks_ref,
    u_ref,
    s_ref,
    o_ref,
    *,
    fold,
    precision,
    length,
    nodes,
):
    # Blocks: count [] = nodes on the accepted root path (0: nothing accepted, the state is
    # kept); sel [] = the accepted node; path [L] their ids (any order; entries past count add
    # nothing: the loop stops at count, the dot and the unrolled updates zero them); gamma [N]
    # this head's root-path log gates; k [N, dk] the keys as verify took them and ks [N] their
    # normalising factors (k_m = ks_m k_m, as the verify formed it); u [N, bv]; s, o [dk, bv].
    # S_sel = P_sel S_pre + sum_m w_m k_m u_m^T with P_sel = exp(gamma_sel) and
    # w_m = exp(gamma_sel - gamma_m), the weights formed here from gamma (no per-layer XLA
    # gathers before the kernel). The path is known up front (no pointer chase). fold "loop":
    # fp32 rank-1 updates over the real path length (`_rank1_fold`); "dot": the path rows
    # gathered as [L, dk], [L, bv] blocks and added by one tensor-core dot (`_dot_fold`);
    # "unroll": fp32 rank-1 updates of all L rows, unrolled (every row load issued at once,
    # no shared-memory staging as the dot needs), rows past count zeroed. count, sel and path
    # arrive raw (`_path_inputs`: sel < 0 = nothing accepted).
    count, sel, node_at, path_ids = _path_inputs(count_ref, sel_ref, path_ref, length, nodes)

    def key(node):
        return k_ref[node].astype(jnp.float32) * ks_ref[node]

    if fold == "unroll":
        ids = [node_at(m) for m in range(length)]
        s = s_ref[...]
        rows = [(gamma_ref[nd], key(nd), u_ref[nd]) for nd in ids]
        g_sel = gamma_ref[sel]
        init = _path_scale(count, g_sel) * s
        o_ref[...] = _unrolled_fold(
            count, init, [(_path_weight(g_sel, g_m), k_m, u_m) for g_m, k_m, u_m in rows]
        )
        return
    g_sel = gamma_ref[sel]
    init = _path_scale(count, g_sel) * s_ref[...]
    if fold == "dot":
        path = path_ids()
        w = _path_weight(g_sel, gamma_ref[path])
        live = jnp.arange(path.shape[0], dtype=jnp.int32) < count
        keys = k_ref[path, :].astype(jnp.float32) * ks_ref[path][:, None]
        o_ref[...] = _dot_fold(init, w, keys, u_ref[path, :], live, precision)
        return

    def row(m):
        node = node_at(m)
        return _path_weight(g_sel, gamma_ref[node]), key(node), u_ref[node]

    o_ref[...] = _rank1_fold(count, init, row)


def accepted_rows(parents, accepted, length: int):
    """(path [B, length] int32, count [B] int32): the accepted node's root path as a commit
    reads it, accepted node first, walked up the parent pointers (padding repeats the accepted
    node, so loads stay in bounds; count 0 when accepted is -1). A decode step that already
    holds the accepted path (`Accepted.path`, root first) passes that instead, once for every
    layer."""
    accepted = jnp.asarray(accepted, jnp.int32)
    walk = accepted_path(parents, accepted, length)  # -1 past the root (all -1 for accepted -1)
    valid = walk >= 0
    path = jnp.where(valid, walk, jnp.clip(accepted, 0, None)[:, None])
    return path, jnp.sum(valid, axis=1, dtype=jnp.int32)


def commit_path_weights(
    factors: TreeFactors, parents, accepted, length: int, path=None, count=None
):
    """What a commit needs of the accepted node's root path (at most `length` nodes):
    path [B, L] int32 node ids (walked: accepted node first; padding repeats it, so gathers stay
    in bounds and in cache); w [B, L, HV] = exp(gamma_sel - gamma_j) (0 past count); p_sel
    [B, HV] = exp(gamma_sel) (1 when accepted = -1); count [B] = real nodes on the path (0 when
    -1). path, count: the path when the caller holds it (any order, see `commit_state_pallas`);
    then parents and length are not read."""
    accepted = jnp.asarray(accepted, jnp.int32)
    path, count = _path_rows(parents, accepted, length, path, count, factors.k.shape[1])
    valid = jnp.arange(path.shape[1])[None, :] < count[:, None]
    rows = jnp.arange(path.shape[0])[:, None]
    gamma_path = factors.gamma[rows, path]  # [B, L, HV]
    gamma_sel = factors.gamma[rows[:, 0], jnp.clip(accepted, 0, None)]  # [B, HV]
    w = jnp.where(valid[:, :, None], _path_weight(gamma_sel[:, None], gamma_path), 0.0)
    p_sel = jnp.where((accepted >= 0)[:, None], jnp.exp(gamma_sel), 1.0)
    return path, w, p_sel, count


def _path_rows(parents, accepted, length, path, count, n):
    """(path, count) walked from parents, or the caller's, clipped in bounds; count 0 where
    accepted is -1 (`_raw_path` sanitised outside a kernel, as `_path_inputs` does inside)."""
    path, count = _raw_path(parents, accepted, length, path, count)
    return jnp.clip(path, 0, n - 1), jnp.where(accepted >= 0, count, 0)


def _raw_path(parents, accepted, length, path, count):
    """(path, count) for a kernel that sanitises them itself (`_path_inputs`): the caller's as
    given (int32), or walked from parents (`accepted_rows`)."""
    if (path is None) != (count is None):
        raise ValueError("pass the accepted path and its count together, or neither")
    if path is None:
        return accepted_rows(parents, accepted, length)
    return jnp.asarray(path, jnp.int32), jnp.asarray(count, jnp.int32)


def _key_rows(factors: TreeFactors, rows, path):
    """The normalised keys of nodes `path` [B, L] (fp32, [B, L, Hk, dk]), as
    `TreeFactors.keys()` forms them, without scaling all N rows."""
    ks = None if factors.k_scale is None else factors.k_scale[rows, path]
    return scaled_keys(factors.k[rows, path], ks)


def _k_scale(factors: TreeFactors):
    """[B, N, Hk] fp32 per-row key factors for a kernel (ones when the factors have none)."""
    if factors.k_scale is None:
        return jnp.ones(factors.k.shape[:3], jnp.float32)
    return factors.k_scale.astype(jnp.float32)


def pending_commit(
    factors: TreeFactors,
    parents,
    accepted,
    length: int,
    path=None,
    count=None,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
) -> PendingCommit:
    """The accepted node's root-path factor rows, gathered (at most `length` nodes): what the
    next verify folds into the state (`PendingCommit`). accepted [B] int32, -1 = nothing.
    path, count: as in `commit_path_weights` (padded to `length` rows when shorter).
    backend: "pallas" (the default on GPU: `_pending_gather_pallas`, one launch for all heads)
    or "reference" (XLA gathers: several launches, measured slower on the H200)."""
    backend, interpret = resolve_backend(backend, interpret)
    if path is not None and path.shape[1] < length:
        path = jnp.pad(jnp.asarray(path, jnp.int32), ((0, 0), (0, length - path.shape[1])))
    if backend == "pallas":
        accepted = jnp.asarray(accepted, jnp.int32)
        path, count = _raw_path(parents, accepted, length, path, count)
        return _pending_gather_pallas(factors, accepted, path, count, interpret=interpret)
    path, w, p_sel, count = commit_path_weights(factors, parents, accepted, length, path, count)
    rows = jnp.arange(path.shape[0])[:, None]
    return PendingCommit(
        k=_key_rows(factors, rows, path),
        u=factors.u[rows, path].astype(jnp.float32),
        w=w,
        p_sel=p_sel,
        count=count,
    )


def gather_pending_path(
    pending: PendingPath, *, backend: str = "auto", interpret: bool | None = None
) -> PendingCommit:
    """The rows of a `PendingPath`, gathered (`pending_commit`): for a verify that folds
    gathered rows (the Mosaic kernel, the reference) and for `apply_pending`."""
    count = pending.live_count()
    accepted = jnp.where(count > 0, jnp.asarray(pending.sel, jnp.int32), -1)
    return pending_commit(
        pending.factors,
        None,
        accepted,
        pending.path.shape[1],
        pending.path,
        count,
        backend=backend,
        interpret=interpret,
    )


def _pending_gather_kernel(
    count_ref,
    sel_ref,
    path_ref,
    gamma_ref,
    k_ref,
    ks_ref,
    u_ref,
    pk_ref,
    pu_ref,
    pw_ref,
    ps_ref,
    *,
    ratio,
    rows,
    nodes,
):
    # Blocks: count, sel [] and path [Lp] as the caller holds them (`_path_inputs`; Lp a power
    # of two >= rows, ids past rows masked and never stored); gamma [N]; k [N, dk], ks [N] (the
    # keys and their normalising factors); u [N, dv]; out pk [Lp, dk] (this value head's key
    # head, normalised: written by the first value head of the group), pu [Lp, dv], pw [Lp],
    # ps [].
    count, sel, _, path_ids = _path_inputs(count_ref, sel_ref, path_ref, rows, nodes)
    path = path_ids()
    g_sel = gamma_ref[sel]
    idx = jnp.arange(path.shape[0], dtype=jnp.int32)
    keep = None if rows == path.shape[0] else idx < rows
    col = None if keep is None else keep[:, None]
    w = jnp.where(idx < count, _path_weight(g_sel, gamma_ref[path]), 0.0)
    _store(pw_ref, w, keep)
    ps_ref[...] = _path_scale(count, g_sel)
    _store(pu_ref, u_ref[path, :].astype(jnp.float32), col)

    @pl.when(pl.program_id(0) % ratio == 0)
    def _():
        ks = ks_ref[path][:, None]
        _store(pk_ref, jnp.where(ks != 0, k_ref[path, :].astype(jnp.float32) * ks, 0.0), col)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _pending_gather_pallas(factors: TreeFactors, accepted, path, count, *, interpret=False):
    """`pending_commit`'s gathers as one Pallas launch: grid (HV, B), each program gathers its
    value head's u rows, weights and p_sel, and (first head of a key-head group) the key rows.
    accepted [B], path [B, L], count [B] as the caller holds them (the kernel clips the ids and
    takes count 0 where accepted is -1: no XLA op before the launch). The returned count is
    that sanitised count (an XLA op, dropped when the caller does not read it)."""
    b, n, hk, dk = factors.k.shape
    hv, dv = factors.u.shape[2:]
    ratio = hv // hk
    length = path.shape[1]
    lp = next_pow2(length)
    dkp, dvp = next_pow2(dk), next_pow2(dv)
    kf = pad_axis(factors.k, 3, dkp)
    uf = pad_axis(factors.u, 3, dvp)
    per_req = pl.BlockSpec((None,), lambda h, i: (i,))
    pk, pu, pw, ps = pl.pallas_call(
        functools.partial(_pending_gather_kernel, ratio=ratio, rows=length, nodes=n),
        grid=(hv, b),
        in_specs=[
            per_req,
            per_req,
            pl.BlockSpec((None, lp), lambda h, i: (i, 0)),
            pl.BlockSpec((None, n, None), lambda h, i: (i, 0, h)),
            pl.BlockSpec((None, n, None, dkp), lambda h, i: (i, 0, h // ratio, 0)),
            pl.BlockSpec((None, n, None), lambda h, i: (i, 0, h // ratio)),
            pl.BlockSpec((None, n, None, dvp), lambda h, i: (i, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, lp, None, dkp), lambda h, i: (i, 0, h // ratio, 0)),
            pl.BlockSpec((None, lp, None, dvp), lambda h, i: (i, 0, h, 0)),
            pl.BlockSpec((None, lp, None), lambda h, i: (i, 0, h)),
            pl.BlockSpec((None, None), lambda h, i: (i, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, length, hk, dkp), jnp.float32),
            jax.ShapeDtypeStruct((b, length, hv, dvp), jnp.float32),
            jax.ShapeDtypeStruct((b, length, hv), jnp.float32),
            jax.ShapeDtypeStruct((b, hv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="bole_pending_gather",
    )(count, accepted, path, factors.gamma.astype(jnp.float32), kf, _k_scale(factors), uf)
    count = jnp.where(accepted >= 0, jnp.clip(count, 0, length), 0)
    return PendingCommit(k=pk[..., :dk], u=pu[..., :dv], w=pw, p_sel=ps, count=count)


@functools.partial(jax.jit, static_argnames=("precision",))
def apply_pending(state, pending: PendingCommit, precision: str | None = "highest"):
    """S = p_sel S + sum_m w_m k_m u_m^T (plain jnp): the commit's maths, the reference for the
    kernels that fold it. state [B, HV, dk, dv]; returns fp32. precision of the einsum
    ("highest" = fp32, None = backend default)."""
    b, length, hk, dk = pending.k.shape
    hv, dv = pending.u.shape[2:]
    r = hv // hk
    # GQA without repeating keys: value head h = (key head h // r, member h % r).
    prec = jax.lax.Precision.HIGHEST if precision == "highest" else None
    # rows past count weigh 0 and are zeroed (their contents, even NaN, never reach the sum)
    live = (jnp.arange(length)[None, :] < jnp.asarray(pending.count)[:, None])[:, :, None, None]
    delta = jnp.einsum(
        "bmgd,bmgr,bmgrv->bgrdv",
        jnp.where(live, pending.k, 0.0),
        pending.w.reshape(b, length, hk, r),
        jnp.where(live, pending.u, 0.0).reshape(b, length, hk, r, dv),
        precision=prec,
    )
    return pending.p_sel[:, :, None, None] * state.astype(jnp.float32) + delta.reshape(
        b, hv, dk, dv
    )


# Path rows up to which fold "auto" unrolls the rank-1 updates (a decode step's path has depth + 1
# rows, ~9); longer paths (a walk bounded by N) take the dot.
UNROLL_MAX_ROWS = 16


# Most GDN layers one commit launch holds (`commit_states_pallas`).
COMMIT_LAYERS_PER_LAUNCH = 8


def commit_launch(b: int, length: int, fold: str = "auto", block_v: int | None = None):
    """(fold, block_v) of a commit of b requests whose accepted paths have `length` rows:
    "auto" -> "unroll" up to UNROLL_MAX_ROWS rows at b >= 4, else "dot"; block_v None -> 64
    for the unrolled fold at b >= 16, else 32: measured fastest in place on the H200, 4 warps
    (docs/kernels.md, launch table)."""
    if fold == "auto":
        fold = "unroll" if length <= UNROLL_MAX_ROWS and b >= 4 else "dot"
    if block_v is None:
        block_v = 64 if fold == "unroll" and b >= 16 else 32
    return fold, block_v


@functools.partial(
    jax.jit, static_argnames=("block_v", "num_warps", "max_path", "interpret", "fold")
)
def commit_state_pallas(
    state,
    factors: TreeFactors,
    parents,
    accepted,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    max_path: int | None = None,
    interpret: bool = False,
    path=None,
    count=None,
    fold: str = "auto",
):
    """Pallas form of `tree_gdn_commit.commit_state`: one program per (request, value head, value
    tile) reads its S_pre tile once, adds the fp32 rank-1 updates of the accepted node's
    root-path factor rows and writes the new tile over the old one: the bytes floor of a
    commit (read S, write S, path rows). The weights exp(gamma_sel - gamma_j) are formed in the
    kernel from gamma, so a layer's commit is this one kernel.

    path, count: the accepted root path's node ids [B, L] (any order; entries past count[b]
    weigh nothing, and are clipped into [0, N)) and their number [B] (0 keeps the state); both
    or neither. None: walked here from parents (`accepted_rows`). A decode step passes its
    accepted path once for all layers.
    max_path: static bound on nodes on a root path (tree depth bound) for that walk; None = N
    (always exact).
    fold: "unroll" (fp32 rank-1 updates of every path row, unrolled: all row loads in flight
    at once, no shared memory), "dot" (the path rows gathered as blocks of a power of two >= 16
    rows and added by one [dk, L] x [L, bv] tensor-core dot in three TF32 passes, ~fp32;
    `_dot_fold`), "loop" (fp32 rank-1 updates, a loop over the real path length) or "auto"
    (`commit_launch`: unroll for paths of <= 16 rows, as a decode step's, at B >= 4, else dot;
    the loop measured slowest, docs/kernels.md, launch table).
    block_v: value columns per program (None: `commit_launch`).
    """
    accepted = jnp.asarray(accepted, jnp.int32)
    n = factors.k.shape[1]
    path, count = _raw_path(
        parents, accepted, next_pow2(min(n, max_path or n), minimum=1), path, count
    )  # power-of-two blocks when walked here
    (new,) = _commit_launch_call(
        (state,), (factors,), accepted, path, count, block_v, num_warps, interpret, fold
    )
    return new


def _commit_layers_kernel(count_ref, sel_ref, path_ref, *refs, layers, **kw):
    # refs = (gamma, k, ks, u, s) of each layer, then each layer's output. With several layers,
    # grid axis 0 is the layer and the program runs `_commit_kernel` on that layer's refs (a
    # switch over the layers: in Triton no block is loaded before a branch reads it, so a
    # program touches only its own layer's tiles).
    ins, outs = refs[: 5 * layers], refs[5 * layers :]

    def branch(i):
        def body():
            _commit_kernel(count_ref, sel_ref, path_ref, *ins[5 * i : 5 * i + 5], outs[i], **kw)

        return body

    if layers == 1:
        branch(0)()
    else:
        jax.lax.switch(pl.program_id(0), [branch(i) for i in range(layers)])


def _commit_launch_call(
    states, factors, accepted, path, count, block_v, num_warps, interpret, fold
):
    """The commit kernel over `len(states)` layers of the same shapes in one launch: grid
    (dv tiles, HV, B), with a leading layer axis when there are several. path, count as the
    caller holds them (`_path_inputs` sanitises them in the kernel). Returns the new states."""
    if fold not in _FOLDS + ("auto",):
        raise ValueError(f"fold must be 'auto' or one of {_FOLDS}, got {fold!r}")
    b, n, hk, dk = factors[0].k.shape
    hv, dv = factors[0].u.shape[2:]
    ratio = hv // hk
    dkp, dvp = next_pow2(dk), next_pow2(dv)
    length = path.shape[1]
    fold, block_v = commit_launch(b, length, fold, block_v)
    bv = min(block_v, dvp)
    # dot blocks: a power of two >= 16 rows; ids past the L present are masked in the kernel
    lb = next_pow2(length) if fold == "dot" else length
    layers = len(states)

    def spec(shape, index):  # index(t, h, i); the layer axis, when there is one, is not read
        if layers == 1:
            return pl.BlockSpec(shape, index)
        return pl.BlockSpec(shape, lambda l, t, h, i: index(t, h, i))

    layer_specs = [
        spec((None, n, None), lambda t, h, i: (i, 0, h)),
        spec((None, n, None, dkp), lambda t, h, i: (i, 0, h // ratio, 0)),
        spec((None, n, None), lambda t, h, i: (i, 0, h // ratio)),
        spec((None, n, None, bv), lambda t, h, i: (i, 0, h, t)),
        spec((None, None, dkp, bv), lambda t, h, i: (i, h, 0, t)),
    ]
    per_req = spec((None,), lambda t, h, i: (i,))
    operands = []
    for st, f in zip(states, factors):
        operands += [
            f.gamma.astype(jnp.float32),
            pad_axis(f.k, 3, dkp),
            _k_scale(f),
            pad_axis(f.u, 3, dvp),
            pad_axis(pad_axis(st.astype(jnp.float32), 2, dkp), 3, dvp),
        ]
    grid = (dvp // bv, hv, b)
    new = pl.pallas_call(
        functools.partial(
            _commit_layers_kernel,
            layers=layers,
            fold=fold,
            length=length,
            nodes=n,
            precision=None if interpret else _PRECISIONS["tf32x3"],
        ),
        grid=grid if layers == 1 else (layers,) + grid,
        in_specs=[per_req, per_req, spec((None, lb), lambda t, h, i: (i, 0))]
        + layer_specs * layers,
        out_specs=[layer_specs[4]] * layers,
        out_shape=[jax.ShapeDtypeStruct((b, hv, dkp, dvp), jnp.float32)] * layers,
        # In place: each program reads its tile of S before writing the same tile. Inside the
        # decode loop the old state is dead after the commit, so XLA can write the new state into
        # the loop-carried buffer instead of a fresh one followed by a copy (the 9B profile shows
        # one state-sized memcpy per GDN layer per step). Outside a donating jit XLA copies the
        # input first, as aliasing requires.
        input_output_aliases={3 + 5 * i + 4: i for i in range(layers)},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="bole_commit_state" if layers == 1 else "bole_commit_states",
    )(count, accepted, path, *operands)
    if (dkp, dvp) != (dk, dv):
        new = [x[:, :, :dk, :dv] for x in new]
    return tuple(new)


@functools.partial(
    jax.jit, static_argnames=("block_v", "num_warps", "interpret", "fold", "layers_per_launch")
)
def commit_states_pallas(
    states,
    factors,
    accepted,
    path,
    count,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
    fold: str = "auto",
    layers_per_launch: int | None = None,
):
    """`commit_state_pallas` of several GDN layers in few launches: states and factors are
    sequences (one entry per layer, every layer of the same shapes); accepted [B], path [B, L]
    and count [B] are the step's, shared by all layers (as a decode step holds them). Each
    layer's state is written in place (aliased), as the per-layer launch does. A commit of a
    small batch is a few microseconds of work per layer behind each launch's fixed cost; one
    launch of many layers' tiles pays that cost once and keeps every SM busy. A launch holds at
    most `layers_per_launch` layers (None: COMMIT_LAYERS_PER_LAUNCH): its kernel is a switch with
    a copy of the commit per layer, and the GPU compile time grows faster than the copies.
    Returns the new states, a tuple in the layers' order."""
    states, factors = tuple(states), tuple(factors)
    if len(states) != len(factors) or not states:
        raise ValueError(
            f"one factor set per state, at least one layer: {len(states)} states, "
            f"{len(factors)} factor sets"
        )
    shapes = {(s.shape, f.k.shape, f.u.shape) for s, f in zip(states, factors)}
    if len(shapes) != 1:
        raise ValueError(f"every layer's state and factors must have the same shapes: {shapes}")
    accepted = jnp.asarray(accepted, jnp.int32)
    path, count = jnp.asarray(path, jnp.int32), jnp.asarray(count, jnp.int32)
    per = COMMIT_LAYERS_PER_LAUNCH if layers_per_launch is None else layers_per_launch
    if per < 1:
        raise ValueError(f"layers_per_launch must be >= 1, got {per}")
    new = ()
    for i in range(0, len(states), per):
        new += _commit_launch_call(
            states[i : i + per],
            factors[i : i + per],
            accepted,
            path,
            count,
            block_v,
            num_warps,
            interpret,
            fold,
        )
    return new


def commit_states(
    states,
    factors,
    accepted,
    path,
    count,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    fold: str = "auto",
    layers_per_launch: int | None = None,
):
    """The commit of several GDN layers with the step's accepted path (`commit_state` with
    `path` and `count` given, for each layer): backend "pallas" (the default on GPU) is one
    launch per `layers_per_launch` layers (`commit_states_pallas`); "reference" commits each
    layer with the jnp reference. Returns a tuple of new states [B, HV, dk, dv] fp32, in the
    layers' order."""
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "pallas":
        return commit_states_pallas(
            states,
            factors,
            accepted,
            path,
            count,
            block_v=block_v,
            num_warps=num_warps,
            interpret=interpret,
            fold=fold,
            layers_per_launch=layers_per_launch,
        )
    return tuple(
        commit_state(s, f, None, accepted, path=path, count=count, backend="reference")
        for s, f in zip(states, factors)
    )


# ------------------------------------------------------------------------- the commit, either backend


def commit_state(
    state,
    factors: TreeFactors,
    parents,
    accepted,
    *,
    max_path: int | None = None,
    precision: str | None = "highest",
    backend: str = "auto",
    interpret: bool | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    path=None,
    count=None,
    fold: str = "auto",
):
    """New committed GDN state of each request.

    state [B, HV, dk, dv] fp32 (the state verify started from); factors from `tree_gdn_verify`;
    parents [B, N] int32; accepted [B] int32 = last accepted node (-1: nothing accepted, the
    state is kept). Returns [B, HV, dk, dv] fp32.

    max_path: static bound on nodes on any root path (the tree depth bound): only that many
    factor rows are gathered (None = N, always exact).
    path [B, L], count [B]: the accepted root path's node ids (any order; entries past count
    weigh nothing) and their number, when the caller holds them (a decode step: `Accepted.path`,
    once for every layer); None: walked here from parents.
    backend "reference" (the default off GPU): gathers + one batched einsum; precision: of the
    [dk, path] x [path, dv] matmul ("highest" = fp32; None = backend default, TF32 on GPU).
    backend "pallas" (the default on GPU): `tree_gdn_commit.commit_state_pallas`, the path rows added
    per state tile as unrolled fp32 rank-1 updates (fold "unroll", the "auto" choice for a
    decode step's paths), by one TF32x3 tensor-core dot (fold "dot", ~fp32) or by a loop of
    rank-1 updates (fold "loop"); precision does not apply; block_v None: the fold's
    measured launch (`tree_gdn_commit.commit_launch`). It moves the commit's floor bytes (read S, write
    S, the path rows)."""
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "pallas":
        return commit_state_pallas(
            state,
            factors,
            parents,
            accepted,
            block_v=block_v,
            num_warps=num_warps,
            max_path=max_path,
            interpret=interpret,
            path=path,
            count=count,
            fold=fold,
        )
    return _commit_state_einsum(
        state, factors, parents, accepted, path, count, max_path=max_path, precision=precision
    )


@functools.partial(jax.jit, static_argnames=("max_path", "precision"))
def _commit_state_einsum(
    state, factors: TreeFactors, parents, accepted, path, count, *, max_path, precision
):
    n = factors.k.shape[1]
    length = n if max_path is None else min(max_path, n)
    if path is not None:
        length = path.shape[1]
    pending = pending_commit(factors, parents, accepted, length, path, count, backend="reference")
    new = apply_pending(state, pending, precision=precision)
    accepted = jnp.asarray(accepted, jnp.int32)
    return jnp.where((accepted >= 0)[:, None, None, None], new, state.astype(jnp.float32))
