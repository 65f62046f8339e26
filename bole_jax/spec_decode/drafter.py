"""MTP drafting: catch-up of the MTP cache, then EAGLE-style top-k tree expansion.

Per step and request (k = TreeShape.topk, D = TreeShape.depth):
  1. catch-up: the MTP entries of the tokens committed last step (accepted drafts) and of the
     root (the bonus token, the tree root this step) are computed in one MTP call; the root's
     output gives the depth-1 distribution: its top-k children are the depth-1 candidates and
     the first frontier.
  2. for depth s = 1 .. D-1: the k frontier nodes run one MTP query each (tree-masked: each sees
     the committed MTP entries plus its own ancestors' draft entries), every frontier node's
     top-k children become candidates with cumulative score rho = rho_parent + log q, and the k
     best candidates by rho form the next frontier.
The draft scores come from the whole lm_head, or from a reduced draft vocabulary when the params
carry one (`draft_vocab.py`). All candidates are recorded in a breadth-ordered pool (k + (D-1) k^2 of them, parents first);
`tree.select_from_pool` keeps the best N-1. With k = 1 the same code drafts a chain.
Draft entries are written to MTP-cache slots after the committed ones (scratch, overwritten by
the next catch-up), so drafting allocates nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model.config import ModelConfig
from bole_jax.model.mtp import mtp_forward
from bole_jax.spec_decode.draft_vocab import draft_top_k

BIG = 2**30


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """Static shape of the speculation (hashable: part of the compiled program)."""

  topk: int = 4  # children expanded per frontier node (1 = chain)
  depth: int = 8  # max draft depth D (tree nodes sit at depth 0..D)
  num_nodes: int = 64  # N: verified nodes per request, root included

  def __post_init__(self):
    if self.topk < 1 or self.depth < 1 or self.num_nodes < 1:
      raise ValueError(f"invalid TreeShape {self}: topk, depth and num_nodes must be >= 1")

  @property
  def path_nodes(self) -> int:
    """The most nodes on a root path of a tree of this shape (depth + 1, the root included):
    the longest accepted path, and the verify kernel's static depth bound."""
    return self.depth + 1

  @property
  def pool_size(self) -> int:
    return self.topk + (self.depth - 1) * self.topk ** 2

  @property
  def draft_slots(self) -> int:
    """MTP-cache slots needed after the committed entries for the draft queries."""
    return (self.depth - 1) * self.topk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
  """Drafter state carried between steps.

  kv:           MTP KV cache, one AttnCache per MTP layer [B, S_mtp, Hkv, D].
  pend_tokens:  [B, D+1] tokens whose MTP entries are still to be computed: last step's
                accepted drafts then the bonus token (the root of this step).
  pend_hidden:  [B, D+1, H] target hidden state (after final norm) preceding each pending token.
  pend_count:   [B] int32 number of pending entries (>= 1).
  oracle:       [B, L] int32 target continuation for the synthetic-acceptance drafter, or None.
  """

  kv: tuple
  pend_tokens: jax.Array
  pend_hidden: jax.Array
  pend_count: jax.Array
  oracle: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pool:
  tokens: jax.Array  # [B, M] int32
  parents: jax.Array  # [B, M] int32 pool index of the parent, -1 = the root
  scores: jax.Array  # [B, M] f32 rho (cumulative draft log-prob)


