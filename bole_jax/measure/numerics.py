"""Teacher-forced numerics of the decoding modes against autoregressive decoding.

Greedy agreement with AR (`bench_e2e.py`'s `ar_agreement`) says how far two bf16 runs went before
a near-tie flipped, which depends on where the near-ties fall: a handful of requests decide it
and one flip more or less moves it by several points. This measures the cause directly. AR
decodes `1 + steps * (depth + 1)` greedy tokens and keeps its fp32 logits at every position;
then each variant (a mode, a backend, kernel options) replays the same tokens: every step
verifies a tree whose root path is AR's next `depth + 1` tokens (for the tree modes with
`nodes - depth - 1` random distractor nodes hung off it, as a drafter's tree has), commits that
whole path whatever the logits say, and compares the path's logits with AR's at the same
positions. So every variant sees the same prefixes, and every position counts:

  - |logit - AR logit|: max and mean over positions and vocabulary;
  - the error of AR's top-2 margin (the variant's logit of AR's token less its logit of AR's
    runner-up, against AR's gap): mean and 99th percentile; a flip is a position where it
    exceeds AR's gap, so at equal margin errors two variants flip alike;
  - flips: positions whose argmax differs from AR's token, with AR's top-2 gap there (a flip
    at a gap far above the error would be a bug, not rounding);
  - the committed GDN state after the last step against AR's after the same tokens (relative
    max error, the worst layer): what a variant carries into every later step.

Two baselines of the same kind: "chunk", AR's own forward over the path's tokens at once (a
prefill chunk), which computes the same function in another order; and "ar", the one-token
decode itself, which equals the reference exactly unless the reference runs in another dtype
(`ref_params`: e.g. AR in fp32 while every variant runs in bf16, so that each variant's distance
from the fp32 model sits beside AR's own).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import ModelConfig, forward, init_cache
from bole_jax.model import logits as lm_logits
from bole_jax.model.cache import GDNCache, committed_state
from bole_jax.pallas.options import BACKENDS, KernelOptions
from bole_jax.spec_decode import verify
from bole_jax.spec_decode.acceptance import Accepted
from bole_jax.spec_decode.tree import Tree

MODES = ("ar", "chunk", "chain", "pernode", "bole")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of decoding the same tokens: a mode, the kernels' backend, the kernel options."""

    mode: str
    backend: str = "auto"
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")

    @property
    def name(self) -> str:
        base = KernelOptions()
        opts = [
            f"{f.name}={_text(getattr(self.kernels, f.name))}"
            for f in dataclasses.fields(KernelOptions)
            if getattr(self.kernels, f.name) != getattr(base, f.name)
        ]
        if self.backend != "auto":
            opts.insert(0, f"backend={self.backend}")
        return self.mode + (":" + ",".join(opts) if opts else "")


def _text(value) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def parse_variant(text: str) -> Variant:
    """`MODE` or `MODE:KEY=VALUE,...`, the keys `backend` and any `KernelOptions` field (bools as
    1 / 0), e.g. `bole:tree_gdn_bf16=0` or `bole:backend=pallas,interpret_numerics=device`."""
    mode, _, rest = text.partition(":")
    backend, kw = "auto", {}
    fields = {f.name for f in dataclasses.fields(KernelOptions)}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {text!r}: expected KEY=VALUE, got {item!r}")
        if key == "backend":
            backend = value
        elif key in fields:
            if isinstance(getattr(KernelOptions(), key), bool):
                if value not in ("0", "1"):
                    raise ValueError(f"variant {text!r}: {key} takes 1 or 0, got {value!r}")
                kw[key] = value == "1"
            else:
                kw[key] = value
        else:
            raise ValueError(
                f"variant {text!r}: unknown key {key!r}; expected backend or one of "
                f"{sorted(fields)}"
            )
    return Variant(mode, backend, KernelOptions(**kw))


