"""Checkpoint loading/saving: HF folders (all layouts we accept), orbax round trip, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import load_torch_model, make_tiny_hf_model, rel_err, tiny_hf_config, torch_logits

from bole_jax.model import ModelConfig, forward, init_cache, init_params, logits
from bole_jax.model.checkpoint import load_config, restore_params, save_params
from bole_jax.model.weights import (
    CheckpointError,
    SafetensorsFile,
    hf_state_dict,
    load_hf_checkpoint,
    save_hf_checkpoint,
    write_safetensors,
)

_forward = jax.jit(forward, static_argnums=1)


def _tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _read_all(folder) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.shapes}


def _rewrite(src, dst, tensors, config=None):
    """Copy an HF folder, replacing model.safetensors (and config.json when given)."""
    shutil.copytree(src, dst)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


# ----------------------------------------------------------------------------- round trips

ROUND_TRIP = [
    ("qwen3_next", True, 2, dict(mlp_only_layers=[1])),
    ("qwen3_5", False, 3, {}),
    ("qwen3_5_moe", True, 4, {}),
]


@pytest.mark.parametrize("family,moe,seed,overrides", ROUND_TRIP, ids=[r[0] for r in ROUND_TRIP])
def test_save_hf_checkpoint_round_trip(tiny_checkpoint, tmp_path, family, moe, seed, overrides):
    """load -> save_hf_checkpoint writes exactly the tensors save_pretrained wrote, and
    transformers loads the result to the same logits."""
    path, model = tiny_checkpoint(family, moe=moe, seed=seed, **overrides)
    cfg, params = load_hf_checkpoint(path)
    out = str(tmp_path / "resaved")
    save_hf_checkpoint(out, cfg, params)
    ours, ref = _read_all(out), _read_all(path)
    assert sorted(ours) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    reloaded = load_torch_model(out)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9))
    np.testing.assert_array_equal(torch_logits(reloaded, ids), torch_logits(model, ids))
    cfg2, params2 = load_hf_checkpoint(out)
    assert cfg2 == cfg
    _tree_equal(params2, params)


def test_orbax_round_trip(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("qwen3_next", moe=True, seed=2, mlp_only_layers=[1])
    cfg, params = load_hf_checkpoint(path)
    save_params(tmp_path / "ckpt", params, cfg)
    assert load_config(tmp_path / "ckpt") == cfg
    _tree_equal(restore_params(tmp_path / "ckpt"), params)
    # Without a config the stored tree comes back as is; into an explicit bf16 config it is cast.
    save_params(tmp_path / "bare", params)
    assert load_config(tmp_path / "bare") is None
    _tree_equal(restore_params(tmp_path / "bare"), params)
    p16 = restore_params(tmp_path / "ckpt", cfg, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    with pytest.raises(FileNotFoundError, match="no params checkpoint"):
        restore_params(tmp_path / "nothing")


def test_bf16_checkpoint_loads(tmp_path):
    model = make_tiny_hf_model("qwen3_next", seed=5).to(torch.bfloat16)
    path = str(tmp_path / "bf16")
    model.save_pretrained(path)
    cfg, params = load_hf_checkpoint(path)
    assert cfg.dtype == "bfloat16"
    dtypes = _leaf_dtypes(params)
    assert {p for p, d in dtypes.items() if d == jnp.float32} == _fp32_gdn_paths(cfg)
    assert all(d == jnp.bfloat16 for p, d in dtypes.items() if p not in _fp32_gdn_paths(cfg))
    sd = model.state_dict()
    as_np = lambda t: t.float().numpy()
    np.testing.assert_array_equal(
        np.asarray(params["embed"], np.float32), as_np(sd["model.embed_tokens.weight"])
    )
    np.testing.assert_array_equal(
        np.asarray(params["layers"][3]["attn"]["w_k"], np.float32),
        as_np(sd["model.layers.3.self_attn.k_proj.weight"]).T,
    )
    _, p32 = load_hf_checkpoint(path, dtype=jnp.float32)
    assert p32["embed"].dtype == jnp.float32
    hidden, _ = _forward(params, cfg, jnp.zeros((1, 4), jnp.int32), init_cache(cfg, 1, 8))
    assert bool(jnp.all(jnp.isfinite(logits(params, cfg, hidden))))


def _leaf_dtypes(params) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {
        tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path): x.dtype for path, x in flat
    }


def _fp32_gdn_paths(cfg) -> set:
    return {
        ("layers", i, "gdn", n)
        for i, t in enumerate(cfg.layer_types)
        if t == "linear_attention"
        for n in ("A_log", "norm_w")
    }


def test_bf16_checkpoint_keeps_fp32_gdn_leaves(tiny_checkpoint, tmp_path):
    """A checkpoint as released: bf16 weights, A_log and linear_attn.norm.weight stored fp32.
    Loading into bf16 keeps those two fp32, bit for bit (bf16 would round them: exp(A_log) is
    the decay rate), and the forward reads them unrounded: its logits are those of the same
    model with the two leaves rounded to bf16 only when the checkpoint rounds them."""
    path, _ = tiny_checkpoint("qwen3_5", seed=3)
    tensors = {
        k: v if k.endswith(("A_log", "linear_attn.norm.weight")) else v.astype(jnp.bfloat16)
        for k, v in _read_all(path).items()
    }
    assert all(tensors[k].dtype == np.float32 for k in tensors if k.endswith("A_log"))
    with open(os.path.join(path, "config.json")) as f:
        config = {**json.load(f), "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    folder = _rewrite(path, str(tmp_path / "mixed"), tensors, config)
    cfg, params = load_hf_checkpoint(folder)
    assert cfg.dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
    stored32 = _read_all(path)
    for i in (0, 1, 2):
        if cfg.layer_types[i] != "linear_attention":
            continue
        gdn = params["layers"][i]["gdn"]
        assert gdn["A_log"].dtype == jnp.float32 and gdn["norm_w"].dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(gdn["A_log"]), stored32[f"model.layers.{i}.linear_attn.A_log"]
        )
        np.testing.assert_array_equal(
            np.asarray(gdn["norm_w"]), stored32[f"model.layers.{i}.linear_attn.norm.weight"]
        )
        assert not np.array_equal(
            np.asarray(gdn["A_log"].astype(jnp.bfloat16).astype(jnp.float32)),
            stored32[f"model.layers.{i}.linear_attn.A_log"],
        )
    # The forward uses the fp32 leaves: rounding them to bf16 changes the logits.
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 12)))
    rounded = jax.tree_util.tree_map_with_path(
        lambda p, x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params
    )
    out = [
        logits(q, cfg, _forward(q, cfg, ids, init_cache(cfg, 1, 16, jnp.bfloat16))[0])
        for q in (params, rounded)
    ]
    assert bool(jnp.all(jnp.isfinite(out[0]))) and not np.array_equal(
        np.asarray(out[0]), np.asarray(out[1])
    )
    # Resaved, the mixed dtypes survive.
    save_hf_checkpoint(tmp_path / "resaved", cfg, params)
    again = _read_all(tmp_path / "resaved")
    assert {k: v.dtype for k, v in again.items()} == {k: v.dtype for k, v in tensors.items()}


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path):
    path, model = tiny_checkpoint("qwen3_next", moe=True, seed=2, mlp_only_layers=[1])
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    _tree_equal(load_hf_checkpoint(sharded)[1], load_hf_checkpoint(path)[1])


def test_mixed_dtype_sharded_round_trip(tiny_checkpoint, tmp_path):
    """bf16 params with the fp32 GDN leaves -> save_hf_checkpoint over several shards + index
    -> load: the same tree, dtypes and values; transformers loads the folder to the same logits
    as the bf16 values; the shards are plain safetensors (the library reads them)."""
    from safetensors.numpy import load_file

    path, _ = tiny_checkpoint("qwen3_next", moe=True, seed=2, mlp_only_layers=[1])
    cfg, params = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    out = tmp_path / "sharded"
    save_hf_checkpoint(out, cfg, params, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    dtypes = set()
    for fn in shards:
        dtypes |= {str(a.dtype) for a in load_file(str(out / fn)).values()}
    assert dtypes == {"bfloat16", "float32"}
    cfg2, params2 = load_hf_checkpoint(out)
    assert cfg2 == dataclasses.replace(cfg, dtype="bfloat16")
    assert _leaf_dtypes(params2) == _leaf_dtypes(params)
    _tree_equal(params2, params)
    ref = load_torch_model(str(out))
    cfg32, p32 = load_hf_checkpoint(out, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 7))
    hidden, _ = _forward(p32, cfg32, jnp.asarray(ids), init_cache(cfg32, 1, 8, jnp.float32))
    assert rel_err(np.asarray(logits(p32, cfg32, hidden)), torch_logits(ref, ids)) < 1e-5


def test_reader_without_the_library_reads_the_same(tiny_checkpoint, monkeypatch):
    """The built-in fallback reader (no `safetensors` package, or a dtype its numpy binding lacks)
    reads what the library reads; fp8 goes through it."""
    import ml_dtypes

    from bole_jax.model import weights

    path, _ = tiny_checkpoint("qwen3_5", seed=3)
    with_lib = load_hf_checkpoint(path)[1]
    monkeypatch.setattr(weights, "_safetensors_lib", lambda: None)
    _tree_equal(load_hf_checkpoint(path)[1], with_lib)
    monkeypatch.undo()
    fn = os.path.join(os.path.dirname(path) if os.path.isfile(path) else path, "fp8.safetensors")
    t = {"a": np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3fn), "b": np.ones(3, np.float32)}
    write_safetensors(fn, t)
    f = SafetensorsFile(fn)
    assert f.dtypes == {"a": "F8_E4M3", "b": "F32"}
    for k in t:
        np.testing.assert_array_equal(
            np.asarray(f.get(k)).astype(np.float32), t[k].astype(np.float32)
        )
    os.remove(fn)


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_error_shard_path_outside_the_folder(tiny_checkpoint, tmp_path, kind):
    """model.safetensors.index.json may only name files inside the model folder."""
    _, model = tiny_checkpoint("qwen3_5", seed=3)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="100KB")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(folder / victim), str(outside / victim))
    if kind == "absolute":
        new = str(outside / victim)
    elif kind == "dotdot":
        new = f"../outside/{victim}"
    else:
        os.symlink(outside / victim, folder / victim)
        new = victim
    index["weight_map"] = {k: new if v == victim else v for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    why = {
        "absolute": "is absolute",
        "dotdot": r"leaves the folder \('\.\.'\)",
        "symlink": "resolves outside the folder",
    }[kind]
    with pytest.raises(CheckpointError, match=f"shard path .*{why}.*inside the model folder"):
        load_hf_checkpoint(folder)
    # A symlink that stays inside the folder is fine.
    if kind == "symlink":
        os.remove(folder / victim)
        shutil.move(str(outside / victim), str(folder / ("real_" + victim)))
        os.symlink(folder / ("real_" + victim), folder / victim)
        load_hf_checkpoint(folder)


def test_multimodal_prefix_fused_experts_and_mtp(tiny_checkpoint, tmp_path):
    """A Qwen3.5-MoE folder as released: nested text_config, `model.language_model.` prefix, vision
    tensors, fused expert tensors and `mtp.*` tensors."""
    path, _ = tiny_checkpoint("qwen3_5_moe", moe=True, seed=4)
    cfg, params = load_hf_checkpoint(path)
    cfg_mtp = dataclasses.replace(cfg, mtp_num_layers=1)
    mtp = init_params(cfg_mtp, jax.random.key(1))["mtp"]
    tensors = {}
    for k, v in hf_state_dict(cfg_mtp, {**params, "mtp": mtp}).items():
        tensors[
            k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        ] = v
    for pre in [f"model.language_model.layers.{i}.mlp." for i in range(cfg.num_layers)] + [
        "mtp.layers.0.mlp."
    ]:
        E = cfg.num_experts
        g = [tensors.pop(f"{pre}experts.{e}.gate_proj.weight") for e in range(E)]
        u = [tensors.pop(f"{pre}experts.{e}.up_proj.weight") for e in range(E)]
        d = [tensors.pop(f"{pre}experts.{e}.down_proj.weight") for e in range(E)]
        tensors[pre + "experts.gate_up_proj"] = np.concatenate([np.stack(g), np.stack(u)], axis=1)
        tensors[pre + "experts.down_proj"] = np.stack(d)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    text["mtp_num_hidden_layers"] = 1
    config = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    folder = _rewrite(path, str(tmp_path / "released"), tensors, config)
    cfg2, params2 = load_hf_checkpoint(folder)
    assert cfg2 == cfg_mtp
    _tree_equal(params2, {**params, "mtp": mtp})
    # mtp.* tensors present while the config says nothing: the tensors decide.
    config["text_config"].pop("mtp_num_hidden_layers")
    folder = _rewrite(folder, str(tmp_path / "no_mtp_key"), tensors, config)
    assert load_hf_checkpoint(folder)[0].mtp_num_layers == 1
    # Config declares MTP but transformers dropped the tensors when re-saving: load without it.
    assert load_hf_checkpoint(path, cfg=cfg_mtp)[0].mtp_num_layers == 0


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def tiny_folder(tiny_checkpoint, tmp_path):
    """A private copy of a tiny checkpoint that a test may break."""
    path, _ = tiny_checkpoint("qwen3_5", seed=3)
    return shutil.copytree(path, tmp_path / "ckpt")


def test_error_missing_folder_and_config(tiny_folder, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    os.remove(tiny_folder / "config.json")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_hf_checkpoint(tiny_folder)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tiny_folder)


def test_error_unsupported_model_type(tiny_folder):
    d = json.loads((tiny_folder / "config.json").read_text())
    d["model_type"] = "llama"
    (tiny_folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'.*qwen3_next.*qwen3_5"):
        load_hf_checkpoint(tiny_folder)


def test_error_no_weights(tiny_folder):
    os.remove(tiny_folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(tiny_folder)


def _edit_tensors(folder, edit):
    tensors = _read_all(folder)
    edit(tensors)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)


def test_error_missing_tensor(tiny_folder):
    _edit_tensors(tiny_folder, lambda t: t.pop("model.layers.2.linear_attn.in_proj_z.weight"))
    with pytest.raises(
        CheckpointError, match=r"1 tensor\(s\) missing: model.layers.2.linear_attn.in_proj_z.weight"
    ):
        load_hf_checkpoint(tiny_folder)


def test_error_unexpected_tensor(tiny_folder):
    _edit_tensors(
        tiny_folder,
        lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4))}),
    )
    with pytest.raises(
        CheckpointError, match="unexpected tensor.*model.layers.0.self_attn.q_proj.weight"
    ):
        load_hf_checkpoint(tiny_folder)


def test_error_misshaped_tensor(tiny_folder):
    _edit_tensors(
        tiny_folder,
        lambda t: t.update({"model.layers.1.linear_attn.A_log": np.zeros(5, np.float32)}),
    )
    with pytest.raises(
        CheckpointError, match=r"model.layers.1.linear_attn.A_log has shape \(5,\), expected \(4,\)"
    ):
        load_hf_checkpoint(tiny_folder)


def test_error_missing_shard(tiny_checkpoint, tmp_path):
    _, model = tiny_checkpoint("qwen3_5", seed=3)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1]
    os.remove(folder / shard)
    with pytest.raises(CheckpointError, match=f"shard file.*missing: {shard}"):
        load_hf_checkpoint(folder)


# ----------------------------------------------------------------------------- config


def test_config_variants():
    base = tiny_hf_config("qwen3_next", moe=True).to_dict()
    # layer_types derived from full_attention_interval; legacy top-level RoPE keys; eos list.
    d = {k: v for k, v in base.items() if k not in ("layer_types", "rope_parameters")}
    d.update(
        num_hidden_layers=6,
        full_attention_interval=3,
        rope_theta=5e5,
        partial_rotary_factor=0.5,
        eos_token_id=[7, 9],
        torch_dtype="bfloat16",
    )
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.eos_token_ids, cfg.dtype) == (
        5e5,
        16,
        (7, 9),
        "bfloat16",
    )
    assert cfg == ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert hash(cfg) == hash(ModelConfig.from_hf_dict(cfg.to_hf_dict()))
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'"):
        ModelConfig.from_hf_dict({**d, "model_type": "mamba"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="missing required key 'hidden_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "hidden_size"})


def test_config_moe_layers_match_transformers():
    from transformers import Qwen3NextForCausalLM

    hf_cfg = tiny_hf_config(
        "qwen3_next", moe=True, num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    model = Qwen3NextForCausalLM(hf_cfg)
    assert [cfg.is_moe_layer(i) for i in range(8)] == [
        hasattr(l.mlp, "experts") for l in model.model.layers
    ]
    assert [cfg.is_moe_layer(i) for i in range(8)] == [
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        True,
    ]


def test_config_generation_eos_merged(tiny_folder):
    (tiny_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    d = json.loads((tiny_folder / "config.json").read_text())
    d["eos_token_id"] = 6
    (tiny_folder / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_pretrained(tiny_folder).eos_token_ids == (6, 5)
