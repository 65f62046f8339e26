"""Tree structure, candidate selection and lossless acceptance (greedy and stochastic)."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.pallas.tree_utils import tree_structure
from bole_jax.sampling import SamplingParams, target_probs
from bole_jax.spec_decode import acceptance, drafter
from bole_jax.spec_decode import tree as tree_mod


def _random_pool(rng, b, m, vocab=50):
    """A breadth-ordered candidate pool with monotone cumulative scores."""
    parents = np.full((b, m), -1, np.int32)
    scores = np.zeros((b, m), np.float32)
    for i in range(b):
        for j in range(m):
            p = int(rng.integers(-1, j)) if j else -1
            parents[i, j] = p
            base = scores[i, p] if p >= 0 else 0.0
            # ties on purpose: some children with log-prob exactly 0
            scores[i, j] = base + (
                0.0 if rng.random() < 0.15 else float(np.log(rng.random() + 1e-3))
            )
    tokens = rng.integers(0, vocab, (b, m)).astype(np.int32)
    return tokens, parents, scores


@pytest.mark.parametrize("n,m", [(2, 5), (8, 20), (16, 16), (33, 120)])
def test_select_from_pool_invariants(n, m):
    rng = np.random.default_rng(n * 1000 + m)
    b = 6
    tokens, parents, scores = _random_pool(rng, b, m)
    num_select = rng.integers(0, n, b)
    select = jax.jit(tree_mod.select_from_pool, static_argnums=5)  # as the decode step runs it
    t = select(
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(tokens),
        jnp.asarray(parents),
        jnp.asarray(scores),
        jnp.asarray(num_select),
        n,
    )
    t2 = select(
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(tokens),
        jnp.asarray(parents),
        jnp.asarray(scores),
        jnp.asarray(num_select),
        n,
    )
    for f in ("tokens", "parents", "depth", "num_nodes"):  # deterministic
        np.testing.assert_array_equal(getattr(t, f), getattr(t2, f))
    par = np.asarray(t.parents)
    num = np.asarray(t.num_nodes)
    dep = np.asarray(t.depth)
    for i in range(b):
        k = num[i]
        assert k == 1 + min(num_select[i], n - 1, m)
        assert par[i, 0] == -1 and t.tokens[i, 0] == i
        for j in range(1, k):  # connected, topological, depth consistent
            assert 0 <= par[i, j] < j
            assert dep[i, j] == dep[i, par[i, j]] + 1
        assert (par[i, k:] == -1).all()
        # The selected set is the top-k by score (ties: lower pool index): compare with numpy.
        order = sorted(range(m), key=lambda c: (-scores[i, c], c))[: k - 1]
        chosen = sorted(order)
        np.testing.assert_array_equal(np.asarray(t.tokens[i, 1:k]), tokens[i, chosen])


def test_tree_structure_matches_walk():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 16, 64, 128):
        parents = np.array(
            [[-1] + [int(rng.integers(-1, j)) for j in range(1, n)] for _ in range(3)], np.int32
        )
        m = np.asarray(tree_structure(jnp.asarray(parents)).anc)
        for b in range(3):
            for i in range(n):
                expect = set()
                j = i
                while j >= 0:
                    expect.add(j)
                    j = parents[b, j]
                assert set(np.nonzero(m[b, i])[0]) == expect


def _random_tree(rng, n, vocab, max_children=4):
    parents = [-1]
    kids = {0: 0}
    for j in range(1, n):
        opts = [p for p in range(j) if kids.get(p, 0) < max_children]
        p = int(rng.choice(opts))
        kids[p] = kids.get(p, 0) + 1
        parents.append(p)
    tokens = []
    used = {}
    for j, p in enumerate(parents):  # siblings get distinct tokens
        s = used.setdefault(p, set())
        t = int(rng.choice([x for x in range(vocab) if x not in s]))
        s.add(t)
        tokens.append(t)
    return np.array(tokens, np.int32), np.array(parents, np.int32)


def _make_tree(tokens, parents, num_nodes):
    t = jnp.asarray(tokens)
    p = jnp.asarray(parents)
    nn = jnp.asarray(num_nodes, jnp.int32)
    return tree_mod.Tree(
        tokens=t,
        parents=p,
        depth=tree_mod.depths(p, nn),
        num_nodes=nn,
        score=jnp.zeros(t.shape, jnp.float32),
    )


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "loop"])
def test_greedy_acceptance_matches_python_walk(unroll):
    rng = np.random.default_rng(1)
    b, n, vocab = 8, 24, 5
    toks, pars, nums = [], [], []
    for _ in range(b):
        t, p = _random_tree(rng, n, vocab)
        toks.append(t)
        pars.append(p)
        nums.append(int(rng.integers(1, n + 1)))
    pars = np.where(np.arange(n)[None] < np.array(nums)[:, None], np.array(pars), -1)
    tree = _make_tree(np.array(toks), pars, nums)
    target = rng.integers(0, vocab, (b, n)).astype(np.int32)
    acc = acceptance.accept_greedy(tree, jnp.asarray(target), max_depth=n, unroll=unroll)
    for i in range(b):
        cur, path = 0, [0]
        while True:
            kids = [j for j in range(nums[i]) if pars[i, j] == cur and toks[i][j] == target[i, cur]]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        assert int(acc.num_accepted[i]) == len(path)
        np.testing.assert_array_equal(np.asarray(acc.path[i, : len(path)]), path)
        emitted = [toks[i][j] for j in path[1:]] + [target[i, cur]]
        np.testing.assert_array_equal(np.asarray(acc.tokens[i, : len(path)]), emitted)
        assert int(acc.last[i]) == cur


def _chi2_critical(dof, alpha):
    """Upper-alpha quantile of chi-square (Wilson-Hilferty approximation)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@jax.jit
