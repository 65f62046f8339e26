"""The drafter's top-k of log-softmax: the Pallas kernel (interpret mode off the GPU) against the
plain-jnp reference and `lax.top_k` of `log_softmax`, on fresh random rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.pallas import top_k


def _rows(rng, shape, ties):
    z = (rng.standard_normal(shape) * 4).astype(np.float32)
    if ties:  # many exact ties, among the winners too
        z = np.round(z)
    z[..., rng.integers(shape[-1])] = 30.0  # one clear winner somewhere in each row
    return jnp.asarray(z)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "shape,k",
    [((1, 4, 8192), 4), ((16, 4, 8192), 4), ((3, 1000), 7), ((2, 5, 64), 1), ((5, 300), 16)],
)
def test_kernel_is_the_reference(shape, k, ties):
    """Same ids in the same order (ties to the lower index) as the reference and as
    lax.top_k(log_softmax); log q within an ulp of lse of the reference's, and <= 0."""
    z = _rows(np.random.default_rng(), shape, ties)
    lq, ids = top_k.top_k_log_softmax(z, k, backend="pallas")
    rq, rids = top_k.top_k_log_softmax_ref(z, k)
    wq, wids = jax.lax.top_k(jax.nn.log_softmax(z, axis=-1), k)
    assert lq.shape == ids.shape == (*shape[:-1], k)
    assert lq.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_array_equal(ids, wids)
    np.testing.assert_allclose(lq, rq, rtol=0, atol=2e-6 * max(1.0, float(jnp.abs(rq).max())))
    np.testing.assert_allclose(lq, wq, rtol=0, atol=1e-4)
    assert float(lq.max()) <= 0.0


def test_bf16_rows_and_backend_choice():
    """bf16 logits are read as fp32; "auto" off the GPU is the reference; rows or k the kernel
    does not take are an error for "pallas" and the reference for "auto"."""
    z = _rows(np.random.default_rng(), (3, 4096), False).astype(jnp.bfloat16)
    lq, ids = top_k.top_k_log_softmax(z, 5, backend="pallas")
    rq, rids = top_k.top_k_log_softmax_ref(z, 5)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(lq, rq, atol=2e-5)
    long = jnp.zeros((2, top_k.FUSED_MAX_V * 2), jnp.float32).at[:, 7].set(1.0)
    with pytest.raises(ValueError, match="at most"):
        top_k.top_k_log_softmax(long, 4, backend="pallas")
    with pytest.raises(ValueError, match="k = 17"):
        top_k.top_k_log_softmax(z, 17, backend="pallas")
    with pytest.raises(ValueError, match=r"must lie in \[1, 4096\]"):
        top_k.top_k_log_softmax(z, 0)
    lq, ids = top_k.top_k_log_softmax(long, 4)  # auto: the chunked reference
    assert int(ids[0, 0]) == 7
    if jax.default_backend() != "gpu":
        got = jax.make_jaxpr(lambda x: top_k.top_k_log_softmax(x, 4))(z)
        assert "pallas_call" not in str(got)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "shape,k,chunk", [((4, 4096), 4, 256), ((2, 3, 2048), 5, 128), ((3, 1000), 4, 256)]
)
def test_chunked_top_k_is_top_k(shape, k, chunk, ties):
    """The two-round top-k gives lax.top_k's values and indices, in its order (ties to the lower
    index), on fresh random rows (with many exact ties), and the plain top-k where the row is no
    whole number of chunks (1000)."""
    rng = np.random.default_rng()
    z = rng.standard_normal(shape).astype(np.float32)
    if ties:
        z = np.round(z * 2) / 2
    z[..., rng.integers(shape[-1])] = 9.0  # one winner in a random chunk
    want = jax.lax.top_k(jnp.asarray(z), k)
    got = jax.jit(top_k.chunked_top_k, static_argnums=(1, 2))(jnp.asarray(z), k, chunk)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("shape,k", [((1, 4, 8192), 4), ((64, 1000), 8)])
def test_kernel_lowers_to_triton(shape, k):
    """The kernel lowers for cuda through Pallas -> Triton (Triton's compiler does not run)."""
    z = jnp.zeros(shape, jnp.float32)
    fn = jax.jit(lambda x: top_k.top_k_log_softmax(x, k, backend="pallas", interpret=False))
    text = fn.trace(z).lower(lowering_platforms=("cuda",)).as_text()
    assert "bole_top_k_log_softmax" in text
