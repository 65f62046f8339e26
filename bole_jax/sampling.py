"""Token sampling shared by autoregressive decoding and speculative acceptance.

Sampling parameters are per-request *arrays* (not Python scalars) so that one compiled program
serves any mix of greedy and stochastic requests in a batch:

  temperature [B] f32  (0 = greedy)
  top_p       [B] f32  (1 = off)
  top_k       [B] i32  (0 = off)

`target_probs` is the single definition of "the distribution the model samples from"; the
stochastic tree acceptance uses the same function, which is what makes it lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling parameters (arrays of shape [B])."""

  temperature: jax.Array  # [B] f32, 0 = greedy
  top_p: jax.Array  # [B] f32 in (0, 1]
  top_k: jax.Array  # [B] i32, 0 = no limit

  @staticmethod
  def make(batch: int, temperature=0.0, top_p=1.0, top_k=0) -> "SamplingParams":
    """Broadcast scalars (or per-request sequences) to [batch] arrays, validating them."""
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,))
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,))
    return SamplingParams(t, p, k)


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
  """Raise ValueError for parameters a user can get wrong (checked on the host)."""
  if not (temperature >= 0.0):
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  if not (0.0 < top_p <= 1.0):
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if int(top_k) != top_k or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")


def target_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """The distribution each request samples from, after temperature, top-k and top-p.

  logits: [B, ..., V] (any float dtype). Returns f32 probabilities of the same shape. Greedy rows
  (temperature 0) get a one-hot on the argmax, so acceptance maths treats them uniformly.
  """
  logits = logits.astype(jnp.float32)
  extra = logits.ndim - 2
  expand = lambda x: x.reshape(x.shape + (1,) * (extra + 1))
  temp = expand(sp.temperature)
  greedy = temp <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, temp)
  # Rank of each token in descending order: computed via a sort of the scaled logits.
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  rank = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
  k = expand(sp.top_k)
  keep = (k <= 0) | (rank < k)
  # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep &= mass_before < expand(sp.top_p)
  kept = jnp.where(keep, sorted_probs, 0.0)
  kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
  probs = jnp.zeros_like(kept)
  probs = jnp.put_along_axis(probs, order, kept, axis=-1, inplace=False)
  onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jnp.where(greedy, onehot, probs)


def sample(logits: jax.Array, sp: SamplingParams, key: jax.Array) -> jax.Array:
  """Sample one token per row of logits [B, V] -> [B] int32.

  All-greedy batches skip the sort entirely (argmax only).
  """
  def _greedy(_):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def _stochastic(_):
    probs = target_probs(logits, sp)
    return sample_from_probs(probs, key)

  return jax.lax.cond(jnp.all(sp.temperature <= 0.0), _greedy, _stochastic, None)


def sample_from_probs(probs: jax.Array, key: jax.Array) -> jax.Array:
  """Categorical sample from probabilities [B, V] -> [B] int32 (rows need not be normalised)."""
  logp = jnp.log(jnp.maximum(probs, 0.0))
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
