"""Speculative decoding engine: every mode is lossless against autoregressive decoding.

Greedy outputs of bole / pernode / chain must equal AR token for token. With random weights the
MTP drafter is rarely right, so each mode also runs with the synthetic-acceptance drafter (the AR
continuation placed in the tree, each depth kept with probability 0.8): deep accepted runs then
exercise the commit of GDN state, conv state and KV compaction. bole runs with its default eager
commit and with the lazy one (`bole-lazy`); `test_lazy_commit_matches_eager_each_step` steps both.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import LLM, ModelConfig
from bole_jax.model import forward, init_cache, init_params
from bole_jax.model import logits as lm_logits
from bole_jax.model.cache import (
    GDNCache,
    committed_state,
    pending_nodes,
    pending_rows,
    with_pending,
)
from bole_jax.pallas.factors import PendingCommit, PendingPath
from bole_jax.sampling import SamplingParams
from bole_jax.spec_decode import acceptance, verify
from bole_jax.spec_decode import tree as tree_mod
from bole_jax.spec_decode.acceptance import accept_greedy
from bole_jax.spec_decode.step import spec_step

PROMPT_LENS = (5, 17, 33, 9)
NEW = 64


def _prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in PROMPT_LENS]


def _cfg(family, moe=False):
    # Small vocab so the target is peaky enough for some random-MTP drafts to be right.
    return ModelConfig.tiny(family, moe=moe, vocab_size=96, mtp_num_layers=1)


@pytest.fixture(
    scope="module",
    params=[("qwen3_next", False), ("qwen3_next", True), ("qwen3_5", False)],
    ids=["next", "next-moe", "q35"],
)
def model(request):
    family, moe = request.param
    cfg = _cfg(family, moe)
    params = init_params(cfg, jax.random.key(1), "float32")
    prompts = _prompts(cfg.vocab_size)
    ar = LLM(cfg, params=params).generate(prompts, max_new_tokens=NEW, spec="ar")
    return cfg, params, prompts, ar


SYNTHETIC = dict(synthetic_accept=0.8, num_nodes=16, depth=6)


@pytest.fixture(scope="module")
def bole_llms(model):
    """{lazy_commit: LLM} with the synthetic drafter, shared so that each compiles its decode
    segment once (generate below, then the step-by-step comparison)."""
    cfg, params, _, _ = model
    return {
        lazy: LLM(cfg, params=params, spec_options=dict(SYNTHETIC, lazy_commit=lazy))
        for lazy in (True, False)
    }


@pytest.mark.parametrize("mode", ["bole", "bole-lazy", "pernode", "chain", "bole-chain"])
def test_greedy_spec_equals_ar_synthetic(model, bole_llms, mode):
    cfg, params, prompts, ar = model
    if mode != "bole" and (cfg.num_experts or cfg.family != "qwen3_next"):
        pytest.skip(
            "baselines and the lazy commit differ only in GDN state handling: one family "
            "covers them"
        )
    if mode == "bole-chain":  # the chain's shape, verified and committed by bole
        chain = dict(SYNTHETIC, topk=1, num_nodes=SYNTHETIC["depth"] + 1)
        llm, mode = LLM(cfg, params=params, spec_options=chain), "bole"
        assert llm._spec_config("bole").shape.topk == 1
    elif mode.startswith("bole"):
        llm, mode = bole_llms[mode == "bole-lazy"], "bole"
    else:
        llm = LLM(cfg, params=params, spec_options=SYNTHETIC)
    out = llm.generate(prompts, max_new_tokens=NEW, spec=mode, oracle=[o.token_ids for o in ar])
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids
        assert o.stats["drafter"].startswith("synthetic acceptance")
    mean_acc = np.mean([o.stats["tokens_per_step"] for o in out])
    assert mean_acc > 2.0, mean_acc  # deep acceptance really happened


def test_greedy_spec_equals_ar_mtp(model):
    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip(
            "the synthetic drafter runs this family's MTP head too (catch-up and every "
            "expansion level; it only overrides one candidate per level): "
            "test_greedy_spec_equals_ar_synthetic covers it, the unforced drafts are "
            "family-independent"
        )
    out = LLM(cfg, params=params, spec_options=dict(num_nodes=16, depth=4)).generate(
        prompts, max_new_tokens=NEW, spec="bole"
    )
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids
        assert o.stats["drafter"] == "mtp"


def test_greedy_bole_with_draft_vocab_equals_ar(model):
    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip("the draft vocabulary only changes the drafter's head: one family covers it")
    llm = LLM(cfg, params=params, spec_options=dict(num_nodes=16, depth=4), draft_vocab=24)
    out = llm.generate(prompts, max_new_tokens=NEW, spec="bole")
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids
        assert o.stats["drafter"] == "mtp, 24-token draft vocabulary"
    assert llm.params["mtp"]["draft_head"].shape == (cfg.hidden_size, 24)


@pytest.mark.parametrize("lazy", [False, True, "chain"], ids=["eager", "lazy", "chain"])
def test_greedy_bole_with_pallas_kernels_equals_ar(model, lazy):
    """The engine on the Pallas kernels (interpret mode here; the GPU default): the tree verify
    with the step's static depth bound (tree depth + 1; a request past it would get NaN), the
    dot-fold commit kernel (eager) or the verify's fold (lazy), the tree conv kernel; "chain": the
    bole chain (one child per node, every node on the accepted path's depth bound)."""
    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip("kernel plumbing, not model family: one family covers it")
    opts = dict(SYNTHETIC, backend="pallas", lazy_commit=lazy is True)
    if lazy == "chain":
        opts.update(topk=1, num_nodes=SYNTHETIC["depth"] + 1)
    llm = LLM(cfg, params=params, spec_options=opts)
    out = llm.generate(
        prompts[:2], max_new_tokens=24, spec="bole", oracle=[o.token_ids for o in ar[:2]]
    )
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids[:24]
    assert np.mean([o.stats["tokens_per_step"] for o in out]) > 2.0


def test_default_mode_is_bole_with_mtp_else_ar():
    cfg = _cfg("qwen3_next")
    assert LLM(cfg).default_spec == "bole"
    cfg0 = ModelConfig.tiny("qwen3_next", vocab_size=96)
    llm = LLM(cfg0)
    assert llm.default_spec == "ar"
    with pytest.raises(ValueError, match="no MTP head"):
        llm.generate([[1, 2, 3]], max_new_tokens=4, spec="bole")
    with pytest.raises(ValueError, match="unknown spec mode"):
        llm.generate([[1, 2, 3]], max_new_tokens=4, spec="medusa")


def test_lazy_commit_matches_eager_each_step(model, bole_llms):
    """Lazy and eager bole commits, stepped side by side from the same prefill (one step per
    segment: the programs generate compiled above): after every step the lazy cache's committed
    GDN states apply_pending(state, pending) equal the eager states (fp32, tight), conv states,
    KV lengths and outputs agree, and both end on AR's tokens."""
    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip("the commit is the same code for every family: one covers it")
    oracle = [o.token_ids for o in ar]
    b = len(prompts)
    runs = {}
    for lazy, llm in bole_llms.items():
        spec = llm._spec_config("bole", b)
        assert spec.lazy_commit is lazy and spec.pending_length == (7 if lazy else None)
        state = llm.start_batch(prompts, NEW, mode="bole", oracle=oracle, spec_batch=b)
        runs[lazy] = [llm.segment_fn("bole", b), state]
    pending_seen = 0
    for _ in range(NEW):
        for run in runs.values():
            run[1] = run[0](params, run[1], jnp.int32(1))
        lazy_st, eager_st = runs[True][1], runs[False][1]
        np.testing.assert_array_equal(lazy_st.out, eager_st.out)
        np.testing.assert_array_equal(lazy_st.cache.lengths, eager_st.cache.lengths)
        for c_l, c_e in zip(lazy_st.cache.layers, eager_st.cache.layers):
            if isinstance(c_l, GDNCache):
                assert c_e.pending is None and pending_rows(c_l.pending) == 7
                assert pending_nodes(c_l.pending) == (
                    spec.shape.num_nodes if spec.kernels.lazy_rows == "path" else None
                )
                pending_seen += int(np.sum(c_l.pending.count))
                np.testing.assert_allclose(committed_state(c_l), c_e.state, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(c_l.conv, c_e.conv, rtol=1e-5, atol=1e-6)
        if bool(jnp.all(eager_st.done)):
            break
    assert bool(jnp.all(lazy_st.done)) and pending_seen > 0
    for i, want in enumerate(oracle):
        assert np.asarray(lazy_st.out[i, : len(want)]).tolist() == want
    with pytest.raises(ValueError, match="pending commits of"):  # layouts do not mix
        jax.eval_shape(
            functools.partial(spec_step, cfg=cfg, spec=bole_llms[False]._spec_config("bole", b)),
            params,
            lazy_st,
        )


def test_forward_folds_a_pending_commit():
    """The model forward (an AR decode step) on a cache with a lazy commit pending equals the
    forward on the settled cache, and leaves nothing pending. (Prefill runs the same `_gdn_core`
    with the chunked rule.)"""
    from serving.test_prefix_cache import random_pending  # tests/ is on sys.path (conftest)

    cfg = _cfg("qwen3_next")
    params = init_params(cfg, jax.random.key(4), "float32")
    toks = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 1)), jnp.int32)
    cache = random_pending(init_cache(cfg, 2, 16, jnp.float32), cfg, 5)
    fwd = jax.jit(functools.partial(forward, params, cfg))
    h_lazy, out_lazy = fwd(toks, cache)
    h_ref, out_ref = fwd(toks, with_pending(cache, cfg, None))
    np.testing.assert_allclose(h_lazy, h_ref, rtol=1e-5, atol=1e-5)
    for c, r in zip(out_lazy.layers, out_ref.layers):
        if isinstance(c, GDNCache):
            np.testing.assert_array_equal(c.pending.count, 0)
            np.testing.assert_allclose(committed_state(c), r.state, rtol=1e-5, atol=1e-6)


