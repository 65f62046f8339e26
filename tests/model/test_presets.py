"""Random-weight presets: published dims, and the benchmark lm_head initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.model import ModelConfig, init_params
from bole_jax.model import logits as lm_logits
from bole_jax.model.presets import PRESETS, peaked_lm_head, preset


def test_peaked_lm_head_matches_tied_logits():
    untied = ModelConfig.tiny("qwen3_5", tie_word_embeddings=False)
    params = init_params(untied, jax.random.key(1), "float32")
    peaked = peaked_lm_head(params, untied)
    assert peaked["lm_head"].shape == params["lm_head"].shape
    h = jax.random.normal(jax.random.key(2), (3, untied.hidden_size))
    tied_logits = h @ params["embed"].T
    np.testing.assert_allclose(
        np.asarray(lm_logits(peaked, untied, h)), np.asarray(tied_logits), rtol=1e-5, atol=1e-5
    )
    tied = ModelConfig.tiny("qwen3_5", tie_word_embeddings=True)
    tparams = init_params(tied, jax.random.key(1), "float32")
    assert peaked_lm_head(tparams, tied) is tparams  # nothing to do for tied models


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name):
    cfg = preset(name, mtp=True)
    assert cfg.vocab_size == PRESETS[name]["vocab_size"] and cfg.mtp_num_layers == 1
    assert jnp.dtype(cfg.dtype) == jnp.bfloat16
