"""Decoder-layer building blocks, as pure functions over the params dicts of params.py.

The pieces are split where the tree-verify forward (spec_decode) needs to swap something:
  GDN:        gdn_in_proj -> [gdn_core_chunked | gdn_core_recurrent | tree conv+rule] -> gdn_out
  attention:  attn_qkv -> (write KV) -> attend(mask) -> attn_out
  MLP:        mlp (dense or MoE, chosen by the params' keys)
Numerics follow transformers' Qwen3-Next / Qwen3.5 code (fp32 norms, fp32 softmax, fp32 gates).
Shapes: B batch, T tokens, S KV slots; other letters as in config.ModelConfig.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import parallel
from bole_jax.model.cache import GDNCache, settle
from bole_jax.model.config import ModelConfig
from bole_jax.pallas import moe_gmm
from bole_jax.pallas.attention import attend_reference, attend_split_s
from bole_jax.pallas.gdn_decode import gdn_decode
from bole_jax.pallas.gdn_ref import chunk_gated_delta_rule, recurrent_gated_delta_rule
from bole_jax.pallas.tree_utils import resolve_backend

# ----------------------------------------------------------------------------- norms


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: normalise in fp32, scale by (1 + w) in fp32, cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: normalise x in fp32, cast back, scale by plain w, then * silu(z) in fp32."""
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = w * y  # in the weight's dtype, as transformers does
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[rotary_dim / 2] inverse frequencies, computed in fp32 like transformers."""
    rd = cfg.rotary_dim
    exponent = np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)
    return (np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponent)).astype(np.float32)


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig, dtype):
    """cos, sin [B, T, rotary_dim] for integer positions [B, T].

    Qwen3.5's mRoPE gives the three (t, h, w) sections the same position for text tokens, so it
    reduces to this 1-D RoPE (transformers expands text position ids to 3 identical rows)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Partial rotate-half RoPE on the first cos.shape[-1] channels. x [B, T, heads, D]."""
    rd = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


# ----------------------------------------------------------------------------- attention


def attn_qkv(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """Projections of gated attention, after q_norm / k_norm and RoPE.

    x [B, T, H], positions [B, T] int. Returns q [B, T, Hq, D], k, v [B, T, Hkv, D],
    gate [B, T, Hq*D] (pre-sigmoid output gate)."""
    B, T, _ = x.shape
    D = cfg.head_dim
    q = (x @ p["w_q"]).reshape(B, T, cfg.num_heads, D)
    gate = x @ p["w_gate"]
    k = (x @ p["w_k"]).reshape(B, T, cfg.num_kv_heads, D)
    v = (x @ p["w_v"]).reshape(B, T, cfg.num_kv_heads, D)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, cfg, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array, cfg: ModelConfig):
    """Masked GQA softmax attention (softmax in fp32): `attend_reference`, or with
    `KernelOptions.attention_backend` "pallas" / "auto" (on the GPU) the split-S kernel of
    `pallas/attention.py` (not under tensor parallelism, whose heads XLA partitions)."""
    backend = cfg.kernels.attention_backend
    if backend == "reference" or cfg.tp > 1:
        return attend_reference(q, k_cache, v_cache, mask)
    return attend_split_s(q, k_cache, v_cache, mask, backend=backend)


def attn_out(p: dict, o: jax.Array, gate: jax.Array, cfg: ModelConfig) -> jax.Array:
    """o [B, T, Hq, D] * sigmoid(gate) then o_proj -> [B, T, H]."""
    B, T = o.shape[:2]
    o = o.reshape(B, T, -1) * jax.nn.sigmoid(gate)
    return o @ p["w_o"]


# ----------------------------------------------------------------------------- Gated DeltaNet


def gdn_in_proj(p: dict, x: jax.Array, cfg: ModelConfig):
    """GDN input projections. x [B, T, H] ->
    qkv [B, T, C] pre-conv ([all q | all k | all v]), z [B, T, HV, dv] output gate,
    g [B, T, HV] fp32 log decay = -exp(A_log) * softplus(a + dt_bias), beta [B, T, HV] fp32."""
    B, T, _ = x.shape
    qkv = x @ p["w_qkv"]
    z = (x @ p["w_z"]).reshape(B, T, cfg.gdn_num_value_heads, cfg.gdn_value_dim)
    beta = jax.nn.sigmoid(x @ p["w_b"]).astype(jnp.float32)
    a = (x @ p["w_a"]).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + p["dt_bias"].astype(jnp.float32)
    )
    return qkv, z, g, beta


def causal_conv(qkv: jax.Array, conv_state: jax.Array, conv_w: jax.Array, num_new: jax.Array):
    """Depthwise causal conv + SiLU with the committed inputs as left context, ragged commit.

    qkv [B, T, C] pre-conv inputs (tokens t >= num_new[b] are padding), conv_state [B, K-1, C]
    (row K-2 newest), conv_w [K, C] (y_t = sum_i w[i] x_{t-K+1+i}), num_new [B] int32.
    Returns y [B, T, C] (qkv.dtype) and the new conv state: the last K-1 VALID inputs of the
    sequence (unchanged when num_new[b] == 0)."""
    K = conv_w.shape[0]
    T = qkv.shape[1]
    # At one token per step (AR decode at B = 1) XLA rewrites the qkv projection, a vector x
    # matrix dot, into multiply + reduce and fused that reduce into the concatenate below: each
    # output element then ran the whole 2048-long reduction alone, uncoalesced. Measured at
    # Qwen3-Next-80B dims (TP = 2): 0.58 ms per GDN layer, 72% of the AR step
    # (docs/design-decisions.md). The barrier keeps the projection its own kernel.
    qkv = jax.lax.optimization_barrier(qkv)
    xs = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, K-1+T, C]
    x32, w32 = xs.astype(jnp.float32), conv_w.astype(jnp.float32)
    y = sum(w32[i] * x32[:, i : i + T] for i in range(K))
    y = jax.nn.silu(y).astype(qkv.dtype)
    # Token t sits at xs row K-1+t, so the K-1 rows ending at the last valid token start at num_new.
    idx = num_new[:, None] + jnp.arange(K - 1)[None, :]  # [B, K-1]
    new_state = jnp.take_along_axis(xs, idx[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)


def _split_qkv(y: jax.Array, cfg: ModelConfig):
    B, T, _ = y.shape
    kd = cfg.gdn_num_key_heads * cfg.gdn_key_dim
    q = y[..., :kd].reshape(B, T, cfg.gdn_num_key_heads, cfg.gdn_key_dim)
    k = y[..., kd : 2 * kd].reshape(B, T, cfg.gdn_num_key_heads, cfg.gdn_key_dim)
    v = y[..., 2 * kd :].reshape(B, T, cfg.gdn_num_value_heads, cfg.gdn_value_dim)
    return q, k, v


def _gdn_core(rule, conv_w, qkv, g, beta, cache: GDNCache, num_new, cfg):
    # A lazy commit still pending is part of the committed state: fold it in first (cleared in
    # the returned cache, whose pytree structure stays the input's).
    cache = settle(cache)
    y, conv = causal_conv(qkv, cache.conv, conv_w, num_new)
    q, k, v = _split_qkv(y, cfg)
    valid = (jnp.arange(qkv.shape[1])[None, :] < num_new[:, None])[..., None]  # [B, T, 1]
    # Padding tokens: g = beta = 0 leaves the state exactly unchanged; zeroing k, v as well keeps
    # a non-finite padding row from leaking in through 0 * inf.
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    k, v = jnp.where(valid[..., None], k, 0), jnp.where(valid[..., None], v, 0)
    o, state = rule(q, k, v, g, beta, cache.state)
    return o, GDNCache(conv=conv, state=state, pending=cache.pending)


def _gdn_core_per_shard(rule, p, qkv, g, beta, cache: GDNCache, num_new, cfg: ModelConfig):
    """`_gdn_core` on each device's own heads under tensor parallelism (parallel.py), else as is."""
    heads = parallel.split_at(2)
    cache_specs = parallel.gdn_cache_specs(cfg, pending=cache.pending)
    core = parallel.over_gdn_heads(
        functools.partial(_gdn_core, rule, cfg=parallel.gdn_local_cfg(cfg)),
        cfg,
        in_specs=(parallel.split_at(1), heads, heads, heads, cache_specs, parallel.REPLICATED),
        out_specs=(heads, cache_specs),
    )
    return core(p["conv_w"], qkv, g, beta, cache, num_new)


