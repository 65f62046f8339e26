"""The target model forward: append new tokens to every request of a batch, update the cache.

    hidden, cache = forward(params, cfg, tokens, cache, num_new)   # jit with cfg static
    logits = logits(params, cfg, hidden)

`forward` serves batched right-padded prefill (T > 1: chunked GDN form), chunked prefill
continuation (T > 1 on a non-empty cache) and decode (T == 1: recurrent form). Tree
verification reuses the pieces of layers.py / blocks.py with its own GDN core and mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bole_jax.model import parallel
from bole_jax.model.blocks import attention_layer, mlp_block
from bole_jax.model.cache import AttnCache, Cache, GDNCache
from bole_jax.model.config import LINEAR, ModelConfig
from bole_jax.model.layers import (
    gdn_core_chunked,
    gdn_core_recurrent,
    gdn_in_proj,
    gdn_out,
    rms_norm,
)


def causal_prefix_mask(lengths: jax.Array, num_new: jax.Array, T: int, S: int) -> jax.Array:
    """[B, T, S] bool: new token t of request b (position lengths[b] + t) sees slots up to its own
    position, and never slots past the request's last valid token (padding rows see the prefix)."""
    s = jnp.arange(S)[None, None, :]
    pos = (lengths[:, None] + jnp.arange(T)[None, :])[..., None]
    end = (lengths + num_new)[:, None, None]
    return (s <= pos) & (s < jnp.maximum(end, 1))


def decoder_layer(
    p: dict, cfg: ModelConfig, layer_type: str, x: jax.Array, c, *, positions, mask, slots, num_new
):
    """One decoder layer: x += mixer(input_norm(x)); x += mlp(post_attn_norm(x)). Returns (x, c').

    Attention layers are `blocks.attention_layer` (shared with the tree verify and the MTP head);
    GDN layers use the chunked rule for T > 1 and the recurrent one for T == 1."""
    if layer_type != LINEAR:
        return attention_layer(p, x, positions, c, slots, mask, cfg)
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    qkv, z, g, beta = gdn_in_proj(p["gdn"], h, cfg)
    core = gdn_core_recurrent if x.shape[1] == 1 else gdn_core_chunked
    o, c = core(p["gdn"], qkv, g, beta, c, num_new, cfg)
    return mlp_block(p, x + gdn_out(p["gdn"], o, z, cfg), cfg), c


def forward_pre_norm(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: Cache,
    num_new: jax.Array | None = None,
):
    """Like `forward`, but returns the last decoder layer's output BEFORE the final norm."""
    B, T = tokens.shape
    num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    lengths = cache.lengths
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    valid = jnp.arange(T)[None, :] < num_new[:, None]
    S = cache.capacity or 1
    slots = jnp.where(valid, positions, S)  # padding -> out of range -> dropped
    mask = causal_prefix_mask(lengths, num_new, T, S)

    x = parallel.embed_lookup(params["embed"], tokens, cfg)
    new_layers = []
    for i, (p, c) in enumerate(zip(params["layers"], cache.layers)):
        assert isinstance(c, GDNCache if cfg.layer_types[i] == LINEAR else AttnCache), (i, type(c))
        x, c = decoder_layer(
            p,
            cfg,
            cfg.layer_types[i],
            x,
            c,
            positions=positions,
            mask=mask,
            slots=slots,
            num_new=num_new,
        )
        new_layers.append(c)
    return x, Cache(layers=tuple(new_layers), lengths=lengths + num_new)


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: Cache,
    num_new: jax.Array | None = None,
):
    """Append tokens to each request and return the final-normed hidden states.

    Args:
      tokens: [B, T] int32; request b's new tokens are tokens[b, :num_new[b]] (right padded).
      cache: committed state; request b has cache.lengths[b] tokens. Its KV capacity must be
        >= lengths + num_new (writes past capacity are dropped: callers check).
      num_new: [B] int32 in [0, T], or None for all T.
    Returns:
      hidden [B, T, H] AFTER the final RMSNorm (rows t >= num_new[b] are garbage), and the new
      cache (lengths += num_new; conv state = last K-1 valid inputs; padding leaves GDN states and
      KV slots untouched).
    """
    x, cache = forward_pre_norm(params, cfg, tokens, cache, num_new)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """fp32 logits [..., V] from final-normed hidden [..., H] (tied or untied lm_head)."""
    if cfg.tie_word_embeddings:
        return jnp.einsum(
            "...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32
        )
    return jnp.einsum(
        "...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32
    )
