"""Batch-wide verification budget: selector invariants, the calibration table and its lookup, and
the end-to-end benchmark on CPU with the tiny preset (which also checks that every mode stays
lossless against AR with a binding budget)."""

import dataclasses
import json
import logging
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import ModelConfig
from bole_jax.measure import bench, calibrate
from bole_jax.model import init_params
from bole_jax.serving import cli
from bole_jax.spec_decode import budget
from bole_jax.spec_decode import tree as tree_mod
from bole_jax.spec_decode.step import SpecConfig

# ----------------------------------------------------------------------------- random pools


def random_pool(rng, b, topk=3, depth=4, tie_step=0.5, dead=0.0):
    """Pools laid out as drafter.expand lays them out: depth 1 = topk children of the root, then
    topk^2 candidates per depth whose parents are the previous depth's topk best (stable).
    log q is quantised (many exact ties, within and across requests); `dead` = fraction of
    subtrees with rho = -inf."""
    scores, parents = [], []
    for _ in range(b):
        sc = list(-tie_step * rng.integers(0, 3, topk))
        par = [-1] * topk
        prev = list(range(topk))
        for _ in range(1, depth):
            prev_sc = np.array([sc[i] for i in prev])
            new_sc, new_par = [], []
            for f, p in enumerate(prev):
                for _ in range(topk):
                    lq = -tie_step * rng.integers(0, 3)
                    new_sc.append(-np.inf if rng.random() < dead else prev_sc[f] + lq)
                    new_par.append(p)
            base = len(sc)
            order = np.argsort(-np.array(new_sc), kind="stable")[:topk]
            sc += new_sc
            par += new_par
            prev = [base + int(o) for o in order]
        scores.append(sc)
        parents.append(par)
    scores = np.array(scores, np.float32)
    parents = np.array(parents, np.int32)
    # rho never increases down a path (and -inf propagates)
    for i in range(b):
        for j, p in enumerate(parents[i]):
            if p >= 0:
                scores[i, j] = min(scores[i, j], scores[i, p])
    return scores, parents


def reference_counts(scores, active, k, cap):
    """Global sort by (-rho, request, pool index), then take greedily respecting the caps."""
    b, m = scores.shape
    items = sorted(
        (-float(scores[r, i]), r, i)
        for r in range(b)
        for i in range(m)
        if active[r] and np.isfinite(scores[r, i])
    )
    spare = max(k - int(np.sum(active)), 0)
    counts, taken = np.zeros(b, np.int32), set()
    for _, r, i in items:
        if len(taken) == spare:
            break
        if counts[r] < cap[r]:
            counts[r] += 1
            taken.add((r, i))
    return counts, taken


SELECT = jax.jit(budget.select_counts, static_argnums=2)
FROM_POOL = jax.jit(tree_mod.select_from_pool, static_argnums=5)
CASES = [  # (batch, budget, topk, depth, inactive fraction, dead fraction, cap)
    (1, 5, 3, 4, 0.0, 0.0, 8),
    (4, 20, 3, 4, 0.0, 0.0, 8),
    (4, 20, 3, 4, 0.5, 0.0, 8),
    (6, 40, 4, 3, 0.3, 0.1, 15),
    (5, 3, 2, 5, 0.0, 0.0, 6),
    (8, 200, 3, 4, 0.2, 0.0, 7),
    (3, 9, 2, 4, 0.0, 0.3, "room"),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_selector_matches_reference_and_is_prefix_connected(case):
    b, k, topk, depth, p_off, dead, cap = case
    rng = np.random.default_rng(hash(case) % 2**32)
    scores, parents = random_pool(rng, b, topk, depth, dead=dead)
    m = scores.shape[1]
    n = 1 + (cap if cap != "room" else 6)
    active = rng.random(b) >= p_off
    active[0] = True
    caps = np.full(b, cap, np.int32) if cap != "room" else rng.integers(0, 6, b).astype(np.int32)
    args = (jnp.asarray(scores), jnp.asarray(active), k, jnp.asarray(caps))
    got = np.asarray(SELECT(*args))
    want, taken = reference_counts(scores, active, k, caps)
    np.testing.assert_array_equal(got, want)
    # Invariants: budget (roots included), per-request cap, inactive requests get nothing.
    assert got.sum() <= max(k - active.sum(), 0)
    assert np.all(got <= caps) and np.all(got[~active] == 0)
    # Greedy: the budget is filled as far as the pools and caps allow.
    avail = sum(min(c, int(np.isfinite(s).sum())) for c, s, a in zip(caps, scores, active) if a)
    assert got.sum() == min(max(k - active.sum(), 0), avail)
    np.testing.assert_array_equal(np.asarray(SELECT(*args)), got)  # deterministic
    # The tree select_from_pool builds from the counts holds exactly the reference's nodes, and
    # every node's parent is in the tree (prefix-connected).
    tokens = np.broadcast_to(np.arange(1, m + 1, dtype=np.int32), (b, m))  # token = pool idx + 1
    t = FROM_POOL(
        jnp.zeros(b, jnp.int32),
        jnp.asarray(tokens),
        jnp.asarray(parents),
        jnp.asarray(scores),
        jnp.asarray(got),
        n,
    )
    tok, par, num = np.asarray(t.tokens), np.asarray(t.parents), np.asarray(t.num_nodes)
    np.testing.assert_array_equal(num, 1 + got)
    for r in range(b):
        pool_idx = tok[r, 1 : num[r]] - 1
        assert {(r, int(i)) for i in pool_idx} == {x for x in taken if x[0] == r}
        for j in range(1, num[r]):
            pp = parents[r, tok[r, j] - 1]
            assert 0 <= par[r, j] < j
            assert (pp < 0 and par[r, j] == 0) or (pp >= 0 and tok[r, par[r, j]] - 1 == pp)


def test_selector_budget_below_active_keeps_roots_only():
    scores, _ = random_pool(np.random.default_rng(0), 4)
    got = SELECT(jnp.asarray(scores), jnp.ones(4, bool), 3, 10)
    np.testing.assert_array_equal(np.asarray(got), 0)


def test_confident_request_gets_the_bigger_tree():
    scores = np.array([[-0.1, -0.2, -0.3, -0.4], [-3.0, -4.0, -5.0, -6.0]], np.float32)
    got = np.asarray(SELECT(jnp.asarray(scores), jnp.ones(2, bool), 6, 3))
    np.testing.assert_array_equal(got, [3, 1])


def test_spec_config_budget_validation():
    assert SpecConfig.for_mode("bole", budget=32).budget == 32
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="budget"):
            SpecConfig.for_mode("bole", budget=bad)


# ----------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny("qwen3_next", mtp_num_layers=1)
    return cfg, init_params(cfg, jax.random.key(0), "float32")


def cand(mode, nodes, step_ms, tokens_per_step=None, depth=8, topk=4):
    c = dict(
        mode=mode,
        nodes=nodes,
        depth=0 if mode == "ar" else depth,
        topk=1 if mode in ("ar", "chain") else topk,
        step_ms=step_ms,
    )
    if tokens_per_step is not None:
        c["tokens_per_step"] = tokens_per_step
    return c


def hand_table(cfg, dtype, entries, acceptance=None, identity=None, **kw):
    """A calibration table with made-up step times and acceptance (format 2)."""
    identity = identity or budget.model_identity(cfg, dtype)
    return dict(
        format=budget.TABLE_FORMAT,
        device=budget.device_name(),
        jax=jax.__version__,
        model=budget.model_signature(cfg, dtype),
        identity=identity,
        drafter="mtp",
        acceptance=acceptance or {},
        entries=entries,
        **kw,
    )


# Measured-looking numbers: at B = 1 the tree wins; at B = 16 the tree's step grows faster than
# its acceptance (chain wins); at B = 64 every speculative step loses to AR.
ACCEPT = {
    "chain d=8": dict(tokens_per_step=2.9),
    "bole N=8 d=8 k=4": dict(tokens_per_step=3.6),
    "bole N=32 d=8 k=4": dict(tokens_per_step=4.2),
}
ENTRIES = [
    dict(
        batch=1,
        kv=1024,
        candidates=[
            cand("ar", 1, 0.30),
            cand("chain", 9, 0.60),
            cand("bole", 8, 0.62),
            cand("bole", 32, 0.70),
        ],
    ),
    dict(
        batch=16,
        kv=1024,
        candidates=[
            cand("ar", 1, 0.33),
            cand("chain", 9, 0.75),
            cand("bole", 8, 1.20),
            cand("bole", 32, 1.90),
        ],
    ),
    dict(
        batch=64,
        kv=1024,
        candidates=[
            cand("ar", 1, 0.39),
            cand("chain", 9, 1.30),
            cand("bole", 8, 1.67),
            cand("bole", 32, 4.00),
        ],
    ),
]


