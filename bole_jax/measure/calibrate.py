"""Calibration of the verification budget: time decode and tree verify, choose the width.

The budget worth verifying is the one that costs about as much as a
plain decode step: time the complete hybrid tree-verify forward T_ver(N) (`verify_forward` + the
lm head) at N nodes per request, and the one-token decode forward T_dec, per batch bucket and KV
capacity bucket, and keep B_ver = max{N : T_ver(N) <= (1 + eps) T_dec}. The table (JSON, one per
device and model dims) gives the engine its per-request tree width N = B_ver and total budget
K = batch * B_ver; `resolve_spec_options` finds it (an explicit path, `<model_dir>/
bole_calibration.json`, or the user cache) and falls back to `default_choice` with one warning.

Note on cost: the verify forward is padded to [B, N] rows, so verify time follows B * N whatever
the budget; a budget below B * N moves nodes between requests but does not make the step
cheaper. The calibrated N is what sets the cost (docs/budget.md).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.measure.env import environment, progress_bar
from bole_jax.model import forward, init_cache, logits, parallel
from bole_jax.pallas.testing import random_trees
from bole_jax.spec_decode import tree as tree_mod
from bole_jax.spec_decode import verify
from bole_jax.spec_decode.budget import MAX_NODES, TABLE_FORMAT, model_signature
from bole_jax.spec_decode.verify import GDN_MODES

DEFAULT_BATCHES = (1, 4, 16, 32, 64)
DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_KV = (1024,)


def _model_parts(model) -> tuple[Any, Any]:
  """(cfg, params) from an LLM or a (cfg, params) pair."""
  if hasattr(model, "cfg") and hasattr(model, "params"):
    return model.cfg, model.params
  try:
    cfg, params = model
  except (TypeError, ValueError):
    raise TypeError("calibrate needs an LLM or a (ModelConfig, params) pair") from None
  return cfg, params


def _check_buckets(name: str, values: Sequence[int], hi: int | None = None) -> tuple[int, ...]:
  vals = list(values)
  if not vals:
    raise ValueError(f"{name}: give at least one bucket")
  bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1]
  if bad:
    raise ValueError(f"{name}: buckets must be positive integers, got {bad}")
  if hi is not None and max(vals) > hi:
    raise ValueError(f"{name}: {max(vals)} is above {hi} (the Pallas tree kernels verify at most "
                     f"{hi} nodes per request)")
  return tuple(sorted(set(int(v) for v in vals)))


def _random_cache(cfg, batch: int, capacity: int, length: int, dtype, key):
  """A cache with `length` committed tokens of random content (never time on zeros)."""
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, dtype))
  leaves, tdef = jax.tree.flatten(cache)
  keys = jax.random.split(key, len(leaves))

  @jax.jit
  def fill(keys):
    out = [(jax.random.normal(k, x.shape, jnp.float32) * 0.1).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else jnp.full(x.shape, length, x.dtype)
           for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tdef, out)

  return parallel.create(lambda: fill(keys), cfg)  # on the mesh under tensor parallelism


def _random_tree(rng: np.random.Generator, batch: int, n: int, vocab: int, topk: int,
                 depth: int):
  """A batch of random draft trees of n nodes (at most topk children, depth+1 nodes a path;
  topk 1: chains)."""
  tokens = jnp.asarray(rng.integers(0, vocab, (batch, n)), jnp.int32)
  num = jnp.full((batch,), n, jnp.int32)
  if topk == 1:
    return tree_mod.chain_tree(tokens, num)
  parents, _ = random_trees(rng, batch, n, max_children=topk, max_depth=depth + 1)
  parents = jnp.asarray(parents)
  return tree_mod.Tree(tokens=tokens, parents=parents, depth=tree_mod.depths(parents, num),
                       num_nodes=num, score=jnp.zeros((batch, n), jnp.float32))


def _decode_fn(cfg):
  def dec(params, cache, tokens):  # the plain one-token decode forward + lm head
    hidden, cache = forward(params, cfg, tokens, cache)
    return jnp.argmax(logits(params, cfg, hidden[:, 0]), axis=-1), parallel.constrain(cache, cfg)

  return jax.jit(dec, donate_argnums=1)


def _verify_fn(cfg, mode: str, backend: str, depth_bound: int | None = None):
  def ver(params, cache, tree):  # the complete hybrid tree-verify forward + lm head
    hidden, cache, auxs = verify.verify_forward(params, cfg, tree, cache, mode=mode,
                                                backend=backend, depth_bound=depth_bound)
    return jnp.argmax(logits(params, cfg, hidden), axis=-1), parallel.constrain(cache, cfg), auxs

  return jax.jit(ver, donate_argnums=1)


def _time_chained(run, params, cache, arg, warmup: int, repeats: int):
  """Median seconds of run(params, cache, arg) -> (out, cache', ...); the cache is donated and
  chained through the calls. Returns (seconds, cache)."""
  ts = []
  for i in range(warmup + repeats):
    t0 = time.perf_counter()
    out = run(params, cache, arg)
    jax.block_until_ready(out)
    if i >= warmup:
      ts.append(time.perf_counter() - t0)
    cache = out[1]
  return statistics.median(ts), cache


def _is_oom(e: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _time_bucket(progs, params, fresh_cache, eps, warmup, repeats, early_stop, pool, wave, bar):
  """Time progs[0] (the decode step, T_dec) then progs[1:] (T_ver at growing N) on one cache.

  Programs are lowered here (tracing holds the GIL) and compiled in `pool` (the next lowering
  overlaps the previous compilations), `wave` at a time; each wave is compiled completely
  before anything is timed (XLA autotunes on the device while it compiles, which would disturb
  the clock). Early stop: after two consecutive verify times
  above (1 + eps) max(T_dec, T_ver(N_min)), or one above twice that, or an out-of-memory error.
  Returns (seconds per program, None where not timed; {index: note})."""
  times, notes = [None] * len(progs), {}
  cache = fresh_cache()
  over = 0
  for start in range(0, len(progs), wave):
    chunk = range(start, min(start + wave, len(progs)))
    futs = [pool.submit(progs[i][0].lower(params, cache, progs[i][1]).compile) for i in chunk]
    compiled = [f.result() for f in futs]
    for i, exe in zip(chunk, compiled):
      if bar is not None:
        bar.update(1)
      try:
        times[i], cache = _time_chained(exe, params, cache, progs[i][1], warmup, repeats)
      except Exception as e:  # noqa: BLE001 - a verify OOM ends this bucket; the rest are bugs
        if i == 0 or not _is_oom(e):
          raise
        notes[i], over = "out of memory", 2
        cache = fresh_cache()  # the donated cache is gone
      if i > 0 and times[i] is not None:
        # max with the smallest tree: a fixed tree-path overhead above eps must not stop the
        # search before the knee (see _entry).
        bound = (1 + eps) * max(times[0], times[1] or 0.0)
        over = 2 if times[i] > 2 * bound else (over + 1 if times[i] > bound else 0)
      if early_stop and over >= 2:
        for rest in range(i + 1, len(progs)):
          notes[rest] = "skipped (early stop)"
        if bar is not None:
          bar.update(len(progs) - 1 - i)
        return times, notes
  return times, notes


def check_calibration_args(batch_buckets, node_buckets, kv_buckets, eps, *, mode="bole",
                           warmup=2, repeats=10):
  """Validated, sorted buckets (clear errors for bad ones)."""
  batch_buckets = _check_buckets("batch buckets", batch_buckets)
  node_buckets = _check_buckets("node buckets", node_buckets, MAX_NODES)
  kv_buckets = _check_buckets("KV buckets", kv_buckets)
  if not eps >= 0:
    raise ValueError(f"eps must be >= 0, got {eps}")
  if mode not in GDN_MODES:
    raise ValueError(f"unknown verify mode {mode!r}; expected one of {GDN_MODES}")
  if warmup < 0 or repeats < 1:
    raise ValueError("need warmup >= 0 and repeats >= 1")
  margin = max(node_buckets) + warmup + repeats + 2
  small = [s for s in kv_buckets if s <= margin]
  if small:
    raise ValueError(f"KV buckets {small} leave no room: each must exceed {margin} "
                     "(largest node bucket + timed decode steps)")
  return batch_buckets, node_buckets, kv_buckets


def calibrate(model, batch_buckets: Sequence[int] = DEFAULT_BATCHES,
              node_buckets: Sequence[int] = DEFAULT_NODES, kv_buckets: Sequence[int] = DEFAULT_KV,
              eps: float = 0.1, *, mode: str = "bole", topk: int = 4, depth: int = 8,
              backend: str = "auto", warmup: int = 2, repeats: int = 10, early_stop: bool = True,
              workers: int = 8, progress: bool = True, seed: int = 0) -> dict:
  """Time T_dec and T_ver(N) per (batch, KV capacity) bucket and choose the budget.

  model: an `LLM` or a (ModelConfig, params) pair (params in the dtype to be served).
  batch_buckets: batch sizes B; node_buckets: tree widths N (nodes per request, root included,
  <= 128); kv_buckets: KV capacities S (the attention layers read all S slots; committed
  lengths are set near S). eps: allowed verify overhead over a decode step.
  mode: the verify mode timed ("bole"; "pernode" / "chain" for the baselines).
  Timing: programs are compiled `workers` at a time in threads, and a wave is compiled
  completely before it is timed (compilation excluded); per program `warmup` calls, then the
  median of `repeats` calls, each blocked until ready; the cache is donated and chained through
  the calls, as in the engine. early_stop: stop growing N for a bucket (and compiling its larger
  N) once two consecutive N (or one N at twice the bound) exceed (1 + eps) T_dec (or the
  smallest tree's time, when that is larger: see `_entry`).
  Returns the table (JSON-ready dict: `format_table` prints it, `save_table` writes it).
  """
  cfg, params = _model_parts(model)
  batch_buckets, node_buckets, kv_buckets = check_calibration_args(
      batch_buckets, node_buckets, kv_buckets, eps, mode=mode, warmup=warmup, repeats=repeats)
  dtype = params["embed"].dtype
  dec_fn, ver_fn = _decode_fn(cfg), _verify_fn(cfg, mode, backend, depth + 1)
  rng = np.random.default_rng(seed)
  entries = []
  groups = [(s, b) for s in kv_buckets for b in batch_buckets]
  bar = (progress_bar(len(groups) * (1 + len(node_buckets)), "calibrate", "prog")
         if progress else None)
  t_start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    for s, b in groups:
      length = max(1, s - max(node_buckets) - warmup - repeats - 2) if cfg.attention_layers else 1
      key = jax.random.key(seed + 7919 * b + s)
      fresh_cache = lambda: _random_cache(cfg, b, s, length, dtype, key)  # noqa: E731
      toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 1)), jnp.int32)
      trees = {n: _random_tree(rng, b, n, cfg.vocab_size, 1 if mode == "chain" else topk, depth)
               for n in node_buckets}
      progs = [(dec_fn, toks)] + [(ver_fn, trees[n]) for n in node_buckets]
      times, notes = _time_bucket(progs, params, fresh_cache, eps, warmup, repeats,
                                  early_stop, pool, max(1, workers), bar)
      t_ver = {n: t for n, t in zip(node_buckets, times[1:]) if t is not None}
      ver_notes = {n: notes[i] for i, n in enumerate(node_buckets, 1) if i in notes}
      entries.append(_entry(b, s, length, times[0], t_ver, ver_notes, eps, node_buckets))
  if bar is not None:
    bar.close()
  env = environment()
  return dict(
      format=TABLE_FORMAT, device=env["device"], platform=env["platform"], jax=env["jax"],
      git_commit=env["git_commit"],
      created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      model=model_signature(cfg, dtype), mode=mode, backend=backend,
      tree=dict(topk=topk, depth=depth), eps=eps, warmup=warmup, repeats=repeats,
      early_stop=early_stop, batch_buckets=list(batch_buckets), node_buckets=list(node_buckets),
      kv_buckets=list(kv_buckets), seconds=round(time.perf_counter() - t_start, 1),
      entries=entries)


def _entry(b, s, length, t_dec, t_ver, notes, eps, node_buckets) -> dict:
  """The bucket's choice: B_ver = max{N : T_ver(N) <= (1 + eps) T_dec}. When no N qualifies (the
  tree path costs more than eps over a decode step even for the smallest tree), fall back to the
  knee max{N : T_ver(N) <= (1 + eps) T_ver(N_min)}: beyond it extra nodes stop being free."""
  fits = [n for n, t in t_ver.items() if t <= (1 + eps) * t_dec]
  rule = "T_ver <= (1+eps) T_dec"
  if not fits and t_ver:
    smallest = t_ver[min(t_ver)]
    fits, rule = [n for n, t in t_ver.items() if t <= (1 + eps) * smallest], "knee"
  nodes = max(fits) if fits else min(node_buckets)
  return dict(batch=b, kv=s, kv_length=length, t_dec_ms=1e3 * t_dec,
              t_ver_ms={str(n): 1e3 * t for n, t in t_ver.items()},
              ratio={str(n): t / t_dec for n, t in t_ver.items()},
              notes={str(n): v for n, v in notes.items()},
              nodes=nodes, budget=b * nodes, within_eps=rule != "knee", rule=rule)


def format_table(table: dict) -> str:
  """Human-readable view: T_ver(N) / T_dec per bucket, and the chosen width and budget."""
  nodes = table["node_buckets"]
  m = table["model"]
  head = (f"budget calibration: {table['device']}, jax {table['jax']}, mode {table['mode']}, "
          f"eps {table['eps']}, {m.get('family')} H={m.get('hidden_size')} "
          f"L={m.get('num_layers')} {m.get('param_dtype')}")
  cols = ["batch", "kv", "T_dec ms"] + [f"N={n}" for n in nodes] + ["-> N", "budget"]
  rows = []
  for e in table["entries"]:
    r = [str(e["batch"]), str(e["kv"]), f"{e['t_dec_ms']:.3g}"]
    for n in nodes:
      v = e["ratio"].get(str(n))
      r.append(f"{v:.2f}x" if v is not None else ("oom" if "memory" in e["notes"].get(str(n), "")
                                                   else "-"))
    r += [str(e["nodes"]) + ("" if e["within_eps"] else "!"), str(e["budget"])]
    rows.append(r)
  width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
  lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, width))]
  lines += ["  ".join(x.rjust(w) for x, w in zip(r, width)) for r in rows]
  lines.append("cells: T_ver(N) / T_dec; -> N = max{N : T_ver(N) <= (1+eps) T_dec}; "
               "! = none within eps, the knee max{N : T_ver(N) <= (1+eps) T_ver(N_min)}; "
               "budget = batch * N")
  return "\n".join(lines)


def save_table(table: dict, path: str | os.PathLike) -> Path:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(table, indent=1))
  return path


def merge_tables(old: dict, new: dict) -> dict:
  """`new` with the entries of `old` it does not re-measure (calibrating in several runs, e.g.
  a few batch buckets per run). Both must describe the same device, model, mode, tree and eps."""
  same = lambda k: json.dumps(old.get(k), sort_keys=True) == json.dumps(new.get(k),  # noqa: E731
                                                                       sort_keys=True)
  diff = [k for k in ("device", "model", "mode", "tree", "eps") if not same(k)]
  if diff:
    raise ValueError(f"cannot merge calibration tables that differ in {', '.join(diff)}")
  seen = {(e["batch"], e["kv"]) for e in new["entries"]}
  entries = sorted([e for e in old["entries"] if (e["batch"], e["kv"]) not in seen]
                   + new["entries"], key=lambda e: (e["kv"], e["batch"]))
  union = lambda k: sorted(set(old[k]) | set(new[k]))  # noqa: E731
  return {**new, "entries": entries, "batch_buckets": union("batch_buckets"),
          "node_buckets": union("node_buckets"), "kv_buckets": union("kv_buckets")}
