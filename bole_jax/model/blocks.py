"""Whole decoder layers built from the pieces in `layers.py`, shared by every forward.

The target's prefill/decode forward, the tree verify forward and the MTP head all run the same
gated-attention decoder layer; they differ only in which rows they write and in the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bole_jax.model.cache import AttnCache
from bole_jax.model.config import ModelConfig
from bole_jax.model.layers import attend, attn_out, attn_qkv, mlp, rms_norm


def write_kv(buf: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """KV buffer buf [B, Hkv, S, D] <- rows [B, T, Hkv, D] at slots [B, T] (slots >= S: dropped).

    With one row in all (decode at B = 1) the barrier keeps the rows' producers (the k / v
    projections, vector-matrix products there) out of the scatter's fusion. Compiled without
    CUDA command buffers (the in-loop profile's program, bench.TRACE_COMPILER_OPTIONS), that
    scatter fusion took 71 us per layer at Qwen3.5-9B dims on an H200 and the AR step's kernels
    5.55 ms, against 5.06 ms in the timed program; with the barrier 5.12 ms, and the timed step
    unchanged within noise (5.18 against 5.22 ms; docs/design-decisions.md)."""
    if rows.shape[0] * rows.shape[1] == 1:
        rows = jax.lax.optimization_barrier(rows)
    b = jnp.arange(buf.shape[0])[:, None, None]
    h = jnp.arange(buf.shape[1])[None, :, None]
    rows = jnp.swapaxes(rows, 1, 2).astype(buf.dtype)
    return buf.at[b, h, slots[:, None, :]].set(rows, mode="drop")


def take_kv(buf: jax.Array, slots: jax.Array) -> jax.Array:
    """rows [B, T, Hkv, D] of KV buffer buf [B, Hkv, S, D] at slots [B, T] (clamped to S - 1)."""
    b = jnp.arange(buf.shape[0])[:, None]
    return buf[b, :, jnp.minimum(slots, buf.shape[2] - 1)]


def mlp_block(lp: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x + mlp(post_attn_norm(x))."""
    return x + mlp(lp["mlp"], rms_norm(x, lp["post_attn_norm"], cfg.rms_norm_eps), cfg)


def attention_layer(
    lp: dict,
    x: jax.Array,
    positions: jax.Array,
    cache: AttnCache,
    slots: jax.Array,
    mask: jax.Array,
    cfg: ModelConfig,
    packing=None,
):
    """One gated-attention decoder layer.

    x [B, T, H]; positions [B, T] (RoPE); the new keys/values are written at slots [B, T] (>= S:
    dropped) before attending with mask [B, T, S]. Returns (x' [B, T, H], cache').

    packing (the tree verify's `verify.RowPacking`): x [1, P, H] and positions [1, P] are packed
    rows; the queries, keys and values are unpacked to the [B, T] layout of slots and mask for
    the attention, whose output is packed again.
    """
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
    q, k, v, gate = attn_qkv(lp["attn"], h, positions, cfg)
    if packing is not None:
        q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
    cache = AttnCache(k=write_kv(cache.k, k, slots), v=write_kv(cache.v, v, slots))
    o = attend(q, cache.k, cache.v, mask, cfg)
    if packing is not None:
        o = packing.pack(o)
    x = x + attn_out(lp["attn"], o, gate, cfg)
    return mlp_block(lp, x, cfg), cache
