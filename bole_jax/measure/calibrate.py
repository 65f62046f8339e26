"""Calibration of the decode configuration: time whole decode steps, measure acceptance, choose.

For each batch bucket B, every candidate configuration (ar; chain at a draft depth d; bole at a
tree width N and depth d) runs the engine's own jitted decode loop (`LLM.segment_fn`) on the
model being calibrated: `warm` untimed steps, then `repeats` timed windows of `steps` steps. The step time is the
fastest window's loop wall time per step (draft, select, verify, accept, commit, emit: everything a step does, fused as
the engine runs it). The acceptance estimate is the tokens emitted per request per step in the
same runs, pooled over the buckets: measured with the model's real MTP head on the built-in
prompts (`CALIBRATION_PROMPTS`, generic text and code, never a benchmark's evaluation set) or on
the user's own (`prompts`, `bole-jax calibrate --prompts-file`: text like the workload's), or,
for random weights with the synthetic drafter, the synthetic acceptance
1 + p + ... + p^min(d, N-1). The choice per bucket (`budget.choose`): the candidate with the most
expected tokens per second, acceptance / step time.

One prefill per bucket is shared by every candidate (same prompts, same first token, the same KV
capacity). Every bucket is prefilled and its programs lowered in this thread first, all of them
compiled in `workers` threads, and only then are the buckets timed in order (XLA autotunes on
the device while it compiles; no compilation runs beside a timed loop). With `time_budget`,
candidates not compiled by then are skipped, and buckets not reached by then are neither
prefilled nor compiled (both marked in the table): the choice is then made among those measured
(ar is always first, so a table always has a safe choice).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.measure.env import environment, progress_bar
from bole_jax.model import parallel
from bole_jax.model.cache import AttnCache, with_pending
from bole_jax.pallas.tree_utils import next_pow2
from bole_jax.spec_decode import budget
from bole_jax.spec_decode.acceptance import expected_tokens_per_step, synthetic_accept_prob  # noqa: F401
from bole_jax.spec_decode.budget import MAX_NODES, TABLE_FORMAT, candidate_id, model_signature
from bole_jax.spec_decode.drafter import draft_cache_capacity, prefill_rows

# Phase lines (prefill and lowering, compilation, each bucket timed): INFO, so that a run with
# no progress bar still says where its minutes go (`bole-jax calibrate` shows them).
log = logging.getLogger("bole_jax.calibrate")

# Short, generic prompts (prose, code, lists, dialogue): what the acceptance is measured on.
CALIBRATION_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog. The dog",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is the capital of France?\nA:",
    "for i in range(10):\n    print(",
    "Here is a list of fruits:\n1. Apple\n2.",
)

DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_NODES = (4, 8, 16, 32, 64)
DEFAULT_DEPTHS = (8,)
CPU_NODES = (4, 8)  # CPU: the tree kernels run as references (interpret mode): few widths
# Automatic calibration on an accelerator: the widths timed for a batch bucket below / from
# AUTO_LARGE_BATCH. Measured at Qwen3.5-9B dims (one H200, 5799bea, docs/benchmarks.md section
# 2): from B = 16 on, 32 and 64 nodes were 1.8-4.8x slower per step than 8 (B = 16: 20.0 and
# 32.4 ms against 10.8; B = 64: 65 and 119 against 25.0) and the fastest bole point at B = 64
# was 4 nodes (10907 tok/s against 8611 with 8).
AUTO_NODES = (8, 16, 32, 64)
AUTO_NODES_LARGE = (4, 8, 16, 32)
AUTO_LARGE_BATCH = 16
AUTO_SECONDS = 60.0  # automatic calibration on first use: at most about this long
AUTO_STEPS, AUTO_REPEATS, AUTO_WARM = 4, 2, 2


# ---------------------------------------------------------------- timing the engine's loop


_copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


def dispatch_ms(run, params, state, repeats: int = 3):
    """Host time of a call of the compiled loop that runs no step (dispatch, the loop's first
    condition, the wait), fastest of `repeats`: the fixed cost a timed window of
    `timed_segment` carries on top of its steps. Returns (ms, state)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state = run(params, state, jnp.int32(0))
        jax.block_until_ready(state.out)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best, state


def timed_segment(run, params, state, warm_steps: int, steps: int, n: int):
    """Warm up (`warm_steps` loop iterations, compilation included when `run` is not compiled
    yet), then time `steps` iterations of the jitted loop `run(params, state, max_steps)`.
    Throughput counts the tokens the first `n` (real) requests emitted in the timed window."""
    state = run(params, state, jnp.int32(warm_steps))
    jax.block_until_ready(state.out)
    n0 = np.asarray(state.num_out).copy()
    s0 = np.asarray(state.steps).copy()
    t = time.perf_counter()
    state = run(params, state, jnp.int32(steps))
    jax.block_until_ready(state.out)
    dt = time.perf_counter() - t
    n1, s1 = np.asarray(state.num_out), np.asarray(state.steps)
    toks = int((n1 - n0)[:n].sum())
    req_steps = int((s1 - s0)[:n].sum())
    nsteps = int((s1 - s0)[:n].max())
    return dict(
        batch=n,
        time_s=dt,
        tokens=toks,
        loop_steps=nsteps,
        request_steps=req_steps,
        step_ms=1e3 * dt / max(nsteps, 1),
        tokens_per_s=toks / dt,
        tokens_per_step=toks / max(req_steps, 1),
    ), state


def prompt_token_ids(tokenizer, prompts: Sequence[str], prompt_len: int) -> list[list[int]]:
    """Token ids of measurement prompts (calibration, `bole-jax bench --prompts-file`): each text
    with its trailing whitespace stripped, cut to its last `prompt_len` tokens; empty ones dropped.

    Why strip: a prompt that ends in a bare newline stops at a token boundary the tokenizer never
    makes mid-text (its newline merges with the next line's indentation), and a model reads it as
    the end of a file. On the demo model 10 of the first 16 HumanEval prompts (each ends in
    '\"\"\"\\n') got EOS as their first greedy token, and the continuation past it, a memorized
    licence header, accepted 8.8 tokens per chain step: the bench's tokens per step at B = 16
    were 6.67 (chain) and 7.31 (32-node tree) with the raw prompts, 5.48 and 6.84 stripped (CPU,
    bf16). Code-evaluation harnesses strip HumanEval prompts for the same reason.
    Spec-Bench's questions end in text and are unchanged by it."""
    return [t for t in (tokenizer.encode(measurement_text(p))[-prompt_len:] for p in prompts) if t]


