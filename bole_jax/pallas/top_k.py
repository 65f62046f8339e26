"""The drafter's top-k of log-softmax, one launch per draft level.

Every draft level turns its frontier rows' logits z [..., V] into the k best log-probabilities
and their token ids:
    (log q, ids) = top_k(z - logsumexp(z), k),   log q clipped to <= 0,
the top-k taken on z and the logsumexp subtracted from the k winners only (the same order and
values as a top-k of log_softmax, without a [..., V] fp32 log-prob array written and read back).

`top_k_log_softmax_ref` is that in plain jnp (XLA's top-k over chunks of the row, then over the
chunks' winners, and a logsumexp): on the GPU four or five kernels per level. The Pallas kernel
reads each row once in one program: the row's max and sum of exponentials (the logsumexp), then k
rounds of "the largest remaining entry, its lowest index, masked out", in registers. Rows up to
`FUSED_MAX_V` entries take it; longer rows (a 32k draft vocabulary) keep the chunked reference,
whose first round spreads a row over the whole chip.

Ties go to the lower index in both, as `jax.lax.top_k` orders them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.tree_utils import next_pow2, pad_axis, resolve_backend

__all__ = ["top_k_log_softmax", "top_k_log_softmax_ref", "chunked_top_k", "FUSED_MAX_V"]

TOP_K_CHUNK = 256
# Longest row the one-program kernel takes (fp32 row and int32 indices in registers: 8192
# entries are 32 per thread at 8 warps); k at most this many rounds.
FUSED_MAX_V = 8192
FUSED_MAX_K = 16


def chunked_top_k(z: jax.Array, k: int, chunk: int = TOP_K_CHUNK):
    """`jax.lax.top_k(z, k)` over the last axis in two rounds: the top k of each `chunk`
    consecutive entries, then the top k of those winners. The same values and indices in the same
    order: an entry among the k best of the row (by value, ties to the lower index) has fewer
    than k entries before it in that order, so fewer than k in its chunk, and the second round
    sees the winners in chunk order, each chunk's in index order. On the GPU one top-k over a
    32768-entry row runs as one thread block per row (21 us per draft level at B = 1 and at
    B = 16 on an H200); the chunks spread the first round over the whole chip. Rows shorter than
    4 chunks, or not a whole number of chunks, take the plain top-k."""
    v = z.shape[-1]
    if v % chunk or v < 4 * chunk or k > chunk:
        return jax.lax.top_k(z, k)
    lead = z.shape[:-1]
    c = v // chunk
    v1, i1 = jax.lax.top_k(z.reshape(*lead, c, chunk), k)  # [..., c, k]
    i1 = i1 + (jnp.arange(c, dtype=i1.dtype) * chunk)[:, None]
    v2, j = jax.lax.top_k(v1.reshape(*lead, c * k), k)
    return v2, jnp.take_along_axis(i1.reshape(*lead, c * k), j, axis=-1)


def top_k_log_softmax_ref(z: jax.Array, k: int):
    """(top-k of log_softmax(z) [..., k] fp32, their indices [..., k] int32) from logits z
    [..., V] in plain jnp. log q = z - lse <= 0 exactly in fp (lse = max + log(sum exp(z - max))
    with the sum >= 1), which the drafter's early stop relies on (rho never increases down a
    path): the clip only guards the rounding of lse."""
    z = z.astype(jnp.float32)
    top, idx = chunked_top_k(z, k)
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    return jnp.minimum(top - lse, 0.0), idx.astype(jnp.int32)


def _kernel(z_ref, lq_ref, id_ref, *, k: int, v: int):
    # Blocks: z [Vp] (one row, -inf past v), lq / id [Kp].
    vp, kp = z_ref.shape[0], lq_ref.shape[0]
    idx = jnp.arange(vp, dtype=jnp.int32)
    z = z_ref[...].astype(jnp.float32)
    m = jnp.max(z, axis=0)
    lse = m + jnp.log(jnp.sum(jnp.exp(z - m), axis=0))
    slot = jnp.arange(kp, dtype=jnp.int32)
    vals = jnp.full((kp,), -jnp.inf, jnp.float32)
    ids = jnp.zeros((kp,), jnp.int32)
    for j in range(k):
        t = jnp.max(z, axis=0)
        at = jnp.min(jnp.where(z == t, idx, vp), axis=0)  # the lowest index holding it
        at = jnp.minimum(at, v - 1)  # a NaN row matches nothing: an id in range all the same
        vals = jnp.where(slot == j, t, vals)
        ids = jnp.where(slot == j, at, ids)
        z = jnp.where(idx == at, -jnp.inf, z)
    lq_ref[...] = jnp.minimum(vals - lse, 0.0)
    id_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("k", "interpret", "num_warps"))
def _top_k_pallas(z, *, k: int, interpret: bool, num_warps: int):
    lead, v = z.shape[:-1], z.shape[-1]
    rows = z.reshape(-1, v)
    r = rows.shape[0]
    vp, kp = next_pow2(v), next_pow2(k, minimum=2)
    if vp != v:  # padding never wins (k <= v) and adds exp(-inf) = 0 to the sum
        rows = pad_axis(rows, 1, vp, -jnp.inf)
    lq, ids = pl.pallas_call(
        functools.partial(_kernel, k=k, v=v),
        grid=(r,),
        in_specs=[pl.BlockSpec((None, vp), lambda i: (i, 0))],
        out_specs=[
            pl.BlockSpec((None, kp), lambda i: (i, 0)),
            pl.BlockSpec((None, kp), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((r, kp), jnp.float32),
            jax.ShapeDtypeStruct((r, kp), jnp.int32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="bole_top_k_log_softmax",
    )(rows)
    return lq[:, :k].reshape(*lead, k), ids[:, :k].reshape(*lead, k)


def top_k_log_softmax(
    z: jax.Array, k: int, *, backend: str = "auto", interpret: bool | None = None
):
    """(log q [..., k] fp32, ids [..., k] int32): the k largest entries of log_softmax(z) over
    the last axis, largest first (ties to the lower index), from logits z [..., V].

    backend: "pallas" (the one-program kernel; interpret mode off the GPU), "reference" (plain
    jnp) or "auto" (the kernel on the GPU where the row fits it: V <= FUSED_MAX_V, k <=
    FUSED_MAX_K; the reference elsewhere). The kernel's logsumexp sums in another order than
    XLA's, so log q may differ from the reference's by an ulp of lse; ids are the same."""
    v = z.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"top-k: k = {k} must lie in [1, {v}] for rows of {v} entries")
    fits = v <= FUSED_MAX_V and k <= FUSED_MAX_K
    if backend == "pallas" and not fits:
        raise ValueError(
            f"the Pallas top-k takes rows of at most {FUSED_MAX_V} entries and k <= "
            f"{FUSED_MAX_K}, got V = {v}, k = {k} (backend 'auto' or 'reference' take any)"
        )
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "reference" or not fits or z.size == 0:
        return top_k_log_softmax_ref(z, k)
    return _top_k_pallas(z, k=k, interpret=interpret, num_warps=8 if v > 2048 else 4)
