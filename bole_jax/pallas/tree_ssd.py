"""Bole tree verify through a Mamba2 / SSD layer: one fused Pallas (Triton) kernel.

The SSD recurrence S_t = exp(a_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t is the gated delta rule
with G = 0 (docs/algorithm.md, SSD layers; the Mamba2 mapping q = C, k = B, v = dt x,
a = dt A is in `tree_ssd_ref`, with `from_mamba2`; D x, the gate and the conv stay outside). Per
request and value head, all N tree nodes at once from the ONE committed state S_pre [dk, dv]:
    gamma = A* a                               root-path cumulative log decays, P = exp(gamma)
    Gam[i, j] = exp(gamma_i - gamma_j) on A*   (<= 1: no overflow)
    O = diag(P) Q S_pre + ((Q K^T) * Gam * A*) V
Unlike GDN (`tree_gdn.py`) there is no (I + G)^-1, no key normalisation and no pseudo values: the
kernel is two dots per value tile, and the token-level factors are the inputs themselves,
(k, u = v, gamma), of which only gamma is computed here. `tree_gdn_commit.commit_state` rebuilds the
accepted node's state from them exactly as for GDN.

Program layout (as tree_gdn.py): grid (dv / block_v, HV / heads_per_program, B). A program owns
one request, a group of value heads sharing one key head (Mamba2 group), and one value tile. It
loads q, k once, forms Q K^T [Np, Np] once for its value heads, then per value head: decays ->
gamma, Gam; the [dk, block_v] state tile -> Q S; the output dot (Q K^T * Gam) V. Every dot is 2-D
with all dims >= 16: the node axis is a block of Np = next power of two >= 16 rows touched past N
only through masked loads/stores; padding nodes (>= num_nodes) are masked to zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas import tree_ssd_ref
from bole_jax.pallas.factors import TreeFactors
from bole_jax.pallas.tree_utils import (
    TreeStructure,
    next_pow2,
    pad_axis,
    resolve_backend,
    tree_structure,
)

# The Triton-portable dot / masked load / masked store and the precision names are the GDN
# kernel's: one implementation of each.
from bole_jax.pallas.triton_ops import PRECISIONS as _PRECISIONS
from bole_jax.pallas.triton_ops import dot as _dot
from bole_jax.pallas.triton_ops import load as _load
from bole_jax.pallas.triton_ops import store as _store

__all__ = ["TreeFactors", "TreeSSDConfig", "tree_ssd_verify"]

MAX_NODES = 128  # the N x N tiles of one program must fit in registers / shared memory


@dataclasses.dataclass(frozen=True)
class TreeSSDConfig:
    """Launch parameters of the Pallas kernel (static, hashable).

    block_v: value columns per program (power of two >= 16); None = min(dv, 64) (Mamba2's headdim
      is 64: one tile per head).
    heads_per_program: value heads sharing one key head handled by one program (must divide
      HV / Hk); > 1 reuses q, k and Q K^T across them (Mamba2 has 8-16 heads per group).
    num_warps: None = 4 for N <= 64, 8 above.
    precision: of the dots on GPU: None (TF32), "tf32x3" or "highest". Interpret mode is fp32.
    """

    block_v: int | None = None
    heads_per_program: int = 1
    num_warps: int | None = None
    num_stages: int = 1
    precision: str | None = None


def _tree_ssd_kernel(
    nn_ref, anc_ref, q_ref, k_ref, v_ref, a_ref, s_ref, o_ref, gamma_ref, *, n_real, prec
):
    # Blocks: anc [Np, Np] int8; q, k [Np, dk]; v, o [Np, hg, bv]; a, gamma [Np, hg];
    # s [hg, dk, bv]. Np = N rounded up to a power of two >= 16: rows >= N lie past the arrays'
    # end and are touched only through masks.
    n = anc_ref.shape[0]
    hg = a_ref.shape[1]
    first_tile = pl.program_id(0) == 0
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = idx < jnp.minimum(nn_ref[...], n_real)  # [Np] real nodes
    vrow = valid[:, None]
    inb = None if n == n_real else (idx < n_real)[:, None]  # rows inside the arrays
    row_mask = None if inb is None else inb[:, 0]
    anc = _load(anc_ref, None if inb is None else inb & inb.T) != 0  # [Np, Np] ancestor-or-self

    # `where`, not a multiply: padding rows may hold anything, NaN included.
    q = jnp.where(vrow, _load(q_ref, inb).astype(jnp.float32), 0.0)  # [Np, dk]
    k = jnp.where(vrow, _load(k_ref, inb).astype(jnp.float32), 0.0)
    qk = _dot(q, k, prec, trans_b=True)  # [Np, Np], shared by the program's value heads

    def value_head(j, carry):
        a = jnp.where(valid, _load(a_ref.at[:, j], row_mask), 0.0)
        gamma = jnp.sum(jnp.where(anc, a[None, :], 0.0), axis=1)  # [Np] root-path log decay

        @pl.when(first_tile)
        def _():
            _store(gamma_ref.at[:, j], gamma, row_mask)

        decay = jnp.exp(jnp.minimum(gamma[:, None] - gamma[None, :], 0.0))
        w = jnp.where(anc, qk * decay, 0.0)  # (Q K^T) * Gam * A*
        p = jnp.where(valid, jnp.exp(gamma), 0.0)[:, None]  # [Np, 1]
        s = s_ref[j, :, :]  # [dk, bv] committed state tile
        v = jnp.where(vrow, _load(v_ref.at[:, j, :], inb).astype(jnp.float32), 0.0)
        o = p * _dot(q, s, prec) + _dot(w, v, prec)
        _store(o_ref.at[:, j, :], o.astype(o_ref.dtype), inb)
        return carry

    if hg == 1:
        value_head(jnp.int32(0), 0)
    else:
        jax.lax.fori_loop(0, hg, value_head, 0)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _tree_ssd_pallas(q, k, v, a, state, tree: TreeStructure, num_nodes, *, cfg, interpret):
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    ratio, hg = hv // hk, cfg.heads_per_program
    # Triton: power-of-two blocks and dot dims >= 16. N: masked Np-row blocks (no copies);
    # dk, dv: zero padding, which adds zero terms.
    np_, dkp, dvp = next_pow2(n), next_pow2(dk), next_pow2(dv)
    bv = min(dvp, 64) if cfg.block_v is None else cfg.block_v
    if bv < 16 or bv & (bv - 1) or dvp % bv:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dvp}")
    if hg < 1 or ratio % hg:
        raise ValueError(f"heads_per_program={hg} must divide HV/Hk={ratio}")
    num_warps = cfg.num_warps or (4 if np_ <= 64 else 8)
    qp, kp = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp)
    vp = pad_axis(v, 3, dvp)
    sp = pad_axis(pad_axis(state.astype(jnp.float32), 2, dkp), 3, dvp)

    # Value tiles fastest, then heads: programs sharing q, k and the mask run together (L2 hits).
    grid = (dvp // bv, hv // hg, b)
    per_req = pl.BlockSpec((None,), lambda t, h, i: (i,))
    qk_spec = pl.BlockSpec((None, np_, None, dkp), lambda t, h, i: (i, 0, (h * hg) // ratio, 0))
    val_spec = pl.BlockSpec((None, np_, hg, bv), lambda t, h, i: (i, 0, h, t))
    head_spec = pl.BlockSpec((None, np_, hg), lambda t, h, i: (i, 0, h))
    o, gamma = pl.pallas_call(
        functools.partial(
            _tree_ssd_kernel, n_real=n, prec=None if interpret else _PRECISIONS[cfg.precision]
        ),
        grid=grid,
        in_specs=[
            per_req,
            pl.BlockSpec((None, np_, np_), lambda t, h, i: (i, 0, 0)),
            qk_spec,
            qk_spec,
            val_spec,
            head_spec,
            pl.BlockSpec((None, hg, dkp, bv), lambda t, h, i: (i, h, 0, t)),
        ],
        out_specs=[val_spec, head_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, hv, dvp), v.dtype),
            jax.ShapeDtypeStruct((b, n, hv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages),
        name="bole_tree_ssd",
    )(num_nodes, tree.anc.astype(jnp.int8), qp, kp, vp, a.astype(jnp.float32), sp)  # int8: no i1
    return o[..., :dv], tree_ssd_ref.ssd_factors(k, v, gamma, tree.valid)


def tree_ssd_verify(
    q,
    k,
    v,
    a,
    state,
    parents,
    num_nodes=None,
    *,
    tree: TreeStructure | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    config: TreeSSDConfig | None = None,
):
    """Verify all nodes of a draft tree through one SSD (Mamba2) layer from the committed state.

    q, k [B, N, Hk, dk] (C, B of Mamba2: Hk = ngroups, dk = d_state; used as given, no norm or
    scale); v [B, N, HV, dv] (dt * x: HV = nheads, dv = headdim; bf16 or fp32); a [B, N, HV]
    fp32 log decay (dt * A <= 0); state [B, HV, dk, dv] fp32 (Mamba2's h transposed; read only);
    parents [B, N] int32 (parent < index, -1 = child of the committed state); num_nodes [B] int32
    or None (nodes >= num_nodes are padding: zero outputs and factors, whatever their inputs).
    tree: `tree_structure(parents, num_nodes)`, once per step for all layers (computed here when
    None). backend: "auto" (Pallas on GPU, the jnp closed form elsewhere) | "pallas" |
    "reference".

    Returns (o [B, N, HV, dv] in v.dtype, without D x and the gate; TreeFactors(k [B, N, Hk, dk],
    u = v [B, N, HV, dv], gamma [B, N, HV]), fp32) for `tree_gdn_commit.commit_state`.
    """
    b, n, hk, dk = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, n) or hv % hk:
        raise ValueError(
            f"inconsistent shapes q {q.shape} k {k.shape} v {v.shape}: need "
            "q, k [B, N, Hk, dk], v [B, N, HV, dv] with HV a multiple of Hk"
        )
    if a.shape != (b, n, hv) or state.shape != (b, hv, dk, v.shape[3]):
        raise ValueError(f"a {a.shape} must be [B, N, HV] and state {state.shape} [B, HV, dk, dv]")
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "reference":
        return tree_ssd_ref.tree_ssd_closed_form(q, k, v, a, state, parents, num_nodes, tree)
    if n > MAX_NODES:
        raise ValueError(
            f"the Pallas tree SSD kernel handles N <= {MAX_NODES} nodes (got {n}): "
            "use backend='reference' or a smaller tree"
        )
    cfg = config or TreeSSDConfig()
    if cfg.precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(_PRECISIONS)}, got {cfg.precision!r}")
    if tree is None:
        tree = tree_structure(parents, num_nodes)
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    return _tree_ssd_pallas(
        q, k, v, a, state, tree, jnp.asarray(num_nodes, jnp.int32), cfg=cfg, interpret=interpret
    )