# Jitted, shared by the three modes below (op by op, the bole case alone took 40-100 s on CI).
_forward = jax.jit(forward, static_argnums=1)
_verify = jax.jit(verify.verify_forward, static_argnums=1, static_argnames=("mode",))
_accept = jax.jit(accept_greedy, static_argnums=2)
_accept_stochastic = jax.jit(
    lambda tree, logits, sp, key: acceptance.accept_stochastic(tree, logits, sp, key, 8, 4)
)
_commit = jax.jit(verify.commit, static_argnames=("mode",))


@pytest.mark.parametrize("mode", ["bole", "bole-fused", "bole-lazy", "bole-lazy-gather", "pernode"])
def test_commit_equals_ar_cache(mode, monkeypatch):
    """After verify + greedy accept + commit of an oracle tree, the cache equals AR's (bole-lazy:
    its committed states; the pending commit kept as the step's factors and accepted path, or
    -gather, as the path's gathered rows; bole-fused: every GDN layer's commit in one Pallas
    launch, `KernelOptions.fused_commit`, run here in interpret mode)."""
    lazy = mode.startswith("bole-lazy")
    gather = mode == "bole-lazy-gather"
    fused = mode == "bole-fused"
    mode = "bole" if lazy or fused else mode
    cfg = _cfg("qwen3_next")
    if fused:
        from bole_jax.pallas import tree_gdn_commit

        calls = []

        def one_launch(*a, **kw):
            calls.append(len(a[0]))
            return commit_states(*a, **kw, backend="pallas", interpret=True)

        commit_states = tree_gdn_commit.commit_states
        monkeypatch.setattr(tree_gdn_commit, "commit_states", one_launch)
        monkeypatch.setattr(verify, "resolve_backend", lambda b, i: ("pallas", True))
        cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, fused_commit=True))
    params = init_params(cfg, jax.random.key(2), "float32")
    rng = np.random.default_rng(5)
    b, cap, n = 3, 128, 12
    lens = np.array([7, 3, 12], np.int32)
    toks = np.zeros((b, 12), np.int32)
    for i in range(b):
        toks[i, : lens[i]] = rng.integers(1, cfg.vocab_size, lens[i])
    cache = init_cache(cfg, b, cap, jnp.float32)
    hidden, cache = _forward(params, cfg, jnp.asarray(toks), cache, jnp.asarray(lens))
    root = jnp.argmax(
        lm_logits(
            params,
            cfg,
            jnp.take_along_axis(hidden, jnp.asarray(lens - 1)[:, None, None], axis=1)[:, 0],
        ),
        -1,
    ).astype(jnp.int32)
    # AR continuation of 5 tokens after the root.
    ar_cache, tok, cont = cache, root, []
    for _ in range(5):  # (num_new all ones: the decode program of the reference run below)
        h, ar_cache = _forward(params, cfg, tok[:, None], ar_cache, jnp.ones((b,), jnp.int32))
        tok = jnp.argmax(lm_logits(params, cfg, h[:, 0]), -1).astype(jnp.int32)
        cont.append(tok)
    cont = np.stack(cont, 1)  # [B, 5]
    # Tree: root, a path with the AR tokens for the first `depth_ok[b]` levels, plus distractors.
    depth_ok = [4, 0, 2]
    parents = np.full((b, n), -1, np.int32)
    tokens = np.zeros((b, n), np.int32)
    for i in range(b):
        tokens[i, 0] = root[i]
        prev = 0
        nodes = 1
        for d in range(4):
            # a wrong sibling first, then the right (or wrong when past depth_ok) token
            parents[i, nodes], tokens[i, nodes] = prev, (cont[i, d] + 1) % cfg.vocab_size
            nodes += 1
            parents[i, nodes] = prev
            tokens[i, nodes] = cont[i, d] if d < depth_ok[i] else (cont[i, d] + 2) % cfg.vocab_size
            prev = nodes
            nodes += 1
    num_nodes = jnp.full((b,), 9, jnp.int32)
    parents = np.where(np.arange(n)[None] < 9, parents, -1)
    tree = tree_mod.Tree(
        tokens=jnp.asarray(tokens),
        parents=jnp.asarray(parents),
        depth=tree_mod.depths(jnp.asarray(parents), num_nodes),
        num_nodes=num_nodes,
        score=jnp.zeros((b, n)),
    )
    if lazy:  # a step's pending: 9 rows (depth 8 + 1) of n nodes; here nothing pending yet
        cache = with_pending(cache, cfg, 9, None if gather else n)
    hid, vcache, auxs = _verify(params, cfg, tree, cache, mode=mode)
    acc = _accept(tree, jnp.argmax(lm_logits(params, cfg, hid), -1).astype(jnp.int32), 8)
    np.testing.assert_array_equal(np.asarray(acc.num_accepted), np.array(depth_ok) + 1)
    commit = jax.jit(verify.commit, static_argnames=("mode", "cfg"))
    new = commit(
        vcache, auxs, tree, acc, jnp.ones((b,), bool), mode=mode, cfg=cfg if fused else None
    )
    if fused:  # one call for every GDN layer
        assert calls == [sum(isinstance(c, GDNCache) for c in vcache.layers)] and calls[0] > 1
    if lazy:  # the commit left the accepted paths pending, the state untouched
        for c_new, c_old in zip(new.layers, vcache.layers):
            if isinstance(c_new, GDNCache):
                np.testing.assert_array_equal(c_new.pending.count, np.array(depth_ok) + 1)
                np.testing.assert_array_equal(c_new.state, c_old.state)
                assert isinstance(c_new.pending, PendingCommit if gather else PendingPath)
        new = dataclasses.replace(
            new,
            layers=tuple(
                GDNCache(conv=c.conv, state=committed_state(c)) if isinstance(c, GDNCache) else c
                for c in new.layers
            ),
        )
    # AR reference: feed root + accepted drafts.
    ref = cache
    for d in range(max(depth_ok) + 1):
        step_tok = jnp.asarray(
            np.where(
                np.array(depth_ok) >= d,
                np.concatenate([np.asarray(root)[:, None], cont], 1)[:, d],
                0,
            )
        )
        num_new = jnp.asarray((np.array(depth_ok) >= d).astype(np.int32))
        _, ref = _forward(params, cfg, step_tok[:, None], ref, num_new)
    np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(ref.lengths))
    for c_new, c_ref in zip(new.layers, ref.layers):
        if isinstance(c_new, GDNCache):
            np.testing.assert_allclose(c_new.state, c_ref.state, rtol=1e-4, atol=1e-5)
            # pre-conv inputs: projections of 12 rows vs 1 row differ by matmul rounding only
            np.testing.assert_allclose(c_new.conv, c_ref.conv, rtol=1e-4, atol=1e-5)
        else:
            for i in range(b):
                L = int(ref.lengths[i])
                kn, kr = c_new.k[i, :, :L], c_ref.k[i, :, :L]
                np.testing.assert_allclose(kn, kr, rtol=1e-4, atol=1e-5)
                vn, vr = c_new.v[i, :, :L], c_ref.v[i, :, :L]
                np.testing.assert_allclose(vn, vr, rtol=1e-4, atol=1e-5)
    # The bonus token is AR's next token after the accepted run.
    expect_bonus = [cont[i, depth_ok[i]] for i in range(b)]
    np.testing.assert_array_equal(np.asarray(acc.bonus), expect_bonus)


