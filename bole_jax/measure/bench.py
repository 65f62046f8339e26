"""Decode-throughput benchmark harness (used by `bole-jax bench` and benchmarks/bench_decode.py).

Times the engine's own jitted loop (`LLM.segment_fn`) after prefill: warm-up segment first
(compilation excluded), then a timed run of `steps` loop iterations; throughput counts the tokens
actually emitted in the timed window. Random-weight models use the synthetic-acceptance drafter
(the AR continuation placed in the tree); every row says which drafter produced it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax import compile_cache
from bole_jax.measure import numerics
from bole_jax.measure.calibrate import (  # noqa: F401
    _copy,
    _delete,
    eos_requests,
    expected_tokens_per_step,
    ignore_eos,
    kv_need,
    park_on_host,
    prompt_token_ids,
    settle_compiles,
    synthetic_accept_prob,
    temp_bytes,
    timed_segment,
    unpark,
    with_filler,
)
from bole_jax.measure.calibrate import derive_state as _derive_state
from bole_jax.measure.env import environment, progress_bar
from bole_jax.model import ModelConfig, parallel
from bole_jax.model.cache import GDNCache
from bole_jax.spec_decode import draft_vocab as draft_vocab_mod


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def target_weight_bytes(cfg: ModelConfig, params, batch: int) -> int:
    """Bytes of the target's weights one forward reads: every weight once, the embedding table
    only for the B rows looked up, the lm_head fully (the tied embedding fully when tied)."""
    w = tree_bytes({k: v for k, v in params.items() if k not in ("embed", "mtp")})
    emb = params["embed"]
    w += batch * emb.shape[1] * emb.dtype.itemsize
    if cfg.tie_word_embeddings:
        w += emb.size * emb.dtype.itemsize
    return w


def check_context(context: int) -> None:
    """--context (each request's KV filled to this many tokens) must be a power of two >= 64:
    it is the KV capacity itself."""
    if context < 64 or context & (context - 1):
        raise ValueError(f"--context must be a power of two >= 64, got {context}")


def ar_step_floor_bytes(cfg: ModelConfig, params, cache, batch: int) -> int:
    """Fewest bytes one AR decode step must move: every weight once (the embedding table only
    for the B rows looked up; the lm_head fully), each GDN state read + written, each conv state
    read + written, each attention layer's committed KV read once and one new row written."""
    w = target_weight_bytes(cfg, params, batch)
    state = 0
    lengths = np.asarray(cache.lengths)
    for c in cache.layers:
        if isinstance(c, GDNCache):
            state += 2 * (tree_bytes(c.state) + tree_bytes(c.conv))
        else:
            row = c.k.shape[1] * c.k.shape[3] * c.k.dtype.itemsize * 2  # k and v (heads, D)
            state += int(lengths.sum()) * row + batch * row
    return w + state


def run_mode(llm, ids, mode: str, gen_tokens: int, warm_steps: int, steps: int, oracle=None):
    """Prefill, warm up, then time `steps` loop iterations. Returns a dict of measurements and the
    final state."""
    state = llm.start_batch(ids, gen_tokens, mode=mode, oracle=oracle)
    r, state = timed_segment(llm.segment_fn(mode), llm.params, state, warm_steps, steps, len(ids))
    return dict(mode=mode, **r), state


def print_table(rows: Sequence[dict], cols: Sequence[str]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(cols, width)),
        "-+-".join("-" * w for w in width),
    ]
    lines += [" | ".join(x.ljust(w) for x, w in zip(row, width)) for row in cells]
    out = "\n".join(lines)
    print(out, flush=True)
    return out


def write_json(path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(
            payload,
            f,
            indent=1,
            default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o),
        )


# ============================================================================ end to end
# Offline decode throughput of every mode side by side (`bole-jax bench`,
# benchmarks/bench_e2e.py). docs/budget.md explains the method.

E2E_MODES = ("ar", "bole", "pernode", "chain", "bole-chain", "engine")
# "bole-chain": the chain's shape (one child per node, N = depth + 1) drafted like the chain and
# verified and committed by bole (tree closed form, factors) instead of per-node state snapshots.
# "engine": what `LLM.generate` decodes with when no mode is given (the calibration table's best
# configuration over ar / chain / bole for the batch, `budget.choice_for(mode=None)`), timed as
# its own point so that the choice can be compared with the modes it chose between.
FULL_BATCHES = (1, 4, 16, 32, 64)
QUICK_BATCHES = (1,)
QUICK_TIME_BUDGET = 75.0  # seconds: `bench --quick` ends within about this (plus the last point)
CPU_NOTE = (
    "CPU: the kernels run as references (Pallas in interpret mode, jnp references "
    "elsewhere), so these numbers are not GPU-representative: on a GPU the tree verify "
    "and commit are Pallas kernels"
)
STAGES = ("draft", "select", "verify", "accept", "commit", "emit")
MiB = 2**20


def load_prompts(path) -> list[str]:
    """Prompts from a file: .jsonl (or .jsonl.gz) records with a "prompt" string (HumanEval) or
    a "turns" list (Spec-Bench: the first turn is used), else one prompt per non-empty line."""
    import gzip
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    gz = p.suffix == ".gz"
    with gzip.open(p, "rt", encoding="utf-8") if gz else open(p, encoding="utf-8") as f:
        text = f.read()
    prompts = []
    if (p.name[:-3] if gz else p.name).endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if isinstance(obj, str):
                prompts.append(obj)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            elif isinstance(obj, dict) and obj.get("turns") and isinstance(obj["turns"][0], str):
                prompts.append(obj["turns"][0])
            else:
                raise ValueError(
                    f"{path}:{n}: expected a 'prompt' string or a 'turns' list of strings"
                )
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts in the file")
    return prompts


def memory_per_request(cfg: ModelConfig, mode: str, num_nodes: int, capacity: int, dtype) -> dict:
    """MiB one request holds: committed GDN states (fp32) and conv states, the KV cache at
    `capacity` slots, and one step's verify transients (docs/interfaces.md, GDNVerifyOut): bole's
    token-level factors (the keys k [Hk, dk] in the model's dtype with their fp32 k_scale [Hk];
    u [HV, dv] and gamma [HV] fp32) and pre-conv inputs per node, or the baselines' per-node
    scratch (a full fp32 state and a conv window per node)."""
    it = jnp.dtype(dtype).itemsize
    g, a = len(cfg.gdn_layers), len(cfg.attention_layers)
    hk, hv, dk, dv = (
        cfg.gdn_num_key_heads,
        cfg.gdn_num_value_heads,
        cfg.gdn_key_dim,
        cfg.gdn_value_dim,
    )
    c, w = cfg.conv_dim, cfg.conv_kernel - 1
    if mode == "bole":
        st = g * num_nodes * (hk * dk * it + (hk + hv * dv + hv) * 4)
        cv = g * num_nodes * c * it
    elif mode in ("pernode", "chain"):
        st, cv = g * num_nodes * hv * dk * dv * 4, g * num_nodes * w * c * it
    else:
        st = cv = 0
    return dict(
        gdn_state_mib=g * hv * dk * dv * 4 / MiB,
        conv_state_mib=g * w * c * it / MiB,
        kv_mib=a * capacity * 2 * cfg.num_kv_heads * cfg.head_dim * it / MiB,
        verify_state_mib=st / MiB,
        verify_conv_mib=cv / MiB,
    )


# ---------------------------------------------------------------- step-time breakdown