def test_choice_never_loses_on_a_hand_made_table(tiny):
    cfg, params = tiny
    t = hand_table(cfg, jnp.float32, ENTRIES, ACCEPT)
    # B = 1: bole N = 32 expects 4.2 / 0.70 = 6.0 tok/ms, the best of ar 3.3, chain 4.8, N = 8 5.8
    c = budget.choose(t, 1)
    assert (c.mode, c.num_nodes, c.depth, c.topk, c.budget) == ("bole", 32, 8, 4, 32)
    assert c.spec_options() == dict(num_nodes=32, budget=32, depth=8, topk=4)
    # B = 16: chain 2.9 / 0.75 = 3.87 beats bole 3.0 (N = 8) and ar 3.03: the tree loses -> chain
    assert budget.choose(t, 16).mode == "chain" and budget.choose(t, 9).mode == "chain"
    # B = 64: every speculative step loses (chain 2.23, bole 2.16 < ar 2.56) -> ar
    c = budget.choose(t, 64)
    assert c.mode == "ar" and c.spec_options() == {} and c.budget is None
    assert budget.choose(t, 200).mode == "ar"  # beyond the last bucket: the last
    # For every bucket the choice is the measured best of ar / chain / bole.
    for e in ENTRIES:
        ranked = budget.rank_candidates(t, e)
        best = max(ranked, key=lambda r: r["tokens_per_ms"])
        assert budget.choose(t, e["batch"]).tokens_per_ms == pytest.approx(best["tokens_per_ms"])
    # An explicit spec keeps its mode and takes that mode's best shape from the table.
    assert budget.choose(t, 64, mode="bole").num_nodes == 8
    assert budget.choose(t, 64, mode="pernode").mode == "pernode"
    assert budget.choose(t, 1, mode="chain").depth == 8
    # Untimed candidates are never chosen (time budget / out of memory).
    e = dict(
        batch=1,
        kv=1024,
        candidates=[cand("ar", 1, 0.30), dict(cand("bole", 8, None), note="skipped")],
    )
    t2 = hand_table(cfg, jnp.float32, [e], ACCEPT)
    assert budget.choose(t2, 1).mode == "ar" and budget.choose(t2, 1, mode="bole") is None


def test_the_bole_chain_is_a_candidate_and_can_be_chosen(tiny):
    """Calibration times the chain's shape verified by bole (k = 1, N = d + 1) beside the trees;
    where it is the fastest the engine decodes with it, and an explicit topk keeps to the trees."""
    assert [calibrate.candidate_id(c) for c in calibrate.candidates([4, 8], [2, 8])] == [
        "ar",
        "chain d=2",
        "chain d=8",
        "bole N=3 d=2 k=1",
        "bole N=9 d=8 k=1",
        "bole N=4 d=2 k=4",
        "bole N=4 d=8 k=4",
        "bole N=8 d=2 k=4",
        "bole N=8 d=8 k=4",
    ]
    # With topk 1 the trees are the bole chain already: no duplicate candidate.
    ids = [calibrate.candidate_id(c) for c in calibrate.candidates([9], [8], topk=1)]
    assert ids == ["ar", "chain d=8", "bole N=9 d=8 k=1"]
    # Several children counts: every width with each.
    ids = [calibrate.candidate_id(c) for c in calibrate.candidates([8, 16], [8], topk=[4, 2, 1])]
    assert ids == ["ar", "chain d=8", "bole N=9 d=8 k=1"] + [
        f"bole N={n} d=8 k={k}" for n in (8, 16) for k in (2, 4)
    ]
    with pytest.raises(ValueError, match="topk"):
        calibrate.calibrate(None, (1,), (4,), (2,), topk=[0, 4])
    cfg, _ = tiny
    e = dict(
        batch=16,
        kv=1024,
        candidates=[
            cand("ar", 1, 0.33),
            cand("chain", 9, 0.75),
            cand("bole", 9, 0.60, topk=1),
            cand("bole", 8, 1.20),
        ],
    )
    accept = dict(ACCEPT, **{"bole N=9 d=8 k=1": dict(tokens_per_step=2.9)})
    t = hand_table(cfg, jnp.float32, [e], accept)
    c = budget.choose(t, 16)  # 2.9 / 0.60 = 4.8 tok/ms: chain 3.9, tree 3.0, ar 3.0
    assert (c.mode, c.num_nodes, c.topk, c.budget) == ("bole", 9, 1, 16 * 9)
    assert c.spec_options() == dict(num_nodes=9, budget=144, depth=8, topk=1)
    assert budget.choose(t, 16, mode="bole").topk == 1
    assert budget.choose(t, 16, mode="pernode").topk == 4  # the per-node baseline stays a tree
    tree = budget.choose(t, 16, mode="bole", topk=4)
    assert (tree.num_nodes, tree.topk) == (8, 4)
    assert budget.choose(t, 16, mode="chain").mode == "chain"


def test_acceptance_weighting():
    """Expected throughput = acceptance / step time: a faster step loses to a slower one that
    emits proportionally more tokens; the table-level (pooled) acceptance wins over a candidate's
    own; ar's acceptance is 1 whatever is stored."""
    e = dict(
        batch=4,
        kv=512,
        candidates=[
            cand("ar", 1, 1.0, tokens_per_step=9.0),
            cand("chain", 5, 2.0, 2.4, depth=4),
            cand("bole", 8, 3.0, 3.3, depth=4),
        ],
    )
    t = dict(entries=[e], acceptance={})
    # ar 1.0, chain 1.2, bole 1.1 tokens per ms
    assert [r["mode"] for r in budget.rank_candidates(t, e)] == ["chain", "bole", "ar"]
    assert budget.choose(t, 4).mode == "chain"
    assert budget.rank_candidates(t, e)[-1]["tokens_per_step"] == 1.0
    # The pooled estimate raises bole's acceptance to 3.9 (1.3 per ms): bole.
    t["acceptance"] = {"bole N=8 d=4 k=4": dict(tokens_per_step=3.9)}
    c = budget.choose(t, 4)
    assert (c.mode, c.tokens_per_step, c.step_ms) == ("bole", 3.9, 3.0)
    # Below one token per ms gained over the extra step time: ar again.
    t["acceptance"] = {"bole N=8 d=4 k=4": 2.9, "chain d=4": 1.9}
    assert budget.choose(t, 4).mode == "ar"
    # Ties go to the cheaper configuration (ar before chain before bole).
    e2 = dict(batch=1, kv=512, candidates=[cand("bole", 4, 2.0, 2.0), cand("ar", 1, 1.0)])
    assert budget.choose(dict(entries=[e2], acceptance={}), 1).mode == "ar"


def test_synthetic_acceptance():
    p = calibrate.synthetic_accept_prob(3.5, 8)
    assert calibrate.expected_tokens_per_step(p, 8) == pytest.approx(3.5, abs=1e-6)
    assert calibrate.expected_tokens_per_step(0.5, 2) == 1.75
    assert bench.expected_tokens_per_step is calibrate.expected_tokens_per_step