def forced_tree(path_tokens: np.ndarray, nodes: int, vocab: int, rng) -> Tree:
    """A tree whose first `D + 1` nodes are the chain `path_tokens` [B, D + 1] (node j's parent
    j - 1) and whose other nodes (up to `nodes`) carry random tokens under random earlier nodes
    of depth < D (so no root path is longer than the chain)."""
    b, d1 = path_tokens.shape
    n = max(nodes, d1)
    parents = np.full((b, n), -1, np.int32)
    parents[:, 1:d1] = np.arange(d1 - 1)
    depth = np.zeros((b, n), np.int32)
    depth[:, :d1] = np.arange(d1)
    tokens = np.zeros((b, n), np.int32)
    tokens[:, :d1] = path_tokens
    for i in range(d1, n):
        for r in range(b):
            choices = np.flatnonzero(depth[r, :i] < d1 - 1)
            p = int(rng.choice(choices))
            parents[r, i], depth[r, i] = p, depth[r, p] + 1
        tokens[:, i] = rng.integers(0, vocab, b)
    return Tree(
        tokens=jnp.asarray(tokens),
        parents=jnp.asarray(parents),
        depth=jnp.asarray(depth),
        num_nodes=jnp.full((b,), n, jnp.int32),
        score=jnp.zeros((b, n), jnp.float32),
    )


def _forced_step(
    params, cache, tree: Tree, emitted, *, cfg: ModelConfig, mode: str, backend: str, d1: int
):
    """Verify `tree` and commit its first d1 nodes (the chain) whatever the logits say: (the
    chain's logits [B, d1, V] fp32, the cache after)."""
    b = tree.tokens.shape[0]
    if mode == "ar":  # the one-token decode, token by token
        rows = []
        for j in range(d1):
            hidden, cache = forward(params, cfg, tree.tokens[:, j : j + 1], cache)
            rows.append(lm_logits(params, cfg, hidden))
        return jnp.concatenate(rows, axis=1), cache
    if mode == "chunk":
        hidden, cache = forward(params, cfg, tree.tokens[:, :d1], cache)
        return lm_logits(params, cfg, hidden), cache
    hidden, cache, auxs = verify.verify_forward(
        params, cfg, tree, cache, mode=mode, backend=backend, depth_bound=d1
    )
    logits = verify.verify_logits(params, cfg, hidden[:, :d1], None)
    path = jnp.broadcast_to(jnp.arange(d1, dtype=jnp.int32), (b, d1))
    acc = Accepted(
        path=path,
        num_accepted=jnp.full((b,), d1, jnp.int32),
        bonus=emitted[:, -1],
        tokens=emitted,
    )
    active = jnp.ones((b,), bool)
    return logits, verify.commit(cache, auxs, tree, acc, active, mode=mode, cfg=cfg)


def _gdn_states(cache) -> list[np.ndarray]:
    return [np.asarray(committed_state(c)) for c in cache.layers if isinstance(c, GDNCache)]