def measurement_text(prompt: str) -> str:
    """A measurement prompt as the bench, the calibration and the acceptance report feed it: its
    trailing whitespace stripped (`prompt_token_ids` says why)."""
    return prompt.rstrip()


def ignore_eos(state):
    """The state with EOS as an ordinary token, so that every request decodes to its length and
    the batch stays full while it is timed: only padding rows (nothing emitted) and rows at their
    length are done, whatever their first token was (`vLLM`'s `ignore_eos` for benchmarks). The
    bench and the calibration share it, so their acceptance counts the same tokens; both record
    how many requests emitted EOS (`eos_requests`), past which the text is no longer the
    workload's."""
    done = (state.num_out == 0) | (state.num_out >= state.max_out)
    return dataclasses.replace(state, eos=jnp.full_like(state.eos, -1), done=done)


def eos_requests(state, n: int, eos_ids) -> int:
    """How many of the first `n` requests' outputs hold an EOS token."""
    out, num = np.asarray(state.out), np.asarray(state.num_out)
    ids = np.asarray([e for e in eos_ids if e >= 0], np.int32)
    return int(sum(bool(np.isin(out[i, : num[i]], ids).any()) for i in range(n)))


def settle_compiles(futures) -> int:
    """Past a time budget: drop the compilations not yet started and wait for the running ones (at
    most one per worker), so that nothing compiles beside a timed loop. Returns how many were
    dropped. Why: a compilation beside a timed loop slowed the tiny preset's chain step on a
    2-core CPU from 1.4 to 10.9 ms, and on an H200 (Qwen3.5-9B dims, B = 1) the AR step from 5.4
    to 36.5 ms (a compile's GPU autotuning and its threads)."""
    futures = list(futures)
    dropped = sum(1 for f in futures if not f.done() and f.cancel())
    concurrent.futures.wait([f for f in futures if not f.cancelled()])
    return dropped


