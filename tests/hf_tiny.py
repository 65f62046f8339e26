"""Tiny random Hugging Face models for tests (transformers on CPU, fp32).

    path = make_tiny_hf_checkpoint(tmp_path, family="qwen3_next", moe=True, seed=1)
    model = load_torch_model(path)            # the transformers reference, eval mode
    path, model = make_tiny_hf_checkpoint(tmp_path, ..., return_model=True)

Families: "qwen3_next" (dense or MoE), "qwen3_5" (dense, tied embeddings by default),
"qwen3_5_moe". Default dims: hidden 64, 4 layers (3 GDN + 1 attention), GDN Hk=2 / HV=4,
dk = dv = 16, attention 4 q / 2 kv heads of 32 (rotary 8), vocab 256, MoE 8 experts top-2 + shared.
EVERY weight is randomised (norms, A_log, dt_bias included), scaled so activations stay O(1) and
logits are peaked (greedy decoding is then robust to rounding). `overrides` go to the HF config.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _classes(family: str):
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextConfig, Qwen3NextForCausalLM
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5TextConfig, Qwen3_5ForCausalLM
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def tiny_hf_config(family: str = "qwen3_next", moe: bool = False, **overrides):
    """The transformers config object of a tiny model."""
    config_cls, _ = _classes(family)
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3_next":
        kw.update(intermediate_size=96, num_experts=0)
    if family == "qwen3_5":
        kw.update(intermediate_size=96, tie_word_embeddings=True)
    if moe or family == "qwen3_5_moe":
        kw.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    kw.update(overrides)
    cfg = config_cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter with seeded random values of a sensible scale."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen, dtype=torch.float32)
    for name, p in sorted(model.named_parameters()):
        if name.endswith(
            "A_log"
        ):  # decay rates exp(A_log) in [0.05, 1]: memory over several tokens
            val = torch.empty(p.shape).uniform_(np.log(0.05), 0.0, generator=gen)
        elif name.endswith("dt_bias"):
            val = 0.5 * randn(p.shape)
        elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain scale
            val = 1.0 + 0.2 * randn(p.shape)
        elif p.ndim == 1:  # zero-centred RMSNorm offsets (1 + w)
            val = 0.2 * randn(p.shape)
        elif name.endswith("embed_tokens.weight"):
            val = randn(p.shape)
        else:  # [.., out, in] linear / conv / fused expert weights
            val = randn(p.shape) * p.shape[-1] ** -0.5
            if name.endswith("lm_head.weight") or name.endswith("mlp.gate.weight"):
                val = 3.0 * val  # peaked logits and decisive routing
        p.copy_(val.to(p.dtype))
    return model


def make_tiny_hf_model(family: str = "qwen3_next", moe: bool = False, seed: int = 0, **overrides):
    """A randomised tiny transformers model (fp32, eval mode)."""
    torch.manual_seed(seed)
    _, model_cls = _classes(family)
    model = model_cls(tiny_hf_config(family, moe, **overrides)).eval()
    randomize_(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def make_tiny_hf_checkpoint(
    tmp_path,
    family: str = "qwen3_next",
    moe: bool = False,
    seed: int = 0,
    return_model: bool = False,
    **overrides,
):
    """save_pretrained a tiny random model under tmp_path; returns the folder (and the model)."""
    name = f"{family}{'_moe' if moe else ''}_s{seed}"
    if overrides:
        name += "_" + hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
    path = os.path.join(os.fspath(tmp_path), name)
    model = make_tiny_hf_model(family, moe, seed, **overrides)
    model.save_pretrained(path)
    return (path, model) if return_model else path


def load_torch_model(path):
    """Load a tiny checkpoint back with transformers (fp32, eager attention, eval mode)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    family = {
        "qwen3_next": "qwen3_next",
        "qwen3_5_text": "qwen3_5",
        "qwen3_5_moe_text": "qwen3_5_moe",
    }[model_type]
    _, model_cls = _classes(family)
    return model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def torch_logits(model, ids) -> np.ndarray:
    """Full-sequence fp32 logits [B, T, V] (no cache)."""
    return model(torch.as_tensor(np.asarray(ids)), use_cache=False).logits.float().numpy()


# transformers renamed the output field / kwarg `past_key_values` to `cache` (5.2x); the GPU image
# has 5.17: accept both.
def _cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _cache_kw() -> str:
    import inspect

    from transformers import Qwen3NextForCausalLM

    return (
        "cache"
        if "cache" in inspect.signature(Qwen3NextForCausalLM.forward).parameters
        else "past_key_values"
    )


_CACHE_KW = _cache_kw()


@torch.no_grad()
def torch_greedy_run(model, prompt, steps: int) -> dict:
    """Greedy continuation of one prompt with transformers' own cache (prefill, then 1-token steps).

    Returns tokens [steps], logits [steps, V] (the distribution each token was taken from) and
    prefill_cache: per layer (conv_state [1, C, K], recurrent_state [1, HV, dk, dv]) for GDN layers
    or (keys, values) [1, Hkv, T, D] for attention layers, copied right after the prefill."""
    out = model(torch.as_tensor(np.asarray(prompt))[None], use_cache=True)
    c = _cache_of(out)
    prefill_cache = [
        (c.layers[i].conv_states[0].clone(), c.layers[i].recurrent_states[0].clone())
        if t == "linear_attention"
        else (c.layers[i].keys.clone(), c.layers[i].values.clone())
        for i, t in enumerate(model.config.layer_types)
    ]
    tokens, step_logits = [], []
    for _ in range(steps):
        step_logits.append(out.logits[0, -1].float().numpy())
        nxt = out.logits[0, -1].argmax()
        tokens.append(int(nxt))
        out = model(nxt.view(1, 1), use_cache=True, **{_CACHE_KW: _cache_of(out)})
    return dict(tokens=tokens, logits=np.stack(step_logits), prefill_cache=prefill_cache)


def torch_greedy(model, prompt, steps: int) -> list[int]:
    """The greedy tokens of `torch_greedy_run`."""
    return torch_greedy_run(model, prompt, steps)["tokens"]


def rel_err(a, b) -> float:
    """||a - b|| / ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