def gdn_core_chunked(p, qkv, g, beta, cache: GDNCache, num_new, cfg: ModelConfig, chunk: int = 64):
    """Conv + chunked gated delta rule (prefill, T > 1). Returns (o [B, T, HV, dv], GDNCache')."""
    rule = lambda *a: chunk_gated_delta_rule(*a, chunk=chunk)
    return _gdn_core_per_shard(rule, p, qkv, g, beta, cache, num_new, cfg)


DECODE_INTERPRET = None  # Pallas interpret mode; None = on anything but GPU


def _decode_rule(q, k, v, g, beta, state, *, interpret):
    """`recurrent_gated_delta_rule`'s signature, T == 1, through the Pallas decode kernel (state
    updated in place). Padding rows arrive masked by `_gdn_core` (k = v = g = beta = 0), which
    leaves their state exactly unchanged here too."""
    o, state = gdn_decode(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, backend="pallas", interpret=interpret
    )
    return o[:, None], state


def gdn_core_recurrent(
    p,
    qkv,
    g,
    beta,
    cache: GDNCache,
    num_new,
    cfg: ModelConfig,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """Conv + recurrent gated delta rule (decode, T == 1; any T works). Same returns.

    T == 1 with the backend resolving to Pallas (backend None: `cfg.kernels.gdn_decode_backend`,
    "auto" = on GPU) runs the in-place decode kernel, which measured faster than the jnp rule
    (docs/design-decisions.md); otherwise (CPU, T > 1) the jnp rule."""
    backend = cfg.kernels.gdn_decode_backend if backend is None else backend
    interpret = DECODE_INTERPRET if interpret is None else interpret
    backend, interpret = resolve_backend(backend, interpret)
    rule = recurrent_gated_delta_rule
    if qkv.shape[1] == 1 and backend == "pallas":
        rule = functools.partial(_decode_rule, interpret=interpret)
    return _gdn_core_per_shard(rule, p, qkv, g, beta, cache, num_new, cfg)


def gdn_out(p: dict, o: jax.Array, z: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gated RMSNorm per value head, then out_proj. o, z [B, T, HV, dv] -> [B, T, H]."""
    B, T = o.shape[:2]
    y = gated_rms_norm(o, z, p["norm_w"], cfg.rms_norm_eps)
    return y.reshape(B, T, -1) @ p["w_out"]


# ----------------------------------------------------------------------------- MLP / MoE


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, shards: int = 1) -> jax.Array:
    """silu(x @ W_gate) * (x @ W_up) @ W_down with W_gate_up = [W_gate | W_up].

    shards > 1 (tensor parallelism): W_gate_up's columns are stored shard-major,
    [gate_0 | up_0 | gate_1 | up_1 | ...] (parallel.py), and split per shard, so each device
    pairs its own gate and up columns."""
    if shards == 1:
        gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)
    else:
        lead = x.shape[:-1]
        h = (x @ w_gate_up).reshape(*lead, shards, 2, -1)
        gate, up = h[..., 0, :].reshape(*lead, -1), h[..., 1, :].reshape(*lead, -1)
    return (jax.nn.silu(gate) * up) @ w_down


def moe_route(router: jax.Array, x: jax.Array, cfg: ModelConfig):
    """fp32 softmax router, top-k, optional renormalisation. x [N, H] ->
    (weights [N, k] in x.dtype, experts [N, k] int32)."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    top_w, top_e = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w.astype(x.dtype), top_e.astype(jnp.int32)


def moe_experts_gather(p, x, top_w, top_e):
    """Few tokens (decode): gather each token's k experts' weights; reads only those experts."""
    w_gu = p["w_gate_up"][top_e]  # [N, k, H, 2I]
    gate, up = jnp.split(jnp.einsum("nh,nkhi->nki", x, w_gu), 2, axis=-1)
    y = jnp.einsum("nki,nkih->nkh", jax.nn.silu(gate) * up, p["w_down"][top_e])
    return jnp.einsum("nkh,nk->nh", y, top_w)


def moe_experts_sorted(p, x, top_w, top_e):
    """Many tokens (prefill/verify): sort (token, expert) pairs by expert, grouped matmuls."""
    N, k = top_e.shape
    E = p["w_gate_up"].shape[0]
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[token], p["w_gate_up"], sizes)  # [N*k, 2I]
    gate, up = jnp.split(h, 2, axis=-1)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["w_down"], sizes)  # [N*k, H]
    y = y * top_w.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def moe_experts_dense(p, x, top_w, top_e):
    """Reference: every expert on every token, combined with the routing weights (tests only)."""
    E = p["w_gate_up"].shape[0]
    gate, up = jnp.split(jnp.einsum("nh,ehi->nei", x, p["w_gate_up"]), 2, axis=-1)
    y = jnp.einsum("nei,eih->neh", jax.nn.silu(gate) * up, p["w_down"])
    comb = jnp.sum(jax.nn.one_hot(top_e, E, dtype=x.dtype) * top_w[..., None], axis=1)  # [N, E]
    return jnp.einsum("neh,ne->nh", y, comb)