def wait_compiles(futures, deadline: float | None, progress: bool) -> None:
    """Wait for the compilations until they end or `deadline` (perf_counter seconds) passes, a
    bar counting the programs compiled where `progress` (the compilations, minutes at 9B dims,
    come before the first candidate is timed)."""
    left = {f for f in futures if not f.done()}
    if not left:
        return
    bar = progress_bar(len(futures), "compile", "prog") if progress else None
    try:
        if bar is not None:
            bar.update(len(futures) - len(left))
        while left:
            timeout = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
            done, left = concurrent.futures.wait(
                left, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not done:
                break
            if bar is not None:
                bar.update(len(done))
    finally:
        if bar is not None:
            bar.close()


def derive_state(base, mode: str, spec, cfg, oracle=None, copy: bool = True):
    """A fresh copy of the prefilled `base` state laid out for `mode` (every mode shares one
    prefill: same prompts, same first token, same KV capacity). ar drops the drafter state; a
    spec mode keeps the MTP cache rows start_batch would have allocated for it (committed rows +
    the mode's draft scratch) and takes the synthetic drafter's oracle. The GDN caches get the
    mode's pending-commit layout (`SpecConfig.pending_length`) and the drafter's pending rows
    its depth's (`TreeShape.path_nodes`: candidates of several depths share one prefill), placed
    like every cache leaf under tensor parallelism (`parallel.place`: the empty pending rows
    split on their heads, as the compiled loop expects; made here they were replicated, and a
    tp > 1 lazy run failed at its first call). copy=False: `base` is a throw-away copy already
    (one state on the device at a time, for runs at the memory limit). `base` is a prefill's
    state: one pending drafter entry per request."""
    length = spec.pending_length if spec is not None else None
    nodes = spec.pending_nodes if spec is not None else None
    base = dataclasses.replace(base, cache=with_pending(base.cache, cfg, length, nodes))
    if mode == "ar":
        ds = None
    else:
        ds = base.extra
        rows = draft_cache_capacity(base.cache.capacity, spec.shape)  # as LLM.start_batch sizes it
        assert rows <= ds.kv[0].capacity, (rows, ds.kv[0].k.shape)
        # a prefill's one pending entry (row 0), laid out for this depth as start_batch does
        toks, hid, count = prefill_rows(
            ds.pend_tokens[:, 0], ds.pend_hidden[:, 0], p=spec.shape.path_nodes
        )
        ds = dataclasses.replace(
            ds,
            kv=tuple(AttnCache(k=c.k[:, :, :rows], v=c.v[:, :, :rows]) for c in ds.kv),
            pend_tokens=toks,
            pend_hidden=hid,
            pend_count=count,
            oracle=ds.oracle if oracle is None else oracle,
        )
    out = dataclasses.replace(base, extra=ds)
    return parallel.place(_copy(out) if copy else out, cfg)


class _Parked:
    """A pytree of arrays moved to host memory, with the shardings to put it back with."""

    def __init__(self, tree, shardings):
        self.tree, self.shardings = tree, shardings


def _delete(tree) -> None:
    """Free the device buffers of every array in `tree` (a state no longer used)."""
    for x in jax.tree.leaves(tree):
        try:
            x.delete()
        except (AttributeError, RuntimeError, ValueError):  # deleted already / not an array
            pass


def park_on_host(trees: dict, force: bool = False) -> dict:
    """{key: pytree on the accelerator} -> {key: _Parked in host memory}: the prefilled states of
    the batches whose turn has not come (their programs are lowered already). Holding every
    batch's caches at once left no room for a step's scratch at Qwen3-Next-80B dims (TP = 2:
    "Failed to allocate Scratch for all-reduce"). {} where there is nothing to park or no CPU
    backend (JAX_PLATFORMS without cpu); also on a CPU backend, unless `force` (tests)."""
    if not trees or (jax.default_backend() == "cpu" and not force):
        return {}
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:
        return {}
    return {
        k: _Parked(jax.device_put(t, host), jax.tree.map(lambda x: x.sharding, t))
        for k, t in trees.items()
    }


def unpark(p):
    """The inverse of `park_on_host` for one entry (anything else is returned as it is): a new
    device copy each call, which the loop may donate (`may_alias=False`: on a CPU backend the
    host and the device are one, and a put could hand back the parked arrays themselves)."""
    if not isinstance(p, _Parked):
        return p
    return jax.block_until_ready(jax.device_put(p.tree, p.shardings, may_alias=False))


# ---------------------------------------------------------------- candidates


def candidates(
    nodes: Sequence[int],
    depths: Sequence[int],
    topk: int | Sequence[int] = 4,
    modes: Sequence[str] = ("ar", "chain", "bole"),
) -> list[dict]:
    """The configurations timed per bucket, in the order they are measured: ar, chain per depth,
    the chain verified by bole per depth, then bole trees by growing width (a time budget cuts the
    most expensive ones).

    The bole chain (k = 1, N = d + 1) drafts what the chain drafts (one MTP row per request per
    level, so its acceptance is the chain's) and verifies it with the tree closed form and the
    factor commit instead of the chain's per-node state snapshots. Measured on one H200 (Qwen3.5-9B
    dims, 7f0cccc): the snapshot chain's verify took 5.22 / 9.69 / 26.9 ms at B = 1 / 16 / 64
    against 4.86 / 7.09 / 16.4 ms for an 8-node bole tree, whose draft (four rows per request per
    level) cost 1.88 / 2.74 / 5.34 ms against the chain's 1.64 / 1.62 / 2.34.
    topk: children per node of the trees, one value or several (each width and depth is then
    timed with each: fewer children draft fewer MTP rows per level)."""
    ks = sorted({int(topk)} if isinstance(topk, int) else {int(k) for k in topk})
    out = [dict(mode="ar", nodes=1, depth=0, topk=1)] if "ar" in modes else []
    if "chain" in modes:
        out += [dict(mode="chain", nodes=d + 1, depth=d, topk=1) for d in depths]
    if "bole" in modes:
        out += [dict(mode="bole", nodes=d + 1, depth=d, topk=1) for d in depths]
        out += [
            dict(mode="bole", nodes=n, depth=d, topk=k)
            for n in sorted(nodes)
            for k in ks
            for d in depths
            if k > 1
        ]
    return out


def check_calibration_args(batch_buckets, node_buckets, depths, *, steps=16, warm=2):
    """Validated, sorted buckets (clear errors for bad ones)."""

    def positive(name, values, hi=None):
        vals = list(values)
        if not vals:
            raise ValueError(f"{name}: give at least one value")
        bad = [
            v for v in vals if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
        ]
        if bad:
            raise ValueError(f"{name}: must be positive integers, got {bad}")
        if hi is not None and max(vals) > hi:
            raise ValueError(
                f"{name}: {max(vals)} is above {hi} (the Pallas tree kernels verify at "
                f"most {hi} nodes per request)"
            )
        return tuple(sorted(set(int(v) for v in vals)))

    if steps < 1 or warm < 0:
        raise ValueError("need --steps >= 1 and --warm >= 0")
    return (
        positive("batch buckets", batch_buckets),
        positive("node buckets", node_buckets, MAX_NODES),
        positive("depths", depths),
    )


def check_contexts(contexts: Sequence[int]) -> tuple[int, ...]:
    """Validated, sorted filled-context KV capacities (powers of two >= 64)."""
    vals = list(contexts or ())
    bad = [
        v
        for v in vals
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 64 or v & (v - 1)
    ]
    if bad:
        raise ValueError(f"contexts: KV capacities must be powers of two >= 64, got {bad}")
    return tuple(sorted(set(int(v) for v in vals)))


# ---------------------------------------------------------------- the measurement


def _prompt_ids(
    llm, prompt_len: int, synthetic: bool, seed: int, prompts: Sequence[str] | None = None
) -> list[list[int]]:
    if prompts is not None:
        if synthetic or llm.tokenizer is None:
            raise ValueError(
                "calibration prompts need a checkpoint with a tokenizer and its MTP head (the "
                "synthetic drafter's acceptance does not depend on the prompts)"
            )
        ids = prompt_token_ids(llm.tokenizer, prompts, prompt_len)
        if not ids:
            raise ValueError("no calibration prompt has a token")
        return ids
    if llm.tokenizer is not None and not synthetic:
        return prompt_token_ids(llm.tokenizer, CALIBRATION_PROMPTS, prompt_len)
    rng = np.random.default_rng(seed)
    return rng.integers(1, llm.cfg.vocab_size, (len(CALIBRATION_PROMPTS), prompt_len)).tolist()


def calibrate(
    llm,
    batch_buckets: Sequence[int] = DEFAULT_BATCHES,
    node_buckets: Sequence[int] = DEFAULT_NODES,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    *,
    topk: int | Sequence[int] = 4,
    modes: Sequence[str] = ("ar", "chain", "bole"),
    accept_prob: float | None = None,
    steps: int = 8,
    repeats: int = 3,
    warm: int = 2,
    prompt_len: int = 64,
    backend: str = "auto",
    time_budget: float | None = None,
    workers: int | None = None,
    progress: bool = True,
    seed: int = 0,
    prompts: Sequence[str] | None = None,
    prompts_source: str | None = None,
    contexts: Sequence[int] = (),
) -> dict:
    """Time whole decode steps of every candidate and estimate their acceptance (module docstring).

    llm: the `LLM` to calibrate (its weights, MTP head, draft vocabulary and dtype are what is
      measured). accept_prob: random weights: the synthetic drafter with per-depth acceptance p
      (the prompts are then random tokens and the acceptance is the synthetic one, not measured).
    batch_buckets: batch sizes B; node_buckets: bole tree widths N (root included, <= 128);
    depths: draft depths d (chain verifies d + 1 nodes). warm: untimed loop steps per candidate,
      then `repeats` timed windows of `steps` steps: the step time is the fastest window's (a
      machine shared with other jobs slows some windows), the acceptance counts all of them.
      time_budget: seconds; candidates not compiled by then are skipped (those compiled are then
      timed).
    prompts: the texts the acceptance is measured on (default `CALIBRATION_PROMPTS`); a batch
      bucket of B requests takes the first B (cycled), each cut to its last `prompt_len` tokens.
      The table's choice weighs step time against acceptance, and the acceptance of a tree over
      a chain depends on the text (docs/budget.md, "Which prompts"); trailing whitespace is
      stripped (`prompt_token_ids`). prompts_source: recorded in the table.
    contexts: KV capacities (powers of two, above the calibration's own) to time every batch
      bucket at as well: each request's KV cache is filled to that many tokens (its prompt,
      filler rows that attention reads like real context, then the generation, as `bole-jax
      bench --context`), and the entry records `context`. A step's attention and the drafter's
      read the whole context, so the choice there can differ (ar where a tree wins at short
      contexts); `budget.choose(kv=...)` looks it up. Only step times come from these runs: the
      acceptance is measured at the calibration's own context (the filler is not text).
    Returns the table (JSON-ready dict: `format_table` prints it, `save_table` writes it).
    """
    batch_buckets, node_buckets, depths = check_calibration_args(
        batch_buckets, node_buckets, depths, steps=steps, warm=warm
    )
    contexts = check_contexts(contexts)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ks = [topk] if isinstance(topk, (int, np.integer)) else list(topk)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) for k in ks):
        raise ValueError(f"topk: give positive integers, got {topk!r}")
    if min(ks) < 1:
        raise ValueError(f"topk: children per node must be >= 1, got {topk!r}")
    t_start = time.perf_counter()
    deadline = None if time_budget is None else t_start + time_budget
    cfg, params = llm.cfg, llm.params
    dtype = params["embed"].dtype
    has_mtp = bool(cfg.mtp_num_layers) and "mtp" in params
    cands = candidates(node_buckets, depths, topk, modes if has_mtp else ("ar",))
    if not cands or cands[0]["mode"] != "ar":
        raise ValueError(
            "the candidates must include ar (the reference every choice is safe against)"
        )
    synthetic = accept_prob is not None
    ids_all = _prompt_ids(llm, prompt_len, synthetic, seed, prompts)
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    gen = 1 + (warm + repeats * steps) * (max(depths) + 1)  # no request finishes while timed
    if contexts:  # each one above the own context's capacity at every batch (nothing run yet)
        for b in batch_buckets:
            ids = [ids_all[i % len(ids_all)] for i in range(b)]
            slack = _bucket_llms(llm, cands, b, accept_prob, backend)[2]
            own = next_pow2(kv_need(max(map(len, ids)), gen, slack), minimum=64)
            if contexts[0] <= own:
                raise ValueError(
                    f"contexts: {contexts[0]} is not above the calibration's own KV capacity "
                    f"({own} at batch {b}: the prompts, {gen} generated tokens and the tree's "
                    "rows); give a larger power of two"
                )
    entries, acc = [], {}
    # (batch, filled context or None): the calibration's own context first, for every batch
    buckets = [(b, None) for b in batch_buckets] + [(b, L) for L in contexts for b in batch_buckets]
    bar = None  # the timing bar, from the first timed candidate (the compile bar comes first)
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        # Every bucket is prefilled and lowered first and all programs compile together in the
        # pool (one bucket at a time left most workers idle: 7 programs per bucket, 4 buckets of
        # about 70 s compiles each at 9B dims, 365 s in all on a 16-core host); then the buckets
        # are timed in order, with no compilation running beside a timed loop.
        prepared = []  # (batch, context, prepared bucket or None: past the time budget)
        for b, ctx in buckets:
            if deadline is not None and time.perf_counter() > deadline and prepared:
                # Past the budget: no prefill, lowering or compilation for this bucket (its
                # compilations would run on in the pool's threads, which the process waits for at
                # exit: Qwen3.5-9B dims, four buckets, --time-budget 170 once ran 345 s). Its
                # candidates are listed untimed, so the table chooses nothing there rather than
                # another bucket's choice.
                prepared.append((b, ctx, None))
                continue
            ids = [ids_all[i % len(ids_all)] for i in range(b)]
            prep = _prepare_bucket(llm, ids, cands, gen, accept_prob, backend, pool, ctx)
            if ctx is not None:
                # A filled context's caches wait in host memory for their turn (all of them on
                # the device at once: 85 requests x 16k tokens at 9B dims are 42 GiB).
                prep["base"] = park_on_host({0: prep["base"]}).get(0, prep["base"])
            prepared.append((b, ctx, prep))
            log.info(
                "calibrate: batch %d%s prefilled, %d programs lowered (%d of %d buckets)",
                b,
                "" if ctx is None else f" at context {ctx}",
                len(prep["jobs"]),
                len(prepared),
                len(buckets),
            )
        jobs = [f for _, _, prep in prepared if prep is not None for f in prep["jobs"].values()]
        n_prep = sum(prep is not None for _, _, prep in prepared)
        log.info(
            "calibrate: %d of %d buckets prefilled and lowered in %.0f s; compiling %d programs "
            "in %d threads",
            n_prep,
            len(prepared),
            time.perf_counter() - t_start,
            len(jobs),
            workers,
        )
        t_compile = time.perf_counter()
        wait_compiles(jobs, deadline, progress)
        dropped = settle_compiles(jobs)
        ended = [f for f in jobs if not f.cancelled()]
        failed = sum(f.exception() is not None for f in ended)
        log.info(
            "calibrate: compiled %d programs in %.0f s%s%s",
            len(ended) - failed,
            time.perf_counter() - t_compile,
            f", {failed} failed" if failed else "",
            f", {dropped} not started within the time budget (skipped)" if dropped else "",
        )
        if progress:
            bar = progress_bar(len(buckets) * len(cands), "calibrate", "prog")
        first = next((prep for _, _, prep in prepared if prep is not None), None)
        if first is not None:
            _warm_device(first, cands[0], cfg, params, warm)
        kv = None
        for k, (b, ctx, prep) in enumerate(prepared):
            if prep is None:
                entry = dict(
                    batch=b,
                    kv=kv if ctx is None else ctx,
                    candidates=[dict(c, note="skipped (time budget)") for c in cands],
                )
                if bar is not None:
                    bar.update(len(cands))
            else:
                t_bucket = time.perf_counter()
                entry, measured = _time_bucket(llm, prep, cands, warm, steps, repeats, bar)
                log.info(
                    "calibrate: timed batch %d at KV %d%s in %.1f s",
                    b,
                    entry["kv"],
                    "" if ctx is None else " (filled context)",
                    time.perf_counter() - t_bucket,
                )
                prepared[k] = (b, ctx, None)  # its states and programs are no longer needed
                if ctx is None:
                    kv = entry["kv"]
                    for cid, (toks, nsteps) in measured.items():  # text, not filler: acceptance
                        t0, s0 = acc.get(cid, (0, 0))
                        acc[cid] = (t0 + toks, s0 + nsteps)
            if ctx is not None:
                entry["context"] = ctx
            entries.append(entry)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if bar is not None:
            bar.close()
    acceptance = {}
    for c in cands:
        cid = candidate_id(c)
        if c["mode"] == "ar":
            continue
        if synthetic:
            acceptance[cid] = dict(
                tokens_per_step=expected_tokens_per_step(
                    accept_prob, min(c["depth"], c["nodes"] - 1)
                ),
                source="synthetic",
            )
        elif cid in acc:
            toks, nsteps = acc[cid]
            acceptance[cid] = dict(
                tokens_per_step=toks / max(nsteps, 1),
                tokens=toks,
                request_steps=nsteps,
                source="measured",
            )
    env = environment()
    identity = budget.llm_identity(llm)
    if synthetic:
        identity = dict(identity, drafter=f"synthetic p={accept_prob:.4f}")
    table = dict(
        format=TABLE_FORMAT,
        device=env["device"],
        platform=env["platform"],
        jax=env["jax"],
        git_commit=env["git_commit"],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=model_signature(cfg, dtype),
        identity=identity,
        key=budget.table_key(identity),
        drafter="mtp" if not synthetic else f"synthetic p={accept_prob:.4f}",
        prompts="random tokens"
        if synthetic
        else "built-in (bole_jax.measure.calibrate.CALIBRATION_PROMPTS)"
        if prompts is None
        else f"{prompts_source or 'given'} ({len(ids_all)} prompts)",
        backend=backend,
        steps=steps,
        repeats=repeats,
        warm=warm,
        batch_buckets=list(batch_buckets),
        contexts=list(contexts),
        node_buckets=list(node_buckets),
        depths=list(depths),
        topk=topk if isinstance(topk, int) else sorted({int(k) for k in topk}),
        acceptance=acceptance,
        seconds=round(time.perf_counter() - t_start, 1),
        entries=entries,
    )
    return _with_choices(table)


