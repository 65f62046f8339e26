"""Published model dimensions for random-weight benchmarks (speed does not depend on weights).

Values follow released config.json files / transformers' config defaults; entries marked
`assumed` were not available offline and are estimates (they only change the weight bytes).
"""

from __future__ import annotations

from bole_jax.model.config import FULL, LINEAR, ModelConfig


def _hybrid(n_layers: int) -> tuple[str, ...]:
    return tuple(LINEAR if (i + 1) % 4 else FULL for i in range(n_layers))


PRESETS: dict[str, dict] = {
    # transformers Qwen3_5TextConfig defaults == Qwen3.5-9B's text config.
    "qwen3.5-9b": dict(
        family="qwen3_5",
        vocab_size=248320,
        hidden_size=4096,
        num_layers=32,
        num_heads=16,
        num_kv_heads=4,
        head_dim=256,
        rotary_dim=64,
        gdn_num_key_heads=16,
        gdn_num_value_heads=32,
        intermediate_size=12288,
        tie_word_embeddings=False,
    ),
    # assumed: intermediate 9216 and tied embeddings (small Qwen3.5 models tie them).
    "qwen3.5-4b": dict(
        family="qwen3_5",
        vocab_size=248320,
        hidden_size=2560,
        num_layers=32,
        num_heads=16,
        num_kv_heads=4,
        head_dim=256,
        rotary_dim=64,
        gdn_num_key_heads=16,
        gdn_num_value_heads=32,
        intermediate_size=9216,
        tie_word_embeddings=True,
    ),
    # assumed: hidden 5120, 64 layers, intermediate 17408, 24 q / 4 kv heads.
    "qwen3.5-27b": dict(
        family="qwen3_5",
        vocab_size=248320,
        hidden_size=5120,
        num_layers=64,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        rotary_dim=64,
        gdn_num_key_heads=16,
        gdn_num_value_heads=48,
        intermediate_size=17408,
        tie_word_embeddings=False,
    ),
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        rotary_dim=64,
        gdn_num_key_heads=16,
        gdn_num_value_heads=32,
        intermediate_size=5120,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    ),
}


def preset(name: str, *, mtp: bool = True, dtype: str = "bfloat16", **overrides) -> ModelConfig:
    """ModelConfig with a published model's dimensions (GDN dk = dv = 128, conv width 4)."""
    if name == "tiny":  # CPU smoke tests of benchmark scripts
        return ModelConfig.tiny(
            "qwen3_next", mtp_num_layers=1 if mtp else 0, dtype=dtype, **overrides
        )
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update(
        layer_types=_hybrid(kw["num_layers"]),
        rope_theta=10_000_000.0,
        gdn_key_dim=128,
        gdn_value_dim=128,
        conv_kernel=4,
        dtype=dtype,
        mtp_num_layers=1 if mtp else 0,
        max_position_embeddings=262144,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def peaked_lm_head(params: dict, cfg: ModelConfig) -> dict:
    """Random-weight benchmarks of untied models: lm_head initialised as a copy of embed^T.

    Same shapes and bytes as an untied model, but logits keep a clear top-1 margin (the input
    token's own embedding dominates, as with tied weights). With an independent random lm_head the
    248k logits are nearly Gaussian: the top-2 gap is ~1% of the logit scale, so bf16 rounding
    differences between a one-token decode and a tree verify flip greedy tokens within a few steps
    (measured on the H200 at 9B dims: benchmarks/results/greedy_check_qwen3.5-9b.json), after which
    the synthetic drafter's oracle (the AR continuation) is never accepted again.
    """
    if cfg.tie_word_embeddings or "lm_head" not in params:
        return params
    return {**params, "lm_head": params["embed"].T.astype(params["lm_head"].dtype)}
