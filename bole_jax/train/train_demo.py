"""Train the embedded demo model: a small Qwen3-Next-architecture hybrid and its MTP head.

    python -m bole_jax.train.train_demo --out DIR [--train-seconds 420] [--size code] [--seed 0]

The recipe (bole_jax/train/README.md has the GPU command and the time budget):

1. Data (`corpus.collect_corpus`): every Python source and text doc of the machine (stdlib,
   site-packages, /usr/share/doc), visited in a hash order of their relative paths, exact
   duplicates dropped, licences / packaging metadata / minified or numeric files skipped,
   split train / validation by content hash (1%), capped at --max-bytes of training text.
   Tokenised with the shipped tokenizer (or one retrained on the training documents with
   --tokenizer-vocab), documents joined with EOS, the whole stream kept on the device.
2. Target (phase 1): next-token cross-entropy on random windows (seeded by step), AdamW
   (b2 0.95, decoupled weight decay on matrices only), global-norm clipping, linear warm-up then
   cosine decay; fp32 master weights, bf16 compute (matrices cast per step; norms, A_log,
   dt_bias and the logits / softmax stay fp32).
3. MTP head (phase 2, target frozen): trained as the drafter runs it (spec_decode/drafter.py):
   level 1 at position q reads embed(x_q) and the target's hidden_{q-1}; level j >= 2 reads
   embed(x_q) and the head's own output of level j-1 at q-1, and attends to the level-1
   entries up to q-j+1 plus its draft ancestors (one per level), exactly the drafter's mask.
   Labels: with --mtp-distill (default) the target's own next-token distribution at q (soft
   cross-entropy = KL to the target + const), else the data token x_{q+1}. Level j's loss
   weighs --mtp-level-decay^(j-1).
4. Time: --train-seconds is split between the phases (--mtp-fraction); each phase times its
   first steps (inside the warm-up, whose learning rates do not depend on the step count) and
   then fixes its step count, so the cosine schedule ends when the time does; --wall-seconds
   caps the whole command. The step counts are logged: --target-steps / --mtp-steps repeat a
   run exactly (same data order, init and schedule; bitwise on CPU).
5. Export: DIR in Hugging Face layout (config.json, bf16 safetensors shards of at most
   --shard-mb with their index, tokenizer.json, tokenizer_config.json with the ChatML template,
   draft_vocab.json from the training token counts) and DIR/train_log.json; --bundle DIR2
   copies the shards, train_log.json and a meta.tar of the other files to DIR2 (few files).

The compiles of phase 1 overlap data loading and those of phase 2 and the evaluation overlap
phase 1 (background threads). Never trains on the evaluation sets (corpus.EXCLUDE).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import ModelConfig, abstract_params, init_params, load_hf_checkpoint
from bole_jax.model import logits as lm_logits
from bole_jax.model.blocks import mlp_block
from bole_jax.model.cache import init_gdn_cache
from bole_jax.model.config import FULL, LINEAR
from bole_jax.model.layers import attend, attn_out, attn_qkv, rms_norm
from bole_jax.model.model import decoder_layer
from bole_jax.model.weights import save_hf_checkpoint

PACKAGE_DEFAULT = Path(__file__).resolve().parents[1] / "default_model"
T_START = _T_IMPORT = time.time()


SIZES = {
    # ~16M parameters: the model shipped before this recipe (3.6 minutes of training).
    "demo": dict(
        hidden_size=320,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rotary_dim=16,
        gdn_num_key_heads=4,
        gdn_num_value_heads=8,
        gdn_key_dim=32,
        gdn_value_dim=32,
        intermediate_size=960,
    ),
    # ~25M parameters (22.8M target + 2.2M MTP, 51 MB in bf16): this recipe's model. Same depth
    # as "demo" (8 layers: the CPU compile and per-token launch count stay where they were),
    # wider, GDN heads of 64 (a 4x larger recurrent state per head than "demo").
    "code": dict(
        hidden_size=384,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rotary_dim=16,
        gdn_num_key_heads=4,
        gdn_num_value_heads=8,
        gdn_key_dim=64,
        gdn_value_dim=64,
        intermediate_size=1152,
    ),
    # ~60M parameters with Qwen3-Next's GDN head size (dk = dv = 128, 16 value heads): a 6.3 MB
    # fp32 recurrent state per request, so one full state per tree node (the per-node baseline)
    # costs 0.4 GB per request at 64 nodes and memory binds in the online benchmark.
    "wide": dict(
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        rotary_dim=32,
        gdn_num_key_heads=8,
        gdn_num_value_heads=16,
        gdn_key_dim=128,
        gdn_value_dim=128,
        intermediate_size=1536,
    ),
    # CPU smoke tests only.
    "tiny": dict(
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rotary_dim=8,
        gdn_num_key_heads=2,
        gdn_num_value_heads=2,
        gdn_key_dim=16,
        gdn_value_dim=16,
        intermediate_size=128,
    ),
}


def demo_config(
    vocab_size: int, eos_id: int, size: str = "demo", num_layers: int = 8, full_every: int = 4
) -> ModelConfig:
    """num_layers layers, every `full_every`-th gated attention, the others GDN (8, 4: 6 GDN + 2
    attention, Qwen3-Next's pattern); one MTP layer; the widths of SIZES[size]."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {sorted(SIZES)}")
    return ModelConfig(
        family="qwen3_next",
        vocab_size=vocab_size,
        num_layers=num_layers,
        layer_types=tuple(LINEAR if (i + 1) % full_every else FULL for i in range(num_layers)),
        rope_theta=10000.0,
        conv_kernel=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_ids=(eos_id,),
        dtype="float32",
        mtp_num_layers=1,
        max_position_embeddings=4096,
        **SIZES[size],
    )


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- data


def tokenize(tok, docs: list[str], eos: int) -> np.ndarray:
    """Documents -> one int32 stream, EOS after each document."""
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)(docs, add_special_tokens=False)
    lens = np.fromiter((len(e.ids) + 1 for e in enc), np.int64, len(enc))
    out = np.empty(int(lens.sum()), np.int32)
    i = 0
    for e, n in zip(enc, lens):
        out[i : i + n - 1] = e.ids
        out[i + n - 1] = eos
        i += n
    return out