def _with_choices(table: dict) -> dict:
    """`table` with each entry's `choice` (`budget.choose` at its batch and KV bucket) set."""
    for e in table["entries"]:
        best = budget.choose(table, e["batch"], e["kv"])
        e["choice"] = (
            None
            if best is None
            else dict(mode=best.mode, nodes=best.num_nodes, depth=best.depth, topk=best.topk)
        )
    return table


def _bucket_llms(llm, cands, b, p, backend):
    """Per candidate of a batch bucket of `b`: its LLM (sharing the weights), its SpecConfig (spec
    modes), and the KV rows its tree writes past the committed tokens (`slack`; 0 for ar)."""
    cfg, params, mk = llm.cfg, llm.params, type(llm)
    llms, specs = {}, {}
    for c in cands:
        cid = candidate_id(c)
        if c["mode"] == "ar":
            llms[cid] = mk(cfg, params=params, max_batch_size=b)
            continue
        opts = dict(
            topk=c["topk"],
            depth=c["depth"],
            num_nodes=c["nodes"],
            backend=backend,
            synthetic_accept=p,
        )
        llms[cid] = mk(cfg, params=params, max_batch_size=b, spec_options=opts)
        specs[cid] = llms[cid]._spec_config(c["mode"], b)
    slack = {cid: specs[cid].slack if cid in specs else 0 for cid in llms}
    return llms, specs, slack