def test_table_is_keyed_by_model_device_and_jax(tiny, tmp_path, monkeypatch):
    cfg, params = tiny
    dtype = params["embed"].dtype
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    assert budget.default_table_dir() == tmp_path / "cache" / "calibration"
    monkeypatch.delenv("BOLE_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert budget.default_table_dir() == tmp_path / "xdg" / "bole_jax" / "calibration"
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    # Model identity: a checkpoint folder's config and weight files (name, size, mtime).
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"a": 1}')
    (m / "model.safetensors").write_bytes(b"x" * 10)
    ident = budget.model_identity(cfg, dtype, m)
    assert budget.model_identity(cfg, dtype, m) == ident
    key = budget.table_key(ident)
    assert key != budget.table_key(ident, device="NVIDIA H200")
    assert key != budget.table_key(ident, jax_version="0.0.1")
    assert key != budget.table_key(budget.model_identity(cfg, dtype, m, draft_vocab=64))
    assert key != budget.table_key(budget.model_identity(cfg, jnp.bfloat16, m))
    (m / "model.safetensors").write_bytes(b"y" * 11)  # retrained weights: another model
    assert budget.table_key(budget.model_identity(cfg, dtype, m)) != key
    ident = budget.model_identity(cfg, dtype, m)
    # Written to the user cache under its key, found there by the same model only.
    t = hand_table(cfg, dtype, ENTRIES, ACCEPT, identity=ident)
    path = calibrate.store(t)
    assert path == budget.table_path(ident) and path.parent == tmp_path / "cache" / "calibration"
    assert path.name.startswith("model-") and budget.table_key(ident) in path.name
    found, where = budget.find_table(cfg, dtype, model_dir=m)
    assert found == json.loads(json.dumps(t)) and where == str(path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"a": 2}')
    assert budget.find_table(cfg, dtype, model_dir=other)[0] is None
    # Another jax version's table lives under another key: not found.
    path.rename(budget.table_path(ident, jax_version="0.0.1"))
    table, why = budget.find_table(cfg, dtype, model_dir=m)
    assert table is None and "no table at" in why
    # A table shipped inside a model folder is read (never written there) if it matches.
    calibrate.save_table(t, m / budget.CALIBRATION_FILE)
    assert budget.find_table(cfg, dtype, model_dir=m)[1] == str(m / budget.CALIBRATION_FILE)
    assert (
        budget.find_table(dataclasses.replace(cfg, hidden_size=32), dtype, model_dir=m)[0] is None
    )
    # Explicit paths must exist and match the device / dims.
    with pytest.raises(FileNotFoundError, match="calibration table not found"):
        budget.find_table(cfg, dtype, path=tmp_path / "missing.json")
    assert budget.find_table(cfg, dtype, path=m / budget.CALIBRATION_FILE)[0] is not None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a calibration table"):
        budget.load_table(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(
        json.dumps(dict(format="bole_jax.calibration/1", entries=[{}]))
    )
    with pytest.raises(ValueError, match="old format.*bole-jax calibrate"):
        budget.load_table(tmp_path / "old.json")


def test_tables_never_go_into_the_package(tiny, tmp_path, monkeypatch, capsys):
    import bole_jax

    cfg, params = tiny
    pkg = Path(bole_jax.__file__).resolve().parent
    t = hand_table(cfg, jnp.float32, ENTRIES, ACCEPT)
    for bad in (pkg / "default_model" / budget.CALIBRATION_FILE, pkg / "t.json"):
        with pytest.raises(ValueError, match="inside the installed bole_jax package"):
            calibrate.save_table(t, bad)
        assert not bad.exists()
    # The CLI refuses before measuring anything.
    assert cli.main(["calibrate", "--out", str(pkg / "x.json"), "--no-progress"]) == 2
    assert "inside the installed bole_jax package" in capsys.readouterr().err
    # Merging: the stored table's other buckets and acceptance are kept.
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    first = hand_table(cfg, jnp.float32, ENTRIES[:1], {"chain d=8": 2.0})
    second = hand_table(cfg, jnp.float32, ENTRIES[2:], {"bole N=8 d=8 k=4": 3.0})
    calibrate.store(first)
    merged = budget.load_table(calibrate.store(second))
    assert [e["batch"] for e in merged["entries"]] == [1, 64]
    assert merged["acceptance"] == {"chain d=8": 2.0, "bole N=8 d=8 k=4": 3.0}
    assert list((tmp_path / "cache" / "calibration").iterdir()) == [
        budget.table_path(first["identity"])
    ]
    with pytest.raises(ValueError, match="differ in device"):
        calibrate.merge_tables(dict(first, device="other"), second)


def test_notice_names_the_exact_command(tiny, tmp_path, monkeypatch, caplog):
    import bole_jax
    from bole_jax.llm import DEFAULT_MODEL_DIR

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    m = tmp_path / "my model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    want = f"bole-jax calibrate --model '{m.resolve()}'"
    assert budget.calibrate_command(m) == want
    assert budget.calibrate_command(None, embedded=True) == "bole-jax calibrate"
    assert budget.calibrate_command(None, preset="tiny") == "bole-jax calibrate --preset tiny"
    assert budget.is_embedded_model(DEFAULT_MODEL_DIR)
    assert budget.is_embedded_model(Path(bole_jax.__file__).parent / "default_model")
    assert not budget.is_embedded_model(m)

    class Fake:  # what the engine passes: an LLM's cfg, params, path and options
        def __init__(self, path):
            self.cfg, self.params, self.path, self.spec_options = cfg, params, path, {}

    assert budget.llm_command(Fake(DEFAULT_MODEL_DIR)) == "bole-jax calibrate"
    assert budget.llm_command(Fake(m)) == want
    budget._warned.clear()
    with caplog.at_level(logging.WARNING, logger="bole_jax"):
        for _ in range(3):
            opts = budget.spec_options_for(Fake(m), "bole", 16)
            assert calibrate.decode_mode(Fake(m), None, 16) == "ar"
    assert opts == budget.default_choice(16).spec_options()
    notes = [r.message for r in caplog.records if "no calibration table" in r.message]
    assert len(notes) == 2  # once for the explicit bole width, once for the mode choice
    assert all(f"`{want}`" in n for n in notes), notes
    assert "decoding with ar" in notes[1] and "tree width 16" in notes[0]
    budget._warned.clear()
    with caplog.at_level(logging.WARNING, logger="bole_jax"):
        seen = len(caplog.records)
        # a configuration looked up for comparison (the memory plan's rows): no notice
        assert budget.spec_options_for(Fake(m), "bole", 16, quiet=True) == opts
    assert not [r for r in caplog.records[seen:] if "no calibration table" in r.message]
    budget._warned.clear()
    with caplog.at_level(logging.WARNING, logger="bole_jax"):
        budget.spec_options_for(Fake(m), "chain", 16)
    (note,) = [r.message for r in caplog.records[-1:] if "no calibration table" in r.message]
    assert "decoding with chain." in note and "width" not in note  # a chain has no tree width


def test_engine_decodes_with_the_table_choice(tiny, tmp_path, monkeypatch):
    """LLM(spec=None) takes the table's mode per batch bucket (here: chain at B = 1, ar at B = 2
    and above); spec="bole" keeps bole at the table's width; without a table on CPU: ar."""
    from bole_jax.llm import LLM

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    llm = LLM(cfg, params=params, max_batch_size=4)
    prompts = [[3, 5, 7, 9], [2, 4, 6], [1, 2, 3], [9, 8]]
    assert calibrate.decode_mode(llm, None, 1) == "ar"  # no table (and no auto-calibration on CPU)
    ar = llm.generate(prompts, max_new_tokens=6)
    assert all(o.stats["mode"] == "ar" for o in ar)
    entries = [
        dict(
            batch=1,
            kv=64,
            candidates=[
                cand("ar", 1, 1.0),
                cand("chain", 3, 1.5, depth=2),
                cand("bole", 4, 3.0, depth=2, topk=2),
                cand("bole", 8, 2.5, depth=2, topk=2),
            ],
        ),
        dict(
            batch=2,
            kv=64,
            candidates=[
                cand("ar", 1, 1.0),
                cand("chain", 3, 3.0, depth=2),
                cand("bole", 8, 3.0, depth=2, topk=2),
            ],
        ),
    ]
    acc = {"chain d=2": 2.0, "bole N=4 d=2 k=2": 2.5, "bole N=8 d=2 k=2": 2.6}
    calibrate.store(
        hand_table(cfg, params["embed"].dtype, entries, acc, identity=budget.llm_identity(llm))
    )
    llm = LLM(cfg, params=params, max_batch_size=4)
    assert calibrate.decode_mode(llm, None, 1) == "chain"
    assert (
        calibrate.decode_mode(llm, None, 2) == "ar" and calibrate.decode_mode(llm, None, 4) == "ar"
    )
    (one,) = llm.generate(prompts[:1], max_new_tokens=6)
    assert one.stats["mode"] == "chain" and one.token_ids == ar[0].token_ids  # greedy: lossless
    assert llm._spec_config("chain", 1).shape.depth == 2
    assert [o.stats["mode"] for o in llm.generate(prompts, max_new_tokens=6)] == ["ar"] * 4
    spec = llm._spec_config("bole", 1)  # explicit bole: the table's best bole tree at B = 1
    assert (spec.shape.num_nodes, spec.shape.depth, spec.shape.topk, spec.budget) == (8, 2, 2, 8)
    # Explicit options still win over the table.
    llm2 = LLM(cfg, params=params, max_batch_size=4, spec_options=dict(num_nodes=4, depth=3))
    assert calibrate.decode_mode(llm2, None, 1) == "bole"
    assert llm2._spec_config("bole", 1).shape.num_nodes == 4


def test_auto_calibration_on_the_tiny_model(tiny, tmp_path, monkeypatch):
    """First use with automatic calibration (forced on here; off by default on CPU): the bucket in
    use is measured within the time budget and stored in the user cache; the choice comes from
    it and the output equals AR's."""
    from bole_jax.llm import LLM

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "AUTO_SECONDS", 45.0)
    monkeypatch.setattr(calibrate, "CPU_NODES", (4,))
    monkeypatch.setattr(calibrate, "DEFAULT_DEPTHS", (2,))
    llm = LLM(cfg, params=params, max_batch_size=2, spec_options=dict(auto_calibrate=True))
    prompts = [[3, 5, 7, 9], [2, 4, 6]]
    t = time.perf_counter()
    table, where = calibrate.ensure_table(llm, 2)
    took = time.perf_counter() - t
    assert table is not None and where == str(budget.table_path(budget.llm_identity(llm)))
    assert took < 45.0 + 60.0, took  # the budget, plus the candidate in flight when it ran out
    assert Path(where).parent == tmp_path / "cache" / "calibration"
    (e,) = table["entries"]
    assert e["batch"] == 2 and [budget.candidate_id(c) for c in e["candidates"]] == [
        "ar",
        "chain d=2",
        "bole N=3 d=2 k=1",
        "bole N=4 d=2 k=4",
    ]
    timed = [c for c in e["candidates"] if "step_ms" in c]
    assert timed[0]["mode"] == "ar" and all(c["step_ms"] > 0 for c in timed)
    for c in timed[1:]:  # measured acceptance of random weights: between 1 and depth + 1
        assert 1.0 <= table["acceptance"][budget.candidate_id(c)]["tokens_per_step"] <= 3.0
    assert e["choice"]["mode"] == budget.choose(table, 2).mode
    print(calibrate.format_table(table))
    assert "<- chosen" in calibrate.format_table(table)
    out = llm.generate(prompts, max_new_tokens=5)
    assert {o.stats["mode"] for o in out} == {e["choice"]["mode"]}
    ar = llm.generate(prompts, max_new_tokens=5, spec="ar")
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    # Found again, not re-measured.
    t = time.perf_counter()
    assert calibrate.ensure_table(llm, 2)[0] == table and time.perf_counter() - t < 5


