"""The jitted generation loop: prefill, then a `lax.while_loop` over decode steps.

Every decoding mode (autoregressive, chain, tree) plugs a *step function* into the same loop:

  step(params, state) -> state

where `state` is a `DecodeState`. The loop runs in segments of at most `segment` steps so that the
host can report progress and check stop strings between segments without recompiling; the state
(including the cache) is donated, so segments update it in place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from bole_jax.model import Cache, ModelConfig, forward, parallel
from bole_jax.model import logits as lm_logits
from bole_jax.sampling import SamplingParams, sample
from bole_jax.spec_decode.drafter import mtp_prefill


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything a decode step reads and writes (a pytree; every field is an array).

    cache:      the target model's cache (committed tokens only).
    out:        [B, L] int32 generated tokens, -1 beyond num_out.
    num_out:    [B] int32 number of generated tokens (the first comes from prefill).
    next_token: [B] int32 the last generated token, not yet in the cache (the next step's input).
    done:       [B] bool request finished (EOS, length, stop string, or a padding row).
    max_out:    [B] int32 per-request max_new_tokens.
    steps:      [B] int32 decode steps during which the request was active.
    sampling:   per-request SamplingParams.
    key:        PRNG key, split once per step.
    eos:        [E] int32 EOS token ids (-1 padded).
    extra:      mode-specific pytree (drafter cache, last hidden, acceptance stats), or None.
    logprobs:   `Logprobs` written next to `out` by `emit`, or None (not recorded: the steps
                then compute nothing for them).
    """

    cache: Cache
    out: jax.Array
    num_out: jax.Array
    next_token: jax.Array
    done: jax.Array
    max_out: jax.Array
    steps: jax.Array
    sampling: SamplingParams
    key: jax.Array
    eos: jax.Array
    extra: Any = None
    logprobs: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Logprobs:
    """Target log-probabilities of the generated tokens: log_softmax of the target model's logits
    at the position that produced each token (before temperature, top-k and top-p), in every mode
    (speculative ones: of the accepted tokens and the bonus, at their tree nodes).

    logp:     [B, L] float32, of the token out[b, i].
    top_ids:  [B, L, K] int32, the K most likely tokens at that position (K may be 0).
    top_logp: [B, L, K] float32, their log-probabilities.
    """

    logp: jax.Array
    top_ids: jax.Array
    top_logp: jax.Array

    @classmethod
    def zeros(cls, b: int, length: int, k: int) -> "Logprobs":
        return cls(
            jnp.zeros((b, length), jnp.float32),
            jnp.zeros((b, length, k), jnp.int32),
            jnp.zeros((b, length, k), jnp.float32),
        )


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    """logits [..., V], tokens [...] -> (logp [...], top_ids [..., k], top_logp [..., k])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if k == 0:
        shape = tokens.shape + (0,)
        return logp, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    top_logp, top_ids = jax.lax.top_k(lp, k)
    return logp, top_ids.astype(jnp.int32), top_logp


def is_eos(tokens: jax.Array, eos: jax.Array) -> jax.Array:
    """tokens [...] int32 -> bool, True where the token is one of the EOS ids."""
    return jnp.any(tokens[..., None] == eos, axis=-1)


def emit(
    state: DecodeState, tokens: jax.Array, count: jax.Array, logits: jax.Array | None = None
) -> DecodeState:
    """Append up to `count[b]` tokens of `tokens [B, M]` to each active request's output.

    Honours EOS inside the run (tokens after the first EOS are not emitted) and max_out. Returns the
    state with out, num_out, next_token and done updated. `logits [B, M, V]`: the target logits
    each token was drawn from; with `state.logprobs`, their log-probabilities are recorded too.
    """
    b, m = tokens.shape
    idx = jnp.arange(m, dtype=jnp.int32)
    room = state.max_out - state.num_out
    count = jnp.where(state.done, 0, jnp.minimum(count, room))
    eos_hit = is_eos(tokens, state.eos) & (idx[None, :] < count[:, None])
    first_eos = jnp.where(jnp.any(eos_hit, axis=1), jnp.argmax(eos_hit, axis=1) + 1, m + 1)
    count = jnp.minimum(count, first_eos)
    pos = state.num_out[:, None] + idx[None, :]
    valid = idx[None, :] < count[:, None]
    pos = jnp.where(valid, pos, state.out.shape[1])  # out of bounds -> dropped
    rows = jnp.arange(b)[:, None]
    out = state.out.at[rows, pos].set(tokens, mode="drop")
    lps = state.logprobs
    if lps is not None and logits is not None:
        logp, top_ids, top_logp = token_logprobs(logits, tokens, lps.top_ids.shape[-1])
        lps = Logprobs(
            lps.logp.at[rows, pos].set(logp, mode="drop"),
            lps.top_ids.at[rows, pos].set(top_ids, mode="drop"),
            lps.top_logp.at[rows, pos].set(top_logp, mode="drop"),
        )
    num_out = state.num_out + count
    last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    next_token = jnp.where(count > 0, last, state.next_token)
    done = state.done | (first_eos <= count) | (num_out >= state.max_out)
    return dataclasses.replace(
        state, out=out, num_out=num_out, next_token=next_token, done=done, logprobs=lps
    )


def ar_step(params, state: DecodeState, *, cfg: ModelConfig) -> DecodeState:
    """One autoregressive step: feed next_token, sample one token, append it. Under the named
    scope "stage_ar" (step.STAGE_SCOPE: the in-loop profile's stage)."""
    with jax.named_scope("stage_ar"):
        key, sub = jax.random.split(state.key)
        num_new = jnp.where(state.done, 0, 1).astype(jnp.int32)
        hidden, cache = forward(params, cfg, state.next_token[:, None], state.cache, num_new)
        logits = lm_logits(params, cfg, hidden[:, 0])
        tok = sample(logits, state.sampling, sub)
        state = dataclasses.replace(
            state, cache=cache, key=key, steps=state.steps + (~state.done).astype(jnp.int32)
        )
        return emit(
            state,
            tok[:, None],
            jnp.ones_like(state.num_out),
            None if state.logprobs is None else logits[:, None],
        )


def run_segment(
    params, state: DecodeState, max_steps: jax.Array, *, step_fn: Callable
) -> DecodeState:
    """Run `step_fn` until every request is done or `max_steps` steps were taken."""

    def cond(carry):
        i, s = carry
        return (i < max_steps) & ~jnp.all(s.done)

    def body(carry):
        i, s = carry
        return i + 1, step_fn(params, s)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache", "draft_kv"))
def prefill_chunk(
    params,
    cache: Cache,
    tokens: jax.Array,
    num_new: jax.Array,
    h_before=None,
    draft_kv=None,
    *,
    cfg: ModelConfig,
):
    """Append one right-padded chunk of prompt tokens [B, T] to the cache.

    Returns the hidden state of each request's last new token [B, H] (h_before where
    num_new == 0), the cache, and, when the MTP cache `draft_kv` is given, the MTP cache with this
    chunk's entries (the MTP entry of position p needs the hidden of p-1: `h_before` carries the
    previous chunk's last hidden state).
    """
    start = cache.lengths
    hidden, cache = forward(params, cfg, tokens, cache, num_new)
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if h_before is None:
        h_before = jnp.zeros_like(h_last)
    if draft_kv is not None:
        draft_kv = mtp_prefill(params, cfg, draft_kv, tokens, hidden, h_before, start, num_new)
    h_last = jnp.where((num_new > 0)[:, None], h_last, h_before)
    # Tensor parallelism: return the caches in their placement so that donation reuses them.
    return h_last, parallel.constrain(cache, cfg), parallel.constrain(draft_kv, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def first_token(params, h_last, sampling: SamplingParams, key, *, cfg: ModelConfig):
    """Sample the first generated token from the prompt's last hidden state [B, H]."""
    return sample(lm_logits(params, cfg, h_last), sampling, key)
