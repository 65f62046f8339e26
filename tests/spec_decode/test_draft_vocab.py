"""Reduced draft vocabulary (spec_decode/draft_vocab.py): id selection, the restricted top-k and
the CLI that counts token frequencies (greedy decoding with it == AR: tests/spec_decode/test_engine.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import ModelConfig
from bole_jax.model import logits as lm_logits
from bole_jax.spec_decode import draft_vocab


def _cfg(tied=False, vocab=96):
    return ModelConfig.tiny(
        "qwen3_next",
        vocab_size=vocab,
        mtp_num_layers=1,
        eos_token_ids=(7,),
        tie_word_embeddings=tied,
    )


def test_select_ids_file_order_eos_and_errors(tmp_path):
    cfg = _cfg()
    ids, source = draft_vocab.select_ids(cfg, 10)
    assert ids.tolist() == sorted(set(range(9)) | {7} | {9}) and "first 10" in source
    rng = np.random.default_rng()
    order = rng.permutation(cfg.vocab_size)
    order = np.concatenate([order[:5], order[:3], order[5:]])  # duplicates are dropped
    (tmp_path / draft_vocab.DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": order.tolist()}))
    ids, source = draft_vocab.select_ids(cfg, 12, tmp_path)
    dedup = list(dict.fromkeys(order.tolist()))
    want = ([7] + [t for t in dedup if t != 7])[:12]
    assert ids.tolist() == sorted(want) and str(tmp_path) in source
    assert len(set(ids.tolist())) == 12
    for bad in (0, -3, cfg.vocab_size, 2.5):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            draft_vocab.select_ids(cfg, bad)
    (tmp_path / draft_vocab.DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": [1, 999]}))
    with pytest.raises(ValueError, match="token_ids must be ids"):
        draft_vocab.select_ids(cfg, 12, tmp_path)
    (tmp_path / draft_vocab.DRAFT_VOCAB_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="'token_ids' list"):
        draft_vocab.select_ids(cfg, 12, tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_draft_top_k_is_the_top_k_over_the_subset(tied):
    cfg = _cfg(tied)
    rng = np.random.default_rng()
    # What the drafter's head reads: embed, lm_head (untied), the MTP entry.
    params = {
        "embed": jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32),
        "mtp": {},
    }
    if not tied:
        params["lm_head"] = jnp.asarray(
            rng.standard_normal((cfg.hidden_size, cfg.vocab_size)), jnp.float32
        )
    ids = np.sort(rng.choice(cfg.vocab_size, 40, replace=False)).astype(np.int32)
    h = jnp.asarray(rng.standard_normal((3, 5, cfg.hidden_size)), jnp.float32)
    full_lp, full_tok = draft_vocab.draft_top_k(params, cfg, h, 4)
    z = lm_logits(params, cfg, h)
    np.testing.assert_array_equal(full_tok, jax.lax.top_k(z, 4)[1])
    sub = draft_vocab.with_draft_vocab(params, cfg, ids)
    assert draft_vocab.has_draft_vocab(sub) and not draft_vocab.has_draft_vocab(params)
    lp, tok = draft_vocab.draft_top_k(sub, cfg, h, 4)
    zs = np.asarray(z)[..., ids]
    want = ids[np.argsort(-zs, axis=-1, kind="stable")[..., :4]]
    np.testing.assert_array_equal(tok, want)
    want_lp = np.sort(np.asarray(jax.nn.log_softmax(jnp.asarray(zs), axis=-1)), axis=-1)[..., ::-1]
    np.testing.assert_allclose(lp, want_lp[..., :4], rtol=1e-5, atol=1e-5)
    assert not draft_vocab.has_draft_vocab(draft_vocab.without_draft_vocab(sub))
    with pytest.raises(ValueError, match="ids in"):
        draft_vocab.with_draft_vocab(params, cfg, [0, cfg.vocab_size])


def test_draft_vocab_needs_mtp():
    cfg = _cfg()
    with pytest.raises(ValueError, match="MTP"):
        draft_vocab.with_draft_vocab({"embed": jnp.zeros((cfg.vocab_size, 4))}, cfg, [1, 2])


def test_cli_draft_vocab_counts_and_uses_the_file(model_dir, tmp_path, capsys):
    import shutil

    from bole_jax.serving import cli

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.py").write_text("def f(x):\n    return x + 1\n" * 50)
    assert cli.main(["draft-vocab", "--model", str(d), str(text)]) == 0
    table = json.loads((d / draft_vocab.DRAFT_VOCAB_FILE).read_text())
    assert sorted(table["token_ids"]) == list(range(8192)) and table["tokens_counted"] > 0
    assert "top   1024 tokens cover 100.00%" in capsys.readouterr().out
    cfg = ModelConfig.from_pretrained(d)
    ids, source = draft_vocab.select_ids(cfg, 64, d)
    assert set(table["token_ids"][:63]) <= set(ids.tolist()) and "most frequent" in source
    assert cli.main(["draft-vocab", "--model", str(tmp_path / "nope"), str(text)]) == 2