def moe_experts_gmm(
    p,
    x,
    top_w,
    top_e,
    *,
    rows_per_expert: float | None = None,
    config=None,
    backend: str = "auto",
    interpret: bool | None = None,
):
    """Grouped matmuls (pallas/moe_gmm.py): the pairs sorted by expert into row tiles of one
    expert each; every used expert's weights are read in place, once per tile (no weight copies,
    no dense padding); SwiGLU fused into the gate_up matmul. Expert id E (= the local expert
    count) is a dropped pair: no row, no work, contributes 0 (`moe_experts_local`).

    rows_per_expert: expected real pairs per expert, picks the row tile (default N k / E; under
    expert parallelism the caller passes N k / E_global: most pairs here are dropped).
    config: one moe_gmm.GMMConfig for both matmuls or a (gate_up, down) pair sharing block_m.
    backend: "auto" (Pallas on GPU, the jnp reference elsewhere) | "pallas" | "reference"."""
    n, k = top_e.shape
    num_experts = p["w_gate_up"].shape[0]
    if config is None:
        r = n * k / num_experts if rows_per_expert is None else rows_per_expert
        bm = moe_gmm.GMMConfig.auto(r).block_m
        size = jnp.dtype(p["w_gate_up"].dtype).itemsize
        config = (
            moe_gmm.GMMConfig.for_block_m(bm, True, size),
            moe_gmm.GMMConfig.for_block_m(bm, False, size),
        )
    cfg_up, cfg_down = config if isinstance(config, tuple) else (config, config)
    assert cfg_up.block_m == cfg_down.block_m, (cfg_up, cfg_down)
    lay = moe_gmm.group_layout(top_e.reshape(-1), num_experts, cfg_up.block_m)
    run = functools.partial(
        moe_gmm.gmm, tile_expert=lay.tile_expert, backend=backend, interpret=interpret
    )
    # Padding rows read token n (past the end): zero rows.
    xs = jnp.take(x, lay.row_pair // k, axis=0, mode="fill", fill_value=0)  # [M, H]
    h = run(xs, p["w_gate_up"], swiglu=True, config=cfg_up)  # [M, I] silu(gate) * up
    y = run(h, p["w_down"], config=cfg_down)  # [M, H]
    # Dropped pairs read row M (past the end): 0. Combined in fp32.
    y = jnp.take(y, lay.pair_row, axis=0, mode="fill", fill_value=0).reshape(n, k, -1)
    return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), top_w.astype(jnp.float32)).astype(
        x.dtype
    )


