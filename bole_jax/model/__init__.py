"""Target model: config, params, cache, layers, forward, HF checkpoint I/O (see docs/interfaces.md).

Orbax save/restore of converted params lives in `bole_jax.model.checkpoint` (imported on demand).
"""

from bole_jax.model.cache import AttnCache, Cache, GDNCache, init_cache
from bole_jax.model.config import ModelConfig
from bole_jax.model.model import forward, forward_pre_norm, logits
from bole_jax.model.params import abstract_params, init_params, param_shapes
from bole_jax.model.weights import CheckpointError, load_hf_checkpoint, save_hf_checkpoint

__all__ = [
    "AttnCache",
    "Cache",
    "CheckpointError",
    "GDNCache",
    "ModelConfig",
    "abstract_params",
    "forward",
    "forward_pre_norm",
    "init_cache",
    "init_params",
    "load_hf_checkpoint",
    "logits",
    "param_shapes",
    "save_hf_checkpoint",
]
