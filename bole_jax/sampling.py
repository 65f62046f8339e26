"""Token sampling shared by autoregressive decoding and speculative acceptance.

Sampling parameters are per-request *arrays* (not Python scalars) so that one compiled program
serves any mix of greedy and stochastic requests in a batch:

  temperature [B] f32  (0 = greedy)
  top_p       [B] f32  (1 = off)
  top_k       [B] i32  (0 = off)
  stream      [B] i32  (the request's random stream; -1 = its row in the batch)

`target_probs` is the single definition of "the distribution the model samples from"; the
stochastic tree acceptance uses the same function, which is what makes it lossless.

A batch known on the host to be all greedy is marked by the static field `greedy` (pytree
metadata, so a jitted program is specialised on it): `sample` and the acceptance then take the
argmax path with no `lax.cond`, whose predicate XLA reads back to the host on every decode step
(docs/design-decisions.md, "A static greedy program"). `SamplingParams.make` sets it when every
temperature is a concrete 0; traced values and mixed batches keep `greedy=False`, whose program
serves any mix of greedy and stochastic rows.

Random draws are per row: row b draws with fold_in(step key, stream[b]) (`row_keys`), so a
request's samples depend on the step key and its stream only, not on which other requests share
its batch or on its row. `LLM.generate` gives each prompt its index in the call as its stream and
starts every batch from key(seed), hence the same output for a seed whatever max_batch_size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (arrays of shape [B])."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_p: jax.Array  # [B] f32 in (0, 1]
    top_k: jax.Array  # [B] i32, 0 = no limit
    stream: jax.Array  # [B] i32, the request's random stream (-1: its row index)
    # Static: every row is greedy (temperature 0), known on the host. True compiles the argmax
    # path only; it must never be set on a batch with a temperature above 0 (`make` sets it).
    greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def make(
        batch: int, temperature=0.0, top_p=1.0, top_k=0, stream=-1, *, static_greedy: bool = True
    ) -> "SamplingParams":
        """Broadcast scalars (or per-request sequences) to [batch] arrays. `greedy` is set where
        every temperature is a concrete value <= 0 and `static_greedy` is on (off: a program that
        serves any mix, e.g. a server's running batch whose requests come and go)."""
        temp, top_p, top_k, stream = (
            _per_row(x, d, batch)
            for x, d in (
                (temperature, jnp.float32),
                (top_p, jnp.float32),
                (top_k, jnp.int32),
                (stream, jnp.int32),
            )
        )
        greedy = static_greedy and _all_greedy(temperature)
        return SamplingParams(temp, top_p, top_k, stream, greedy=greedy)

    def mixed(self) -> "SamplingParams":
        """The same arrays, for the program that serves any mix of greedy and stochastic rows."""
        return dataclasses.replace(self, greedy=False)


def _all_greedy(temperature) -> bool:
    """Every temperature <= 0, decided on the host (False for traced values)."""
    if _traced(temperature):
        return False
    return bool(np.all(np.asarray(temperature, np.float32) <= 0.0))


def _traced(x) -> bool:
    """x, or an element of a list / tuple x, is a tracer (its value is not known on the host)."""
    return any(isinstance(v, jax.core.Tracer) for v in (x if isinstance(x, (list, tuple)) else [x]))


def _per_row(x, dtype, batch: int) -> jax.Array:
    """x broadcast to [batch]: on the host for concrete values (an eager jnp broadcast compiles a
    program per shape), traced otherwise."""
    if _traced(x):
        return jnp.broadcast_to(jnp.asarray(x, dtype), (batch,))
    return jax.device_put(np.array(np.broadcast_to(np.asarray(x, dtype), (batch,))))


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
    # top-p on the top-k-renormalised distribution (as transformers' and vLLM's samplers): keep the
    # smallest prefix whose mass reaches top_p (the token crossing it is kept).
    in_k = jnp.where(keep, sorted_probs, 0.0)
    in_k = in_k / jnp.sum(in_k, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(in_k, axis=-1) - in_k
    keep &= mass_before < expand(sp.top_p)
    kept = jnp.where(keep, sorted_probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    probs = jnp.zeros_like(kept)
    probs = jnp.put_along_axis(probs, order, kept, axis=-1, inplace=False)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


def greedy_or_sampled(sp: SamplingParams, greedy, sampled):
    """greedy() where the whole batch is greedy, else sampled(): statically for a batch marked
    greedy on the host (`sp.greedy`: no `lax.cond`), else under a `lax.cond` on the temperatures
    (one program for any mix). Shared by `sample` and the acceptance."""
    if sp.greedy:
        return greedy()
    return jax.lax.cond(jnp.all(sp.temperature <= 0.0), greedy, sampled)


def sample(logits: jax.Array, sp: SamplingParams, key: jax.Array) -> jax.Array:
    """Sample one token per row of logits [B, V] -> [B] int32.

    All-greedy batches skip the sort entirely (argmax only: `greedy_or_sampled`).
    """
    return greedy_or_sampled(
        sp,
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: sample_from_probs(target_probs(logits, sp), key, sp),
    )


def row_keys(key: jax.Array, sp: SamplingParams) -> jax.Array:
    """One key per row [B]: fold_in(key, stream), the row index where stream is -1."""
    rows = jnp.arange(sp.stream.shape[0], dtype=jnp.int32)
    stream = jnp.where(sp.stream >= 0, sp.stream, rows)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, stream)


def sample_from_probs(
    probs: jax.Array, key: jax.Array, sp: SamplingParams | None = None
) -> jax.Array:
    """Categorical sample from probabilities [B, V] -> [B] int32 (rows need not be normalised).

    With `sp`, row b draws with its own key (`row_keys`); without, one draw over the batch."""
    logp = jnp.log(jnp.maximum(probs, 0.0))
    if sp is None:
        return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    draw = lambda k, lp: jax.random.categorical(k, lp, axis=-1)
    return jax.vmap(draw)(row_keys(key, sp), logp).astype(jnp.int32)


def uniform(key: jax.Array, sp: SamplingParams, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) f32 of shape [B, ...] (B = shape[0]), row b from its own key (`row_keys`)."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(row_keys(key, sp))
