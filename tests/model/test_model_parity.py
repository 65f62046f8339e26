"""Parity of bole_jax.model against transformers (fp32, CPU) on tiny random models.

Relative error is ||ours - ref|| / ||ref||; the bound is 1e-5 throughout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import rel_err, torch_greedy_run, torch_logits

from bole_jax.model import (
    Cache,
    ModelConfig,
    abstract_params,
    forward,
    init_cache,
    init_params,
    logits,
)
from bole_jax.model.cache import AttnCache, GDNCache
from bole_jax.model.layers import (
    moe_experts_dense,
    moe_experts_gather,
    moe_experts_sorted,
    moe_route,
    rms_norm,
    rope_cos_sin,
)
from bole_jax.model.weights import load_hf_checkpoint
from bole_jax.pallas.gdn_ref import chunk_gated_delta_rule, recurrent_gated_delta_rule

TOL = 1e-5

FAMILIES = [
    pytest.param(
        ("qwen3_next", False, 1, dict(num_hidden_layers=8)), id="qwen3_next-dense-8layers"
    ),
    pytest.param(("qwen3_next", True, 2, dict(mlp_only_layers=[1])), id="qwen3_next-moe"),
    pytest.param(("qwen3_5", False, 3, {}), id="qwen3_5-dense-tied"),
    pytest.param(("qwen3_5_moe", True, 4, {}), id="qwen3_5_moe"),
]

_forward = jax.jit(forward, static_argnums=1)
_logits = jax.jit(logits, static_argnums=1)
_chunk_rule = jax.jit(chunk_gated_delta_rule, static_argnames=("chunk",))
_recurrent_rule = jax.jit(recurrent_gated_delta_rule)


@functools.partial(jax.jit, static_argnums=1, donate_argnums=3)
def _greedy_step(params, cfg, tok, cache):
    """One decode step for the whole batch: (next greedy token, this step's logits, cache')."""
    hidden, cache = forward(params, cfg, tok[:, None], cache)
    lg = logits(params, cfg, hidden[:, 0])
    return jnp.argmax(lg, axis=-1).astype(jnp.int32), lg, cache


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tiny_checkpoint):
    family, moe, seed, overrides = request.param
    path, torch_model = tiny_checkpoint(family, moe=moe, seed=seed, **overrides)
    cfg, params = load_hf_checkpoint(path)
    return cfg, params, torch_model


def _rng(seed):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- whole model


def test_config_matches_hf(case):
    cfg, _, model = case
    hf = model.config
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.rotary_dim == 8 and cfg.conv_dim == 2 * 2 * 16 + 4 * 16
    for i, layer in enumerate(model.model.layers):
        assert cfg.is_moe_layer(i) == hasattr(layer.mlp, "experts"), i


def test_full_sequence_logits(case):
    """Two 70-token sequences in one call (the GDN chunked form spans 2 chunks of 64)."""
    cfg, params, model = case
    ids = _rng(0).integers(0, cfg.vocab_size, (2, 70))
    ref = torch_logits(model, ids)
    hidden, cache = _forward(params, cfg, jnp.asarray(ids), init_cache(cfg, 2, 80))
    err = rel_err(_logits(params, cfg, hidden), ref)
    assert err <= TOL, err
    np.testing.assert_array_equal(cache.lengths, [70, 70])


PROMPT_LENS = (6, 13, 2, 9)  # one batch, right padded; 2 < K-1 exercises a partly-empty conv window
STEPS = 32


@pytest.fixture(scope="module")
def batched_run(case):
    """Ragged batched prefill of 4 prompts, then STEPS jitted greedy decode steps (donated cache),
    and transformers' per-prompt greedy run with its own cache, keeping everything to compare."""
    cfg, params, model = case
    rng = _rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in PROMPT_LENS]
    T = max(PROMPT_LENS)
    tokens = np.zeros((len(prompts), T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    num_new = jnp.asarray(PROMPT_LENS, jnp.int32)
    hidden, cache = _forward(
        params, cfg, jnp.asarray(tokens), init_cache(cfg, len(prompts), T + STEPS), num_new
    )
    prefill_cache = jax.tree.map(np.asarray, cache)
    step_logits = [_logits(params, cfg, hidden[jnp.arange(len(prompts)), num_new - 1])]
    tok = jnp.argmax(step_logits[0], axis=-1).astype(jnp.int32)
    generated = [tok]
    for _ in range(STEPS - 1):
        tok, lg, cache = _greedy_step(params, cfg, tok, cache)
        generated.append(tok)
        step_logits.append(lg)
    ours = dict(
        tokens=np.stack(generated, 1),
        logits=np.stack(step_logits, 1),
        prefill_cache=prefill_cache,
        final_lengths=np.asarray(cache.lengths),
        prompt_tokens=tokens,
    )
    refs = [torch_greedy_run(model, p, STEPS) for p in prompts]
    return cfg, params, prompts, ours, refs


def test_batched_greedy_matches_hf(batched_run):
    """Identical greedy tokens for 32 steps, 4 prompts of different lengths in one batch."""
    _, _, prompts, ours, refs = batched_run
    for b in range(len(prompts)):
        assert ours["tokens"][b].tolist() == refs[b]["tokens"], b
    np.testing.assert_array_equal(ours["final_lengths"], np.asarray(PROMPT_LENS) + STEPS - 1)


def test_prefill_and_decode_logits_match_hf(batched_run):
    """Logits after the ragged prefill and after every recurrent decode step (same tokens fed)."""
    _, _, prompts, ours, refs = batched_run
    for b in range(len(prompts)):
        errs = [rel_err(ours["logits"][b, i], refs[b]["logits"][i]) for i in range(STEPS)]
        assert max(errs) <= TOL, (b, max(errs))


def test_prefill_cache_matches_hf(batched_run):
    """Every cache entry after the ragged prefill: conv window, recurrent state, K and V."""
    cfg, _, prompts, ours, refs = batched_run
    for b, n in enumerate(PROMPT_LENS):
        for i, (c, ref) in enumerate(zip(ours["prefill_cache"].layers, refs[b]["prefill_cache"])):
            if isinstance(c, GDNCache):
                # transformers keeps the last K inputs as [B, C, K]; we keep the last K-1 as [B, K-1, C].
                assert rel_err(c.conv[b], ref[0][0, :, 1:].T.numpy()) <= TOL, (b, i)
                assert rel_err(c.state[b], ref[1][0].numpy()) <= TOL, (b, i)
            else:
                # both keep KV heads-major: [B, Hkv, S, D]
                assert rel_err(c.k[b, :, :n], ref[0][0].numpy()) <= TOL, (b, i)
                assert rel_err(c.v[b, :, :n], ref[1][0].numpy()) <= TOL, (b, i)


def test_conv_state_is_last_valid_inputs(batched_run):
    """After the ragged prefill each GDN conv state holds the last K-1 VALID pre-conv inputs
    (zero rows in front for the 2-token prompt)."""
    cfg, params, _, ours, _ = batched_run
    layer0 = params["layers"][0]
    ids = ours["prompt_tokens"]
    x = (
        rms_norm(params["embed"][ids], layer0["input_norm"], cfg.rms_norm_eps)
        @ layer0["gdn"]["w_qkv"]
    )
    K1 = cfg.conv_kernel - 1
    for b, n in enumerate(PROMPT_LENS):
        expected = np.concatenate([np.zeros((K1, cfg.conv_dim), np.float32), np.asarray(x[b, :n])])[
            -K1:
        ]
        np.testing.assert_allclose(
            ours["prefill_cache"].layers[0].conv[b], expected, rtol=1e-6, atol=1e-6
        )


def test_chunked_prefill_and_idle_requests(case):
    """Appending a prompt in two ragged pieces equals one prefill; requests with num_new = 0 are
    left exactly as they were (same shapes as the batched run: no new compilation)."""
    cfg, params, model = case
    ids = _rng(4).integers(0, cfg.vocab_size, (4, 13))
    ref = torch_logits(model, ids[:1, :11])
    cache = init_cache(cfg, 4, max(PROMPT_LENS) + STEPS)
    h1, cache = _forward(params, cfg, jnp.asarray(ids), cache, jnp.asarray([4, 13, 0, 5]))
    before = jax.tree.map(lambda x: np.asarray(x[1:3]), cache)
    piece = np.zeros((4, 13), np.int32)
    piece[0, :7] = ids[0, 4:11]
    h2, cache = _forward(params, cfg, jnp.asarray(piece), cache, jnp.asarray([7, 0, 0, 0]))
    ours = np.concatenate([_logits(params, cfg, h1[0, :4]), _logits(params, cfg, h2[0, :7])])
    assert rel_err(ours, ref[0]) <= TOL
    after = jax.tree.map(lambda x: np.asarray(x[1:3]), cache)
    jax.tree.map(np.testing.assert_array_equal, after, before)
    np.testing.assert_array_equal(cache.lengths, [11, 13, 0, 5])


# ----------------------------------------------------------------------------- pieces


def _gdn_inputs(seed, B=2, T=150, Hk=2, HV=4, dk=16, dv=16):
    rng = _rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    g = -rng.uniform(0.0, 0.7, size=(B, T, HV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(B, T, HV)).astype(np.float32)
    return f(B, T, Hk, dk), f(B, T, Hk, dk), f(B, T, HV, dv), g, beta, f(B, HV, dk, dv)


@pytest.mark.parametrize("chunk", [16, 64])
def test_gdn_chunked_matches_recurrent_and_torch(chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _gdn_inputs(6)
    o_c, s_c = _chunk_rule(q, k, v, g, beta, s0, chunk=chunk)
    o_r, s_r = _recurrent_rule(q, k, v, g, beta, s0)
    assert rel_err(o_c, o_r) <= TOL and rel_err(s_c, s_r) <= TOL
    t = torch.as_tensor
    # Older transformers (5.17, the GPU image) expect q/k already expanded to the value heads.
    r = v.shape[2] // q.shape[2]
    qe, ke = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    o_tc, s_tc = torch_chunk_gated_delta_rule(
        t(qe),
        t(ke),
        t(v),
        t(g),
        t(beta),
        chunk_size=chunk,
        initial_state=t(s0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o_tr, s_tr = torch_recurrent_gated_delta_rule(
        t(qe),
        t(ke),
        t(v),
        t(g),
        t(beta),
        initial_state=t(s0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o_c, o_tc.numpy()) <= TOL and rel_err(s_c, s_tc.numpy()) <= TOL
    assert rel_err(o_r, o_tr.numpy()) <= TOL and rel_err(s_r, s_tr.numpy()) <= TOL
    # One step at a time (the decode path) threads the same state.
    s, outs = s0, []
    for i in range(20):
        o, s = _recurrent_rule(
            q[:, i : i + 1],
            k[:, i : i + 1],
            v[:, i : i + 1],
            g[:, i : i + 1],
            beta[:, i : i + 1],
            s,
        )
        outs.append(o)
    o20, s20 = _chunk_rule(
        q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], s0, chunk=chunk
    )
    assert rel_err(np.concatenate(outs, 1), o20) <= TOL and rel_err(s, s20) <= TOL


def test_gdn_padding_tokens_leave_state_unchanged():
    q, k, v, g, beta, s0 = _gdn_inputs(7, T=40)
    n = 25
    g2, beta2 = g.copy(), beta.copy()
    g2[:, n:], beta2[:, n:] = 0.0, 0.0
    o_pad, s_pad = _chunk_rule(q, k, v, g2, beta2, s0, chunk=16)
    o_ref, s_ref = _chunk_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0, chunk=16)
    assert rel_err(s_pad, s_ref) <= TOL and rel_err(o_pad[:, :n], o_ref) <= TOL
    _, s_rec = _recurrent_rule(q, k, v, g2, beta2, s0)
    assert rel_err(s_rec, s_ref) <= TOL


def test_moe_expert_paths_agree():
    """Gathered (decode) and sorted ragged_dot (prefill) expert paths vs the dense reference."""
    cfg = ModelConfig.tiny("qwen3_next", moe=True)
    rng = _rng(9)
    E, H, Ie = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    p = {
        "router": rng.normal(size=(H, E)).astype(np.float32),
        "w_gate_up": rng.normal(size=(E, H, 2 * Ie)).astype(np.float32) * H**-0.5,
        "w_down": rng.normal(size=(E, Ie, H)).astype(np.float32) * Ie**-0.5,
    }
    x = jnp.asarray(rng.normal(size=(13, H)).astype(np.float32))

    @jax.jit
    def run(p, x):
        w, e = moe_route(p["router"], x, cfg)
        return (
            w,
            moe_experts_dense(p, x, w, e),
            moe_experts_gather(p, x, w, e),
            moe_experts_sorted(p, x, w, e),
        )

    w, ref, gathered, ragged = run(p, x)
    np.testing.assert_allclose(jnp.sum(w, -1), 1.0, rtol=1e-6)
    assert rel_err(gathered, ref) <= TOL and rel_err(ragged, ref) <= TOL


def test_qwen3_5_mrope_text_positions_equal_1d_rope():
    from hf_tiny import tiny_hf_config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf_cfg = tiny_hf_config(
        "qwen3_5",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert cfg.rotary_dim == 16 and cfg.rope_theta == 1e6
    pos = np.array([[0, 1, 2, 3, 500], [7, 8, 9, 10, 11]])
    rot = Qwen3_5TextRotaryEmbedding(hf_cfg)
    cos_ref, sin_ref = rot(
        torch.zeros(1, dtype=torch.float32), torch.as_tensor(pos)[None].expand(3, -1, -1)
    )
    cos, sin = rope_cos_sin(jnp.asarray(pos), cfg, jnp.float32)
    np.testing.assert_allclose(cos, cos_ref.numpy(), atol=1e-6)
    np.testing.assert_allclose(sin, sin_ref.numpy(), atol=1e-6)


def test_bf16_params_forward(tiny_checkpoint):
    path, model = tiny_checkpoint("qwen3_next", moe=True, seed=2, mlp_only_layers=[1])
    cfg, p32 = load_hf_checkpoint(path)
    _, p16 = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    # bf16 except the GDN A_log and norm weights, kept fp32 (model/weights.py FP32_GDN_LEAVES)
    gdn32 = [
        p16["layers"][i]["gdn"][n]
        for i, t in enumerate(cfg.layer_types)
        if t == "linear_attention"
        for n in ("A_log", "norm_w")
    ]
    assert gdn32 and all(x.dtype == jnp.float32 for x in gdn32)
    assert sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16)) == len(
        jax.tree.leaves(p16)
    ) - len(gdn32)
    ids = jnp.asarray(_rng(8).integers(0, cfg.vocab_size, (2, 70)))
    h32, _ = _forward(p32, cfg, ids, init_cache(cfg, 2, 80))
    h16, c16 = _forward(p16, cfg, ids, init_cache(cfg, 2, 80, jnp.bfloat16))
    assert c16.layers[0].conv.dtype == jnp.bfloat16 and c16.layers[0].state.dtype == jnp.float32
    l32, l16 = _logits(p32, cfg, h32), _logits(p16, cfg, h16)
    assert l16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(l16)))
    assert rel_err(l16, l32) < 0.1


def test_init_params_layout_and_forward():
    """init_params produces exactly the documented layout (incl. the MTP subtree) and runs."""
    cfg = ModelConfig.tiny(
        "qwen3_next", moe=True, mlp_only_layers=(1,)
    )  # == the tiny HF qwen3_next-moe
    cfg_mtp = dataclasses.replace(cfg, mtp_num_layers=1)
    params = init_params(cfg_mtp, jax.random.key(0))
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), abstract_params(cfg_mtp))
    assert "w_gate_up" in params["layers"][1]["mlp"] and "router" not in params["layers"][1]["mlp"]
    assert "attn" in params["mtp"]["layers"][0] and "router" in params["mtp"]["layers"][0]["mlp"]
    assert params["mtp"]["fc"].shape == (2 * cfg.hidden_size, cfg.hidden_size)
    cache = init_cache(cfg, 2, 80)
    assert (
        isinstance(cache, Cache) and isinstance(cache.layers[3], AttnCache) and cache.capacity == 80
    )
    target = {k: v for k, v in params.items() if k != "mtp"}  # forward never reads the MTP head
    hidden, cache = _forward(target, cfg, jnp.zeros((2, 70), jnp.int32), cache)
    assert bool(jnp.all(jnp.isfinite(hidden)))


