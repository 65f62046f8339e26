"""The batch-wide verification budget: one global top-K over rho, and its calibration table.

Selector (docs/algorithm.md, budget). Each request's drafter fills a candidate pool
(`drafter.Pool`, breadth ordered, rho = cumulative draft log-prob, never increasing down a
path). Instead of a fixed N-1 drafts per request, the batch verifies at most K nodes in total
(roots included): every active request keeps its root, and the K - num_active spare slots go to
the candidates with the highest rho across ALL requests, each request taking at most `cap` of
them (N-1, the static tree width). Requests with confident drafts get bigger trees. Order: by
(-rho, request, pool index), taken greedily; since rho never increases down a path and a parent
precedes its children in the pool, each request's share is a prefix of its own (-rho, pool index)
order, i.e. prefix-connected, and `tree.select_from_pool(..., num_select, n)` turns the
per-request counts back into exactly those nodes. Shapes are fixed: K is static (one compiled
program per capacity bucket).

Calibration table. The budget worth verifying is the one that costs about as much as a plain
decode step; `bole_jax.measure.calibrate` times it per device and model dims and writes a JSON
table. Here the table is found and read: it gives the engine its per-request tree width
N = B_ver and total budget K = batch * B_ver; `resolve_spec_options` finds it (an explicit path,
`<model_dir>/bole_calibration.json`, or the user cache) and falls back to `default_choice` with
one warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

log = logging.getLogger("bole_jax")

TABLE_FORMAT = "bole_jax.calibration/1"
CALIBRATION_FILE = "bole_calibration.json"  # looked up inside a model folder
MAX_NODES = 128  # the Pallas tree kernels verify at most 128 nodes per request
DEFAULT_VERIFY_ROWS = 256  # safe default without a table: about this many verify rows per step


# ============================================================================ the selector


def select_counts(scores: jax.Array, active: jax.Array, budget: int,
                  cap: jax.Array | int) -> jax.Array:
  """Per-request draft counts of the batch-wide top-K selector (module docstring).

  scores [B, M] f32: each request's candidate pool rho (non-finite = not a candidate).
  active [B] bool: requests still decoding; inactive ones get 0 drafts and no root slot.
  budget: K, total verified nodes across the batch, roots included (static int). If fewer than
    num_active, only roots are verified.
  cap: [B] int32 or int, the most drafts request b may take (N - 1, or less for KV room).
  Returns num_select [B] int32 for `tree.select_from_pool`, with sum(num_select) <=
  max(K - num_active, 0) and num_select <= cap; greedy: the sum is as large as the pools allow.
  """
  b, m = scores.shape
  ok = active[:, None] & jnp.isfinite(scores)
  key = jnp.where(ok, -scores, jnp.inf)  # [B, M] ascending = best first
  rows = jnp.arange(b)[:, None]
  # Rank within the request by (-rho, pool index): a parent ranks before its children.
  order = jnp.argsort(key, axis=-1, stable=True)
  rank = jnp.zeros((b, m), jnp.int32).at[rows, order].set(jnp.arange(m, dtype=jnp.int32)[None])
  cap = jnp.broadcast_to(jnp.asarray(cap, jnp.int32), (b,))
  eligible = ok & (rank < cap[:, None])  # beyond the cap a request would skip them anyway
  # Global order by (-rho, request, pool index) = stable sort of the row-major flattening.
  gorder = jnp.argsort(jnp.where(eligible, key, jnp.inf).reshape(-1), stable=True)
  grank = jnp.zeros((b * m,), jnp.int32).at[gorder].set(jnp.arange(b * m, dtype=jnp.int32))
  spare = jnp.maximum(budget - jnp.sum(active.astype(jnp.int32)), 0)
  taken = eligible & (grank.reshape(b, m) < spare)  # eligible candidates occupy the first ranks
  return jnp.sum(taken, axis=-1).astype(jnp.int32)


# ============================================================================ the table


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
  """Tree width and batch budget for one batch: what `SpecConfig` takes (num_nodes, budget)."""

  num_nodes: int  # N, verified nodes per request (root included): the compiled tree width
  budget: int | None  # K, verified nodes across the batch (None: N per request)
  source: str  # where it came from (table path or "default")

  def spec_options(self) -> dict:
    return dict(num_nodes=self.num_nodes, budget=self.budget)


# Fields that do not change the cost of the verify / decode forward (the MTP head drafts: it is
# not part of what the table times), and the kernel options: a table is keyed by model dims and
# device, timed with the options of the run that made it.
_NOT_SPEED = ("eos_token_ids", "max_position_embeddings", "rope_theta", "rms_norm_eps",
              "norm_topk_prob", "dtype", "mtp_num_layers", "kernels")


def model_signature(cfg, param_dtype) -> dict:
  """The model dims a calibration table is valid for (JSON-normalised): every config field that
  changes the cost of a forward, plus the dtype the weights are held in."""
  d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_SPEED}
  d["param_dtype"] = str(jnp.dtype(param_dtype))
  return json.loads(json.dumps(d))


def device_name() -> str:
  return jax.devices()[0].device_kind


def load_table(path: str | os.PathLike) -> dict:
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"calibration table not found: {path} (make one with "
                            "`bole-jax calibrate`)")
  try:
    table = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not a calibration table (invalid JSON: {e.msg})") from None
  if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT or not table.get(
      "entries"):
    raise ValueError(f"{path}: not a calibration table (expected format {TABLE_FORMAT!r})")
  return table


def default_table_dir() -> Path:
  """Where `bole-jax calibrate` writes tables for presets, and the engine looks for them."""
  root = os.environ.get("BOLE_JAX_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "bole_jax")
  return Path(root) / "calibration"


def table_mismatch(table: dict, cfg, param_dtype, device: str | None = None) -> str | None:
  """Why `table` does not apply to this model on this device (None when it does)."""
  device = device or device_name()
  if table.get("device") != device:
    return f"calibrated on {table.get('device')!r}, running on {device!r}"
  sig = model_signature(cfg, param_dtype)
  # Tables written before tensor parallelism existed were single-device ones.
  model = {"tp": 1, **table.get("model", {})}
  diff = sorted(k for k in set(sig) | set(model) if sig.get(k) != model.get(k))
  if diff:
    return f"model dims differ ({', '.join(diff[:4])})"
  return None


def find_table(cfg, param_dtype, *, path: str | os.PathLike | None = None,
               model_dir: str | os.PathLike | None = None) -> tuple[dict | None, str]:
  """The calibration table for this model and device: `path` if given (must exist), else
  `<model_dir>/bole_calibration.json`, else the first match in `default_table_dir()`.
  Returns (table or None, where it came from or why none matched)."""
  candidates = []
  if path is not None:
    candidates.append(Path(path))
    if not Path(path).is_file():
      raise FileNotFoundError(f"calibration table not found: {path}")
  else:
    if model_dir is not None:
      candidates.append(Path(model_dir) / CALIBRATION_FILE)
    d = default_table_dir()
    if d.is_dir():
      candidates += sorted(d.glob("*.json"))
  reasons = []
  for c in candidates:
    if not c.is_file():
      continue
    try:
      table = load_table(c)
    except ValueError as e:
      reasons.append(str(e))
      continue
    why = table_mismatch(table, cfg, param_dtype)
    if why is None:
      return table, str(c)
    reasons.append(f"{c}: {why}")
  return None, "; ".join(reasons) or "no table found"


def _bucket(values: Sequence[int], x: int | None) -> int:
  """Smallest bucket >= x (the largest if none; the largest when x is None)."""
  values = sorted(values)
  if x is None:
    return values[-1]
  return next((v for v in values if v >= x), values[-1])


def choose(table: dict, batch: int, kv: int | None = None, source: str = "table") -> BudgetChoice:
  """The table's choice for a batch of `batch` requests with KV capacity `kv` (None: the
  largest KV bucket, the conservative one)."""
  b = _bucket(sorted({e["batch"] for e in table["entries"]}), batch)
  s = _bucket(sorted({e["kv"] for e in table["entries"]}), kv)
  e = next(e for e in table["entries"] if e["batch"] == b and e["kv"] == s)
  return BudgetChoice(num_nodes=int(e["nodes"]), budget=int(e["budget"]), source=source)


def default_choice(batch: int) -> BudgetChoice:
  """Without a table: about DEFAULT_VERIFY_ROWS verify rows per step (power-of-two width in
  [4, 64]), budget = batch bucket * width. Correct anywhere; fast only by luck."""
  b = 1 << (max(batch, 1) - 1).bit_length()
  n = 1 << int(math.log2(max(DEFAULT_VERIFY_ROWS // b, 1)))
  n = min(max(n, 4), 64)
  return BudgetChoice(num_nodes=n, budget=b * n, source="default")


_warned: set = set()


def _warn_once(key, msg: str) -> None:
  if key not in _warned:
    _warned.add(key)
    log.warning(msg)


def choice_for(cfg, param_dtype, batch: int, *, calibration: str | os.PathLike | None = None,
               model_dir: str | os.PathLike | None = None, kv: int | None = None) -> BudgetChoice:
  """Tree width and budget for `batch` requests: from the matching calibration table, else the
  safe default (with one logged warning per model and device)."""
  table, where = find_table(cfg, param_dtype, path=calibration, model_dir=model_dir)
  if table is not None:
    return choose(table, batch, kv, source=where)
  d = default_choice(batch)
  _warn_once((device_name(), json.dumps(model_signature(cfg, param_dtype), sort_keys=True)),
             f"bole_jax: no calibration table for this model on {device_name()} ({where}); "
             f"using the default of about {DEFAULT_VERIFY_ROWS} verify rows per step (tree "
             f"width {d.num_nodes} per request at batch {batch}, 4-64 by batch). Run `bole-jax "
             "calibrate` to measure the verify budget.")
  return d


def resolve_spec_options(cfg, spec_options: dict | None, *, param_dtype, batch: int,
                         model_dir: str | os.PathLike | None = None) -> dict:
  """`LLM(spec_options=...)` with the calibrated width and budget filled in.

  Explicit `num_nodes` or `budget` win (the table is not consulted); `calibration` (a table
  path) is consumed here. Otherwise the table matching (device, model dims) chooses them for a
  batch of `batch` requests (see `choice_for`)."""
  opts = dict(spec_options or {})
  path = opts.pop("calibration", None)
  if "num_nodes" in opts or "budget" in opts:
    return opts
  c = choice_for(cfg, param_dtype, batch, calibration=path, model_dir=model_dir)
  return {**opts, **c.spec_options()}