def val_windows(val: np.ndarray, length: int, count: int) -> np.ndarray:
    """The first `count` consecutive non-overlapping windows of `length` tokens ([count, length])."""
    n = min(count, len(val) // length)
    if n == 0:
        raise ValueError(
            f"validation stream has {len(val)} tokens, fewer than one window of "
            f"{length}: lower --seq or raise --max-val-bytes"
        )
    return val[: n * length].reshape(n, length)


@functools.partial(jax.jit, static_argnums=(3, 4))
def sample_windows(data: jax.Array, key: jax.Array, step: jax.Array, batch: int, length: int):
    """[batch, length] windows of the token stream at uniform random starts (key folded with step:
    the batch of a step does not depend on what ran before it)."""
    starts = jax.random.randint(jax.random.fold_in(key, step), (batch,), 0, data.shape[0] - length)
    return data[starts[:, None] + jnp.arange(length)[None]]


# ----------------------------------------------------------------------------- training forward


def heads_major(kv: jax.Array) -> jax.Array:
    """[B, T, Hkv, D] keys or values -> [B, Hkv, T, D], the layout `attend` reads (the cache's)."""
    return jnp.swapaxes(kv, 1, 2)


@jax.custom_vjp
def embed_rows(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """embed[tokens]; its gradient is a one-hot matmul instead of a scatter-add (GPU scatter-add
    uses atomics: not run-to-run deterministic)."""
    return embed[tokens]


def _embed_fwd(embed, tokens):
    # A [V, 0] array carries the table's row count and dtype as a JAX-typed residual.
    return embed[tokens], (tokens, jnp.zeros((embed.shape[0], 0), embed.dtype))


def _embed_bwd(res, g):
    tokens, like = res
    oh = jax.nn.one_hot(tokens.reshape(-1), like.shape[0], dtype=g.dtype)
    d = jnp.einsum("nv,nh->vh", oh, g.reshape(-1, g.shape[-1]), preferred_element_type=jnp.float32)
    return d.astype(like.dtype), None


embed_rows.defvjp(_embed_fwd, _embed_bwd)


def compute_params(params, dtype):
    """Matrices in the compute dtype; 1-D leaves (norms, A_log, dt_bias) stay fp32."""
    return jax.tree.map(lambda x: x.astype(dtype) if x.ndim >= 2 else x, params)


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))[None]


