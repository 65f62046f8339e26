"""Bole tree verify through a Gated DeltaNet layer: one fused Pallas (Triton) kernel.

Maths (docs/algorithm.md, tree closed form), per request and value head, all N tree nodes at once
from the ONE committed state S_pre [dk, dv]:
    gamma = A* g                               root-path cumulative log gates, P = exp(gamma)
    Gam[i, j] = exp(gamma_i - gamma_j) on A*   (<= 1: no overflow)
    G = diag(b) ((K K^T) * Gam * A)            strictly lower in topological order: nilpotent
    U = (I + G)^-1 diag(b) (V - diag(P) K S_pre)
    O = diag(P) Q S_pre + ((Q K^T) * Gam * A*) U
and the factors (k, u, gamma) that let `tree_gdn_commit.commit_state` rebuild the accepted node's
state afterwards. No per-node state is ever formed. With the lazy commit (`pending_commit`) that
rebuild is deferred: the next verify folds the accepted path's rows into the state tiles it
loads and writes the committed state out (`tree_gdn_verify(pending=)`).

Program layout: grid (dv / block_v, HV / heads_per_program, B). A program owns one request, a group
of value heads that share one key head, and one value tile. It loads q, k once (L2-normalises them
in registers), forms the N x N matrices K K^T and Q K^T once for all its value heads, then per
value head: gates -> gamma, Gam, G; the [dk, block_v] state tile -> K S, Q S; the inverse by a
finite series of dependent [N, N] x [N, block_v] dots; the output dot. Every dot is 2-D with all
dims >= 16: the node axis is a block of Np = next power of two >= 16 rows, rows past N are only
touched through masked loads/stores, and padding nodes (>= num_nodes) are masked to zero.

`(I + G)^-1` with a dynamic number of steps read per request (path_len from the tree structure),
so any depth is exact:
  * "neumann":  Z <- -G Z, U <- U + Z, path_len - 1 times;
  * "squaring": U <- (I + X) U, X <- X^2 from X = -G, ceil(log2 path_len) times
                (fewer dependent steps for deep trees, one extra N x N dot per step);
  * "matrix":   T = (I + G)^-1 = prod_m (I + X^(2^m)) formed once per value head, then one
                T @ rhs dot per value tile: pays off when a program covers several value tiles
                (`tiles_per_program`), e.g. a whole value head at large batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas import tree_gdn_mgpu, tree_gdn_ref
from bole_jax.pallas.factors import (
    PendingCommit,
    PendingPath,
    check_pending,
    check_pending_path,
    with_keys,
)
from bole_jax.pallas.options import KernelOptions
from bole_jax.pallas.tree_gdn_commit import (
    _FOLDS,
    UNROLL_MAX_ROWS,
    _dot_fold,
    _path_inputs,
    _path_scale,
    _path_weight,
    _rank1_fold,
    _unrolled_fold,
    apply_pending,
    gather_pending_path,
)
from bole_jax.pallas.tree_utils import (
    L2_EPS,
    TreeStructure,
    next_pow2,
    pad_axis,
    resolve_backend,
    tree_structure,
)
from bole_jax.pallas.triton_ops import PRECISIONS, TF32_EMULATED
from bole_jax.pallas.triton_ops import dot as _dot
from bole_jax.pallas.triton_ops import load as _load
from bole_jax.pallas.triton_ops import store as _store

__all__ = ["TreeGDNConfig", "tree_gdn_verify", "mosaic_launch"]

_INVERSES = ("neumann", "squaring", "matrix")
_PRECISIONS = PRECISIONS


@dataclasses.dataclass(frozen=True)
class TreeGDNConfig:
    """Launch parameters of the Pallas kernel (static, hashable).

    block_v: value columns per program (power of two >= 16); None = 32.
    num_warps: None = 4 for N <= 64, 8 above (offline sm_90 compiles: no register spills).
    heads_per_program: value heads sharing one key head handled by one program (must divide
      HV / Hk); > 1 reuses q, k, K K^T, Q K^T across them at the cost of fewer programs.
    tiles_per_program: consecutive value tiles one program loops over (block_v columns each);
      > 1 reuses K K^T, Q K^T, Gam, G (and T with "matrix") across them, with fewer programs.
    inverse: "neumann", "squaring" (applied to each value tile) or "matrix" (T = (I + G)^-1 formed
      once per head by squaring, then one T @ rhs dot per tile); see the module docstring.
    depth_bound: the most nodes a root path of the caller's trees can have (a decode step's
      tree depth + 1), or None. With a bound the inverse is unrolled for that depth (static
      code, measured faster on the H200: docs/kernels.md) and a request whose tree is deeper
      gets NaN outputs and factors (so a wrong bound is loud); None: the exact number of steps
      read per request at run time (path_len), in a loop.
    bf16_qk: bf16 operands (fp32 accumulation) for K K^T and Q K^T (q, k arrive in bf16 anyway).
    bf16_state: bf16 operands for K S_pre and Q S_pre (the state tile rounded to bf16, as
      flash-linear-attention's chunk kernels do). The inverse and output dots stay fp32.
    precision: of the fp32 dots on GPU: None (TF32), "tf32x3" (3 TF32 passes, ~fp32) or
      "highest" (IEEE fp32 FMA). Interpret mode always computes in fp32.
    precise_nodes: the node-by-node dots (K K^T, Q K^T, the inverse, T rhs and the outputs'
      (Q K^T * Gam) U) in three TF32 passes (~fp32) whatever `precision` says; with bf16_qk
      False their q and k operands stay fp32. The state dots (K S, Q S) keep bf16_state and
      `precision`.
    fold: how a pending lazy commit's rows are added to each state tile: "loop" (fp32 rank-1
      updates, a loop of `count` trips), "dot" (one [dk, L] x [L, block_v] tensor-core dot in
      three TF32 passes, ~fp32; see `_dot_fold`) or "unroll" (fp32 rank-1 updates of all L
      rows, unrolled, rows past count zeroed: every row load in flight at once).
    prefetch_state: with one value tile per program (tiles_per_program = 1, one value head),
      load the state tile first, before the tree mask and q/k, so its latency overlaps the
      N x N work (in program order it is issued after the inverse, then waited for at once).
      Holds the tile in registers through the N x N work.
    prefetch_fold: the same for a pending lazy commit's rows (folds "unroll" and "dot"; one
      value tile per program, one value head): their loads, a `PendingPath`'s dependent ones
      included, issue before the N x N work instead of at the fold.
    emulate_tf32: interpret mode only (no effect on the device): the dots the device takes at
      TF32 (precision None) round their fp32 operands to TF32 first (`triton_ops.TF32_EMULATED`),
      so that a CPU run reproduces the launch's rounding; the "tf32x3" ones stay fp32.
    """

    block_v: int | None = None
    heads_per_program: int = 1
    tiles_per_program: int = 1
    num_warps: int | None = None
    num_stages: int = 1
    inverse: str = "squaring"
    depth_bound: int | None = None
    bf16_qk: bool = False
    bf16_state: bool = False
    precision: str | None = None
    precise_nodes: bool = False
    fold: str = "loop"
    prefetch_state: bool = False
    prefetch_fold: bool = False
    emulate_tf32: bool = False

    def with_fold(self, fold: str) -> "TreeGDNConfig":
        """This launch with another fold; `prefetch_fold` kept only where the fold allows it
        (not with "loop", which loads its rows trip by trip)."""
        return dataclasses.replace(
            self, fold=fold, prefetch_fold=self.prefetch_fold and fold != "loop"
        )

    @classmethod
    def auto(
        cls,
        batch: int,
        nodes: int,
        depth_bound: int | None = None,
        options: KernelOptions = KernelOptions(),
        dv: int | None = None,
    ) -> "TreeGDNConfig":
        """The launch measured fastest at Qwen3-Next dims on the H200 (docs/kernels.md, launch
        table), for value heads of dv columns (None: 128); a head narrower than the table's
        columns per program takes one tile per program (the demo model's dv = 64 at B > 4 and
        more than 16 nodes: the table's two 64-column tiles would be a 128-column head). bf16
        q/k/state operands (`options.tree_gdn_bf16`; False: fp32, same shapes).
        B = 1: 32 columns per program; up to 16 nodes the state tile loaded first and the matrix
        inverse, squaring per tile above; B <= 4: 64 columns, 4 warps, the matrix inverse;
        B > 4: 64 columns on 2 warps up to 16 nodes, else a whole value head as two 64-column
        tiles (pipelined above 32 nodes); above 64 nodes 8 warps and 32 columns. depth_bound unrolls the inverse. The
        lazy verify's fold: unrolled for paths of <= UNROLL_MAX_ROWS rows (above 8 nodes at
        B > 4; its loads issued first at B <= 4), else the dot at B <= 4 up to 64 nodes, else
        the rank-1 loop."""
        cfg = cls._auto(batch, nodes, depth_bound, options)
        if dv is not None and cfg.tiles_per_program > 1:
            dvp = next_pow2(dv)
            tiles = dvp // min(cfg.block_v, dvp)
            cfg = dataclasses.replace(cfg, tiles_per_program=min(cfg.tiles_per_program, tiles))
        return cfg

    @classmethod
    def _auto(cls, batch, nodes, depth_bound, options) -> "TreeGDNConfig":
        short = depth_bound is not None and depth_bound <= UNROLL_MAX_ROWS  # rows to unroll
        if batch <= 4:
            fold = "unroll" if short else "dot" if nodes <= 64 else "loop"
        else:
            fold = "unroll" if short and nodes > 8 else "loop"
        bf16 = options.tree_gdn_bf16
        state = options.tree_gdn_state if bf16 else "tf32"  # tree_gdn_bf16=False: all fp32
        precise_nodes = options.tree_gdn_nodes == "fp32"
        kw = dict(
            bf16_qk=bf16 and not precise_nodes,
            precise_nodes=precise_nodes,
            bf16_state=state == "bf16",
            precision="tf32x3" if options.tree_gdn_state == "fp32" else None,
            depth_bound=depth_bound,
            fold=fold,
            prefetch_fold=batch <= 4 and fold != "loop",
        )
        if nodes > 64:
            return cls(block_v=32, num_warps=8, **dict(kw, prefetch_fold=False))
        if batch == 1:
            # <= 16 nodes the matrix inverse forms T while the prefetched state tile is in
            # flight; at 32 nodes squaring measured faster (docs/kernels.md, launch table).
            small = nodes <= 16
            return cls(
                block_v=32,
                num_warps=4,
                prefetch_state=small,
                inverse="matrix" if small else "squaring",
                **kw,
            )
        if batch <= 4:
            return cls(block_v=64, num_warps=4, inverse="matrix", **kw)
        if nodes <= 16:
            return cls(block_v=64, num_warps=2, inverse="matrix", **kw)
        # Above 16 nodes a whole value head as two 64-column tiles; at 16 nodes one tile was
        # faster lazy (docs/kernels.md, launch table).
        return cls(
            block_v=64,
            tiles_per_program=2,
            num_warps=4,
            num_stages=1 if nodes <= 32 else 2,
            inverse="matrix",
            **kw,
        )


def mosaic_launch(
    batch: int,
    nodes: int,
    dk: int,
    dv: int,
    v_dtype,
    depth_bound: int | None,
    options: KernelOptions = KernelOptions(),
) -> dict | None:
    """The Mosaic GPU verify's launch (`tree_gdn_mgpu.tree_gdn_verify_mgpu` keywords) where the
    auto launch takes it instead of the Triton kernel, else None: where the H200 measured it
    faster at Qwen3-Next dims, at every batch measured (1 to 64; docs/kernels.md, launch
    table). 64-column tiles, the inverse by squaring, one bf16 wgmma per product, exp and rsqrt
    by the hardware approximations, the kernel's own warpgroup barriers. Needs jax >= 0.11 (the
    GPU image), dk = dv = 128, bf16 v (the kernel rounds o through bf16), a static depth bound,
    exactly 64 nodes (fewer stay on Triton: padding the node axis to 64 in XLA cost more than
    the kernel saved), `options.tree_gdn_bf16` and `options.mosaic`."""
    if (
        not (
            options.mosaic
            and options.tree_gdn_bf16
            and options.tree_gdn_state == "bf16"
            and options.tree_gdn_nodes == "bf16"
            and tree_gdn_mgpu.AVAILABLE
        )
        or depth_bound is None
    ):
        return None
    if (dk, dv) != (tree_gdn_mgpu.HEAD_DIM,) * 2 or jnp.dtype(v_dtype) != jnp.bfloat16:
        return None
    if nodes != tree_gdn_mgpu.NP:
        return None
    return dict(block_v=64, inverse="squaring", products=1, approx_math=True, auto_barriers=False)


def _l2norm_scale(x):
    """[rows]: the factors r that L2-normalise the rows of x (x * r[:, None]); `gdn_ref.
    l2_scale`'s maths, written here so that the kernel's source locations stay in this file
    (benchmarks/profile/offline_compile.py maps SASS back to them)."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)