def kv_need(longest: int, gen: int, slack: dict) -> int:
    """KV rows a batch needs before any filler: its longest prompt, `gen` generated tokens, the
    most rows a mode's tree writes past them (`slack`: {mode or candidate: rows}) and the next
    token. `start_batch` sizes the capacity as the next power of two (64 at least); a filled
    context of L tokens adds L - kv_need filler rows, which makes the capacity exactly L."""
    return longest + gen + max(slack.values()) + 1


def with_filler(state, fill: int):
    """`state` with `fill` more committed rows per request: the filler of a long context, read by
    attention like real context (`bole-jax bench --context`, `calibrate(contexts=...)`)."""
    if not fill:
        return state
    cache = dataclasses.replace(state.cache, lengths=state.cache.lengths + fill)
    return dataclasses.replace(state, cache=cache)


def _prepare_bucket(llm, ids, cands, gen, p, backend, pool, context=None) -> dict:
    """One batch bucket's shared prefill, and every candidate's program lowered here (tracing
    holds the GIL) and submitted to `pool` for compilation. Returns the bucket's base state, its
    LLMs, specs and compile futures. context: each request's KV cache holds that many tokens (a
    power of two): its prompt, filler rows counted as committed context, then the generation."""
    cfg, params = llm.cfg, llm.params
    b = len(ids)
    llms, specs, slack = _bucket_llms(llm, cands, b, p, backend)
    base_id = max(llms, key=lambda k: specs[k].shape.draft_slots if k in specs else -1)
    base_mode = next(c["mode"] for c in cands if candidate_id(c) == base_id)
    oracle = None
    if p is not None and base_mode != "ar":  # the synthetic drafter forces random chains
        rng = np.random.default_rng(b)
        oracle = rng.integers(1, cfg.vocab_size, (b, gen + 1)).tolist()
    # filled context: start_batch's capacity is then exactly `context` (checked in `calibrate`)
    fill = 0 if context is None else context - kv_need(max(map(len, ids)), gen, slack)
    base = llms[base_id].start_batch(
        ids,
        gen,
        mode=base_mode,
        spec_batch=b,
        oracle=oracle,
        extra_capacity=max(slack.values()) - slack[base_id] + fill,
    )
    base = ignore_eos(with_filler(base, fill))  # batches stay full, as in the bench
    jax.block_until_ready(base)
    jobs = {}
    for c in cands:
        cid = candidate_id(c)
        shapes = parallel.annotate(
            jax.eval_shape(
                lambda s, m=c["mode"], sp=specs.get(cid): derive_state(s, m, sp, cfg), base
            ),
            cfg,
        )
        low = llms[cid].segment_fn(c["mode"], b).lower(params, shapes, jnp.int32(0))
        jobs[cid] = pool.submit(low.compile)
    return dict(
        batch=b,
        context=context,
        capacity=int(base.cache.capacity),
        base=base,
        llms=llms,
        specs=specs,
        jobs=jobs,
        synthetic=p is not None,
    )