def target_hidden(p, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The target's final-normed hidden states [B, T, H] for tokens [B, T] from position 0.

    The training form of `model.forward` on an empty cache (tests check equality): the same
    GDN decoder layers (chunked rule, zero initial state), attention layers from the same pieces
    but attending over the window's own keys (no KV-cache scatter), the embedding through
    `embed_rows`."""
    b, t = tokens.shape
    x = embed_rows(p["embed"], tokens)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = causal_mask(t)
    num_new = jnp.full((b,), t, jnp.int32)
    for i, lp in enumerate(p["layers"]):
        if cfg.layer_types[i] == LINEAR:
            x, _ = decoder_layer(
                lp,
                cfg,
                LINEAR,
                x,
                init_gdn_cache(cfg, b, x.dtype),
                positions=positions,
                mask=None,
                slots=None,
                num_new=num_new,
            )
        else:
            h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
            q, k, v, gate = attn_qkv(lp["attn"], h, positions, cfg)
            o = attend(q, heads_major(k), heads_major(v), mask, cfg)
            x = mlp_block(lp, x + attn_out(lp["attn"], o, gate, cfg), cfg)
    return rms_norm(x, p["final_norm"], cfg.rms_norm_eps)


def token_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross-entropy (fp32) of logits [..., V] against int labels [...]."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]


def target_loss(params, cfg: ModelConfig, x: jax.Array, dtype):
    """Mean next-token cross-entropy of fp32 master params on windows x [B, T+1]."""
    p = compute_params(params, dtype)
    hidden = target_hidden(p, cfg, x[:, :-1])
    return jnp.mean(token_ce(lm_logits(p, cfg, hidden), x[:, 1:]))


def level_mask(t: int, level: int) -> jax.Array:
    """[1, T, level*T] bool: which MTP entries a level-`level` query at position q sees, keys laid
    out level-major (entry (i, s) = level i + 1 at position s at column i*T + s).

    As the drafter's tree mask on the chain through q: the level-1 entries (target hidden) at
    positions 1 .. q-level+1 (the committed prefix up to the draft root) and the level-i entry at
    q-level+i for i = 2 .. level (its ancestors, then itself). Rows q < level have no root and are
    masked out of the loss; they see their own entry so that their softmax stays finite."""
    q = jnp.arange(t)[:, None]
    s = jnp.arange(t)[None, :]
    blocks = [(s >= 1) & (s <= q - level + 1)]
    blocks += [s == q - level + i for i in range(2, level + 1)]
    own = [jnp.zeros((t, t), bool)] * (level - 1) + [s == q]
    return (jnp.concatenate(blocks, 1) | jnp.concatenate(own, 1))[None]


def mtp_level(p, cfg: ModelConfig, tokens, h_prev, positions, kv, mask):
    """One MTP pass over all positions (the training form of `mtp.mtp_forward`): tokens [B, T],
    h_prev [B, T, H], kv: per MTP layer the (keys, values) lists of the earlier levels
    ([B, T, Hkv, D] each), mask [1, T, (len(keys) + 1) T]. Returns (out [B, T, H], kv + this
    level's entries)."""
    mp = p["mtp"]
    eps = cfg.rms_norm_eps
    e = rms_norm(embed_rows(p["embed"], tokens), mp["pre_fc_norm_embedding"], eps)
    h = rms_norm(h_prev.astype(e.dtype), mp["pre_fc_norm_hidden"], eps)
    x = jnp.concatenate([e, h], axis=-1) @ mp["fc"]
    new_kv = []
    for lp, (ks, vs) in zip(mp["layers"], kv):
        hh = rms_norm(x, lp["input_norm"], eps)
        q, k, v, gate = attn_qkv(lp["attn"], hh, positions, cfg)
        ks, vs = ks + [k], vs + [v]
        o = attend(
            q, heads_major(jnp.concatenate(ks, 1)), heads_major(jnp.concatenate(vs, 1)), mask, cfg
        )
        x = mlp_block(lp, x + attn_out(lp["attn"], o, gate, cfg), cfg)
        new_kv.append((ks, vs))
    return rms_norm(x, mp["norm"], eps), new_kv


def mtp_loss(
    mtp, params, cfg: ModelConfig, x: jax.Array, dtype, levels: int, decay: float, distill: bool
):
    """MTP loss on the frozen target, x [B, T+1]. Returns (weighted loss, metrics) with metrics
    per level j: "agree{j}" top-1 agreement with the target's argmax (what greedy acceptance
    checks), "kl{j}" KL(target || head), "ce{j}" cross-entropy against the data token."""
    p = compute_params(dict(params, mtp=mtp), dtype)
    b, t1 = x.shape
    t = t1 - 1
    tokens, data_next = x[:, :t], x[:, 1:]
    hidden = jax.lax.stop_gradient(target_hidden(p, cfg, tokens))  # hidden_q predicts x_{q+1}
    t_logp = jax.lax.stop_gradient(jax.nn.log_softmax(lm_logits(p, cfg, hidden)))
    t_prob, t_arg = jnp.exp(t_logp), jnp.argmax(t_logp, -1)
    t_ent = -jnp.sum(t_prob * t_logp, -1)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zero = jnp.zeros_like(hidden[:, :1])
    h_prev = jnp.concatenate([zero, hidden[:, :-1]], 1)  # level 1 at q reads hidden_{q-1}
    kv = [([], []) for _ in p["mtp"]["layers"]]
    total, wsum, metrics = 0.0, 0.0, {}
    for j in range(1, levels + 1):
        out, kv = mtp_level(p, cfg, tokens, h_prev, positions, kv, level_mask(t, j))
        logq = jax.nn.log_softmax(lm_logits(p, cfg, out))
        valid = (jnp.arange(t) >= j)[None, :].astype(jnp.float32)
        n = b * jnp.sum(valid)
        soft = -jnp.sum(t_prob * logq, -1)  # soft cross-entropy = KL + target entropy
        hard = -jnp.take_along_axis(logq, data_next[..., None], -1)[..., 0]
        lj = jnp.sum((soft if distill else hard) * valid) / n
        w = decay ** (j - 1)
        total, wsum = total + w * lj, wsum + w
        metrics[f"agree{j}"] = jnp.sum((jnp.argmax(logq, -1) == t_arg) * valid) / n
        metrics[f"kl{j}"] = jnp.sum((soft - t_ent) * valid) / n
        metrics[f"ce{j}"] = jnp.sum(hard * valid) / n
        h_prev = jnp.concatenate([zero, out[:, :-1]], 1)  # level j+1 at q reads out_j at q-1
    return total / wsum, metrics


# ----------------------------------------------------------------------------- optimisation


def lr_at(step, total, peak, warmup, min_frac):
    """Linear warm-up over `warmup` steps, then cosine from peak to min_frac * peak at `total`.
    During the warm-up the rate does not depend on `total` (the timing probe runs there)."""
    step = step.astype(jnp.float32)
    warm = jnp.minimum(1.0, (step + 1.0) / warmup)
    frac = jnp.clip((step - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
    return peak * warm * (min_frac + (1.0 - min_frac) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))


def make_optimizer(b1: float, b2: float, weight_decay: float, clip: float):
    import optax

    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.scale_by_adam(b1=b1, b2=b2, eps=1e-8),
        optax.add_decayed_weights(
            weight_decay, mask=lambda t: jax.tree.map(lambda x: x.ndim >= 2, t)
        ),
    )


def make_step(loss_fn, opt):
    """step(trainable, opt_state, frozen, x, step, total, hp) -> (trainable', state', loss,
    metrics). hp: peak, warmup, min_frac (fp32 scalars, traced: no recompiles across values)."""

    def step(trainable, state, frozen, x, i, total, hp):
        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, x)
        lr = lr_at(i, total, hp["peak"], hp["warmup"], hp["min_frac"])
        upd, state = opt.update(g, state, trainable)
        trainable = jax.tree.map(lambda p, u: p - lr * u, trainable, upd)
        gnorm = jnp.sqrt(
            sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g))
        )
        return trainable, state, loss, dict(metrics, grad_norm=gnorm, lr=lr)

    return jax.jit(step, donate_argnums=(0, 1))