def test_calibrate_several_depths_in_one_run(tiny, caplog):
    """Candidates of several depths share one prefill per bucket: each is laid out with its own
    depth's pending drafter rows (`derive_state`), so every one of them is timed (a run with
    `--depth 2 4` failed at lowering: the pending rows of the deepest candidate reached the
    others), and their synthetic acceptance grows with the depth. With no progress bar the run
    still logs its phases (prefill, compilation, each bucket timed), and each timed candidate
    records its program's temporaries."""
    import logging

    from bole_jax.llm import LLM

    cfg, params = tiny
    llm = LLM(cfg, params=params, max_batch_size=2)
    caplog.set_level(logging.INFO, logger="bole_jax.calibrate")
    table = calibrate.calibrate(
        llm,
        (2,),
        (4,),
        (2, 4),
        modes=("ar", "chain", "bole"),
        progress=False,
        accept_prob=0.8,
        steps=2,
        repeats=1,
        warm=1,
    )
    (e,) = table["entries"]
    ids = [budget.candidate_id(c) for c in e["candidates"]]
    assert ids == [
        "ar",
        "chain d=2",
        "chain d=4",
        "bole N=3 d=2 k=1",
        "bole N=5 d=4 k=1",
        "bole N=4 d=2 k=4",
        "bole N=4 d=4 k=4",
    ]
    assert all(c.get("step_ms", 0) > 0 for c in e["candidates"]), e["candidates"]
    acc = table["acceptance"]
    assert acc["chain d=4"]["tokens_per_step"] > acc["chain d=2"]["tokens_per_step"]
    temp = {budget.candidate_id(c): c["temp_bytes"] for c in e["candidates"]}
    assert all(t > 0 for t in temp.values()), temp
    assert temp["chain d=4"] > temp["ar"]  # the verify rows and drafter levels hold more
    assert "temp MiB" in calibrate.format_table(table)
    said = [r.getMessage() for r in caplog.records if r.name == "bole_jax.calibrate"]
    assert any("batch 2 prefilled, 7 programs lowered" in m for m in said), said
    assert any("compiled 7 programs in" in m for m in said), said
    assert any("timed batch 2 at KV" in m for m in said), said
    # each program's memory by kind: the state comes back in its donated buffers
    mem = [m for m in said if "chain d=4: arguments" in m]
    assert len(mem) == 1 and "of them in donated arguments" in mem[0], said


def fake_time(llm, prep, cands, *a, **k):
    """`calibrate._time_bucket` without a model: made-up step times, 1 token per step."""
    rows = [dict(c, step_ms=1.0 + i, tokens_per_step=1.0) for i, c in enumerate(cands)]
    return dict(batch=prep["batch"], kv=96, candidates=rows), {}


def test_calibrate_past_the_budget_starts_no_bucket(tiny, monkeypatch):
    """Buckets reached after the time budget are not prefilled, lowered or compiled: they are
    listed with every candidate untimed, so the table chooses nothing for them (the engine then
    decodes ar there), never another bucket's choice."""
    from bole_jax.llm import LLM

    cfg, params = tiny
    started = []

    def fake_prepare(llm, ids, cands, *a, **k):
        started.append(len(ids))
        time.sleep(0.3)  # the first bucket uses up the budget
        return dict(batch=len(ids), jobs={})

    monkeypatch.setattr(calibrate, "_prepare_bucket", fake_prepare)
    monkeypatch.setattr(calibrate, "_time_bucket", fake_time)
    llm = LLM(cfg, params=params, max_batch_size=8)
    table = calibrate.calibrate(
        llm, (1, 4, 8), (4,), (2,), time_budget=0.1, progress=False, accept_prob=0.5
    )
    assert started == [1]
    assert [(e["batch"], e["kv"]) for e in table["entries"]] == [(1, 96), (4, 96), (8, 96)]
    for e in table["entries"][1:]:
        assert all(c["note"] == "skipped (time budget)" for c in e["candidates"])
        assert e["choice"] is None and budget.choose(table, e["batch"]) is None
    assert budget.choose(table, 1).mode == "ar"


@pytest.mark.parametrize(
    "batch, widths",
    [(1, (8, 16, 32, 64)), (4, (8, 16, 32, 64)), (16, (4, 8, 16, 32)), (33, (4, 8, 16, 32))],
)
def test_auto_calibration_widths_by_batch(tiny, tmp_path, monkeypatch, batch, widths):
    """On an accelerator, first-use calibration times the widths measured to matter at the
    bucket: up to 64 nodes below B = 16, from 4 to 32 nodes from B = 16 on."""
    from bole_jax.llm import LLM

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate.jax, "default_backend", lambda: "gpu")
    seen = {}

    def fake(llm, buckets, nodes, *a, **k):
        seen.update(buckets=list(buckets), nodes=tuple(nodes))
        raise RuntimeError("stop here")

    monkeypatch.setattr(calibrate, "calibrate", fake)
    llm = LLM(cfg, params=params, max_batch_size=64, spec_options=dict(auto_calibrate=True))
    with pytest.raises(RuntimeError, match="stop here"):
        calibrate.ensure_table(llm, batch)
    assert seen == dict(buckets=[budget.batch_bucket(batch)], nodes=widths)


