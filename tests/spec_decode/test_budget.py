"""Batch-wide verification budget: selector invariants, the calibration table and its lookup, and
the end-to-end benchmark on CPU with the tiny preset (which also checks that every mode stays
lossless against AR with a binding budget)."""

import dataclasses
import json
import logging
import re

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
  items = sorted((-float(scores[r, i]), r, i) for r in range(b) for i in range(m)
                 if active[r] and np.isfinite(scores[r, i]))
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
    (1, 5, 3, 4, 0.0, 0.0, 8), (4, 20, 3, 4, 0.0, 0.0, 8), (4, 20, 3, 4, 0.5, 0.0, 8),
    (6, 40, 4, 3, 0.3, 0.1, 15), (5, 3, 2, 5, 0.0, 0.0, 6), (8, 200, 3, 4, 0.2, 0.0, 7),
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
  caps = (np.full(b, cap, np.int32) if cap != "room" else rng.integers(0, 6, b).astype(np.int32))
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
  t = FROM_POOL(jnp.zeros(b, jnp.int32), jnp.asarray(tokens), jnp.asarray(parents),
                jnp.asarray(scores), jnp.asarray(got), n)
  tok, par, num = np.asarray(t.tokens), np.asarray(t.parents), np.asarray(t.num_nodes)
  np.testing.assert_array_equal(num, 1 + got)
  for r in range(b):
    pool_idx = tok[r, 1:num[r]] - 1
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


@pytest.fixture(scope="module")
def table(tiny):
  return calibrate.calibrate(tiny, [2], [1, 4], [64], eps=0.1, repeats=2, workers=2,
                          progress=False)


def test_calibration_table(table, tiny, tmp_path):
  cfg, params = tiny
  assert table["format"] == budget.TABLE_FORMAT and table["device"] == jax.devices()[0].device_kind
  assert table["jax"] == jax.__version__ and table["model"] == budget.model_signature(
      cfg, params["embed"].dtype)
  (e,) = table["entries"]
  assert (e["batch"], e["kv"]) == (2, 64) and e["t_dec_ms"] > 0
  assert e["nodes"] in (1, 4) and e["budget"] == 2 * e["nodes"]
  for n, t in e["t_ver_ms"].items():
    assert t > 0 and e["ratio"][n] == pytest.approx(t / e["t_dec_ms"])
  text = calibrate.format_table(table)
  assert "T_dec" in text and "N=4" in text
  path = calibrate.save_table(table, tmp_path / "t.json")
  assert budget.load_table(path) == json.loads(json.dumps(table))
  # Calibrating in several runs: entries of other buckets are kept, re-measured ones replaced.
  other = json.loads(json.dumps(table))
  other["entries"] = [dict(e, batch=8, budget=8 * e["nodes"]), dict(e, t_dec_ms=-1.0)]
  other["batch_buckets"] = [2, 8]
  merged = calibrate.merge_tables(other, table)
  assert [(x["batch"], x["t_dec_ms"]) for x in merged["entries"]] == [(2, e["t_dec_ms"]),
                                                                     (8, e["t_dec_ms"])]
  assert merged["batch_buckets"] == [2, 8]
  with pytest.raises(ValueError, match="differ in eps"):
    calibrate.merge_tables(dict(other, eps=0.5), table)


def test_choice_rule_and_lookup():
  t_ver = {1: 1.0, 2: 1.05, 4: 1.08, 8: 1.3, 16: 2.0}
  e = calibrate._entry(4, 1024, 900, 1.0, t_ver, {}, 0.1, list(t_ver))
  assert (e["nodes"], e["budget"], e["within_eps"]) == (4, 16, True)
  # A fixed tree-path overhead: nothing within eps of T_dec, the knee is taken instead.
  e = calibrate._entry(4, 1024, 900, 0.8, t_ver, {}, 0.1, list(t_ver))
  assert (e["nodes"], e["within_eps"]) == (4, False)
  table = dict(entries=[dict(batch=b, kv=s, nodes=n, budget=b * n)
                        for b, s, n in [(1, 512, 64), (4, 512, 32), (16, 512, 8),
                                        (1, 4096, 32), (4, 4096, 16), (16, 4096, 4)]])
  assert budget.choose(table, 1, 300).num_nodes == 64
  assert budget.choose(table, 3, 300) == budget.BudgetChoice(32, 128, "table")
  assert budget.choose(table, 64, 300).num_nodes == 8  # beyond the last bucket: the last
  assert budget.choose(table, 4).num_nodes == 16  # no KV length: the largest (conservative)
  assert budget.choose(table, 16, 2000).num_nodes == 4
  assert [budget.default_choice(b).num_nodes for b in (1, 4, 16, 32, 64, 256)] == [
      64, 64, 16, 8, 4, 4]