def default_experts_impl(tokens: int, cfg: ModelConfig):
    """`moe`'s static choice of experts implementation for `tokens` rows. On a GPU the
    grouped-matmul kernel at every size: it reads each used expert's weights once, in place
    (ragged_dot lowers there to a dense padded dot that runs out of memory at prefill sizes;
    gathering copies every pair's weights). Elsewhere (CPU tests and parity) the jnp paths:
    gathered weights when few are read, else ragged_dot. Decided by jax.default_backend() at
    trace time: the model threads no kernel backend into its MLP."""
    pairs = tokens * cfg.num_experts_per_tok
    if jax.default_backend() == "gpu":
        return functools.partial(moe_experts_gmm, rows_per_expert=pairs / cfg.num_experts)
    return moe_experts_gather if pairs <= cfg.num_experts else moe_experts_sorted


def moe(p: dict, x: jax.Array, cfg: ModelConfig, experts_impl=None) -> jax.Array:
    """Sparse MoE block with sigmoid-gated shared expert. x [..., H] -> [..., H]."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    top_w, top_e = moe_route(p["router"], x, cfg)
    if experts_impl is None:
        experts_impl = default_experts_impl(x.shape[0], cfg)
    num_experts = p["w_gate_up"].shape[0]
    if parallel.shards(cfg, num_experts) > 1:  # expert parallelism: each device its E / tp experts
        routed = parallel.over_experts(
            functools.partial(moe_experts_local, experts_impl), cfg, num_experts
        )(p, x, top_w, top_e)
    else:
        routed = experts_impl(p, x, top_w, top_e)
    shared = jax.nn.sigmoid(x @ p["shared_gate"]) * swiglu(
        x, p["shared_gate_up"], p["shared_down"], parallel.shards(cfg, p["shared_down"].shape[0])
    )
    return (routed + shared).reshape(shape)


def moe_experts_local(experts_impl, p, x, top_w, top_e, first):
    """The routed output restricted to the experts held in p, global ids [first, first + E_local)
    (expert parallelism, parallel.over_experts). Pairs routed elsewhere: dropped (expert id
    E_local) for the grouped matmul, which gives them no rows; the other paths send them to the
    last local expert with weight 0: computed, contributing nothing (leaving them out of every
    ragged_dot group would save that work, but the rows past sum(group_sizes) are only known to
    be zero on CPU)."""
    e_local = p["w_gate_up"].shape[0]
    e = top_e - first
    mine = (e >= 0) & (e < e_local)
    if getattr(experts_impl, "func", experts_impl) is moe_experts_gmm:
        return experts_impl(p, x, top_w, jnp.where(mine, e, e_local))
    return experts_impl(p, x, jnp.where(mine, top_w, 0), jnp.where(mine, e, e_local - 1))


def mlp(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The layer's feed-forward block: MoE when its params have a router, else dense SwiGLU."""
    if "router" in p:
        return moe(p, x, cfg)
    return swiglu(x, p["w_gate_up"], p["w_down"], parallel.shards(cfg, p["w_down"].shape[0]))
