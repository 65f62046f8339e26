"""Sampling: the target distribution (temperature, top-k, then top-p on the top-k-renormalised
distribution) and per-row random streams independent of the batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.sampling import SamplingParams, row_keys, sample, target_probs, uniform


def _probs(p, top_k=0, top_p=1.0):
    logits = jnp.log(jnp.asarray([p], jnp.float32))
    return np.asarray(target_probs(logits, SamplingParams.make(1, 1.0, top_p, top_k)))[0]


def test_top_p_on_top_k_renormalised():
    """As transformers' TopK then TopP warpers and vLLM: top-k renormalises first, top-p measures
    its mass on that (the full-softmax mass would keep two tokens: [0.571, 0.429, 0, 0])."""
    np.testing.assert_allclose(_probs([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5), [1, 0, 0, 0])
    np.testing.assert_allclose(
        _probs([0.4, 0.3, 0.2, 0.1], top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0], rtol=1e-6
    )
    np.testing.assert_allclose(
        _probs([0.4, 0.3, 0.2, 0.1], top_k=2), [4 / 7, 3 / 7, 0, 0], rtol=1e-6
    )
    np.testing.assert_allclose(
        _probs([0.4, 0.3, 0.2, 0.1], top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0], rtol=1e-6
    )
    np.testing.assert_allclose(_probs([0.4, 0.3, 0.2, 0.1]), [0.4, 0.3, 0.2, 0.1], rtol=1e-6)


def test_top_p_matches_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 2
    for top_k, top_p in ((5, 0.6), (10, 0.9), (3, 0.3), (0, 0.8), (7, 1.0)):
        scores = torch.from_numpy(logits.copy())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        want = torch.softmax(scores, -1).numpy()
        got = np.asarray(
            target_probs(jnp.asarray(logits), SamplingParams.make(6, 1.0, top_p, top_k))
        )
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"top_k={top_k} top_p={top_p}")


def test_row_streams_do_not_depend_on_the_batch():
    """A row's draw depends on (key, stream) only: the same stream gives the same sample alone, in
    another row, or next to other rows; rows without a stream (-1) use their row index."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(5, 50)), jnp.float32)
    key = jax.random.key(3)
    sp = SamplingParams.make(5, 1.0, stream=jnp.arange(10, 15))
    together = np.asarray(sample(logits, sp, key))
    for i in range(5):
        alone = sample(logits[i : i + 1], SamplingParams.make(1, 1.0, stream=10 + i), key)
        assert int(alone[0]) == together[i]
    perm = np.array([3, 0, 4, 1, 2])
    shuffled = sample(
        logits[perm], SamplingParams.make(5, 1.0, stream=jnp.arange(10, 15)[perm]), key
    )
    np.testing.assert_array_equal(np.asarray(shuffled), together[perm])
    u = np.asarray(uniform(key, sp, (5, 3)))
    np.testing.assert_array_equal(
        np.asarray(uniform(key, SamplingParams.make(1, 1.0, stream=12), (1, 3)))[0], u[2]
    )
    assert len({tuple(r) for r in u}) == 5  # distinct streams draw differently
    default = row_keys(key, SamplingParams.make(3, 1.0))
    explicit = row_keys(key, SamplingParams.make(3, 1.0, stream=jnp.arange(3)))
    np.testing.assert_array_equal(jax.random.key_data(default), jax.random.key_data(explicit))


def test_row_samples_follow_the_target_distribution():
    """Per-row keys still sample the target: 20000 draws of one row vs its probabilities."""
    p = np.array([0.5, 0.25, 0.15, 0.1])
    logits = jnp.log(jnp.asarray(np.tile(p, (1, 1)), jnp.float32))
    draw = jax.jit(jax.vmap(lambda k: sample(logits, SamplingParams.make(1, 1.0, stream=4), k)[0]))
    toks = np.asarray(draw(jax.random.split(jax.random.key(0), 20000)))
    freq = np.bincount(toks, minlength=4) / len(toks)
    np.testing.assert_allclose(freq, p, atol=0.015)


def _prims(f, *args) -> set[str]:
    return {e.primitive.name for e in jax.make_jaxpr(f)(*args).eqns}


def test_static_greedy_flag_is_set_only_for_concrete_zero_temperatures():
    assert SamplingParams.make(3).greedy
    assert SamplingParams.make(3, [0.0, 0.0, 0.0]).greedy
    assert not SamplingParams.make(3, [0.0, 0.7, 0.0]).greedy
    assert not SamplingParams.make(3, 0.0, static_greedy=False).greedy
    assert not SamplingParams.make(3, 0.0).mixed().greedy
    seen = []
    jax.jit(lambda t: seen.append(SamplingParams.make(3, t).greedy) or t)(jnp.float32(0.0))
    assert seen == [False]
    # static: part of the pytree structure, so a jitted program is specialised on it
    a, b = SamplingParams.make(2), SamplingParams.make(2).mixed()
    assert jax.tree.structure(a) != jax.tree.structure(b)
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(b)) == 4


def test_static_greedy_sample_has_no_cond_and_the_same_tokens():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
    key = jax.random.key(0)
    sp = SamplingParams.make(4)
    assert "cond" not in _prims(sample, logits, sp, key)
    assert "cond" in _prims(sample, logits, sp.mixed(), key)
    np.testing.assert_array_equal(sample(logits, sp, key), sample(logits, sp.mixed(), key))
    np.testing.assert_array_equal(sample(logits, sp, key), np.argmax(logits, -1))
