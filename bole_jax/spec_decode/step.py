"""One speculative decoding step: draft -> select -> verify -> accept -> commit.

Modes share everything but the GDN state handling and the tree shape:
  bole     top-k tree, closed-form tree verify from one state, factor commit (the method);
           the commit rebuilds each GDN state at the accepted node right away (default), or
           with lazy_commit keeps the step's factors and accepted path and the next verify
           folds the path's rows into the state it loads (verify.py; README "Lazy commit")
  pernode  same tree, per-node full states in a scratch buffer + copy commit (SGLang "tree")
  chain    top-1 chain, one state snapshot per position (vLLM style)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model.cache import Cache, GDNCache, pending_nodes, pending_rows
from bole_jax.model.config import ModelConfig
from bole_jax.pallas.options import KernelOptions
from bole_jax.spec_decode import budget as budget_mod
from bole_jax.spec_decode import drafter, verify
from bole_jax.spec_decode import tree as tree_mod
from bole_jax.spec_decode.acceptance import accept, accept_simulated, node_rows
from bole_jax.spec_decode.drafter import TreeShape
from bole_jax.spec_decode.loop import DecodeState, emit

SPEC_MODES = ("bole", "pernode", "chain")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static speculation settings (hashable)."""

    mode: str = "bole"
    shape: TreeShape = TreeShape()
    backend: str = "auto"  # kernels: "auto" | "pallas" | "reference"
    synthetic_accept: float | None = None  # synthetic drafter: per-depth acceptance probability
    budget: int | None = None  # total verified nodes across the batch (None: N per request)
    lazy_commit: bool = False  # bole: pending rows folded in by the next verify (False: eager)
    # The kernel options (the same value as ModelConfig.kernels, `spec_step` checks it); the
    # decode state's lazy-commit layout follows kernels.lazy_rows (`pending_nodes`).
    kernels: KernelOptions = KernelOptions()
    # Benchmarks only: simulated acceptance, each next depth of the tree's deepest path accepted
    # with this probability whatever the target says (`acceptance.accept_simulated`; outputs are
    # not the model's). None: the lossless acceptance.
    simulate_accept: float | None = None

    def __post_init__(self):
        if self.mode not in SPEC_MODES:
            raise ValueError(
                f"unknown spec mode {self.mode!r}; expected one of {SPEC_MODES} or 'ar'"
            )
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"kernels must be a KernelOptions, got {self.kernels!r}")
        if not isinstance(self.lazy_commit, bool):
            raise ValueError(f"lazy_commit must be a bool, got {self.lazy_commit!r}")
        if self.budget is not None and (type(self.budget) is not int or self.budget < 1):
            raise ValueError(
                f"budget must be a positive int (total verified nodes across the batch) "
                f"or None, got {self.budget!r}"
            )
        if self.simulate_accept is not None:
            if isinstance(self.simulate_accept, bool) or not (
                isinstance(self.simulate_accept, (int, float)) and 0 <= self.simulate_accept <= 1
            ):
                raise ValueError(
                    f"simulate_accept must be a probability in [0, 1] or None, got "
                    f"{self.simulate_accept!r}"
                )
            if self.synthetic_accept is not None:
                raise ValueError("simulate_accept and synthetic_accept exclude each other")
        if self.mode == "chain" and self.shape.topk != 1:
            raise ValueError("chain mode drafts with topk=1")
        if self.mode == "chain" and self.shape.num_nodes != self.shape.depth + 1:
            raise ValueError("chain mode verifies depth + 1 nodes")

    @staticmethod
    def for_mode(
        mode: str,
        topk: int = 4,
        depth: int = 8,
        num_nodes: int = 64,
        backend: str = "auto",
        synthetic_accept: float | None = None,
        budget: int | None = None,
        lazy_commit: bool = False,
        kernels: KernelOptions = KernelOptions(),
        simulate_accept: float | None = None,
    ) -> "SpecConfig":
        if mode == "chain":
            topk, num_nodes = 1, depth + 1
        return SpecConfig(
            mode,
            TreeShape(topk, depth, num_nodes),
            backend,
            synthetic_accept,
            budget,
            lazy_commit,
            kernels,
            simulate_accept=simulate_accept,
        )

    @property
    def slack(self) -> int:
        """KV slots a request needs beyond its committed tokens during a step."""
        return self.shape.num_nodes

    @property
    def pending_length(self) -> int | None:
        """Rows of the GDN caches' pending commit in this mode's decode state (`cache.with_pending`):
        depth + 1, the most nodes on an accepted path, for lazy bole; None otherwise."""
        return self.shape.path_nodes if self.mode == "bole" and self.lazy_commit else None

    @property
    def pending_nodes(self) -> int | None:
        """Tree nodes of the factors a lazy bole commit keeps (`PendingPath`, the default
        `kernels.lazy_rows` "path"): N; None for gathered rows or no lazy commit."""
        return (
            self.shape.num_nodes
            if self.pending_length and self.kernels.lazy_rows == "path"
            else None
        )


def check_cache_layout(spec: SpecConfig, cache: Cache) -> None:
    """Static check (at trace time) that the cache is laid out for this spec's commit: a pending
    commit of `spec.pending_length` rows (of `spec.pending_nodes` nodes' factors) in every GDN
    layer, or none."""
    want = (spec.pending_length, spec.pending_nodes)
    for c in cache.layers:
        if isinstance(c, GDNCache):
            have = (
                (None, None)
                if c.pending is None
                else (pending_rows(c.pending), pending_nodes(c.pending))
            )
            if have != want:
                raise ValueError(
                    f"the decode state's GDN caches carry pending commits of (rows, nodes) "
                    f"{have}, this {spec.mode} spec (lazy_commit={spec.lazy_commit}) needs "
                    f"{want}: lay the state out with model.cache.with_pending "
                    "(LLM.state_after_prefill does)"
                )


