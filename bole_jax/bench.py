"""Decode-throughput benchmark harness (used by `bole-jax bench` and benchmarks/bench_decode.py).

Times the engine's own jitted loop (`LLM.segment_fn`) after prefill: warm-up segment first
(compilation excluded), then a timed run of `steps` loop iterations; throughput counts the tokens
actually emitted in the timed window. Random-weight models use the synthetic-acceptance drafter
(the AR continuation placed in the tree); every row says which drafter produced it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import ModelConfig
from bole_jax.model.cache import AttnCache, GDNCache


def environment() -> dict:
  """What a result needs to be comparable: device, jax version, git commit."""
  # The GPU machine gets a copy of the tree without usable git history: callers pass the commit.
  commit = os.environ.get("BOLE_GIT_COMMIT", "")
  if not commit:
    try:
      commit = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - best effort outside a checkout
      commit = ""
  d = jax.devices()[0]
  return dict(device=d.device_kind, platform=d.platform, num_devices=jax.device_count(),
              jax=jax.__version__, python=platform.python_version(), git_commit=commit or "unknown")


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
  """Measured device copy bandwidth in bytes/s (bytes read + bytes written)."""
  x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  f(x).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t)
  return 2 * nbytes / float(np.median(ts))


def tree_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def ar_step_floor_bytes(cfg: ModelConfig, params, cache, batch: int) -> int:
  """Fewest bytes one AR decode step must move: every weight once (the embedding table only
  for the B rows looked up; the lm_head fully), each GDN state read + written, each conv state
  read + written, each attention layer's committed KV read once and one new row written."""
  w = tree_bytes({k: v for k, v in params.items() if k not in ("embed", "mtp")})
  emb = params["embed"]
  w += batch * emb.shape[1] * emb.dtype.itemsize
  if cfg.tie_word_embeddings:
    w += emb.size * emb.dtype.itemsize
  state = 0
  lengths = np.asarray(cache.lengths)
  for c in cache.layers:
    if isinstance(c, GDNCache):
      state += 2 * (tree_bytes(c.state) + tree_bytes(c.conv))
    else:
      row = c.k.shape[2] * c.k.shape[3] * c.k.dtype.itemsize * 2  # k and v
      state += int(lengths.sum()) * row + batch * row
  return w + state


def run_mode(llm, ids, mode: str, gen_tokens: int, warm_steps: int, steps: int, oracle=None):
  """Prefill, warm up, then time `steps` loop iterations. Returns a dict of measurements and the
  final state."""
  seg = llm.segment_fn(mode)
  state = llm.start_batch(ids, gen_tokens, mode=mode, oracle=oracle)
  state = seg(llm.params, state, jnp.int32(warm_steps))  # compile + warm
  jax.block_until_ready(state.out)
  n0 = np.asarray(state.num_out).copy()
  s0 = np.asarray(state.steps).copy()
  t = time.perf_counter()
  state = seg(llm.params, state, jnp.int32(steps))
  jax.block_until_ready(state.out)
  dt = time.perf_counter() - t
  n1, s1 = np.asarray(state.num_out), np.asarray(state.steps)
  real = slice(0, len(ids))
  toks = int((n1 - n0)[real].sum())
  nsteps = int((s1 - s0)[real].max())
  return dict(mode=mode, batch=len(ids), time_s=dt, tokens=toks, loop_steps=nsteps,
              step_ms=1e3 * dt / max(nsteps, 1), tokens_per_s=toks / dt,
              tokens_per_step=toks / max(int((s1 - s0)[real].sum()), 1)), state


def print_table(rows: Sequence[dict], cols: Sequence[str]) -> str:
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
  width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(cols, width)),
           "-+-".join("-" * w for w in width)]
  lines += [" | ".join(x.ljust(w) for x, w in zip(row, width)) for row in cells]
  out = "\n".join(lines)
  print(out, flush=True)
  return out


def write_json(path, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=lambda o: dataclasses.asdict(o)
              if dataclasses.is_dataclass(o) else str(o))
