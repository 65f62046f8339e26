"""One decode token of the gated delta rule per request: a Pallas (Triton) kernel that updates the
recurrent state IN PLACE.

Maths: `gdn_ref.gated_delta_step` (T == 1 of `recurrent_gated_delta_rule`), per request and
value head h with key head h // r (r = HV / Hk), state S [dk, dv] fp32:
    q, k = l2norm(q), l2norm(k)            (x * rsqrt(sum x^2 + 1e-6), fp32), q *= scale
    S   = exp(g) S
    S  += k (beta (v - S^T k))^T
    o   = S^T q                            (the updated state, the scaled query)

Why a kernel: in the decode loop XLA writes the plain-jnp update to a fresh buffer and then
copies it into the loop-carried state (one state-sized memcpy per GDN layer per step, plus
several small fusions). Here the state output aliases the state input (`input_output_aliases`),
and each program reads its [dk, block_v] state tile before writing the same tile, touched by no
other program, so the update runs in place when the caller's buffer is donatable (the loop
carry, or a donating jit; otherwise XLA copies the input first, as aliasing requires).

Program layout: grid (dv / block_v, HV, B). A program loads q, k [dk] of its key head (and
normalises them in registers), v [block_v], g, beta of its value head, and its state tile. No
dots: the two reductions over dk (S^T k, S^T q) are `sum(S * x[:, None], axis=0)` and the rank-1
update is a broadcast product, all in fp32 (exact fp32 maths on GPU, no TF32 passes), so it
matches the jnp path (einsums at precision HIGHEST) to rounding.

dk, dv that are not powers of two are zero-padded (zero terms; the padded state is a copy, so
such shapes do not update in place). Real models use 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.gdn_ref import recurrent_gated_delta_rule
from bole_jax.pallas.tree_utils import L2_EPS, next_pow2, pad_axis, resolve_backend

__all__ = ["gdn_decode", "gdn_decode_reference"]


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x) + L2_EPS)


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, sn_ref, *, scale, qk_l2norm):
    # Blocks: q, k [dk] (the value head's key head); v [bv]; g, beta []; s, sn [dk, bv] (sn
    # aliases s: the tile is read here before its own store, by no other program); o [bv].
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    v = v_ref[...].astype(jnp.float32)
    s = s_ref[...] * jnp.exp(g_ref[...])  # [dk, bv]
    kv_mem = jnp.sum(s * k[:, None], axis=0)  # S^T k [bv]
    delta = (v - kv_mem) * beta_ref[...]
    s = s + k[:, None] * delta[None, :]
    o_ref[...] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    sn_ref[...] = s


@functools.partial(
    jax.jit, static_argnames=("scale", "qk_l2norm", "block_v", "num_warps", "interpret")
)
def _gdn_decode_pallas(q, k, v, g, beta, state, *, scale, qk_l2norm, block_v, num_warps, interpret):
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    ratio = hv // hk
    dkp, dvp = next_pow2(dk), next_pow2(dv)
    bv = min(block_v, dvp)
    if bv < 16 or bv & (bv - 1) or dvp % bv:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dvp}")
    q, k = pad_axis(q, 2, dkp), pad_axis(k, 2, dkp)
    v = pad_axis(v, 2, dvp)
    s = pad_axis(pad_axis(state.astype(jnp.float32), 2, dkp), 3, dvp)
    qk_spec = pl.BlockSpec((None, None, dkp), lambda t, h, i: (i, h // ratio, 0))
    gate_spec = pl.BlockSpec((None, None), lambda t, h, i: (i, h))
    val_spec = pl.BlockSpec((None, None, bv), lambda t, h, i: (i, h, t))
    state_spec = pl.BlockSpec((None, None, dkp, bv), lambda t, h, i: (i, h, 0, t))
    o, s = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, qk_l2norm=qk_l2norm),
        grid=(dvp // bv, hv, b),  # value tiles fastest: programs sharing q, k run together
        in_specs=[qk_spec, qk_spec, val_spec, gate_spec, gate_spec, state_spec],
        out_specs=[val_spec, state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, hv, dvp), v.dtype),
            jax.ShapeDtypeStruct(s.shape, jnp.float32),
        ],
        input_output_aliases={5: 1},  # state -> new state, in place
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="bole_gdn_decode",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), s)
    if (dkp, dvp) != (dk, dv):
        o, s = o[..., :dv], s[:, :, :dk, :dv]
    return o, s


def gdn_decode_reference(q, k, v, g, beta, state, *, scale=None, qk_l2norm: bool = True):
    """`recurrent_gated_delta_rule` on one token, in `gdn_decode`'s layout."""
    o, s = recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        state,
        scale,
        qk_l2norm=qk_l2norm,
    )
    return o[:, 0], s


def gdn_decode(
    q,
    k,
    v,
    g,
    beta,
    state,
    *,
    scale=None,
    qk_l2norm: bool = True,
    backend: str = "auto",
    interpret: bool | None = None,
    block_v: int = 32,
    num_warps: int = 4,
):
    """One decode token of the gated delta rule per request.

    Args:
      q, k: [B, Hk, dk] raw post-conv (L2-normalised here when qk_l2norm).
      v: [B, HV, dv]; value head h reads key head h // (HV / Hk).
      g: [B, HV] log decay (<= 0); beta: [B, HV] write strength. g = beta = 0 with k = 0 leaves
        a request's state exactly unchanged (how callers mask padding rows).
      state: [B, HV, dk, dv] fp32 (other dtypes are cast to fp32, a copy).
      scale: query scale, default dk^-1/2.
      backend: "auto" (Pallas on GPU, the jnp rule elsewhere) | "pallas" | "reference".
      interpret: Pallas interpret mode; None = on anything but GPU.
      block_v: value columns per program (power of two >= 16); num_warps: per program.
    Returns:
      o [B, HV, dv] in v.dtype, new state [B, HV, dk, dv] fp32 (written over the state buffer
      when it is donatable).
    """
    hk, hv = k.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"HV={hv} must be a multiple of Hk={hk}")
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "reference":
        return gdn_decode_reference(q, k, v, g, beta, state, scale=scale, qk_l2norm=qk_l2norm)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _gdn_decode_pallas(
        q,
        k,
        v,
        g,
        beta,
        state,
        scale=scale,
        qk_l2norm=qk_l2norm,
        block_v=block_v,
        num_warps=num_warps,
        interpret=interpret,
    )
