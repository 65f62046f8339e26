"""The hybrid decoding cache: one entry per decoder layer, plus the committed length per request.

Design
------
- A GDN layer keeps O(1) state per request: the last K-1 pre-conv inputs (`conv`, model dtype;
  row K-2 is the newest) and the recurrent state `state` [B, HV, dk, dv] in fp32 (it accumulates
  thousands of rank-1 updates; bf16 would drift).
- A full-attention layer keeps a CONTIGUOUS KV buffer per request with a fixed capacity S
  (`k`, `v` [B, Hkv, S, D], heads-major so the attention's batched dots read it in place: a
  slot-major [B, S, Hkv, D] buffer made XLA copy each layer's whole K and V to this layout every
  step, a second KV cache of temporaries); request b's committed tokens occupy slots
  [0, lengths[b]).
  Contiguous per-request buffers keep every shape static (one compiled decode/verify program per
  bucket), make the tree-verify write "append N node rows at lengths[b] + i" and the accept-time
  compaction "move the accepted rows to consecutive slots" simple gathers/scatters, and need no
  page table. The cost is that each request reserves S slots up front; the scheduler picks S
  (a paged cache can replace this later behind the same `Cache` type).
- `lengths` [B] int32 is the number of committed tokens of each request (its next position).
  Slots >= lengths[b] hold garbage and are never read (attention masks them).
- Lazy commit (bole decode states only). A GDN layer may also hold `pending`: the last step's
  accepted commit, not yet folded into `state`: its factors and accepted path (`PendingPath`,
  the default: the next verify reads the path's rows from them, no gather launch) or the path's
  factor rows gathered (`PendingCommit`, `KernelOptions.lazy_rows` "gather"). INVARIANT: the
  committed recurrent state is always
      apply_pending(state, pending)          (just `state` when pending is None),
  so every reader of a GDN state goes through `committed_state` / `settle` (the model forward,
  the prefix-cache checkpoints, the scheduler's slot insertion), and the next tree verify folds
  the rows into the state tile it loads anyway (`tree_gdn_verify(pending=...)`), which saves
  the commit's separate read + write of the whole fp32 state. `pending` is None in prefill
  caches and in the ar / pernode / chain (and eager bole) decode states; in a lazy bole decode
  state it is always a PendingPath of N nodes and depth + 1 path rows (or a PendingCommit of
  depth + 1 rows), "nothing pending" being its `empty` (accepted node -1; count 0 and p_sel 1),
  so a while-loop carry keeps one pytree structure.

All three are pytrees (`jax.tree_util.register_dataclass`), so a `Cache` can be passed through
`jax.jit` and donated (`donate_argnames=("cache",)`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model.config import LINEAR, ModelConfig
from bole_jax.pallas.factors import PendingCommit, PendingPath
from bole_jax.pallas.tree_gdn_commit import apply_pending, gather_pending_path


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNCache:
    conv: jax.Array  # [B, K-1, C] model dtype: last K-1 pre-conv inputs, row K-2 newest
    state: jax.Array  # [B, HV, dk, dv] fp32: recurrent state S ("K, V" layout)
    # Lazy commit (see the module docstring): the last step's factors + accepted path, or its
    # gathered rows, not yet folded into `state`; the committed state is `committed_state`.
    pending: PendingPath | PendingCommit | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnCache:
    k: jax.Array  # [B, Hkv, S, D] model dtype, keys after k_norm and RoPE
    v: jax.Array  # [B, Hkv, S, D] model dtype

    @property
    def capacity(self) -> int:
        """S, the KV slots per request."""
        return self.k.shape[2]


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
                return c.capacity
        return None


def committed_state(c: GDNCache) -> jax.Array:
    """[B, HV, dk, dv] fp32: the layer's committed recurrent state, apply_pending(state, pending)
    (a `PendingPath`'s rows gathered first; `state` itself when nothing is pending)."""
    if c.pending is None:
        return c.state
    pending = c.pending
    if isinstance(pending, PendingPath):
        pending = gather_pending_path(pending, backend="reference")
    return apply_pending(c.state, pending)


def pending_rows(p: PendingCommit | PendingPath) -> int:
    """L, the most accepted-path nodes a pending commit holds."""
    return p.path.shape[1] if isinstance(p, PendingPath) else p.k.shape[1]


def pending_nodes(p: PendingCommit | PendingPath | None) -> int | None:
    """M, the nodes of the factors a `PendingPath` keeps (None for gathered rows or nothing)."""
    return p.factors.u.shape[1] if isinstance(p, PendingPath) else None


def empty_pending_like(p: PendingCommit | PendingPath) -> PendingCommit | PendingPath:
    """Nothing pending, with the shapes (and type) of `p`."""
    if isinstance(p, PendingPath):
        b, m, hk, dk = p.factors.k.shape
        hv, dv = p.factors.u.shape[2:]
        return PendingPath.empty(b, m, pending_rows(p), hk, dk, hv, dv, k_dtype=p.factors.k.dtype)
    b, length, hk, dk = p.k.shape
    hv, dv = p.u.shape[2:]
    return PendingCommit.empty(b, length, hk, dk, hv, dv)


def settle(c: GDNCache) -> GDNCache:
    """The layer with its pending commit folded into `state` and cleared: same committed state,
    same pytree structure (a no-op when pending is None)."""
    if c.pending is None:
        return c
    return GDNCache(conv=c.conv, state=committed_state(c), pending=empty_pending_like(c.pending))


def settle_cache(cache: Cache) -> Cache:
    """`settle` on every GDN layer."""
    return dataclasses.replace(
        cache, layers=tuple(settle(c) if isinstance(c, GDNCache) else c for c in cache.layers)
    )


def with_pending(
    cache: Cache, cfg: ModelConfig, length: int | None, nodes: int | None = None
) -> Cache:
    """The cache laid out for a decode mode, committed states unchanged: any pending commit is
    folded in, then every GDN layer gets `pending` None (length None: ar, pernode, chain, eager
    bole) or, for lazy bole (length: spec depth + 1, the most nodes an accepted path has), an
    empty PendingPath of `nodes` tree nodes (the step's N; keys in the model dtype) or, nodes
    None, an empty PendingCommit of `length` rows."""
    layers = []
    for c in cache.layers:
        if isinstance(c, GDNCache):
            state = committed_state(c)
            b, hv, dk, dv = state.shape
            hk = cfg.gdn_num_key_heads
            pending = (
                None
                if length is None
                else PendingCommit.empty(b, length, hk, dk, hv, dv)
                if nodes is None
                else PendingPath.empty(b, nodes, length, hk, dk, hv, dv, k_dtype=c.conv.dtype)
            )
            c = GDNCache(conv=c.conv, state=state, pending=pending)
        layers.append(c)
    return dataclasses.replace(cache, layers=tuple(layers))


def init_gdn_cache(cfg: ModelConfig, batch: int, dtype) -> GDNCache:
    return GDNCache(
        conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
        state=jnp.zeros(
            (batch, cfg.gdn_num_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim), jnp.float32
        ),
    )


def init_attn_cache(cfg: ModelConfig, batch: int, capacity: int, dtype) -> AttnCache:
    shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return AttnCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> Cache:
    """An empty cache for `batch` requests of up to `capacity` tokens each (prompt + generated)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers = tuple(
        init_gdn_cache(cfg, batch, dtype)
        if t == LINEAR
        else init_attn_cache(cfg, batch, capacity, dtype)
        for t in cfg.layer_types
    )
    return Cache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))