def _random_tree(rng, num_nodes, n, vocab):
    b = len(num_nodes)
    parents = np.full((b, n), -1, np.int32)
    for i in range(b):
        for j in range(1, num_nodes[i]):
            parents[i, j] = rng.integers(0, j)
    num = jnp.asarray(num_nodes, jnp.int32)
    valid = np.arange(n)[None] < np.asarray(num_nodes)[:, None]
    return tree_mod.Tree(
        tokens=jnp.asarray(np.where(valid, rng.integers(1, vocab, (b, n)), 0), jnp.int32),
        parents=jnp.asarray(parents),
        depth=tree_mod.depths(jnp.asarray(parents), num),
        num_nodes=num,
        score=jnp.asarray(np.where(valid, 0.0, -np.inf), jnp.float32),
    )


def test_pack_rows_layout_and_truncation():
    """Active requests' nodes fill the rows in request order; an inactive request verifies
    nothing; a request running past the last row keeps the nodes before it."""
    tree = _random_tree(np.random.default_rng(0), [5, 2, 7, 4], 8, 50)
    active = jnp.asarray([True, True, False, True])
    t, pk = verify.pack_rows(tree, active, 9)
    np.testing.assert_array_equal(t.num_nodes, [5, 2, 7, 2])  # request 3: rows 7 and 8 only
    dest = np.asarray(pk.dest)
    np.testing.assert_array_equal(dest[0, :5], np.arange(5))
    np.testing.assert_array_equal(dest[1, :2], [5, 6])
    np.testing.assert_array_equal(dest[3, :2], [7, 8])
    assert (dest[2] == 9).all() and (dest[0, 5:] == 9).all() and (dest[3, 2:] == 9).all()
    np.testing.assert_array_equal(pk.src, [0, 1, 2, 3, 4, 8, 9, 24, 25])
    x = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8) + 1
    back = np.asarray(pk.unpack(pk.pack(x)))
    np.testing.assert_array_equal(back, np.where(dest < 9, np.asarray(x), 0))
    assert verify.packed_rows(4, 8, None) is None and verify.packed_rows(4, 8, 32) is None
    assert verify.packed_rows(4, 8, 9) == 9 and verify.packed_rows(16, 8, 9) == 16


