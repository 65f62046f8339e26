"""Static model configuration for the hybrid (Gated DeltaNet + gated attention) families.

`ModelConfig` is a frozen, hashable dataclass: pass it as a static argument to `jax.jit`.
It is built from a Hugging Face ``config.json`` dict of one of these ``model_type``s:

- ``qwen3_next``                          (Qwen3-Next; MoE or dense MLP per layer)
- ``qwen3_5`` / ``qwen3_5_text``          (Qwen3.5 dense; the text part may be nested under
                                            ``text_config`` in the multimodal config)
- ``qwen3_5_moe`` / ``qwen3_5_moe_text``  (Qwen3.5 MoE; may be nested the same way)

Which layers are MoE matches transformers exactly (`ModelConfig.is_moe_layer`):
Qwen3-Next: ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``;
Qwen3.5 dense: none; Qwen3.5 MoE: every layer (its router always renormalises the top-k).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from bole_jax.pallas.options import KernelOptions

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

# model_type -> family. A family fixes the checkpoint layout (see weights.py) and the MoE rule.
_FAMILY = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_HF_TEXT_MODEL_TYPE = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
_HF_ARCHITECTURE = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
}

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know, in one hashable record.

    Shape letters used elsewhere: H = hidden_size, V = vocab_size, Hq = num_heads,
    Hkv = num_kv_heads, D = head_dim, Hk = gdn_num_key_heads, HV = gdn_num_value_heads,
    dk = gdn_key_dim, dv = gdn_value_dim, K = conv_kernel, C = conv_dim = 2*Hk*dk + HV*dv.
    """

    family: str  # "qwen3_next" | "qwen3_5" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) | "full_attention", one per layer
    # Gated full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # first rotary_dim channels of each head are rotated (partial RoPE)
    rope_theta: float
    # Gated DeltaNet.
    gdn_num_key_heads: int
    gdn_num_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    conv_kernel: int
    # MLP / MoE.
    intermediate_size: int  # dense SwiGLU width (0 when no layer is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Misc.
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # checkpoint dtype name ("float32" | "bfloat16" | "float16")
    mtp_num_layers: int = 0  # MTP (multi-token prediction) decoder layers; 0 = no MTP head
    max_position_embeddings: int = 32768
    # Tensor-parallel shards (not from config.json). > 1: params, caches and the GDN kernels are
    # split over a "tp" device mesh and fused channel axes are stored shard-major (see
    # bole_jax/model/parallel.py); 1: no parallelism, every code path as without it.
    tp: int = 1
    # Which kernels run where they choose for themselves (not from config.json; `KernelOptions`:
    # the tree verify's operands and Mosaic route, the commit's fold, the lazy-commit layout,
    # the GDN decode backend).
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self):
        if self.family not in _HF_TEXT_MODEL_TYPE:
            raise ValueError(
                f"unknown family {self.family!r}; expected one of {sorted(_HF_TEXT_MODEL_TYPE)}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}"
            )
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ValueError(f"unsupported layer types {bad}; expected {LINEAR!r} or {FULL!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.gdn_num_value_heads % self.gdn_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.gdn_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.gdn_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"kernels must be a KernelOptions, got {self.kernels!r}")
        if type(self.tp) is not int or self.tp < 1:
            raise ValueError(
                f"tp must be a positive int (tensor-parallel devices), got {self.tp!r}"
            )
        if any(self.is_moe_layer(i) for i in range(self.num_layers)):
            if not (
                0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
            ):
                raise ValueError(
                    "MoE layers need 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0"
                )
        if (
            not all(self.is_moe_layer(i) for i in range(self.num_layers))
            and self.intermediate_size <= 0
        ):
            raise ValueError("dense MLP layers need intermediate_size > 0")

    # ----- derived quantities -------------------------------------------------------------
    @property
    def conv_dim(self) -> int:
        """C: conv channels [all q | all k | all v] of a GDN layer."""
        return (
            2 * self.gdn_num_key_heads * self.gdn_key_dim
            + self.gdn_num_value_heads * self.gdn_value_dim
        )

    @property
    def gdn_value_heads_per_key_head(self) -> int:
        return self.gdn_num_value_heads // self.gdn_num_key_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` uses the sparse MoE block (transformers' rule).

        MTP layers are indexed after the target layers (num_layers + j), as vLLM does."""
        if self.family == "qwen3_5":
            return False
        if self.family == "qwen3_5_moe":
            return True
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def mtp_layer_is_moe(self, j: int) -> bool:
        return self.is_moe_layer(self.num_layers + j)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (nested `text_config` is understood)."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a config dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in _FAMILY:
            raise ValueError(
                f"unsupported model_type {model_type!r}: bole_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = _FAMILY[model_type]
        outer = d
        if isinstance(d.get("text_config"), dict):
            d = {**d["text_config"]}
        else:
            d = dict(d)

        def get(key, default=None, required=False):
            for src in (d, outer):
                if key in src and src[key] is not None:
                    return src[key]
            if required:
                raise ValueError(
                    f"config for model_type {model_type!r} is missing required key {key!r}"
                )
            return default

        hidden = int(get("hidden_size", required=True))
        num_layers = int(get("num_hidden_layers", required=True))
        num_heads = int(get("num_attention_heads", required=True))
        head_dim = int(get("head_dim") or hidden // num_heads)
        layer_types = get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        layer_types = tuple(layer_types)[:num_layers]
        if get("attention_bias", False):
            raise ValueError(
                "attention_bias=True is not supported (no released Qwen3-Next/Qwen3.5 model uses it)"
            )
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported; only 'silu'")

        # RoPE parameters: transformers 5 keeps them in `rope_parameters`; older files use
        # top-level rope_theta / partial_rotary_factor and an optional `rope_scaling` dict.
        rope = {}
        for key in ("rope_scaling", "rope_parameters"):
            if isinstance(get(key), dict):
                rope.update(get(key))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; only default (1-D, or text-only mRoPE)"
            )
        theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)))
        rotary_dim = int(head_dim * partial)

        num_experts = int(get("num_experts", 0) or 0) if family != "qwen3_5" else 0
        if family == "qwen3_5_moe":
            # Qwen3.5-MoE: every layer is sparse and the router always renormalises.
            norm_topk, sparse_step, mlp_only = True, 1, ()
        else:
            norm_topk = bool(get("norm_topk_prob", True))
            sparse_step = int(get("decoder_sparse_step", 1) or 1)
            mlp_only = tuple(int(i) for i in (get("mlp_only_layers") or ()))

        eos = get("eos_token_id")
        eos = (
            ()
            if eos is None
            else (tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        )
        dtype_name = str(get("dtype") or get("torch_dtype") or "bfloat16").replace("torch.", "")
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r} in config")

        return cls(
            family=family,
            vocab_size=int(get("vocab_size", required=True)),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=layer_types,
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads", required=True)),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            gdn_num_key_heads=int(get("linear_num_key_heads", 16)),
            gdn_num_value_heads=int(get("linear_num_value_heads", 32)),
            gdn_key_dim=int(get("linear_key_head_dim", 128)),
            gdn_value_dim=int(get("linear_value_head_dim", 128)),
            conv_kernel=int(get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(get("intermediate_size", 0) or 0)
            if family != "qwen3_5_moe"
            else 0,
            num_experts=num_experts,
            num_experts_per_tok=int(get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0) if num_experts else 0,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0)
            if num_experts
            else 0,
            norm_topk_prob=norm_topk,
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            dtype=_DTYPES[dtype_name],
            mtp_num_layers=int(get("mtp_num_hidden_layers", 0) or 0),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `<path>/config.json` (or a config.json path). EOS ids from generation_config.json,
        when present, are appended to the config's own (transformers' generate stops on both)."""
        path = os.fspath(path)
        cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.isdir(path) and not os.path.isfile(path):
            raise FileNotFoundError(f"model path {path!r} does not exist")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(
                f"no config.json in {path!r}: expected a Hugging Face model folder (config.json + *.safetensors)"
            )
        try:
            with open(cfg_file) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        cfg = cls.from_hf_dict(d)
        gen_file = os.path.join(os.path.dirname(cfg_file), "generation_config.json")
        if os.path.isfile(gen_file):
            try:
                with open(gen_file) as f:
                    gen_eos = json.load(f).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                gen_eos = None
            if gen_eos is not None:
                gen_eos = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
                merged = tuple(dict.fromkeys(list(cfg.eos_token_ids) + [int(e) for e in gen_eos]))
                cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """A text-only transformers config.json dict for this config (inverse of from_hf_dict)."""
        d: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURE[self.family]],
            "model_type": _HF_TEXT_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rotary_dim / self.head_dim,
            },
            "linear_num_key_heads": self.gdn_num_key_heads,
            "linear_num_value_heads": self.gdn_num_value_heads,
            "linear_key_head_dim": self.gdn_key_dim,
            "linear_value_head_dim": self.gdn_value_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype": self.dtype,
        }
        if self.family != "qwen3_5_moe":
            d["intermediate_size"] = self.intermediate_size
        if self.family == "qwen3_next":
            d.update(
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                norm_topk_prob=self.norm_topk_prob,
            )
        if self.family != "qwen3_5":
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        if self.eos_token_ids:
            d["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        if self.mtp_num_layers:
            d["mtp_num_hidden_layers"] = self.mtp_num_layers
        return d

    @classmethod
    def tiny(cls, family: str = "qwen3_next", moe: bool = False, **overrides) -> "ModelConfig":
        """A small config for tests: 4 layers (3 GDN + 1 attention), H=64, HV/Hk=2, dk=dv=16, D=32."""
        kw: dict[str, Any] = dict(
            family=family,
            vocab_size=256,
            hidden_size=64,
            num_layers=4,
            layer_types=(LINEAR, LINEAR, LINEAR, FULL),
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            rotary_dim=8,
            rope_theta=10000.0,
            gdn_num_key_heads=2,
            gdn_num_value_heads=4,
            gdn_key_dim=16,
            gdn_value_dim=16,
            conv_kernel=4,
            intermediate_size=0 if family == "qwen3_5_moe" else 96,
            dtype="float32",
        )
        if moe or family == "qwen3_5_moe":
            kw.update(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
            )
        if "num_layers" in overrides and "layer_types" not in overrides:
            n = overrides["num_layers"]
            kw["layer_types"] = tuple(LINEAR if (i + 1) % 4 else FULL for i in range(n))
        kw.update(overrides)
        return cls(**kw)
