"""The native multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5, used as the drafter.

    e = RMSNorm_e(embed(x_p));  h = RMSNorm_h(hidden_{p-1});  x = [e ; h] @ fc   (2H -> H)
    x = attention decoder layer(s) at position p;  out = RMSNorm(x);  logits = lm_head(out)

`hidden_{p-1}` is the target's hidden state at position p-1 AFTER the target's final norm (the
tensor the target's lm_head reads, as vLLM feeds its MTP modules); `out` predicts x_{p+1}.
Applied recursively for deeper draft steps, `out` of the parent query plays the role of hidden.
Embedding and lm_head are shared with the target. The MTP layers keep their own plain KV cache
(`AttnCache` per MTP layer): slot p holds the entry of position p (p >= 1; slot 0 is unused since
position 0 has no previous hidden state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bole_jax.model import parallel
from bole_jax.model.blocks import attention_layer
from bole_jax.model.cache import AttnCache, init_attn_cache
from bole_jax.model.config import ModelConfig
from bole_jax.model.layers import rms_norm


class MissingMTPError(ValueError):
    pass


def require_mtp(cfg: ModelConfig, params) -> None:
    if cfg.mtp_num_layers == 0 or "mtp" not in params:
        raise MissingMTPError(
            "this model has no MTP head (no mtp.* tensors / mtp_num_hidden_layers = 0), which the "
            "speculative modes use as their drafter: use spec='ar', or for benchmarks on random "
            "weights build the model with random MTP weights (ModelConfig with mtp_num_layers=1)"
        )


def init_mtp_cache(cfg: ModelConfig, batch: int, capacity: int, dtype) -> tuple[AttnCache, ...]:
    return tuple(init_attn_cache(cfg, batch, capacity, dtype) for _ in range(cfg.mtp_num_layers))


def mtp_forward(
    params,
    cfg: ModelConfig,
    tokens: jax.Array,
    h_prev: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    mask: jax.Array,
    kv: tuple[AttnCache, ...],
):
    """tokens [B, T]; h_prev [B, T, H]; positions, slots [B, T]; mask [B, T, S].

    Returns (out [B, T, H] after the MTP norm, kv'). New entries are written at `slots` first.
    """
    mp = params["mtp"]
    e = rms_norm(
        parallel.embed_lookup(params["embed"], tokens, cfg),
        mp["pre_fc_norm_embedding"],
        cfg.rms_norm_eps,
    )
    h = rms_norm(h_prev.astype(e.dtype), mp["pre_fc_norm_hidden"], cfg.rms_norm_eps)
    x = jnp.concatenate([e, h], axis=-1) @ mp["fc"]
    new_kv = []
    for lp, c in zip(mp["layers"], kv):
        x, c = attention_layer(lp, x, positions, c, slots, mask, cfg)
        new_kv.append(c)
    return rms_norm(x, mp["norm"], cfg.rms_norm_eps), tuple(new_kv)
