"""Masked GQA attention over a heads-major KV cache: a split-S (flash-decoding) Pallas kernel.

Maths: `attend_reference` below (plain jnp, what `model.layers.attend` runs by default): per
request b, KV head h and query row r (one of h's G = Hq / Hkv query heads at one of the T query
positions),
    s_j = (q_r . k_j) / sqrt(D)  over the slots j the mask allows,   o_r = sum_j softmax(s)_j v_j.

Why a kernel: at long context the reference writes the fp32 scores [B, Hkv, G, T, S] and reads
them back three to four times (the max, the sum, the normalisation and cast, the PV dot). Measured
at Qwen3.5-9B dims, 16k slots, B = 32, a 16-node verify (docs/benchmarks.md section 8): 9.2 ms
for 8 layers against 3.4 ms of KV reads. Here the scores never leave the chip: each program
streams its share of the slots once, with an online softmax.

Program layout: grid (B, Hkv, splits). Program (b, h, p) takes the M = G x T query rows of KV head
h (padded to a power of two >= 16) and the slot tiles p, p + 1, ... of its split (block_s slots
each), and keeps the running max m, the running sum l and the unnormalised output acc [M, D] in
fp32. The splits' partial (acc, m, l) are combined outside: o = sum_p e^(m_p - m) acc_p /
sum_p e^(m_p - m) l_p. Probabilities enter the PV dot in the values' dtype, as in the reference
(unnormalised here, normalised there: the same rounding up to a row scale).

The mask is read as int8 rows [M, S] (the [B, T, S] mask repeated over the G heads of a group:
T x G x S bytes per request, small beside the KV cache's S x D x 4 bytes per head). A query row
with no allowed slot gives zeros (the reference: NaN; callers never have one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.tree_utils import next_pow2, resolve_backend

__all__ = ["attend_reference", "attend_split_s", "split_count"]

TARGET_PROGRAMS = 528  # about four programs per SM on an H200 (132 SMs)
# The most query rows (G x T) of one program: its query block and accumulator live on chip. A
# prefill chunk (T = 256, G = 4: 1024 rows) asked an H200 for 272 KiB of shared memory (227 KiB
# available) and failed to launch; a 16-node verify is 64 rows. Wider queries run the reference,
# whose scores are amortised over many query rows there.
MAX_ROWS = 64


def attend_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array):
    """Masked GQA softmax attention in plain jnp (softmax in fp32).

    q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D] (heads-major, as the cache stores them);
    mask [B, T, S] bool (True = may attend). Every query row must allow at least one slot.
    Returns o [B, T, Hq, D] in q.dtype."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = scores * (D**-0.5)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # The dot writes heads-major; the [B, T, heads, D] transpose is of the T query rows only.
    o = jnp.einsum("bkgts,bksd->bkgtd", probs, v_cache, preferred_element_type=jnp.float32)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


def split_count(batch: int, kv_heads: int, tiles: int) -> int:
    """Splits of the slot axis: enough programs to fill the GPU, at least one tile each."""
    return max(1, min(tiles, -(-TARGET_PROGRAMS // (batch * kv_heads))))


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    block_s,
    per_split,
    tiles,
    scale,
    precision,
):
    # Blocks: q [M, D]; k, v [S, D] (the program's request and KV head); mask [M, S] int8;
    # o [M, D] fp32, m, l [M] fp32 (the program's split).
    split = pl.program_id(2)
    q = q_ref[...]
    rows, d = q.shape

    def body(i, carry):
        acc, m, l = carry
        t = split * per_split + i
        start = jnp.minimum(t, tiles - 1) * block_s
        k = k_ref[pl.ds(start, block_s), :]
        v = v_ref[pl.ds(start, block_s), :]
        ok = (mask_ref[:, pl.ds(start, block_s)] != 0) & (t < tiles)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * scale
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing allowed yet
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
        return acc * alpha[:, None] + pv, m_new, l

    init = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = jax.lax.fori_loop(0, per_split, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit, static_argnames=("block_s", "splits", "num_warps", "num_stages", "interpret")
)
def _attend_pallas(q, k_cache, v_cache, mask, *, block_s, splits, num_warps, num_stages, interpret):
    b, t, hq, d = q.shape
    hkv, s_len = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = g * t
    mp = max(16, next_pow2(rows))
    tiles = s_len // block_s
    splits = split_count(b, hkv, tiles) if splits is None else min(splits, tiles)
    per_split = -(-tiles // splits)
    # Query rows of KV head h in the reference's (g, t) order, padded to mp rows.
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, rows, d)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, mp - rows), (0, 0)))
    mk = jnp.broadcast_to(mask[:, None].astype(jnp.int8), (b, g, t, s_len)).reshape(b, rows, s_len)
    mk = jnp.pad(mk, ((0, 0), (0, mp - rows), (0, 0)))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        block_s=block_s,
        per_split=per_split,
        tiles=tiles,
        scale=d**-0.5,
        precision=precision,
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=[
            pl.BlockSpec((None, None, mp, d), lambda i, h, p: (i, h, 0, 0)),
            pl.BlockSpec((None, None, s_len, d), lambda i, h, p: (i, h, 0, 0)),
            pl.BlockSpec((None, None, s_len, d), lambda i, h, p: (i, h, 0, 0)),
            pl.BlockSpec((None, mp, s_len), lambda i, h, p: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, mp, d), lambda i, h, p: (i, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, mp), lambda i, h, p: (i, h, p, 0)),
            pl.BlockSpec((None, None, None, mp), lambda i, h, p: (i, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, mp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, mp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, mp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="bole_attend_split_s",
    )(qh, k_cache, v_cache, mk)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all)))
    den = jnp.sum(w * l, axis=2)  # [B, Hkv, mp]
    num = jnp.sum(w[..., None] * o, axis=2)  # [B, Hkv, mp, D]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    out = out[:, :, :rows].reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def attend_split_s(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    mask: jax.Array,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    block_s: int = 64,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Masked GQA softmax attention, `attend_reference`'s contract.

    q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D] heads-major; mask [B, T, S] bool (True = may
    attend). Returns o [B, T, Hq, D] in q.dtype. backend "auto": the kernel on GPU, the reference
    elsewhere, and only for 16-bit inputs (in fp32 the kernel's IEEE dots measured 3-15x slower
    than the reference on an H200); "pallas" (interpret mode off the GPU) | "reference". More
    than MAX_ROWS query rows per KV head (prefill chunks), or a slot count that is not a multiple
    of block_s (a power of two >= 16), run the reference."""
    auto = backend == "auto"
    backend, interpret = resolve_backend(backend, interpret)
    s_len, d = k_cache.shape[2], k_cache.shape[3]
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[1])
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s={block_s} must be a power of two >= 16")
    wide = auto and jnp.dtype(q.dtype).itemsize > 2
    if backend == "reference" or wide or rows > MAX_ROWS or s_len % block_s or d & (d - 1):
        return attend_reference(q, k_cache, v_cache, mask)
    return _attend_pallas(
        q,
        k_cache,
        v_cache,
        mask,
        block_s=block_s,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