# Named scopes of the step's stages: every HLO op of a compiled decode loop carries its stage in
# its metadata op_name (".../stage_verify/..."), which benchmarks/profile_step.py attributes the
# loop's device time by. loop.ar_step is "stage_ar".
STAGES = ("draft", "select", "verify", "accept", "commit", "emit")
STAGE_SCOPE = "stage_"

# The drafter's early stop (drafter.can_gain) is on unless a test compares against the full
# expansion (read at trace time). Only the while-loop form of the expansion watches it (on the
# CPU and TPU by default: drafter.unroll_levels); unrolled levels run the full expansion.
EARLY_STOP = True


def stage(name: str):
    return jax.named_scope(STAGE_SCOPE + name)


def stop_rule(spec: SpecConfig, state: DecodeState) -> drafter.StopRule:
    """What `select` will keep, for the drafter's early stop."""
    n = spec.shape.num_nodes
    room = state.cache.capacity - state.cache.lengths
    cap = jnp.clip(room - 1, 0, n - 1) if spec.budget is not None else None
    return drafter.StopRule(num_select=n - 1, budget=spec.budget, cap=cap, active=~state.done)


def draft(params, cfg: ModelConfig, spec: SpecConfig, state: DecodeState, key):
    """Catch up the MTP cache and expand the candidate pool. Returns (pool, DraftState)."""
    ds = state.extra
    lengths = state.cache.lengths
    h_root, ds = drafter.catch_up(params, cfg, ds, lengths)
    forced = None
    if spec.synthetic_accept is not None:
        forced = drafter.synthetic_chain(
            ds.oracle, state.num_out, spec.shape.depth, spec.synthetic_accept, cfg.vocab_size, key
        )
    stop = stop_rule(spec, state) if EARLY_STOP else None
    pool, kv = drafter.expand(params, cfg, spec.shape, ds.kv, h_root, lengths, forced, stop)
    return pool, dataclasses.replace(ds, kv=kv)


def select(spec: SpecConfig, state: DecodeState, pool) -> tree_mod.Tree:
    """The candidates to verify, by rho, prefix-connected, within each request's KV room.

    budget None: each request's top N-1. budget K: the batch-wide top-K over rho (roots
    included, at most N-1 drafts per request; `budget.select_counts`)."""
    n = spec.shape.num_nodes
    room = state.cache.capacity - state.cache.lengths
    num = n - 1
    if spec.budget is not None:
        num = budget_mod.select_counts(
            pool.scores, ~state.done, spec.budget, jnp.clip(room - 1, 0, n - 1)
        )
    t = tree_mod.select_from_pool(state.next_token, pool.tokens, pool.parents, pool.scores, num, n)
    return tree_mod.truncate(t, room)


def packed_tree(spec: SpecConfig, tree: tree_mod.Tree, active: jax.Array | None):
    """(tree, verify.RowPacking) for a verify over the batch-wide budget's rows packed together
    (`KernelOptions.packed_verify`, where the budget is below B x N rows), else (tree, None)."""
    rows = verify.packed_rows(tree.tokens.shape[0], spec.shape.num_nodes, spec.budget)
    if rows is None or not spec.kernels.packed_verify:
        return tree, None
    return verify.pack_rows(tree, active, rows)


def spec_step(params, state: DecodeState, *, cfg: ModelConfig, spec: SpecConfig) -> DecodeState:
    """One step; each stage under its named scope (`stage`), the verify's lm_head included in
    "verify" and the drafter's bookkeeping (after_accept) in "emit", as bench.stage_functions
    splits them."""
    if spec.kernels != cfg.kernels:
        raise ValueError(
            f"SpecConfig.kernels {spec.kernels} differs from ModelConfig.kernels "
            f"{cfg.kernels}: build both from one KernelOptions (LLM(kernel_options=...) "
            "does)"
        )
    check_cache_layout(spec, state.cache)
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    active = ~state.done
    with stage("draft"):
        pool, ds = draft(params, cfg, spec, state, k_draft)
    with stage("select"):
        tree = select(spec, state, pool)
    with stage("verify"):
        tree, packing = packed_tree(spec, tree, active)
        hidden, cache, auxs = verify.verify_forward(
            params,
            cfg,
            tree,
            state.cache,
            mode=spec.mode,
            backend=spec.backend,
            depth_bound=spec.shape.path_nodes,
            packing=packing,
        )
        logits = verify.verify_logits(params, cfg, hidden, packing)
    with stage("accept"):
        if spec.simulate_accept is None:
            acc = accept(
                tree,
                logits,
                state.sampling,
                k_acc,
                max_depth=spec.shape.depth,
                max_children=spec.shape.topk,
            )
        else:  # benchmarks: a chosen acceptance rate, not the target's (acceptance.py)
            acc = accept_simulated(
                tree, logits, state.sampling, k_acc, spec.simulate_accept, spec.shape.depth
            )
    with stage("commit"):
        cache = verify.commit(cache, auxs, tree, acc, active, mode=spec.mode, cfg=cfg)
    with stage("emit"):
        ds = drafter.after_accept(ds, acc.tokens, acc.path, acc.num_accepted, hidden, active)
        state = dataclasses.replace(
            state, cache=cache, extra=ds, key=key, steps=state.steps + active.astype(jnp.int32)
        )
        # Token j of the accepted run was drawn at path node j (a draft accepted there, or the bonus).
        at_path = None if state.logprobs is None else node_rows(logits, acc.path)
        return emit(state, acc.tokens, acc.num_accepted, at_path)
