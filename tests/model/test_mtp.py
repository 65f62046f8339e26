"""MTP head: parity with a small PyTorch reference built from transformers' own layers, loaded
through the real checkpoint path (mtp.* tensors in model.safetensors)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import make_tiny_hf_checkpoint, randomize_, rel_err
from safetensors.torch import load_file, save_file

from bole_jax.model.mtp import init_mtp_cache, mtp_forward
from bole_jax.model.weights import load_hf_checkpoint


class TorchMTP(torch.nn.Module):
    """Reference MTP layer (layout of released Qwen3-Next checkpoints / vLLM's qwen3_next_mtp):
    out = norm(decoder_layer(fc([norm_e(embed(x_p)) ; norm_h(hidden_{p-1})])))."""

    def __init__(self, config, family):
        super().__init__()
        if family == "qwen3_next":
            from transformers.models.qwen3_next import modeling_qwen3_next as m

            norm, layer, rope = (
                m.Qwen3NextRMSNorm,
                m.Qwen3NextDecoderLayer,
                m.Qwen3NextRotaryEmbedding,
            )
        else:
            from transformers.models.qwen3_5 import modeling_qwen3_5 as m

            norm, layer, rope = (
                m.Qwen3_5RMSNorm,
                m.Qwen3_5DecoderLayer,
                m.Qwen3_5TextRotaryEmbedding,
            )
        h, eps = config.hidden_size, config.rms_norm_eps
        full = config.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = norm(h, eps=eps)
        self.pre_fc_norm_hidden = norm(h, eps=eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([layer(config, layer_idx=full)])
        self.norm = norm(h, eps=eps)
        self.rope = rope(config=config)

    def forward(self, embed, ids, hidden, position_ids):
        e = self.pre_fc_norm_embedding(embed(ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = ids.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        emb = self.rope(x, position_ids)
        for layer in self.layers:
            out = layer(x, position_embeddings=emb, attention_mask=mask, position_ids=position_ids)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@torch.no_grad()
def test_mtp_matches_torch_reference(tmp_path, family):
    path, model = make_tiny_hf_checkpoint(tmp_path, family, return_model=True)
    mtp = TorchMTP(model.config, family).eval()
    randomize_(mtp, seed=11)
    # Add the mtp.* tensors to the checkpoint, as released Qwen3-Next / Qwen3.5 folders have them.
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    tensors.update(
        {
            f"mtp.{k}": v.contiguous()
            for k, v in mtp.state_dict().items()
            if not k.startswith("rope.")
        }
    )
    save_file(tensors, st, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        conf = json.load(f)
    conf["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)

    cfg, params = load_hf_checkpoint(path, dtype="float32")
    assert cfg.mtp_num_layers == 1 and "mtp" in params
    rng = np.random.default_rng(0)
    t = 11
    ids = rng.integers(0, cfg.vocab_size, (2, t))
    hidden = rng.normal(size=(2, t, cfg.hidden_size)).astype(np.float32)
    pos = np.tile(np.arange(1, t + 1), (2, 1))
    ref = mtp(
        model.get_input_embeddings(),
        torch.as_tensor(ids),
        torch.as_tensor(hidden),
        torch.as_tensor(pos),
    ).numpy()
    s = np.arange(t + 1)[None, None]
    mask = (s >= 1) & (s <= pos[..., None])
    out, _ = mtp_forward(
        params,
        cfg,
        jnp.asarray(ids),
        jnp.asarray(hidden),
        jnp.asarray(pos),
        jnp.asarray(pos),
        jnp.asarray(mask),
        init_mtp_cache(cfg, 2, t + 1, jnp.float32),
    )
    assert rel_err(np.asarray(out), ref) < 1e-5
