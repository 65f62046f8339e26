"""Tensor-parallel checks on simulated CPU devices, run by tests/model/test_tp.py in a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/tp_worker.py OUT_DIR GROUP...

XLA reads the device count when JAX initialises, so these checks cannot share the pytest process
(JAX is initialised there with one CPU device). The groups run one after the other; each writes
OUT_DIR/GROUP.json, {check: {"ok", "detail", "seconds"}}; a check that raises is recorded as
failed with its traceback.

Every check compares a sharded run with the single-device one on the same weights: greedy
tokens identical (speculative modes use the synthetic-acceptance drafter, whose trees contain
the AR continuation, so deep accepted paths exercise the sharded commits) and fp32 logits close.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bole_jax.llm import LLM  # noqa: E402
from bole_jax.model import (  # noqa: E402
    ModelConfig,
    forward,
    init_cache,
    init_params,
    layers,  # noqa: E402
    logits,
    parallel,  # noqa: E402
)
from bole_jax.model.cache import committed_state, with_pending  # noqa: E402
from bole_jax.model.config import FULL, LINEAR  # noqa: E402
from bole_jax.pallas import tree_gdn_commit, tree_pernode  # noqa: E402
from bole_jax.spec_decode import tree as tree_mod  # noqa: E402
from bole_jax.spec_decode import verify
from bole_jax.spec_decode.acceptance import accept_greedy  # noqa: E402

NEW = 16  # generated tokens per prompt
PROMPTS = [[5, 17, 33, 9, 2], [7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [11]]
SPEC = dict(synthetic_accept=0.8, num_nodes=8, depth=4)


def tiny(family: str, moe: bool = False, **kw) -> ModelConfig:
    """2 decoder layers (GDN, attention) + an MTP layer: every kind of tensor, little to compile."""
    return ModelConfig.tiny(
        family,
        moe=moe,
        vocab_size=96,
        mtp_num_layers=1,
        num_layers=2,
        layer_types=(LINEAR, FULL),
        **kw,
    )


def close(a, b, what: str) -> str:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = float(np.max(np.abs(a - b)))
    tol = 1e-4 * (1.0 + float(np.max(np.abs(b))))
    assert a.shape == b.shape and err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"
    return f"{what} max|diff| {err:.2g}"


def spec_of(x) -> P:
    return x.sharding.spec


# ----------------------------------------------------------------------------- checks


def check_generate(cfg, params, tp, modes) -> str:
    """Greedy tokens of every mode at tp equal the single-device AR tokens."""
    ref = LLM(cfg, params=params).generate(PROMPTS, max_new_tokens=NEW, spec="ar")
    want = [o.token_ids for o in ref]
    notes = []
    for mode in modes:
        opts = {} if mode == "ar" else SPEC
        t0 = time.perf_counter()
        llm = LLM(cfg, params=params, tp=tp, spec_options=opts)
        out = llm.generate(
            PROMPTS, max_new_tokens=NEW, spec=mode, oracle=None if mode == "ar" else want
        )
        print(f"  generate {mode} tp={tp}: {time.perf_counter() - t0:.1f} s", flush=True)
        got = [o.token_ids for o in out]
        assert got == want, f"{mode} at tp={tp}: {got} != {want}"
        if mode != "ar":
            mean = float(np.mean([o.stats["tokens_per_step"] for o in out]))
            assert mean > 1.5, f"{mode}: no deep acceptance ({mean:.2f} tokens/step)"
            notes.append(f"{mode} {mean:.2f} tok/step")
        else:
            notes.append(mode)
        notes.append(check_placement(llm, mode, want))
    return ", ".join(notes)


def check_placement(llm, mode, oracle) -> str:
    """start_batch lays the state out per parallel.state_specs and a segment keeps that layout
    (the same shapes as generate's: its compiled programs are reused)."""
    b = len(PROMPTS)
    st = llm.start_batch(
        PROMPTS, NEW, mode=mode, spec_batch=b, oracle=None if mode == "ar" else oracle
    )
    want = jax.tree.leaves(parallel.state_specs(st, llm.cfg), is_leaf=lambda x: isinstance(x, P))
    for when in ("start_batch", "segment"):
        got = [x.sharding.spec for x in jax.tree.leaves(st)]
        bad = [
            (g, w)
            for g, w in zip(got, want)
            if tuple(g) != tuple(w) and not (tuple(w) == () and all(d is None for d in g))
        ]
        assert len(got) == len(want) and not bad, (when, bad[:4])
        st = llm.segment_fn(mode, b)(llm.params, st, jnp.int32(2))
    c = st.cache.layers
    return f"[state: GDN {spec_of(c[0].state)}, conv {spec_of(c[0].conv)}, KV {spec_of(c[1].k)}]"


def _tree(b: int, n: int, vocab: int, chain: bool = False, seed: int = 0):
    """A random ragged tree per request (parents before children), or a ragged chain."""
    rng = np.random.default_rng(seed)
    parents = np.broadcast_to(np.arange(n, dtype=np.int32) - 1, (b, n)).copy()
    if not chain:
        for i in range(1, n):
            parents[:, i] = rng.integers(0, i, b)
    num = np.array([n, max(1, n - 3)] * (b // 2) + [n] * (b % 2), np.int32)
    parents = np.where(np.arange(n)[None] < num[:, None], parents, -1)
    depth = np.asarray(tree_mod.depths(jnp.asarray(parents), jnp.asarray(num)))
    return tree_mod.Tree(
        tokens=jnp.asarray(rng.integers(0, vocab, (b, n)), jnp.int32),
        parents=jnp.asarray(parents),
        depth=jnp.asarray(depth),
        num_nodes=jnp.asarray(num),
        score=jnp.zeros((b, n), jnp.float32),
    )


def check_logits(cfg, params, tp, modes=("bole",), backend="reference", n: int = 6) -> str:
    """Prefill, one decode step, then per GDN mode the tree verify and the commit of a greedy
    accepted path, at tp vs on one device: fp32 logits and committed caches close. "bole-lazy":
    the lazy commit as gathered rows, "bole-lazy-path" as the step's factors and accepted path
    (split over the heads either way), compared by the committed state, and a second verify that
    folds the pending commit in, and a model forward (one decode token) on the cache with the
    commit still pending, which folds it too. n: tree nodes per request."""
    tcfg = dataclasses.replace(cfg, tp=tp)
    tparams = parallel.shard_params(params, tcfg)
    b, t = 2, 8
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    num_new = jnp.asarray([t, 5], jnp.int32)
    accepted = {}  # mode -> the reference run's Accepted, reused by the sharded run

    def run(c, p, verify_backend):
        cache = parallel.create(lambda: init_cache(c, b, 64, jnp.float32), c)
        fwd = jax.jit(lambda p, x, cache, k: forward(p, c, x, cache, k))
        h1, cache = fwd(p, toks, cache, num_new)
        # backend="pallas": the decode step through the in-place decode kernel too.
        dc = (
            c
            if verify_backend != "pallas"
            else dataclasses.replace(
                c, kernels=dataclasses.replace(c.kernels, gdn_decode_backend="pallas")
            )
        )
        dec = jax.jit(lambda p, x, cache, k: forward(p, dc, x, cache, k))
        h2, cache = dec(p, toks[:, :1], cache, jnp.ones((b,), jnp.int32))
        outs = [logits(p, c, h1), logits(p, c, h2)]
        for name in modes:
            lazy = name.startswith("bole-lazy")
            mode = "bole" if lazy else name
            start = cache
            if (
                lazy
            ):  # the lazy layout: rows for accept_greedy's n + 1 path nodes (of n-node factors)
                start = parallel.place(
                    with_pending(cache, c, n + 1, n if name == "bole-lazy-path" else None), c
                )
            tree = _tree(b, n, c.vocab_size, chain=mode == "chain")
            ver = jax.jit(
                lambda p, tr, cache: verify.verify_forward(
                    p, c, tr, cache, mode=mode, backend=verify_backend
                )
            )
            hv, vcache, auxs = ver(p, tree, start)
            lg = logits(p, c, hv)
            acc = accepted.setdefault(
                name, accept_greedy(tree, jnp.argmax(lg, -1).astype(jnp.int32), n)
            )
            new = jax.jit(
                lambda cache, auxs, tr, acc: verify.commit(
                    cache, auxs, tr, acc, jnp.ones((b,), bool), mode=mode, cfg=c
                )
            )(vcache, auxs, tree, acc)
            outs += [lg, committed_state(new.layers[0]), new.layers[0].conv, new.layers[1].k]
            if lazy:  # the next verify starts from the pending-applied state, as does a forward
                assert new.layers[0].pending is not None
                hv2, vcache2, _ = ver(p, tree, new)
                h3, fcache = fwd(p, toks[:, :1], new, jnp.ones((b,), jnp.int32))
                outs += [
                    logits(p, c, hv2),
                    vcache2.layers[0].state,
                    logits(p, c, h3),
                    fcache.layers[0].state,
                ]
        return outs

    ref = run(cfg, params, "reference")
    got = run(tcfg, tparams, backend)
    names = ["prefill", "decode"] + [
        f"{m} {w}"
        for m in modes
        for w in ("verify", "GDN state", "conv state", "KV")
        + (
            (
                "verify 2",
                "GDN state after verify 2",
                "forward on the pending cache",
                "GDN state after that forward",
            )
            if m.startswith("bole-lazy")
            else ()
        )
    ]
    order = parallel.qkv_channel_order(tcfg)  # the conv cache's channels are stored shard-major
    ref = [
        r[..., order] if "conv" in name and order is not None else r for r, name in zip(ref, names)
    ]
    return "; ".join(close(g, r, name) for g, r, name in zip(got, ref, names))


def check_logits_commit_local(cfg, params, tp, modes) -> str:
    """check_logits with the Pallas kernels, and the baselines' state commit traced on each
    device's own heads under tp (a Pallas launch outside shard_map is a custom call XLA
    cannot partition: it gathered every device's per-node states, the 80B TP = 2 loss in
    docs/design-decisions.md).
    12 nodes: PERNODE's launch at B = 2 walks them depth-first (`PernodeConfig.auto` above 8)."""
    seen, orig = [], tree_pernode.commit_pernode_state
    fused, orig_states, orig_backend = [], tree_gdn_commit.commit_states, verify.resolve_backend

    def spy(old, *a, **kw):
        seen.append(old.shape[1])
        return orig(old, *a, **kw)

    def one_launch(states, *a, **kw):  # bole's commit of every layer: the kernel, interpreted
        fused.append(states[0].shape[1])
        return orig_states(states, *a, **kw, backend="pallas", interpret=True)

    tree_pernode.commit_pernode_state = spy
    tree_gdn_commit.commit_states = one_launch
    verify.resolve_backend = lambda b, i: ("pallas", True)  # as on a GPU: the one launch
    try:
        msg = check_logits(cfg, params, tp, modes=modes, backend="pallas", n=12)
        assert tree_pernode.PernodeConfig.auto(2, 12).order == "dfs"
    finally:
        tree_pernode.commit_pernode_state = orig
        tree_gdn_commit.commit_states = orig_states
        verify.resolve_backend = orig_backend
    hv = cfg.gdn_num_value_heads
    assert sorted(set(seen)) == [hv // tp, hv], f"commit saw {seen} heads (want {hv // tp} at tp)"
    assert sorted(set(fused)) == [hv // tp, hv], f"one-launch commit saw {fused} heads"
    return f"{msg}; commits on {hv // tp} of {hv} heads per device"


def _engine_frames(eqn) -> tuple[str, ...]:
    """file:line function of the bole_jax frames an equation was traced from, outermost first
    (JAX keeps the frames inside the traced function: the outer ones are the enclosing
    equations')."""
    tb = eqn.source_info.traceback
    return tuple(
        f"{os.path.basename(f.file_name)}:{f.line_num} {f.function_name}"
        for f in reversed(tb.frames if tb is not None else ())
        if f"{os.sep}bole_jax{os.sep}" in f.file_name
    )


def _eqns(jaxpr, inside: bool = False, where: tuple = ()):
    """(equation, inside a shard_map body?, the engine frames it was reached from) of every
    equation in jaxpr and in the jaxprs its equations carry (jit, while, cond, scan, shard_map,
    custom_jvp / custom_vjp, ...). A Pallas kernel's own body is not a program: not searched."""
    for eqn in jaxpr.eqns:
        here = where + tuple(f for f in _engine_frames(eqn) if f not in where)
        yield eqn, inside, here
        if eqn.primitive.name == "pallas_call":
            continue
        body_inside = inside or eqn.primitive.name == "shard_map"
        for val in eqn.params.values():
            for sub in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jex_core.Jaxpr):
                    yield from _eqns(sub, body_inside, here)


def _pallas_launches(jaxpr):
    """(kernel name, inside a shard_map body?, the engine frames it was reached from) of every
    pallas_call in jaxpr and the jaxprs it carries."""
    for eqn, inside, here in _eqns(jaxpr):
        if eqn.primitive.name == "pallas_call":
            yield eqn.params.get("name") or "<unnamed>", inside, here


def check_pallas_inside_shard_map(
    cfg, params, tp, modes=("ar", "bole", "bole-lazy", "pernode", "chain")
) -> str:
    """Every Pallas launch of the engine's programs at tp, with the kernels a GPU selects, lies
    inside a shard_map body. A pallas_call reached outside shard_map on sharded arrays lowers (on
    GPU) to a custom call XLA's SPMD partitioner cannot split: every operand is all-gathered to
    every device (the baselines' state commit did that: ~27 ms per step at 80B TP = 2 B = 4).
    On CPU "auto" picks the jnp references, so the sharded-vs-single checks cannot
    see such a launch; here jax.default_backend() answers "gpu" while the programs are only
    TRACED (never lowered: nothing of the GPU is needed), and the jaxprs are searched.

    Per mode ("bole-lazy": bole with the lazy commit) the traced program is start_batch (chunked
    prefill, first token) followed by the jitted decode segment (`LLM.segment_fn`: the loop the
    generate and serving paths run). The batch of 4 takes the launches a GPU takes at B >= 2 (the
    baselines' commit runs the jnp copy at B = 1). jit caches its traces, and the backend is
    chosen in Python at trace time: the caches are cleared before (a trace made on CPU would be
    reused, its references hiding the kernels) and after (a GPU trace must never reach a CPU
    compile). The GDN heads must be split at this tp: where they are not, over_gdn_heads runs the
    kernels on replicated operands by design (each device the whole layer, nothing gathered)."""
    assert parallel.gdn_shards(dataclasses.replace(cfg, tp=tp)) == tp, "GDN heads not split"
    b = len(PROMPTS)
    found, outside, notes = {}, [], []
    prev = jax.default_backend
    jax.default_backend = lambda: "gpu"
    jax.clear_caches()
    try:
        for name in modes:
            mode = "bole" if name == "bole-lazy" else name
            opts = {} if mode == "ar" else dict(SPEC, lazy_commit=name == "bole-lazy")
            t0 = time.perf_counter()
            llm = LLM(cfg, params=params, tp=tp, spec_options=opts)
            oracle = (
                None if mode == "ar" else [[0] * NEW] * b
            )  # synthetic acceptance: values unused

            def program(p, llm=llm, mode=mode, oracle=oracle):
                st = llm.start_batch(PROMPTS, NEW, mode=mode, spec_batch=b, oracle=oracle)
                return llm.segment_fn(mode, b)(p, st, jnp.int32(2))

            launches = list(_pallas_launches(jax.make_jaxpr(program)(llm.params).jaxpr))
            found[name] = sorted({k for k, _, _ in launches})
            outside += [
                f"{name}: {k}, from {' > '.join(w[-4:]) or '?'}"
                for k, inside, w in launches
                if not inside
            ]
            notes.append(f"{name} {'/'.join(found[name])} ({time.perf_counter() - t0:.1f} s)")
    finally:
        jax.default_backend = prev
        jax.clear_caches()
    assert not outside, (
        f"Pallas kernels outside shard_map at tp={tp} (XLA gathers their "
        "operands on every device):\n  " + "\n  ".join(outside)
    )
    if "bole" in found:  # the eager commit (one launch for every GDN layer; this model has one)
        assert "bole_commit_state" in found["bole"], found["bole"]
    empty = [m for m, k in found.items() if not k]
    assert not empty, f"no Pallas launch traced for {empty}: the GPU selection did not take effect"
    return f"all Pallas launches inside shard_map at tp={tp}: " + "; ".join(notes)


def _table_reads(jaxpr, shape):
    """(primitive, inside a shard_map body?) of every gather / dynamic_slice reading an array of
    `shape` in jaxpr and the jaxprs it carries."""
    for eqn, inside, _ in _eqns(jaxpr):
        if (
            eqn.primitive.name in ("gather", "dynamic_slice")
            and eqn.invars
            and tuple(getattr(eqn.invars[0].aval, "shape", ())) == tuple(shape)
        ):
            yield eqn.primitive.name, inside


def check_embed_lookup(cfg, params, tp) -> str:
    """The embedding lookup with the vocabulary split: equal to the table's rows (bf16, exact) for
    one token, a batch of single tokens and a batch of sequences; and in the AR and bole programs
    (prefill + decode loop) every read of the table lies inside a shard_map. A lookup left to
    XLA's partitioner reads the split table directly; for one token XLA:GPU turns it into a
    dynamic-slice first, and the partitioner then all-gathers the whole table every step (2 GB per
    device at 9B dims: the tp = 2 AR step at B = 1 took 9.7 ms against 4.2 at B = 4).
    XLA:CPU does not make that rewrite, so the structure is what is checked here."""
    tcfg = dataclasses.replace(cfg, tp=tp)
    assert parallel.shards(tcfg, cfg.vocab_size) == tp, "vocabulary not split"
    table = jnp.asarray(
        np.random.default_rng(5).normal(size=(cfg.vocab_size, cfg.hidden_size)), jnp.bfloat16
    )
    placed = parallel.place_params({"embed": table}, tcfg)["embed"]
    assert placed.sharding.spec[0] == parallel.AXIS, spec_of(placed)
    look = jax.jit(lambda e, t: parallel.embed_lookup(e, t, tcfg))
    rng = np.random.default_rng(6)
    for shape in ((1, 1), (4, 1), (2, 7), (3, 5)):
        t = jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)
        if shape == (3, 5):  # out of range, as embed[tokens] takes them: from the end, clamped
            t = t.at[0].set(jnp.asarray([-1, -cfg.vocab_size, cfg.vocab_size, 10**6, -(10**6)]))
        got = np.asarray(look(placed, t).astype(jnp.float32))
        assert np.array_equal(got, np.asarray(table[t].astype(jnp.float32))), f"tokens {shape}"
    outside, notes = [], []
    for mode in ("ar", "bole"):
        llm = LLM(cfg, params=params, tp=tp, spec_options={} if mode == "ar" else SPEC)
        oracle = None if mode == "ar" else [[0] * NEW]

        def program(p, llm=llm, mode=mode, oracle=oracle):
            st = llm.start_batch(PROMPTS[:1], NEW, mode=mode, spec_batch=1, oracle=oracle)
            return llm.segment_fn(mode, 1)(p, st, jnp.int32(2))

        jaxpr = jax.make_jaxpr(program)(llm.params).jaxpr
        whole = list(_table_reads(jaxpr, table.shape))  # the split table, read as one array
        local = [
            name
            for name, inside in _table_reads(jaxpr, (cfg.vocab_size // tp, cfg.hidden_size))
            if inside
        ]
        outside += [f"{mode}: {name}" for name, inside in whole if not inside]
        assert local, f"{mode}: no per-device read of the table traced"
        notes.append(f"{mode} {len(local)} per-device reads")
    assert not outside, f"embedding table read outside shard_map at tp={tp}: {outside}"
    return f"embed lookup exact at tp={tp}, table read per device only ({', '.join(notes)})"


def check_moe_gmm(cfg, params, tp) -> str:
    """The grouped-matmul experts (Pallas kernel, interpret mode) under expert parallelism, the
    pairs of other devices' experts dropped, vs the single-device dense reference: one MoE layer
    (routed + shared experts) on random tokens."""
    tcfg = dataclasses.replace(cfg, tp=tp)
    mlp = params["layers"][0]["mlp"]
    tmlp = parallel.shard_params(params, tcfg)["layers"][0]["mlp"]
    assert tmlp["w_gate_up"].sharding.spec[0] == parallel.AXIS, spec_of(tmlp["w_gate_up"])
    x = jnp.asarray(np.random.default_rng(3).normal(size=(24, cfg.hidden_size)), jnp.float32)
    gmm = functools.partial(layers.moe_experts_gmm, backend="pallas")
    got = jax.jit(lambda p, x: layers.moe(p, x, tcfg, experts_impl=gmm))(tmlp, x)
    dense = layers.moe_experts_dense
    ref = jax.jit(lambda p, x: layers.moe(p, x, cfg, experts_impl=dense))(mlp, x)
    return close(got, ref, f"moe gmm tp={tp}")


def check_layout(cfg, params, tp, init_key=None) -> str:
    """Specs of representative tensors, shard/unshard round trip, and (init_key: the key params
    were made with) the sharded random init equal to the sharded canonical one."""
    tcfg = dataclasses.replace(cfg, tp=tp)
    sp = parallel.shard_params(params, tcfg)
    back = parallel.unshard_params(sp, tcfg)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if init_key is not None:
        direct = parallel.init_params(tcfg, init_key, "float32")
        for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(sp)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.spec == b.sharding.spec
    gdn = sp["layers"][0]["gdn"]
    notes = [
        f"w_qkv {spec_of(gdn['w_qkv'])}",
        f"w_out {spec_of(gdn['w_out'])}",
        f"embed {spec_of(sp['embed'])}",
        f"mtp w_k {spec_of(sp['mtp']['layers'][0]['attn']['w_k'])}",
    ]
    # Shard j of w_qkv holds [q_j | k_j | v_j]: the canonical layout of a model with Hk/tp heads.
    s = parallel.gdn_shards(tcfg)
    if s > 1:
        local = parallel.gdn_local_cfg(tcfg)
        shard0 = np.asarray(gdn["w_qkv"].addressable_shards[0].data)
        full = np.asarray(params["layers"][0]["gdn"]["w_qkv"])
        kd, lkd = (
            cfg.gdn_num_key_heads * cfg.gdn_key_dim,
            local.gdn_num_key_heads * local.gdn_key_dim,
        )
        np.testing.assert_array_equal(shard0[:, :lkd], full[:, :lkd])  # q heads of shard 0
        np.testing.assert_array_equal(
            shard0[:, lkd : 2 * lkd], full[:, kd : kd + lkd]
        )  # its k heads
        assert shard0.shape[1] == local.conv_dim
    return ", ".join(notes)


def check_big_init(cfg, tp) -> str:
    """Groups above params.GROUP_DRAW_LIMIT (the experts of big models) are drawn shard by shard
    in the tensor-parallel init: the layout, placement and scale are those of the ordinary init,
    each shard is its own draw, and the init program has no global-sized temporary."""
    from bole_jax.model import params as params_mod

    tcfg = dataclasses.replace(cfg, tp=tp)
    ref = parallel.init_params(tcfg, jax.random.key(5), "float32")
    experts = ref["layers"][0]["mlp"]["w_gate_up"]
    old, params_mod.GROUP_DRAW_LIMIT = params_mod.GROUP_DRAW_LIMIT, experts.size - 1
    try:
        prog = parallel.init_program(tcfg, "float32")
        big = prog(jax.random.key(5))
        temp = prog.lower(jax.random.key(5)).compile().memory_analysis().temp_size_in_bytes
    finally:
        params_mod.GROUP_DRAW_LIMIT = old
    for a, b in zip(jax.tree.leaves(big), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding.spec == b.sharding.spec
    w = big["layers"][0]["mlp"]["w_gate_up"]
    assert not np.array_equal(np.asarray(w), np.asarray(experts))  # drawn the other way
    shards = [np.asarray(s.data) for s in w.addressable_shards]
    assert len(shards) == tp and not np.array_equal(shards[0], shards[1])
    bound = 3.0**0.5 * w.shape[-2] ** -0.5
    assert np.abs(np.asarray(w)).max() <= bound and np.asarray(w).std() > 0.5 * bound / 3**0.5
    # the small groups are still the ordinary draws
    np.testing.assert_array_equal(
        np.asarray(big["layers"][0]["mlp"]["router"]), np.asarray(ref["layers"][0]["mlp"]["router"])
    )
    ordinary = parallel.init_program(tcfg, "float32").lower(jax.random.key(5)).compile()
    temp0 = ordinary.memory_analysis().temp_size_in_bytes
    assert temp < temp0, (temp, temp0)
    return f"big-group init: shard-wise draws; init temp {temp} B (ordinary draws: {temp0} B)"


def check_errors(cfg, params) -> str:
    try:
        LLM(cfg, params=params, tp=jax.device_count() * 2)
        raise AssertionError("tp > devices did not raise")
    except ValueError as e:
        assert "devices" in str(e) and "--tp" in str(e), e
    tcfg = dataclasses.replace(cfg, tp=4)
    try:
        LLM(tcfg, params=params, tp=2)
        raise AssertionError("tp mismatch did not raise")
    except ValueError as e:
        assert "tp=4" in str(e), e
    notes = parallel.replicated_groups(dataclasses.replace(cfg, tp=8))
    assert any("num_attention_heads=4" in n for n in notes), notes
    return "; ".join(notes)


def check_save(cfg, params, tp) -> str:
    """A tensor-parallel LLM's params save to the canonical checkpoint layout."""
    from bole_jax.model.weights import load_hf_checkpoint, save_hf_checkpoint

    llm = LLM(cfg, params=params, tp=tp)
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(d, llm.cfg, llm.params)
        cfg2, p2 = load_hf_checkpoint(d)
        assert cfg2.tp == 1
        for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        llm2 = LLM(d, tp=tp)  # the loader's per-tensor placement
        for a, b in zip(jax.tree.leaves(llm2.params), jax.tree.leaves(llm.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.spec == b.sharding.spec
    return "save -> load round trip exact; LLM(path, tp) placement matches"


def check_bench_lazy(tp) -> str:
    """`bole-jax bench --lazy-commit --tp 2` decodes (the tiny Qwen3-Next preset): the state the
    bench derives for lazy bole from the shared prefill must carry its empty pending rows split on
    their heads, as the compiled loop expects (they were replicated, and the first call of the
    loop failed on the H200); the tokens equal AR's."""
    from bole_jax.serving import cli

    with tempfile.TemporaryDirectory() as d:
        rc = cli.main(
            [
                "bench",
                "--preset",
                "tiny",
                "--dtype",
                "float32",
                "--batch",
                "1",
                "--modes",
                "ar",
                "bole",
                "--lazy-commit",
                "--tp",
                str(tp),
                "--quick",
                "--no-plots",
                "--out",
                d,
            ]
        )
        with open(os.path.join(d, "e2e_tiny.json")) as f:
            res = json.load(f)
    assert rc == 0 and not res["errors"] and not res["skipped"], (rc, res["errors"], res["skipped"])
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "bole"} and rows["bole"]["ar_agreement"] == 1.0, res["rows"]
    return f"lazy bole at tp={tp}: {rows['bole']['tokens_per_step']:.2f} tokens per step, == AR"


# ----------------------------------------------------------------------------- groups


def group_next():
    """Qwen3-Next dense at tp=2: every mode; layout, placement, errors, saving; the Pallas kernels
    (interpret mode) inside shard_map see local heads: the tp=2 verify of every GDN mode with
    backend="pallas" against the single-device reference (the reference backend under tp:
    groups "moe" and "q35"); the bench's lazy decode; every mode's programs traced with the GPU's
    kernels, no Pallas launch outside shard_map (last: it clears JAX's caches)."""
    cfg = tiny("qwen3_next")
    params = init_params(cfg, jax.random.key(1), "float32")
    yield "layout tp=2", lambda: check_layout(cfg, params, 2, init_key=jax.random.key(1))
    yield "errors", lambda: check_errors(cfg, params)
    yield "save tp=2", lambda: check_save(cfg, params, 2)
    yield (
        "pallas verify tp=2",
        lambda: check_logits_commit_local(
            cfg, params, 2, modes=("bole", "bole-lazy", "bole-lazy-path", "pernode", "chain")
        ),
    )
    yield (
        "generate tp=2",
        lambda: check_generate(cfg, params, 2, ("ar", "bole", "pernode", "chain")),
    )
    yield "bench lazy tp=2", lambda: check_bench_lazy(2)
    yield "embed lookup tp=2", lambda: check_embed_lookup(cfg, params, 2)
    yield "pallas inside shard_map tp=2", lambda: check_pallas_inside_shard_map(cfg, params, 2)


def group_moe():
    """Qwen3-Next MoE at tp=4: experts split 4 ways, 2 KV heads replicated (fallback); the
    grouped-matmul experts path (on CPU the model uses the jnp paths) checked on one layer."""
    cfg = tiny("qwen3_next", moe=True, gdn_num_key_heads=4, gdn_num_value_heads=8)
    params = init_params(cfg, jax.random.key(2), "float32")
    notes = parallel.replicated_groups(dataclasses.replace(cfg, tp=4))
    assert len(notes) == 1 and "num_key_value_heads=2" in notes[0], notes
    yield "layout tp=4", lambda: check_layout(cfg, params, 4)
    yield "big-group init tp=4", lambda: check_big_init(cfg, 4)
    yield "logits tp=4", lambda: check_logits(cfg, params, 4)
    yield "moe gmm tp=4", lambda: check_moe_gmm(cfg, params, 4)
    yield "generate tp=4", lambda: check_generate(cfg, params, 4, ("ar", "bole"))


def group_q35():
    """Qwen3.5 dense at tp=8: dims chosen divisible by 8, so every group is split."""
    cfg = tiny(
        "qwen3_5",
        num_heads=8,
        num_kv_heads=8,
        head_dim=16,
        gdn_num_key_heads=8,
        gdn_num_value_heads=16,
        gdn_key_dim=8,
        gdn_value_dim=8,
    )
    params = init_params(cfg, jax.random.key(3), "float32")
    assert not parallel.replicated_groups(dataclasses.replace(cfg, tp=8))
    yield "layout tp=8", lambda: check_layout(cfg, params, 8)
    yield (
        "logits tp=8",
        lambda: check_logits(
            cfg, params, 8, modes=("bole", "bole-lazy", "bole-lazy-path", "chain")
        ),
    )
    yield "generate tp=8", lambda: check_generate(cfg, params, 8, ("bole",))


GROUPS = {"next": group_next, "moe": group_moe, "q35": group_q35}


def run_group(group: str, out: str) -> None:
    results = {}
    for name, fn in GROUPS[group]():
        t0 = time.perf_counter()
        try:
            results[name] = dict(ok=True, detail=fn())
        except Exception:  # recorded, the other checks still run
            results[name] = dict(ok=False, detail=traceback.format_exc()[-3000:])
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(
            f"{group}/{name}: {'ok' if results[name]['ok'] else 'FAILED'} "
            f"({results[name]['seconds']} s)",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def main(out_dir: str, *groups: str) -> None:
    assert jax.device_count() >= 8, f"run with 8 simulated devices, got {jax.devices()}"
    assert groups and all(g in GROUPS for g in groups), (groups, list(GROUPS))
    for group in groups:
        run_group(group, os.path.join(out_dir, f"{group}.json"))


if __name__ == "__main__":
    main(*sys.argv[1:])