def _first_two_emitted(tree, logits, sp, keys):
    """accept_stochastic once per key: (first two emitted tokens, number accepted) of request 0.
    Module level: one compile for every parametrization below (sampling params are arrays)."""

    def one(k):
        a = acceptance.accept_stochastic(tree, logits, sp, k, 3, 4)
        return a.tokens[0, :2], a.num_accepted[0]

    return jax.vmap(one)(keys)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 4)])
def test_stochastic_acceptance_preserves_target_distribution(temperature, top_p, top_k):
    """Empirical distribution of the first two emitted tokens vs the exact target distribution.

    Chi-square test at false-alarm rate 1e-4 per test (fixed seeds: deterministic)."""
    rng = np.random.default_rng(int(temperature * 100) + top_k)
    vocab, samples = 6, 40000
    # root with 3 children, the first two of which have children of their own.
    parents = np.array([-1, 0, 0, 0, 1, 1, 2], np.int32)
    tokens = np.array([0, 2, 0, 5, 1, 3, 4], np.int32)
    n = len(parents)
    logits = jnp.asarray(rng.normal(size=(1, n, vocab)) * 1.5, jnp.float32)
    tree = _make_tree(tokens[None], parents[None], [n])
    sp = SamplingParams.make(1, temperature, top_p, top_k)
    p = np.asarray(target_probs(logits, sp))[0]  # [N, V]

    toks, num = _first_two_emitted(tree, logits, sp, jax.random.split(jax.random.key(7), samples))
    toks, num = np.asarray(toks), np.asarray(num)
    # First token ~ p_root.
    expect = p[0] * samples
    obs = np.bincount(toks[:, 0], minlength=vocab)
    keep = expect > 0
    assert obs[~keep].sum() == 0, "emitted a token outside the target's support"
    chi = ((obs[keep] - expect[keep]) ** 2 / expect[keep]).sum()
    assert chi < _chi2_critical(keep.sum() - 1, 1e-4), (chi, obs, expect)
    # Second token (only emitted when the first was an accepted draft): joint ~ p_root(x) p_x(y).
    joint_exp, joint_obs = [], []
    for node in (1, 2, 3):
        x = tokens[node]
        rows = (toks[:, 0] == x) & (num >= 2)
        assert (
            rows.sum() == (toks[:, 0] == x).sum()
        )  # a drafted token is always accepted as a draft
        e = p[0, x] * p[node] * samples
        o = np.bincount(toks[rows, 1], minlength=vocab)
        joint_exp.append(e)
        joint_obs.append(o)
    e = np.concatenate(joint_exp)
    o = np.concatenate(joint_obs)
    keep = e > 0
    assert o[~keep].sum() == 0
    e2 = e[keep]
    chi = ((o[keep] - e2) ** 2 / e2).sum()
    assert chi < _chi2_critical(keep.sum() - 1, 1e-4), chi


