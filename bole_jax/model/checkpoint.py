"""Save / restore converted params with orbax-checkpoint (fast reload of a converted model).

    save_params("/ckpt/qwen35-9b", params, cfg)     # <path>/params (orbax) + <path>/model_config.json
    cfg = load_config("/ckpt/qwen35-9b")
    params = restore_params("/ckpt/qwen35-9b")      # structure/dtype from the saved config

`model_config.json` is `cfg.to_hf_dict()` (transformers-style; `ModelConfig.from_hf_dict` rebuilds
the same config) with "dtype" set to the params' actual dtype.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from bole_jax.model import parallel
from bole_jax.model.config import ModelConfig
from bole_jax.model.params import abstract_params

_ITEM = "params"
_CONFIG = "model_config.json"


def save_params(
    path: str | os.PathLike, params: dict, cfg: ModelConfig | None = None, *, force: bool = False
):
    """Write params (and cfg, when given) under the folder `path`. An existing checkpoint there is
    an error unless force=True. Params in a tensor-parallel layout (cfg.tp > 1) are saved in the
    canonical one."""
    if cfg is not None and cfg.tp > 1:
        params = parallel.unshard_params(params, cfg)
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, _ITEM), params, force=force)
    if cfg is not None:
        d = cfg.to_hf_dict()
        d["dtype"] = str(jax.tree.leaves(params)[0].dtype)
        with open(os.path.join(path, _CONFIG), "w") as f:
            json.dump(d, f, indent=2)


def load_config(path: str | os.PathLike) -> ModelConfig | None:
    """The config saved beside the params by `save_params` (None if it was saved without one)."""
    cfg_file = os.path.join(os.fspath(path), _CONFIG)
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def restore_params(path: str | os.PathLike, cfg: ModelConfig | None = None, dtype=None) -> dict:
    """Restore params saved by `save_params`.

    With a cfg (given, or saved beside the params) the result has exactly `abstract_params(cfg,
    dtype)`'s structure, shapes and dtype (default cfg.dtype); otherwise the stored tree as is."""
    path = os.path.abspath(os.fspath(path))
    item = os.path.join(path, _ITEM)
    if not os.path.isdir(item):
        raise FileNotFoundError(
            f"no params checkpoint at {item} (write one with bole_jax.model.checkpoint.save_params)"
        )
    cfg = cfg or load_config(path)
    with ocp.StandardCheckpointer() as ckpt:
        if cfg is None:
            return ckpt.restore(item)
        return ckpt.restore(item, abstract_params(cfg, dtype))
