"""Hugging Face checkpoint <-> params conversion (no torch needed).

`load_hf_checkpoint(path)` reads a local HF folder: config.json and model.safetensors, or shards
listed in model.safetensors.index.json. Tensors are memory-mapped (bf16 / fp8 via ml_dtypes), moved
to the device and converted to the flat layout of params.py:

- Linear weights [out, in] -> [in, out].
- Qwen3-Next GDN `in_proj_qkvz` (rows grouped per key head g: [q_g | k_g | v_g (r*dv) | z_g (r*dv)])
  and `in_proj_ba` ([b_g (r) | a_g (r)]) are de-interleaved into w_qkv ([all q | all k | all v]),
  w_z, w_b, w_a. Qwen3.5's flat in_proj_qkv / in_proj_z / in_proj_b / in_proj_a map directly.
- Attention `q_proj` rows per head [q_h | gate_h] are split into w_q and w_gate.
- MoE experts: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what transformers'
  save_pretrained writes) or fused `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
  [E, H, I] (transformers' in-memory layout) -> w_gate_up [E, H, 2I], w_down [E, I, H].
- Key prefixes `model.` and `model.language_model.` (Qwen3.5 multimodal checkpoints) are both
  accepted; the vision tower (`model.visual.*`) is ignored; `mtp.*` goes to params["mtp"].
- Tied embeddings: no lm_head param (a stored lm_head.weight is ignored).

`save_hf_checkpoint(path, cfg, params)` is the inverse (config.json + model.safetensors, or shards
with an index, in the family's own layout, per-expert MoE keys), loadable by transformers'
*ForCausalLM.from_pretrained. Files are read and written with the `safetensors` library (with a
built-in fallback for what its numpy binding lacks: `SafetensorsFile`). Shard paths of an index
must stay inside the model folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from bole_jax.model.config import FULL, LINEAR, ModelConfig

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: missing files/tensors, unexpected or misshaped tensors."""


# ----------------------------------------------------------------------------- safetensors I/O

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _safetensors_lib():
    """The `safetensors` package's (safe_open, numpy save_file), or None without it."""
    try:
        from safetensors import safe_open
        from safetensors.numpy import save_file
    except ImportError:
        return None
    return safe_open, save_file