def stage_functions(cfg: ModelConfig, spec) -> dict:
    """The stages of `step.spec_step`, each its own jitted function, chained by their outputs:

      draft(params, state) -> (pool, ds)          select(state, pool) -> tree
      verify(params, tree, cache) -> (logits, hidden, cache, auxs)      [cache donated]
      accept(tree, logits, state) -> acc          commit(cache, auxs, tree, acc, done) -> cache
      emit(light_state, light_ds, acc, hidden) -> (light_state, light_ds)  [bookkeeping]

    (light_* = the state without caches, so that no stage pays for copying what it passes
    through). Keys are split as spec_step splits them.

    What "verify" and "commit" hold depends on the bole commit (`commit_kind`): eager, the commit
    rebuilds every GDN state (read + write of the fp32 state) besides the conv-state and KV
    commits, and the verify only reads the states; lazy (SpecConfig.lazy_commit), the commit only
    keeps the step's factors and accepted path (`PendingPath`; lazy_rows "gather": gathers the
    path's factor rows) besides the conv-state and KV commits, and the verify folds the previous
    step's path rows into the states and writes them back (the state write moves from the commit
    into the verify)."""
    from bole_jax.spec_decode import drafter, loop, step, verify
    from bole_jax.spec_decode.acceptance import accept

    def keys(state):
        return jax.random.split(state.key, 3)

    def draft(params, state):
        return step.draft(params, cfg, spec, state, keys(state)[1])

    def select(state, pool):
        return step.select(spec, state, pool)

    def verify_(params, tree, cache):
        # The step packs the active requests' nodes; the stage packs every request's.
        tree, packing = step.packed_tree(spec, tree, None)
        hidden, cache, auxs = verify.verify_forward(
            params,
            cfg,
            tree,
            cache,
            mode=spec.mode,
            backend=spec.backend,
            depth_bound=spec.shape.path_nodes,
            packing=packing,
        )
        return verify.verify_logits(params, cfg, hidden, packing), hidden, cache, auxs

    def accept_(tree, logits, state):
        return accept(
            tree,
            logits,
            state.sampling,
            keys(state)[2],
            max_depth=spec.shape.depth,
            max_children=spec.shape.topk,
        )

    def commit(cache, auxs, tree, acc, done):
        return verify.commit(cache, auxs, tree, acc, ~done, mode=spec.mode, cfg=cfg)

    def emit(state, ds, acc, hidden):
        active = ~state.done
        ds = drafter.after_accept(ds, acc.tokens, acc.path, acc.num_accepted, hidden, active)
        state = dataclasses.replace(state, steps=state.steps + active.astype(jnp.int32))
        return loop.emit(state, acc.tokens, acc.num_accepted), ds

    return dict(
        draft=jax.jit(draft),
        select=jax.jit(select),
        verify=jax.jit(verify_, donate_argnums=2),
        accept=jax.jit(accept_),
        commit=jax.jit(commit, donate_argnums=0),
        emit=jax.jit(emit),
    )


def stage_floor_bytes(cfg: ModelConfig, params, state, spec) -> dict:
    """Fewest bytes each stage of one spec step must move, {stage: bytes}, for the decode state
    `state` (its cache lengths: the KV read) and `spec`:

      draft   (MTP layer weights + the draft head: lm_head columns of the draft vocabulary, or
              the whole lm_head) x the draft levels, min(depth, N - 1) (catch-up + root top-k,
              then one level per depth below the first; the CPU's early stop may run fewer)
      select  the pool read (tokens, parents, scores) + the tree written
      verify  the target's weights + the committed KV, GDN and conv states read + the step's
              factors (bole: token-level factors and pre-conv rows per node; pernode / chain: a
              full state and conv window per node) and KV rows written, the verify logits
              [B, N, V] fp32 written
      accept  the logits read + the tree
      commit  bole eager: every GDN state read + written, conv states written; lazy: the conv
              states written (the state write is the next verify's, counted there); pernode /
              chain: the accepted node's state and conv window copied (read + write)
      emit    the emitted tokens and the drafter's pending hidden rows written (their read)
    """
    b = state.next_token.shape[0]
    n, d = spec.shape.num_nodes, spec.shape.draft_levels
    m = spec.shape.pool_size
    mtp = params["mtp"]
    layer_w = tree_bytes({k: v for k, v in mtp.items() if k not in ("draft_head", "draft_ids")})
    if "draft_head" in mtp:
        head = tree_bytes(mtp["draft_head"])
    else:
        head = tree_bytes(params["embed"] if cfg.tie_word_embeddings else params["lm_head"])
    cache = state.cache
    lengths = np.asarray(cache.lengths)
    gdn = conv = kv_read = kv_row = 0
    for c in cache.layers:
        if isinstance(c, GDNCache):
            gdn += tree_bytes(c.state)
            conv += tree_bytes(c.conv)
        else:
            row = c.k.shape[1] * c.k.shape[3] * c.k.dtype.itemsize * 2  # k and v (heads, D)
            kv_read += int(lengths.sum()) * row
            kv_row += row
    dtype = params["embed"].dtype
    mem = memory_per_request(cfg, spec.mode, n, cache.capacity, dtype)
    factors = b * int((mem["verify_state_mib"] + mem["verify_conv_mib"]) * MiB)
    logits = b * n * cfg.vocab_size * 4
    tree = b * n * 4 * 4 + b * 4
    lazy = spec.mode == "bole" and spec.lazy_commit
    if spec.mode == "bole":
        commit = conv if lazy else 2 * gdn + conv
    else:
        commit = 2 * (gdn + conv)
    hid = b * (d + 1) * cfg.hidden_size * jnp.dtype(dtype).itemsize
    return dict(
        draft=d * (layer_w + head),
        select=b * m * 12 + tree,
        verify=(
            target_weight_bytes(cfg, params, b)
            + kv_read
            + gdn
            + conv
            + factors
            + b * n * kv_row
            + logits
            + (gdn if lazy else 0)
        ),
        accept=logits + tree,
        commit=commit,
        emit=b * (d + 1) * 4 + 2 * hid,
    )


def _matrix_elems(tree) -> int:
    """Elements of the matrices (ndim >= 2) in a params tree: what a row's matmuls multiply."""
    return sum(int(x.size) for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) >= 2)


def stage_floor_flops(cfg: ModelConfig, params, state, spec) -> dict:
    """Fewest matmul flops of the stages that multiply weight matrices, {stage: flops}: 2 x the
    weight matrices' elements x the rows they multiply (attention scores and every elementwise
    op left out, so a floor).

      draft   the MTP layer and the draft head over B rows (the root's level), then B x topk rows
              at each of the draft_levels - 1 levels below it (the catch-up of accepted tokens
              and the early stop left out)
      verify  the target's matrices over the verified rows: B x N, or the batch-wide budget's
              packed rows (`KernelOptions.packed_verify`)
      ar      (spec None) the target's matrices over B rows
    MoE models: {} (which experts a row takes is data-dependent)."""
    if cfg.num_experts:
        return {}
    b = state.next_token.shape[0]
    target = _matrix_elems({k: v for k, v in params.items() if k not in ("embed", "mtp")})
    if cfg.tie_word_embeddings:
        target += int(params["embed"].size)
    if spec is None:
        return dict(ar=2 * target * b)
    n, d, k = spec.shape.num_nodes, spec.shape.draft_levels, spec.shape.topk
    mtp = params["mtp"]
    draft_w = _matrix_elems({k_: v for k_, v in mtp.items() if k_ != "draft_ids"})
    if "draft_head" not in mtp:  # the whole lm_head scores the drafts
        draft_w += int((params["embed"] if cfg.tie_word_embeddings else params["lm_head"]).size)
    rows = b * n
    if spec.budget is not None and cfg.kernels.packed_verify:
        rows = max(min(spec.budget, rows), b)
    return dict(draft=2 * draft_w * b * (1 + (d - 1) * k), verify=2 * target * rows)


# Peak dense bf16 matmul rate (TFLOP/s) by device kind, for the compute floors: datasheet figures.
PEAK_TFLOPS_BF16 = {
    "NVIDIA H200": 989.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
}


