"""Train the embedded demo model: a small Qwen3-Next-architecture hybrid and its MTP head.

    python -m bole_jax.train.train_demo --out DIR [--minutes 8] [--seed 0]

The shipped default model was made on the H200 image with (see benchmarks/results/
demo_train_log.json; the step counts below make the run independent of timing):

    python -m bole_jax.train.train_demo --out DIR --seed 0 --target-steps 1975 --mtp-steps 1393 \
        --corpus /usr/lib/python3.12 /opt/torch/.venv/lib/python3.12/site-packages \
        --max-bytes 120000000

Phase 1 trains the target (GDN + gated attention) on next-token prediction; phase 2 freezes it and
trains the MTP head on the target's hidden states (input: embedding of x_p and the target hidden
at p-1 after the final norm; label: x_{p+1}). Data: the offline corpus of `corpus.py` (Python
sources and documentation found on the machine, never the evaluation sets), tokenised with the
tokenizer given (default: the one shipped with the package), split 99/1 into train/validation
by document. Deterministic given the seed and the corpus. Writes DIR in Hugging Face layout
(config.json, model.safetensors with mtp.* tensors, tokenizer.json) plus train_log.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import ModelConfig, forward, init_cache, init_params
from bole_jax.model import logits as lm_logits
from bole_jax.model.config import FULL, LINEAR
from bole_jax.model.mtp import init_mtp_cache, mtp_forward
from bole_jax.model.weights import save_hf_checkpoint
from bole_jax.train.corpus import corpus_files, iter_documents

PACKAGE_DEFAULT = Path(__file__).resolve().parents[1] / "default_model"


SIZES = {
    # ~16M parameters: the shipped default model.
    "demo": dict(hidden_size=320, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=16,
                 gdn_num_key_heads=4, gdn_num_value_heads=8, gdn_key_dim=32, gdn_value_dim=32,
                 intermediate_size=960),
    # ~60M parameters with Qwen3-Next's GDN head size (dk = dv = 128, 16 value heads): a 6.3 MB
    # fp32 recurrent state per request, so one full state per tree node (the per-node baseline)
    # costs 0.4 GB per request at 64 nodes and memory binds in the online benchmark.
    "wide": dict(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=32,
                 gdn_num_key_heads=8, gdn_num_value_heads=16, gdn_key_dim=128, gdn_value_dim=128,
                 intermediate_size=1536),
}


def demo_config(vocab_size: int, eos_id: int, size: str = "demo") -> ModelConfig:
  """8 layers (6 GDN + 2 attention), one MTP layer; the widths of SIZES[size]."""
  if size not in SIZES:
    raise ValueError(f"unknown size {size!r}; known: {sorted(SIZES)}")
  return ModelConfig(
      family="qwen3_next", vocab_size=vocab_size, num_layers=8,
      layer_types=tuple(LINEAR if (i + 1) % 4 else FULL for i in range(8)),
      rope_theta=10000.0, conv_kernel=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
      eos_token_ids=(eos_id,), dtype="float32", mtp_num_layers=1, max_position_embeddings=4096,
      **SIZES[size])


def load_tokens(tokenizer_path: Path, roots, max_bytes: int, seed: int):
  """Tokenise the corpus: (train ids, validation ids) as int32 arrays, EOS between documents."""
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(str(tokenizer_path))
  eos = tok.token_to_id("<|endoftext|>")
  files = corpus_files(roots, seed=seed)
  docs = list(iter_documents(files, max_bytes=max_bytes))
  n_val = max(1, len(docs) // 100)
  enc = tok.encode_batch(docs)
  seqs = [np.asarray(e.ids + [eos], np.int32) for e in enc]
  return np.concatenate(seqs[n_val:]), np.concatenate(seqs[:n_val]), tok, eos


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(data) - seq - 2, batch)
    yield np.stack([data[s:s + seq + 2] for s in starts])


def target_loss(params, cfg, x):
  """Mean next-token cross-entropy. x [B, T+1] -> scalar, and hidden [B, T, H]."""
  inp, lab = x[:, :-1], x[:, 1:]
  cache = init_cache(cfg, inp.shape[0], inp.shape[1], jnp.float32)
  hidden, _ = forward(params, cfg, inp, cache)
  lg = lm_logits(params, cfg, hidden)
  ce = -jnp.take_along_axis(jax.nn.log_softmax(lg), lab[..., None], axis=-1)[..., 0]
  return jnp.mean(ce), hidden


def mtp_loss(mtp, params, cfg, x):
  """MTP cross-entropy on the frozen target: position p sees x_p and hidden_{p-1}, predicts
  x_{p+1}. x [B, T+2]. Also returns top-1 agreement with the label (acceptance proxy)."""
  full = dict(params, mtp=mtp)
  _, hidden = target_loss(params, cfg, x[:, :-1])
  hidden = jax.lax.stop_gradient(hidden)  # [B, T, H] hidden_t predicts x_{t+1}
  b, t = hidden.shape[:2]
  tokens = x[:, 1:t + 1]  # x_p for p = 1..T, paired with hidden_{p-1}
  labels = x[:, 2:t + 2]
  pos = jnp.broadcast_to(jnp.arange(1, t + 1), (b, t))
  kv = init_mtp_cache(cfg, b, t + 1, jnp.float32)
  s = jnp.arange(t + 1)[None, None]
  mask = (s >= 1) & (s <= pos[..., None])
  out, _ = mtp_forward(full, cfg, tokens, hidden, pos, pos, mask, kv)
  lg = lm_logits(full, cfg, out)
  ce = -jnp.take_along_axis(jax.nn.log_softmax(lg), labels[..., None], axis=-1)[..., 0]
  return jnp.mean(ce), jnp.mean(jnp.argmax(lg, -1) == labels)


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
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      dict(metadata=dict(total_size=total), weight_map=weight_map), indent=1))
  src.unlink()


def main(argv=None):
  import optax

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
  ap.add_argument("--mtp-fraction", type=float, default=0.25, help="share of time for the MTP phase")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--size", choices=sorted(SIZES), default="demo",
                  help="model widths (default demo: the shipped model; wide: Qwen3-Next GDN heads)")
  ap.add_argument("--tokenizer", type=Path, default=PACKAGE_DEFAULT / "tokenizer.json")
  ap.add_argument("--corpus", nargs="*", type=Path, default=None)
  ap.add_argument("--max-bytes", type=int, default=120_000_000)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--shard-mb", type=int, default=15, help="max size of one weights file")
  ap.add_argument("--target-steps", type=int, default=None,
                  help="fixed step count for the target phase (default: fill the time budget); "
                       "fixing both step counts makes a run reproducible")
  ap.add_argument("--mtp-steps", type=int, default=None, help="fixed step count for the MTP phase")
  a = ap.parse_args(argv)

  t_start = time.time()
  train, val, tok, eos = load_tokens(a.tokenizer, a.corpus, a.max_bytes, a.seed)
  print(f"corpus: {len(train)/1e6:.1f}M train tokens, {len(val)/1e6:.2f}M validation tokens "
        f"({time.time() - t_start:.0f}s)", flush=True)
  cfg = demo_config(tok.get_vocab_size(), eos, a.size)
  params = init_params(cfg, jax.random.key(a.seed), "float32")
  mtp = params.pop("mtp")
  n_params = sum(x.size for x in jax.tree.leaves(params))
  n_mtp = sum(x.size for x in jax.tree.leaves(mtp))
  print(f"model: {n_params/1e6:.1f}M target + {n_mtp/1e6:.2f}M MTP parameters", flush=True)
  rng = np.random.default_rng(a.seed)
  data = batches(train, a.batch, a.seq, rng)
  budget = a.minutes * 60 - (time.time() - t_start) - 30  # leave time to evaluate and save
  t_budget, m_budget = budget * (1 - a.mtp_fraction), budget * a.mtp_fraction

  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
                    optax.add_decayed_weights(0.05))

  def lr_at(i: int, total: int) -> float:
    """Linear warm-up (200 steps) then cosine decay to 5% of the peak."""
    if i < 200:
      return a.lr * (i + 1) / 200
    frac = min(1.0, (i - 200) / max(total - 200, 1))
    return a.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

  @jax.jit
  def val_loss(params, x):
    return target_loss(params, cfg, x)[0]

  def run_phase(name, loss_fn, trainable, frozen, seconds, fixed_steps=None):
    """Train `trainable` on loss_fn(trainable, frozen, x) -> (loss, metric) for ~seconds."""

    @jax.jit
    def step(trainable, state, frozen, x, lr):
      (loss, metric), g = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, x)
      upd, state = opt.update(g, state, trainable)
      return jax.tree.map(lambda p, u: p - lr * u, trainable, upd), state, loss, metric

    # Time a few steps (on a throw-away copy) to size the schedule to the time budget.
    t0 = time.time()
    state = opt.init(trainable)
    probe, st, loss, _ = step(trainable, state, frozen, jnp.asarray(next(data)), 0.0)
    jax.block_until_ready(loss)
    t1 = time.time()
    for _ in range(5):
      probe, st, loss, _ = step(probe, st, frozen, jnp.asarray(next(data)), 0.0)
    jax.block_until_ready(loss)
    per_step = (time.time() - t1) / 5
    total = fixed_steps or max(int((seconds - (time.time() - t0)) / per_step), 50)
    print(f"[{name}] compile {t1 - t0:.0f}s, {per_step*1e3:.0f} ms/step, {total} steps "
          f"({a.batch * a.seq / per_step / 1e3:.0f}k tok/s)", flush=True)
    log = []
    for i in range(total):
      trainable, state, loss, metric = step(trainable, state, frozen, jnp.asarray(next(data)),
                                            lr_at(i, total))
      if i % 200 == 0 or i == total - 1:
        log.append(dict(step=i, loss=float(loss), metric=float(metric),
                        t=round(time.time() - t_start, 1)))
        print(f"[{name}] step {i}/{total} loss {float(loss):.3f} metric {float(metric):.3f}",
              flush=True)
    return trainable, log, per_step, total

  params, log_t, ps_t, n_t = run_phase(
      "target", lambda p, _, x: (target_loss(p, cfg, x[:, :-1])[0], jnp.float32(0)), params, None,
      t_budget, a.target_steps)
  mtp, log_m, ps_m, n_m = run_phase(
      "mtp", lambda m, p, x: mtp_loss(m, p, cfg, x), mtp, params, m_budget, a.mtp_steps)

  # Validation: target loss and MTP top-1 agreement on held-out documents.
  vrng = np.random.default_rng(a.seed + 1)
  vb = batches(val, 16, a.seq, vrng)
  vx = [next(vb) for _ in range(8)]
  v_loss = float(np.mean([val_loss(params, jnp.asarray(x[:, :-1])) for x in vx]))
  mtp_eval = jax.jit(lambda m, p, x: mtp_loss(m, p, cfg, x))
  m_res = [mtp_eval(mtp, params, jnp.asarray(x)) for x in vx]
  v_mtp_loss = float(np.mean([r[0] for r in m_res]))
  v_mtp_top1 = float(np.mean([r[1] for r in m_res]))
  params = dict(params, mtp=mtp)
  a.out.mkdir(parents=True, exist_ok=True)
  save_hf_checkpoint(a.out, cfg, params, dtype="bfloat16")
  reshard(a.out, a.shard_mb << 20)
  shutil.copy(a.tokenizer, a.out / "tokenizer.json")
  tc = a.tokenizer.parent / "tokenizer_config.json"
  if tc.exists():
    shutil.copy(tc, a.out / "tokenizer_config.json")
  report = dict(
      seed=a.seed, size=a.size, minutes=a.minutes, device=str(jax.devices()[0].device_kind),
      jax=jax.__version__, train_tokens=int(len(train)), val_tokens=int(len(val)),
      params_target=int(n_params), params_mtp=int(n_mtp), config=dataclasses.asdict(cfg),
      target=dict(steps=n_t, ms_per_step=ps_t * 1e3, log=log_t),
      mtp=dict(steps=n_m, ms_per_step=ps_m * 1e3, log=log_m),
      val_loss=v_loss, val_ppl=math.exp(v_loss), val_mtp_loss=v_mtp_loss,
      val_mtp_top1_label_acc=v_mtp_top1, batch=a.batch, seq=a.seq,
      wall_s=round(time.time() - t_start, 1))
  (a.out / "train_log.json").write_text(json.dumps(report, indent=1))
  print(json.dumps({k: v for k, v in report.items() if k not in ("config",)})[:2000])


if __name__ == "__main__":
  main()