class SafetensorsFile:
    """A .safetensors file: `.shapes` / `.dtypes` from the header, `.get(name)` as a numpy array.

    Read with the `safetensors` library (safe_open, framework="numpy": memory-mapped, bf16 as
    ml_dtypes.bfloat16 on safetensors >= 0.4); dtypes its numpy binding cannot give (fp8 on
    0.8, bf16 on old versions) and installs without the library are read by the memory-mapped
    parser below (the format: 8-byte little-endian header length, JSON header, raw data)."""

    def __init__(self, filename: str):
        self.filename = filename
        self._mm = None
        self._header = None
        lib = _safetensors_lib()
        self._lib = None
        try:
            if lib is not None:
                self._lib = lib[0](filename, framework="numpy")
                slices = {k: self._lib.get_slice(k) for k in self._lib.keys()}
                self.shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
                self.dtypes = {k: v.get_dtype() for k, v in slices.items()}
            else:
                self._read_header()
                self.shapes = {k: tuple(v["shape"]) for k, v in self._header.items()}
                self.dtypes = {k: v["dtype"] for k, v in self._header.items()}
        except CheckpointError:
            raise
        except Exception as e:  # OSError, ValueError, safetensors' SafetensorError
            raise CheckpointError(f"cannot read safetensors file {self.filename}: {e}") from e

    def _read_header(self):
        try:
            with open(self.filename, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read safetensors file {self.filename}: {e}") from e
        header.pop("__metadata__", None)
        self._header, self._data_start = header, 8 + n

    def get(self, name: str) -> np.ndarray:
        if self.dtypes[name] not in _ST_DTYPES:
            raise CheckpointError(
                f"tensor {name} in {self.filename} has unsupported dtype {self.dtypes[name]}"
            )
        if self._lib is not None:
            try:
                a = self._lib.get_tensor(name)
            except (TypeError, ValueError, AttributeError):  # a dtype its numpy binding lacks
                pass
            else:
                if a.dtype == _ST_DTYPES[self.dtypes[name]]:
                    return a
        return self._raw(name)

    def _raw(self, name: str) -> np.ndarray:
        if self._header is None:
            self._read_header()
        if self._mm is None:
            self._mm = np.memmap(self.filename, dtype=np.uint8, mode="r")
        info = self._header[name]
        start, end = info["data_offsets"]
        raw = self._mm[self._data_start + start : self._data_start + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(filename: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Write numpy arrays (bf16 / fp8 via ml_dtypes, mixed dtypes allowed) as one .safetensors
    file, with the `safetensors` library when it takes every dtype, else the writer below."""
    metadata = {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}
    for name, a in tensors.items():
        if np.asarray(a).dtype not in _ST_NAMES:
            raise ValueError(f"cannot write tensor {name} of dtype {np.asarray(a).dtype}")
    lib = _safetensors_lib()
    if lib is not None:
        try:
            lib[1](
                {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                filename,
                metadata=metadata,
            )
            return
        except (TypeError, ValueError, AttributeError):  # e.g. fp8, unknown to its numpy binding
            pass
    _write_raw(filename, tensors, metadata)


def _write_raw(filename: str, tensors: dict[str, np.ndarray], metadata: dict):
    header: dict = {"__metadata__": metadata}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


# ----------------------------------------------------------------------------- the name/layout map


@dataclasses.dataclass
class _Entry:
    """HF tensors `hf` (name -> HF shape) <-> params leaves at `paths`, with both conversions."""

    hf: dict[str, tuple[int, ...]]
    paths: tuple[tuple, ...]
    to_params: Callable[..., tuple]  # (*hf arrays in hf order) -> tuple of leaves
    to_hf: Callable[..., tuple]  # (*leaves) -> tuple of hf arrays in hf order


def _linear(hf_name: str, path: tuple, n_in: int, n_out: int) -> _Entry:
    return _Entry({hf_name: (n_out, n_in)}, (path,), lambda w: (w.T,), lambda w: (w.T,))


def _vector(hf_name: str, path: tuple, n: int) -> _Entry:
    return _Entry({hf_name: (n,)}, (path,), lambda w: (w,), lambda w: (w,))


def _gdn_entries(cfg: ModelConfig, pre: str, root: tuple) -> list[_Entry]:
    H, Hk, HV, dk, dv, K, C = (
        cfg.hidden_size,
        cfg.gdn_num_key_heads,
        cfg.gdn_num_value_heads,
        cfg.gdn_key_dim,
        cfg.gdn_value_dim,
        cfg.conv_kernel,
        cfg.conv_dim,
    )
    r = HV // Hk
    pre, root = pre + "linear_attn.", root + ("gdn",)
    out = []
    if cfg.family == "qwen3_next":

        def qkvz_to_params(qkvz, ba):
            w = qkvz.reshape(Hk, 2 * dk + 2 * r * dv, H)
            q, k = w[:, :dk].reshape(-1, H), w[:, dk : 2 * dk].reshape(-1, H)
            v, z = (
                w[:, 2 * dk : 2 * dk + r * dv].reshape(-1, H),
                w[:, 2 * dk + r * dv :].reshape(-1, H),
            )
            ba = ba.reshape(Hk, 2 * r, H)
            b, a = ba[:, :r].reshape(HV, H), ba[:, r:].reshape(HV, H)
            return np.concatenate([q, k, v], axis=0).T, z.T, b.T, a.T

        def qkvz_to_hf(w_qkv, w_z, w_b, w_a):
            qkv = w_qkv.T
            q = qkv[: Hk * dk].reshape(Hk, dk, H)
            k = qkv[Hk * dk : 2 * Hk * dk].reshape(Hk, dk, H)
            v = qkv[2 * Hk * dk :].reshape(Hk, r * dv, H)
            z = w_z.T.reshape(Hk, r * dv, H)
            qkvz = np.concatenate([q, k, v, z], axis=1).reshape(-1, H)
            ba = np.concatenate([w_b.T.reshape(Hk, r, H), w_a.T.reshape(Hk, r, H)], axis=1).reshape(
                -1, H
            )
            return qkvz, ba

        out.append(
            _Entry(
                {
                    pre + "in_proj_qkvz.weight": (C + HV * dv, H),
                    pre + "in_proj_ba.weight": (2 * HV, H),
                },
                tuple(root + (n,) for n in ("w_qkv", "w_z", "w_b", "w_a")),
                qkvz_to_params,
                qkvz_to_hf,
            )
        )
    else:
        out += [
            _linear(pre + "in_proj_qkv.weight", root + ("w_qkv",), H, C),
            _linear(pre + "in_proj_z.weight", root + ("w_z",), H, HV * dv),
            _linear(pre + "in_proj_b.weight", root + ("w_b",), H, HV),
            _linear(pre + "in_proj_a.weight", root + ("w_a",), H, HV),
        ]
    out += [
        _Entry(
            {pre + "conv1d.weight": (C, 1, K)},
            (root + ("conv_w",),),
            lambda w: (w[:, 0, :].T,),
            lambda w: (w.T[:, None, :],),
        ),
        _vector(pre + "A_log", root + ("A_log",), HV),
        _vector(pre + "dt_bias", root + ("dt_bias",), HV),
        _vector(pre + "norm.weight", root + ("norm_w",), dv),
        _linear(pre + "out_proj.weight", root + ("w_out",), HV * dv, H),
    ]
    return out


def _attn_entries(cfg: ModelConfig, pre: str, root: tuple) -> list[_Entry]:
    H, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre, root = pre + "self_attn.", root + ("attn",)

    def q_to_params(w):
        w = w.reshape(Hq, 2 * D, H)
        return w[:, :D].reshape(-1, H).T, w[:, D:].reshape(-1, H).T

    def q_to_hf(w_q, w_gate):
        return (
            np.concatenate([w_q.T.reshape(Hq, D, H), w_gate.T.reshape(Hq, D, H)], axis=1).reshape(
                -1, H
            ),
        )

    return [
        _Entry(
            {pre + "q_proj.weight": (2 * Hq * D, H)},
            (root + ("w_q",), root + ("w_gate",)),
            q_to_params,
            q_to_hf,
        ),
        _linear(pre + "k_proj.weight", root + ("w_k",), H, Hkv * D),
        _linear(pre + "v_proj.weight", root + ("w_v",), H, Hkv * D),
        _linear(pre + "o_proj.weight", root + ("w_o",), Hq * D, H),
        _vector(pre + "q_norm.weight", root + ("q_norm",), D),
        _vector(pre + "k_norm.weight", root + ("k_norm",), D),
    ]


def _gate_up_entry(gate_name, up_name, path, H, I) -> _Entry:
    return _Entry(
        {gate_name: (I, H), up_name: (I, H)},
        (path,),
        lambda g, u: (np.concatenate([g.T, u.T], axis=1),),
        lambda w: (w[:, :I].T, w[:, I:].T),
    )


def _mlp_entries(
    cfg: ModelConfig, pre: str, root: tuple, moe: bool, fused_experts: bool
) -> list[_Entry]:
    H = cfg.hidden_size
    pre, root = pre + "mlp.", root + ("mlp",)
    if not moe:
        I = cfg.intermediate_size
        return [
            _gate_up_entry(
                pre + "gate_proj.weight", pre + "up_proj.weight", root + ("w_gate_up",), H, I
            ),
            _linear(pre + "down_proj.weight", root + ("w_down",), I, H),
        ]
    E, Ie, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = [_linear(pre + "gate.weight", root + ("router",), H, E)]
    if fused_experts:
        out += [
            _Entry(
                {pre + "experts.gate_up_proj": (E, 2 * Ie, H)},
                (root + ("w_gate_up",),),
                lambda w: (np.swapaxes(w, 1, 2),),
                lambda w: (np.swapaxes(w, 1, 2),),
            ),
            _Entry(
                {pre + "experts.down_proj": (E, H, Ie)},
                (root + ("w_down",),),
                lambda w: (np.swapaxes(w, 1, 2),),
                lambda w: (np.swapaxes(w, 1, 2),),
            ),
        ]
    else:
        names = {
            f"{pre}experts.{e}.{p}_proj.weight": s
            for e in range(E)
            for p, s in (("gate", (Ie, H)), ("up", (Ie, H)), ("down", (H, Ie)))
        }

        def experts_to_params(*ws):
            g, u, d = ws[0::3], ws[1::3], ws[2::3]
            gu = np.concatenate(
                [np.swapaxes(np.stack(g), 1, 2), np.swapaxes(np.stack(u), 1, 2)], axis=2
            )
            return gu, np.swapaxes(np.stack(d), 1, 2)

        def experts_to_hf(gu, d):
            out = []
            for e in range(E):
                out += [gu[e, :, :Ie].T, gu[e, :, Ie:].T, d[e].T]
            return tuple(out)

        out.append(
            _Entry(
                names, (root + ("w_gate_up",), root + ("w_down",)), experts_to_params, experts_to_hf
            )
        )
    sp = pre + "shared_expert."
    out += [
        _gate_up_entry(
            sp + "gate_proj.weight", sp + "up_proj.weight", root + ("shared_gate_up",), H, Is
        ),
        _linear(sp + "down_proj.weight", root + ("shared_down",), Is, H),
        _linear(pre + "shared_expert_gate.weight", root + ("shared_gate",), H, 1),
    ]
    return out


def _layer_entries(cfg, pre, root, layer_type, moe, fused_experts) -> list[_Entry]:
    H = cfg.hidden_size
    out = [
        _vector(pre + "input_layernorm.weight", root + ("input_norm",), H),
        _vector(pre + "post_attention_layernorm.weight", root + ("post_attn_norm",), H),
    ]
    out += _gdn_entries(cfg, pre, root) if layer_type == LINEAR else _attn_entries(cfg, pre, root)
    return out + _mlp_entries(cfg, pre, root, moe, fused_experts)


def checkpoint_entries(
    cfg: ModelConfig, fused_experts: Callable[[str], bool] = lambda pre: False
) -> list[_Entry]:
    """All HF tensors of `cfg` (canonical `model.` prefix) and how they map to params.
    `fused_experts(layer_prefix)` says whether that layer stores fused expert tensors."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out = [
        _Entry(
            {"model.embed_tokens.weight": (V, H)}, (("embed",),), lambda w: (w,), lambda w: (w,)
        ),
        _vector("model.norm.weight", ("final_norm",), H),
    ]
    if not cfg.tie_word_embeddings:
        out.append(_linear("lm_head.weight", ("lm_head",), H, V))
    for i, t in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        out += _layer_entries(cfg, pre, ("layers", i), t, cfg.is_moe_layer(i), fused_experts(pre))
    if cfg.mtp_num_layers:
        out += [
            _linear("mtp.fc.weight", ("mtp", "fc"), 2 * H, H),
            _vector("mtp.pre_fc_norm_embedding.weight", ("mtp", "pre_fc_norm_embedding"), H),
            _vector("mtp.pre_fc_norm_hidden.weight", ("mtp", "pre_fc_norm_hidden"), H),
            _vector("mtp.norm.weight", ("mtp", "norm"), H),
        ]
        for j in range(cfg.mtp_num_layers):
            pre = f"mtp.layers.{j}."
            out += _layer_entries(
                cfg, pre, ("mtp", "layers", j), FULL, cfg.mtp_layer_is_moe(j), fused_experts(pre)
            )
    return out


def _empty_tree(cfg: ModelConfig) -> dict:
    tree: dict = {"layers": [dict() for _ in range(cfg.num_layers)]}
    if cfg.mtp_num_layers:
        tree["mtp"] = {"layers": [dict() for _ in range(cfg.mtp_num_layers)]}
    return tree


def _set(tree, path, value):
    node = tree
    for key in path[:-1]:
        if isinstance(node, dict) and key not in node:
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


# ----------------------------------------------------------------------------- loading


def _canonical(name: str) -> str | None:
    """Checkpoint name -> canonical name (`model.` prefix), or None for tensors we never use."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    if name.startswith(("model.visual.", "visual.")) or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def _check_shard_path(folder: str, fn, index: str) -> None:
    """A shard named by the index must be a file inside the model folder: a relative path with no
    `..`, not absolute, and not resolving (through symlinks) outside the folder."""

    def bad(why):
        raise CheckpointError(
            f"{index}: shard path {fn!r} {why}; shard paths must be file names "
            "inside the model folder (fix or regenerate the index)"
        )

    if not isinstance(fn, str) or not fn:
        bad("is not a file name")
    parts = fn.replace("\\", "/").split("/")
    if os.path.isabs(fn) or fn.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", fn):
        bad("is absolute")
    if ".." in parts:
        bad("leaves the folder ('..')")
    root = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(folder, fn))
    if os.path.commonpath([root, target]) != root:
        bad(f"resolves outside the folder (to {target})")


def _index_files(path: str) -> dict[str, str]:
    """Map checkpoint tensor name -> safetensors file path (validating that files exist)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"bad index file {index}: {e}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"bad index file {index}: weight_map is not an object")
        for fn in sorted(set(weight_map.values())):
            _check_shard_path(path, fn, index)
        missing = sorted(
            {fn for fn in weight_map.values() if not os.path.isfile(os.path.join(path, fn))}
        )
        if missing:
            raise CheckpointError(
                f"checkpoint {path}: shard file(s) listed in model.safetensors.index.json "
                f"are missing: {', '.join(missing)}"
            )
        return {name: os.path.join(path, fn) for name, fn in weight_map.items()}
    if os.path.isfile(single):
        return {name: single for name in SafetensorsFile(single).shapes}
    found = sorted(os.listdir(path))
    raise CheckpointError(
        f"checkpoint {path}: no model.safetensors or model.safetensors.index.json "
        f"(found: {', '.join(found) or 'nothing'}); only safetensors checkpoints are supported"
    )


# GDN leaves kept in fp32 whatever the params dtype: real Qwen3-Next / Qwen3.5 checkpoints store
# A_log and the gated norm weight (linear_attn.norm.weight) in fp32 next to bf16 weights, and vLLM
# and SGLang keep them fp32 (the decay exp(A_log) and the norm scale lose 3 digits in bf16). The
# forward reads them as fp32 (layers.gdn_in_proj, layers.gated_rms_norm).
FP32_GDN_LEAVES = ("A_log", "norm_w")


def leaf_dtype(path: tuple, dtype) -> jnp.dtype:
    """The dtype a converted leaf at params `path` gets when loading into params of `dtype`."""
    if len(path) >= 2 and path[-2] == "gdn" and path[-1] in FP32_GDN_LEAVES:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


def _name_list(names, limit=12) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    dtype=None,
    place: Callable[[tuple, jax.Array], jax.Array] | None = None,
):
    """Load a local Hugging Face folder into (cfg, params).

    Args:
      path: folder with config.json and model.safetensors (or an index + shards).
      cfg: use this config instead of reading config.json.
      dtype: params dtype (default cfg.dtype, the checkpoint's own); the GDN A_log and norm
        weights stay fp32 (`FP32_GDN_LEAVES`), as the checkpoints store them.
      place: called on each converted leaf as place(path in params, leaf) -> leaf, before the next
        tensor is read (tensor parallelism: `parallel.layout_leaf` puts each leaf on the mesh at
        once, so no device holds the whole model).
    Returns (cfg, params); cfg.mtp_num_layers reflects the MTP tensors actually present.
    Raises CheckpointError naming any missing file, missing/unexpected tensor or shape mismatch.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist")
    if cfg is None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"checkpoint {path}: config.json is missing")
        cfg = ModelConfig.from_pretrained(path)
    dtype = jnp.dtype(dtype or cfg.dtype)

    files = _index_files(path)
    readers = {fn: SafetensorsFile(fn) for fn in sorted(set(files.values()))}
    present: dict[str, tuple[str, str]] = {}  # canonical name -> (file, stored name)
    for name, fn in files.items():
        canon = _canonical(name)
        if canon is not None:
            present[canon] = (fn, name)
    if cfg.tie_word_embeddings:
        present.pop("lm_head.weight", None)

    # MTP: the tensors decide (transformers drops mtp.* on load, so re-saved models lack them).
    mtp_layers = {int(m.group(1)) for n in present if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    has_mtp = any(n.startswith("mtp.") for n in present)
    if not has_mtp and cfg.mtp_num_layers:
        log.warning(
            "config.json declares %d MTP layer(s) but the checkpoint has no mtp.* tensors: "
            "loading without the MTP head",
            cfg.mtp_num_layers,
        )
        cfg = dataclasses.replace(cfg, mtp_num_layers=0)
    elif has_mtp and not cfg.mtp_num_layers:
        cfg = dataclasses.replace(cfg, mtp_num_layers=max(mtp_layers, default=0) + 1)

    fused = lambda pre: pre + "mlp.experts.gate_up_proj" in present
    entries = checkpoint_entries(cfg, fused)
    expected = {n for e in entries for n in e.hf}
    missing = expected - present.keys()
    if missing:
        raise CheckpointError(
            f"checkpoint {path}: {len(missing)} tensor(s) missing: {_name_list(missing)}"
        )
    unexpected = present.keys() - expected
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path}: {len(unexpected)} unexpected tensor(s) (not part of a "
            f"{cfg.family} model with this config): {_name_list(unexpected)}"
        )
    for e in entries:
        for n, shape in e.hf.items():
            fn, stored = present[n]
            got = readers[fn].shapes[stored]
            if tuple(got) != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {path}: tensor {stored} has shape {tuple(got)}, "
                    f"expected {tuple(shape)} for this config"
                )

    from bole_jax.model import parallel

    parallel.check_weights_fit(cfg, dtype)  # a clear error, not an OOM partway through loading
    params = _empty_tree(cfg)
    # Converted on the host (numpy), then one transfer per leaf: device-side conversions would
    # compile a program per tensor shape (dozens on every start, cached or not).
    for e in entries:
        arrays = []
        for n in e.hf:
            fn, stored = present[n]
            arrays.append(readers[fn].get(stored))
        for p, leaf in zip(e.paths, e.to_params(*arrays)):
            leaf = np.asarray(leaf).astype(leaf_dtype(p, dtype), copy=False)
            _set(params, p, jax.device_put(leaf) if place is None else place(p, leaf))
    return cfg, params


# ----------------------------------------------------------------------------- saving


def hf_state_dict(cfg: ModelConfig, params: dict, dtype=None) -> dict[str, np.ndarray]:
    """params -> {HF tensor name: numpy array} in the family's layout (per-expert MoE keys).
    Params in a tensor-parallel layout (cfg.tp > 1) are converted back to the canonical one."""
    if cfg.tp > 1:
        from bole_jax.model import parallel

        params, cfg = parallel.unshard_params(params, cfg), dataclasses.replace(cfg, tp=1)
    out = {}
    for e in checkpoint_entries(cfg):
        if any(p[0] == "mtp" for p in e.paths) and "mtp" not in params:
            continue
        leaves = [_get(params, p) for p in e.paths]
        for n, a in zip(e.hf, e.to_hf(*leaves)):
            a = np.asarray(a if dtype is None else a.astype(dtype))
            assert a.shape == tuple(e.hf[n]), (n, a.shape, e.hf[n])
            out[n] = a
    return out


def save_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: dict,
    dtype=None,
    max_shard_bytes: int | None = None,
):
    """Write `cfg` and `params` as a Hugging Face folder (config.json + model.safetensors).

    dtype: tensor dtype to write (default: the params' own, e.g. bf16 with the fp32 GDN leaves).
      config.json's dtype follows the embedding's.
    max_shard_bytes: split the tensors over model-0000i-of-0000n.safetensors files of about this
      size (a tensor is never split) with a model.safetensors.index.json, as save_pretrained's
      max_shard_size does (default: one model.safetensors)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = hf_state_dict(cfg, params, dtype)
    written = str(np.dtype(next(iter(tensors.values())).dtype))
    if "mtp" not in params:
        cfg = dataclasses.replace(cfg, mtp_num_layers=0)
    d = cfg.to_hf_dict()
    d["dtype"] = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}.get(
        written, cfg.dtype
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    if max_shard_bytes is None:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        return
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fn), shard)
        weight_map.update({name: fn for name in shard})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
