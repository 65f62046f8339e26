"""The gated delta rule in plain jnp (docs/algorithm.md, gated delta rule): chunked (prefill) and
recurrent.

Per value head, with state S [dk, dv] (fp32) and token t:
    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T (scale * q_t)
q and k are L2-normalised INSIDE these functions (x * rsqrt(sum x^2 + 1e-6), in fp32, as
transformers' `use_qk_l2norm_in_kernel=True` and the tree kernel do); pass raw post-conv q, k.
Keys/queries have Hk heads and are shared by r = HV / Hk consecutive value heads (value head j
reads key head j // r).

Both functions match transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` step for step (same chunking, same UT transform) so fp32 parity
is at rounding level. Tokens with g = 0 and beta = 0 leave the state exactly unchanged: callers
zero g and beta of right-padding tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST  # the state is fp32 maths: no TF32/bf16 passes on GPU


def l2_scale(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """rsqrt(sum(x^2) + eps) over the last axis, in fp32: the factor `l2_normalize` applies
    (one per row; the tree verify keeps it as the keys' factor, `TreeFactors.k_scale`)."""
    x = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32."""
    return x.astype(jnp.float32) * l2_scale(x, eps)[..., None]


def _prepare(q, k, v, g, beta, scale, qk_l2norm):
    """Expand key heads to value heads, cast to fp32, normalise, transpose to [B, HV, T, d]."""
    Hk, HV = k.shape[2], v.shape[2]
    assert HV % Hk == 0, (Hk, HV)
    r = HV // Hk
    q, k = (jnp.repeat(x, r, axis=2) if r > 1 else x for x in (q, k))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q.astype(jnp.float32) * scale
    tr = lambda x: jnp.moveaxis(x.astype(jnp.float32), 2, 1)  # [B, T, HV, ...] -> [B, HV, T, ...]
    return tr(q), tr(k), tr(v), tr(g), tr(beta)


def _initial_state(initial_state, B, HV, dk, dv):
    if initial_state is None:
        return jnp.zeros((B, HV, dk, dv), jnp.float32)
    return initial_state.astype(jnp.float32)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + strictly_lower(a))^-1 for a [..., n, n], n a power of two (a's diagonal and upper
    triangle are ignored).

    Bottom-up 2x2 block elimination, [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]:
    log2(n) levels of batched matmuls (XLA's batched triangular solve is very slow on CPU)."""
    n = a.shape[-1]
    assert n & (n - 1) == 0, f"chunk size {n} must be a power of two"
    batch = a.shape[:-2]
    inv = jnp.ones(batch + (n, 1, 1), a.dtype)  # inverses of the n unit 1x1 diagonal blocks
    s = 1
    while s < n:
        nb = n // (2 * s)
        diag_blocks = jnp.diagonal(a.reshape(*batch, nb, 2 * s, nb, 2 * s), axis1=-4, axis2=-2)
        c = jnp.moveaxis(diag_blocks, -1, -3)[
            ..., s:, :s
        ]  # [..., nb, s, s], strictly below the diagonal
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        off = -jnp.einsum("...ij,...jk,...kl->...il", d_inv, c, a_inv, precision=_HI)
        inv = jnp.concatenate(
            [
                jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1),
                jnp.concatenate([off, d_inv], -1),
            ],
            -2,
        )  # [..., nb, 2s, 2s]
        s *= 2
    return inv[..., 0, :, :]


def chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state=None, scale=None, chunk: int = 64, *, qk_l2norm: bool = True
):
    """Chunked gated delta rule (prefill form).

    Args:
      q, k: [B, T, Hk, dk] raw (L2-normalised here when qk_l2norm).
      v: [B, T, HV, dv].
      g: [B, T, HV] fp32 log decay (<= 0).  beta: [B, T, HV] write strength in (0, 1).
      initial_state: [B, HV, dk, dv] fp32 or None (zeros).
      scale: query scale, default dk^-1/2.
      chunk: chunk length (a power of two); T is zero-padded to a multiple of it (padding has
        g = beta = 0, so it changes nothing).
    Returns:
      o [B, T, HV, dv] in v.dtype, final state [B, HV, dk, dv] fp32.
    """
    B, T, _, dk = k.shape
    HV, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)  # [B, HV, T, .]
    pad = (-T) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (T + pad) // chunk
    to_chunks = lambda x: x.reshape(B, HV, n, chunk, *x.shape[3:])  # [B, HV, n, c, .]
    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum = jnp.cumsum(g, axis=-1)  # [B, HV, n, c] log decay from chunk start to position i
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (<= 1: no overflow), 0 above the diagonal.
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    ut_system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=_HI) * decay
    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay
    # UT transform: [u | w] = (I + strictly_lower(ut_system))^-1 [v_beta | k_beta * exp(cum)].
    inv = unit_lower_inverse(ut_system)
    new_values = jnp.einsum("...ij,...jd->...id", inv, v_beta, precision=_HI)
    k_cumdecay = jnp.einsum(
        "...ij,...jd->...id", inv, k_beta * jnp.exp(cum)[..., None], precision=_HI
    )

    q_dec = q * jnp.exp(cum)[..., None]  # reads the chunk-start state
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # writes into the chunk-end state
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, HV, n, 1, 1]

    def step(S, xs):
        u, w, qd, kd, a, cd = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, S, precision=_HI)
        o = jnp.einsum("bhck,bhkv->bhcv", qd, S, precision=_HI) + jnp.einsum(
            "bhij,bhjv->bhiv", a, v_new, precision=_HI
        )
        S = S * cd + jnp.einsum("bhck,bhcv->bhkv", kd, v_new, precision=_HI)
        return S, o

    per_chunk = lambda x: jnp.moveaxis(x, 2, 0)  # scan over the chunk axis
    S0 = _initial_state(initial_state, B, HV, dk, dv)
    S, o = jax.lax.scan(
        step, S0, tuple(map(per_chunk, (new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay)))
    )
    o = jnp.moveaxis(o, 0, 2).reshape(B, HV, n * chunk, dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), S


def gated_delta_step(S, q_t, k_t, v_t, g_t, beta_t):
    """One recurrence step on prepared fp32 inputs: S [B, HV, dk, dv], q_t/k_t [B, HV, dk]
    (normalised, q scaled), v_t [B, HV, dv], g_t/beta_t [B, HV]. Returns (S', o_t [B, HV, dv])."""
    S = S * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", S, k_t, precision=_HI)
    delta = (v_t - kv_mem) * beta_t[..., None]
    S = S + k_t[..., :, None] * delta[..., None, :]
    return S, jnp.einsum("bhkv,bhk->bhv", S, q_t, precision=_HI)


def recurrent_gated_delta_rule(
    q, k, v, g, beta, initial_state=None, scale=None, *, qk_l2norm: bool = True
):
    """Token-by-token gated delta rule (decode form; T = 1 is one step). Same arguments and
    returns as `chunk_gated_delta_rule` (without `chunk`)."""
    B, T, _, dk = k.shape
    HV, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)  # [B, HV, T, .]
    S = _initial_state(initial_state, B, HV, dk, dv)
    if T == 1:  # the decode step: no scan
        S, o = gated_delta_step(S, q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0])
        return o[:, None].astype(out_dtype), S

    def step(S, xs):
        return gated_delta_step(S, *xs)

    S, o = jax.lax.scan(step, S, tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), S  # o: [T, B, HV, dv] -> [B, T, HV, dv]