def mtp_prefill(params, cfg: ModelConfig, kv, tokens, hidden, h_before, start, num_new):
  """MTP entries for a prefill chunk: position p = start + t uses token x_p and hidden_{p-1}.

  tokens [B, T]; hidden [B, T, H] target hidden of the chunk; h_before [B, H] the hidden at
  position start-1 (ignored at start 0); start, num_new [B]. Position 0 has no entry.
  """
  t = jnp.arange(tokens.shape[1])[None]
  pos = start[:, None] + t
  h_prev = jnp.concatenate([h_before[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
  valid = (t < num_new[:, None]) & (pos >= 1)
  slots = jnp.where(valid, pos, BIG)
  s = jnp.arange(kv[0].k.shape[1])[None, None]
  mask = (s >= 1) & (s <= jnp.maximum(pos, 1)[..., None])
  _, kv = mtp_forward(params, cfg, tokens, h_prev, pos, slots, mask, kv)
  return kv


def catch_up(params, cfg: ModelConfig, ds: DraftState, lengths):
  """Compute the pending MTP entries (positions lengths - count + 1 .. lengths).

  Returns (root output [B, H], DraftState with the entries written and nothing pending)."""
  p = ds.pend_tokens.shape[1]
  j = jnp.arange(p)[None]
  pos = lengths[:, None] - ds.pend_count[:, None] + 1 + j
  valid = j < ds.pend_count[:, None]
  slots = jnp.where(valid, pos, BIG)
  s = jnp.arange(ds.kv[0].k.shape[1])[None, None]
  mask = (s >= 1) & (s <= jnp.maximum(pos, 1)[..., None])
  out, kv = mtp_forward(params, cfg, ds.pend_tokens, ds.pend_hidden, pos, slots, mask, ds.kv)
  root = jnp.take_along_axis(out, jnp.maximum(ds.pend_count - 1, 0)[:, None, None], axis=1)[:, 0]
  return root, dataclasses.replace(ds, kv=kv)


def expand(params, cfg: ModelConfig, shape: TreeShape, kv, h_root, lengths, forced=None):
  """EAGLE-style top-k expansion from the root's MTP output (module docstring). Returns the pool
  and the MTP cache (draft scratch rows written after the committed entries).

  forced [B, D] (synthetic acceptance): the first candidate of the best frontier node at every
  depth is replaced by forced[:, depth-1] with score 0, which keeps that chain in the frontier
  and in the selected tree.
  """
  k, d = shape.topk, shape.depth
  b = h_root.shape[0]
  lp, tok = draft_top_k(params, cfg, h_root, k)  # [B, k]
  if forced is not None:
    tok, lp = tok.at[:, 0].set(forced[:, 0]), lp.at[:, 0].set(0.0)
  pool_tok = [tok]
  pool_par = [jnp.full((b, k), -1, jnp.int32)]
  pool_sc = [lp]
  f_tok, f_sc, f_idx = tok, lp, jnp.broadcast_to(jnp.arange(k), (b, k))
  f_hid = jnp.broadcast_to(h_root[:, None], (b, k, h_root.shape[-1]))
  n_slots = shape.draft_slots
  f_anc = jnp.zeros((b, k, max(n_slots, 1)), bool)  # draft slots of each frontier's ancestors
  cap = kv[0].k.shape[1]
  s_idx = jnp.arange(cap)[None, None]
  base = k  # pool offset of the next depth's candidates
  for s in range(1, d):
    own = (s - 1) * k + jnp.arange(k)  # draft slot index of each frontier query
    slots = lengths[:, None] + 1 + own[None]  # [B, k]
    anc_self = f_anc | (jnp.arange(f_anc.shape[-1])[None, None] == own[None, :, None])
    rel = s_idx - (lengths[:, None, None] + 1)
    in_draft = (rel >= 0) & (rel < n_slots)
    draft_ok = jnp.take_along_axis(anc_self, jnp.clip(rel, 0, n_slots - 1).repeat(k, axis=1),
                                   axis=2)
    mask = ((s_idx >= 1) & (s_idx <= lengths[:, None, None])) | (in_draft & draft_ok)
    pos = jnp.broadcast_to(lengths[:, None] + s, (b, k))
    out, kv = mtp_forward(params, cfg, f_tok, f_hid, pos, slots, mask, kv)
    lp, ctok = draft_top_k(params, cfg, out, k)  # [B, k, k]
    c_sc = (f_sc[:, :, None] + lp).reshape(b, k * k)
    c_tok = ctok.reshape(b, k * k)
    if forced is not None:  # frontier 0 is the forced chain's node (score 0 is the maximum)
      c_tok, c_sc = c_tok.at[:, 0].set(forced[:, s]), c_sc.at[:, 0].set(0.0)
    c_par = jnp.repeat(f_idx, k, axis=1)
    pool_tok.append(c_tok)
    pool_par.append(c_par)
    pool_sc.append(c_sc)
    # Next frontier: the k best candidates (stable: ties go to the earlier candidate).
    best = jnp.argsort(-c_sc, axis=-1, stable=True)[:, :k]
    parent_f = best // k
    f_tok = jnp.take_along_axis(c_tok, best, axis=1)
    f_sc = jnp.take_along_axis(c_sc, best, axis=1)
    f_idx = base + best
    f_hid = jnp.take_along_axis(out, parent_f[..., None], axis=1)
    f_anc = jnp.take_along_axis(anc_self, parent_f[..., None], axis=1)
    base += k * k
  pool = Pool(tokens=jnp.concatenate(pool_tok, 1).astype(jnp.int32),
              parents=jnp.concatenate(pool_par, 1).astype(jnp.int32),
              scores=jnp.concatenate(pool_sc, 1).astype(jnp.float32))
  return pool, kv


def synthetic_chain(oracle: jax.Array, num_out: jax.Array, depth: int, accept_prob: float,
                    vocab: int, key: jax.Array) -> jax.Array:
  """Synthetic-acceptance drafts for random-weight benchmarks: the target's own continuation.

  oracle [B, L] is the target's greedy output (from an autoregressive run); the root of this
  step is output token num_out-1, so the correct drafts are oracle[num_out : num_out + depth].
  Each depth keeps the correct token with probability accept_prob and otherwise gets a wrong
  one, so the accepted length is controlled (mean about sum_d accept_prob^d). Returns [B, depth].
  """
  idx = jnp.clip(num_out[:, None] + jnp.arange(depth)[None], 0, oracle.shape[1] - 1)
  good = jnp.take_along_axis(oracle, idx, axis=1)
  k1, k2 = jax.random.split(key)
  keep = jax.random.uniform(k1, good.shape) < accept_prob
  wrong = (good + jax.random.randint(k2, good.shape, 1, vocab)) % vocab
  return jnp.where(keep, good, wrong).astype(jnp.int32)


def after_accept(ds: DraftState, emitted: jax.Array, path: jax.Array, num_accepted: jax.Array,
                 hidden: jax.Array, active: jax.Array) -> DraftState:
  """Queue the MTP entries of the newly committed tokens: emitted [B, D+1] (accepted drafts then
  the bonus), the target hidden of the path nodes preceding each, num_accepted of them."""
  h = jnp.take_along_axis(hidden, path[..., None], axis=1)  # [B, D+1, H]
  return dataclasses.replace(
      ds, pend_tokens=jnp.where(active[:, None], emitted, ds.pend_tokens),
      pend_hidden=jnp.where(active[:, None, None], h.astype(ds.pend_hidden.dtype), ds.pend_hidden),
      pend_count=jnp.where(active, num_accepted, ds.pend_count))
