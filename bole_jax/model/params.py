"""The parameter pytree: one flat layout for both families, and a fast random initialiser.

Params are a plain nested dict of arrays. Linear weights are stored [in, out] (y = x @ W).
RMSNorm weights are the checkpoint's zero-centred offsets (applied as 1 + w); the GDN gated norm
weight is a plain scale (applied as w). Shape letters as in `config.ModelConfig`.

    params = {
      "embed":      [V, H]
      "lm_head":    [H, V]           absent when cfg.tie_word_embeddings (logits use embed.T)
      "final_norm": [H]
      "layers":     [layer_0, ..., layer_{L-1}]   a list; cfg.layer_types[i] says which mixer
      "mtp":        {...}            only when cfg.mtp_num_layers > 0 (see below)
    }

    layer = {
      "input_norm":     [H]
      "post_attn_norm": [H]
      "gdn":  {...}   when cfg.layer_types[i] == "linear_attention"
      "attn": {...}   when cfg.layer_types[i] == "full_attention"
      "mlp":  {...}   dense or MoE (cfg.is_moe_layer(i)); the keys say which
    }

    gdn = {                                   Gated DeltaNet (channels of C: [all q | all k | all v])
      "w_qkv":   [H, C]        C = 2*Hk*dk + HV*dv; q head g = channels [g*dk, (g+1)*dk), ...
      "w_z":     [H, HV*dv]    output gate; value head j = channels [j*dv, (j+1)*dv)
      "w_b":     [H, HV]       beta = sigmoid(x @ w_b)
      "w_a":     [H, HV]       g = -exp(A_log) * softplus(x @ w_a + dt_bias)
      "conv_w":  [K, C]        depthwise causal conv: y_t = sum_i conv_w[i] * x_{t-K+1+i}
      "A_log":   [HV]
      "dt_bias": [HV]
      "norm_w":  [dv]          gated RMSNorm scale (plain w, shared by all value heads)
      "w_out":   [HV*dv, H]
    }
    Value head j belongs to key head j // (HV // Hk) (Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
    are de-interleaved into this order at load time; see weights.py).

    attn = {                                  gated full attention
      "w_q":    [H, Hq*D]      query heads (de-interleaved from q_proj's per-head [q_h | gate_h])
      "w_gate": [H, Hq*D]      output gate, same head order
      "w_k":    [H, Hkv*D]
      "w_v":    [H, Hkv*D]
      "q_norm": [D]            per-head RMSNorm (1 + w) before RoPE
      "k_norm": [D]
      "w_o":    [Hq*D, H]
    }

    dense mlp = {"w_gate_up": [H, 2I] ([gate | up]), "w_down": [I, H]}         I = intermediate_size
    moe mlp = {
      "router":         [H, E]
      "w_gate_up":      [E, H, 2Ie]   per expert [gate | up]                  Ie = moe_intermediate_size
      "w_down":         [E, Ie, H]
      "shared_gate_up": [H, 2Is]                                              Is = shared_expert_intermediate_size
      "shared_down":    [Is, H]
      "shared_gate":    [H, 1]        sigmoid gate of the shared expert
    }

    mtp = {                                   native multi-token-prediction head (checkpoint "mtp.*")
      "fc":                    [2H, H]   input [norm_e(embed(token)) ; norm_h(hidden)], embedding first
      "pre_fc_norm_embedding": [H]
      "pre_fc_norm_hidden":    [H]
      "layers":                [mtp_layer_j ...]  full-attention decoder layers (same dict as a target
                                                 attention layer; MLP kind: cfg.mtp_layer_is_moe(j))
      "norm":                  [H]
    }   embedding and lm_head are shared with the target.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from bole_jax.model.config import FULL, LINEAR, ModelConfig


def layer_shapes(cfg: ModelConfig, layer_type: str, moe: bool) -> dict:
    """Nested dict of shapes of one decoder layer (the single source of truth for the layout)."""
    H, D = cfg.hidden_size, cfg.head_dim
    layer: dict = {"input_norm": (H,), "post_attn_norm": (H,)}
    if layer_type == LINEAR:
        HV, dv, C, K = cfg.gdn_num_value_heads, cfg.gdn_value_dim, cfg.conv_dim, cfg.conv_kernel
        layer["gdn"] = {
            "w_qkv": (H, C),
            "w_z": (H, HV * dv),
            "w_b": (H, HV),
            "w_a": (H, HV),
            "conv_w": (K, C),
            "A_log": (HV,),
            "dt_bias": (HV,),
            "norm_w": (dv,),
            "w_out": (HV * dv, H),
        }
    else:
        Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
        layer["attn"] = {
            "w_q": (H, Hq * D),
            "w_gate": (H, Hq * D),
            "w_k": (H, Hkv * D),
            "w_v": (H, Hkv * D),
            "q_norm": (D,),
            "k_norm": (D,),
            "w_o": (Hq * D, H),
        }
    if moe:
        E, Ie, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        layer["mlp"] = {
            "router": (H, E),
            "w_gate_up": (E, H, 2 * Ie),
            "w_down": (E, Ie, H),
            "shared_gate_up": (H, 2 * Is),
            "shared_down": (Is, H),
            "shared_gate": (H, 1),
        }
    else:
        I = cfg.intermediate_size
        layer["mlp"] = {"w_gate_up": (H, 2 * I), "w_down": (I, H)}
    return layer


def param_shapes(cfg: ModelConfig) -> dict:
    """The whole params tree as shapes (tuples), same structure as `init_params`'s result."""
    H, V = cfg.hidden_size, cfg.vocab_size
    tree: dict = {
        "embed": (V, H),
        "final_norm": (H,),
        "layers": [
            layer_shapes(cfg, t, cfg.is_moe_layer(i)) for i, t in enumerate(cfg.layer_types)
        ],
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (H, V)
    if cfg.mtp_num_layers:
        tree["mtp"] = {
            "fc": (2 * H, H),
            "pre_fc_norm_embedding": (H,),
            "pre_fc_norm_hidden": (H,),
            "layers": [
                layer_shapes(cfg, FULL, cfg.mtp_layer_is_moe(j)) for j in range(cfg.mtp_num_layers)
            ],
            "norm": (H,),
        }
    return tree


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def abstract_params(cfg: ModelConfig, dtype=None) -> dict:
    """`jax.ShapeDtypeStruct` tree of the params (for restoring checkpoints, eval_shape, sharding)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg), is_leaf=_is_shape
    )


def _init_group(name: str, shape: tuple[int, ...], key, dtype, leaf=None):
    """Random values for `shape[0]` leaves called `name` of shape shape[1:] (one RNG call per
    group: the program, hence compile time, does not grow with depth). Uniform with the variance
    of the intended normal: cheaper to generate, and values do not matter for speed. `leaf`: the
    whole leaf's shape when `shape` is a block of it (its fan-in sets the scale)."""
    leaf_given, leaf = leaf is not None, leaf or shape[1:]
    if name == "A_log":  # decay rates exp(A_log) in [1, 16], as transformers initialises them
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if name in ("dt_bias", "norm_w"):
        return jnp.ones(shape, dtype)
    if name.endswith("norm") or name.startswith("pre_fc_norm"):  # zero-centred RMSNorm offsets
        return jnp.zeros(shape, dtype)
    fan_in = leaf[-2] if len(leaf) >= 2 else leaf[-1]
    std = 1.0 if name == "embed" else (leaf[0] if name == "conv_w" else fan_in) ** -0.5
    half_width = std * 3.0**0.5
    # Blocks of big leaves are drawn in their own dtype: no fp32 temporary of their size.
    rng_dtype = dtype if leaf_given and jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jax.random.uniform(key, shape, rng_dtype, -half_width, half_width).astype(dtype)


def init_params(cfg: ModelConfig, key, dtype=None) -> dict:
    """Random params with `cfg`'s shapes (benchmarks, tests), generated on device by ONE jitted
    program with one RNG call per distinct (name, shape) (no host loops; compile time independent
    of depth).

    Values: zero-mean with 1/sqrt(fan_in) scale for matrices (std 1 for the embedding), zero
    RMSNorm offsets, transformers-like A_log / dt_bias. Speed does not depend on values.
    """
    return _init_params(cfg, jnp.dtype(dtype or cfg.dtype), key)


def key_path(kp) -> tuple:
    """A jax key path as plain dict keys / list indices, e.g. ("layers", 3, "gdn", "w_qkv")."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kp)


def init_leaf(name: str, shape: tuple[int, ...], key, dtype, leaf=None):
    """Random values of one leaf called `name` (or, with `leaf` its whole shape, of a block of
    shape `shape` of it), as `init_params` draws them."""
    return _init_group(name, (1,) + tuple(shape), key, dtype, leaf=tuple(leaf or shape))[0]


# Param groups (leaves of one name and shape) with more elements than this are drawn one leaf
# at a time, by `draw_big` (below).
GROUP_DRAW_LIMIT = 1 << 28


def _default_draw(path, name, shape, key, dtype):
    return init_leaf(name, shape, key, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(cfg: ModelConfig, dtype, key) -> dict:
    return build_params(cfg, dtype, key)


def build_params(cfg: ModelConfig, dtype, key, draw_big=_default_draw) -> dict:
    """The traced body of `init_params`. Groups above GROUP_DRAW_LIMIT elements (MoE experts
    of big models) are drawn leaf by leaf with draw_big(path, name, shape, key, dtype): one draw
    of all 49 expert gate_up tensors of Qwen3-Next-80B is a 196 GiB fp32 temporary, and the
    tensor-parallel init (parallel.init_params) draws those leaves shard by shard instead."""
    shapes = param_shapes(cfg)
    paths_and_shapes = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    groups: dict[tuple, list[int]] = {}
    for i, (path, shape) in enumerate(paths_and_shapes):
        groups.setdefault((path[-1].key, shape), []).append(i)
    leaves = [None] * len(paths_and_shapes)
    # "rbg" lowers each draw to one RngBitGenerator op; threefry unrolls ~100 ops per draw, which
    # makes XLA:CPU compile times balloon.
    key = jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")
    for ((name, shape), members), k in zip(groups.items(), jax.random.split(key, len(groups))):
        if len(members) * math.prod(shape) > GROUP_DRAW_LIMIT:
            for i, kj in zip(members, jax.random.split(k, len(members))):
                leaves[i] = draw_big(key_path(paths_and_shapes[i][0]), name, shape, kj, dtype)
            continue
        values = _init_group(name, (len(members),) + shape, k, dtype)
        for j, i in enumerate(members):
            leaves[i] = values[j]
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes, is_leaf=_is_shape), leaves
    )
