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
import functools

import jax
import jax.numpy as jnp

from bole_jax.model.config import ModelConfig
from bole_jax.model.mtp import mtp_forward
from bole_jax.spec_decode.draft_vocab import draft_top_k

BIG = 2**30

# The MTP cache's slot count is rounded up to a multiple of this. On the GPU, XLA pads the
# operands of a bf16 dot to multiples of 8 (for cuBLAS), and the drafter's attention dots take the
# whole MTP cache as an operand: an unaligned slot count (capacity + draft slots + 1 is odd for
# every power-of-two capacity) made every draft level copy the MTP keys and values into padded
# temporaries. Measured on one H200 (Qwen3.5-9B dims, 16k context, B = 32): those copies were 7.4
# of the draft stage's 15.0 ms (docs/design-decisions.md).
DRAFT_SLOT_ALIGN = 64

# How the expansion runs its levels (read at trace time; `unroll_levels`): None (the default)
# unrolls them on GPUs and keeps the `lax.while_loop` with the early stop elsewhere; True / False
# force one form everywhere (for measurements and tests). On a GPU the loop reads its predicate
# back to the host once per level, each read waiting for the level's kernels: unrolled, the
# Qwen3.5-9B dims bole-chain step at B = 1 went 7.32 -> 6.59 ms and the demo model's 32-node tree
# step 1.21 -> 1.02 ms (B = 1) and 1.69 -> 1.46 ms (B = 16), at the same tokens per step (one
# H200, 4cd2a9e; docs/design-decisions.md). On the CPU the read costs nothing, the early stop
# saves the levels it skips, and the loop compiles one level instead of depth - 1; on a TPU the
# loop's predicate stays on the device (not measured there).
# The acceptance walk of a static greedy batch follows the same switch (`acceptance.accept`).
UNROLL: bool | None = None
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def unroll_levels(backend: str | None = None) -> bool:
    """Whether `expand` unrolls its levels (UNROLL; None: on GPUs only)."""
    if UNROLL is not None:
        return bool(UNROLL)
    return (backend or jax.default_backend()) in GPU_BACKENDS


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
    def draft_levels(self) -> int:
        """The draft levels worth running, min(D, N - 1): the selected tree is prefix-connected
        with at most N - 1 nodes below the root, so no node deeper than N - 1 can be selected.
        (The while loop's early stop found this bound at run time: with real drafts, N = 4 and
        D = 8 it ended every expansion after 3 levels; the unrolled levels need it statically.)"""
        return max(1, min(self.depth, self.num_nodes - 1))

    @property
    def pool_size(self) -> int:
        return self.topk + (self.depth - 1) * self.topk**2

    @property
    def draft_slots(self) -> int:
        """MTP-cache slots needed after the committed entries for the draft queries."""
        return (self.depth - 1) * self.topk


