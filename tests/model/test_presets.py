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


def test_weights_that_cannot_fit_the_device_fail_with_a_clear_error(monkeypatch, capsys):
    """Random weights larger than what the device has available raise `WeightsDoNotFit` (a
    ValueError the CLI prints) before anything is allocated: `bole-jax bench` at its default
    Qwen3.5-9B dims in float32 (35 GiB) was ended by the host's OOM killer with no message on a
    23 GiB CPU machine."""
    import bole_jax
    from bole_jax.llm import LLM
    from bole_jax.model import parallel
    from bole_jax.serving import cli

    free = parallel.available_bytes()
    assert free is None or free > 0
    cfg = preset("tiny", mtp=True)
    need = parallel.check_weights_fit(cfg, "float32")
    assert need == sum(x.size * 4 for x in jax.tree.leaves(init_params(cfg, jax.random.key(0))))
    assert parallel.check_weights_fit(cfg, "bfloat16") == need // 2
    monkeypatch.setattr(parallel, "available_bytes", lambda device=None: need - 1)
    with pytest.raises(bole_jax.WeightsDoNotFit, match=r"more than the .* cpu device"):
        LLM(cfg)
    assert parallel.check_weights_fit(cfg, "bfloat16") == need // 2  # half the bytes fit
    assert cli.main(["bench", "--preset", "tiny", "--compile-cache", "none"]) == 2
    assert "the weights of this model take" in capsys.readouterr().err
    # a checkpoint is checked before its tensors are read (the demo model: 25M params)
    monkeypatch.setattr(parallel, "available_bytes", lambda device=None: 2**20)
    with pytest.raises(parallel.WeightsDoNotFit, match=r"take 9\d\.\d MiB in float32"):
        LLM(dtype="float32")