WARM_DEVICE_S = 0.5


def _warm_device(prep, cand, cfg, params, warm: int, seconds: float = WARM_DEVICE_S):
    """Run the first bucket's `cand` (AR) program untimed for about `seconds` on copies of its
    prefill, so that the first timed window does not find a device idle since the compilations
    (the demo model's B = 1 bucket, timed first, measured every candidate about 0.09 ms per step
    slower than `bench` did)."""
    job = prep["jobs"].get(candidate_id(cand))
    if job is None or not job.done() or job.cancelled() or job.exception() is not None:
        return
    run = job.result()
    t0 = time.perf_counter()
    for _ in range(1000):
        state = derive_state(prep["base"], cand["mode"], None, cfg)
        state = run(params, state, jnp.int32(max(warm, 1)))
        jax.block_until_ready(state.out)
        del state
        if time.perf_counter() - t0 > seconds:
            break


def _time_bucket(llm, prep, cands, warm, steps, repeats, bar):
    """Every candidate of a prepared bucket timed in order, each on a copy of the shared prefill.
    Called once the compilations have ended or the time budget is spent: a candidate whose
    program is not compiled by then is skipped (no compilation runs beside a timed loop: one
    took the demo model's chain step on a 2-core CPU from ~20 to 110-150 ms). Returns (entry,
    {candidate id: (tokens, request steps)} of the speculative candidates measured)."""
    cfg, params = llm.cfg, llm.params
    b, base, specs, jobs = prep["batch"], prep["base"], prep["specs"], prep["jobs"]
    filled = prep["context"] is not None
    ready = {cid: f.done() and not f.cancelled() for cid, f in jobs.items()}
    rows, measured = [], {}
    for c in cands:
        cid = candidate_id(c)
        row = dict(c)
        if not ready[cid]:
            row["note"] = "skipped (time budget)"
        else:
            try:
                run = jobs[cid].result()
                row["temp_bytes"] = temp_bytes(run)
                log.info(
                    "calibrate: batch %d KV %d %s: %s", b, prep["capacity"], cid, memory_line(run)
                )
                if isinstance(base, _Parked):
                    # A filled context's prefill stays in host memory; each candidate gets its
                    # own device copy (never the shared base and a copy at once: 64 requests x
                    # 16k tokens at 9B dims are 32 GiB of KV, twice that passed an H100).
                    state = derive_state(unpark(base), c["mode"], specs.get(cid), cfg, copy=False)
                else:
                    state = derive_state(base, c["mode"], specs.get(cid), cfg)
                windows = []
                for w in range(repeats):
                    r, state = timed_segment(run, params, state, warm if w == 0 else 0, steps, b)
                    windows.append(r)
                overhead, state = dispatch_ms(run, params, state)
                # random prompts and forced chains: no text whose end EOS could mark
                eos = (
                    None
                    if prep["synthetic"]
                    else eos_requests(state, b, getattr(llm, "eos_ids", ()))
                )
                del state
                # The fastest window: the programs are fixed-shape, so slower windows measure other
                # processes sharing the machine, not the configuration.
                fast = min(windows, key=lambda r: r["step_ms"])
                toks = sum(r["tokens"] for r in windows)
                req_steps = sum(r["request_steps"] for r in windows)
                row.update(
                    step_ms=fast["step_ms"],
                    tokens_per_step=toks / max(req_steps, 1),
                    tokens_per_s=1e3 * b * toks / max(req_steps, 1) / fast["step_ms"],
                    window_step_ms=[r["step_ms"] for r in windows],
                    dispatch_ms=overhead,
                    eos_requests=eos,
                )
                if c["mode"] != "ar":
                    measured[cid] = (toks, req_steps)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a wide tree: not timed
                # ar out of memory at the own context: nothing can be chosen, so it stops the
                # calibration; at a filled context (parked on the host or not: no CPU backend)
                # the entry records it (the engine then has no choice at that context and
                # decodes its default there)
                if not _is_oom(e) or (c["mode"] == "ar" and not filled):
                    raise
                row["note"] = "out of memory"
                state = None  # freed before the next candidate's copy is made
        rows.append(row)
        if bar is not None:
            bar.update(1)
    return dict(batch=b, kv=prep["capacity"], candidates=rows), measured