@pytest.mark.parametrize("mode", ["bole", "pernode", "chain"])
def test_packed_verify_matches_the_unpacked_one(mode):
    """The verify over packed rows gives the unpacked verify's outputs at every verified node:
    hidden states, logits (left packed: `acceptance.NodeLogits`, read by node), the same greedy
    and stochastic acceptance, and after the commit the same caches for active requests."""
    cfg = _cfg("qwen3_next")
    params = init_params(cfg, jax.random.key(3), "float32")
    rng = np.random.default_rng(7)
    b, cap, n = 4, 64, 8
    lens = np.array([6, 11, 3, 9], np.int32)
    toks = np.where(
        np.arange(12)[None] < lens[:, None], rng.integers(1, cfg.vocab_size, (b, 12)), 0
    )
    cache = init_cache(cfg, b, cap, jnp.float32)
    _, cache = _forward(params, cfg, jnp.asarray(toks, jnp.int32), cache, jnp.asarray(lens))
    sizes = [6, 6, 6, 6] if mode == "chain" else [5, 2, 7, 4]
    tree = _random_tree(rng, sizes, n, cfg.vocab_size)
    if mode == "chain":
        tree = tree_mod.chain_tree(tree.tokens, tree.num_nodes)
    active = jnp.asarray([True, True, False, True])
    rows = int(sum(s for s, a in zip(sizes, active) if a))
    t_pk, pk = verify.pack_rows(tree, active, rows)
    np.testing.assert_array_equal(t_pk.num_nodes, tree.num_nodes)  # nothing truncated
    outs = {}
    for name, packing in (("full", None), ("packed", pk)):
        hid, vcache, auxs = verify.verify_forward(
            params, cfg, tree, cache, mode=mode, packing=packing
        )
        logits = verify.verify_logits(params, cfg, hid, packing)
        assert isinstance(logits, acceptance.NodeLogits) == (packing is not None)
        dense = acceptance.node_rows(logits, jnp.broadcast_to(jnp.arange(n), (b, n)))
        acc = _accept(tree, acceptance.node_argmax(logits), 8)
        stoch = _accept_stochastic(tree, logits, SamplingParams.make(b, 1.0), jax.random.key(5))
        c = _commit(vcache, auxs, tree, acc, active, mode=mode)
        outs[name] = (hid, dense, acc, stoch, c)
    (h0, l0, a0, s0, c0), (h1, l1, a1, s1, c1) = outs["full"], outs["packed"]
    kept = np.asarray(tree.valid & active[:, None])
    np.testing.assert_allclose(np.asarray(h1)[kept], np.asarray(h0)[kept], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l1)[kept], np.asarray(l0)[kept], rtol=1e-5, atol=1e-5)
    assert (np.asarray(h1)[~kept] == 0).all() and (np.asarray(l1)[~kept] == 0).all()
    on = np.asarray(active)
    for x1, x0 in ((a1, a0), (s1, s0)):
        for f in ("num_accepted", "path", "tokens"):
            np.testing.assert_array_equal(
                np.asarray(getattr(x1, f))[on], np.asarray(getattr(x0, f))[on]
            )
    np.testing.assert_array_equal(np.asarray(c1.lengths), np.asarray(c0.lengths))
    for x1, x0 in zip(jax.tree.leaves(c1.layers), jax.tree.leaves(c0.layers)):
        np.testing.assert_allclose(np.asarray(x1)[on], np.asarray(x0)[on], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["bole", "pernode", "chain"])