def draft_cache_capacity(capacity: int, shape: TreeShape) -> int:
    """MTP-cache slots for a target KV capacity: slot 0 unused (position 0 has no MTP entry), the
    committed entries, a step's draft slots, rounded up to a multiple of DRAFT_SLOT_ALIGN."""
    need = capacity + shape.draft_slots + 1
    return -(-need // DRAFT_SLOT_ALIGN) * DRAFT_SLOT_ALIGN


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    """Drafter state carried between steps.

    kv:           MTP KV cache, one AttnCache per MTP layer [B, Hkv, S_mtp, D].
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
    scores: jax.Array  # [B, M] f32 rho (cumulative draft log-prob), -inf = not drafted
    levels: jax.Array | None = None  # [] int32 draft levels the expansion ran (1 .. depth)


@functools.partial(jax.jit, static_argnames=("p",))  # one program, not eager ops, per start
def prefill_rows(tok0: jax.Array, h_last: jax.Array, *, p: int):
    """The drafter's pending rows after a prefill (`DraftState.pend_*`): tok0 [B] and h_last
    [B, H] as row 0 of p (the tree's path_nodes), one pending entry per request."""
    b = tok0.shape[0]
    toks = jnp.zeros((b, p), jnp.int32).at[:, 0].set(tok0)
    hid = jnp.zeros((b, p, h_last.shape[-1]), h_last.dtype).at[:, 0].set(h_last)
    return toks, hid, jnp.ones((b,), jnp.int32)


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
    s = jnp.arange(kv[0].capacity)[None, None]
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
    s = jnp.arange(ds.kv[0].capacity)[None, None]
    mask = (s >= 1) & (s <= jnp.maximum(pos, 1)[..., None])
    out, kv = mtp_forward(params, cfg, ds.pend_tokens, ds.pend_hidden, pos, slots, mask, ds.kv)
    root = jnp.take_along_axis(out, jnp.maximum(ds.pend_count - 1, 0)[:, None, None], axis=1)[:, 0]
    return root, dataclasses.replace(ds, kv=kv)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["cap", "active"],
    meta_fields=["num_select", "budget"],
)
@dataclasses.dataclass(frozen=True)
class StopRule:
    """What the selector after the drafter keeps, for the expansion's early stop (`can_gain`).

    num_select: each request keeps at most its best `num_select` candidates by (-rho, pool
      index) (N - 1, `tree.select_from_pool`); static.
    budget:     with the batch-wide selector (`budget.select_counts`), K, the verified nodes across
      the batch (static), else None.
    cap:        [B] int32, the most drafts each request may take under the budget (its KV room);
      only with a budget.
    active:     [B] bool, requests whose tree is used (done and padding rows never keep the
      expansion going), or None: every request.
    """

    num_select: int
    budget: int | None = None
    cap: jax.Array | None = None
    active: jax.Array | None = None


def can_gain(rule: StopRule, scores: jax.Array, frontier_scores: jax.Array) -> jax.Array:
    """[B] bool: whether a candidate drafted below the frontier could still be selected.

    scores [B, M] f32 the pool so far (-inf where not drafted yet); frontier_scores [B, k] f32.
    Every later candidate descends from a frontier node, so its rho is at most the best frontier
    score F (log q <= 0 and fp addition of a non-positive number never increases a value), and
    its pool index is larger than every current candidate's. Request b cannot gain when
      F <= its num_select-th best score so far (num_select current candidates rank before any
      later one: they score at least as much and come earlier in the pool), or,
      with a budget, F < G: G is the (K - active)-th best score of a subset of the candidates the
      budget can take now (those strictly above their request's cap-th best score), so G is at
      most the selector's cut-off; a later candidate then ranks after every taken one, and it
      cannot push a taken candidate out of its request's cap either (it ranks after it).
    Either way adding later candidates leaves the selected set, and so the tree, unchanged.
    """
    b, m = scores.shape
    active = jnp.ones((b,), bool) if rule.active is None else rule.active
    best_f = jnp.max(frontier_scores, axis=-1)
    n1 = min(rule.num_select, m)
    top = jax.lax.top_k(scores, n1)[0] if n1 >= 1 else jnp.full((b, 1), jnp.inf)
    if rule.num_select > m:  # every finite candidate is selected: only -inf ones are not
        thr = jnp.full((b,), -jnp.inf)
    else:
        thr = top[:, -1]
    gain = best_f > thr
    if rule.budget is not None:
        # The takeable candidates (strictly above their request's cap-th best score) are among
        # the request's cap - 1 best, which `top` holds in order: G is taken over the B x
        # (N - 1) entries of `top` rather than the B x M pool (the same multiset of values): the
        # one op of a draft level that grows with K. With the pool-wide top-K the draft stage
        # took 5.6 ms at B = 64, N = 8, K = 512 against 2.4 ms at N = 4, K = 256 (one H200,
        # Qwen3.5-9B dims, 5799bea).
        cap = jnp.clip(jnp.broadcast_to(jnp.asarray(rule.cap, jnp.int32), (b,)), 0, n1)
        v_cap = jnp.take_along_axis(top, jnp.maximum(cap - 1, 0)[:, None], axis=1)
        takeable = active[:, None] & (cap[:, None] >= 1) & (top > v_cap) & jnp.isfinite(top)
        spare = rule.budget - jnp.sum(active.astype(jnp.int32))
        kk = min(rule.budget, b * top.shape[1])
        g_top = jax.lax.top_k(jnp.where(takeable, top, -jnp.inf).reshape(-1), kk)[0]
        g = jnp.where(spare >= 1, g_top[jnp.clip(spare - 1, 0, kk - 1)], jnp.inf)
        g = jnp.where(spare > kk, -jnp.inf, g)
        gain &= best_f >= g
    return gain & active


def expand(
    params,
    cfg: ModelConfig,
    shape: TreeShape,
    kv,
    h_root,
    lengths,
    forced=None,
    stop: StopRule | None = None,
):
    """EAGLE-style top-k expansion from the root's MTP output (module docstring). Returns the pool
    (Pool.levels: the draft levels run, 1 .. shape.draft_levels) and the MTP cache (draft
    scratch rows written after the committed entries).

    The levels below the first run in one `lax.while_loop` (one level's program, compiled once)
    over a preallocated [B, M] pool, each level's k^2 candidates written at its breadth-order
    offset; levels never run keep rho = -inf (never selected). With `stop`, the loop ends as soon
    as no request can gain a selected candidate from a deeper level (`can_gain`): the selected
    tree is the one the full expansion gives.

    forced [B, D] (synthetic acceptance): the first candidate of the best frontier node at every
    depth is replaced by forced[:, depth-1] with score 0, which keeps that chain in the frontier
    and in the selected tree.

    Unrolled instead (`unroll_levels`: on GPUs), every level runs as straight-line
    code, with no predicate read back to the host per level and no `can_gain`: the pool of the
    full expansion, whose selected tree is the one the early stop gives.
    """
    k, d = shape.topk, shape.draft_levels  # levels past N - 1 could never be selected
    b, m = h_root.shape[0], shape.pool_size
    lp, tok = draft_top_k(params, cfg, h_root, k)  # [B, k]
    if forced is not None:
        tok, lp = tok.at[:, 0].set(forced[:, 0]), lp.at[:, 0].set(0.0)
    lp = lp.astype(jnp.float32)
    p_tok = jnp.zeros((b, m), jnp.int32).at[:, :k].set(tok.astype(jnp.int32))
    p_par = jnp.full((b, m), -1, jnp.int32)
    p_sc = jnp.full((b, m), -jnp.inf, jnp.float32).at[:, :k].set(lp)
    if d == 1:
        return Pool(tokens=p_tok, parents=p_par, scores=p_sc, levels=jnp.int32(1)), kv
    f_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    f_hid = jnp.broadcast_to(h_root[:, None], (b, k, h_root.shape[-1]))
    n_slots = shape.draft_slots
    f_anc = jnp.zeros((b, k, n_slots), bool)  # draft slots of each frontier's ancestors
    cap = kv[0].capacity
    s_idx = jnp.arange(cap)[None, None]
    rel = s_idx - (lengths[:, None, None] + 1)  # [B, 1, S] slot index among the draft slots
    in_draft = (rel >= 0) & (rel < n_slots)
    committed = (s_idx >= 1) & (s_idx <= lengths[:, None, None])
    rel = jnp.clip(rel, 0, n_slots - 1).repeat(k, axis=1)

    def level(carry):
        s, kv, f_tok, f_sc, f_idx, f_hid, f_anc, p_tok, p_par, p_sc, _ = carry
        own = (s - 1) * k + jnp.arange(k)  # draft slot index of each frontier query
        slots = lengths[:, None] + 1 + own[None]  # [B, k]
        anc_self = f_anc | (jnp.arange(n_slots)[None, None] == own[None, :, None])
        mask = committed | (in_draft & jnp.take_along_axis(anc_self, rel, axis=2))
        pos = jnp.broadcast_to(lengths[:, None] + s, (b, k))
        out, kv = mtp_forward(params, cfg, f_tok, f_hid, pos, slots, mask, kv)
        lp, ctok = draft_top_k(params, cfg, out, k)  # [B, k, k]
        c_sc = (f_sc[:, :, None] + lp).reshape(b, k * k)
        c_tok = ctok.reshape(b, k * k).astype(jnp.int32)
        if forced is not None:  # frontier 0 is the forced chain's node (score 0 is the maximum)
            f_s = jax.lax.dynamic_index_in_dim(forced, s, axis=1, keepdims=False)
            c_tok, c_sc = c_tok.at[:, 0].set(f_s), c_sc.at[:, 0].set(0.0)
        c_par = jnp.repeat(f_idx, k, axis=1)
        base = k + (s - 1) * k * k  # pool offset of this depth's candidates
        p_tok = jax.lax.dynamic_update_slice(p_tok, c_tok, (0, base))
        p_par = jax.lax.dynamic_update_slice(p_par, c_par, (0, base))
        p_sc = jax.lax.dynamic_update_slice(p_sc, c_sc, (0, base))
        # Next frontier: the k best candidates (stable: ties go to the earlier candidate, which
        # keeps the forced chain's node, candidate 0 with the top score 0, first).
        best = jnp.argsort(-c_sc, axis=-1, stable=True)[:, :k]
        f_sc = jnp.take_along_axis(c_sc, best, axis=1)
        parent_f = best // k
        f_tok = jnp.take_along_axis(c_tok, best, axis=1)
        f_idx = (base + best).astype(jnp.int32)
        f_hid = jnp.take_along_axis(out, parent_f[..., None], axis=1)
        f_anc = jnp.take_along_axis(anc_self, parent_f[..., None], axis=1)
        go = jnp.any(can_gain(stop, p_sc, f_sc)) if use_stop else jnp.bool_(True)
        return s + 1, kv, f_tok, f_sc, f_idx, f_hid, f_anc, p_tok, p_par, p_sc, go

    watch = not unroll_levels()  # the while loop, else unrolled
    use_stop = watch and stop is not None
    go = jnp.any(can_gain(stop, p_sc, lp)) if use_stop else jnp.bool_(True)
    carry = (
        jnp.int32(1) if watch else 1,  # unrolled: s is a Python int, static offsets
        kv,
        tok.astype(jnp.int32),
        lp,
        f_idx,
        f_hid,
        f_anc,
        p_tok,
        p_par,
        p_sc,
        go,
    )
    if watch:
        carry = jax.lax.while_loop(lambda c: (c[0] < d) & c[-1], level, carry)
    else:
        for _ in range(1, d):
            carry = level(carry)
    s, kv, *_, p_tok, p_par, p_sc, _ = carry
    return Pool(tokens=p_tok, parents=p_par, scores=p_sc, levels=jnp.int32(s)), kv


def synthetic_chain(
    oracle: jax.Array,
    num_out: jax.Array,
    depth: int,
    accept_prob: float,
    vocab: int,
    key: jax.Array,
) -> jax.Array:
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


def after_accept(
    ds: DraftState,
    emitted: jax.Array,
    path: jax.Array,
    num_accepted: jax.Array,
    hidden: jax.Array,
    active: jax.Array,
) -> DraftState:
    """Queue the MTP entries of the newly committed tokens: emitted [B, D+1] (accepted drafts then
    the bonus), the target hidden of the path nodes preceding each, num_accepted of them."""
    h = jnp.take_along_axis(hidden, path[..., None], axis=1)  # [B, D+1, H]
    return dataclasses.replace(
        ds,
        pend_tokens=jnp.where(active[:, None], emitted, ds.pend_tokens),
        pend_hidden=jnp.where(
            active[:, None, None], h.astype(ds.pend_hidden.dtype), ds.pend_hidden
        ),
        pend_count=jnp.where(active, num_accepted, ds.pend_count),
    )
