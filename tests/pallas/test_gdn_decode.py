"""Pallas one-token decode of the gated delta rule (pallas/gdn_decode.py) vs the jnp rule.

CPU only: the kernel runs in Pallas interpret mode (fp32 maths, so tolerances are tight), and a
lowering test builds the Triton IR for the GPU. Random inputs are fresh every run (seed printed
in failure messages) plus a fixed seed.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.model import layers
from bole_jax.model.cache import GDNCache
from bole_jax.model.config import ModelConfig
from bole_jax.pallas.gdn_decode import gdn_decode, gdn_decode_reference

jax.config.update("jax_default_matmul_precision", "highest")

SEEDS = [0, RUN_SEED]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, hk, hv, dk, dv, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, hk, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hk, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hv, dv)), dtype)
    g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((b, hv)))), jnp.float32)  # -softplus
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, hv)))), jnp.float32)
    state = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "b,hk,hv,dk,dv,block_v",
    [
        (1, 2, 2, 16, 16, 32),  # ratio 1, one tile
        (3, 1, 2, 32, 32, 16),  # ratio 2, two value tiles
        (3, 2, 6, 48, 32, 32),  # ratio 3, dk padded 48 -> 64
        (1, 1, 2, 128, 128, 32),  # real head dims, four value tiles
        (3, 2, 4, 128, 40, 32),  # dv padded 40 -> 64
    ],
)
def test_kernel_matches_rule(seed, b, hk, hv, dk, dv, block_v):
    args = _inputs(seed, b, hk, hv, dk, dv)
    o_ref, s_ref = gdn_decode_reference(*args)
    o, s = gdn_decode(*args, backend="pallas", interpret=True, block_v=block_v)
    assert o.shape == (b, hv, dv) and o.dtype == jnp.float32, (o.shape, o.dtype)
    assert s.shape == (b, hv, dk, dv) and s.dtype == jnp.float32, (s.shape, s.dtype)
    assert rel(o, o_ref) <= 1e-5, (seed, rel(o, o_ref))
    assert rel(s, s_ref) <= 1e-5, (seed, rel(s, s_ref))


def test_kernel_bf16_inputs_and_scale():
    """bf16 q/k/v (the model dtype): o comes back in bf16, the state stays fp32; explicit scale
    and qk_l2norm=False follow the rule's conventions."""
    args = _inputs(RUN_SEED, 2, 1, 2, 32, 32, jnp.bfloat16)
    for kw in ({}, {"scale": 0.3, "qk_l2norm": False}):
        o_ref, s_ref = gdn_decode_reference(*args, **kw)
        o, s = gdn_decode(*args, backend="pallas", interpret=True, **kw)
        assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
        assert rel(s, s_ref) <= 1e-5, (RUN_SEED, kw, rel(s, s_ref))
        assert rel(o, o_ref) <= 1e-2, (RUN_SEED, kw, rel(o, o_ref))  # bf16 rounding of o


def _pallas_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for val in eqn.params.values():
            for sub in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _pallas_eqns(sub)


def test_state_output_aliases_state_input():
    args = _inputs(0, 2, 1, 2, 32, 32)
    jaxpr = jax.make_jaxpr(lambda *a: gdn_decode(*a, backend="pallas", interpret=True))(*args)
    eqns = list(_pallas_eqns(jaxpr.jaxpr))
    assert len(eqns) == 1
    assert tuple(eqns[0].params["input_output_aliases"]) == ((5, 1),)


def test_kernel_lowers_to_triton_in_place():
    """The kernel lowers for cuda through Pallas->Triton (does not run Triton's compiler), and a
    jit that donates the state hands that buffer to the new state (tf.aliasing_output)."""
    b, hk, hv, d = 2, 2, 4, 128
    q = jnp.zeros((b, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, hv, d), jnp.bfloat16)
    gate = jnp.zeros((b, hv), jnp.float32)
    state = jnp.zeros((b, hv, d, d), jnp.float32)
    fn = jax.jit(lambda *a: gdn_decode(*a, backend="pallas", interpret=False), donate_argnums=5)
    text = fn.trace(q, q, v, gate, gate, state).lower(lowering_platforms=("cuda",)).as_text()
    assert "bole_gdn_decode" in text and "output_operand_alias" in text
    assert "tf.aliasing_output = 1" in text  # outputs: o, state


@pytest.mark.parametrize("hk,hv", [(1, 2), (2, 2)])
def test_gdn_core_recurrent_kernel_path(hk, hv):
    """Through gdn_core_recurrent (conv + masking + rule), the forced Pallas path equals the jnp
    path, and a request with num_new == 0 keeps its state (and conv state) exactly."""
    cfg = ModelConfig.tiny(gdn_num_key_heads=hk, gdn_num_value_heads=hv)
    rng = np.random.default_rng(RUN_SEED)
    b, c, kk = 3, cfg.conv_dim, cfg.conv_kernel
    p = {"conv_w": jnp.asarray(rng.standard_normal((kk, c)) * 0.5, jnp.float32)}
    qkv = jnp.asarray(rng.standard_normal((b, 1, c)), jnp.float32)
    g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((b, 1, hv)))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, 1, hv)))), jnp.float32)
    cache = GDNCache(
        conv=jnp.asarray(rng.standard_normal((b, kk - 1, c)), jnp.float32),
        state=jnp.asarray(
            rng.standard_normal((b, hv, cfg.gdn_key_dim, cfg.gdn_value_dim)), jnp.float32
        ),
    )
    num_new = jnp.asarray([1, 0, 1], jnp.int32)
    o_ref, c_ref = layers.gdn_core_recurrent(
        p, qkv, g, beta, cache, num_new, cfg, backend="reference"
    )
    o, c_new = layers.gdn_core_recurrent(
        p, qkv, g, beta, cache, num_new, cfg, backend="pallas", interpret=True
    )
    assert rel(o, o_ref) <= 1e-5, (RUN_SEED, rel(o, o_ref))
    assert rel(c_new.state, c_ref.state) <= 1e-5, (RUN_SEED, rel(c_new.state, c_ref.state))
    np.testing.assert_array_equal(c_new.state[1], cache.state[1])
    np.testing.assert_array_equal(c_new.conv[1], cache.conv[1])
    assert not np.array_equal(c_new.state[0], cache.state[0])  # valid rows did update
