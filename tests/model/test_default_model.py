"""The shipped demo model: loads in transformers and matches our forward (fp32), writes code."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import rel_err

from bole_jax import LLM
from bole_jax.llm import DEFAULT_MODEL_DIR
from bole_jax.model import forward, init_cache, logits


@pytest.fixture(scope="module")
def llm():
    return LLM()  # fp32 on CPU


def test_default_model_parity_with_transformers(llm):
    from transformers import Qwen3NextForCausalLM

    ref = Qwen3NextForCausalLM.from_pretrained(
        DEFAULT_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert llm.cfg.mtp_num_layers == 1 and "mtp" in llm.params
    ids = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    with torch.no_grad():
        want = ref(torch.as_tensor([ids]), use_cache=False).logits.float().numpy()
    cache = init_cache(llm.cfg, 1, len(ids), jnp.float32)
    hidden, _ = forward(llm.params, llm.cfg, jnp.asarray([ids]), cache)
    got = np.asarray(logits(llm.params, llm.cfg, hidden))
    assert rel_err(got, want) < 1e-5


def test_default_model_writes_code(llm):
    out = llm.generate(["def fibonacci(n):"], max_new_tokens=24, spec="bole")[0]
    assert out.stats["mode"] == "bole"
    # trained on Python: a `def` line is followed by an indented body (random weights would not)
    assert out.text.startswith("\n    "), out.text
    assert out.stats["tokens_per_step"] > 1.5  # its MTP head drafts accepted tokens


def test_demo_config_sizes_match_the_shipped_model():
    """train_demo's "code" widths are the shipped model's config; "wide" has Qwen3-Next's GDN
    head size (the memory-bound online benchmark relies on its per-request state size)."""
    import pytest

    from bole_jax.model.config import ModelConfig
    from bole_jax.train.train_demo import demo_config

    shipped = LLM().cfg
    demo = demo_config(shipped.vocab_size, shipped.eos_token_ids[0], "code")
    for f in (
        "hidden_size",
        "num_layers",
        "layer_types",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "gdn_num_key_heads",
        "gdn_num_value_heads",
        "gdn_key_dim",
        "gdn_value_dim",
        "intermediate_size",
        "mtp_num_layers",
    ):
        assert getattr(demo, f) == getattr(shipped, f), f
    wide = demo_config(8192, 0, "wide")
    assert isinstance(wide, ModelConfig)
    assert (wide.gdn_num_value_heads, wide.gdn_key_dim, wide.gdn_value_dim) == (16, 128, 128)
    with pytest.raises(ValueError, match="unknown size"):
        demo_config(8192, 0, "huge")


def test_pallas_draft_top_k_drafts_the_same_trees(llm):
    """The drafter's top-k by the Pallas kernel (interpret mode here) drafts the same tokens as the
    jnp reference: the same output and the same steps, so the same acceptance."""
    import dataclasses

    from bole_jax.pallas.options import KernelOptions

    prompt = ["def add(a, b):\n    return", "import numpy as np\n\nx = np."]
    outs = {}
    for backend in ("reference", "pallas"):
        opts = dataclasses.replace(KernelOptions(), draft_top_k_backend=backend)
        other = LLM(kernel_options=opts)
        outs[backend] = other.generate(prompt, max_new_tokens=20, spec="bole")
    for a, b in zip(outs["reference"], outs["pallas"]):
        assert a.token_ids == b.token_ids
        assert a.stats["steps"] == b.stats["steps"] and a.stats["tokens_per_step"] > 1.5
