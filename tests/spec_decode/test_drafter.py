"""The drafter's expansion: the early stop never changes the selected tree (on random pools
with exact ties, and on a tiny model's drafts, greedy and stochastic, with and without the
batch budget), it does stop where no deeper candidate can be selected, and each draft level is
one MTP call and one draft-head read (counted in the jaxpr)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import LLM, ModelConfig
from bole_jax.model import init_params
from bole_jax.spec_decode import budget, drafter
from bole_jax.spec_decode import step as step_mod
from bole_jax.spec_decode import tree as tree_mod

SELECT = jax.jit(tree_mod.select_from_pool, static_argnums=5)
COUNTS = jax.jit(budget.select_counts, static_argnums=2)
CAN_GAIN = jax.jit(drafter.can_gain)


def _expansion(rng, topk, depth, forced, tie_step=0.5):
    """Pool of one request laid out level by level as drafter.expand lays it out (quantised log q:
    many exact ties; `forced`: the synthetic chain, score 0, as child 0 of the best frontier).
    Returns (scores [M], frontier scores per level [depth, topk])."""
    m = topk + (depth - 1) * topk**2
    sc = np.full(m, -np.inf, np.float32)
    lq = lambda n: (-tie_step * rng.choice(4, n, p=[0.1, 0.3, 0.3, 0.3])).astype(np.float32)  # noqa: E731
    sc[:topk] = np.sort(lq(topk))[::-1]
    if forced:
        sc[0] = 0.0
    front = [sc[:topk].copy()]
    for s in range(1, depth):
        c = (front[-1][:, None] + lq(topk * topk).reshape(topk, topk)).reshape(-1)
        if forced:
            c[0] = 0.0
        base = topk + (s - 1) * topk**2
        sc[base : base + topk**2] = c
        front.append(c[np.argsort(-c, kind="stable")[:topk]])
    return sc, np.stack(front)


@pytest.mark.parametrize(
    "n, topk, depth, bud",
    [(4, 3, 5, None), (8, 2, 6, None), (6, 3, 4, 14), (16, 4, 4, 8), (3, 1, 6, 5)],
)
@pytest.mark.parametrize("forced", [False, True])
def test_rule_never_changes_the_selection(n, topk, depth, bud, forced):
    """Random pools: at every level where can_gain is False for every active request, the
    selection (per-request top N-1, or the budget's counts) from the pool so far equals the one
    from the fully expanded pool."""
    rng = np.random.default_rng(n * 100 + topk * 10 + depth + forced)
    b, stops, trials = 5, 0, 40
    m = topk + (depth - 1) * topk**2
    parents = np.full((b, m), -1, np.int32)  # parents do not enter the selected set's choice
    for _ in range(trials):
        pools = [_expansion(rng, topk, depth, forced and rng.random() < 0.5) for _ in range(b)]
        full = np.stack([p[0] for p in pools])
        active = rng.random(b) < 0.8
        cap = rng.integers(0, n, b).astype(np.int32)
        rule = drafter.StopRule(n - 1, bud, jnp.asarray(cap) if bud else None, jnp.asarray(active))
        for s in range(1, depth):
            part = full.copy()
            part[:, topk + (s - 1) * topk**2 :] = -np.inf  # levels 0 .. s-1 drafted
            front = np.stack([p[1][s - 1] for p in pools])
            if np.any(CAN_GAIN(rule, jnp.asarray(part), jnp.asarray(front))):
                continue
            stops += 1
            if bud is None:
                num = np.full(b, n - 1, np.int32)
            else:
                num = np.asarray(
                    COUNTS(jnp.asarray(part), jnp.asarray(active), bud, jnp.asarray(cap))
                )
                np.testing.assert_array_equal(
                    num, COUNTS(jnp.asarray(full), jnp.asarray(active), bud, jnp.asarray(cap))
                )
            tok = jnp.asarray(rng.integers(0, 50, (b, m)), jnp.int32)
            t_part = SELECT(
                jnp.zeros(b, jnp.int32),
                tok,
                jnp.asarray(parents),
                jnp.asarray(part),
                jnp.asarray(num),
                n,
            )
            t_full = SELECT(
                jnp.zeros(b, jnp.int32),
                tok,
                jnp.asarray(parents),
                jnp.asarray(full),
                jnp.asarray(num),
                n,
            )
            for f in ("tokens", "num_nodes", "score"):
                a, c = np.asarray(getattr(t_part, f)), np.asarray(getattr(t_full, f))
                np.testing.assert_array_equal(a[active], c[active], err_msg=f)
            break
    if topk > 1 and not forced:
        assert stops > 0  # the rule does fire on these pools


def _can_gain_pool_wide(rule, scores, front):
    """can_gain's budget threshold G taken over the whole pool (its first form): the reference
    for the form that takes it over each request's N-1 best."""
    b, m = scores.shape
    active = np.ones(b, bool) if rule.active is None else np.asarray(rule.active)
    best_f = front.max(-1)
    n1 = min(rule.num_select, m)
    top = -np.sort(-scores, axis=1)[:, :n1]
    thr = np.full(b, -np.inf) if rule.num_select > m else top[:, -1]
    gain = best_f > thr
    cap = np.clip(np.asarray(rule.cap), 0, n1)
    v_cap = top[np.arange(b), np.maximum(cap - 1, 0)]
    takeable = active[:, None] & (cap[:, None] >= 1) & (scores > v_cap[:, None])
    takeable &= np.isfinite(scores)
    spare = rule.budget - active.sum()
    vals = -np.sort(-np.where(takeable, scores, -np.inf).reshape(-1))
    g = np.inf if spare < 1 else vals[spare - 1] if spare <= vals.size else -np.inf
    return gain & (best_f >= g) & active


@pytest.mark.parametrize("n, topk, depth", [(4, 3, 5), (8, 4, 4), (16, 4, 6), (2, 2, 3)])
def test_budget_threshold_over_top_equals_pool_wide(n, topk, depth):
    """The budget's threshold taken over each request's N-1 best gives can_gain's pool-wide
    answer, on random partial pools with many exact ties, inactive rows, caps from 0 to N-1 and
    budgets below, at and above what the batch can take."""
    rng = np.random.default_rng()
    b = 6
    for _ in range(30):
        pools = [_expansion(rng, topk, depth, rng.random() < 0.3) for _ in range(b)]
        s = rng.integers(1, depth)
        part = np.stack([p[0] for p in pools])
        part[:, topk + (s - 1) * topk**2 :] = -np.inf
        front = np.stack([p[1][s - 1] for p in pools])
        active = rng.random(b) < 0.8
        cap = rng.integers(0, n, b).astype(np.int32)
        for bud in (1, b, 3 * b, b * n, 4 * b * n):
            rule = drafter.StopRule(n - 1, bud, jnp.asarray(cap), jnp.asarray(active))
            got = np.asarray(CAN_GAIN(rule, jnp.asarray(part), jnp.asarray(front)))
            np.testing.assert_array_equal(got, _can_gain_pool_wide(rule, part, front))


def _cfg():
    return ModelConfig.tiny("qwen3_next", vocab_size=96, mtp_num_layers=1)


@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(1), "float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 17, 33, 9)]
    return cfg, params, prompts


def _draft_and_select(llm, state, early_stop):
    spec = llm._spec_config("bole")
    old = step_mod.EARLY_STOP
    step_mod.EARLY_STOP = early_stop
    try:

        def f(params, state):
            pool, _ = step_mod.draft(params, llm.cfg, spec, state, jax.random.key(3))
            return pool, step_mod.select(spec, state, pool)

        return jax.jit(f)(llm.params, state)
    finally:
        step_mod.EARLY_STOP = old


@pytest.mark.parametrize(
    "opts",
    [dict(num_nodes=6, topk=3, depth=5), dict(num_nodes=6, topk=3, depth=4, budget=10)],
    ids=["per-request", "budget"],
)
def test_model_drafts_same_tree_and_stop_early(tiny, opts, monkeypatch):
    """A tiny random model's drafter (flat draft distributions: a deep candidate is never among
    the few best): the expansion stops before the last level and selects the tree of the full
    expansion."""
    cfg, params, prompts = tiny
    monkeypatch.setattr(drafter, "UNROLL", False)  # the while loop watches the early stop
    llm = LLM(cfg, params=params, spec_options=opts)
    state = llm.start_batch(prompts, 16, mode="bole")
    state = dataclasses.replace(state, done=state.done.at[1].set(True))  # an inactive row
    (pool_a, t_a), (pool_b, t_b) = (_draft_and_select(llm, state, e) for e in (True, False))
    assert int(pool_b.levels) == opts["depth"]
    assert 1 <= int(pool_a.levels) < opts["depth"]
    act = ~np.asarray(state.done)
    for f in ("tokens", "parents", "depth", "num_nodes", "score"):
        np.testing.assert_array_equal(
            np.asarray(getattr(t_a, f))[act], np.asarray(getattr(t_b, f))[act], err_msg=f
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_identical_with_and_without_early_stop(tiny, temperature, monkeypatch):
    """The while loop with and without its early stop, and the unrolled levels: the same tokens."""
    cfg, params, prompts = tiny
    outs = []
    for unroll, early in ((False, True), (False, False), (True, True)):
        monkeypatch.setattr(drafter, "UNROLL", unroll)
        monkeypatch.setattr(step_mod, "EARLY_STOP", early)
        llm = LLM(cfg, params=params, spec_options=dict(num_nodes=4, topk=3, depth=5))
        outs.append(
            llm.generate(prompts, max_new_tokens=24, spec="bole", temperature=temperature, seed=5)
        )
    for a, b, c in zip(*outs):
        assert a.token_ids == b.token_ids == c.token_ids


def _dots(eqns, shape):
    """dot_generals whose rhs has `shape`, also inside pjit / named scopes, not inside while
    loops (counted per body)."""
    n = 0
    for e in eqns:
        if e.primitive.name == "dot_general" and tuple(e.invars[1].aval.shape) == shape:
            n += 1
        if e.primitive.name == "while":
            continue
        for p in e.params.values():
            sub = getattr(p, "jaxpr", None)
            if sub is not None and hasattr(sub, "eqns"):
                n += _dots(sub.eqns, shape)
    return n


def _count_draft(monkeypatch, llm, spec, state, early_stop):
    """(jaxpr of the draft, the number of mtp_forward and draft_top_k traces)."""
    calls = dict(mtp=0, head=0)

    def counted(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(drafter, "mtp_forward", counted("mtp", drafter.mtp_forward))
    monkeypatch.setattr(drafter, "draft_top_k", counted("head", drafter.draft_top_k))
    monkeypatch.setattr(step_mod, "EARLY_STOP", early_stop)
    fn = lambda p, s: step_mod.draft(p, llm.cfg, spec, s, jax.random.key(0))  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(llm.params, state).jaxpr
    return fn, jaxpr, calls


def _head_shape(cfg, draft_vocab):
    h = cfg.hidden_size
    if draft_vocab:
        return (h, draft_vocab)
    return (cfg.vocab_size, h) if cfg.tie_word_embeddings else (h, cfg.vocab_size)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_one_mtp_call_and_one_head_read_per_level(tiny, draft_vocab, monkeypatch):
    """Catch-up + root top-k outside the loop, then one level per loop iteration: with the early
    stop watched (a tree) the draft traces mtp_forward and draft_top_k once each outside and once
    in the level body (one while loop), and the draft head [H, V or V_d] is read by one dot
    outside and one in the body. Unrolled (`drafter.UNROLL`), depth traces, depth head dots, no
    while loop. Either way a step makes `levels` MTP calls and head reads."""
    cfg, params, prompts = tiny
    llm = LLM(
        cfg, params=params, spec_options=dict(num_nodes=8, topk=3, depth=5), draft_vocab=draft_vocab
    )
    state = llm.start_batch(prompts, 16, mode="bole")
    spec = llm._spec_config("bole")
    head = _head_shape(cfg, draft_vocab)
    monkeypatch.setattr(drafter, "UNROLL", False)
    _, jaxpr, calls = _count_draft(monkeypatch, llm, spec, state, True)
    assert calls == dict(mtp=2, head=2)
    loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == 1
    assert _dots(jaxpr.eqns, head) == 1
    assert _dots(loops[0].params["body_jaxpr"].jaxpr.eqns, head) == 1

    monkeypatch.setattr(drafter, "UNROLL", True)
    fn, jaxpr, calls = _count_draft(monkeypatch, llm, spec, state, True)
    d = spec.shape.depth
    assert calls == dict(mtp=d, head=d)  # the catch-up, then d - 1 levels
    assert not [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert _dots(jaxpr.eqns, head) == d
    pool, _ = jax.jit(fn)(llm.params, state)
    assert int(pool.levels) == d


@pytest.mark.parametrize("mode", ["chain", "bole-chain", "tree"])
def test_unrolled_levels_draft_the_full_expansion(tiny, mode, monkeypatch):
    """Unrolled (`drafter.UNROLL`, the default on GPUs), the expansion runs every level
    as straight-line code: no while loop, no can_gain, and the pool the while loop drafts without
    the early stop (whose selected tree is the early stop's: test_model_drafts_same_tree_...)."""
    cfg, params, prompts = tiny
    depth = 5
    opts = {
        "chain": dict(depth=depth),
        "bole-chain": dict(topk=1, depth=depth, num_nodes=depth + 1),
        "tree": dict(num_nodes=8, topk=3, depth=depth),
    }[mode]
    llm = LLM(cfg, params=params, spec_options=opts)
    real = "chain" if mode == "chain" else "bole"
    state = llm.start_batch(prompts, 16, mode=real)
    spec = llm._spec_config(real)
    gained = []

    def can_gain(*a):
        gained.append(1)
        return CAN_GAIN(*a)

    monkeypatch.setattr(drafter, "can_gain", can_gain)
    monkeypatch.setattr(drafter, "UNROLL", True)
    fn, jaxpr, calls = _count_draft(monkeypatch, llm, spec, state, True)
    assert calls == dict(mtp=depth, head=depth) and not gained
    assert not [e for e in jaxpr.eqns if e.primitive.name == "while"]
    pool, _ = jax.jit(fn)(llm.params, state)
    assert int(pool.levels) == depth
    if mode != "tree":
        assert np.isfinite(np.asarray(pool.scores)).all()  # a chain's pool is every level's draft
    monkeypatch.setattr(drafter, "UNROLL", False)  # the while loop, no early stop: the same pool
    monkeypatch.setattr(step_mod, "EARLY_STOP", False)
    looped, _ = jax.jit(lambda p, s: fn(p, s))(llm.params, state)  # a new trace
    assert int(looped.levels) == depth
    for f in ("tokens", "parents", "scores"):
        np.testing.assert_array_equal(getattr(pool, f), getattr(looped, f), err_msg=f)


@pytest.mark.parametrize("unroll", [True, False])
def test_draft_levels_stop_at_n_minus_1(tiny, unroll, monkeypatch):
    """A tree of N nodes drafts min(D, N - 1) levels: no node deeper than N - 1 can be selected
    (the selection is prefix-connected). The pool of a 4-node tree is the first 3 levels of the
    full 5-level pool, and selecting 4 nodes from either gives the same tree: the synthetic
    drafter's forced chain (score 0, the top at every depth) makes it the depth-3 path."""
    cfg, params, prompts = tiny
    monkeypatch.setattr(drafter, "UNROLL", unroll)
    monkeypatch.setattr(step_mod, "EARLY_STOP", False)
    assert drafter.TreeShape(3, 5, 4).draft_levels == 3
    assert drafter.TreeShape(3, 5, 16).draft_levels == 5
    assert (
        drafter.TreeShape(1, 8, 9).draft_levels == 8
        and drafter.TreeShape(2, 8, 1).draft_levels == 1
    )
    out = {}
    for n in (4, 16):
        opts = dict(num_nodes=n, topk=3, depth=5, synthetic_accept=0.9)
        llm = LLM(cfg, params=params, spec_options=opts)
        oracle = np.arange(len(prompts) * 32).reshape(len(prompts), 32) % cfg.vocab_size
        state = llm.start_batch(prompts, 16, mode="bole", oracle=jnp.asarray(oracle, jnp.int32))
        spec = llm._spec_config("bole")
        pool = jax.jit(lambda p, s: step_mod.draft(p, cfg, spec, s, jax.random.key(0))[0])(
            llm.params, state
        )
        out[n] = (llm, state, spec, pool)
    small, full = out[4][3], out[16][3]
    assert int(small.levels) == 3 and int(full.levels) == 5
    head = 3 + 2 * 3**2  # the candidates of levels 1..3
    for f in ("tokens", "parents", "scores"):
        np.testing.assert_array_equal(
            np.asarray(getattr(small, f))[:, :head], np.asarray(getattr(full, f))[:, :head]
        )
    assert np.isneginf(np.asarray(small.scores)[:, head:]).all()
    assert (np.asarray(small.parents)[:, head:] == -1).all()
    _, state, spec, _ = out[4]
    t_small, t_full = (
        jax.jit(step_mod.select, static_argnums=0)(spec, state, pl) for pl in (small, full)
    )
    assert (np.asarray(t_full.depth).max(axis=1) == 3).all()  # the forced path, 3 deep
    for f in ("tokens", "parents", "depth", "num_nodes", "score"):
        np.testing.assert_array_equal(
            np.asarray(getattr(t_small, f)), np.asarray(getattr(t_full, f)), err_msg=f
        )


def test_levels_unrolled_on_gpus_only(monkeypatch):
    """UNROLL = None (the default): unrolled levels on GPUs, the while loop and its early stop
    elsewhere (CPU, TPU); True / False force one form."""
    monkeypatch.setattr(drafter, "UNROLL", None)
    assert not drafter.unroll_levels("cpu") and not drafter.unroll_levels("tpu")
    assert drafter.unroll_levels("gpu") and drafter.unroll_levels("cuda")
    assert drafter.unroll_levels() == (jax.default_backend() in drafter.GPU_BACKENDS)
    for force in (True, False):
        monkeypatch.setattr(drafter, "UNROLL", force)
        assert drafter.unroll_levels("cpu") is force and drafter.unroll_levels("gpu") is force


@pytest.mark.parametrize("mode", ["bole", "chain"])
def test_mtp_cache_slots_are_aligned(tiny, mode):
    """The MTP cache holds the target's capacity plus a step's draft slots and slot 0, rounded up
    to DRAFT_SLOT_ALIGN (a multiple of 8: XLA on the GPU pads a bf16 dot's unaligned operand, which
    for the drafter's attention is a copy of the whole MTP cache per level)."""
    cfg, params, prompts = tiny
    assert drafter.DRAFT_SLOT_ALIGN % 8 == 0
    llm = LLM(cfg, params=params, spec_options=dict(num_nodes=6, topk=3, depth=4))
    shape = llm._spec_config(mode).shape
    for new in (16, 100):
        state = llm.start_batch(prompts, new, mode=mode)
        cap = state.cache.capacity
        for c in state.extra.kv:
            slots = c.k.shape[2]
            assert slots == drafter.draft_cache_capacity(cap, shape)
            assert slots % drafter.DRAFT_SLOT_ALIGN == 0
            assert (
                cap + shape.draft_slots + 1
                <= slots
                < cap + shape.draft_slots + 1 + drafter.DRAFT_SLOT_ALIGN
            )