def _tree_gdn_kernel(
    nn_ref,
    plen_ref,
    anc_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    s_ref,
    *refs,
    n_real,
    scale,
    ratio,
    cfg,
    interpret,
    has_pending,
    pend_rows=0,
    pend_path=False,
    pend_nodes=0,
):
    # Blocks: anc [Np, Np] int8; q, k [Np, dk]; v [Np, hg, tpp*bv]; g, beta [Np, hg];
    # s [hg, dk, tpp*bv]; o, u [Np, hg, tpp*bv]; gamma [Np, hg]; ks [Np]. Np = N rounded up
    # to a power of two >= 16: rows >= N lie past the arrays' end, touched only through masks.
    # has_pending adds, after s: count [] (rows to fold), pk [Lb, dk], pu [Lb, hg, tpp*bv],
    # pw [Lb, hg], ps [hg] (p_sel); and the output sn [hg, dk, tpp*bv], the folded state (it may
    # alias s: each tile is read before its own store and by no other program). Lb = the
    # pend_rows rows present, or (fold "dot") a power of two >= 16 of them, rows past
    # pend_rows touched only through masks.
    # pend_path (a `PendingPath`: the previous verify's factors, read at the path's rows) adds
    # instead: count [], sel [], path [Lb] (node ids), pg [Mp, hg] (gamma), pk [Mp, dk] (keys as
    # that verify took them), pks [Mp] (their k_scale), pu [Mp, hg, tpp*bv]; Mp = the
    # pend_nodes = M rows rounded up to a power of two, only rows named by the path are read.
    # The caller's count, sel and path are used as given (no XLA ops before the launch),
    # sanitised here as the commit kernel sanitises them (`_path_inputs`).
    if pend_path:
        (
            cnt_ref,
            sel_ref,
            path_ref,
            pg_ref,
            pk_ref,
            pks_ref,
            pu_ref,
            o_ref,
            u_ref,
            gamma_ref,
            ks_ref,
            sn_ref,
        ) = refs
        pend = (
            *_path_inputs(cnt_ref, sel_ref, path_ref, pend_rows, pend_nodes),
            pg_ref,
            pk_ref,
            pks_ref,
            pu_ref,
        )
    elif has_pending:
        cnt_ref, pk_ref, pu_ref, pw_ref, ps_ref, o_ref, u_ref, gamma_ref, ks_ref, sn_ref = refs
        # The loop bound is clamped to the rows present, so a bad count cannot read past them.
        pend = (jnp.minimum(cnt_ref[...], pend_rows), pk_ref, pu_ref, pw_ref, ps_ref)
    else:
        o_ref, u_ref, gamma_ref, ks_ref = refs
        pend = None
    n = anc_ref.shape[0]
    hg = g_ref.shape[1]
    tpp = cfg.tiles_per_program
    bv = v_ref.shape[2] // tpp  # register tile; the program covers tpp of them
    tile, head_block = pl.program_id(0), pl.program_id(1)
    if interpret:  # fp32, or the device's TF32 rounding emulated
        prec = TF32_EMULATED if cfg.emulate_tf32 and cfg.precision is None else None
        prec_n = None if cfg.precise_nodes else prec
    else:
        prec = _PRECISIONS[cfg.precision]
        prec_n = _PRECISIONS["tf32x3"] if cfg.precise_nodes else prec
    qk_dtype = jnp.bfloat16 if cfg.bf16_qk else jnp.float32
    s_dtype = jnp.bfloat16 if cfg.bf16_state else jnp.float32
    prec_fold = None if interpret else _PRECISIONS["tf32x3"]

    # A pending commit's rows (a `PendingPath`'s after their dependent id loads) and the [dk, bv]
    # committed state tile (fp32), issued ahead of everything else when asked (one value head
    # and tile per program).
    # (j as a traced int, as value_head gets it: interpret mode's masked loads need one)
    early_rows = (
        _pending_rows(pend, pend_path, jnp.int32(0), slice(None), cfg.fold, pend_rows)
        if pend is not None and cfg.prefetch_fold
        else None
    )
    early_s = s_ref[0, :, :] if cfg.prefetch_state else None
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = idx < jnp.minimum(nn_ref[...], n_real)  # [Np] real nodes
    vrow = valid[:, None]
    inb = None if n == n_real else (idx < n_real)[:, None]  # rows inside the arrays
    path_len = plen_ref[...]
    # depth_bound: the inverse's steps unrolled for it (static code; a run-time loop or cond
    # around them measured 10% slower at B = 16 N = 64); a request whose tree breaks the bound
    # gets NaN outputs and factors (loud, never silently wrong).
    depth = path_len if cfg.depth_bound is None else cfg.depth_bound
    broken = None if cfg.depth_bound is None else path_len > cfg.depth_bound
    gate_mask = None if inb is None else inb[:, 0]
    first_tile = tile == 0

    anc = _load(anc_ref, None if inb is None else inb & inb.T) != 0  # [Np, Np] ancestor-or-self
    strict = anc & (idx[:, None] != idx[None, :])

    # Keys/queries once per program, shared by its value heads (GQA) and value tiles. Rows
    # past the real nodes load as 0 (masked), so padding never reaches a dot.
    rows = vrow if inb is None else vrow & inb
    kraw = _load(k_ref, rows).astype(jnp.float32)  # [Np, dk]
    qraw = _load(q_ref, rows).astype(jnp.float32)
    k_scale = _l2norm_scale(kraw)
    kn = kraw * k_scale[:, None]
    qn = qraw * (_l2norm_scale(qraw) * scale)[:, None]

    @pl.when(first_tile & ((head_block * hg) % ratio == 0))
    def _():  # the factor k_scale (the keys themselves are the caller's k)
        _store(ks_ref, jnp.where(valid, k_scale, 0.0), gate_mask)

    kb, qb = kn.astype(qk_dtype), qn.astype(qk_dtype)
    kk = _dot(kb, kb, prec_n, trans_b=True)  # [Np, Np]
    qk = _dot(qb, kb, prec_n, trans_b=True)
    kb, qb = kn.astype(s_dtype), qn.astype(s_dtype)

    def value_head(j, carry):
        # A loop, not an unrolled Python for: keeps one head's tiles live at a time.
        g = jnp.where(valid, _load(g_ref.at[:, j], gate_mask), 0.0)
        beta = jnp.where(valid, _load(beta_ref.at[:, j], gate_mask), 0.0)
        gamma = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)  # [Np] root-path log gate

        @pl.when(first_tile)
        def _():
            _store(gamma_ref.at[:, j], gamma, gate_mask)

        gam = jnp.where(anc, jnp.exp(jnp.minimum(gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        p = jnp.where(valid, jnp.exp(gamma), 0.0)[:, None]  # [Np, 1]
        gmat = jnp.where(strict, beta[:, None] * kk * gam, 0.0)
        # "matrix": T = (I + G)^-1 once per head, reused by all value tiles of the program;
        # otherwise G itself, applied per tile.
        tmat = _inverse_matrix(gmat, depth, prec_n) if cfg.inverse == "matrix" else gmat
        qkg = qk * gam

        def value_tile(t, c):
            cols = pl.ds(pl.multiple_of(t * bv, bv), bv) if tpp > 1 else slice(None)
            s = s_ref[j, :, cols] if early_s is None else early_s  # [dk, bv] fp32
            if pend is not None:
                loaded = (
                    early_rows
                    if early_rows is not None
                    else _pending_rows(pend, pend_path, j, cols, cfg.fold, pend_rows)
                )
                s = _fold_rows(s, pend[0], loaded, cfg.fold, prec_fold)
                sn_ref[j, :, cols] = s
            s = s.astype(s_dtype)
            ks = _dot(kb, s, prec)  # [Np, bv]
            qs = _dot(qb, s, prec)
            v = jnp.where(vrow, _load(v_ref.at[:, j, cols], inb).astype(jnp.float32), 0.0)
            rhs = beta[:, None] * (v - p * ks)
            if cfg.inverse == "matrix":
                u = _dot(tmat, rhs, prec_n)
            else:
                u = _apply_inverse(tmat, rhs, depth, cfg.inverse, prec_n)
            o = p * qs + _dot(qkg, u, prec_n)
            if broken is not None:
                o, u = jnp.where(broken, jnp.nan, o), jnp.where(broken, jnp.nan, u)
            _store(o_ref.at[:, j, cols], o.astype(o_ref.dtype), inb)
            _store(u_ref.at[:, j, cols], u, inb)
            return c

        if tpp == 1:
            value_tile(0, 0)
        else:
            jax.lax.fori_loop(0, tpp, value_tile, 0)
        return carry

    if hg == 1:
        value_head(jnp.int32(0), 0)
    else:
        jax.lax.fori_loop(0, hg, value_head, 0)


def _pending_rows(pend, pend_path: bool, j, cols, fold: str, rows: int):
    """The loads of a pending lazy commit's fold for value head j (columns cols): (scale, rows)
    with scale the state's decay p_sel and rows, by fold, "unroll": [(w_m [], k_m [dk],
    u_m [bv])] for every row present; "dot": (w [Lb], k [Lb, dk], u [Lb, bv], live [Lb]);
    "loop": a function m -> (w_m, k_m, u_m) (loaded inside the loop). Gathered rows
    (`PendingCommit`) come as the caller gathered them; a `PendingPath`'s are read from the
    previous verify's factors at the path's node ids (a dependent load of the id first), the
    weights formed here from gamma as `_commit_kernel` forms them. Independent of the state,
    so a kernel may issue them before anything else (`TreeGDNConfig.prefetch_fold`)."""
    if pend_path:
        count, sel, node_at, path_ids, pg_ref, pk_ref, pks_ref, pu_ref = pend
        g_sel = pg_ref[sel, j]

        def row(node):
            key = pk_ref[node].astype(jnp.float32) * pks_ref[node]
            return _path_weight(g_sel, pg_ref[node, j]), key, pu_ref[node, j, cols]

        scale = _path_scale(count, g_sel)
        if fold == "unroll":
            return scale, [row(node_at(m)) for m in range(rows)]
        if fold == "dot":
            path = path_ids()  # ids past the L present masked to 0 (not live)
            keys = pk_ref[path, :].astype(jnp.float32) * pks_ref[path][:, None]
            return scale, (
                _path_weight(g_sel, pg_ref[path, j]),
                keys,
                pu_ref[path, j, cols],
                jnp.arange(path.shape[0]) < count,
            )
        return scale, lambda m: row(node_at(m))
    count, pk_ref, pu_ref, pw_ref, ps_ref = pend
    scale = ps_ref[j]
    if fold == "unroll":
        return scale, [(pw_ref[m, j], pk_ref[m], pu_ref[m, j, cols]) for m in range(rows)]
    if fold == "dot":
        lp = pk_ref.shape[0]
        idx = jnp.arange(lp, dtype=jnp.int32)
        inb = None if lp == rows else idx < rows
        col = None if inb is None else inb[:, None]
        return scale, (
            _load(pw_ref.at[:, j], inb),
            _load(pk_ref, col),
            _load(pu_ref.at[:, j, cols], col),
            idx < count,
        )
    return scale, lambda m: (pw_ref[m, j], pk_ref[m], pu_ref[m, j, cols])


def _fold_rows(s, count, loaded, fold: str, precision):
    """p_sel S + sum_{m < count} w_m k_m u_m^T on one fp32 state tile s [dk, bv], from
    `_pending_rows`' (scale, rows): the rows added as `_commit_kernel` adds them, by a loop of
    fp32 rank-1 updates, unrolled ones (`_unrolled_fold`) or one dot (`_dot_fold`)."""
    scale, rows = loaded
    init = scale * s
    if fold == "unroll":
        return _unrolled_fold(count, init, rows)
    if fold == "dot":
        return _dot_fold(init, *rows, precision)
    return _rank1_fold(count, init, rows)


def _inverse_matrix(gmat, path_len, prec):
    """T = (I + G)^-1 = prod_m (I + X^(2^m)), X = -G, by squaring: 2 dependent [Np, Np] dots per
    doubling of the covered depth (2 steps for path_len <= 8)."""
    n = gmat.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    x = -gmat
    t = jnp.where(idx[:, None] == idx[None, :], 1.0, 0.0) + x  # covers X^0..X^1

    def body(c):
        width, x, t = c
        x = _dot(x, x, prec)
        return width * 2, x, t + _dot(t, x, prec)

    if isinstance(path_len, int):
        width = 2
        while width < path_len:
            width, x, t = body((width, x, t))
        return t
    return jax.lax.while_loop(lambda c: c[0] < path_len, body, (jnp.int32(2), x, t))[2]


def _apply_inverse(gmat, rhs, path_len, method, prec):
    """(I + G)^-1 rhs for G nilpotent of index <= path_len (static int or traced scalar)."""
    if method == "neumann":

        def body(_, zu):
            z, u = zu
            z = -_dot(gmat, z, prec)
            return z, u + z

        return jax.lax.fori_loop(0, path_len - 1, body, (rhs, rhs))[1]
    if method == "squaring":
        # prod_m (I + (-G)^(2^m)) = sum_{j < 2^steps} (-G)^j: exact once 2^steps >= path_len.
        if isinstance(path_len, int):
            x, u, width = -gmat, rhs, 1
            while width < path_len:
                u = u + _dot(x, u, prec)
                width *= 2
                if width < path_len:
                    x = _dot(x, x, prec)
            return u

        def body(c):
            width, x, u = c
            return width * 2, _dot(x, x, prec), u + _dot(x, u, prec)

        return jax.lax.while_loop(lambda c: c[0] < path_len, body, (jnp.int32(1), -gmat, rhs))[2]
    raise ValueError(f"inverse must be one of {_INVERSES}, got {method!r}")


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _tree_gdn_pallas(
    q,
    k,
    v,
    g,
    beta,
    state,
    anc,
    num_nodes,
    path_len,
    pending: PendingCommit | PendingPath | None = None,
    *,
    scale,
    cfg,
    interpret,
):
    """The kernel launch: q, k [B, N, Hk, dk]; v [B, N, HV, dv]; g, beta [B, N, HV]; state
    [B, HV, dk, dv]; anc [B, N, N]; num_nodes, path_len [B]. Returns (o, u, gamma, k_scale):
    `with_keys` makes the factors (outside this jit, which would copy k were it to return it).

    pending (rows [B, L, ...], see `PendingCommit`): a distinct static variant (None is an empty
    pytree, so the plain launch is unchanged) that folds the rows into each state tile and also
    returns the folded state [B, HV, dk, dv] fp32. It is written over the state buffer: in place
    when the caller's jit donates `state` and dk, dv are powers of two (else over the padded
    copy, or over an XLA copy of an undonated state). A `PendingPath` is folded the same way, its
    rows read from the previous verify's factors at the path's node ids (no gathered rows)."""
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    ratio = hv // hk
    hg = cfg.heads_per_program
    # Triton wants power-of-two blocks and dot dims >= 16. N: blocks of Np rows with masked
    # loads/stores (no copies). dk, dv (128 in real models): zero padding, which adds zero terms.
    np_, dkp, dvp = next_pow2(n), next_pow2(dk), next_pow2(dv)
    bv = min(dvp, 32 if cfg.block_v is None else cfg.block_v)
    num_warps = (4 if np_ <= 64 else 8) if cfg.num_warps is None else cfg.num_warps
    if bv < 16 or bv & (bv - 1) or dvp % bv:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dvp}")
    if hg < 1 or ratio % hg:
        raise ValueError(f"heads_per_program={hg} must divide HV/Hk={ratio}")
    if (cfg.prefetch_state or cfg.prefetch_fold) and (cfg.tiles_per_program != 1 or hg != 1):
        raise ValueError(
            "prefetch_state / prefetch_fold need tiles_per_program=1 and heads_per_program=1"
        )
    if cfg.prefetch_fold and cfg.fold == "loop":
        raise ValueError(
            "prefetch_fold needs fold 'unroll' or 'dot' (the loop loads its rows trip by trip)"
        )
    tpp = cfg.tiles_per_program
    if tpp < 1 or dvp % (bv * tpp):
        raise ValueError(f"tiles_per_program={tpp} x block_v={bv} must divide dv={dvp}")
    bw = bv * tpp  # value columns per program
    q, k = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp)
    v = pad_axis(v, 3, dvp)
    state = pad_axis(pad_axis(state.astype(jnp.float32), 2, dkp), 3, dvp)

    # Value tiles fastest, then heads: programs that share q, k (and a request's mask) run
    # together, so those loads hit L2.
    grid = (dvp // bw, hv // hg, b)
    key_head = lambda h: (h * hg) // ratio  # noqa: E731
    per_req = pl.BlockSpec((None,), lambda t, h, i: (i,))
    qk_spec = pl.BlockSpec((None, np_, None, dkp), lambda t, h, i: (i, 0, key_head(h), 0))
    val_spec = pl.BlockSpec((None, np_, hg, bw), lambda t, h, i: (i, 0, h, t))
    gate_spec = pl.BlockSpec((None, np_, hg), lambda t, h, i: (i, 0, h))
    state_spec = pl.BlockSpec((None, hg, dkp, bw), lambda t, h, i: (i, h, 0, t))
    in_specs = [
        per_req,
        per_req,
        pl.BlockSpec((None, np_, np_), lambda t, h, i: (i, 0, 0)),
        qk_spec,
        qk_spec,
        val_spec,
        gate_spec,
        gate_spec,
        state_spec,
    ]
    out_specs = [
        val_spec,
        val_spec,
        gate_spec,
        pl.BlockSpec((None, np_, None), lambda t, h, i: (i, 0, key_head(h))),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, n, hv, dvp), v.dtype),
        jax.ShapeDtypeStruct((b, n, hv, dvp), jnp.float32),
        jax.ShapeDtypeStruct((b, n, hv), jnp.float32),
        jax.ShapeDtypeStruct((b, n, hk), jnp.float32),
    ]
    args = [
        num_nodes,
        path_len,
        anc.astype(jnp.int8),
        q,
        k,
        v,
        g.astype(jnp.float32),  # int8:
        beta.astype(jnp.float32),
        state,
    ]  # bytes, not i1
    aliases = {}
    pend_path = isinstance(pending, PendingPath)
    pend_rows = pend_nodes = 0  # (the kernel's pending path rows / factor nodes, or gathered rows)
    if pend_path:
        # The previous verify's factors as blocks of Mp rows (a power of two; rows past M lie
        # past the arrays' end and are never named by the path); the path as a block of Lb ids
        # (fold "dot": a power of two, ids past L masked). count, sel and path go in as the
        # caller holds them (the kernel sanitises them): no XLA op runs before the launch
        # (each would be a kernel of its own, ~0.8 us at B = 1), nothing is copied but a dv
        # padding of u when dv is not a power of two.
        f = pending.factors
        pend_nodes, pend_rows = f.u.shape[1], pending.path.shape[1]
        mp = next_pow2(pend_nodes, minimum=1)
        lb = pend_rows if cfg.fold != "dot" else next_pow2(pend_rows)
        in_specs += [
            per_req,
            per_req,
            pl.BlockSpec((None, lb), lambda t, h, i: (i, 0)),
            pl.BlockSpec((None, mp, hg), lambda t, h, i: (i, 0, h)),
            pl.BlockSpec((None, mp, None, dkp), lambda t, h, i: (i, 0, key_head(h), 0)),
            pl.BlockSpec((None, mp, None), lambda t, h, i: (i, 0, key_head(h))),
            pl.BlockSpec((None, mp, hg, bw), lambda t, h, i: (i, 0, h, t)),
        ]
        args += [
            jnp.asarray(pending.count, jnp.int32),
            jnp.asarray(pending.sel, jnp.int32),
            jnp.asarray(pending.path, jnp.int32),
            f.gamma.astype(jnp.float32),
            pad_axis(f.k, 3, dkp),
            f.k_scale.astype(jnp.float32),
            pad_axis(f.u.astype(jnp.float32), 3, dvp),
        ]
    elif pending is not None:
        # folds "loop" / "unroll" load the rows one at a time ([dk] / [bw] vectors), so L need
        # not be a power of two; fold "dot" reads blocks of lb (a power of two >= 16) rows,
        # those past L masked. Either way no padding copy along L, only along dk / dv when those
        # are padded.
        pend_rows = pending.k.shape[1]
        lb = pend_rows if cfg.fold != "dot" else next_pow2(pend_rows)
        in_specs += [
            per_req,
            pl.BlockSpec((None, lb, None, dkp), lambda t, h, i: (i, 0, key_head(h), 0)),
            pl.BlockSpec((None, lb, hg, bw), lambda t, h, i: (i, 0, h, t)),
            pl.BlockSpec((None, lb, hg), lambda t, h, i: (i, 0, h)),
            pl.BlockSpec((None, hg), lambda t, h, i: (i, h)),
        ]
        args += [
            jnp.asarray(pending.count, jnp.int32),
            pad_axis(pending.k.astype(jnp.float32), 3, dkp),
            pad_axis(pending.u.astype(jnp.float32), 3, dvp),
            pending.w.astype(jnp.float32),
            pending.p_sel.astype(jnp.float32),
        ]
    if pending is not None:  # the folded state, written over the state input
        out_specs.append(state_spec)
        out_shape.append(jax.ShapeDtypeStruct(state.shape, jnp.float32))
        aliases = {8: 4}
    outs = pl.pallas_call(
        functools.partial(
            _tree_gdn_kernel,
            n_real=n,
            scale=scale,
            ratio=ratio,
            cfg=cfg,
            interpret=interpret,
            has_pending=pending is not None,
            pend_rows=pend_rows,
            pend_path=pend_path,
            pend_nodes=pend_nodes,
        ),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages),
        name="bole_tree_gdn",
    )(*args)
    o, u, gamma, k_scale = outs[:4]
    if dvp != dv:
        o, u = o[..., :dv], u[..., :dv]
    if pending is None:
        return o, u, gamma, k_scale
    new = outs[4]
    return o, u, gamma, k_scale, (new[:, :, :dk, :dv] if (dkp, dvp) != (dk, dv) else new)