def test_greedy_spec_with_a_packed_budget_equals_ar(model, mode):
    """A batch-wide budget below B x N: the verify runs over the budget's packed rows
    (`KernelOptions.packed_verify`, the default), lossless; the same tokens without packing."""
    cfg, params, prompts, ar = model
    if mode != "bole" and (cfg.num_experts or cfg.family != "qwen3_next"):
        pytest.skip("the packing is of the target's matmuls: the baselines on one family")
    opts = dict(SYNTHETIC, budget=10)
    out = LLM(cfg, params=params, spec_options=opts).generate(
        prompts, max_new_tokens=NEW, spec=mode, oracle=[o.token_ids for o in ar]
    )
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids
    assert np.mean([o.stats["tokens_per_step"] for o in out]) > 1.5


def test_start_batch_exact_rows_is_lossless(model):
    """`start_batch(rows=n)` lays the state out with exactly n rows (the fixed-memory benchmark's
    and the server's slot layout, no power-of-two padding): 3 prompts in 3 rows decode with bole
    to AR's tokens; fewer rows than prompts is refused."""
    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip("the layout is the same code for every family: one covers it")
    llm = LLM(cfg, params=params, max_batch_size=3)
    state = llm.start_batch(prompts[:3], NEW, mode="bole", rows=3, spec_batch=3)
    assert state.out.shape[0] == 3 and state.cache.lengths.shape[0] == 3
    state = llm.segment_fn("bole", 3)(params, state, jnp.int32(NEW))
    assert bool(jnp.all(state.done))
    for i in range(3):
        want = ar[i].token_ids
        assert np.asarray(state.out[i, : len(want)]).tolist() == want
    with pytest.raises(ValueError, match="rows=2 < the 3 prompts"):
        llm.start_batch(prompts[:3], NEW, mode="bole", rows=2)


