"""The memory plan against what the engine really allocates, on the tiny model (CPU).

`slot_bytes` estimates a decode slot by part; here its persistent parts are compared with the
arrays of a scheduler's running decode state, leaf by leaf, in every mode (and both lazy bole
layouts, and with logprobs recorded), and its step transient with the verify outputs a decode step
produces (`jax.eval_shape` of the step) and with the compiled segment's temporary memory. Then
the per-mode plan (start-up table, /metrics), the errors for what can never fit, and admission
bounded by the slots.
"""

import dataclasses
import functools
import http.client
import json
import re

import jax
import jax.numpy as jnp
import pytest

from bole_jax import LLM
from bole_jax.model.cache import AttnCache, GDNCache
from bole_jax.model.config import KernelOptions
from bole_jax.serving.memory import (
    MODES,
    PER_ROW_SCALARS,
    FixedStats,
    format_plan_table,
    kv_capacity,
    plan_by_mode,
    slot_bytes,
    split_transient,
)
from bole_jax.serving.requests import RequestParams
from bole_jax.serving.scheduler import Scheduler, _shared_fields_cleared
from bole_jax.serving.server import OpenAIServer, build_server
from bole_jax.spec_decode import loop, verify
from bole_jax.spec_decode import step as step_mod

MAX_CONTEXT = 64
TREE = dict(num_nodes=16, depth=4)  # a small tree: 16 verified nodes, paths of 5
SLOTS = 2

# (mode, LLM options, Scheduler options): every mode, both lazy bole layouts, logprobs.
CASES = {
    "ar": ("ar", {}, {}),
    "ar-logprobs": ("ar", {}, dict(max_logprobs=3)),
    "chain": ("chain", {}, {}),
    "pernode": ("pernode", {}, {}),
    "bole": ("bole", {}, dict(max_logprobs=2)),
    "bole-lazy-path": ("bole", dict(lazy_commit=True), {}),
    "bole-lazy-gather": ("bole", dict(lazy_commit=True, lazy_rows="gather"), {}),
}


@pytest.fixture(scope="module")
def llms(model_dir):
    made = {}

    def get(opts):
        opts = dict(opts)
        rows = opts.pop("lazy_rows", None)
        key = (tuple(sorted(opts.items())), rows)
        if key not in made:
            kernels = None if rows is None else KernelOptions(lazy_rows=rows)
            made[key] = LLM(model_dir, spec_options={**TREE, **opts}, kernel_options=kernels)
        return made[key]

    return get


@pytest.fixture(scope="module")
def engines(llms):
    """case -> a scheduler of SLOTS slots with its running state built (no engine thread)."""
    made = {}

    def get(case):
        if case not in made:
            mode, llm_opts, kw = CASES[case]
            s = Scheduler(
                llms(llm_opts),
                mode=mode,
                max_batch=SLOTS,
                max_context=MAX_CONTEXT,
                segment_steps=4,
                prefix_cache_gb=0,
                **kw,
            )
            s._ensure_state()
            made[case] = s
        return made[case]

    return get


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _state_by_part(state) -> dict[str, int]:
    """The running state's bytes in slot_bytes' parts (the shared PRNG key and EOS ids left out)."""
    state = _shared_fields_cleared(state)
    kv = sum(_nbytes(c) for c in state.cache.layers if isinstance(c, AttnCache))
    gdn = sum(_nbytes(c) for c in state.cache.layers if isinstance(c, GDNCache))
    drafter = _nbytes(state.extra)
    rest = _nbytes(dataclasses.replace(state, cache=None, extra=None)) + _nbytes(
        state.cache.lengths
    )
    assert kv + gdn + drafter + rest == _nbytes(state)
    return dict(attention_kv=kv, gdn_state=gdn, drafter=drafter, output=rest)


@pytest.mark.parametrize("case", list(CASES))
def test_persistent_parts_are_the_running_state(engines, case):
    """KV, GDN states (with any pending commit) and the drafter: exactly the running state's
    arrays; output: the out rows (and logprobs) exactly, per-row scalars within their bound."""
    s = engines(case)
    assert s.num_slots == SLOTS
    got = _state_by_part(s._state)
    est = s.slot_bytes
    assert s.state_bytes == sum(got.values())
    for part in ("attention_kv", "gdn_state", "drafter"):
        assert est.get(part, 0) * SLOTS == got[part], part
    assert 0 <= est["output"] * SLOTS - got["output"] <= PER_ROW_SCALARS * SLOTS
    # The layout the case is about is really there (a test of the cases, not of the estimate).
    gdn = next(c for c in s._state.cache.layers if isinstance(c, GDNCache))
    lazy = CASES[case][1].get("lazy_commit", False)
    assert (gdn.pending is not None) == lazy
    assert (s._state.logprobs is not None) == ("max_logprobs" in CASES[case][2])


