"""Simulated acceptance (SpecConfig.simulate_accept, benchmarks only): a chosen acceptance rate.

The tree (topk 2, depth 3, N 11) holds the drafter's whole candidate pool (2 + 2 * 2^2 = 10
drafts), so every step's tree reaches depth D = 3 and a step emits 1 + L tokens with
P(L = d) = p^d (1 - p) for d < D and P(L = D) = p^D: mean 1 + p + p^2 + p^3. The KV state after
each step must be that of a real acceptance of the emitted tokens: the bonus token of every greedy
request is the target's argmax after exactly the tokens emitted before it (checked against one
forward over prompt + output), while the accepted drafts are the random drafter's, which the
target mostly disagrees with.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import LLM, ModelConfig
from bole_jax.model import forward, init_cache, init_params
from bole_jax.model import logits as lm_logits
from bole_jax.spec_decode import budget
from bole_jax.spec_decode.acceptance import expected_tokens_per_step, synthetic_accept_prob
from bole_jax.spec_decode.step import SpecConfig

TREE = dict(topk=2, depth=3, num_nodes=11)
DEPTH = TREE["depth"]
PROMPT_LENS = (5, 17, 33, 9, 4, 8, 12, 20)
GREEDY = 4  # the first GREEDY requests are greedy, the others sample (temperature 0.8)
STEPS = 40
MAX_NEW = 256  # more than STEPS * (DEPTH + 1): no request finishes within the steps


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("qwen3_next", vocab_size=96, mtp_num_layers=1)  # no EOS
    params = init_params(cfg, jax.random.key(1), "float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    return cfg, params, prompts


def _run(model, mode: str, p: float, lazy: bool = False, steps: int = STEPS):
    """Step a batch one decode step at a time: (final state, [steps, B] num_out after each)."""
    cfg, params, prompts = model
    llm = LLM(cfg, params=params, spec_options=dict(TREE, simulate_accept=p, lazy_commit=lazy))
    b = len(prompts)
    assert llm._spec_config(mode, b).simulate_accept == p
    temps = [0.0] * GREEDY + [0.8] * (b - GREEDY)
    state = llm.start_batch(prompts, MAX_NEW, mode=mode, temperature=temps, spec_batch=b)
    seg = llm.segment_fn(mode, b)
    counts = []
    for _ in range(steps):
        state = seg(params, state, jnp.int32(1))
        counts.append(np.asarray(state.num_out))
    assert not np.asarray(state.done).any()
    np.testing.assert_array_equal(np.asarray(state.steps), steps)
    return state, np.stack(counts)


def _accepted_law(p: float, depth: int) -> np.ndarray:
    """P(tokens per step = 1 + d), d = 0..depth."""
    return np.array([p**d * (1 - p) for d in range(depth)] + [p**depth])


@functools.partial(jax.jit, static_argnums=1)
def _greedy_next(params, cfg, toks, lens):
    """The target's argmax after every position of toks [B, T] (one prefill forward)."""
    cache = init_cache(cfg, toks.shape[0], toks.shape[1], jnp.float32)
    hidden, _ = forward(params, cfg, toks, cache, lens)
    return jnp.argmax(lm_logits(params, cfg, hidden), -1)


@pytest.mark.parametrize("mode", ["bole", "bole-lazy", "pernode", "chain"])
def test_mean_tokens_per_step_and_commit(model, mode):
    cfg, params, prompts = model
    lazy = mode == "bole-lazy"
    mode = "bole" if lazy else mode
    p = 0.6
    state, counts = _run(model, mode, p, lazy)
    per_step = np.diff(np.concatenate([np.ones((1, len(prompts)), int), counts]), axis=0)
    # Each step of each request emits 1 + L tokens, L independent across requests and steps.
    law = _accepted_law(p, DEPTH)
    assert set(np.unique(per_step)) <= set(range(1, DEPTH + 2))
    mean = float(per_step.mean())
    want = expected_tokens_per_step(p, DEPTH)
    assert abs(float(law @ np.arange(1, DEPTH + 2)) - want) < 1e-12
    # Tolerance: 5 standard errors of the mean of n = B * STEPS independent draws (sd 1.17 here,
    # so about +-0.33 around 2.18); a correct implementation misses it with probability < 1e-6.
    sd = float(np.sqrt(law @ (np.arange(1, DEPTH + 2) - want) ** 2))
    assert abs(mean - want) < 5 * sd / np.sqrt(per_step.size), (mean, want)
    # The greedy requests' bonus tokens (the last token of each step's run) are the target's own
    # next tokens after everything emitted before them: the commit of the accepted paths is exact.
    out = np.asarray(state.out)
    n_out = counts[-1]
    width = max(len(prompts[i]) + n_out[i] for i in range(GREEDY))
    toks = np.zeros((GREEDY, width), np.int32)
    for i in range(GREEDY):
        seq = prompts[i] + out[i, : n_out[i]].tolist()
        toks[i, : len(seq)] = seq
    lens = np.array([len(prompts[i]) + n_out[i] for i in range(GREEDY)], np.int32)
    target = np.asarray(_greedy_next(params, cfg, jnp.asarray(toks), jnp.asarray(lens)))
    disagree = 0
    for i in range(GREEDY):
        bonus = {0} | {int(c) - 1 for c in counts[:, i]}  # out index of each step's bonus
        for j in range(n_out[i]):
            at = len(prompts[i]) + j  # out[i, j]'s position: predicted at position at - 1
            if j in bonus:
                assert target[i, at - 1] == out[i, j], (i, j)
            else:
                disagree += int(target[i, at - 1] != out[i, j])
    # A lossless acceptance would only emit the target's tokens: here the drafts were forced.
    assert disagree > 0


@pytest.mark.parametrize("p, tokens", [(1.0, DEPTH + 1), (0.0, 1)])
def test_extreme_probabilities(model, p, tokens):
    """p = 1: the whole depth-D path and the bonus every step; p = 0: the bonus alone."""
    _, counts = _run(model, "bole", p, steps=6)
    np.testing.assert_array_equal(counts[-1], 1 + 6 * tokens)


def test_spec_config_checks_and_mean_option(model):
    cfg, params, _ = model
    with pytest.raises(ValueError, match="probability"):
        SpecConfig(simulate_accept=1.5)
    with pytest.raises(ValueError, match="exclude"):
        SpecConfig(simulate_accept=0.5, synthetic_accept=0.5)
    assert SpecConfig().simulate_accept is None
    llm = LLM(cfg, params=params, spec_options=dict(TREE, simulate_accept_mean=2.5))
    for mode in ("bole", "chain"):
        spec = llm._spec_config(mode, 4)
        assert spec.simulate_accept == pytest.approx(synthetic_accept_prob(2.5, DEPTH))
        assert expected_tokens_per_step(spec.simulate_accept, DEPTH) == pytest.approx(2.5)
    # Calibration tables: those of the synthetic drafter at the same p (the same acceptance).
    p = synthetic_accept_prob(2.5, DEPTH)
    assert budget.llm_identity(llm)["drafter"] == f"synthetic p={p:.4f}"
    assert budget.llm_identity(LLM(cfg, params=params))["drafter"] == "mtp"
    bad = LLM(cfg, params=params, spec_options=dict(TREE, simulate_accept_mean=DEPTH + 1.5))
    with pytest.raises(ValueError, match="mean tokens per step"):
        bad._spec_config("bole", 4)