def peak_tflops(dtype, device_kind: str | None = None) -> float | None:
    """The bf16 peak for bf16 weights (None for other dtypes or an unknown device)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return None
    kind = device_kind or jax.devices()[0].device_kind
    return next((v for k, v in PEAK_TFLOPS_BF16.items() if kind.startswith(k)), None)


# Peak HBM bandwidth (GB/s) by device kind, for the floors' times: the datasheet figures.
PEAK_GBPS = {
    "NVIDIA H200": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA H100": 3350.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
}


def peak_gbps(device_kind: str | None = None) -> float | None:
    kind = device_kind or jax.devices()[0].device_kind
    return next((v for k, v in PEAK_GBPS.items() if kind.startswith(k)), None)


def _light(state, ds):
    return dataclasses.replace(state, cache=None, extra=None), dataclasses.replace(ds, kv=())


def lower_stages(fns: dict, params, state) -> dict:
    """Lower every stage on `state` (arrays or ShapeDtypeStructs), chaining output shapes."""
    low = {"draft": fns["draft"].lower(params, state)}
    pool, ds = low["draft"].out_info
    low["select"] = fns["select"].lower(state, pool)
    tree = low["select"].out_info
    low["verify"] = fns["verify"].lower(params, tree, state.cache)
    logits, hidden, cache, auxs = low["verify"].out_info
    low["accept"] = fns["accept"].lower(tree, logits, state)
    acc = low["accept"].out_info
    low["commit"] = fns["commit"].lower(cache, auxs, tree, acc, state.done)
    low["emit"] = fns["emit"].lower(*_light(state, ds), acc, hidden)
    return low


def _median_ms(fn, reps: int, prepare=None) -> float:
    ts = []
    for _ in range(reps):
        arg = prepare() if prepare else None
        jax.block_until_ready(arg)
        t = time.perf_counter()
        jax.block_until_ready(fn(arg))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def stage_inputs(progs: dict, params, state, reshard: bool = False) -> dict:
    """Every stage's arguments on the same `state`, produced by running the previous stages once:
    name -> a function returning the argument tuple (a fresh copy of a donated cache per call, so
    that each call can donate it).

    reshard (tensor parallelism): a stage was compiled ahead of time from the previous stage's
    output shapes, whose shardings its own compilation chose; its inputs are moved to the
    shardings it was compiled for."""

    def args(name, *a):
        return jax.device_put(a, progs[name].input_shardings[0]) if reshard else a

    a_draft = args("draft", params, state)
    pool, ds = progs["draft"](*a_draft)
    a_select = args("select", state, pool)
    tree = progs["select"](*a_select)
    logits, hidden, vcache, auxs = progs["verify"](
        *args("verify", params, tree, _copy(state.cache))
    )
    a_accept = args("accept", tree, logits, state)
    acc = progs["accept"](*a_accept)
    a_emit = args("emit", *_light(state, ds), acc, hidden)
    return dict(
        draft=lambda: a_draft,
        select=lambda: a_select,
        verify=lambda: args("verify", params, tree, _copy(state.cache)),
        accept=lambda: a_accept,
        commit=lambda: args("commit", _copy(vcache), auxs, tree, acc, state.done),
        emit=lambda: a_emit,
    )


def step_breakdown(progs: dict, params, state, reps: int = 5, reshard: bool = False) -> dict:
    """Median ms of every stage of one step on the same state (each stage timed alone, its
    inputs (`stage_inputs`) made outside the timed region)."""
    inputs = stage_inputs(progs, params, state, reshard)
    return {
        name: _median_ms(lambda a, f=progs[name]: f(*a), reps, make)
        for name, make in inputs.items()
    }


def synthetic_oracle(ar_out: np.ndarray) -> jax.Array:
    """The synthetic drafter's oracle from an AR run's tokens [B, L]: [B, L + 1], the layout
    `LLM.state_after_prefill` gives the oracle (a zero column appended)."""
    return jnp.asarray(np.pad(ar_out, ((0, 0), (0, 1))))


# ---------------------------------------------------------------- in-loop stage split


def _profile_step_module():
    """benchmarks/profile_step.py of this source checkout (its trace reading and HLO parsing)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "profile_step" in sys.modules:
        return sys.modules["profile_step"]
    root = Path(__file__).resolve().parents[2]
    for rel in ("benchmarks/profile_step.py", "benchmarks/profile/profile_step.py"):
        path = root / rel
        if path.is_file():
            spec = importlib.util.spec_from_file_location("profile_step", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["profile_step"] = mod
            spec.loader.exec_module(mod)
            return mod
    raise FileNotFoundError(
        f"--profile-loop reads traces with benchmarks/profile_step.py of a "
        f"source checkout; none under {root}: run from the repository"
    )


# The in-loop profile traces a twin of the timed loop program compiled with these options, per
# backend. On the GPU, XLA captures runs of kernels into CUDA command buffers (graphs), whose
# kernels the trace attributes to the command buffer rather than to their HLO ops: at Qwen3.5-9B
# dims B = 16 that left 6.3 of a 13.0 ms step in no stage (commit faeb9fc). Without command
# buffers every kernel keeps its op and its stage. The launch gaps differ, so the split takes the
# busy time per stage from the twin and the gaps from the timed step; the kernels should be the
# same (one difference found, AR's KV scatter at B = 1, is removed: blocks.write_kv), which the
# profile shows as a busy time above the timed step.
TRACE_COMPILER_OPTIONS = {"gpu": {"xla_gpu_enable_command_buffer": ""}}
TRACE = "trace"  # the compiled twin's key beside (batch, mode)
TOP_OPS = 80  # HLO ops a loop profile keeps


def loop_profile(
    run, params, state, steps: int, n: int, cfg: ModelConfig, spec, step_ms: float | None = None
):
    """Trace `steps` iterations of the compiled loop `run` on `state` (donated) and split the
    loop's device time by stage (profile_step.stage_split, with each stage's floor: its bytes at
    the peak bandwidth, or its matmul flops at the bf16 peak where that is longer).
    `step_ms`: the timed step of the program `run` is a twin of (TRACE_COMPILER_OPTIONS); the
    split's "idle" row is then that step less the traced busy time, so the rows sum to it.
    Returns (profile dict, the state after the traced steps)."""
    import tempfile

    ps = _profile_step_module()
    floors = (
        dict(ar=ar_step_floor_bytes(cfg, params, state.cache, state.next_token.shape[0]))
        if spec is None
        else stage_floor_bytes(cfg, params, state, spec)
    )
    max_steps = jax.device_put(np.int32(steps))  # made here: no transfer inside the trace
    s0 = np.asarray(state.steps).copy()
    with tempfile.TemporaryDirectory(prefix="bench_loop_") as d:
        with jax.profiler.trace(d, profiler_options=ps._trace_options()):
            t = time.perf_counter()
            state = run(params, state, max_steps)
            jax.block_until_ready(state)
            dt = time.perf_counter() - t
        how, events = ps.read_trace(d)
    nsteps = max(int((np.asarray(state.steps) - s0)[:n].max()), 1)
    r = ps.summarise(events, nsteps, ps._hlo_text(run))
    r["wall_ms_per_rep"] = 1e3 * dt / nsteps
    gbps = peak_gbps()
    tflops = peak_tflops(params["embed"].dtype)
    split = ps.stage_split(
        r,
        ("ar",) if spec is None else STAGES,
        floors,
        gbps,
        step_ms=step_ms,
        flops=stage_floor_flops(cfg, params, state, spec),
        tflops=tflops,
    )
    prof = dict(
        steps=nsteps,
        step_ms=step_ms,
        wall_ms_per_step=r["wall_ms_per_rep"],
        busy_ms_per_step=r["busy_ms_per_rep"],
        active_ms_per_step=r["active_ms_per_rep"],
        events_from=r["events_from"],
        attributed_share=r["attributed_share"],
        peak_gbps=gbps,
        peak_tflops=tflops,
        trace=how,
        stage_split=split,
        # the loop's costliest HLO ops (kernel time per step, kernels per step, stage, source)
        top_ops=[
            {k: op.get(k) for k in ("hlo_op", "ms_per_rep", "calls_per_rep", "stage", "source")}
            for op in r["hlo_ops"][:TOP_OPS]
        ],
    )
    return prof, state


def profile_points(profiles, plan, params, cfg, a, gen, p, steps: int, progs) -> list[dict]:
    """`--profile-loop`: trace each timed point's loop once every point of the run is timed, so
    that no timed window follows a trace. (Traced between its prompt sets, the demo model's AR
    step read 1.11 ms in one run against 0.35-0.37 ms in three runs that traced nothing; one
    H200, 4cd2a9e; why was not established.) Each point is prefilled again (its first prompt
    set), derived, and advanced through its warm-up and timed window uninstrumented, so that the
    traced steps see the context the timed ones did; its row gets the split (`loop_profile`).
    Returns the errors."""
    errors, base_of, base = [], None, None  # one batch's prefill at a time (profiles: batch order)
    low_memory = getattr(a, "batch_modes", None) is not None
    for b, m, run, rm, spec, oracle, row in profiles:
        pl = plan[b]
        prefill = lambda: _prefill(pl, gen, p is not None, a.stop_at_eos)  # noqa: E731
        try:
            # the loop donates its state: the oracle, shared by the batch's modes, is copied
            ora = None if oracle is None or rm == "ar" else jnp.copy(oracle)
            if low_memory:  # a throw-away prefill per point, derived in place
                state = _derive_state(prefill(), rm, spec, cfg, ora, copy=False)
            else:
                if base_of != b:
                    base_of, base = b, None  # the last batch's prefill freed first
                    base = prefill()
                state = _derive_state(base, rm, spec, cfg, ora)
            state = run(params, state, jnp.int32(a.warm + a.steps))
            twin = progs.get((b, m, TRACE))
            row["loop_profile"], state = loop_profile(
                twin or run,
                params,
                state,
                steps,
                len(pl["ids"]),
                cfg,
                spec,
                step_ms=row["step_ms"],
            )
            # the timed program itself where no twin was compiled (CPU, or its compilation
            # missed the deadline): command buffers then hide stages
            row["loop_profile"]["traced"] = "twin" if twin else "timed program"
            del state
        except (RuntimeError, OSError) as e:  # a trace that cannot be read is a result
            errors.append(dict(batch=b, mode=m, error=f"profile: {_short(e)}"))
    return errors


# ---------------------------------------------------------------- the run


def _int_or(value, flag: str, words: tuple[str, ...]):
    v = str(value).lower()
    if v in words:
        return v
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{flag} must be a positive int or one of {words}, got {value!r}")
    return n


def _check_e2e_args(a) -> None:
    from bole_jax.spec_decode.budget import MAX_NODES

    if a.quick:
        a.steps, a.warm, a.breakdown_reps = (
            min(a.steps, 8),
            min(a.warm, 2),
            min(a.breakdown_reps, 3),
        )
    # Unset options take the run's defaults: --quick is a smoke run (two batches, no per-stage
    # breakdown, a short time budget: every program compiles, and on a 2-core CPU each costs
    # seconds); a full run measures five batches and splits the step at B = 16.
    if a.batch is None:
        a.batch = list(QUICK_BATCHES if a.quick else FULL_BATCHES)
    if a.dtype is None and a.model is None and jax.default_backend() == "cpu":
        a.dtype = "float32"  # bf16 matmuls are emulated on CPU (LLM's CPU default too)
    if a.breakdown_batch is None:
        a.breakdown_batch = 0 if a.quick else 16
    if a.time_budget is None:
        a.time_budget = QUICK_TIME_BUDGET if a.quick else 480.0
    if a.preset is None and a.model is None:
        a.preset = "qwen3.5-9b"
    if a.model is not None and a.prompts_file is None:
        raise ValueError(
            "--model needs --prompts-file (HumanEval .jsonl with 'prompt', Spec-Bench "
            ".jsonl with 'turns', or one prompt per line)"
        )
    if a.preset is not None and a.prompts_file is not None:
        raise ValueError("--prompts-file goes with --model (presets decode random prompts)")
    if getattr(a, "prompt_sets", 1) < 1:
        raise ValueError(f"--prompt-sets must be >= 1, got {a.prompt_sets}")
    if getattr(a, "prompt_sets", 1) > 1 and a.model is None:
        raise ValueError(
            "--prompt-sets goes with --model (a preset's random prompts and synthetic drafter "
            "measure the same acceptance in every set)"
        )
    if a.prompts_file is not None and not os.path.isfile(a.prompts_file):
        raise FileNotFoundError(f"prompts file not found: {a.prompts_file}")
    if not a.batch or min(a.batch) < 1:
        raise ValueError(f"--batch sizes must be >= 1, got {a.batch}")
    for name in ("steps", "prompt_len", "topk", "depth", "breakdown_reps", "compile_workers"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(a, "rounds", 1) < 1:
        raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
    if getattr(a, "profile_loop", 0) < 0:
        raise ValueError("--profile-loop must be >= 0 (traced steps per point; 0 = off)")
    if a.warm < 0 or a.breakdown_batch < 0 or a.time_budget <= 0:
        raise ValueError("--warm and --breakdown-batch must be >= 0, --time-budget > 0")
    a.nodes = _int_or(a.nodes, "--nodes", ("auto",))
    a.budget = _int_or(a.budget, "--budget", ("auto", "none"))
    if a.nodes != "auto" and a.nodes > MAX_NODES:
        raise ValueError(f"--nodes {a.nodes} is above {MAX_NODES} (the Pallas tree kernels' limit)")
    ctx = getattr(a, "context", None)
    if ctx is not None:
        check_context(ctx)
    if a.accept_prob is not None and not 0.0 < a.accept_prob <= 1.0:
        raise ValueError(f"--accept-prob must lie in (0, 1], got {a.accept_prob}")
    a.modes = list(dict.fromkeys(a.modes))
    a.batch = sorted(set(a.batch))


def _e2e_model(a):
    """(cfg, params, prompt token-id lists, synthetic drafter?)."""
    from bole_jax.llm import LLM
    from bole_jax.model.mtp import require_mtp
    from bole_jax.model.presets import peaked_lm_head, preset

    tp = getattr(a, "tp", 1)
    draft_vocab = getattr(a, "draft_vocab", None)
    if a.model is not None:
        llm = LLM(a.model, dtype=a.dtype, tp=tp, draft_vocab=draft_vocab)
        if llm.tokenizer is None:
            raise ValueError(f"{a.model} has no tokenizer.json: prompts cannot be encoded")
        if any(m != "ar" for m in a.modes):
            require_mtp(llm.cfg, llm.params)
        ids = prompt_token_ids(llm.tokenizer, load_prompts(a.prompts_file), a.prompt_len)
        return llm.cfg, llm.params, ids, False
    cfg = preset(a.preset, mtp=True, tp=parallel.check_tp(tp))
    dtype = a.dtype or "bfloat16"
    parallel.log_layout(cfg)
    params = parallel.init_params(cfg, jax.random.key(a.seed), dtype)  # on the mesh when tp > 1
    params = peaked_lm_head(params, cfg)  # keeps the synthetic oracle valid in bf16 (presets.py)
    if draft_vocab is not None:  # the synthetic drafter forces its chain whatever the subset
        params, source = draft_vocab_mod.restrict(params, cfg, draft_vocab)
        print(f"drafter: {draft_vocab} of {cfg.vocab_size} tokens ({source})", flush=True)
    rng = np.random.default_rng(a.seed)
    ids = rng.integers(0, cfg.vocab_size, (max(a.batch), a.prompt_len)).tolist()
    return cfg, params, ids, True


def _commit_kind(spec) -> str:
    """What the breakdown's "commit" stage holds for this spec (`stage_functions`)."""
    if spec.mode != "bole":
        return "copy"  # pernode / chain: the accepted node's scratch state is copied
    return "lazy" if spec.lazy_commit else "eager"


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def ar_logits(llm, prompt, cont, pos: int) -> np.ndarray:
    """AR's logits [V] fp32 for generated position `pos` (teacher forcing: one forward over
    prompt + cont[:pos])."""
    from bole_jax.model import forward, init_cache
    from bole_jax.model import logits as lm_logits

    cfg, params = llm.cfg, llm.params
    seq = list(prompt) + list(cont[:pos])
    cache = init_cache(cfg, 1, len(seq) + 8, params["embed"].dtype)
    h, _ = jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray([seq]), cache)
    return np.asarray(lm_logits(params, cfg, h[:, -1]), np.float32)[0]


def top2_gap(logits: np.ndarray) -> float:
    """The gap between the two largest logits of [V] (`numerics.top2`)."""
    return float(numerics.top2(np.asarray(logits))[1])


def divergence_info(logits: np.ndarray, ar_token: int, token: int) -> dict:
    """Where a spec mode's token differs from AR's: the teacher-forced logits' top-2 gap, and
    each token's rank (0 = the argmax) and distance below the top logit. A mode token at rank 0
    means the forward agrees with the mode and AR's own decode step left it."""
    top = float(np.max(logits))
    rank = lambda t: int(np.sum(logits > logits[t]))  # noqa: E731
    return dict(
        top2_gap=top2_gap(logits),
        token_rank=rank(token),
        token_deficit=top - float(logits[token]),
        ar_token_rank=rank(ar_token),
        ar_token_deficit=top - float(logits[ar_token]),
    )


def ar_top2_gap(llm, prompt, cont, pos: int) -> float:
    """AR logit gap between the best two tokens at generated position `pos`. A small gap at a
    spec mode's first divergence from AR says a near-tie flipped (the tree kernels sum in another
    order than the decode kernels)."""
    return top2_gap(ar_logits(llm, prompt, cont, pos))


def _plan_batch(a, cfg, params, ids, spec_modes, run_ar, p, gen, longest=None) -> dict:
    """Tree width / budget for this batch and one LLM per mode (all sharing `params`). longest:
    the longest prompt the batch's state must hold (default: of `ids`; `--prompt-sets`: of every
    set, so that each set is prefilled to the same KV capacity and one program serves them)."""
    from bole_jax.llm import LLM
    from bole_jax.spec_decode import budget as budget_mod

    b = len(ids)
    only = getattr(a, "batch_modes", None)
    if only is not None:  # the modes timed at this batch (bench_capacity: each at its own batch)
        spec_modes = [m for m in spec_modes if m in only.get(b, ())]
        run_ar = run_ar and ("ar" in only.get(b, ()) or (p is not None and bool(spec_modes)))
    dtype = params["embed"].dtype
    longest = longest or max(map(len, ids))
    # the KV capacity the table's choice is looked up at: --context's (filled) when given
    kv_guess = getattr(a, "context", None) or 1 << (longest + gen).bit_length()
    nv = (
        int(params["mtp"]["draft_ids"].shape[0])
        if draft_vocab_mod.has_draft_vocab(params)
        else None
    )
    ident = budget_mod.model_identity(
        cfg,
        dtype,
        a.model,
        draft_vocab=nv,
        drafter="mtp" if p is None else f"synthetic p={p:.4f}",
    )
    cmd = budget_mod.calibrate_command(a.model, preset=a.preset)

    def table_choice(mode, quiet=False):  # the table's choice for this batch ("bole": its best
        # tree of --topk children per node; None: any mode and shape)
        return budget_mod.choice_for(
            cfg,
            dtype,
            b,
            calibration=a.calibration,
            model_dir=a.model,
            kv=kv_guess,
            mode=mode,
            identity=ident,
            command=cmd,
            topk=None if mode is None else a.topk,
            quiet=quiet,
        )

    if a.nodes == "auto":
        # no notice about a tree width where no tree mode runs (e.g. --modes ar chain)
        choice = table_choice("bole", quiet=not {"bole", "pernode"} & set(spec_modes))
    else:
        choice = budget_mod.BudgetChoice(a.nodes, None, "--nodes")
    k = {"auto": choice.budget, "none": None}.get(a.budget, a.budget)
    llms, real, echoice = {}, {}, None
    for m in (["ar"] if run_ar else []) + spec_modes:
        if m == "bole-chain":
            opts = dict(
                topk=1,
                depth=a.depth,
                num_nodes=a.depth + 1,
                backend=a.backend,
                synthetic_accept=p,
                lazy_commit=getattr(a, "lazy_commit", False),
            )
            llms[m] = LLM(cfg, params=params, max_batch_size=b, spec_options=opts)
            real[m] = "bole"
            continue
        if m == "engine":
            echoice = table_choice(None)
            real[m] = echoice.mode
            opts = (
                {}
                if echoice.mode == "ar"
                else dict(echoice.spec_options(), backend=a.backend, synthetic_accept=p)
            )
            llms[m] = LLM(cfg, params=params, max_batch_size=b, spec_options=opts)
            continue
        opts = (
            {}
            if m == "ar"
            else dict(
                topk=a.topk,
                depth=a.depth,
                backend=a.backend,
                synthetic_accept=p,
                num_nodes=choice.num_nodes,
                budget=None if m == "chain" else k,
                lazy_commit=getattr(a, "lazy_commit", False),
            )
        )
        llms[m] = LLM(cfg, params=params, max_batch_size=b, spec_options=opts)
        real[m] = m
    specs = {m: llms[m]._spec_config(real[m]) for m in spec_modes if real[m] != "ar"}
    slack = {m: specs[m].slack if m in specs else 0 for m in llms}
    # The prefill is done once, laid out for the mode with the most MTP draft scratch.
    base = max(llms, key=lambda m: specs[m].shape.draft_slots if m in specs else -1)
    fill = 0
    if getattr(a, "context", None):
        # Each request's KV holds `context` tokens: its prompt, filler rows (read by attention
        # like real context), then the generation. Capacity = context (a power of two).
        need = kv_need(longest, gen, slack)
        fill = a.context - need
        if fill < 0:
            raise ValueError(f"--context {a.context} < prompt + generation ({need} tokens)")
    return dict(
        ids=ids,
        longest=longest,
        fill=fill,
        choice=choice,
        engine_choice=echoice,
        real=real,
        llms=llms,
        specs=specs,
        base_mode=base,
        extra_capacity=max(slack.values()) - slack[base],
        # bench_capacity: the state holds exactly the admitted requests (no power-of-two padding)
        rows=b if getattr(a, "exact_batch", False) else None,
    )


def _batch_shapes(pl: dict, gen: int, synthetic: bool, stop_at_eos: bool):
    """The shapes of `_prefill(pl)` without holding its state: one request (the longest prompt,
    so that the KV capacity is the batch's) prefilled in the batch's layout, its batched leaves
    widened to the batch's rows (every leaf but the shared PRNG key and EOS ids)."""
    b = pl["rows"] or 1 << (len(pl["ids"]) - 1).bit_length()  # start_batch's rows
    one = _prefill(dict(pl, ids=[max(pl["ids"], key=len)], rows=1), gen, synthetic, stop_at_eos)
    shapes = jax.eval_shape(lambda x: x, one)
    _delete(one)
    wide = lambda s: jax.ShapeDtypeStruct((b,) + s.shape[1:], s.dtype)  # noqa: E731
    rows = jax.tree.map(wide, dataclasses.replace(shapes, key=None, eos=None))
    return dataclasses.replace(rows, key=shapes.key, eos=shapes.eos)


def _prefill(pl: dict, gen: int, synthetic: bool, stop_at_eos: bool):
    m, b = pl["base_mode"], len(pl["ids"])
    rm = pl["real"][m]
    oracle = [[0]] * b if synthetic and rm != "ar" else None  # the AR run fills it in later
    st = pl["llms"][m].start_batch(
        pl["ids"],
        gen,
        mode=rm,
        # every prompt set of the batch at the capacity of its longest prompt
        extra_capacity=pl["extra_capacity"] + pl["longest"] - max(map(len, pl["ids"])) + pl["fill"],
        oracle=oracle,
        rows=pl["rows"],
    )
    st = with_filler(st, pl["fill"])  # committed context (docs/benchmarks.md, memory)
    if not stop_at_eos:  # EOS is an ordinary token, the first one included (`ignore_eos`)
        st = ignore_eos(st)
    return jax.block_until_ready(st)


def prompt_sets(ids: list, b: int, k: int) -> list[list]:
    """Up to `k` disjoint sets of `b` prompts for a batch of `b` (`--prompt-sets`): set j holds
    prompts j*b .. j*b + b - 1; as many whole sets as the prompts give, at least one (the first b,
    cycled where there are fewer)."""
    n = max(1, min(k, len(ids) // b))
    return [[ids[(j * b + i) % len(ids)] for i in range(b)] for j in range(n)]


def same_as_ar(state, ar_out: np.ndarray, n: int) -> list[np.ndarray]:
    """Per request of the first `n`: which of its emitted tokens equal AR's (a boolean array)."""
    num_out, out = np.asarray(state.num_out), np.asarray(state.out)
    return [out[i, : num_out[i]] == ar_out[i, : num_out[i]] for i in range(n)]


def agreement_interval(fracs, level: float = 0.95, reps: int = 2000, seed: int = 0) -> list:
    """[lo, hi]: a bootstrap interval (over requests) of the mean of per-request agreement
    fractions. Greedy agreement in bf16 is decided by the few requests that meet a near-tie, so
    two modes' agreements are told apart only where their intervals are."""
    x = np.asarray(fracs, np.float64)
    if x.size == 0:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, (reps, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    return [float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))]


def pool_windows(windows: list[dict]) -> dict:
    """Timed windows of one program on several prompt sets as one measurement: their tokens,
    steps and times summed (step time = total time / total loop steps)."""
    if len(windows) == 1:
        return windows[0]
    tot = {k: sum(w[k] for w in windows) for k in ("time_s", "tokens", "loop_steps")}
    req = sum(w["request_steps"] for w in windows)
    return dict(
        windows[0],
        **tot,
        request_steps=req,
        step_ms=1e3 * tot["time_s"] / max(tot["loop_steps"], 1),
        tokens_per_s=tot["tokens"] / tot["time_s"],
        tokens_per_step=tot["tokens"] / max(req, 1),
        set_step_ms=[w["step_ms"] for w in windows],
        set_tokens_per_step=[w["tokens_per_step"] for w in windows],
    )


class _SetStates:
    """A batch's further prompt sets (`--prompt-sets`, real drafters only): each prefilled once,
    in the first set's layout and KV capacity, and decoded by every mode's compiled program like
    the first set; AR's outputs kept as each set's agreement reference."""

    def __init__(self, pl: dict, sets: list, gen: int, stop_at_eos: bool):
        self.pl, self.sets, self.gen, self.stop_at_eos = pl, sets, gen, stop_at_eos
        self.bases, self.ar_out, self.same, self.eos = {}, {}, {}, {}

    def base(self, j: int):
        if j not in self.bases:
            pl = dict(self.pl, ids=self.sets[j])
            self.bases[j] = _prefill(pl, self.gen, False, self.stop_at_eos)
        return self.bases[j]

    def run(self, m, run, params, rm, spec, cfg, warm, steps, gen, timing=False) -> list[dict]:
        """Mode `m`'s timed window on every further set (AR then runs to the end of `gen`;
        `timing`: the windows only, for `--rounds`)."""
        windows, n = [], len(self.pl["ids"])
        eos_ids = self.pl["llms"][m].eos_ids
        for j in range(len(self.sets)):
            state = _derive_state(self.base(j), rm, spec, cfg)
            r, state = timed_segment(run, params, state, warm, steps, n)
            windows.append(r)
            if timing:
                del state
                continue
            if m == "ar":
                state = run(params, state, jnp.int32(gen))
                self.ar_out[j] = np.asarray(state.out)
            if j in self.ar_out:  # each request's tokens against AR's on this set
                same = same_as_ar(state, self.ar_out[j], n)
                self.same[m] = self.same.get(m, []) + same
            if not self.stop_at_eos:
                self.eos[m] = self.eos.get(m, 0) + eos_requests(state, n, eos_ids)
            del state
        return windows

    def close(self) -> None:
        for st in self.bases.values():
            _delete(st)
        self.bases.clear()


def run_e2e(a) -> dict:
    """Offline decode throughput of the selected modes at each batch size, side by side.

    Method (docs/budget.md): one prefill per batch, shared by all modes (same prompts, same KV
    capacity); every decode program (one per mode and batch, plus the breakdown stages) is lowered
    in this thread and compiled in `compile_workers` threads, and all compilation finishes before
    anything is timed (XLA autotunes on the device while it compiles); per point: `warm` untimed
    steps, then `steps` timed steps of the engine's own jitted loop. Presets: random weights and
    the synthetic-acceptance drafter, whose oracle is the AR continuation of the same prompts (the
    AR point runs first and continues to the end of the generation budget; `ar_agreement` is the
    fraction of each mode's tokens equal to AR's). Compilation gets 80% of `time_budget`; points
    not started within `time_budget` are skipped. Failed points are recorded, not fatal.
    Returns the result dict (also written as JSON under `out`)."""
    import concurrent.futures as cf
    import sys
    import traceback

    t_start = time.perf_counter()
    _check_e2e_args(a)
    deadline = t_start + a.time_budget
    if a.compile_cache:  # the CLI has already enabled it; idempotent ("none" = off)
        compile_cache.enable(a.compile_cache)
    env = environment()
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if env["platform"] == "cpu":
        say(f"[bench] {CPU_NOTE}")
    cfg, params, ids_all, synthetic = _e2e_model(a)
    if not ids_all:
        raise ValueError("no prompts left after tokenisation")
    dtype = params["embed"].dtype
    spec_modes = [m for m in a.modes if m != "ar"]
    run_ar = "ar" in a.modes or (synthetic and bool(spec_modes))
    p = None
    if synthetic and spec_modes:
        p = (
            a.accept_prob
            if a.accept_prob is not None
            else synthetic_accept_prob(a.accept_mean, a.depth)
        )
    prof_steps = getattr(a, "profile_loop", 0) or 0
    # no request finishes inside the timed window (nor the profiled one)
    gen = 1 + (a.warm + a.steps + prof_steps) * (a.depth + 1)
    phases = dict(setup_s=time.perf_counter() - t_start)
    say(
        f"[bench] {a.preset or a.model}: {cfg.num_layers} layers, {dtype}, {env['device']}; "
        f"modes {a.modes}, batches {a.batch}, {gen} tokens per request"
        + (f", synthetic drafter p={p:.4f}" if p is not None else "")
    )
    sets = {b: prompt_sets(ids_all, b, getattr(a, "prompt_sets", 1)) for b in a.batch}
    plan = {
        b: _plan_batch(
            a,
            cfg,
            params,
            sets[b][0],
            spec_modes,
            run_ar,
            p,
            gen,
            longest=max(len(x) for st in sets[b] for x in st),
        )
        for b in a.batch
    }

    t = time.perf_counter()
    workers = cf.ThreadPoolExecutor(a.compile_workers)  # prefill compilations overlap too
    # At the memory limit (bench_capacity), one decode state on the device at a time and none
    # parked on the host (the batches of a capacity run together outgrow host memory): each
    # point is prefilled just before it runs, and the programs are lowered for shapes taken from
    # a one-request prefill of each batch's layout (`_batch_shapes`).
    low_memory = getattr(a, "batch_modes", None) is not None
    shapes_of = {}  # the prefilled states' shapes, for lowering
    if low_memory:
        bases = {b: None for b in a.batch}
        for b in a.batch:
            shapes_of[b] = _batch_shapes(plan[b], gen, p is not None, a.stop_at_eos)
    else:
        bases = dict(
            zip(
                a.batch,
                workers.map(
                    lambda b: _prefill(plan[b], gen, p is not None, a.stop_at_eos), a.batch
                ),
            )
        )
    for b in bases:
        if b not in shapes_of:  # (parked states are no arrays: their shapes are recorded)
            shapes_of[b] = jax.eval_shape(lambda x: x, bases[b])
    phases["prefill_s"] = time.perf_counter() - t

    # ---- lower here (tracing holds the GIL), compile in the worker threads
    t = time.perf_counter()
    bd_batch = 0
    if a.breakdown_batch and spec_modes:
        bd_batch = min(a.batch, key=lambda b: (abs(b - a.breakdown_batch), b))
    jobs = {}
    # AR programs first, for every batch: the spec points need the AR run as their oracle and
    # reference, and at 9B dims the AR segments were the last to finish compiling.
    order = sorted(((b, m) for b in a.batch for m in plan[b]["llms"]), key=lambda bm: bm[1] != "ar")
    for b, m in order:
        pl = plan[b]
        rm = pl["real"][m]
        shapes = parallel.annotate(
            jax.eval_shape(lambda s: _derive_state(s, rm, pl["specs"].get(m), cfg), shapes_of[b]),
            cfg,
        )
        low = pl["llms"][m].segment_fn(rm).lower(params, shapes, jnp.int32(0))
        jobs[b, m] = workers.submit(low.compile)
        trace_opts = TRACE_COMPILER_OPTIONS.get(jax.default_backend())
        if prof_steps and trace_opts:
            jobs[b, m, TRACE] = workers.submit(
                functools.partial(low.compile, compiler_options=trace_opts)
            )
    if bd_batch:
        for m in [m for m in spec_modes if m in (a.breakdown_modes or spec_modes)]:
            if m == "engine":  # the chosen configuration's stages are those of its mode
                continue
            spec, rm = plan[bd_batch]["specs"][m], plan[bd_batch]["real"][m]
            shapes = parallel.annotate(
                jax.eval_shape(lambda s: _derive_state(s, rm, spec, cfg), shapes_of[bd_batch]),
                cfg,
            )
            for name, low in lower_stages(stage_functions(cfg, spec), params, shapes).items():
                jobs[bd_batch, m, name] = workers.submit(low.compile)
    phases["lower_s"] = time.perf_counter() - t
    if not low_memory:
        bases.update(park_on_host({b: bases[b] for b in a.batch[1:]}))

    # ---- wait for every program before timing anything
    t = time.perf_counter()
    compile_deadline = t_start + 0.8 * a.time_budget
    left = set(jobs.values())
    with progress_bar(len(left), "compile", "prog") as bar:
        while left:
            done, left = cf.wait(
                left,
                timeout=max(compile_deadline - time.perf_counter(), 0.0),
                return_when=cf.FIRST_COMPLETED,
            )
            if not done:
                break
            bar.update(len(done))
    pending = settle_compiles(left)  # none compiles beside a timed loop
    progs, errors, skipped = {}, [], []
    for key, fut in jobs.items():
        if fut.cancelled():
            continue
        try:
            progs[key] = fut.result()
        except Exception as e:  # noqa: BLE001 - one program failing is a result, not the end
            traceback.print_exc()
            errors.append(dict(batch=key[0], mode=key[1], error=f"compile {key[2:]}: {_short(e)}"))
    workers.shutdown(wait=False)
    if pending:
        before = phases["setup_s"] + phases["prefill_s"] + phases["lower_s"]
        say(
            f"[bench] {pending} programs not started compiling {0.8 * a.time_budget:.0f} s into "
            f"the run (80% of --time-budget, counted from the start; setup, prefill and lowering "
            f"took {before:.0f} s; the compilations running then were awaited): their points are "
            "skipped (raise --time-budget or --compile-workers)"
        )
    phases["compile_s"] = time.perf_counter() - t

    def extra_rounds(b, timed, first_state, more) -> None:
        """`--rounds R`: R - 1 more timed rounds of every mode timed at batch `b`, the modes
        interleaved (ar, chain, ..., ar, chain, ...) so that a drift of the device between
        rounds reaches each mode alike. Each row keeps every round's step time and throughput
        and reports its median round; `round_speedup_vs_ar` pairs each round with AR's."""
        n = len(plan[b]["ids"])
        done = {m: [t[5]] for m, t in timed.items()}
        for k in range(1, a.rounds):
            if time.perf_counter() > deadline:
                skipped.append(dict(batch=b, mode="*", reason=f"rounds {k + 1}-: time budget"))
                break
            for m, (run, rm, spec, ora, _, _) in timed.items():
                try:
                    r, state = timed_segment(
                        run, params, first_state(rm, spec, ora), a.warm, a.steps, n
                    )
                    del state
                    extra = more.run(m, run, params, rm, spec, cfg, a.warm, a.steps, gen, True)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    errors.append(dict(batch=b, mode=m, error=f"round {k + 1}: {_short(e)}"))
                    continue
                done[m].append(pool_windows([r] + extra))
        for m, rs in done.items():
            row = timed[m][4]
            med = sorted(rs, key=lambda x: x["step_ms"])[(len(rs) - 1) // 2]  # the lower median
            row.update({k: v for k, v in med.items() if k != "batch"})
            row.update(
                rounds=len(rs),
                round_step_ms=[x["step_ms"] for x in rs],
                round_tokens_per_s=[x["tokens_per_s"] for x in rs],
            )
            say(
                f"[bench] B={b:<3d} {m:8s} {len(rs)} rounds: step "
                + " / ".join(f"{x['step_ms']:.3f}" for x in rs)
                + f" ms (median {med['step_ms']:.3f})"
            )

    # ---- run the points, batch by batch; AR first (the oracle and the agreement reference)
    t = time.perf_counter()
    rows, breakdown, diverged, profiles = [], [], [], []
    for b in a.batch:
        pl = plan[b]
        parked = bases.pop(b)
        base = None if low_memory else unpark(parked)
        fresh = lambda: _prefill(pl, gen, p is not None, a.stop_at_eos)  # noqa: E731
        n = len(pl["ids"])
        ar_out = oracle = None
        more = _SetStates(pl, sets[b][1:], gen, a.stop_at_eos)  # --prompt-sets: sets 1..K-1

        def first_state(rm, spec, ora, base=base):
            if low_memory:  # this point's own prefill, derived in place (the oracle is shared
                # by the batch's modes and the loop donates its state: a copy)
                ora = None if ora is None else jnp.copy(ora)
                return _derive_state(fresh(), rm, spec, cfg, ora, copy=False)
            return _derive_state(base, rm, spec, cfg, ora)

        timed = {}  # --rounds: per mode, what re-times it, its row and its first round
        for m in pl["llms"]:
            reason = (
                "time budget"
                if time.perf_counter() > deadline
                else "not compiled"
                if (b, m) not in progs
                else "no AR oracle"
                if pl["real"][m] != "ar" and p is not None and oracle is None
                else None
            )
            if reason:
                skipped.append(dict(batch=b, mode=m, reason=reason))
                continue
            spec = pl["specs"].get(m)
            try:
                run = progs[b, m]
                rm = pl["real"][m]
                ora = oracle if p is not None else None
                state = first_state(rm, spec, ora)
                r, state = timed_segment(run, params, state, a.warm, a.steps, n)
                if m == "ar":  # continue to the end of the generation budget
                    state = run(params, state, jnp.int32(gen))
                    ar_out = np.asarray(state.out)
                    oracle = synthetic_oracle(ar_out)
                windows = [r] + more.run(m, run, params, rm, spec, cfg, a.warm, a.steps, gen)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                errors.append(dict(batch=b, mode=m, error=_short(e)))
                say(f"[bench] B={b} {m}: failed ({_short(e)})")
                continue
            out = np.asarray(state.out)
            agree, diverge, agree_ci, n_diverged = None, None, None, None
            if ar_out is not None:
                same = same_as_ar(state, ar_out, n)
                # per request of the first set: the first generated position that differs from
                # AR (None: identical); the agreement is over the requests of every set
                diverge = [None if x.all() else int(np.argmin(x)) for x in same]
                every = same + more.same.get(m, [])
                fracs = [np.mean(x) for x in every]
                agree = float(np.mean(fracs))
                agree_ci = agreement_interval(fracs)
                n_diverged = [int(sum(not x.all() for x in every)), len(every)]
            r = pool_windows(windows)
            cap = state.cache.capacity
            nodes = spec.shape.num_nodes if spec else 1
            temp = temp_bytes(run)  # the loop's temporaries (bench_capacity checks the plan)
            ec = pl["engine_choice"] if m == "engine" else None
            # requests whose text went past an EOS (kept as an ordinary token: `ignore_eos`); a
            # real model's tokens there are no longer the workload's
            n_eos = (
                eos_requests(state, n, pl["llms"][m].eos_ids) + more.eos.get(m, 0)
                if p is None and not a.stop_at_eos
                else None
            )
            row = dict(
                mode=m,
                batch=b,
                nodes=nodes,
                budget=(spec.budget if spec else None) or "-",
                width_from=(
                    ec.source
                    if ec
                    else pl["choice"].source
                    if spec and m not in ("chain", "bole-chain")
                    else "-"
                ),
                chosen=(
                    None
                    if ec is None
                    else ec.mode
                    if ec.mode == "ar"
                    else f"{ec.mode} N={spec.shape.num_nodes} d={spec.shape.depth}"
                    + (f" k={spec.shape.topk}" if ec.mode == "bole" else "")
                    + (f" K={spec.budget}" if spec.budget else "")
                ),
                **{k: v for k, v in r.items() if k != "batch"},
                ar_agreement=agree,
                ar_agreement_ci95=agree_ci,
                ar_diverged_requests=n_diverged,
                ar_first_divergence=diverge,
                eos_requests=n_eos,
                prompt_sets=len(windows),
                kv_capacity=cap,
                step_temp_mib=None if temp is None else temp / 2**20,
                **memory_per_request(cfg, rm, nodes if spec else 0, cap, dtype),
            )
            if p is not None and spec is not None:
                row["expected_tokens_per_step"] = expected_tokens_per_step(
                    p, spec.shape.draft_levels
                )
            rows.append(row)
            timed[m] = (run, rm, spec, ora, row, r)
            if prof_steps:  # traced once every point is timed (the `profile_points` below)
                profiles.append((b, m, run, rm, spec, oracle if p is not None else None, row))
            diverged += [
                (row, i, pos, pl, ar_out[i], int(out[i, pos]))
                for i, pos in enumerate(diverge or [])
                if pos is not None
            ]
            say(
                f"[bench] B={b:<3d} {m:8s} {r['tokens_per_s']:10.1f} tok/s  step {r['step_ms']:.2f} ms"
                f"  {r['tokens_per_step']:.2f} tok/step"
                + (
                    f"  agree {agree:.3f} [{agree_ci[0]:.3f}, {agree_ci[1]:.3f}]"
                    f" ({n_diverged[0]}/{n_diverged[1]} requests diverged)"
                    if agree is not None
                    else ""
                )
                + (f"  EOS emitted by {n_eos} (decoded past it)" if n_eos else "")
                + (f"  ({len(windows)} prompt sets pooled)" if len(windows) > 1 else "")
            )
            stage_progs = {s: progs.get((b, m, s)) for s in STAGES}
            if b == bd_batch and all(stage_progs.values()) and time.perf_counter() > deadline:
                skipped.append(dict(batch=b, mode=m, reason="breakdown: time budget"))
            elif b == bd_batch and all(stage_progs.values()):
                try:
                    ms = step_breakdown(
                        stage_progs, params, state, a.breakdown_reps, reshard=cfg.tp > 1
                    )
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    errors.append(dict(batch=b, mode=m, error=f"breakdown: {_short(e)}"))
                else:
                    total = sum(ms.values())
                    breakdown.append(
                        dict(
                            mode=m,
                            batch=b,
                            commit_kind=_commit_kind(spec),
                            **{f"{k}_ms": v for k, v in ms.items()},
                            sum_ms=total,
                            step_ms=r["step_ms"],
                            **{f"{k}_share": v / total for k, v in ms.items()},
                            commit_pct_of_step=100 * ms["commit"] / r["step_ms"],
                        )
                    )
            if low_memory:
                _delete(state)
            del state
        if getattr(a, "rounds", 1) > 1 and timed:
            extra_rounds(b, timed, first_state, more)
        del base
        more.close()
    phases["run_s"] = time.perf_counter() - t
    if profiles:
        t = time.perf_counter()
        errors += profile_points(profiles, plan, params, cfg, a, gen, p, prof_steps, progs)
        phases["profile_s"] = time.perf_counter() - t
    # Where a mode first left AR's tokens (the first 4 such requests, if time remains): AR's
    # top-2 logit gap there, and how far below AR's top logit the mode's token was (its rank):
    # a near-tie flipped by another summation order, or a real difference?
    for row, i, pos, pl, ar_i, tok in diverged[:4]:
        if time.perf_counter() > deadline or pl["fill"]:  # filler rows: no teacher forcing
            break
        lg = ar_logits(pl["llms"][row["mode"]], pl["ids"][i], ar_i, pos)
        info = dict(position=pos, **divergence_info(lg, int(ar_i[pos]), tok))
        row.setdefault("divergences", {})[str(i)] = info
        say(
            f"[bench] B={row['batch']} {row['mode']}: request {i} first differs from AR at token "
            f"{pos}: teacher-forced top-2 logit gap {info['top2_gap']:.3g}; the {row['mode']} "
            f"token ranks {info['token_rank']} ({info['token_deficit']:.3g} below the top), AR's "
            f"decoded token {info['ar_token_rank']} ({info['ar_token_deficit']:.3g} below)"
        )
    for s in skipped:
        say(f"[bench] skipped B={s['batch']} {s['mode']}: {s['reason']}")

    by = {(r["batch"], r["mode"]): r for r in rows}
    for r in rows:
        for ref in ("ar", "pernode"):
            other = by.get((r["batch"], ref))
            # None where the reference timed no tokens (e.g. every request finished in warm-up)
            ok = other is not None and other["tokens_per_s"] > 0
            r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / other["tokens_per_s"] if ok else None
            rounds = len(r.get("round_tokens_per_s", ()))
            if ok and ref == "ar" and r["mode"] != "ar" and rounds > 1:
                pairs = zip(r["round_tokens_per_s"], other.get("round_tokens_per_s", ()))
                r["round_speedup_vs_ar"] = [x / y for x, y in pairs]
    phases["total_s"] = time.perf_counter() - t_start
    cols = [
        "batch",
        "mode",
        "nodes",
        "budget",
        "tokens_per_s",
        "speedup_vs_ar",
        "speedup_vs_pernode",
        "tokens_per_step",
        "step_ms",
        "ar_agreement",
    ]
    if p is not None:
        cols.insert(8, "expected_tokens_per_step")
    if any(r["mode"] == "engine" for r in rows):
        cols.insert(2, "chosen")
    for r in rows:  # --rounds: the spread of the paired ratios, beside the median rounds' ratio
        if r.get("round_speedup_vs_ar"):
            r["vs_ar_rounds"] = "{:.3g}-{:.3g}".format(
                min(r["round_speedup_vs_ar"]), max(r["round_speedup_vs_ar"])
            )
    if any("vs_ar_rounds" in r for r in rows):
        cols.insert(cols.index("speedup_vs_ar") + 1, "vs_ar_rounds")
    if env["platform"] == "cpu":
        print(f"\n{CPU_NOTE}")
    print(
        f"\noffline decode, {a.preset or a.model} ({dtype}), {env['device']}, "
        f"{'synthetic drafter p=%.4f' % p if p is not None else 'MTP drafter'}, "
        f"{a.steps} timed steps"
    )
    table = print_table(rows, cols) if rows else ""
    if rows:
        big = max(r["batch"] for r in rows)
        mem_rows = [r for r in rows if r["batch"] == big]
        print(f"\nmemory per request (MiB; KV at capacity {mem_rows[0]['kv_capacity']})")
        print_table(
            mem_rows,
            [
                "mode",
                "nodes",
                "gdn_state_mib",
                "conv_state_mib",
                "kv_mib",
                "verify_state_mib",
                "verify_conv_mib",
            ],
        )
    prof_rows = [r for r in rows if r.get("loop_profile")]
    if prof_rows:
        print_loop_profiles(prof_rows)
    if breakdown:
        print(
            f"\nstep-time breakdown at B={bd_batch} (ms; each stage jitted and timed alone; "
            "commit lazy: conv + KV (+ the pending-row gathers with lazy_rows 'gather'), the "
            "GDN state write is in the verify; "
            "eager: state rebuild + conv + KV)"
        )
        print_table(
            breakdown,
            ["mode", "commit_kind"]
            + [f"{s}_ms" for s in STAGES]
            + ["sum_ms", "step_ms", "commit_pct_of_step"],
        )
    print(
        f"\ntime: {', '.join(f'{k} {v:.0f}' for k, v in phases.items())} s"
        + (f"; {len(skipped)} points skipped" if skipped else "")
        + (f"; {len(errors)} errors" if errors else ""),
        flush=True,
    )
    result = dict(
        command=" ".join(sys.argv),
        env=env,
        config=cfg,
        args=vars(a),
        dtype=str(dtype),
        synthetic_accept=p,
        gen_tokens=gen,
        rows=rows,
        breakdown=breakdown,
        skipped=skipped,
        errors=errors,
        phases=phases,
        table=table,
        compiles_pending=pending,
        method="docs/budget.md; breakdown: bench.stage_functions / step_breakdown",
    )
    os.makedirs(a.out, exist_ok=True)
    tag = a.preset or os.path.basename(os.path.normpath(a.model))
    write_json(os.path.join(a.out, f"e2e_{tag}.json"), result)
    if not a.no_plots:
        result["plots"] = plot_e2e(result, a.out, tag)
    return result


def print_loop_profiles(rows: Sequence[dict]) -> str:
    """One line per (batch, mode): the timed step, then ms per loop step of each stage inside the
    jitted loop, other and idle (which sum to the timed step), and the traced loop's wall per step
    (profiler overhead included); a second table: each stage's time over its bytes floor (where
    the device's bandwidth is known), else the floor in MiB."""
    names = [*STAGES, "ar", "other", "idle"]
    table, ratio = [], []
    gbps = None
    for r in rows:
        lp = r["loop_profile"]
        gbps = gbps or lp.get("peak_gbps")
        split = {x["stage"]: x for x in lp["stage_split"]}
        table.append(
            dict(
                batch=r["batch"],
                mode=r["mode"],
                step_ms=lp.get("step_ms"),
                **{f"{k}_ms": split[k]["ms_per_step"] for k in names if k in split},
                traced_wall_ms=lp["wall_ms_per_step"],
                kernels=round(sum(x.get("kernels_per_step", 0.0) for x in split.values())),
            )
        )
        key = "x_floor" if gbps else "floor_mib"

        def cell(x):
            v = x.get(key)
            return f"{v:.3g}*" if v is not None and x.get("bound") == "compute" else v

        ratio.append(
            dict(
                batch=r["batch"],
                mode=r["mode"],
                **{k: cell(split[k]) for k in (*STAGES, "ar") if k in split},
            )
        )
    print(
        f"\nin-loop stage split (ms per loop step, from a profiler trace of "
        f"{rows[0]['loop_profile']['steps']} steps of the jitted loop; "
        f"{rows[0]['loop_profile']['events_from']} events; stages + other = busy, + idle = the "
        "timed step; traced_wall: the traced loop's wall, profiler overhead included; kernels: "
        "device kernels per loop step)"
    )
    cols = (
        ["batch", "mode", "step_ms"]
        + [f"{k}_ms" for k in names if any(f"{k}_ms" in t for t in table)]
        + ["traced_wall_ms", "kernels"]
    )
    out = print_table(table, cols)
    tf = rows[0]["loop_profile"].get("peak_tflops")
    how = f"time / floor time at {gbps:.0f} GB/s" if gbps else "floor MiB: bandwidth unknown"
    if gbps and tf:
        how += f", or at {tf:.0f} TFLOP/s where the stage's matmuls take longer (marked *)"
    print(f"\neach stage over its floor ({how})")
    print_table(
        ratio, ["batch", "mode"] + [k for k in (*STAGES, "ar") if any(k in t for t in ratio)]
    )
    return out


def plot_e2e(result: dict, out: str, tag: str) -> list[str]:
    """Throughput vs batch per mode, and the step-time breakdown (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not importable: no plots)", flush=True)
        return []
    files = []
    rows = result["rows"]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in E2E_MODES:
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["mode"] == m)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch",
            ylabel="output tokens / s",
            title=f"offline decode, {tag}",
        )
        ax.legend()
        files.append(os.path.join(out, f"e2e_{tag}_throughput.png"))
        fig.savefig(files[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    if result["breakdown"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        bd = result["breakdown"]
        bottom = np.zeros(len(bd))
        for s in STAGES:
            v = np.array([r[f"{s}_ms"] for r in bd])
            ax.bar([r["mode"] for r in bd], v, bottom=bottom, label=s)
            bottom += v
        ax.set(ylabel="ms", title=f"step-time breakdown, B={bd[0]['batch']}, {tag}")
        ax.legend()
        files.append(os.path.join(out, f"e2e_{tag}_breakdown.png"))
        fig.savefig(files[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return files
