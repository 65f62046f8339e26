"""The split-S attention kernel (pallas/attention.py) against the plain-jnp attention
(`attend_reference`, beside it).

CPU: the kernel runs in Pallas interpret mode on fresh random inputs (seed in failure messages)
plus a fixed seed, with tree-shaped masks (a committed prefix plus ancestor sets), ragged
lengths, several splits with an empty last split, and bf16; a lowering test builds the Triton IR
for the GPU. Through the model, the kernel's greedy tokens equal the reference's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax import LLM, ModelConfig
from bole_jax.model import forward, init_cache, init_params
from bole_jax.pallas.attention import MAX_ROWS, attend_reference, attend_split_s, split_count
from bole_jax.pallas.options import KernelOptions
from bole_jax.pallas.testing import random_attention_inputs

jax.config.update("jax_default_matmul_precision", "highest")

SEEDS = [0, RUN_SEED]


def _inputs(seed, b, t, hq, hkv, s, d, dtype=jnp.float32):
    # Ragged committed lengths, the shortest (0) and the longest (S - T) included.
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, s - t + 1, b)
    lens[0], lens[-1] = 0, s - t
    return random_attention_inputs(rng, lens, t, hq, hkv, s, d, dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "b,t,hq,hkv,s,d,block_s,splits",
    [
        (2, 1, 4, 1, 64, 32, 16, None),  # AR decode: one query, G = 4
        (3, 5, 4, 2, 128, 32, 16, 3),  # 8 tiles in 3 splits (the last split has 2)
        (2, 16, 2, 2, 96, 64, 32, 4),  # 3 tiles in 4 splits: one split empty
        (1, 9, 8, 2, 256, 16, 64, 1),  # one split over every tile; M = 36 padded to 64
    ],
)
def test_kernel_matches_reference(seed, b, t, hq, hkv, s, d, block_s, splits):
    q, k, v, mask = _inputs(seed, b, t, hq, hkv, s, d)
    want = attend_reference(q, k, v, mask)
    got = attend_split_s(
        q, k, v, mask, backend="pallas", interpret=True, block_s=block_s, splits=splits
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(jnp.max(jnp.abs(got - want)))
    assert err < 2e-6, (seed, err)


@pytest.mark.parametrize("seed", SEEDS)
def test_kernel_matches_reference_in_bf16(seed):
    q, k, v, mask = _inputs(seed, 2, 8, 4, 2, 128, 64, jnp.bfloat16)
    want = attend_reference(q, k, v, mask).astype(jnp.float32)
    f32 = attend_reference(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    got = attend_split_s(q, k, v, mask, backend="pallas", interpret=True, block_s=32)
    assert got.dtype == jnp.bfloat16
    # Both round the probabilities to bf16 before the PV dot (the kernel unnormalised): each
    # within bf16 rounding of the fp32 attention, and of each other.
    assert _rel(got, f32) < 1e-2 and _rel(want, f32) < 1e-2, (seed, _rel(got, f32))
    assert _rel(got, want) < 1e-2, (seed, _rel(got, want))


def test_unaligned_slots_wide_queries_and_bad_block_fall_back_or_fail():
    q, k, v, mask = _inputs(1, 1, 2, 2, 1, 40, 16)  # 40 slots: not a multiple of 16
    got = attend_split_s(q, k, v, mask, backend="pallas", interpret=True, block_s=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend_reference(q, k, v, mask)))
    q, k, v, mask = _inputs(2, 1, 20, 8, 2, 64, 16)  # 80 query rows per KV head > MAX_ROWS
    assert 20 * 4 > MAX_ROWS
    got = attend_split_s(q, k, v, mask, backend="pallas", interpret=True, block_s=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend_reference(q, k, v, mask)))
    with pytest.raises(ValueError, match="block_s"):
        attend_split_s(q, k, v, mask, backend="pallas", block_s=24)


def test_split_count():
    assert split_count(32, 4, 257) == 5  # 128 programs -> 5 splits of 52 tiles
    assert split_count(1, 4, 3) == 3  # never more splits than tiles
    assert split_count(256, 8, 100) == 1


def test_kernel_lowers_to_triton():
    """The kernel lowers for cuda through Pallas -> Triton (Triton's compiler does not run)."""
    q = jnp.zeros((4, 16, 16, 256), jnp.bfloat16)
    kv = jnp.zeros((4, 4, 1024, 256), jnp.bfloat16)
    mask = jnp.ones((4, 16, 1024), bool)
    fn = jax.jit(lambda *a: attend_split_s(*a, backend="pallas", interpret=False))
    text = fn.trace(q, kv, kv, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert "bole_attend_split_s" in text


def test_model_hidden_states_with_the_kernel():
    """A tiny fp32 model's forward (prefill of ragged prompts in two chunks, then one decode
    token) with attention_backend="pallas" (interpret mode) gives the reference's hidden states."""
    import dataclasses

    base = ModelConfig.tiny("qwen3_next", vocab_size=96)
    params = init_params(base, jax.random.key(4), "float32")
    rng = np.random.default_rng(5)
    toks = jnp.asarray(rng.integers(1, base.vocab_size, (3, 24)), jnp.int32)
    lens = jnp.asarray([24, 9, 17], jnp.int32)
    outs = []
    for backend in ("reference", "pallas"):
        cfg = dataclasses.replace(base, kernels=KernelOptions(attention_backend=backend))
        cache = init_cache(cfg, 3, 64, jnp.float32)
        a, cache = forward(params, cfg, toks[:, :16], cache, jnp.minimum(lens, 16))
        b, cache = forward(params, cfg, toks[:, 16:], cache, jnp.maximum(lens - 16, 0))
        c, _ = forward(params, cfg, toks[:, :1], cache)
        outs.append([np.asarray(x) for x in (a, b, c)])
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_model_with_the_kernel_gives_the_same_tokens(mode):
    """A tiny fp32 model (target attention and MTP head) with attention_backend="pallas"
    (interpret mode) generates the reference backend's greedy tokens."""
    base = ModelConfig.tiny("qwen3_next", vocab_size=96, mtp_num_layers=1)
    params = init_params(base, jax.random.key(2), "float32")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, base.vocab_size, n).tolist() for n in (7, 19)]
    outs = []
    for backend in ("reference", "pallas"):
        kernels = KernelOptions(attention_backend=backend)
        llm = LLM(
            base,
            params=params,
            kernel_options=kernels,
            spec_options=dict(num_nodes=6, topk=3, depth=4),
        )
        res = llm.generate(prompts, max_new_tokens=12, spec=None if mode == "ar" else mode)
        outs.append([r.token_ids for r in res])
    assert outs[0] == outs[1]