_COMPILED: dict = {}


def compiled(key, jitted, *args, **static):
    """AOT-compiled `jitted` for the shapes of args (arrays or ShapeDtypeStructs) and the static
    keyword arguments, cached per key in this process (a second run of the recipe reuses its
    programs)."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    k = (
        key,
        str(jax.tree.structure(spec)),
        tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves(spec)),
    )
    if k not in _COMPILED:
        _COMPILED[k] = jitted.lower(*spec, **static).compile()
    return _COMPILED[k]


class Background:
    """Run fn() in a thread; .get() waits and re-raises its exception."""

    def __init__(self, fn):
        self._out, self._err = None, None

        def run():
            try:
                self._out = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in get()
                self._err = e

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def get(self):
        self._t.join()
        if self._err is not None:
            raise self._err
        return self._out


def run_phase(
    name,
    step_fn,
    trainable,
    state,
    frozen,
    data,
    key,
    *,
    batch,
    length,
    hp,
    seconds,
    fixed_steps,
    deadline,
    reserve,
    probe,
    log_every,
):
    """Train for `fixed_steps`, else as many steps as fit min(seconds, deadline - reserve) from
    the phase start (timed over the first `probe` steps, all inside the warm-up). Returns
    (trainable, state, summary dict with the loss curve)."""
    t0 = time.time()
    if probe >= float(hp["warmup"]):
        raise ValueError(
            f"[{name}] the timing probe ({probe} steps) must end inside the warm-up "
            f"({float(hp['warmup']):.0f} steps)"
        )
    total = jnp.float32(fixed_steps or 1 << 30)
    curve, pending, metrics = [], [], {}
    n, i, per_step, t_probe, stopped_early = fixed_steps, 0, None, None, False
    while n is None or i < n:
        if (
            fixed_steps is None
            and per_step
            and i % log_every == 0
            and (time.time() > deadline - 0.5 * reserve)
        ):
            # Steps slowed down after the probe: stop with the schedule unfinished rather than
            # overrun the wall budget (logged).
            log(f"[{name}] stopping early at step {i}/{n}: the wall budget is nearly spent")
            n, stopped_early = i, True
            break
        x = sample_windows(data, key, jnp.int32(i), batch, length)
        trainable, state, loss, metrics = step_fn(
            trainable, state, frozen, x, jnp.int32(i), total, hp
        )
        pending.append((loss, metrics))
        i += 1
        if i == 1 or i == probe:
            jax.block_until_ready(loss)
            if i == 1:
                t_probe = time.time()
                log(f"[{name}] first step done ({t_probe - t0:.1f}s after the phase start)")
            else:
                per_step = (time.time() - t_probe) / (probe - 1)
                if n is None:
                    left = min(seconds - (time.time() - t0), deadline - reserve - time.time())
                    n = max(probe + 1, i + int(left / per_step))
                    total = jnp.float32(n)
                log(
                    f"[{name}] {per_step * 1e3:.1f} ms/step, {batch * (length - 1) / per_step / 1e3:.0f}k "
                    f"tokens/s: {n} steps"
                )
        if pending and (i % log_every == 0 or i == n):
            vals = jax.device_get(pending)
            row = dict(
                step=i,
                loss=round(float(np.mean([v[0] for v in vals])), 4),
                t=round(time.time() - T_START, 1),
            )
            for k in vals[-1][1]:
                row[k] = round(float(np.mean([v[1][k] for v in vals])), 5)
            curve.append(row)
            pending = []
            if len(curve) % 5 == 1 or i == n:
                log(
                    f"[{name}] step {i}/{n} "
                    + " ".join(f"{k} {v}" for k, v in row.items() if k not in ("step", "t"))
                )
    jax.block_until_ready(trainable)
    wall = time.time() - t0
    summary = dict(
        steps=n,
        batch=batch,
        seq=length - 1,
        ms_per_step_probe=round(per_step * 1e3, 2) if per_step else None,
        wall_s=round(wall, 1),
        tokens_seen=int(n) * batch * (length - 1),
        tokens_per_s=round(n * batch * (length - 1) / wall),
        stopped_early=stopped_early,
        curve=curve,
    )
    return trainable, state, summary


# ----------------------------------------------------------------------------- export


def reshard(folder: Path, max_bytes: int) -> None:
    """Split folder/model.safetensors into HF shards of at most max_bytes with an index (keeps
    every file of the shipped model small)."""
    from safetensors.numpy import load_file, save_file

    src = folder / "model.safetensors"
    if src.stat().st_size <= max_bytes:
        return
    tensors = load_file(str(src))
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if nbytes > max_bytes:
            raise ValueError(
                f"tensor {name} ({nbytes} bytes) exceeds the shard limit {max_bytes}: "
                "raise --shard-mb"
            )
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(dict(metadata=dict(total_size=total), weight_map=weight_map), indent=1)
    )
    src.unlink()


def bundle(folder: Path, dest: Path) -> list[str]:
    """Copy folder's weight files and train_log.json to dest, and every other file into
    dest/meta.tar (the device machine returns at most 8 files). Unpack with
    `tar -xf meta.tar -C MODEL_DIR` next to the copied shards."""
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(dest / "meta.tar", "w") as tar:
        for f in sorted(folder.iterdir()):
            if f.suffix == ".safetensors" or f.name == "train_log.json":
                shutil.copy(f, dest / f.name)
                names.append(f.name)
            else:
                tar.add(f, arcname=f.name)
    return names + ["meta.tar"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def next_token(p, buf, t, *, cfg):
    """Greedy next token after buf[0, :t] ([1, W] int32; p in the compute dtype)."""
    return jnp.argmax(lm_logits(p, cfg, target_hidden(p, cfg, buf))[0, t - 1])


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def eval_target_sum(params, x, *, cfg, dtype):
    """(summed next-token cross-entropy, count of top-1 hits) over windows x [B, T+1]."""
    p = compute_params(params, dtype)
    lg = lm_logits(p, cfg, target_hidden(p, cfg, x[:, :-1]))
    return jnp.sum(token_ce(lg, x[:, 1:])), jnp.sum(jnp.argmax(lg, -1) == x[:, 1:])


SAMPLE_WINDOW = 128


def greedy_samples(fn, p, cfg, tok, prompts, new_tokens: int, window: int = SAMPLE_WINDOW):
    """Greedy continuations by the trained target with fn = `next_token` (full-window recompute
    per token: a check of the weights, not of the engine; causal, so the zeros after t do not
    change the output at t - 1)."""
    out = {}
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False).ids[-(window - new_tokens) :]
        buf = np.zeros((1, window), np.int32)
        buf[0, : len(ids)] = ids
        n = len(ids)
        for _ in range(new_tokens):
            nxt = int(fn(p, jnp.asarray(buf), n))
            buf[0, n] = nxt
            n += 1
            if nxt in cfg.eos_token_ids:
                break
        out[prompt] = tok.decode(buf[0, len(ids) : n].tolist(), skip_special_tokens=True)
    return out


SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "import numpy as np\n\n\ndef softmax(x):",
    'class Stack:\n    """A last-in first-out stack."""\n',
)


# ----------------------------------------------------------------------------- the recipe


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="model folder to write")
    ap.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="also copy shards + train_log.json + meta.tar (the other files) here",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="code")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--full-every", type=int, default=4, help="every N-th layer is attention")
    ap.add_argument(
        "--train-seconds",
        type=float,
        default=420.0,
        help="time for both training phases (split by --mtp-fraction)",
    )
    ap.add_argument(
        "--minutes", type=float, default=None, help="old spelling: --train-seconds = 60 x minutes"
    )
    ap.add_argument(
        "--wall-seconds",
        type=float,
        default=520.0,
        help="cap on the whole recipe (from the start of main, after the imports): "
        "training is shortened to fit",
    )
    ap.add_argument("--mtp-fraction", type=float, default=0.2)
    ap.add_argument(
        "--target-steps", type=int, default=None, help="fixed step count (repeat a run)"
    )
    ap.add_argument("--mtp-steps", type=int, default=None, help="fixed step count (repeat a run)")
    # data
    ap.add_argument(
        "--corpus",
        nargs="*",
        type=Path,
        default=None,
        help="folders / files (default: corpus.machine_roots())",
    )
    ap.add_argument("--max-bytes", type=int, default=300_000_000, help="training text (chars)")
    ap.add_argument("--max-val-bytes", type=int, default=3_000_000)
    ap.add_argument("--val-per-mille", type=int, default=10, help="validation share of files")
    ap.add_argument("--max-file-bytes", type=int, default=256_000)
    ap.add_argument("--tokenizer", type=Path, default=PACKAGE_DEFAULT / "tokenizer.json")
    ap.add_argument(
        "--tokenizer-vocab",
        type=int,
        default=0,
        help="retrain a byte-level BPE of this size on the training documents (0: use --tokenizer)",
    )
    ap.add_argument("--tokenizer-max-bytes", type=int, default=100_000_000)
    # target phase
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--b2", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="compute dtype (master weights fp32)",
    )
    # MTP phase
    ap.add_argument("--mtp-batch", type=int, default=64)
    ap.add_argument("--mtp-seq", type=int, default=512)
    ap.add_argument("--mtp-lr", type=float, default=2e-3)
    ap.add_argument("--mtp-warmup", type=int, default=100)
    ap.add_argument(
        "--mtp-levels",
        type=int,
        default=3,
        help="draft levels unrolled in training (1: the catch-up query only)",
    )
    ap.add_argument("--mtp-level-decay", type=float, default=0.7)
    ap.add_argument(
        "--mtp-distill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="label: the target's own distribution (else the data token)",
    )
    # evaluation / logging / export
    ap.add_argument("--val-windows", type=int, default=256)
    ap.add_argument(
        "--compare-model",
        type=Path,
        default=PACKAGE_DEFAULT,
        help="also report this model's validation loss on the same windows (same "
        "tokenizer only; 'none' to skip)",
    )
    ap.add_argument("--samples", type=int, default=48, help="greedy sample tokens (0: none)")
    ap.add_argument("--probe", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--shard-mb", type=int, default=15, help="max size of one weights file (MiB)")
    return ap


def main(argv=None) -> dict:
    from tokenizers import Tokenizer

    from bole_jax.spec_decode.draft_vocab import write_draft_vocab
    from bole_jax.train.corpus import collect_corpus
    from bole_jax.train.tokenizer import train_tokenizer_from_docs, write_tokenizer_config

    global T_START
    a = build_parser().parse_args(argv)
    if a.minutes is not None:
        a.train_seconds, a.minutes = 60.0 * a.minutes, None
    T_START = t_main = time.time()  # --wall-seconds counts from here (after the imports)
    deadline = T_START + a.wall_seconds
    dtype = jnp.dtype(a.dtype)
    stages = {}
    # The comparison model must share the tokenizer (else its losses mean something else).
    old_cfg = None
    if (
        not a.tokenizer_vocab
        and str(a.compare_model) != "none"
        and (Path(a.compare_model) / "tokenizer.json").is_file()
        and (Path(a.compare_model) / "tokenizer.json").read_bytes() == a.tokenizer.read_bytes()
    ):
        old_cfg = ModelConfig.from_pretrained(a.compare_model)
    a.out.mkdir(parents=True, exist_ok=True)

    # Phase-1 compile needs only the vocabulary size: with the given tokenizer it starts now, in a
    # background thread, while the corpus is read and tokenised.
    tok = None if a.tokenizer_vocab else Tokenizer.from_file(str(a.tokenizer))
    opt_t = make_optimizer(0.9, a.b2, a.weight_decay, a.clip)
    opt_m = make_optimizer(0.9, a.b2, a.weight_decay, a.clip)
    hp_t = dict(
        peak=jnp.float32(a.lr), warmup=jnp.float32(a.warmup), min_frac=jnp.float32(a.min_lr_frac)
    )
    hp_m = dict(
        peak=jnp.float32(a.mtp_lr),
        warmup=jnp.float32(a.mtp_warmup),
        min_frac=jnp.float32(a.min_lr_frac),
    )

    def configure(vocab, eos):
        cfg = demo_config(vocab, eos, a.size, a.layers, a.full_every)
        params = init_params(cfg, jax.random.key(a.seed), "float32")
        mtp = params.pop("mtp")
        return cfg, params, mtp

    eval_bs = 16

    def start_compiles(cfg, params, mtp):
        """Both phases' programs and the evaluation's, compiled in two background threads (from
        shapes only: phase 1 donates the arrays while they run)."""
        params_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        mtp_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mtp)
        s = jax.ShapeDtypeStruct((), jnp.int32)
        f = jax.ShapeDtypeStruct((), jnp.float32)

        def target_fn(tr, _, x):
            return target_loss(tr, cfg, x, dtype), {}

        def mtp_fn(m, p, x):
            return mtp_loss(m, p, cfg, x, dtype, a.mtp_levels, a.mtp_level_decay, a.mtp_distill)

        def compile_target():
            x = jax.ShapeDtypeStruct((a.batch, a.seq + 1), jnp.int32)
            return compiled(
                ("target", cfg, a.dtype, a.weight_decay, a.b2, a.clip),
                make_step(target_fn, opt_t),
                params_spec,
                jax.eval_shape(opt_t.init, params_spec),
                None,
                x,
                s,
                f,
                hp_t,
            )

        def compile_rest():
            x = jax.ShapeDtypeStruct((a.mtp_batch, a.mtp_seq + 1), jnp.int32)
            step_m = compiled(
                (
                    "mtp",
                    cfg,
                    a.dtype,
                    a.mtp_levels,
                    a.mtp_level_decay,
                    a.mtp_distill,
                    a.weight_decay,
                    a.b2,
                    a.clip,
                ),
                make_step(mtp_fn, opt_m),
                mtp_spec,
                jax.eval_shape(opt_m.init, mtp_spec),
                params_spec,
                x,
                s,
                f,
                hp_m,
            )
            xv = jax.ShapeDtypeStruct((eval_bs, a.seq + 1), jnp.int32)
            ev_t = compiled(
                ("eval_t", cfg, a.dtype), eval_target_sum, params_spec, xv, cfg=cfg, dtype=dtype
            )
            ev_m = compiled(
                ("eval_m", cfg, a.dtype, a.mtp_levels, a.mtp_level_decay, a.mtp_distill),
                jax.jit(lambda m, p, x: mtp_fn(m, p, x)[1]),
                mtp_spec,
                params_spec,
                jax.ShapeDtypeStruct((eval_bs, a.mtp_seq + 1), jnp.int32),
            )
            ev_old = nxt = None
            if old_cfg is not None:
                old_spec = {
                    k: v for k, v in abstract_params(old_cfg, "float32").items() if k != "mtp"
                }
                ev_old = compiled(
                    ("eval_t", old_cfg, a.dtype),
                    eval_target_sum,
                    old_spec,
                    xv,
                    cfg=old_cfg,
                    dtype=dtype,
                )
            if a.samples:
                p16 = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(
                        x.shape, dtype if len(x.shape) >= 2 else x.dtype
                    ),
                    params_spec,
                )
                nxt = compiled(
                    ("next", cfg, a.dtype),
                    next_token,
                    p16,
                    jax.ShapeDtypeStruct((1, SAMPLE_WINDOW), jnp.int32),
                    jax.ShapeDtypeStruct((), jnp.int32),
                    cfg=cfg,
                )
            return step_m, ev_t, ev_m, ev_old, nxt

        return Background(compile_target), Background(compile_rest)

    pre = rest = None
    if tok is not None:
        eos = tok.token_to_id("<|endoftext|>")
        cfg, params, mtp = configure(tok.get_vocab_size(), eos)
        pre, rest = start_compiles(cfg, params, mtp)

    corpus = collect_corpus(
        a.corpus,
        max_bytes=a.max_bytes,
        max_val_bytes=a.max_val_bytes,
        val_per_mille=a.val_per_mille,
        max_file_bytes=a.max_file_bytes,
        workers=min(32, os.cpu_count() or 4),
    )
    stages["corpus_s"] = round(time.time() - t_main, 1)
    log(
        f"corpus: {corpus.stats['kept_train']} train files ({corpus.stats['train_chars'] / 1e6:.1f}M "
        f"chars), {corpus.stats['kept_val']} validation files of {corpus.stats['candidates']} "
        "candidates"
    )
    if tok is None:
        t0 = time.time()
        docs, n = [], 0
        for d in corpus.train:
            if n >= a.tokenizer_max_bytes:
                break
            docs.append(d)
            n += len(d)
        tok = train_tokenizer_from_docs(docs, a.tokenizer_vocab, a.out, show_progress=False)
        stages["tokenizer_train_s"] = round(time.time() - t0, 1)
        eos = tok.token_to_id("<|endoftext|>")
        cfg, params, mtp = configure(tok.get_vocab_size(), eos)
        pre, rest = start_compiles(cfg, params, mtp)
    else:
        shutil.copy(a.tokenizer, a.out / "tokenizer.json")
        write_tokenizer_config(a.out)
    t0 = time.time()
    train_ids = tokenize(tok, corpus.train, eos)
    val_ids = tokenize(tok, corpus.val, eos)
    stages["tokenize_s"] = round(time.time() - t0, 1)
    log(
        f"tokens: {len(train_ids) / 1e6:.1f}M train, {len(val_ids) / 1e6:.2f}M validation "
        f"({time.time() - t0:.0f}s)"
    )
    n_target = sum(x.size for x in jax.tree.leaves(params))
    n_mtp = sum(x.size for x in jax.tree.leaves(mtp))
    log(
        f"model: {n_target / 1e6:.2f}M target + {n_mtp / 1e6:.2f}M MTP parameters ({a.size}, "
        f"{a.layers} layers, vocab {cfg.vocab_size})"
    )
    data = jnp.asarray(train_ids)
    vt = val_windows(val_ids, a.seq + 1, a.val_windows)
    vm = val_windows(val_ids, a.mtp_seq + 1, a.val_windows * (a.seq + 1) // (a.mtp_seq + 1))
    if min(len(vt), len(vm)) < eval_bs:
        raise ValueError(
            f"only {len(vt)} validation windows of {a.seq + 1} tokens, need >= {eval_bs}:"
            " raise --max-val-bytes / --val-per-mille or lower --seq"
        )
    key = jax.random.key(a.seed)
    k_target, k_mtp = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)

    step_t = pre.get()
    stages["until_phase1_s"] = round(time.time() - T_START, 1)
    log("phase 1 compiled")
    budget_t = a.train_seconds * (1 - a.mtp_fraction)
    # Reserve behind phase 1: phase 2's share (at least a minimum) and the evaluation/export.
    eval_reserve = 25.0
    reserve_t = max(a.train_seconds * a.mtp_fraction, 30.0) + eval_reserve
    opt_state = opt_t.init(params)
    params, _, log_t = run_phase(
        "target",
        step_t,
        params,
        opt_state,
        None,
        data,
        k_target,
        batch=a.batch,
        length=a.seq + 1,
        hp=hp_t,
        seconds=budget_t,
        fixed_steps=a.target_steps,
        deadline=deadline,
        reserve=reserve_t,
        probe=a.probe,
        log_every=a.log_every,
    )
    step_m, ev_t, ev_m, ev_old, nxt = rest.get()
    # Phase 2 gets what phase 1 left of --train-seconds (at least half its share).
    budget_m = max(a.train_seconds - log_t["wall_s"], a.train_seconds * a.mtp_fraction * 0.5)
    mtp_state = opt_m.init(mtp)
    mtp, _, log_m = run_phase(
        "mtp",
        step_m,
        mtp,
        mtp_state,
        params,
        data,
        k_mtp,
        batch=a.mtp_batch,
        length=a.mtp_seq + 1,
        hp=hp_m,
        seconds=budget_m,
        fixed_steps=a.mtp_steps,
        deadline=deadline,
        reserve=eval_reserve,
        probe=min(a.probe, a.mtp_warmup - 1),
        log_every=a.log_every,
    )

    # Validation on fixed held-out windows.
    t0 = time.time()
    n_t = (len(vt) // eval_bs) * eval_bs
    sums = np.sum(
        [
            jax.device_get(ev_t(params, jnp.asarray(vt[i : i + eval_bs])))
            for i in range(0, n_t, eval_bs)
        ],
        axis=0,
        dtype=np.float64,
    )
    val_loss, val_top1 = sums[0] / (n_t * a.seq), sums[1] / (n_t * a.seq)
    n_m = (len(vm) // eval_bs) * eval_bs
    mvals = [
        jax.device_get(ev_m(mtp, params, jnp.asarray(vm[i : i + eval_bs])))
        for i in range(0, n_m, eval_bs)
    ]
    val_mtp = (
        {k: round(float(np.mean([m[k] for m in mvals])), 5) for k in mvals[0]} if mvals else {}
    )
    compare = None
    if ev_old is not None:
        _, old_params = load_hf_checkpoint(a.compare_model, cfg=old_cfg, dtype="float32")
        old_params = {k: v for k, v in old_params.items() if k != "mtp"}
        s = np.sum(
            [
                jax.device_get(ev_old(old_params, jnp.asarray(vt[i : i + eval_bs])))
                for i in range(0, n_t, eval_bs)
            ],
            axis=0,
            dtype=np.float64,
        ) / (n_t * a.seq)
        compare = dict(
            model=str(a.compare_model),
            val_loss=round(float(s[0]), 4),
            val_top1=round(float(s[1]), 4),
            params=int(sum(x.size for x in jax.tree.leaves(old_params))),
        )
    stages["validation_s"] = round(time.time() - t0, 1)
    log(
        f"validation loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f}, top-1 {val_top1:.3f}) over "
        f"{n_t * a.seq} tokens; "
        f"MTP {val_mtp}; compare {compare}"
    )
    samples = {}
    if a.samples:
        t0 = time.time()
        samples = greedy_samples(
            nxt, compute_params(params, dtype), cfg, tok, SAMPLE_PROMPTS, a.samples
        )
        stages["samples_s"] = round(time.time() - t0, 1)
        for k, v in samples.items():
            log(f"sample {k!r} -> {v!r}")

    # Export.
    t0 = time.time()
    full = dict(params, mtp=mtp)
    save_hf_checkpoint(a.out, cfg, full, dtype="bfloat16")
    reshard(a.out, a.shard_mb << 20)
    counts = np.bincount(train_ids, minlength=cfg.vocab_size)
    write_draft_vocab(
        a.out,
        counts,
        source=f"train_demo training tokens ({len(train_ids)} tokens, "
        f"{corpus.stats['kept_train']} files)",
    )
    stages["export_s"] = round(time.time() - t0, 1)
    recipe = {
        k: ([str(x) for x in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v)
        for k, v in vars(a).items()
    }
    repeat = []
    for k, v in recipe.items():
        flag = "--" + k.replace("_", "-")
        if k in ("target_steps", "mtp_steps", "out", "bundle") or v is None:
            continue
        if isinstance(v, bool):
            repeat.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            repeat.append(" ".join([flag] + v))
        else:
            repeat.append(f"{flag}={v}")
    repeat += [f"--target-steps={log_t['steps']}", f"--mtp-steps={log_m['steps']}"]
    report = dict(
        recipe=recipe,
        repeat_args=" ".join(repeat),
        git_commit=os.environ.get("BOLE_GIT_COMMIT"),
        jax=jax.__version__,
        python=sys.version.split()[0],
        device=str(jax.devices()[0].device_kind),
        backend=jax.default_backend(),
        data=dict(
            corpus.stats,
            train_tokens=int(len(train_ids)),
            val_tokens=int(len(val_ids)),
            chars_per_token=round(corpus.stats["train_chars"] / max(len(train_ids), 1), 3),
        ),
        params_target=int(n_target),
        params_mtp=int(n_mtp),
        config=dataclasses.asdict(cfg),
        target=log_t,
        mtp=log_m,
        val_loss=round(float(val_loss), 4),
        val_ppl=round(math.exp(val_loss), 3),
        val_top1=round(float(val_top1), 4),
        val_tokens_evaluated=int(n_t * a.seq),
        val_mtp=val_mtp,
        compare=compare,
        samples=samples,
        stages=stages,
    )
    report["wall_s"] = round(time.time() - T_START, 1)
    report["wall_since_import_s"] = round(time.time() - _T_IMPORT, 1)
    (a.out / "train_log.json").write_text(json.dumps(report, indent=1))
    if a.bundle:
        report["bundle"] = bundle(a.out, a.bundle)
    log(
        f"wrote {a.out}"
        + (f" and {a.bundle}: {report['bundle']}" if a.bundle else "")
        + f"; wall {report['wall_s']}s"
    )
    print(
        json.dumps(
            {
                k: report[k]
                for k in ("val_loss", "val_mtp", "compare", "wall_s", "stages", "repeat_args")
            }
        )
    )
    return report


if __name__ == "__main__":
    main()