def _verify_outputs(s) -> int:
    """Bytes of what one decode step of `s` keeps alive until its acceptance: the target's logits
    and every GDN layer's verify outputs, as the step's own trace produces them."""
    seen = []
    llm, cfg = s.llm, s.llm.cfg

    def logits(*a, **k):
        out = real_logits(*a, **k)
        seen.append(out)
        return out

    def verify_forward(*a, **k):
        hidden, cache, auxs = real_verify(*a, **k)
        seen.append(auxs)
        return hidden, cache, auxs

    real_logits, real_verify = verify.lm_logits, verify.verify_forward
    with pytest.MonkeyPatch.context() as mp:
        if s.spec is None:
            mp.setattr(loop, "lm_logits", logits)
            fn = functools.partial(loop.ar_step, cfg=cfg)
        else:
            mp.setattr(verify, "lm_logits", logits)
            mp.setattr(verify, "verify_forward", verify_forward)
            fn = functools.partial(step_mod.spec_step, cfg=cfg, spec=s.spec)
        jax.eval_shape(fn, llm.params, s._state)
    assert len(seen) == (1 if s.spec is None else 2)
    return _nbytes(seen)


@pytest.mark.parametrize("case", ["ar", "chain", "pernode", "bole-lazy-path", "bole-lazy-gather"])
def test_step_transient_is_what_the_verify_produces(engines, case):
    s = engines(case)
    assert s.slot_bytes["step_transient"] * SLOTS == _verify_outputs(s)


def test_step_transient_of_the_compiled_segment(engines):
    """The compiled decode segment's temporary memory grows per slot by at least the estimate (the
    logits and the verify outputs are alive together), and pernode's more than bole's (one full
    state per node against token-level factors), as estimated."""

    def temp_per_slot(s):
        temps = []
        for b in (1, 2):
            state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype),
                _shared_fields_cleared(s._state),
            )
            state = dataclasses.replace(state, key=s._state.key, eos=s._state.eos)
            seg = s.llm.segment_fn(s.mode, SLOTS)
            ma = seg.lower(s.llm.params, state, jnp.int32(4)).compile().memory_analysis()
            temps.append(ma.temp_size_in_bytes)
        return temps[1] - temps[0]

    got = {case: temp_per_slot(engines(case)) for case in ("ar", "pernode", "bole-lazy-path")}
    est = {case: engines(case).slot_bytes["step_transient"] for case in got}
    for case in got:
        assert got[case] >= est[case], (case, got, est)
    assert est["pernode"] > est["bole-lazy-path"] and got["pernode"] > got["bole-lazy-path"]


@pytest.mark.parametrize("mode", ["ar", "pernode", "bole"])
def test_compiled_segment_does_not_copy_the_kv_cache(llms, mode):
    """The compiled decode segment's temporaries grow with the KV capacity by far less than the
    KV cache itself: attention reads the cache in its stored (heads-major) layout. A slot-major
    cache made XLA copy every layer's K and V to heads-major each step: on this model the
    temporaries grew by 0.96x the KV's growth (ar) and 0.79x (pernode, bole); heads-major, 0 and
    0.12 (the tree's attention scores)."""
    temps, kvs = [], []
    for context in (256, 1024):
        s = Scheduler(llms({}), mode=mode, max_batch=SLOTS, max_context=context, prefix_cache_gb=0)
        s._ensure_state()
        temps.append(s.step_memory["compiled_temp_bytes"])
        state = s._state
        kvs.append(sum(_nbytes(c) for c in state.cache.layers if isinstance(c, AttnCache)))
        kvs[-1] += 0 if state.extra is None else _nbytes(state.extra.kv)  # the MTP head's
    growth = (temps[1] - temps[0]) / (kvs[1] - kvs[0])
    assert growth < 0.3, (mode, temps, kvs, growth)