def test_init_params_big_groups_drawn_leaf_by_leaf():
    """Groups above GROUP_DRAW_LIMIT (the experts of big models) are drawn one leaf at a time:
    same layout, each leaf its own draw, the documented scale; the small groups unchanged."""
    from bole_jax.model import params as params_mod

    cfg = ModelConfig.tiny("qwen3_next", moe=True)
    ref = init_params(cfg, jax.random.key(0), "float32")
    experts = ref["layers"][0]["mlp"]["w_gate_up"]
    old, params_mod.GROUP_DRAW_LIMIT = params_mod.GROUP_DRAW_LIMIT, experts.size - 1
    try:
        big = jax.jit(lambda k: params_mod.build_params(cfg, jnp.float32, k))(jax.random.key(0))
    finally:
        params_mod.GROUP_DRAW_LIMIT = old
    assert jax.tree.map(lambda a: (a.shape, a.dtype), big) == jax.tree.map(
        lambda a: (a.shape, a.dtype), ref
    )
    a, b = big["layers"][0]["mlp"]["w_gate_up"], big["layers"][1]["mlp"]["w_gate_up"]
    assert not np.array_equal(np.asarray(a), np.asarray(experts))
    assert not np.array_equal(np.asarray(a), np.asarray(b))  # every leaf its own draw
    bound = 3.0**0.5 * a.shape[-2] ** -0.5  # uniform with std 1/sqrt(fan_in)
    assert float(jnp.abs(a).max()) <= bound and float(jnp.std(a)) > 0.8 * bound / 3.0**0.5
    np.testing.assert_array_equal(
        np.asarray(big["layers"][0]["mlp"]["router"]), np.asarray(ref["layers"][0]["mlp"]["router"])
    )
