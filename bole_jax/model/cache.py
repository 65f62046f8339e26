"""The hybrid decoding cache: one entry per decoder layer, plus the committed length per request.

Design
------
- A GDN layer keeps O(1) state per request: the last K-1 pre-conv inputs (`conv`, model dtype;
  row K-2 is the newest) and the recurrent state `state` [B, HV, dk, dv] in fp32 (it accumulates
  thousands of rank-1 updates; bf16 would drift).
- A full-attention layer keeps a CONTIGUOUS KV buffer per request with a fixed capacity S
  (`k`, `v` [B, S, Hkv, D]); request b's committed tokens occupy slots [0, lengths[b]).
  Contiguous per-request buffers keep every shape static (one compiled decode/verify program per
  bucket), make the tree-verify write "append N node rows at lengths[b] + i" and the accept-time
  compaction "move the accepted rows to consecutive slots" simple gathers/scatters, and need no
  page table. The cost is that each request reserves S slots up front; the scheduler picks S
  (a paged cache can replace this later behind the same `Cache` type).
- `lengths` [B] int32 is the number of committed tokens of each request (its next position).
  Slots >= lengths[b] hold garbage and are never read (attention masks them).

All three are pytrees (`jax.tree_util.register_dataclass`), so a `Cache` can be passed through
`jax.jit` and donated (`donate_argnames=("cache",)`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model.config import LINEAR, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNCache:
    conv: jax.Array  # [B, K-1, C] model dtype: last K-1 pre-conv inputs, row K-2 newest
    state: jax.Array  # [B, HV, dk, dv] fp32: recurrent state S ("K, V" layout)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnCache:
    k: jax.Array  # [B, S, Hkv, D] model dtype, keys after k_norm and RoPE
    v: jax.Array  # [B, S, Hkv, D] model dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    layers: tuple  # tuple[GDNCache | AttnCache, ...], one per decoder layer (cfg.layer_types order)
    lengths: jax.Array  # [B] int32 committed tokens per request

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int | None:
        """S, the KV slots per request (None for a model without attention layers)."""
        for c in self.layers:
            if isinstance(c, AttnCache):
                return c.k.shape[1]
        return None


def init_gdn_cache(cfg: ModelConfig, batch: int, dtype) -> GDNCache:
    return GDNCache(
        conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
        state=jnp.zeros((batch, cfg.gdn_num_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim), jnp.float32),
    )


def init_attn_cache(cfg: ModelConfig, batch: int, capacity: int, dtype) -> AttnCache:
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return AttnCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> Cache:
    """An empty cache for `batch` requests of up to `capacity` tokens each (prompt + generated)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers = tuple(
        init_gdn_cache(cfg, batch, dtype) if t == LINEAR else init_attn_cache(cfg, batch, capacity, dtype)
        for t in cfg.layer_types)
    return Cache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))