# ------------------------------------------------------------------ the plan per mode
def test_plan_by_mode_fits_every_mode_in_the_same_memory(engines):
    s = engines("bole-lazy-path")
    plans = s.plans
    assert tuple(plans) == MODES
    assert plans["bole"].slot_bytes == s.slot_bytes and plans["bole"].plan == s.memory
    assert plans["pernode"].capacity == plans["bole"].capacity == s.capacity  # the same tree
    assert plans["ar"].capacity == kv_capacity(MAX_CONTEXT)
    assert plans["ar"].slot_bytes == slot_bytes(
        s.llm.cfg, kv_capacity(MAX_CONTEXT), MAX_CONTEXT, None, s.dtype
    )
    # A cap that holds 3 bole slots (2 + the prefill's): every mode planned in it.
    per = {m: p.per_slot for m, p in plans.items()}
    assert per["pernode"] > per["bole"] > per["ar"]
    cap = 4 * per["bole"] - 1
    llm = s.llm
    specs = s._mode_specs(SLOTS)
    plans = plan_by_mode(
        llm.cfg, MAX_CONTEXT, specs, s.dtype, 8, memory_gb=cap / 2**30, prefix_cache_gb=0
    )
    for m, p in plans.items():
        fit = cap // per[m] - 1
        assert p.fit_slots == fit and p.num_slots == min(8, fit), m
        assert (p.plan is None) == (fit < 1)
    assert plans["bole"].fit_slots == 2 and plans["ar"].fit_slots > plans["bole"].fit_slots
    if plans["pernode"].plan is None:
        assert "not enough device memory for one decode slot" in plans["pernode"].error
    table = format_plan_table(plans, "bole")
    lines = table.splitlines()
    assert "usable" in lines[0] and lines[1].split()[-1] == "fit"
    rows = {line[2:].split()[0]: line for line in lines[2:]}
    assert set(rows) == set(MODES)
    assert rows["bole"].startswith("* bole") and rows["ar"].startswith("  ar")
    assert rows["bole"].split()[-2:] == ["2", "2"]
    # Unknown usable memory (CPU, no cap): every mode gets --max-batch slots, no fit column.
    table = format_plan_table(s.plans, "bole")
    assert "usable memory unknown" in table and "fit" not in table.splitlines()[1]


def test_serve_prints_the_plan_per_mode(llms, monkeypatch, capsys):
    from bole_jax.serving import server as server_mod

    monkeypatch.setattr(OpenAIServer, "serve_forever", lambda self, on_ready=None: self.shutdown())
    server_mod.serve(llm=llms({}), spec="pernode", port=0, max_batch=2, max_context=MAX_CONTEXT)
    out = capsys.readouterr().out.splitlines()
    assert "(mode pernode, 2 slots" in out[0]
    assert (
        out[1] == "bole-jax: memory plan per mode (MiB per slot, slots at the same max context; "
        "usable memory unknown):"
    )
    rows = [line.removeprefix("bole-jax: ") for line in out[3:7]]
    assert [r[:2] + r[2:].split()[0] for r in rows] == ["  ar", "  chain", "* pernode", "  bole"]


def _metrics_text(s) -> str:
    """/metrics' text for scheduler s."""
    from prometheus_client import CollectorRegistry, generate_latest

    from bole_jax.serving.metrics import EngineCollector

    reg = CollectorRegistry()
    reg.register(EngineCollector(s))
    return generate_latest(reg).decode()


def _metric(text, name, **labels):
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pat = rf"^{name}{{{lab}}} ([-+0-9.eE]+)$" if labels else rf"^{name} ([-+0-9.eE]+)$"
    m = re.search(pat, text, re.M)
    assert m, (name, labels)
    return float(m.group(1))


def test_metrics_export_the_plan(llms):
    llm = llms({})
    per_bole = sum(
        slot_bytes(
            llm.cfg,
            kv_capacity(MAX_CONTEXT, 16),
            MAX_CONTEXT,
            llm._spec_config("bole", 8),
            "float32",
        ).values()
    )
    s = Scheduler(
        llm, mode="bole", max_batch=8, max_context=MAX_CONTEXT, memory_gb=5.5 * per_bole / 2**30
    )
    assert s.num_slots == 4
    text = _metrics_text(s)
    for part, b in s.slot_bytes.items():
        assert _metric(text, "bole_memory_plan_bytes", part=part) == b * 5
        assert _metric(text, "bole_memory_plan_slot_bytes", mode="bole", part=part) == b
    planned = _metric(text, "bole_memory_planned_bytes")
    parts = sum(_metric(text, "bole_memory_plan_bytes", part=p) for p in s.slot_bytes)
    assert parts + _metric(text, "bole_memory_plan_bytes", part="prefix_cache") == planned
    assert _metric(text, "bole_memory_plan_bytes", part="limit") == int(5.5 * per_bole)
    assert _metric(text, "bole_memory_plan_bytes", part="usable") == int(5.5 * per_bole)
    for mode, p in s.plans.items():
        assert _metric(text, "bole_memory_plan_slots", mode=mode) == p.num_slots
        assert _metric(text, "bole_memory_plan_fit_slots", mode=mode) == p.fit_slots
        total = _metric(text, "bole_memory_plan_slot_bytes", mode=mode, part="total")
        assert total == p.per_slot
    assert _metric(text, "bole_memory_plan_slots", mode="ar") == 8  # capped by --max-batch
    assert 0 < _metric(text, "bole_memory_plan_fit_slots", mode="pernode") < 4