def test_cli_calibrate_model_writes_the_user_cache(model_dir, tmp_path, monkeypatch, capsys):
    """`bole-jax calibrate --model DIR` measures that checkpoint and stores the table under its
    key in the user cache, where the engine loading DIR finds it."""
    from bole_jax.llm import LLM

    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    rc = cli.main(
        [
            "calibrate",
            "--model",
            str(model_dir),
            "--batch",
            "1",
            "--depth",
            "2",
            "--nodes",
            "4",
            "--steps",
            "2",
            "--warm",
            "1",
            "--modes",
            "ar",
            "chain",
            "--compile-cache",
            "none",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    llm = LLM(model_dir)
    path = budget.table_path(budget.llm_identity(llm))
    assert f"wrote {path}" in out and "<- chosen" in out and path.is_file()
    assert not (Path(model_dir) / budget.CALIBRATION_FILE).exists()
    assert table_prompts_measured(budget.load_table(path))
    table = budget.load_table(path)
    assert [budget.candidate_id(c) for c in table["entries"][0]["candidates"]] == [
        "ar",
        "chain d=2",
    ]
    assert calibrate.decode_mode(llm, None, 1) == table["entries"][0]["choice"]["mode"]


def test_calibrate_measures_acceptance_on_the_given_prompts(model_dir, tmp_path, monkeypatch):
    """`bole-jax calibrate --prompts-file F`: the buckets decode F's prompts (cycled to the batch,
    each cut to its last prompt_len tokens), the table names them; clear errors otherwise."""
    from bole_jax.llm import LLM

    seen = []

    def fake_prepare(llm, ids, cands, *a, **k):
        seen.append(ids)
        return dict(batch=len(ids), jobs={})

    monkeypatch.setattr(calibrate, "_prepare_bucket", fake_prepare)
    monkeypatch.setattr(calibrate, "_time_bucket", fake_time)
    llm = LLM(model_dir)
    texts = ["def add(a, b):\n    return", "Translate to French: good morning", "x = [1, 2,"]
    table = calibrate.calibrate(
        llm, (4,), (4,), (2,), progress=False, prompts=texts, prompts_source="mine.jsonl"
    )
    enc = [llm.tokenizer.encode(t) for t in texts]
    assert seen == [enc + enc[:1]] and table["prompts"] == "mine.jsonl (3 prompts)"
    seen.clear()
    calibrate.calibrate(llm, (2,), (4,), (2,), progress=False, prompts=texts, prompt_len=2)
    assert seen == [[e[-2:] for e in enc[:2]]]
    # The CLI reads the file (HumanEval / Spec-Bench records) and refuses presets and bad files.
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"turns": [t, "more"]}) for t in texts))
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    argv = ["calibrate", "--model", str(model_dir), "--batch", "2", "--depth", "2"]
    argv += ["--nodes", "4", "--compile-cache", "none", "--no-progress"]
    seen.clear()
    assert cli.main(argv + ["--prompts-file", str(f)]) == 0
    assert seen == [enc[:2]]
    with pytest.raises(SystemExit, match="needs a checkpoint"):
        cli.main(["calibrate", "--preset", "tiny", "--prompts-file", str(f)])
    with pytest.raises(SystemExit, match="prompts file not found"):
        cli.main(argv + ["--prompts-file", str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="synthetic drafter"):
        calibrate.calibrate(llm, (1,), (4,), (2,), progress=False, prompts=texts, accept_prob=0.5)


def test_a_synthetic_table_re_weighed_at_another_acceptance(tiny, tmp_path, monkeypatch, capsys):
    """`calibrate --preset P --accept-mean X --timings-from T`: T's step times, the synthetic
    acceptance at X, the choice made again, the key of the new drafter; refused for a real
    drafter's table, a checkpoint, or other dims."""
    from bole_jax.model.presets import preset

    cfg = preset("tiny", mtp=True)
    p_lo = calibrate.synthetic_accept_prob(2.0, 8)
    ident = budget.model_identity(cfg, jnp.float32, drafter=f"synthetic p={p_lo:.4f}")
    e = dict(
        batch=4,
        kv=1024,
        candidates=[
            cand("ar", 1, 1.0, tokens_per_step=1.0),
            cand("chain", 9, 3.0, tokens_per_step=1.9),
            cand("bole", 4, 1.8, tokens_per_step=1.6),
        ],
    )
    low = hand_table(
        cfg,
        jnp.float32,
        [e],
        {
            "chain d=8": dict(tokens_per_step=2.0, source="synthetic"),
            "bole N=4 d=8 k=4": dict(tokens_per_step=1.85, source="synthetic"),
        },
        identity=ident,
        depths=[8],
        git_commit="abc1234",
    )
    low["drafter"] = ident["drafter"]
    # at acceptance 2: ar 1.0 tok/ms, chain 0.67, the 4-node tree 1.03 -> the tree
    assert budget.choose(low, 4).mode == "bole"
    high = calibrate.rescore_synthetic(low, 6.4, "t.json")
    p = calibrate.synthetic_accept_prob(6.4, 8)
    acc = high["acceptance"]
    assert acc["chain d=8"]["tokens_per_step"] == pytest.approx(
        calibrate.expected_tokens_per_step(p, 8)
    )
    assert acc["bole N=4 d=8 k=4"]["tokens_per_step"] == pytest.approx(
        calibrate.expected_tokens_per_step(p, 3)
    )
    # the same step times, chosen again: chain 6.4 / 3.0 = 2.1 tok/ms beats the tree's 1.9
    steps = lambda t: [c["step_ms"] for c in t["entries"][0]["candidates"]]  # noqa: E731
    assert steps(high) == steps(low)
    assert (
        high["entries"][0]["choice"]["mode"] == "chain" and budget.choose(high, 4).mode == "chain"
    )
    assert high["drafter"] == high["identity"]["drafter"] == f"synthetic p={p:.4f}"
    assert high["key"] == budget.table_key(high["identity"], high["device"], high["jax"])
    assert high["timings_from"] == dict(
        source="t.json", drafter=low["drafter"], git_commit="abc1234", created=None
    )
    assert "tokens_per_step" not in high["entries"][0]["candidates"][1]  # the old p's counts
    assert budget.choose(low, 4).mode == "bole"  # the source table is unchanged
    with pytest.raises(ValueError, match="only a synthetic-drafter table"):
        calibrate.rescore_synthetic(dict(low, drafter="mtp"), 6.4)
    # the CLI: writes the re-weighed table; refuses a checkpoint or another preset's table
    src, dst = tmp_path / "low.json", tmp_path / "high.json"
    src.write_text(json.dumps(low))
    argv = ["calibrate", "--accept-mean", "6.4", "--timings-from", str(src)]
    assert cli.main(argv + ["--preset", "tiny", "--out", str(dst)]) == 0
    assert "<- chosen" in capsys.readouterr().out
    assert json.loads(dst.read_text())["acceptance"] == high["acceptance"]
    with pytest.raises(SystemExit, match="re-weighs a --preset table"):
        cli.main(argv + ["--model", "DIR"])
    with pytest.raises(SystemExit, match="another model"):
        cli.main(argv + ["--preset", "qwen3.5-9b", "--out", str(dst)])


def table_prompts_measured(table):
    return table["prompts"].startswith("built-in") and all(
        a["source"] == "measured" for a in table["acceptance"].values()
    )


def test_bench_quick_defaults():
    a = cli.build_parser().parse_args(["bench", "--preset", "tiny", "--quick"])
    bench._check_e2e_args(a)
    assert (a.batch, a.breakdown_batch, a.time_budget, a.steps) == ([1], 0, 75.0, 8)
    assert a.dtype == "float32"  # this test runs on CPU
    a = cli.build_parser().parse_args(["bench", "--preset", "tiny"])
    bench._check_e2e_args(a)
    assert (a.batch, a.breakdown_batch, a.time_budget) == ([1, 4, 16, 32, 64], 16, 480.0)
    assert "not GPU-representative" in bench.CPU_NOTE and "interpret" in bench.CPU_NOTE


def test_calibrate_rejects_bad_buckets():
    with pytest.raises(ValueError, match="positive integers"):
        calibrate.check_calibration_args([0, 2], [4], [8])
    with pytest.raises(ValueError, match="at most 128 nodes"):
        calibrate.check_calibration_args([1], [256], [8])
    with pytest.raises(ValueError, match="at least one"):
        calibrate.check_calibration_args([], [4], [8])
    with pytest.raises(ValueError, match="--steps"):
        calibrate.check_calibration_args([1], [4], [8], steps=0)


# ----------------------------------------------------------------------------- end to end


def test_synthetic_accept_prob():
    p = bench.synthetic_accept_prob(6.4, 8)
    assert bench.expected_tokens_per_step(p, 8) == pytest.approx(6.4, abs=1e-6)
    with pytest.raises(ValueError, match="mean tokens per step"):
        bench.synthetic_accept_prob(9.5, 8)


def test_memory_per_request_matches_verify_shapes(tiny):
    from bole_jax.model import init_cache
    from bole_jax.spec_decode import verify

    cfg, params = tiny
    n = 5
    tree = tree_mod.Tree(
        tokens=jnp.zeros((1, n), jnp.int32),
        parents=jnp.arange(n)[None] - 1,
        depth=jnp.arange(n)[None],
        num_nodes=jnp.full((1,), n),
        score=jnp.zeros((1, n)),
    )
    for mode in ("bole", "pernode", "chain"):
        auxs = jax.eval_shape(
            lambda p, c: verify.verify_forward(p, cfg, tree, c, mode=mode)[2],
            params,
            init_cache(cfg, 1, 64, jnp.float32),
        )
        m = bench.memory_per_request(cfg, mode, n, 64, jnp.float32)
        assert bench.tree_bytes(auxs) == pytest.approx(
            (m["verify_state_mib"] + m["verify_conv_mib"]) * bench.MiB
        )


def test_load_prompts(tmp_path):
    import gzip

    (tmp_path / "a.jsonl").write_text('{"prompt": "def f():"}\n\n{"turns": ["Hi", "more"]}\n')
    assert bench.load_prompts(tmp_path / "a.jsonl") == ["def f():", "Hi"]
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"prompt": "x"}\n')
    assert bench.load_prompts(tmp_path / "b.jsonl.gz") == ["x"]
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert bench.load_prompts(tmp_path / "c.txt") == ["one", "two"]
    (tmp_path / "d.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        bench.load_prompts(tmp_path / "d.jsonl")
    with pytest.raises(FileNotFoundError):
        bench.load_prompts(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--preset", "nope"], "unknown preset"),
        (["--preset", "tiny", "--batch", "0"], "--batch"),
        (["--preset", "tiny", "--nodes", "500"], "at most|above 128"),
        (["--preset", "tiny", "--budget", "lots"], "--budget"),
        (["--model", "/nonexistent"], "--prompts-file"),
        (["--model", "/nonexistent", "--prompts-file", "p.jsonl"], "not found"),
    ],
)
def test_bench_cli_errors(argv, msg, capsys):
    assert cli.main(["bench", "--compile-cache", "none", *argv]) == 2
    assert re.search(msg, capsys.readouterr().err)


def test_bench_e2e_tiny(tmp_path):
    """The whole benchmark on CPU: 4 modes side by side, a binding budget, the breakdown."""
    args = cli.build_parser().parse_args(
        [
            "bench",
            "--preset",
            "tiny",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--quick",
            "--compile-cache",
            "none",
            "--compile-workers",
            "2",
            "--depth",
            "2",
            "--topk",
            "2",
            "--nodes",
            "4",
            "--budget",
            "5",
            "--accept-mean",
            "2.5",
            "--breakdown-batch",
            "2",
            "--breakdown-modes",
            "bole",
            "--time-budget",
            "900",
            "--out",
            str(tmp_path),
        ]
    )
    res = bench.run_e2e(args)
    assert res["errors"] == [] and res["skipped"] == []
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "bole", "pernode", "chain", "bole-chain", "engine"}
    # no calibration table in this session's cache: the engine decodes with AR
    assert rows["engine"]["chosen"] == "ar" and rows["engine"]["tokens_per_step"] == 1.0
    # bole-chain: the chain's shape (depth + 1 nodes) with bole's factors, not per-node states
    assert rows["bole-chain"]["nodes"] == rows["chain"]["nodes"] == 3
    assert rows["bole-chain"]["budget"] == "-"
    assert rows["chain"]["verify_state_mib"] > 5 * rows["bole-chain"]["verify_state_mib"]
    for m, r in rows.items():
        assert r["ar_agreement"] == 1.0, m  # greedy fp32: lossless, also with the budget binding
        assert r["ar_first_divergence"] == [None, None], m
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
    assert rows["bole"]["budget"] == 5 and rows["chain"]["budget"] == "-"
    assert rows["bole"]["tokens_per_step"] > 1.3 and rows["ar"]["tokens_per_step"] == 1.0
    assert rows["ar"]["speedup_vs_ar"] == 1.0 and rows["pernode"]["speedup_vs_pernode"] == 1.0
    assert rows["pernode"]["verify_state_mib"] > 10 * rows["bole"]["verify_state_mib"]
    (bd,) = res["breakdown"]
    assert bd["mode"] == "bole" and all(bd[f"{s}_ms"] > 0 for s in bench.STAGES)
    assert bd["commit_kind"] == "eager"  # SpecConfig.lazy_commit is off by default (--lazy-commit)
    saved = json.loads((tmp_path / "e2e_tiny.json").read_text())
    assert {"device", "jax", "git_commit"} <= set(saved["env"]) and saved["command"]
    assert len(saved["rows"]) == 6