def top2(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([..., 2] the ids of the two largest logits of each row of [..., V], runner-up first;
    [...] the gap between them). A partition, not a sort: a 248k vocabulary stays cheap."""
    ids = np.argpartition(logits, -2, axis=-1)[..., -2:]
    vals = np.take_along_axis(logits, ids, axis=-1)
    swap = vals[..., 0] > vals[..., 1]
    ids = np.where(swap[..., None], ids[..., ::-1], ids)
    vals = np.take_along_axis(logits, ids, axis=-1)
    return ids, vals[..., 1] - vals[..., 0]


def teacher_forced(
    params,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    variants: Sequence[Variant],
    *,
    steps: int = 8,
    depth: int = 8,
    nodes: int = 32,
    seed: int = 0,
    ref_params=None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """AR's greedy tokens and logits (with `ref_params` if given, e.g. the same weights in fp32),
    then every variant replaying them with `params` (module docstring). Returns {"ar": {...},
    "variants": [row per variant]}."""
    if steps < 1 or depth < 1:
        raise ValueError(f"steps and depth must be >= 1, got {steps} and {depth}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    log = log or (lambda s: None)
    b, d1 = len(prompts), depth + 1
    gen = 1 + steps * d1
    plen = max(len(p) for p in prompts)
    capacity = plen + gen + max(nodes, d1) + 1
    ref = params if ref_params is None else ref_params
    toks = np.zeros((b, plen), np.int32)
    for r, p in enumerate(prompts):
        toks[r, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)

    fwd = jax.jit(forward, static_argnums=1)
    head = jax.jit(lm_logits, static_argnums=1)

    def prefill(p):
        cache = init_cache(cfg, b, capacity, p["embed"].dtype)
        h, cache = fwd(p, cfg, jnp.asarray(toks), cache, lens)
        return h, cache

    h, cache = prefill(ref)
    first = head(ref, cfg, h[jnp.arange(b), lens - 1])
    ar = np.zeros((b, gen, cfg.vocab_size), np.float32)
    out = np.zeros((b, gen), np.int32)
    ar[:, 0] = np.asarray(first)
    out[:, 0] = ar[:, 0].argmax(-1)
    for t in range(1, gen):  # AR: the one-token decode step
        h, cache = fwd(ref, cfg, jnp.asarray(out[:, t - 1 : t]), cache)
        ar[:, t] = np.asarray(head(ref, cfg, h[:, 0]))
        out[:, t] = ar[:, t].argmax(-1)
    ar_states = _gdn_states(cache)
    del cache
    pair_ids, gaps = top2(ar[:, 1:])  # the positions the variants verify
    log(f"AR: {b} x {gen} tokens")
    cache0 = prefill(params)[1]  # the variants start from their own prefill

    rows = []
    for v in variants:
        vcfg = dataclasses.replace(cfg, kernels=v.kernels)
        step = jax.jit(
            functools.partial(_forced_step, cfg=vcfg, mode=v.mode, backend=v.backend, d1=d1)
        )
        rng = np.random.default_rng(seed)  # the same distractors for every tree variant
        cache = cache0
        flips = np.zeros((b, gen - 1), bool)
        margin_err = np.zeros((b, gen - 1), np.float32)
        err_max, err_sum = 0.0, 0.0
        for s in range(steps):
            t = 1 + s * d1  # the step's root is token t - 1, its chain predicts t .. t + d1 - 1
            n = nodes if v.mode in ("pernode", "bole") else d1
            tree = forced_tree(out[:, t - 1 : t - 1 + d1], n, cfg.vocab_size, rng)
            logits, cache = step(params, cache, tree, jnp.asarray(out[:, t : t + d1]))
            lg, win = np.asarray(logits), slice(t - 1, t - 1 + d1)
            err = np.abs(lg - ar[:, t : t + d1])
            err_max, err_sum = max(err_max, float(err.max())), err_sum + float(err.sum())
            flips[:, win] = lg.argmax(-1) != out[:, t : t + d1]
            # the error of AR's top-2 margin (what a flip needs to exceed): the variant's logit
            # of AR's best token less its logit of AR's runner-up, against AR's gap
            pair = np.take_along_axis(lg, pair_ids[:, win], axis=-1)
            margin_err[:, win] = np.abs((pair[..., 1] - pair[..., 0]) - gaps[:, win])
        states = _gdn_states(cache)
        del cache
        state_err = max(
            float(np.max(np.abs(s - a)) / max(float(np.max(np.abs(a))), 1e-30))
            for s, a in zip(states, ar_states)
        )
        row = dict(
            variant=v.name,
            mode=v.mode,
            backend=v.backend,
            kernels=dataclasses.asdict(v.kernels),
            positions=int(flips.size),
            max_abs_err=err_max,
            mean_abs_err=err_sum / (flips.size * cfg.vocab_size),
            margin_err_mean=float(margin_err.mean()),
            margin_err_p99=float(np.quantile(margin_err, 0.99)),
            flips=int(flips.sum()),
            flip_rate=float(flips.mean()),
            flip_gaps=sorted(float(x) for x in gaps[flips]),
            state_rel_err=state_err,
        )
        rows.append(row)
        log(
            f"{row['variant']}: max |dlogit| {row['max_abs_err']:.3g}, flips {row['flips']}"
            f"/{row['positions']}"
        )
    return dict(
        ar=dict(
            dtype=str(ref["embed"].dtype),
            batch=b,
            tokens=gen,
            positions=int(gaps.size),
            near_ties={
                str(x): int(np.sum(gaps < x)) for x in (0.01, 0.03, 0.1, 0.3)
            },  # positions with AR's top-2 gap below x
        ),
        variants=rows,
    )