# ------------------------------------------------------------------ what can never fit
def test_a_cap_below_one_slot_is_a_clear_error(llms):
    llm = llms({})
    for mode in ("ar", "bole"):
        spec = None if mode == "ar" else llm._spec_config(mode, 8)
        per = sum(
            slot_bytes(
                llm.cfg,
                kv_capacity(MAX_CONTEXT, spec.slack if spec else 0),
                MAX_CONTEXT,
                spec,
                "float32",
            ).values()
        )
        with pytest.raises(ValueError, match="not enough device memory for one decode slot"):
            build_server(
                llm=llm, spec=mode, port=0, max_context=MAX_CONTEXT, memory_gb=1.5 * per / 2**30
            )
        Scheduler(llm, mode=mode, max_context=MAX_CONTEXT, memory_gb=2.5 * per / 2**30)  # fits


def _post(srv, body):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_a_request_longer_than_a_slot_is_a_400(llms):
    """prompt + max_tokens above the max context (what one slot's KV holds): an OpenAI-style 400
    naming the limit, before anything runs (HTTP only: no engine)."""
    s = Scheduler(llms({}), mode="ar", max_batch=2, max_context=MAX_CONTEXT)
    srv = OpenAIServer(s, model_name="tiny", port=0)
    srv._start_http()
    try:
        for body in (
            {"prompt": [5] * 60, "max_tokens": 5},  # 65 > 64
            {"prompt": [5] * MAX_CONTEXT},  # no room for the default max_tokens' one token
        ):
            status, out = _post(srv, body)
            assert status == 400, out
            err = out["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert f"maximum context length is {MAX_CONTEXT} tokens" in err["message"]
        assert s.queue_depth == 0
    finally:
        srv.shutdown()


def test_decode_groups_hold_one_groups_step_transient(llms):
    """With decode groups (--slot-group G) the plan holds the step transient of one group once
    (the groups' steps run one after another) instead of every slot's: per mode slots =
    (usable - G x step) // (slot - step) - 1, more than without groups where the step transient is
    large (pernode's per-node states); a grouped scheduler runs the slots of that plan (re-planned
    from one group's compiled temporaries where they exceed G x step) within the cap, and
    /metrics' parts add up to the planned bytes."""
    llm = llms({})
    spec = llm._spec_config("pernode", 8)
    parts = slot_bytes(llm.cfg, kv_capacity(MAX_CONTEXT, spec.slack), MAX_CONTEXT, spec, "float32")
    step, per = parts["step_transient"], sum(parts.values())
    assert split_transient(parts, None) == (per, 0)
    assert split_transient(parts, 3) == (per - step, 3 * step)
    cap = int(6.5 * per)
    specs = {"pernode": spec, "ar": None}
    plan = functools.partial(
        plan_by_mode,
        llm.cfg,
        MAX_CONTEXT,
        specs,
        "float32",
        64,
        memory_gb=cap / 2**30,
        prefix_cache_gb=0,
        device=FixedStats(None),
    )
    one, grouped = plan(), plan(group_rows=1)
    assert one["pernode"].num_slots == cap // per - 1 == 5
    g = grouped["pernode"].plan
    assert g.num_slots == (cap - step) // (per - step) - 1 > 5
    assert g.shared_bytes == step and g.slot_bytes == per - step
    assert g.planned_bytes == (g.num_slots + 1) * (per - step) + step <= cap
    assert "held for one decode group only" in format_plan_table(grouped, "pernode")

    s = Scheduler(
        llm,
        mode="pernode",
        max_batch=64,
        max_context=MAX_CONTEXT,
        segment_steps=2,
        prefix_cache_gb=0,
        memory_gb=cap / 2**30,
        slot_group=1,
    )
    assert s.num_slots == g.num_slots and s.memory == g
    s._ensure_state()
    temp = s.step_memory["compiled_temp_bytes"]
    assert s.step_memory["estimate_bytes"] == step
    shared = max(temp, step)  # one 1-row group's compiled temporaries, where above the estimate
    assert s.memory.shared_bytes == shared
    assert s.num_slots == min(64, (cap - shared) // (per - step) - 1)
    assert s.memory.planned_bytes <= cap and len(s._groups) == s.num_slots
    text = _metrics_text(s)
    assert _metric(text, "bole_memory_plan_bytes", part="step_transient") == shared
    total = sum(_metric(text, "bole_memory_plan_bytes", part=p) for p in s.slot_bytes)
    total += _metric(text, "bole_memory_plan_bytes", part="prefix_cache")
    assert total == _metric(text, "bole_memory_planned_bytes") == s.memory.planned_bytes
    s.start(warmup=False)
    try:
        reqs = [s.submit([5 + i] * 8, RequestParams(max_tokens=4)) for i in range(3)]
        for r in reqs:
            assert r.result(timeout=120).finish_reason == "length", r.error
    finally:
        s.stop()


def test_admission_never_exceeds_the_slots(llms):
    llm = llms({})
    kw = dict(mode="ar", max_context=MAX_CONTEXT, segment_steps=2, segment_ms=None, prefix_block=16)
    probe = Scheduler(llm, max_batch=2, prefix_cache_gb=0, **kw)
    probe._ensure_state()  # no cap: the compiled step's temporaries at 2 slots, recorded only
    temp = probe.step_memory["compiled_temp_bytes"]
    per = sum(probe.slot_bytes.values()) - probe.slot_bytes["step_transient"]
    per += max(-(-temp // 2), probe.slot_bytes["step_transient"])
    s = Scheduler(llm, max_batch=8, memory_gb=3.5 * per / 2**30, **kw)
    s._ensure_state()
    assert s.num_slots == 2
    reqs = [s.submit([5 + i] * 8, RequestParams(max_tokens=6)) for i in range(5)]
    most = 0
    for _ in range(100):
        s.step()
        assert s.active_slots <= s.num_slots
        most = max(most, s.active_slots)
        if all(r.finished for r in reqs):
            break
    assert most == s.num_slots
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in reqs)
    assert s.active_slots == 0 and s.queue_depth == 0


def test_slots_are_replanned_from_the_compiled_step(llms):
    """The plan charges each slot the compiled decode segment's temporaries / slots where they
    exceed the estimate (on the tiny model they do: activations, the drafter's logits and
    sampling's work are not in `step_transient`): with a cap that fits 6 slots by the estimate,
    the engine re-plans in the same memory, rebuilds its state with the slots that fit the
    measured step and decodes with them; the plan, the state and /metrics agree."""
    llm = llms({})
    spec = llm._spec_config("pernode", 8)
    parts = slot_bytes(llm.cfg, kv_capacity(MAX_CONTEXT, spec.slack), MAX_CONTEXT, spec, "float32")
    per = sum(parts.values())
    cap = 7.5 * per
    s = Scheduler(
        llm,
        mode="pernode",
        max_batch=8,
        max_context=MAX_CONTEXT,
        segment_steps=2,
        prefix_cache_gb=0,
        memory_gb=cap / 2**30,
    )
    assert s.num_slots == 6 and s.slot_bytes == parts  # the estimate's plan
    s._ensure_state()
    mem = s.step_memory
    temp = mem["compiled_temp_bytes"]
    assert temp > 6 * parts["step_transient"]  # the estimate is a lower bound here
    assert mem["planned_slots"] == 6 and mem["estimate_bytes"] == 6 * parts["step_transient"]
    charged = -(-temp // 6)
    assert s.slot_bytes == dict(parts, step_transient=charged)
    want = min(8, int(cap) // (per - parts["step_transient"] + charged) - 1)
    assert s.num_slots == mem["slots"] == want < 6
    assert (s.num_slots + 1) * sum(s.slot_bytes.values()) <= int(cap)
    assert s._state.done.shape == (s.num_slots,) and len(s._slots) == s.num_slots
    assert s.plans["pernode"].plan == s.memory and s.plans["pernode"].num_slots == s.num_slots
    assert mem["recompiled_temp_bytes"] <= temp  # fewer rows, fewer temporaries
    s.start(warmup=False)
    try:
        reqs = [s.submit([5 + i] * 8, RequestParams(max_tokens=4)) for i in range(s.num_slots + 2)]
        for r in reqs:
            assert r.result(timeout=120).finish_reason == "length", r.error
    finally:
        s.stop()
    text = _metrics_text(s)
    assert _metric(text, "bole_memory_step_temp_bytes") == temp
    assert _metric(text, "bole_memory_plan_slots", mode="pernode") == s.num_slots