@pytest.mark.parametrize("winner", ["chain", "bole"])
def test_bench_engine_row_decodes_with_the_table_choice(tmp_path, winner):
    """`bench --modes engine`: the engine's own choice from a calibration table (here one that
    says the tree loses at this batch, or wins), timed as its own point, lossless against AR."""
    from bole_jax.model.presets import preset

    cfg = preset("tiny", mtp=True)
    fast = dict(chain=(0.5, 0.9), bole=(0.9, 0.5))[winner]  # (chain, bole N=4) step ms
    entries = [
        dict(
            batch=2,
            kv=1024,
            candidates=[
                cand("ar", 1, 0.5),
                cand("chain", 3, fast[0], depth=2),
                cand("bole", 4, fast[1], depth=2, topk=2),
            ],
        )
    ]
    accept = {"chain d=2": dict(tokens_per_step=2.0), "bole N=4 d=2 k=2": dict(tokens_per_step=2.0)}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(hand_table(cfg, jnp.float32, entries, accept)))
    args = cli.build_parser().parse_args(
        ["bench", "--preset", "tiny", "--dtype", "float32", "--batch", "2", "--quick"]
        + ["--compile-cache", "none", "--compile-workers", "2", "--depth", "2", "--topk", "2"]
        + ["--modes", "ar", "engine", "--accept-mean", "2.5", "--time-budget", "900"]
        + ["--calibration", str(path), "--out", str(tmp_path), "--no-plots"]
    )
    res = bench.run_e2e(args)
    assert res["errors"] == [] and res["skipped"] == []
    rows = {r["mode"]: r for r in res["rows"]}
    e = rows["engine"]
    want = "chain N=3 d=2 K=6" if winner == "chain" else "bole N=4 d=2 k=2 K=8"
    assert e["chosen"] == want and e["width_from"] == str(path)
    assert e["ar_agreement"] == 1.0 and e["tokens_per_step"] > 1.0


def test_park_on_host_round_trip():
    """bench parks the prefilled states of later batches in host memory and puts them back with
    their shardings: values (typed PRNG keys included) and placements unchanged."""
    tree = dict(a=jnp.arange(6.0).reshape(2, 3), key=jax.random.key(3), n=jnp.int32(5))
    assert bench.park_on_host({}) == {} and bench.park_on_host({1: tree}) == {}  # CPU: nothing
    parked = bench.park_on_host({1: tree}, force=True)
    back = bench.unpark(parked[1])
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [x.sharding for x in jax.tree.leaves(back)] == [
        x.sharding for x in jax.tree.leaves(tree)
    ]
    assert bench.unpark(tree) is tree


def test_ar_logits_teacher_forcing_matches_greedy():
    """bench.ar_logits (the divergence report's yardstick): the teacher-forced forward's argmax
    at each generated position is the token greedy AR generated there."""
    from bole_jax.llm import LLM
    from bole_jax.model.presets import preset

    cfg = preset("tiny")
    llm = LLM(cfg, params=init_params(cfg, jax.random.key(1), "float32"))
    prompt = [3, 5, 7, 11, 13]
    out = llm.generate([prompt], max_new_tokens=4, spec="ar")[0].token_ids
    for pos in (1, 3):
        lg = bench.ar_logits(llm, prompt, out, pos)
        assert int(np.argmax(lg)) == out[pos]
        assert bench.ar_top2_gap(llm, prompt, out, pos) == pytest.approx(
            float(np.sort(lg)[-1] - np.sort(lg)[-2])
        )


def test_divergence_info_ranks_both_tokens():
    lg = np.asarray([0.5, 3.0, 2.2, -1.0, 2.9], np.float32)
    info = bench.divergence_info(lg, ar_token=4, token=1)
    assert info["token_rank"] == 0 and info["token_deficit"] == 0.0
    assert info["ar_token_rank"] == 1 and info["ar_token_deficit"] == pytest.approx(0.1)
    assert info["top2_gap"] == pytest.approx(0.1)
    assert bench.divergence_info(lg, ar_token=1, token=3)["token_rank"] == 4


def test_past_the_budget_running_compiles_end_before_timing():
    """`settle_compiles` (bench and calibrate, past their time budget): the queued compilations
    are dropped and the running ones awaited, so no compilation runs beside a timed loop."""
    import concurrent.futures as cf
    import threading

    release = threading.Event()
    pool = cf.ThreadPoolExecutor(1)
    running = pool.submit(lambda: release.wait(5) and "compiled")
    queued = pool.submit(lambda: "never")
    done = pool.submit(lambda: "never either")
    threading.Timer(0.3, release.set).start()
    t = time.perf_counter()
    assert calibrate.settle_compiles([running, queued, done]) == 2
    assert time.perf_counter() - t > 0.2  # it waited for the running one
    assert running.done() and running.result() == "compiled"
    assert queued.cancelled() and done.cancelled()
    pool.shutdown()
    assert bench.settle_compiles is calibrate.settle_compiles


def test_bench_and_calibration_measure_the_same_acceptance_past_an_eos(model_dir, tmp_path):
    """The calibration's acceptance and the bench's tokens per step count the same tokens: with
    the same prompts, window and shapes they are equal, also where a request's first token is EOS
    (both decode past it as an ordinary token, `calibrate.ignore_eos`, and record it). Before,
    the calibration left such rows done and measured the others only: on the demo model's
    HumanEval prompts it estimated 4.5 tokens per chain step where the bench measured 6.67."""
    import shutil

    from bole_jax.llm import LLM

    texts = ["def add(a, b):\n    return a +", "Translate to French: good", "x = [1, 2,"]
    base = LLM(model_dir)
    ids = calibrate.prompt_token_ids(base.tokenizer, texts, 64)
    first = base.generate([ids[0]], max_new_tokens=1, spec="ar")[0].token_ids[0]
    d = tmp_path / "model"  # the same model, its EOS the first greedy token of prompt 0
    shutil.copytree(model_dir, d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(conf, eos_token_id=int(first))))
    for g in d.glob("generation_config.json"):
        g.unlink()
    llm = LLM(d)
    assert llm.eos_ids == (first,)
    warm, steps = 1, 3
    table = calibrate.calibrate(
        llm, (2,), (4,), (2,), modes=("ar", "chain"), prompts=texts, steps=steps, repeats=1,
        warm=warm, progress=False,
    )  # fmt: skip
    cal = {c["mode"]: c for c in table["entries"][0]["candidates"]}["chain"]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    argv = ["bench", "--model", str(d), "--prompts-file", str(f), "--batch", "2", "--modes"]
    argv += ["chain", "--depth", "2", "--warm", str(warm), "--steps", str(steps), "--prompt-len"]
    argv += ["64", "--breakdown-batch", "0", "--no-plots", "--compile-cache", "none", "--out"]
    res = bench.run_e2e(cli.build_parser().parse_args([*argv, str(tmp_path / "b")]))
    (row,) = res["rows"]
    acc = table["acceptance"][budget.candidate_id(cal)]
    # the EOS row was decoded and counted by both, not dropped by one
    assert acc["request_steps"] == row["request_steps"] == 2 * steps
    assert acc["tokens"] == row["tokens"] and cal["tokens_per_step"] == row["tokens_per_step"]
    assert row["eos_requests"] >= 1 and cal["eos_requests"] >= 1
    assert "EOS: decoded past" in calibrate.format_table(table)


def test_measurement_prompts_and_ignore_eos(model_dir):
    """Measurement prompts lose trailing whitespace (a bare final newline reads as the end of a
    file); `ignore_eos` leaves only padding rows and full rows done; `eos_requests` counts the
    outputs that hold an EOS."""
    import types

    from bole_jax.llm import LLM

    llm = LLM(model_dir)
    tok = llm.tokenizer
    got = calibrate.prompt_token_ids(tok, ['    """\n', " \n", "x = 1\n\n"], 64)
    assert got == [tok.encode('    """'), tok.encode("x = 1")]
    assert calibrate.prompt_token_ids(tok, ["a b c d e"], 2) == [tok.encode("a b c d e")[-2:]]
    st = llm.start_batch([[3, 4, 5], [6, 7], [8]], 4)  # 3 requests in 4 rows
    st = calibrate.ignore_eos(dataclasses.replace(st, done=jnp.ones_like(st.done)))
    assert np.asarray(st.done).tolist() == [False, False, False, True]
    assert (np.asarray(st.eos) == -1).all()
    fake = types.SimpleNamespace(out=np.array([[5, 0, 3], [1, 2, 0]]), num_out=np.array([3, 2]))
    assert calibrate.eos_requests(fake, 2, (0,)) == 1
    assert calibrate.eos_requests(fake, 2, (-1,)) == 0


def test_a_synthetic_calibration_counts_no_eos(tiny):
    """The synthetic drafter decodes random prompts along forced chains: there is no text whose end
    an EOS could mark, so its table records `eos_requests` as None (as the bench does), where a
    real drafter's records a count."""
    from bole_jax.llm import LLM

    cfg, params = tiny
    llm = LLM(cfg, params=params, max_batch_size=2)
    table = calibrate.calibrate(
        llm, (2,), (4,), (2,), topk=2, modes=("ar", "chain"), accept_prob=0.5, progress=False
    )
    timed = [c for c in table["entries"][0]["candidates"] if "step_ms" in c]
    assert [c["mode"] for c in timed] == ["ar", "chain"]
    assert all(c["eos_requests"] is None for c in timed)
    table = calibrate.calibrate(llm, (2,), (4,), (2,), topk=2, modes=("ar",), progress=False)
    assert table["entries"][0]["candidates"][0]["eos_requests"] in (0, 1, 2)