def tree_gdn_verify(
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
    tree: TreeStructure | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    config: TreeGDNConfig | None = None,
    pending: PendingCommit | PendingPath | None = None,
    depth_bound: int | None = None,
    options: KernelOptions | None = None,
):
    """Verify all nodes of a draft tree through one GDN layer from the committed state.

    q, k [B, N, Hk, dk] raw (L2 norm and `scale`, default dk^-1/2, are fused); v [B, N, HV, dv]
    (bf16 or fp32); g [B, N, HV] fp32 log gate (<= 0); beta [B, N, HV] fp32; state [B, HV, dk, dv]
    fp32 (read only); parents [B, N] int32 (parent < index, -1 = child of the committed state);
    num_nodes [B] int32 or None (nodes >= num_nodes are padding: zero outputs and factors).
    tree: `tree_structure(parents, num_nodes)`, computed once per step and shared by all layers
    (computed here when None). backend: "auto" | "pallas" | "reference". config: launch
    parameters of the kernel (None: on a GPU the Mosaic GPU kernel where `mosaic_launch` takes
    it, else `TreeGDNConfig.auto(B, N, depth_bound)`).
    depth_bound: the most nodes on a root path of the caller's trees (a decode step's tree depth
    + 1), used by the auto config (`TreeGDNConfig.depth_bound`: a request whose tree is deeper
    gets NaN outputs and factors from the kernel; the reference backend ignores it).
    options: the kernel options the auto launch follows (None: the defaults, `KernelOptions()`).

    pending: the previous step's commit, not yet applied (`pending_commit`, the lazy commit):
    the verify starts from S = apply_pending(state, pending) and also returns that state. The
    Pallas kernel folds the rows into each state tile it loads (the state is read and written
    once per step) and writes S over the state buffer: in place when the caller's jit donates
    `state`; without donation XLA copies the state first. A `PendingPath` (the previous verify's
    factors and accepted path, the lazy commit without a gather launch) gives the same S: the
    Triton kernel reads the path's rows from the factors; the reference and the Mosaic route
    gather them first (`gather_pending_path`).

    Returns (o [B, N, HV, dv] in v.dtype, TreeFactors(k = the keys as given (bf16 ones rounded
    to bf16 first on the Mosaic route), u [B, N, HV, dv] fp32, gamma [B, N, HV] fp32, k_scale
    [B, N, Hk] fp32: the keys' normalising factors, `TreeFactors.keys()`)), plus the state S
    [B, HV, dk, dv] fp32 when `pending` is given.
    """
    b, n, hk, dk = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, n) or hv % hk:
        raise ValueError(
            f"inconsistent shapes q {q.shape} k {k.shape} v {v.shape}: need "
            "q, k [B, N, Hk, dk], v [B, N, HV, dv] with HV a multiple of Hk"
        )
    if g.shape != (b, n, hv) or beta.shape != (b, n, hv) or state.shape != (b, hv, dk, v.shape[3]):
        raise ValueError(
            f"g {g.shape} / beta {beta.shape} must be [B, N, HV] and state "
            f"{state.shape} [B, HV, dk, dv]"
        )
    scale = float(dk**-0.5 if scale is None else scale)
    options = KernelOptions() if options is None else options
    backend, interpret = resolve_backend(backend, interpret)
    if isinstance(pending, PendingPath):
        check_pending_path(pending, b, hk, hv, dk, v.shape[3])
    elif pending is not None:
        check_pending(pending, b, hk, hv, dk, v.shape[3])
    if backend == "reference":
        if isinstance(pending, PendingPath):
            pending = gather_pending_path(pending, backend="reference")
        if pending is None:
            return tree_gdn_ref.tree_gdn_closed_form(
                q, k, v, g, beta, state, parents, num_nodes, scale=scale, tree=tree
            )
        state = apply_pending(state, pending)
        o, factors = tree_gdn_ref.tree_gdn_closed_form(
            q, k, v, g, beta, state, parents, num_nodes, scale=scale, tree=tree
        )
        return o, factors, state
    if n > 128:
        raise ValueError(
            f"the Pallas tree kernel handles N <= 128 nodes (got {n}): its N x N "
            "tiles must fit one program; use backend='reference' or a smaller tree"
        )
    if tree is None:
        tree = tree_structure(parents, num_nodes)
    launch = (
        None
        if config is not None or interpret
        else mosaic_launch(b, n, dk, v.shape[3], v.dtype, depth_bound, options)
    )
    if launch is not None and isinstance(pending, PendingPath):
        pending = gather_pending_path(pending, backend="pallas", interpret=False)
    if launch is not None and (pending is None or pending.k.shape[1] >= 1):
        # The measured-faster Mosaic GPU kernel (same outputs). With a pending commit it folds
        # the rows into its state tiles and writes them back in place, also measured faster
        # than the best Triton fold (docs/kernels.md, launch table).
        return tree_gdn_mgpu.tree_gdn_verify_mgpu(
            q,
            k,
            v,
            g,
            beta,
            state,
            parents,
            num_nodes,
            depth_bound=depth_bound,
            scale=scale,
            tree=tree,
            interpret=False,
            pending=pending,
            **launch,
        )
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    # No config: the measured launch table on a device; in interpret mode plain fp32 operands
    # (tests compare against the fp32 reference there), or with options.interpret_numerics
    # "device" the table's launch with its roundings emulated (numerics studies on a CPU).
    if config is not None:
        cfg = config
    elif interpret and options.interpret_numerics == "fp32":
        cfg = TreeGDNConfig(depth_bound=depth_bound)
    else:
        cfg = TreeGDNConfig.auto(b, n, depth_bound, options, dv=v.shape[-1])
        if interpret:  # "device": the launch's roundings emulated
            cfg = dataclasses.replace(cfg, emulate_tf32=True)
    if cfg.inverse not in _INVERSES or cfg.precision not in _PRECISIONS or cfg.fold not in _FOLDS:
        raise ValueError(
            f"inverse must be one of {_INVERSES}, precision one of "
            f"{tuple(_PRECISIONS)} and fold one of {_FOLDS}, got {cfg.inverse!r}, "
            f"{cfg.precision!r}, {cfg.fold!r}"
        )
    return with_keys(
        k,
        _tree_gdn_pallas(
            q,
            k,
            v,
            g,
            beta,
            state,
            tree.anc,
            jnp.asarray(num_nodes, jnp.int32),
            tree.path_len.astype(jnp.int32),
            pending,
            scale=scale,
            cfg=cfg,
            interpret=interpret,
        ),
    )