def test_engine_finds_table_or_warns_once(table, tiny, tmp_path, monkeypatch, caplog):
  cfg, params = tiny
  dtype = params["embed"].dtype
  monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "cache"))
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  calibrate.save_table(table, model_dir / budget.CALIBRATION_FILE)
  want = dict(topk=4, num_nodes=table["entries"][0]["nodes"],
              budget=table["entries"][0]["budget"])
  assert budget.resolve_spec_options(cfg, {"topk": 4}, param_dtype=dtype, batch=2,
                                     model_dir=model_dir) == want
  # An explicit path; explicit num_nodes / budget win over any table.
  assert budget.resolve_spec_options(cfg, {"calibration": model_dir / budget.CALIBRATION_FILE,
                                           "topk": 4}, param_dtype=dtype, batch=2) == want
  assert budget.resolve_spec_options(cfg, {"num_nodes": 7}, param_dtype=dtype,
                                     batch=2, model_dir=model_dir) == {"num_nodes": 7}
  # The user cache is searched too.
  calibrate.save_table(table, budget.default_table_dir() / "tiny.json")
  assert budget.choice_for(cfg, dtype, 2).num_nodes == want["num_nodes"]
  # Other model dims: no match -> the safe default, with one warning.
  other = ModelConfig.tiny("qwen3_next", mtp_num_layers=1, hidden_size=32)
  budget._warned.clear()
  with caplog.at_level(logging.WARNING, logger="bole_jax"):
    for _ in range(3):
      c = budget.choice_for(other, dtype, 16, model_dir=model_dir)
  assert c == budget.default_choice(16) and c.source == "default"
  warnings = [r for r in caplog.records if "no calibration table" in r.message]
  assert len(warnings) == 1 and "model dims differ" in warnings[0].message
  # A table from before tensor parallelism (no "tp" in its model dims) is a single-device one.
  old = {**table, "model": {k: v for k, v in table["model"].items() if k != "tp"}}
  assert budget.table_mismatch(old, cfg, dtype) is None
  assert budget.table_mismatch(old, dataclasses.replace(cfg, tp=2), dtype) == \
      "model dims differ (tp)"
  with pytest.raises(FileNotFoundError, match="calibration table not found"):
    budget.choice_for(cfg, dtype, 2, calibration=tmp_path / "missing.json")
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="not a calibration table"):
    budget.load_table(tmp_path / "bad.json")


def test_calibrate_rejects_bad_buckets(tiny):
  with pytest.raises(ValueError, match="positive integers"):
    calibrate.calibrate(tiny, [0, 2], [1], [64])
  with pytest.raises(ValueError, match="at most 128 nodes"):
    calibrate.calibrate(tiny, [1], [256], [1024])
  with pytest.raises(ValueError, match="leave no room"):
    calibrate.calibrate(tiny, [1], [64], [32])
  with pytest.raises(ValueError, match="at least one"):
    calibrate.calibrate(tiny, [], [1], [64])


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
  tree = tree_mod.Tree(tokens=jnp.zeros((1, n), jnp.int32), parents=jnp.arange(n)[None] - 1,
                       depth=jnp.arange(n)[None], num_nodes=jnp.full((1,), n),
                       score=jnp.zeros((1, n)))
  for mode in ("bole", "pernode", "chain"):
    auxs = jax.eval_shape(lambda p, c: verify.verify_forward(p, cfg, tree, c, mode=mode)[2],
                          params, init_cache(cfg, 1, 64, jnp.float32))
    m = bench.memory_per_request(cfg, mode, n, 64, jnp.float32)
    assert bench.tree_bytes(auxs) == pytest.approx((m["verify_state_mib"] + m["verify_conv_mib"])
                                                   * bench.MiB)


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


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "nope"], "unknown preset"),
    (["--preset", "tiny", "--batch", "0"], "--batch"),
    (["--preset", "tiny", "--nodes", "500"], "at most|above 128"),
    (["--preset", "tiny", "--budget", "lots"], "--budget"),
    (["--model", "/nonexistent"], "--prompts-file"),
    (["--model", "/nonexistent", "--prompts-file", "p.jsonl"], "not found"),
])
def test_bench_cli_errors(argv, msg, capsys):
  assert cli.main(["bench", "--compile-cache", "none", *argv]) == 2
  assert re.search(msg, capsys.readouterr().err)


def test_bench_e2e_tiny(tmp_path):
  """The whole benchmark on CPU: 4 modes side by side, a binding budget, the breakdown."""
  args = cli.build_parser().parse_args([
      "bench", "--preset", "tiny", "--dtype", "float32", "--batch", "2", "--quick",
      "--compile-cache", "none", "--compile-workers", "2", "--depth", "2", "--topk", "2",
      "--nodes", "4", "--budget", "5", "--accept-mean", "2.5", "--breakdown-batch", "2",
      "--breakdown-modes", "bole", "--out", str(tmp_path)])
  res = bench.run_e2e(args)
  assert res["errors"] == [] and res["skipped"] == []
  rows = {r["mode"]: r for r in res["rows"]}
  assert set(rows) == {"ar", "bole", "pernode", "chain"}
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
  assert len(saved["rows"]) == 4


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
  assert [x.sharding for x in jax.tree.leaves(back)] == [x.sharding for x in jax.tree.leaves(tree)]
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
        float(np.sort(lg)[-1] - np.sort(lg)[-2]))


def test_divergence_info_ranks_both_tokens():
  lg = np.asarray([0.5, 3.0, 2.2, -1.0, 2.9], np.float32)
  info = bench.divergence_info(lg, ar_token=4, token=1)
  assert info["token_rank"] == 0 and info["token_deficit"] == 0.0
  assert info["ar_token_rank"] == 1 and info["ar_token_deficit"] == pytest.approx(0.1)
  assert info["top2_gap"] == pytest.approx(0.1)
  assert bench.divergence_info(lg, ar_token=1, token=3)["token_rank"] == 4