def test_bench_rounds_interleave_modes_and_report_the_median(tmp_path, monkeypatch):
    """`bench --rounds 3`: every mode is timed three times, round by round in the modes' order
    (ar, chain, ar, chain, ...), the agreement measured once; each row reports its median round
    (the same windows: the same tokens), every round's step time, and its ratio to AR's in each
    round."""
    calls = []
    real = bench.timed_segment

    def spy(run, params, state, warm, steps, n):
        r, state = real(run, params, state, warm, steps, n)
        calls.append(r["step_ms"])
        return r, state

    monkeypatch.setattr(bench, "timed_segment", spy)
    argv = ["bench", "--preset", "tiny", "--dtype", "float32", "--batch", "2", "--modes", "ar"]
    argv += ["chain", "--depth", "2", "--accept-mean", "2", "--warm", "1", "--steps", "2"]
    argv += ["--rounds", "3"]
    argv += ["--breakdown-batch", "0", "--no-plots", "--compile-cache", "none"]
    res = bench.run_e2e(cli.build_parser().parse_args([*argv, "--out", str(tmp_path)]))
    assert not res["errors"], res["errors"]
    rows = {r["mode"]: r for r in res["rows"]}
    assert len(calls) == 2 * 3  # two modes, three rounds, one window each
    for m, r in rows.items():
        assert r["rounds"] == 3 and len(r["round_step_ms"]) == 3
        assert r["step_ms"] == sorted(r["round_step_ms"])[1]
        assert r["tokens_per_s"] == r["round_tokens_per_s"][r["round_step_ms"].index(r["step_ms"])]
    # interleaved: round k's windows are calls 2k (ar) and 2k + 1 (chain)
    assert rows["ar"]["round_step_ms"] == calls[0::2]
    assert rows["chain"]["round_step_ms"] == calls[1::2]
    ratios = rows["chain"]["round_speedup_vs_ar"]
    want = [
        c / a for c, a in zip(rows["chain"]["round_tokens_per_s"], rows["ar"]["round_tokens_per_s"])
    ]
    assert ratios == pytest.approx(want)
    assert rows["chain"]["ar_agreement"] == 1.0  # fp32; measured on the first round only
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert [r["round_step_ms"] for r in saved["rows"]] == [r["round_step_ms"] for r in res["rows"]]
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        bench.run_e2e(cli.build_parser().parse_args([*argv, "--rounds", "0"]))


def test_bench_prompt_sets_pool_disjoint_prompts(tmp_path):
    """`bench --prompt-sets K`: a batch of 1 decodes K different prompts (each set prefilled to the
    first set's KV capacity, so one program serves all of them) and pools them: the tokens and
    request steps are those of the same prompts decoded as one batch, and every set's speculative
    output is compared with AR on that set (fp32: identical)."""
    texts = [
        "def add(a, b):\n    return a +",
        "Translate to French: good morning, how are you today?",
        "x = [1,",
        "unused",
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    import bole_jax

    demo = str(Path(bole_jax.__file__).parent / "default_model")  # a trained drafter
    argv = ["bench", "--model", demo, "--prompts-file", str(f), "--modes", "ar"]
    argv += ["chain", "--depth", "2", "--warm", "1", "--steps", "3", "--breakdown-batch", "0"]
    argv += ["--no-plots", "--compile-cache", "none", "--dtype", "float32"]

    def rows(extra, out):
        res = bench.run_e2e(cli.build_parser().parse_args([*argv, *extra, "--out", out]))
        assert not res["errors"], res["errors"]
        return {r["mode"]: r for r in res["rows"]}

    pooled = rows(["--batch", "1", "--prompt-sets", "3", "--rounds", "2"], str(tmp_path / "a"))
    batch3 = rows(["--batch", "3"], str(tmp_path / "b"))
    for m in ("ar", "chain"):
        r = pooled[m]
        assert r["prompt_sets"] == 3 and len(r["set_tokens_per_step"]) == 3
        assert r["rounds"] == 2 and len(r["round_step_ms"]) == 2  # every set in every round
        assert r["request_steps"] == batch3[m]["request_steps"] == 3 * 3
        assert r["tokens"] == batch3[m]["tokens"]
    assert pooled["chain"]["ar_agreement"] == 1.0
    assert pooled["chain"]["ar_agreement_ci95"] == [1.0, 1.0]
    assert pooled["chain"]["ar_diverged_requests"] == [0, 3]
    # three prompts, three different acceptances: pooled, not the first one's
    assert len(set(pooled["chain"]["set_tokens_per_step"])) > 1
    assert bench.prompt_sets([[1], [2], [3]], 2, 4) == [[[1], [2]]]  # whole sets only
    assert bench.prompt_sets([[1]], 2, 1) == [[[1], [1]]]  # fewer prompts than the batch: cycled
    with pytest.raises(ValueError, match="--prompt-sets goes with --model"):
        bench.run_e2e(
            cli.build_parser().parse_args(["bench", "--preset", "tiny", "--prompt-sets", "2"])
        )


def test_agreement_interval_covers_the_mean_and_narrows_with_requests():
    """The bootstrap interval of the pooled greedy agreement: zero width where every request
    agrees alike, around the mean otherwise, narrower with more requests."""
    from bole_jax.measure import bench

    assert bench.agreement_interval([1.0] * 5) == [1.0, 1.0]
    assert all(np.isnan(bench.agreement_interval([])))
    few = [1.0, 1.0, 0.2, 1.0, 0.5, 1.0, 1.0, 0.9]
    lo, hi = bench.agreement_interval(few)
    assert lo < np.mean(few) < hi <= 1.0
    lo2, hi2 = bench.agreement_interval(few * 20)
    assert lo < lo2 < np.mean(few) < hi2 < hi


def _context_table_entries():
    """Batch 1 at the calibration's own context (kv 64): the chain wins; the same bucket timed
    with every request's KV filled to 1024 tokens: ar wins (the drafter's and the verify's
    attention read the whole context)."""
    return [
        dict(
            batch=1,
            kv=64,
            candidates=[cand("ar", 1, 1.0), cand("chain", 3, 1.5, depth=2)],
        ),
        dict(
            batch=1,
            kv=1024,
            context=1024,
            candidates=[cand("ar", 1, 2.0), cand("chain", 3, 6.0, depth=2)],
        ),
    ]


def test_choose_at_the_kv_bucket_of_a_filled_context(tiny):
    """budget.choose(kv=...) takes the smallest KV bucket >= kv among every entry (filled contexts
    included), else the largest; kv=None keeps the calibration's own context, as before tables
    had filled-context entries."""
    cfg, params = tiny
    t = hand_table(cfg, params["embed"].dtype, _context_table_entries(), {"chain d=2": 2.0})
    mode = lambda kv: budget.choose(t, 1, kv).mode  # noqa: E731
    assert mode(None) == "chain" and mode(64) == "chain" and mode(10) == "chain"
    assert mode(65) == "ar" and mode(1024) == "ar" and mode(1 << 20) == "ar"
    assert calibrate._with_choices(t)["entries"][1]["choice"]["mode"] == "ar"
    # the filled entry is shown as such
    assert "1 @1024" in calibrate.format_table(t)


def test_engine_chooses_at_the_context_it_decodes_at(tiny, tmp_path, monkeypatch):
    """generate() looks the mode up at the KV capacity of its longest request (prompt +
    max_new_tokens), the server at its --max-context: the chain for short requests, ar where the
    table's filled-context entry says the chain loses. Greedy output is AR's either way."""
    from bole_jax.llm import LLM
    from bole_jax.serving.scheduler import Scheduler

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    llm = LLM(cfg, params=params, max_batch_size=1)
    calibrate.store(
        hand_table(
            cfg,
            params["embed"].dtype,
            _context_table_entries(),
            {"chain d=2": 2.0},
            identity=budget.llm_identity(llm),
        )
    )
    llm = LLM(cfg, params=params, max_batch_size=1)
    assert calibrate.decode_mode(llm, None, 1) == "chain"
    assert calibrate.decode_mode(llm, None, 1, kv=512) == "ar"
    short, long_ = [3, 5, 7], list(range(1, 41))
    (s,) = llm.generate([short], max_new_tokens=6)  # capacity 64: the own context
    assert s.stats["mode"] == "chain"
    (lo,) = llm.generate([long_], max_new_tokens=30)  # 40 + 30 tokens: KV bucket 1024
    assert lo.stats["mode"] == "ar"
    (ref,) = LLM(cfg, params=params).generate([short], max_new_tokens=6, spec="ar")
    assert s.token_ids == ref.token_ids
    assert Scheduler(llm, max_batch=1, max_context=48).mode == "chain"
    assert Scheduler(llm, max_batch=1, max_context=200).mode == "ar"


def test_a_context_far_beyond_the_table_names_the_command_that_times_it(tiny, tmp_path, caplog):
    """A batch decoding at 8x or more of the largest KV capacity its table timed gets one notice
    naming `calibrate --context` at that capacity; nearer contexts and repeats get none, nor do
    tables that timed the context."""
    cfg, params = tiny
    dtype = params["embed"].dtype
    short = hand_table(cfg, dtype, [_context_table_entries()[0]], {"chain d=2": 2.0})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(short))

    def notes(kv, table_path=path):
        seen = len(caplog.records)
        budget.choice_for(cfg, dtype, 1, calibration=table_path, kv=kv, mode=None, command="CMD")
        return [r.message for r in caplog.records[seen:] if "--context" in r.message]

    budget._warned.clear()
    with caplog.at_level(logging.WARNING, logger="bole_jax"):
        assert notes(None) == [] and notes(256) == []  # the table timed KV 64: 256 is 4x
        (msg,) = notes(600)
        assert "up to 64 tokens" in msg and "`CMD --context 1024`" in msg
        assert notes(600) == [] and notes(1024) == []  # once per capacity bucket
        assert len(notes(5000)) == 1
        both = tmp_path / "both.json"
        both.write_text(json.dumps(hand_table(cfg, dtype, _context_table_entries(), {})))
        assert notes(5000, both) == []  # timed at 1024: 5000 is under 8x
        # in-memory weights (no folder to name): the API call with its keyword
        seen = len(caplog.records)
        budget.choice_for(
            cfg, dtype, 1, calibration=path, kv=20000, mode=None, command="LLM(...).calibrate()"
        )
        (msg,) = [r.message for r in caplog.records[seen:] if "32768" in r.message]
        assert "`LLM(...).calibrate(contexts=[32768])`" in msg