def test_stochastic_with_greedy_rows_equals_greedy():
    """Greedy rows inside a mixed batch follow the greedy rule exactly."""
    rng = np.random.default_rng(3)
    b, n, vocab = 4, 12, 5
    toks, pars = zip(*[_random_tree(rng, n, vocab) for _ in range(b)])
    tree = _make_tree(np.array(toks), np.array(pars), [n] * b)
    logits = jnp.asarray(rng.normal(size=(b, n, vocab)), jnp.float32)
    sp = SamplingParams.make(b, jnp.array([0.0, 1.0, 0.0, 1.0]), 1.0, 0)
    a = jax.jit(acceptance.accept_stochastic, static_argnums=(4, 5))(
        tree, logits, sp, jax.random.key(0), n, 4
    )
    g = jax.jit(acceptance.accept_greedy, static_argnums=2)(
        tree, jnp.argmax(logits, -1).astype(jnp.int32), n
    )
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(a.tokens[i]), np.asarray(g.tokens[i]))
        assert int(a.num_accepted[i]) == int(g.num_accepted[i])


def test_unrolled_walk_is_the_loop():
    """Unrolled, the acceptance walk is straight-line code, no loop left in the program, and
    accepts what the `fori_loop` walk does, greedy and stochastic (same key: same draws)."""
    rng = np.random.default_rng(5)
    b, n, vocab = 6, 16, 6
    toks, pars = zip(*[_random_tree(rng, n, vocab) for _ in range(b)])
    tree = _make_tree(np.array(toks), np.array(pars), [n] * b)
    logits = jnp.asarray(2.0 * rng.normal(size=(b, n, vocab)), jnp.float32)
    sp = SamplingParams.make(b, jnp.array([0.0, 1.0, 0.7, 1.0, 0.0, 1.3]), 1.0, 0)
    out = {}
    for unroll in (True, False):
        greedy = lambda t, lg: acceptance.accept_greedy(  # noqa: E731
            t, jnp.argmax(lg, -1).astype(jnp.int32), 8, unroll
        )
        stoch = lambda t, lg, k: acceptance.accept_stochastic(t, lg, sp, k, 8, 4, unroll)  # noqa: E731
        loops = [
            e.primitive.name
            for f, args in ((greedy, (tree, logits)), (stoch, (tree, logits, jax.random.key(2))))
            for e in jax.make_jaxpr(f)(*args).eqns
            if e.primitive.name in ("while", "scan")
        ]
        assert (loops == []) == unroll, loops
        out[unroll] = (
            jax.jit(greedy)(tree, logits),
            jax.jit(stoch)(tree, logits, jax.random.key(2)),
        )
    for a, c in zip(out[True], out[False]):
        for f in ("path", "num_accepted", "bonus", "tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(c, f)), f)


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "loop"])
def test_static_greedy_accept_has_no_cond(unroll, monkeypatch):
    """A batch marked greedy on the host (`SamplingParams.greedy`) accepts with no `lax.cond`,
    its walk unrolled where the drafter's levels are (`drafter.UNROLL`); the mixed program keeps
    the cond, its walk in the loop (unrolled inside the cond it was slower on the GPU). Both give
    the same acceptance, and so does the simulated acceptance's static greedy bonus."""
    monkeypatch.setattr(drafter, "UNROLL", unroll)
    rng = np.random.default_rng(7)
    b, n, vocab = 5, 16, 4
    toks, pars = zip(*[_random_tree(rng, n, vocab) for _ in range(b)])
    tree = _make_tree(np.array(toks), np.array(pars), [n] * b)
    logits = jnp.asarray(2.0 * rng.normal(size=(b, n, vocab)), jnp.float32)
    sp = SamplingParams.make(b)
    assert sp.greedy
    key = jax.random.key(3)
    out = {}
    for s in (sp, sp.mixed()):
        # new functions per program: jax caches traces by function (UNROLL is read at trace time)
        acc = lambda t, lg, k: acceptance.accept(t, lg, s, k, max_depth=8, max_children=4)  # noqa: E731
        sim = lambda t, lg, k: acceptance.accept_simulated(t, lg, s, k, 0.8, 8)  # noqa: E731
        prims = {e.primitive.name for e in jax.make_jaxpr(acc)(tree, logits, key).eqns}
        assert ("cond" in prims) != s.greedy, prims
        if s.greedy:
            assert not ({"while", "scan"} & prims) == unroll, prims
        sim_prims = {e.primitive.name for e in jax.make_jaxpr(sim)(tree, logits, key).eqns}
        assert ("cond" in sim_prims) != s.greedy, sim_prims
        out[s.greedy] = (jax.jit(acc)(tree, logits, key), jax.jit(sim)(tree, logits, key))
    for a, c in zip(out[True], out[False]):
        for f in ("path", "num_accepted", "bonus", "tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(c, f)), f)