def temp_bytes(compiled) -> int | None:
    """A compiled program's temporaries (XLA's memory analysis; None where the backend reports
    none): what a candidate needs on the device beside its state and the weights."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - backends without a memory analysis
        return None


def memory_line(compiled) -> str:
    """A compiled program's device memory by kind (XLA's memory analysis): its arguments, its
    outputs and how much of them reuse donated arguments, its temporaries."""
    try:
        m = compiled.memory_analysis()
        mib = lambda x: f"{int(x) / 2**20:.4g} MiB"  # noqa: E731
        return (
            f"arguments {mib(m.argument_size_in_bytes)}, outputs {mib(m.output_size_in_bytes)} "
            f"({mib(m.alias_size_in_bytes)} of them in donated arguments), temporaries "
            f"{mib(m.temp_size_in_bytes)}"
        )
    except Exception:  # noqa: BLE001 - backends without a memory analysis
        return "no memory analysis"


def _is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


# ---------------------------------------------------------------- tables


def format_table(table: dict) -> str:
    """Human-readable view: per bucket, each candidate's step time, acceptance, and expected
    tokens/s (acceptance * batch / step time), the choice marked."""
    m = table["model"]
    lines = [
        f"decode calibration: {table['device']}, jax {table['jax']}, {m.get('family')} "
        f"H={m.get('hidden_size')} L={m.get('num_layers')} {m.get('param_dtype')}, drafter "
        f"{table['drafter']}"
    ]
    cols = ["batch", "candidate", "step ms", "tok/step", "tok/s", ""]
    # the compiled programs' temporaries, where the backend reported them (long contexts: what
    # an out-of-memory candidate asked for beside its state and the weights)
    temps = any(c.get("temp_bytes") is not None for e in table["entries"] for c in e["candidates"])
    if temps:
        cols.insert(5, "temp MiB")

    def temp(c) -> list[str]:
        t = c.get("temp_bytes")
        return [] if not temps else ["-" if t is None else f"{t / 2**20:.3g}"]

    rows = []
    for e in table["entries"]:
        ranked = {candidate_id(c): c for c in budget.rank_candidates(table, e)}
        best = next(iter(ranked), None)
        # entries timed over a filled long context: "16 @16384"
        bucket = str(e["batch"]) + (f" @{e['context']}" if e.get("context") else "")
        for c in e["candidates"]:
            cid = candidate_id(c)
            r = ranked.get(cid)
            if r is None:
                rows.append([bucket, cid, "-", "-", "-", *temp(c), c.get("note", "")])
                continue
            rows.append(
                [
                    bucket,
                    cid,
                    f"{r['step_ms']:.3g}",
                    f"{r['tokens_per_step']:.2f}",
                    f"{1e3 * r['tokens_per_ms'] * e['batch']:.4g}",
                    *temp(c),
                    "<- chosen" if cid == best else "",
                ]
            )
    width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, width)).rstrip())
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, width)).rstrip() for r in rows]
    lines.append(
        "tok/step: acceptance (tokens per request per step, pooled over the buckets); "
        "tok/s = batch * tok/step / step time; chosen: the most tok/s"
        + ("; B @L: each request's KV filled to L tokens" if table.get("contexts") else "")
    )
    eos = [
        (e["batch"], k)
        for e in table["entries"]
        if (k := max((c.get("eos_requests") or 0 for c in e["candidates"]), default=0))
    ]
    if eos and table.get("drafter") == "mtp":
        lines.append(
            "EOS: decoded past as an ordinary token by up to "
            + ", ".join(f"{k} of {b}" for b, k in eos)
            + " requests: their text past it is not the workload's"
        )
    return "\n".join(lines)


def rescore_synthetic(table: dict, accept_mean: float, source: str | None = None) -> dict:
    """A synthetic-drafter table re-weighed at another acceptance, its step times kept.

    With the synthetic drafter a step's cost does not depend on p: the forced chain keeps the
    top score, so every draft level runs whatever p is, and every other stage has fixed shapes.
    Measured on one H200 at Qwen3.5-9B dims: the 24 candidates timed at acceptance 3.5 (5799bea)
    and at 6.4 (7f0cccc) agree within 3.5% (docs/budget.md). So a table for another acceptance
    needs only the acceptance recomputed (1 + p + ... + p^min(d, N - 1) at the new p) and the
    choice made again, not a second calibration (about 7 minutes of compilation at 9B dims).
    The result names where its timings came from (`timings_from`)."""
    drafter = str(table.get("drafter", ""))
    if not drafter.startswith("synthetic"):
        raise ValueError(
            f"only a synthetic-drafter table can be re-weighed (this one: drafter {drafter!r}): "
            "a real drafter's acceptance is measured, so calibrate again"
        )
    p = synthetic_accept_prob(accept_mean, max(table["depths"]))
    acceptance = {}
    for e in table["entries"]:
        for c in e["candidates"]:
            if c["mode"] != "ar":
                acceptance[candidate_id(c)] = dict(
                    tokens_per_step=expected_tokens_per_step(p, min(c["depth"], c["nodes"] - 1)),
                    source="synthetic",
                )
    out = json.loads(json.dumps(table))  # a deep copy
    identity = dict(out["identity"], drafter=f"synthetic p={p:.4f}")
    out.update(
        identity=identity,
        key=budget.table_key(identity, out["device"], out["jax"]),
        drafter=f"synthetic p={p:.4f}",
        acceptance=acceptance,
        timings_from=dict(
            source=source,
            drafter=drafter,
            git_commit=table.get("git_commit"),
            created=table.get("created"),
        ),
    )
    for e in out["entries"]:
        for c in e["candidates"]:  # each candidate's own counts were the old p's
            for k in ("tokens_per_step", "tokens_per_s"):
                c.pop(k, None)
    return _with_choices(out)


def save_table(table: dict, path: str | os.PathLike) -> Path:
    """Write `table` (never inside the installed package: `budget.check_writable_location`)."""
    path = budget.check_writable_location(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)  # readers never see half a table
    return path


def merge_tables(old: dict, new: dict) -> dict:
    """`new` with the buckets of `old` it does not re-measure (calibrating in several runs, or
    automatic calibration adding the bucket in use). Acceptance: `new`'s estimates, `old`'s for
    configurations `new` did not measure. Both must describe the same device, model and drafter."""
    same = lambda k: (
        json.dumps(old.get(k), sort_keys=True)
        == json.dumps(
            new.get(k),  # noqa: E731
            sort_keys=True,
        )
    )
    diff = [k for k in ("device", "jax", "model", "drafter") if not same(k)]
    if diff:
        raise ValueError(f"cannot merge calibration tables that differ in {', '.join(diff)}")
    seen = {(e["batch"], e["kv"]) for e in new["entries"]}
    entries = sorted(
        [e for e in old["entries"] if (e["batch"], e["kv"]) not in seen] + new["entries"],
        key=lambda e: (e["kv"], e["batch"]),
    )
    union = lambda k: sorted(set(old.get(k, [])) | set(new.get(k, [])))  # noqa: E731
    return {
        **new,
        "entries": entries,
        "acceptance": {**old.get("acceptance", {}), **new.get("acceptance", {})},
        "batch_buckets": union("batch_buckets"),
        "node_buckets": union("node_buckets"),
        "depths": union("depths"),
    }


def store(table: dict, out: str | os.PathLike | None = None, merge: bool = True) -> Path:
    """Save `table` to `out` (default: the user cache path of its key, `budget.table_path`),
    merged with the table already there (when `merge` and it is compatible)."""
    path = Path(out) if out is not None else budget.table_path(table["identity"])
    if merge and path.is_file():
        try:
            table = merge_tables(budget.load_table(path), table)
        except ValueError:
            pass  # an old or foreign table at that path: replaced
    return save_table(table, path)


# ---------------------------------------------------------------- the engine's first use


def auto_enabled(llm) -> bool:
    """Whether the engine calibrates on first use: `LLM(spec_options={"auto_calibrate": ...})`,
    else `$BOLE_JAX_AUTO_CALIBRATE` (1 / 0), else on for accelerators and off on CPU (there the
    tree kernels run as references: calibrating the demo model's candidates takes minutes on two
    cores; ar is the CPU default, and `bole-jax calibrate` measures the rest)."""
    opt = (llm.spec_options or {}).get("auto_calibrate")
    if opt is not None:
        return bool(opt)
    env = os.environ.get(budget.AUTO_ENV)
    if env is not None:
        return env.strip().lower() not in ("", "0", "false", "no", "off")
    return jax.default_backend() != "cpu"


def ensure_table(llm, batch: int) -> tuple[dict | None, str]:
    """The table for `llm` covering its batch bucket: found in the cache, else (when `auto_enabled`)
    measured now for that bucket alone (`AUTO_SECONDS` at most; a few steps per candidate) and
    stored in the user cache. Returns (table or None, where / why not)."""
    opts = llm.spec_options or {}
    dtype = llm.params["embed"].dtype
    table, where = budget.find_table(
        llm.cfg,
        dtype,
        path=opts.get("calibration"),
        model_dir=llm.path,
        identity=budget.llm_identity(llm),
    )
    b = budget.batch_bucket(batch)
    covered = table is not None and any(e["batch"] == b for e in table["entries"])
    if covered or opts.get("calibration") is not None or not auto_enabled(llm):
        return table, where
    if not (llm.cfg.mtp_num_layers and "mtp" in llm.params):
        return table, where
    import logging

    log = logging.getLogger("bole_jax")
    log.warning(
        "bole_jax: calibrating this model on %s at batch %d (first use, at most ~%.0f s; "
        "`%s` measures every batch bucket)",
        budget.device_name(),
        b,
        AUTO_SECONDS,
        budget.llm_command(llm),
    )
    nodes = (
        CPU_NODES
        if jax.default_backend() == "cpu"
        else AUTO_NODES_LARGE
        if b >= AUTO_LARGE_BATCH
        else AUTO_NODES
    )
    new = calibrate(
        llm,
        [b],
        nodes,
        DEFAULT_DEPTHS,
        steps=AUTO_STEPS,
        repeats=AUTO_REPEATS,
        warm=AUTO_WARM,
        time_budget=AUTO_SECONDS,
        progress=False,
        accept_prob=budget.table_accept_prob(opts),
    )
    path = store(new)
    skipped = [candidate_id(c) for e in new["entries"] for c in e["candidates"] if "note" in c]
    log.warning(
        "bole_jax: calibrated in %.0f s, table %s%s",
        new["seconds"],
        path,
        f"; not timed within the time budget: {', '.join(skipped)} (the choice is among "
        f"the others; `{budget.llm_command(llm)}` times them all)"
        if skipped
        else "",
    )
    return budget.find_table(llm.cfg, dtype, model_dir=llm.path, identity=budget.llm_identity(llm))


def decode_mode(llm, spec: str | None, batch: int, kv: int | None = None) -> str:
    """The mode `LLM.generate(spec=...)` decodes a batch of `batch` requests with.

    spec given: that mode (its tree shape comes from the table, `budget.spec_options_for`). None:
    the table's choice for the batch bucket (any of ar / chain / bole, whichever is expected
    fastest; the table made on first use where `auto_enabled`), else ar (`budget.untabled_mode`).
    kv: the KV capacity the batch decodes at, which picks the table's KV bucket (`budget.choose`:
    a table with long-context entries, `calibrate(contexts=...)`, can choose ar there and a
    tree at short contexts); None: the calibration's own context.
    A model without an MTP head decodes ar; explicit tree options (num_nodes / budget) or the
    synthetic drafter without `spec` mean bole, as before tables chose modes."""
    has_mtp = bool(llm.cfg.mtp_num_layers) and "mtp" in llm.params
    if spec == "ar" or (spec is None and not has_mtp):
        return "ar"
    opts = llm.spec_options or {}
    if spec is None and ({"num_nodes", "budget", "synthetic_accept"} & set(opts)):
        return "bole"
    if has_mtp:
        ensure_table(llm, batch)
    if spec is not None:
        return spec
    c = budget.choice_for(
        llm.cfg,
        llm.params["embed"].dtype,
        batch,
        calibration=opts.get("calibration"),
        model_dir=llm.path,
        kv=kv,
        mode=None,
        identity=budget.llm_identity(llm),
        command=budget.llm_command(llm),
    )
    return c.mode