def test_engine_takes_the_tree_shape_at_the_context_it_decodes_at(tiny, tmp_path, monkeypatch):
    """Where the table's best bole shape differs between its own context (a tree of 4 nodes) and
    a filled long context (the bole chain, 3 nodes), generate() and the server decode the shape of
    the KV bucket they run at, not the short context's; greedy output is AR's either way."""
    from bole_jax.llm import LLM
    from bole_jax.serving.scheduler import Scheduler

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    tree, chain = cand("bole", 4, 1.0, depth=2, topk=2), cand("bole", 3, 1.0, depth=2, topk=1)
    entries = [
        dict(batch=1, kv=64, candidates=[cand("ar", 1, 1.0), {**tree, "step_ms": 1.0}, chain]),
        dict(
            batch=1,
            kv=1024,
            context=1024,
            candidates=[cand("ar", 1, 2.0), {**tree, "step_ms": 4.0}, {**chain, "step_ms": 2.0}],
        ),
    ]
    acceptance = {"bole N=4 d=2 k=2": 2.5, "bole N=3 d=2 k=1": 2.0}
    llm = LLM(cfg, params=params, max_batch_size=1)
    calibrate.store(
        hand_table(
            cfg, params["embed"].dtype, entries, acceptance, identity=budget.llm_identity(llm)
        )
    )
    llm = LLM(cfg, params=params, max_batch_size=1)
    short, long_ = [3, 5, 7], list(range(1, 41))
    (s,) = llm.generate([short], max_new_tokens=6)  # KV bucket 64: the tree
    (lo,) = llm.generate([long_], max_new_tokens=30)  # 40 + 30 tokens: KV bucket 1024
    assert s.stats["mode"] == lo.stats["mode"] == "bole"
    assert (s.stats["tree"]["nodes"], s.stats["tree"]["topk"]) == (4, 2)
    assert (lo.stats["tree"]["nodes"], lo.stats["tree"]["topk"]) == (3, 1)
    ar = LLM(cfg, params=params)
    for out, p, n in ((s, short, 6), (lo, long_, 30)):
        (ref,) = ar.generate([p], max_new_tokens=n, spec="ar")
        assert out.token_ids == ref.token_ids and ref.stats["tree"] is None
    assert Scheduler(llm, max_batch=1, max_context=48).spec.shape.topk == 2
    assert Scheduler(llm, max_batch=1, max_context=200).spec.shape.topk == 1
    # capacities that resolve to one configuration share one jit (no recompiles across lengths)
    seg = llm.segment_fn
    assert seg("bole", 1, 256) is seg("bole", 1, 1024) is not seg("bole", 1, 64)


def test_calibration_times_filled_contexts(tiny, monkeypatch):
    """calibrate(contexts=[L]): every batch bucket is also timed with each request's KV cache
    filled to L tokens (entry `context`, kv = L; its caches wait in host memory for their turn);
    the acceptance is pooled over the own-context runs only (the filler is not text); a context
    not above the own KV capacity is refused before anything runs."""
    from bole_jax.llm import LLM

    parked = []
    park = calibrate.park_on_host

    def park_forced(trees):  # on a CPU backend parking is skipped unless forced
        parked.append(len(trees))
        return park(trees, force=True)

    monkeypatch.setattr(calibrate, "park_on_host", park_forced)
    cfg, params = tiny
    llm = LLM(cfg, params=params, max_batch_size=1)
    kw = dict(modes=("ar", "bole"), steps=2, repeats=1, warm=0, progress=False, topk=2)
    with pytest.raises(ValueError, match="not above the calibration's own KV capacity"):
        calibrate.calibrate(llm, [1], [4], [2], contexts=[64], **kw)
    with pytest.raises(ValueError, match="powers of two"):
        calibrate.calibrate(llm, [1], [4], [2], contexts=[300], **kw)
    t = calibrate.calibrate(llm, [1], [4], [2], contexts=[256], **kw)
    own, filled = t["entries"]
    assert own.get("context") is None and own["kv"] < 256
    assert (filled["context"], filled["kv"], filled["batch"]) == (256, 256, 1)
    assert all(c.get("step_ms", 0) > 0 for e in (own, filled) for c in e["candidates"])
    # 1 request x 2 steps per configuration: the own context's run alone
    assert t["acceptance"] and all(a["request_steps"] == 2 for a in t["acceptance"].values())
    assert t["contexts"] == [256] and parked == [1]  # the filled bucket only
    # Each candidate of the filled bucket is put on the device from the host copy: never the
    # shared base and a candidate's copy at once (at 9B dims, 64 x 16k tokens, two copies of the
    # KV ran an H100 out of memory). An out-of-memory there, ar's included, is recorded.
    unparked = []
    unpark = calibrate.unpark
    monkeypatch.setattr(calibrate, "unpark", lambda p: unparked.append(1) or unpark(p))
    timed = calibrate.timed_segment

    def oom_when_filled(run, params, state, *args):
        if state.cache.capacity == 256:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return timed(run, params, state, *args)

    monkeypatch.setattr(calibrate, "timed_segment", oom_when_filled)
    t = calibrate.calibrate(llm, [1], [4], [2], contexts=[256], **kw)
    own, filled = t["entries"]
    assert len(unparked) == len(filled["candidates"]) == 3  # ar, the bole chain, the tree
    assert all(c["note"] == "out of memory" for c in filled["candidates"])
    assert all(c.get("step_ms", 0) > 0 for c in own["candidates"])
    assert budget.choose(t, 1, 256) is None and budget.choose(t, 1, 64) is not None
    # the same where the prefill stays on the device (no CPU backend to park it on)
    monkeypatch.setattr(calibrate, "park_on_host", lambda trees: {})
    own, filled = calibrate.calibrate(llm, [1], [4], [2], contexts=[256], **kw)["entries"]
    assert all(c["note"] == "out of memory" for c in filled["candidates"])


def test_server_takes_the_choice_of_the_batch_its_memory_admits(tiny, tmp_path, monkeypatch):
    """Where the memory plan admits fewer slots than --max-batch in a smaller batch bucket, the
    server's tree shape (and mode) is the table's at that bucket (a 4-node tree at 8 rows, the
    3-node bole chain at 2 here): looked up at --max-batch only, a server running 2 slots would
    verify the 8-row bucket's tree."""
    from bole_jax.llm import LLM
    from bole_jax.serving.scheduler import Scheduler

    cfg, params = tiny
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
    tree, chain = cand("bole", 4, 1.0, depth=2, topk=2), cand("bole", 3, 1.0, depth=2, topk=1)
    entries = [
        dict(batch=2, kv=128, candidates=[cand("ar", 1, 1.0), {**tree, "step_ms": 3.0}, chain]),
        dict(batch=8, kv=128, candidates=[cand("ar", 1, 1.0), tree, {**chain, "step_ms": 3.0}]),
    ]
    llm = LLM(cfg, params=params)
    acceptance = {"bole N=4 d=2 k=2": 2.5, "bole N=3 d=2 k=1": 2.4}
    table = hand_table(
        cfg, params["embed"].dtype, entries, acceptance, identity=budget.llm_identity(llm)
    )
    calibrate.store(table)
    llm = LLM(cfg, params=params)
    kw = dict(max_batch=8, max_context=1000, prefix_cache_gb=0)
    wide = Scheduler(llm, **kw)  # no memory cap: 8 slots, the 8-row bucket's tree
    assert (wide.num_slots, wide.mode, wide.spec.shape.num_nodes) == (8, "bole", 4)
    row = sum(wide.slot_bytes.values())
    # 2 slots of the 4-node tree (one more request's worth is kept back for the prefill)
    gb = 3.5 * row / 2**30
    sched = Scheduler(llm, memory_gb=gb, **kw)
    assert (sched.mode, sched.spec.shape.num_nodes, sched.spec.shape.topk) == ("bole", 3, 1)
    assert sched._spec_batch == sched.num_slots == 2
    # Where the smaller bucket's choice does not fit the memory at all (a tree, whose drafter
    # cache doubles this model's KV, where AR admits 2 slots), the first choice stays.
    entries = [
        dict(batch=2, kv=128, candidates=[cand("ar", 1, 1.0), chain]),
        dict(batch=8, kv=128, candidates=[cand("ar", 1, 1.0), {**chain, "step_ms": 9.0}]),
    ]
    path = tmp_path / "t.json"
    calibrate.save_table(
        hand_table(cfg, params["embed"].dtype, entries, acceptance, identity=table["identity"]),
        path,
    )
    llm = LLM(cfg, params=params, spec_options=dict(calibration=str(path)))
    ar_row = sum(Scheduler(llm, mode="ar", **kw).slot_bytes.values())
    gb = 3.5 * ar_row / 2**30
    assert Scheduler(llm, mode="ar", memory_gb=gb, **kw).num_slots == 2
    assert budget.choose(budget.load_table(path), 2).mode == "bole"
    kept = Scheduler(llm, memory_gb=gb, **kw)
    assert (kept.mode, kept.spec, kept._spec_batch, kept.num_slots) == ("ar", None, 8, 2)
