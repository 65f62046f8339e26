"""The tree-GDN verify as a Pallas Mosaic GPU kernel (TMA + wgmma; Hopper).

The engine's verify at 64 nodes on jax >= 0.11 (`tree_gdn.mosaic_launch`: 64-column tiles,
the squaring inverse, one bf16 wgmma per product, hardware exp / rsqrt, the kernel's own
barriers), measured faster than the Triton verify on the H200 at N = 64 and every batch
(docs/kernels.md, launch table), u error 1.4e-4 (Triton 1.1-2.3e-4).
Other launches stay for measurement (`products` 3 and 2, 128-column tiles, the Neumann
series). A verify with another structure than the Triton kernel of `tree_gdn.py` (255 registers
there, two programs per SM): one program per (value tile, value head, request), one
warpgroup, the operands moved by TMA straight from the caller's layouts (strided boxes: no
transposes), every product a bf16 wgmma:

    K K^T, Q K^T                 [N, N]   (k read transposed from shared memory)
    K S, Q S                     [N, bv]  (the fp32 state tile converted to bf16 in shared memory)
    (I + G)^-1 rhs               the finite Neumann series, depth_bound - 1 steps of -G @ X (or
                                 by squaring: (I - G)(I + G^2)(I + G^4)...), each product as
                                 `products` bf16 wgmmas: 3 of a hi / lo split of both operands
                                 (hi hi + hi lo + lo hi: ~16 mantissa bits), 2 (the left operand
                                 rounded) or 1 (both rounded: u error 1.4e-4 against 1.0e-4 at 3,
                                 o 4.0e-3 against 3.2e-3, the bf16 rounding of k and the state
                                 dominating)
    (Q K^T * Gam) U              the same

Same maths and outputs as `tree_gdn_ref.tree_gdn_closed_form` (docs/kernels.md section 1):
o [B, N, HV, dv] in v.dtype and TreeFactors(k, u, gamma). Exact for trees whose longest root path
is at most `depth_bound` nodes (G is nilpotent); deeper requests get NaN outputs, as the Triton
kernel's static depth bound does.

q/k are L2-normalised (and q scaled) in the kernel, in place in shared memory; one program per
key head writes the keys' normalising factors (`TreeFactors.k_scale`) from registers (the
factor k is the caller's bf16 keys: no key write). `block_v` 128 (one value tile per head:
161 KiB of shared memory by Pallas's estimate, one program per SM) or 64 (105 KiB with either
inverse: two programs per SM, K K^T and Q K^T computed twice). The gates come in as the caller
holds them ([B, N, HV]: an 8-head TMA box, this head's column picked in registers); masking, the
root-path gamma (an fp32 row sum of anc * g) and the depth guard are in the kernel, so the only
XLA work around it is padding (N < 64, or HV not a multiple of 8). A pending lazy commit
(`pending=`; the engine's lazy verify at 64 nodes) is folded into
the fp32 state tile in the prologue: its rows (k, u, and the weights and p_sel in 8-head
boxes, as the caller holds them) by TMA, fp32 rank-1 updates in registers, the folded tile
stored by TMA back where it was read (the state a mutable ref, `jax.new_ref`: in place, so a
donating caller's XLA copies nothing; the 64-column launch then needs 113 KiB of shared memory
by Pallas's estimate: still two programs per SM; the g / gamma vectors share one buffer for
that, in this variant only); measured faster than the best Triton fold (docs/kernels.md, launch
table). Limits of this version:
dk = dv = 128, N <= 64 (padded to 64), no pipelining across programs, o rounded through bf16
whatever v's dtype (fp32 callers get bf16 precision).

Versions: written for jax >= 0.11 (the GPU image's 0.11.2: `plgpu.kernel(out_type=,
scratch_types=)`, transposed shared-memory refs). Tests run it in Mosaic GPU interpret mode on the
CPU under jax 0.11 and skip under 0.10.2, whose interpret mode cannot run it (a transform on
loads fails there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bole_jax.pallas.factors import PendingCommit, check_pending, with_keys
from bole_jax.pallas.tree_utils import L2_EPS, TreeStructure, tree_structure

__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "NP", "tree_gdn_verify_mgpu"]

NP = 64  # nodes per program (one wgmma M block); trees of up to NP nodes
GATE_BOX = 8  # value heads per TMA box of the gates (32 bytes of fp32)
HEAD_DIM = 128

try:  # jax >= 0.11: the API this kernel is written against
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
    AVAILABLE = _VERSION >= (0, 11) and hasattr(plgpu, "InterpretGPUParams")
    UNAVAILABLE_REASON = (
        ""
        if AVAILABLE
        else (
            f"jax {jax.__version__}: the Mosaic GPU verify needs jax >= 0.11 (plgpu.kernel's "
            "out_type / scratch_types, transposed shared-memory operands, GPU interpret mode)"
        )
    )
except ImportError as e:  # pragma: no cover - a jax without Mosaic GPU
    plgpu = None
    AVAILABLE, UNAVAILABLE_REASON = False, f"no Mosaic GPU in this jax: {e}"

_BF, _F32 = jnp.bfloat16, jnp.float32
# The kernel's phases, as named regions: with `profile_dir` set, Mosaic GPU's in-kernel profiler
# records each region's start and end per program (benchmarks/profile/mgpu_trace.py reads the trace).
_region = jax.named_scope
PROFILE_SPACE = 96  # regions entered per program


def _transforms(dtype, per_row=None):
    """The swizzle of a row of `per_row` elements (128 bytes by default) with the matching
    tile, the layout wgmma and TMA both take."""
    per_row = per_row or 128 // jnp.dtype(dtype).itemsize
    return (
        plgpu.TilingTransform((8, per_row)),
        plgpu.SwizzleTransform(per_row * jnp.dtype(dtype).itemsize),
    )


def _split(x):
    """x = hi + lo with hi, lo bf16 (hi carries 8 mantissa bits, lo the next 8)."""
    hi = x.astype(_BF)
    return hi, (x - hi.astype(_F32)).astype(_BF)


def _kernel(*refs, ratio, depth, o_dtype, scale, bv, inverse, products, pend_rows, auto_barriers):
    # pend_rows > 0 (a pending lazy commit of that many rows): after the state s_g come its
    # rows pk [B, L, Hk, dk], pu [B, L, HV, dv], the weights pw [B, L, HVp] and p_sel
    # [B, HVp], as the caller holds them (no count: rows past it weigh 0, `PendingCommit`);
    # s_g is then a mutable ref each program writes its folded tile back into (in place).
    n_in, n_out = (12, 4) if pend_rows else (8, 4)
    q_g, k_g, v_g, g_g, beta_g, vflag_g, anc_g, s_g, *pend_g = refs[:n_in]
    o_g, u_g, ks_g, gam_out_g = refs[n_in : n_in + n_out]
    q_s, k_s, v_s, sb_s, vr_s, bar = refs[n_in + n_out :]
    n, dk = NP, HEAD_DIM
    wg = plgpu.Layout.WGMMA
    t = lax.axis_index("t")
    h = lax.axis_index("h")
    b = lax.axis_index("b")
    hk = h // ratio
    cols = pl.ds(t * bv, bv)  # this program's value columns
    # Every operand by TMA, straight from the caller's layouts.
    plgpu.copy_gmem_to_smem(q_g.at[b, :, hk, :], q_s, bar)
    plgpu.copy_gmem_to_smem(k_g.at[b, :, hk, :], k_s, bar)
    plgpu.copy_gmem_to_smem(v_g.at[b, :, h, cols], v_s, bar)
    plgpu.copy_gmem_to_smem(vflag_g.at[b], vr_s, bar)

    def rows_of(vec, width):
        return lax.broadcast_in_dim(vec, (n, width), [0])

    def sync():
        """With auto_barriers off, the warpgroup barrier where the kernel needs one (a
        commit_smem: the proxy fence beside it costs little): after a store that other threads
        read (the column vectors), before the first store into shared memory that earlier
        reads (other warps' loads, wgmmas) may still use. Pallas's automatic barriers put one
        before and one after every store instead."""
        if not auto_barriers:
            plgpu.commit_smem()

    def normalize(ref, factor, valid):
        """x * rsqrt(sum x^2 + eps) * factor per row, padding rows 0, back into `ref` (bf16);
        returns the rows' factors rsqrt(sum x^2 + eps) * factor ([n], per row)."""
        x = plgpu.load(ref, layout=wg).astype(_F32)
        inv = lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS) * factor
        ref[...] = jnp.where(valid, x * rows_of(inv, dk), 0.0).astype(_BF)
        return inv

    def fold(s, pk_s, pu_s, pw_s):
        """p_sel S + sum_m w_m k_m u_m^T on the fp32 state tile s [dk, bv] (registers): fp32
        rank-1 updates, unrolled over the rows present, each under a branch on its weight.
        Rows past the count weigh 0 (the `PendingCommit` contract) and are skipped, as is a
        weight that is not finite, so NaN / inf in a skipped row's factors cannot leak, and a
        decode step's shorter paths skip their padding rows' work. (Zeroing every non-finite
        factor element by value instead costs ~60 ALU operations per row and thread, as many as
        the update's own 64 FMAs.)"""
        col = h % GATE_BOX
        acc = pw_s[ps_row, col] * s  # p_sel
        for m in range(pend_rows):
            w = pw_s[m, col]
            live = jnp.logical_and(w != 0.0, jnp.abs(w) < jnp.inf)  # (a uniform scalar)

            def update(a, m=m, w=w):
                k_m = plgpu.load(pk_s.at[m], layout=wg.reduce(1)) * w  # [dk], per state row
                u_m = plgpu.load(pu_s.at[m], layout=wg.reduce(0))  # [bv], per column
                return a + (
                    lax.broadcast_in_dim(k_m, (dk, bv), [0])
                    * lax.broadcast_in_dim(u_m, (dk, bv), [1])
                )

            acc = lax.cond(live, update, lambda a: a, acc)
        return acc

    def prologue(s32_s, anc_s, g8_s, b8_s, vec_s, sbar, *pend_s):
        # vec_s: g and gamma as column vectors, two buffers or (with a pending commit, whose
        # rows need the space: allocations are aligned) one of two rows
        # (the fp32 state tile, the mask, the gates and a pending commit's rows live only here)
        # The gates: the 8-head box holding this head (TMA needs a contiguous inner extent; 32
        # bytes here), its column picked in registers.
        heads8 = pl.ds((h // GATE_BOX) * GATE_BOX, GATE_BOX)
        plgpu.copy_gmem_to_smem(g_g.at[b, :, heads8], g8_s, bar)
        plgpu.copy_gmem_to_smem(beta_g.at[b, :, heads8], b8_s, bar)
        plgpu.copy_gmem_to_smem(s_g.at[b, h, :, cols], s32_s, sbar)
        plgpu.copy_gmem_to_smem(anc_g.at[b], anc_s, sbar)
        if pend_rows:
            pk_g, pu_g, pw_g, ps_g = pend_g
            pk_s, pu_s, pw_s = pend_s
            plgpu.copy_gmem_to_smem(pk_g.at[b, :, hk, :], pk_s, sbar)
            plgpu.copy_gmem_to_smem(pu_g.at[b, :, h, cols], pu_s, sbar)
            plgpu.copy_gmem_to_smem(pw_g.at[b, :, heads8], pw_s.at[pl.ds(0, pend_rows)], sbar)
            plgpu.copy_gmem_to_smem(ps_g.at[b, heads8], pw_s.at[ps_row], sbar)
        with _region("wait_qkv"):
            plgpu.barrier_wait(bar)
        # vflag: 1 a node, 0 padding, NaN every row of a request deeper than the bound (such a
        # request counts as live: its NaN comes from beta)
        vflag = plgpu.load(vr_s, layout=wg.reduce(1))
        live = vflag != 0
        with _region("normalize"):
            valid = rows_of(vflag, dk) != 0
            normalize(q_s, scale, valid)
            k_inv = normalize(k_s, 1.0, valid)

        @pl.when(jnp.logical_and(h % ratio == 0, t == 0))  # one program per key head
        def _():  # the factor k_scale, from registers (the factor k is the caller's keys)
            ks_g.at[b, :, hk][...] = jnp.where(live, k_inv, 0.0)

        with _region("wait_state"):
            plgpu.barrier_wait(sbar)
        with _region("state_bf16"):
            s = plgpu.load(s32_s, layout=wg)
            if pend_rows:  # the lazy commit: the folded state is the one verified, and stored
                with _region("fold"):
                    s = fold(s, *pend_s)
                s32_s[...] = s
            sb_s[...] = s.astype(_BF)
            plgpu.commit_smem()
            if pend_rows:
                # in place: s_g is then a mutable ref, and only this program reads this tile
                plgpu.copy_smem_to_gmem(s32_s, s_g.at[b, h, :, cols])
        with _region("gam"):
            box_cols = plgpu.broadcasted_iota(jnp.int32, (n, GATE_BOX), 1, layout=wg)

            def column(ref):  # this head's gate per node, row-indexed
                x = plgpu.load(ref, layout=wg)
                return jnp.sum(jnp.where(box_cols == h % GATE_BOX, x, 0.0), axis=1)

            g_node = jnp.where(live, column(g8_s), 0.0)  # (padding may hold inf)
            # A request deeper than the static bound would come out silently wrong: its beta
            # rows NaN make G, U and O NaN (loud, as the Triton kernel's bound).
            b_row = jnp.where(live, column(b8_s) * vflag, 0.0)
            # gamma_i = sum_j anc[i, j] g_j: the root-path cumulative gate. g and gamma are
            # re-read from shared memory as column vectors.
            gv_s, gc_s = (vec_s.at[0], vec_s.at[1]) if pend_rows else vec_s
            gv_s[...] = g_node
            sync()
            anc = plgpu.load(anc_s, layout=wg).astype(_F32)
            g_col = plgpu.load(gv_s, layout=wg.reduce(0))
            g_row = jnp.sum(anc * lax.broadcast_in_dim(g_col, (n, n), [1]), axis=1)
            gc_s[...] = g_row
            sync()

            @pl.when(t == 0)  # the factor gamma, one program per value head
            def _():
                gam_out_g.at[b, :, h][...] = g_row

            gamma_col = plgpu.load(gc_s, layout=wg.reduce(0))
            diff = rows_of(g_row, n) - lax.broadcast_in_dim(gamma_col, (n, n), [1])
            # Gam: exp(gamma_i - gamma_j) on anc*(i)
            gam = jnp.exp(jnp.minimum(diff, 0.0)) * anc
        if pend_rows:  # the folded state's store has read its shared memory (freed next)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return gam, g_row, b_row, vflag

    # a pending commit's rows (unswizzled: read row by row and as scalars)
    # (the weights' rows, then p_sel in the first row on a 128-byte boundary, where a TMA
    # destination must start: one buffer, as a second would cost an aligned KiB of its own)
    ps_row = -(-pend_rows // 4) * 4
    pend_scratch = (
        [
            plgpu.SMEM((pend_rows, dk), _F32),
            plgpu.SMEM((pend_rows, bv), _F32),
            plgpu.SMEM((ps_row + 1, GATE_BOX), _F32),
        ]
        if pend_rows
        else []
    )
    gam, g_row, b_row, vflag = pl.run_scoped(
        prologue,
        plgpu.SMEM((dk, bv), _F32, transforms=_transforms(_F32)),
        plgpu.SMEM((n, n), _BF, transforms=_transforms(_BF)),
        *[plgpu.SMEM((n, GATE_BOX), _F32, transforms=_transforms(_F32, GATE_BOX))] * 2,
        # g, gamma as column vectors (the GPU-timed layout without a pending commit)
        plgpu.SMEM((2, n), _F32) if pend_rows else [plgpu.SMEM((n,), _F32)] * 2,
        plgpu.Barrier(num_arrivals=6 if pend_rows else 2),
        *pend_scratch,
    )

    @_region("mm")
    def mms(*jobs):
        """Independent products, each (pairs, shape): every wgmma issued, then one wait."""

        def run(*accs):
            for (pairs, _), acc in zip(jobs, accs):
                for a, c in pairs:
                    plgpu.wgmma(acc, a, c)
            plgpu.wgmma_wait(0)
            # The barrier ties the accumulators' registers to after the wait. Without it LLVM
            # hoisted a use of them (a negation) above the wait, and ptxas then serialised
            # every wgmma of the kernel (its warning C7514 in a GPU profile).
            return lax.optimization_barrier(tuple(acc[...] for acc in accs))

        return pl.run_scoped(run, *(plgpu.ACC(shape, _F32) for _, shape in jobs))

    def mm(pairs, shape):
        return mms((pairs, shape))[0]

    def split_pairs(a, c):
        """a @ c for (hi, lo) buffer pairs, as `products` bf16 wgmmas: hi hi + hi lo + lo hi
        (3), hi hi + hi lo (2: the left operand rounded to bf16) or hi hi (1)."""
        return [(a[0], c[0]), (a[0], c[1]), (a[1], c[0])][:products]

    def mm_split(a, c, shape):
        return mm(split_pairs(a, c), shape)

    @_region("put")
    def put(pair, value, right=True):
        """value into a (hi, lo) pair; its lo part only where a product reads it: products 3,
        or products 2 when the pair is ever a right operand."""
        if products == 3 or (products == 2 and right):
            pair[0][...], pair[1][...] = _split(value)
        else:
            pair[0][...] = value.astype(_BF)

    def main(ah_s, al_s, xh_s, xl_s, *power):
        a_pair, x_pair = (ah_s, al_s), (xh_s, xl_s)
        rows = plgpu.broadcasted_iota(jnp.int32, (n, n), 0, layout=wg)
        cols_nn = plgpu.broadcasted_iota(jnp.int32, (n, n), 1, layout=wg)
        kt = k_s.T
        with _region("kk_ks"):
            kk, ks = mms(([(k_s, kt)], (n, n)), ([(k_s, sb_s)], (n, bv)))
            g_neg = jnp.where(rows > cols_nn, -rows_of(b_row, n) * kk * gam, 0.0)
            p_rows = rows_of(jnp.exp(g_row), bv)
            v = plgpu.load(v_s, layout=wg).astype(_F32)
            v = jnp.where(rows_of(vflag, bv) != 0, v, 0.0)  # padding rows: may hold garbage
            rhs = rows_of(b_row, bv) * (v - p_rows * ks)

        @_region("inverse")
        def solve(rhs):
            # -G is a left operand only with the Neumann series; with squaring the right one
            # of its own square too. (These buffers reuse the prologue's shared memory.)
            sync()
            put(a_pair, g_neg, right=inverse == "squaring")
            if inverse == "neumann":  # U = sum_{m < depth} (-G)^m rhs: depth - 1 serial products
                u = x = rhs
                for m in range(depth - 1):
                    if m:
                        sync()  # (the last product read x_pair)
                    put(x_pair, x)
                    plgpu.commit_smem()
                    x = mm_split(a_pair, x_pair, (n, bv))
                    u = u + x
            else:  # squaring: U = (I + M)(I + M^2)(I + M^4)... rhs, M = -G, M^depth = 0
                pairs = [a_pair, tuple(power)]
                u, p_val = rhs, g_neg
                factors = (depth - 1).bit_length()  # 2^factors >= depth
                for i in range(factors):
                    put(x_pair, u)
                    jobs = [(split_pairs(pairs[i % 2], x_pair), (n, bv))]
                    if i + 1 < factors:  # the next power, issued beside the [N, bv] product.
                        # Its A operand is a copy in the other pair: lowering refuses one
                        # buffer as both operands, and interpret mode an A operand from
                        # registers.
                        nxt = pairs[(i + 1) % 2]
                        put(nxt, p_val, right=False)
                        jobs.append((split_pairs(nxt, pairs[i % 2]), (n, n)))
                    plgpu.commit_smem()
                    res = mms(*jobs)
                    u = u + res[0]
                    if i + 1 < factors:
                        p_val = res[1]
                        sync()  # (the products read both pairs)
                        put(nxt, p_val)

            return u

        u = solve(rhs)
        with _region("output"):
            qk, qs = mms(([(q_s, kt)], (n, n)), ([(q_s, sb_s)], (n, bv)))
            sync()  # (the inverse's last product read both pairs)
            put(a_pair, qk * gam, right=False)
            put(x_pair, u)
            plgpu.commit_smem()
            wu = mm_split(a_pair, x_pair, (n, bv))
            return p_rows * qs + wu, u

    nn_pair = [plgpu.SMEM((n, n), _BF, transforms=_transforms(_BF))] * 2  # -G / W, hi and lo
    x_pair = [plgpu.SMEM((n, bv), _BF, transforms=_transforms(_BF))] * 2  # X / U, hi and lo
    o, u = pl.run_scoped(
        main, *nn_pair, *x_pair, *(nn_pair if inverse == "squaring" else [])
    )  # the powers of M

    @_region("store")
    def store(o_s, u_s):  # (the inverse's buffers are free again: the same shared memory)
        sync()
        o_s[...] = o.astype(o_dtype)
        u_s[...] = u
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, h, cols])
        plgpu.copy_smem_to_gmem(u_s, u_g.at[b, :, h, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        store,
        plgpu.SMEM((n, bv), o_dtype, transforms=_transforms(o_dtype)),
        plgpu.SMEM((n, bv), _F32, transforms=_transforms(_F32)),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "depth_bound",
        "block_v",
        "inverse",
        "products",
        "approx_math",
        "auto_barriers",
        "interpret",
        "profile_dir",
    ),
)
def _verify(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents,
    num_nodes,
    tree,
    pending,
    *,
    scale,
    depth_bound,
    block_v,
    inverse,
    products,
    approx_math,
    auto_barriers,
    interpret,
    profile_dir,
):
    bsz, n, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if tree is None:
        tree = tree_structure(parents, num_nodes)
    pad = NP - n
    valid = jnp.pad(tree.valid, ((0, 0), (0, pad)))
    anc = jnp.pad(tree.anc, ((0, 0), (0, pad), (0, pad)))

    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(_BF)
    kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(_BF)
    vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(_BF)
    # The gates as the caller holds them ([B, N, HV]; padded only for N < 64 or HV not a
    # multiple of the 8-head box); masking, gamma and the depth guard are in the kernel.
    hvp = -(-hv // GATE_BOX) * GATE_BOX
    gp = jnp.pad(g.astype(_F32), ((0, 0), (0, pad), (0, hvp - hv)))
    bp = jnp.pad(beta.astype(_F32), ((0, 0), (0, pad), (0, hvp - hv)))
    vflag = jnp.where((tree.path_len > depth_bound)[:, None], jnp.nan, valid.astype(_F32))
    o_dtype = v.dtype if v.dtype in (jnp.bfloat16, jnp.float16) else _BF
    pend_rows = 0 if pending is None else pending.k.shape[1]
    pend_args = []
    if pend_rows:  # the rows as the caller holds them (heads padded to the 8-head box only;
        # concatenating w, p_sel and the count into one box cost two XLA launches per call,
        # ~2.3 us at B = 16)
        pend_args = [
            pending.k.astype(_F32),
            pending.u.astype(_F32),
            jnp.pad(pending.w.astype(_F32), ((0, 0), (0, 0), (0, hvp - hv))),
            jnp.pad(pending.p_sel.astype(_F32), ((0, 0), (0, hvp - hv))),
        ]

    def bole_tree_gdn_verify_mgpu(*refs):  # (the kernel's name in profiles)
        _kernel(
            *refs,
            ratio=hv // hk,
            depth=depth_bound,
            o_dtype=o_dtype,
            scale=scale,
            bv=block_v,
            inverse=inverse,
            products=products,
            pend_rows=pend_rows,
            auto_barriers=auto_barriers,
        )

    kernel = plgpu.kernel(
        bole_tree_gdn_verify_mgpu,
        out_type=(
            jax.ShapeDtypeStruct((bsz, NP, hv, dv), o_dtype),
            jax.ShapeDtypeStruct((bsz, NP, hv, dv), _F32),
            jax.ShapeDtypeStruct((bsz, NP, hk), _F32),
            jax.ShapeDtypeStruct((bsz, NP, hvp), _F32),
        ),
        scratch_types=[
            plgpu.SMEM((NP, dk), _BF, transforms=_transforms(_BF)),  # q
            plgpu.SMEM((NP, dk), _BF, transforms=_transforms(_BF)),  # k
            plgpu.SMEM((NP, block_v), _BF, transforms=_transforms(_BF)),  # v
            plgpu.SMEM((dk, block_v), _BF, transforms=_transforms(_BF)),  # S in bf16
            plgpu.SMEM((NP,), _F32),  # vflag
            plgpu.Barrier(num_arrivals=6),
        ],
        grid=(dv // block_v, hv, bsz),
        grid_names=("t", "h", "b"),
        compiler_params=plgpu.CompilerParams(
            approx_math=approx_math,
            unsafe_no_auto_barriers=not auto_barriers,
            **(dict(profile_space=PROFILE_SPACE, profile_dir=profile_dir) if profile_dir else {}),
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    # With a pending commit the state goes in as a mutable ref: each program folds its tile and
    # writes it back where it read it (no other program reads that tile), so the folded state
    # takes the state's buffer (the caller's, when it donates it) instead of a new one, which a
    # donating caller's XLA had copied back (a device copy of the whole state per call:
    # 16.9 us of 74.9 at B = 16 with a new buffer).
    s_in = state.astype(_F32)
    if pend_rows:
        s_in = jax.new_ref(s_in)
    o, u, k_scale, gamma = kernel(qb, kb, vb, gp, bp, vflag, anc.astype(_BF), s_in, *pend_args)
    if pad:
        o, u, k_scale, gamma = o[:, :n], u[:, :n], k_scale[:, :n], gamma[:, :n]
    if hvp != hv:
        gamma = gamma[:, :, :hv]
    if pend_rows:
        return o.astype(v.dtype), u, gamma, k_scale, jax.freeze(s_in)
    return o.astype(v.dtype), u, gamma, k_scale


def tree_gdn_verify_mgpu(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents,
    num_nodes=None,
    *,
    depth_bound: int,
    scale=None,
    tree: TreeStructure | None = None,
    block_v: int = 128,
    inverse: str = "neumann",
    products: int = 3,
    approx_math: bool = False,
    auto_barriers: bool = True,
    pending: PendingCommit | None = None,
    interpret=None,
    profile_dir: str | None = None,
):
    """The Mosaic GPU tree verify; inputs and outputs as `tree_gdn.tree_gdn_verify`
    (q, k [B, N, Hk, 128]; v [B, N, HV, 128]; g, beta [B, N, HV]; state [B, HV, 128, 128];
    parents [B, N]). `depth_bound`: nodes on the longest root path any request may have (a
    static int; deeper requests give NaN). block_v: value columns per program, 128 (one program
    per SM: 161 KiB of shared memory) or 64 (105 KiB: two per SM; K K^T and Q K^T
    are then computed twice). inverse: "neumann" (depth_bound - 1 serial [N, bv] products) or
    "squaring" ((I - G)(I + G^2)(I + G^4)...: ceil(log2(depth_bound)) of them, the powers of G
    as [N, N] products beside, in buffers the prologue's have freed). products: bf16 wgmmas per
    product of fp32 values (the inverse's and W U): 3 (hi / lo splits of both operands, ~16
    mantissa bits), 2 (the left operand, -G or W, rounded to bf16: it already carries the bf16
    rounding of k and q through K K^T and Q K^T) or 1 (both rounded). approx_math: exp and rsqrt
    by the hardware's approximations (ex2.approx, rsqrt.approx: ~2^-22 relative) instead of
    libdevice's (Mosaic GPU's `approx_math`). auto_barriers: False turns off Pallas's
    automatic warpgroup barriers around every shared-memory store (`unsafe_no_auto_barriers`);
    the kernel then places its own where a store can meet another warp's read (after the
    column vectors' stores, before the stores into reused buffers). pending: a lazy commit
    (`tree_gdn_commit.pending_commit`; the engine's lazy verify at 64 nodes): each
    program folds its rows into the fp32 state tile it loads (fp32 rank-1 updates, as the
    Triton kernel's fold "unroll"; a row whose weight is 0 or not finite is skipped),
    verifies from that state and stores it; returns (o, factors, folded state [B, HV, dk, dv]
    fp32, written in place: the state's buffer when the caller donates it). interpret=None:
    interpret mode unless on a GPU. profile_dir: record the kernel's phases per program with
    Mosaic GPU's in-kernel profiler and write the trace (Chrome trace JSON) there, one file per
    call (GPU only; benchmarks/profile/mgpu_trace.py summarises it)."""
    if not AVAILABLE:
        raise RuntimeError(UNAVAILABLE_REASON)
    bsz, n, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if (dk, dv) != (HEAD_DIM, HEAD_DIM):
        raise ValueError(f"tree_gdn_verify_mgpu supports dk = dv = {HEAD_DIM}, got {dk}, {dv}")
    if not 1 <= n <= NP:
        raise ValueError(f"tree_gdn_verify_mgpu supports 1 to {NP} nodes, got {n}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if block_v not in (64, 128):
        raise ValueError(f"block_v must be 64 or 128, got {block_v}")
    if inverse not in ("neumann", "squaring"):
        raise ValueError(f"inverse must be 'neumann' or 'squaring', got {inverse!r}")
    if products not in (1, 2, 3):
        raise ValueError(f"products must be 1, 2 or 3, got {products!r}")
    if int(depth_bound) < 1:
        raise ValueError(f"depth_bound must be >= 1, got {depth_bound}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    scale = float(dk**-0.5 if scale is None else scale)
    parents = jnp.asarray(parents, jnp.int32)
    if num_nodes is not None:
        num_nodes = jnp.asarray(num_nodes, jnp.int32)
    if pending is not None:
        check_pending(pending, bsz, hk, hv, dk, dv)
        if pending.k.shape[1] < 1:  # (the kernel unrolls its rows: none would drop the fold)
            raise ValueError("pending rows: a pending commit needs at least one row")
    # the factor k: the keys the kernel normalised (bf16: the caller's own array when bf16)
    return with_keys(
        k.astype(_BF),
        _verify(
            q,
            k,
            v,
            g,
            beta,
            state,
            parents,
            num_nodes,
            tree,
            pending,
            scale=scale,
            depth_bound=int(depth_bound),
            block_v=int(block_v),
            inverse=inverse,
            products=int(products),
            approx_math=bool(approx_math),
            auto_barriers=bool(auto_barriers),
            interpret=bool(interpret),
            profile_dir=None if interpret else profile_dir,
        ),
    )