def test_generate_splits_a_batch_the_device_memory_cannot_hold(model, monkeypatch, caplog):
    """`generate` decodes as many prompts per batch as the device's free memory holds (the
    estimated decode state of a batch's rows, `serving.memory.slot_bytes`), logging it, with the
    same outputs; where one request does not fit it says so instead of running out of memory."""
    import logging

    from bole_jax.model import parallel
    from bole_jax.serving.memory import slot_bytes

    cfg, params, prompts, ar = model
    if cfg.num_experts or cfg.family != "qwen3_next":
        pytest.skip("the batch split does not depend on the family")
    llm = LLM(cfg, params=params, spec_options=dict(num_nodes=8, depth=4))
    sizes = []
    real = llm._generate_batch
    monkeypatch.setattr(
        llm, "_generate_batch", lambda ids, *a, **k: sizes.append(len(ids)) or real(ids, *a, **k)
    )
    spec = llm._spec_config("bole", 2, quiet=True, kv=None)
    cap = 1 << (max(map(len, prompts)) + NEW + spec.slack).bit_length()
    row = sum(slot_bytes(cfg, max(cap, 64), NEW, spec, params["embed"].dtype).values())
    # room for 2 rows' state (and not 4) within the share generate leaves the state
    free = int(2.5 * row / 0.9)
    monkeypatch.setattr(parallel, "available_bytes", lambda device=None: free)
    caplog.set_level(logging.WARNING, logger="bole_jax")
    out = llm.generate(prompts, max_new_tokens=NEW, spec="bole")
    assert sizes == [2] * (len(prompts) // 2) + [1] * (len(prompts) % 2), sizes
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert any("hold batches of 2" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(parallel, "available_bytes", lambda device=None: row // 2)
    with pytest.raises(ValueError, match="needs about .* MiB of decode state"):
        llm.generate(prompts[:1], max_new_tokens=NEW, spec="bole")
    # the estimate is the state actually allocated (its step transient aside)
    state = llm.start_batch(prompts[:2], NEW, mode="bole", spec_batch=2, out_len=NEW)
    parts = slot_bytes(cfg, state.cache.capacity, NEW, spec, params["embed"].dtype)
    held = 2 * (sum(parts.values()) - parts["step_transient"])
    assert sum(x.nbytes for x in jax.tree.leaves(state)) == pytest.approx(held, rel=0.01)
