"""Tensor parallelism (TP) over a 1-D device mesh, through JAX's own SPMD machinery.

    llm = LLM("path/to/hf_folder", tp=4)          # bole-jax generate / serve / bench --tp 4

Layout (`ModelConfig.tp` = number of shards; 1 = everything as without this module)
- One mesh axis "tp" over the first `tp` devices (`make_mesh`). Params and caches are placed with
  `NamedSharding`s (`param_specs`, `cache_specs`); the jitted programs are partitioned by XLA
  (GSPMD) from those placements. Column-parallel projections (attention q / gate / k / v, GDN
  in_proj, MLP gate+up, lm_head) give head- / channel- / vocab-sharded activations; row-parallel
  ones (attention o_proj, GDN out_proj, MLP down) end in an all-reduce that XLA inserts. The
  hidden state between layers is replicated. No collective is written by hand.
- The GDN core (causal conv, then the delta rule: chunked, recurrent or the tree kernels) and the
  selected-state commit run inside `shard_map` over the value-head axis (`over_gdn_heads`): the
  Pallas kernels see local shapes (Hk/tp key heads, HV/tp value heads, C/tp conv channels) and
  need no partitioning rule. Routed MoE experts run inside `shard_map` over the expert axis
  (`over_experts`): each device applies its E/tp experts, the partial sums are added by XLA.
- Fused axes are stored shard-major. w_qkv, conv_w and the conv cache concatenate
  [all q | all k | all v] on their channel axis C, and w_gate_up concatenates [gate | up]: a
  contiguous split of such an axis would give one device all q heads and another all v heads.
  With tp > 1 they are permuted at placement (`shard_params`) so that shard j holds
  [q_j | k_j | v_j] ([gate_j | up_j]): the canonical layout of a model with 1/tp of the heads.
  Code inside shard_map is the tp = 1 code with the local config (`gdn_local_cfg`); the one
  global-view split of a fused axis, SwiGLU's, reshapes by the shard count (`layers.swiglu`).
  `unshard_params` undoes the permutation (checkpoint saving calls it).

Which dim each group is split on (S = "tp" when tp divides that dim, else replicated):

    group        dim   tensors (sharded axis)
    GDN heads    Hk    w_qkv, conv_w (C, shard-major); w_z, w_b, w_a (out); A_log, dt_bias;
                       w_out (in); cache conv (C), state (HV); tree factors k (Hk), u, gamma (HV);
                       lazy-commit rows k (Hk), u, w, p_sel (HV)
    attn q heads Hq    w_q, w_gate (out); w_o (in)
    attn kv      Hkv   w_k, w_v (out); KV cache (Hkv)          (also the MTP layers and MTP cache)
    dense MLP    I     w_gate_up (out, shard-major); w_down (in)
    experts      E     w_gate_up, w_down (expert axis)
    shared exp.  Is    shared_gate_up (out, shard-major); shared_down (in)
    vocabulary   V     embed (rows), lm_head (columns)
    replicated         norms, router, shared_gate, MTP fc, lengths, tokens, trees, sampling

Not divisible: the group is REPLICATED on every device, with one logged note naming the tensor
group and the dim (Qwen3-Next's 2 KV heads at tp = 4 are replicated, as vLLM does). Results stay
exact; only the memory / speed gain of that group is lost. Errors: tp < 1, tp > visible devices.
Single host only (the mesh is `jax.devices()[:tp]`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bole_jax.model.cache import AttnCache, GDNCache
from bole_jax.model.config import ModelConfig
from bole_jax.model.params import abstract_params, build_params, init_leaf, key_path
from bole_jax.model.params import init_params as init_canonical
from bole_jax.pallas.factors import PendingCommit, PendingPath, TreeFactors

log = logging.getLogger(__name__)

AXIS = "tp"
REPLICATED = P()


# ----------------------------------------------------------------------------- mesh, shard_map


def check_tp(tp) -> int:
    """tp as an int, or a ValueError naming the fix (bad value, too few devices)."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp must be a positive int (tensor-parallel devices), got {tp!r}")
    n = jax.device_count()
    if tp > n:
        hint = (
            f"on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tp} simulates devices"
            if jax.default_backend() == "cpu"
            else "check CUDA_VISIBLE_DEVICES"
        )
        raise ValueError(
            f"tp={tp} needs {tp} devices but only {n} {jax.default_backend()} device(s) "
            f"are visible: lower --tp ({hint})"
        )
    return int(tp)


@functools.lru_cache(maxsize=None)
def make_mesh(tp: int) -> Mesh:
    """The 1-D mesh ("tp",) over the first tp devices (one per process: the same object always)."""
    tp = check_tp(tp)
    return Mesh(np.asarray(jax.devices()[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` (jax >= 0.7) or `jax.experimental.shard_map.shard_map`, without the
    replication check (Pallas calls inside have no replication rule)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as _shard_map  # pragma: no cover (old jax)

    return _shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def split_at(axis: int) -> P:
    """PartitionSpec sharding dim `axis` over "tp" (the others replicated)."""
    return P(*([None] * axis), AXIS)


# ----------------------------------------------------------------------------- shard counts


def shards(cfg: ModelConfig, n: int) -> int:
    """Ways a dim of size n is split: cfg.tp when it divides n, else 1 (replicated)."""
    return cfg.tp if cfg.tp > 1 and n % cfg.tp == 0 else 1


def gdn_shards(cfg: ModelConfig) -> int:
    """Shards of the GDN heads (key heads decide: value head j belongs to key head j // r)."""
    return shards(cfg, cfg.gdn_num_key_heads)


def gdn_local_cfg(cfg: ModelConfig) -> ModelConfig:
    """The config one shard's GDN code sees: 1/s of the key and value heads, tp = 1 (cfg itself
    when the heads are not split)."""
    s = gdn_shards(cfg)
    if s == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        gdn_num_key_heads=cfg.gdn_num_key_heads // s,
        gdn_num_value_heads=cfg.gdn_num_value_heads // s,
        tp=1,
    )


def _groups(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """group -> (dim name, size) deciding its sharding."""
    g = {
        "GDN heads (w_qkv, conv_w, w_z, w_b, w_a, w_out, GDN cache)": (
            "linear_num_key_heads",
            cfg.gdn_num_key_heads,
        ),
        "attention q heads (w_q, w_gate, w_o)": ("num_attention_heads", cfg.num_heads),
        "attention kv heads (w_k, w_v, KV cache)": ("num_key_value_heads", cfg.num_kv_heads),
        "vocabulary (embed, lm_head)": ("vocab_size", cfg.vocab_size),
    }
    layers = list(range(cfg.num_layers)) + [cfg.num_layers + j for j in range(cfg.mtp_num_layers)]
    if not all(cfg.is_moe_layer(i) for i in layers):
        g["dense MLP (w_gate_up, w_down)"] = ("intermediate_size", cfg.intermediate_size)
    if cfg.num_experts:
        g["MoE experts (w_gate_up, w_down)"] = ("num_experts", cfg.num_experts)
        g["shared expert (shared_gate_up, shared_down)"] = (
            "shared_expert_intermediate_size",
            cfg.shared_expert_intermediate_size,
        )
    return g


def replicated_groups(cfg: ModelConfig) -> list[str]:
    """Human-readable notes for the tensor groups tp does not divide (replicated)."""
    return [
        f"{name}: {dim}={n} is not divisible by tp={cfg.tp}, replicated on every device"
        for name, (dim, n) in _groups(cfg).items()
        if cfg.tp > 1 and n % cfg.tp
    ]


_noted: set = set()


def log_layout(cfg: ModelConfig) -> None:
    """Log (once per config) which tensor groups fall back to replication."""
    if cfg in _noted:
        return
    _noted.add(cfg)
    for note in replicated_groups(cfg):
        log.warning("tp: %s", note)


# ----------------------------------------------------------------------------- param layout


def _qkv_order(cfg: ModelConfig, s: int) -> np.ndarray:
    """Shard-major order of the C axis: shard j = [q heads of j | k heads of j | v heads of j]."""
    kd, vd = cfg.gdn_num_key_heads * cfg.gdn_key_dim, cfg.gdn_num_value_heads * cfg.gdn_value_dim
    ks, vs = kd // s, vd // s
    return np.concatenate(
        [
            np.concatenate(
                [
                    np.arange(j * ks, (j + 1) * ks),
                    kd + np.arange(j * ks, (j + 1) * ks),
                    2 * kd + np.arange(j * vs, (j + 1) * vs),
                ]
            )
            for j in range(s)
        ]
    )


def qkv_channel_order(cfg: ModelConfig) -> np.ndarray | None:
    """The stored order of the C axis (w_qkv, conv_w, GDN conv cache) under cfg's tensor
    parallelism, as canonical channel indices (stored[..., i] = canonical[..., order[i]]); None
    when it is the canonical order."""
    s = gdn_shards(cfg)
    return None if s == 1 else _qkv_order(cfg, s)


def _gate_up_order(width: int, s: int) -> np.ndarray:
    """Shard-major order of a [gate | up] axis of 2 * width: shard j = [gate_j | up_j]."""
    w = width // s
    return np.concatenate(
        [
            np.concatenate([np.arange(j * w, (j + 1) * w), width + np.arange(j * w, (j + 1) * w)])
            for j in range(s)
        ]
    )


def leaf_layout(
    cfg: ModelConfig, path: tuple, shape: tuple[int, ...]
) -> tuple[P, np.ndarray | None]:
    """(PartitionSpec, permutation of the last axis or None) of the param at `path` (dict keys /
    list indices as in params.py, e.g. ("layers", 3, "gdn", "w_qkv")) of shape `shape`."""
    names = [k for k in path if isinstance(k, str)]
    name, group = names[-1], (names[-2] if len(names) > 1 else "")

    def ax(n):
        return AXIS if shards(cfg, n) > 1 else None

    if group == "gdn":
        g = ax(cfg.gdn_num_key_heads)
        order = _qkv_order(cfg, cfg.tp) if g and name in ("w_qkv", "conv_w") else None
        spec = {"w_out": P(g, None), "A_log": P(g), "dt_bias": P(g), "norm_w": P()}.get(
            name, P(None, g)
        )
        return spec, order
    if group == "attn":
        q, kv = ax(cfg.num_heads), ax(cfg.num_kv_heads)
        return {
            "w_q": P(None, q),
            "w_gate": P(None, q),
            "w_k": P(None, kv),
            "w_v": P(None, kv),
            "w_o": P(q, None),
        }.get(name, P()), None
    if group == "mlp":
        if name in ("w_gate_up", "w_down") and len(shape) == 3:  # experts [E, ...]
            return P(ax(shape[0]), None, None), None
        if name in ("w_gate_up", "shared_gate_up"):
            width = shape[1] // 2
            a = ax(width)
            return P(None, a), (_gate_up_order(width, cfg.tp) if a else None)
        if name in ("w_down", "shared_down"):
            return P(ax(shape[0]), None), None
        return P(), None  # router, shared_gate
    if name == "embed":
        return P(ax(cfg.vocab_size), None), None
    if name == "lm_head":
        return P(None, ax(cfg.vocab_size)), None
    return P(), None  # norms, MTP fc


def _map_with_path(fn, params):
    return jax.tree_util.tree_map_with_path(lambda kp, x: fn(key_path(kp), x), params)


def param_specs(params, cfg: ModelConfig):
    """Tree of PartitionSpecs with the structure of `params` (any subset of params.py's layout)."""
    return _map_with_path(lambda path, x: leaf_layout(cfg, path, x.shape)[0], params)


def param_shardings(params, cfg: ModelConfig):
    mesh = make_mesh(cfg.tp)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        param_specs(params, cfg),
        is_leaf=lambda x: isinstance(x, P),
    )


def layout_leaf(cfg: ModelConfig, path: tuple, x):
    """One canonical-layout param -> its TP layout, placed on the mesh (the loader's hook)."""
    spec, order = leaf_layout(cfg, path, x.shape)
    if order is not None:
        x = jnp.take(x, jnp.asarray(order), axis=-1)
    return jax.device_put(x, NamedSharding(make_mesh(cfg.tp), spec))


def shard_params(params, cfg: ModelConfig):
    """Canonical params (params.py) -> the TP layout of `cfg` (fused axes permuted shard-major),
    placed on the mesh. Identity when cfg.tp == 1."""
    if cfg.tp == 1:
        return params
    return _map_with_path(functools.partial(layout_leaf, cfg), params)


def place_params(params, cfg: ModelConfig):
    """Params ALREADY in cfg's TP layout (e.g. another LLM's .params) -> placed on the mesh."""
    if cfg.tp == 1:
        return params
    return jax.device_put(params, param_shardings(params, cfg))


def unshard_params(params, cfg: ModelConfig):
    """Inverse of `shard_params`: the canonical layout (fused axes un-permuted), as arrays on one
    device. Identity when cfg.tp == 1."""
    if cfg.tp == 1:
        return params

    def undo(path, x):
        order = leaf_layout(cfg, path, x.shape)[1]
        x = jax.device_put(x, jax.devices()[0])
        return x if order is None else jnp.take(x, jnp.asarray(np.argsort(order)), axis=-1)

    return _map_with_path(undo, params)


class WeightsDoNotFit(ValueError):
    """The model's weights alone exceed the memory its device has available."""


def device_free_bytes(device=None) -> int | None:
    """An accelerator allocator's limit less what is in use on `device` (default: the first
    device); None where the backend reports no limit (CPU)."""
    d = device or jax.devices()[0]
    try:
        stats = d.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def available_bytes(device=None) -> int | None:
    """Bytes a device can still hold (default: the first device): `device_free_bytes`; on CPU
    the host's available memory (Linux `MemAvailable`); None where neither is known."""
    d = device or jax.devices()[0]
    free = device_free_bytes(d)
    if free is not None or d.platform != "cpu":
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_weights_fit(cfg: ModelConfig, dtype=None) -> int:
    """Raise `WeightsDoNotFit` (a ValueError: the CLI prints it) where the weights of `cfg` in
    `dtype`, per device with tensor parallelism, exceed what the device has available, instead
    of letting the first allocations end the process (on a CPU host the kernel's OOM killer
    ends it with no message: `bole-jax bench` at its default Qwen3.5-9B dims in float32 needs
    35 GiB). Returns the weights' bytes per device."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shapes = abstract_params(dataclasses.replace(cfg, tp=1), dtype)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    need = -(-total // cfg.tp)
    free = available_bytes()
    if free is not None and need > free:
        gib = lambda x: f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"  # noqa: E731
        per = f" per device over tp={cfg.tp}" if cfg.tp > 1 else ""
        raise WeightsDoNotFit(
            f"the weights of this model take {gib(need)} in {dtype.name}{per}, more than the "
            f"{gib(free)} the {jax.devices()[0].platform} device has available: use a smaller "
            "model (e.g. `--preset tiny`, or the embedded demo model), bfloat16 weights, or more "
            "devices (tensor parallelism)"
        )
    return need


def init_params(cfg: ModelConfig, key, dtype=None):
    """`model.init_params` in cfg's TP layout, generated directly on the mesh (one jitted program
    with sharded outputs: no device ever holds the whole model). Same values as
    `shard_params(model.init_params(canonical cfg, key), cfg)`, except for the leaves of groups
    above `params.GROUP_DRAW_LIMIT` elements (the MoE experts of big models): each device draws its
    shard of those from its own key (same distribution, values that depend on tp), because XLA
    does not partition a random draw and one global fp32 draw per leaf does not fit. Weights
    that cannot fit the device raise `WeightsDoNotFit` first (`check_weights_fit`)."""
    check_weights_fit(cfg, dtype)
    if cfg.tp == 1:
        return init_canonical(dataclasses.replace(cfg, tp=1), key, dtype)
    return init_program(cfg, dtype)(key)


def init_program(cfg: ModelConfig, dtype=None):
    """The jitted program behind `init_params` for tp > 1 (lower it on a key to see its memory)."""
    base = dataclasses.replace(cfg, tp=1)
    dtype = jnp.dtype(dtype or cfg.dtype)
    shapes = abstract_params(base, dtype)
    mesh = make_mesh(cfg.tp)
    drawn = set()

    def draw_big(path, name, shape, key, dtype):
        spec = leaf_layout(cfg, path, shape)[0]
        if all(a is None for a in spec):
            return init_leaf(name, shape, key, dtype)
        drawn.add(path)
        local = tuple(
            n // cfg.tp if a else n
            for n, a in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))
        )

        def shard(k):
            k = jax.random.fold_in(k, jax.lax.axis_index(AXIS))
            return init_leaf(name, local, k, dtype, leaf=shape)

        return shard_map(shard, mesh, in_specs=P(), out_specs=spec)(key)

    def build(key):
        params = build_params(base, dtype, key, draw_big)
        # Leaves drawn shard by shard are i.i.d.: permuting their fused axes would change nothing.
        return _map_with_path(
            lambda path, x: x if path in drawn else _permute(cfg, path, x), params
        )

    return jax.jit(build, out_shardings=param_shardings(shapes, cfg))


def _permute(cfg, path, x):
    order = leaf_layout(cfg, path, x.shape)[1]
    return x if order is None else jnp.take(x, jnp.asarray(order), axis=-1)


# ----------------------------------------------------------------------------- caches, states


def pending_specs(cfg: ModelConfig, form: str = "rows") -> PendingCommit | PendingPath:
    """A lazy commit split like the heads it belongs to. form "rows" (`PendingCommit`): k
    [B, L, Hk, dk] on Hk; u [B, L, HV, dv], w [B, L, HV] and p_sel [B, HV] on HV; count [B]
    replicated. form "path" (`PendingPath`): the factors as a verify returns them (k, k_scale on
    Hk, u, gamma on HV: axis 2), path, sel and count replicated."""
    heads = P() if gdn_shards(cfg) == 1 else split_at(2)
    if form == "path":
        return PendingPath(
            factors=TreeFactors(k=heads, u=heads, gamma=heads, k_scale=heads),
            path=P(),
            sel=P(),
            count=P(),
        )
    if gdn_shards(cfg) == 1:
        return PendingCommit(k=P(), u=P(), w=P(), p_sel=P(), count=P())
    return PendingCommit(k=heads, u=heads, w=heads, p_sel=split_at(1), count=P())


def gdn_cache_specs(
    cfg: ModelConfig, pending: PendingCommit | PendingPath | None = None
) -> GDNCache:
    """conv [B, K-1, C] split on C (shard-major), state [B, HV, dk, dv] split on HV; pending: the
    cache's lazy commit, whose specs (`pending_specs`) follow its form, or None."""
    rows = (
        None
        if pending is None
        else pending_specs(cfg, "path" if isinstance(pending, PendingPath) else "rows")
    )
    if gdn_shards(cfg) == 1:
        return GDNCache(conv=P(), state=P(), pending=rows)
    return GDNCache(conv=split_at(2), state=split_at(1), pending=rows)


def attn_cache_specs(cfg: ModelConfig) -> AttnCache:
    """k, v [B, Hkv, S, D] split on Hkv (replicated when tp does not divide Hkv)."""
    spec = split_at(1) if shards(cfg, cfg.num_kv_heads) > 1 else P()
    return AttnCache(k=spec, v=spec)


def state_specs(tree, cfg: ModelConfig):
    """PartitionSpecs for any pytree holding caches (Cache, DecodeState, DraftState, ...): GDN and
    attention cache entries as above, every other leaf replicated."""

    def spec(x):
        if isinstance(x, GDNCache):
            return gdn_cache_specs(cfg, pending=x.pending)
        if isinstance(x, AttnCache):
            return attn_cache_specs(cfg)
        return P()

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, (GDNCache, AttnCache)))


def _shardings(tree, cfg):
    mesh = make_mesh(cfg.tp)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), state_specs(tree, cfg), is_leaf=lambda x: isinstance(x, P)
    )


def create(fn: Callable, cfg: ModelConfig):
    """fn() -> a cache-holding pytree, made directly with `state_specs` placements (one jitted
    program with sharded outputs: no device holds the whole of it; compiled per call, for
    one-off use). fn() itself when tp == 1."""
    if cfg.tp == 1:
        return fn()
    return jax.jit(fn, out_shardings=_shardings(jax.eval_shape(fn), cfg))()


def zeros(fn: Callable, cfg: ModelConfig):
    """fn() for an fn that returns zeros (`init_cache`, `init_mtp_cache`), made directly with
    `state_specs` placements, leaf by leaf (nothing compiled per call). fn() itself when tp == 1."""
    if cfg.tp == 1:
        return fn()
    shapes = jax.eval_shape(fn)
    return jax.tree.map(
        lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, _shardings(shapes, cfg)
    )


def annotate(shapes, cfg: ModelConfig):
    """ShapeDtypeStructs of a cache-holding pytree with their `state_specs` shardings (to lower
    programs ahead of time for the arrays `place` lays out). Identity when tp == 1."""
    if cfg.tp == 1:
        return shapes
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        _shardings(shapes, cfg),
    )


def place(tree, cfg: ModelConfig):
    """device_put a cache-holding pytree with `state_specs` (identity when cfg.tp == 1)."""
    if cfg.tp == 1 or tree is None:
        return tree
    return jax.device_put(tree, _shardings(tree, cfg))


def constrain(tree, cfg: ModelConfig):
    """with_sharding_constraint by `state_specs` inside jit (identity when cfg.tp == 1): keeps
    the layout of loop-carried and returned states fixed, so donation and compiled programs are
    reused from call to call."""
    if cfg.tp == 1 or tree is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, _shardings(tree, cfg))


def constrained_step(step: Callable, cfg: ModelConfig) -> Callable:
    """step(params, state) -> state with the output state constrained (identity when tp == 1)."""
    if cfg.tp == 1:
        return step
    return lambda params, state: constrain(step(params, state), cfg)


# ----------------------------------------------------------------------------- per-shard code


def over_gdn_heads(fn: Callable, cfg: ModelConfig, in_specs, out_specs) -> Callable:
    """`fn` run on each device's own GDN heads (shard_map over "tp"), or `fn` itself when the
    heads are not split. fn must be written for local shapes (bind `gdn_local_cfg(cfg)`)."""
    if gdn_shards(cfg) == 1:
        return fn
    return shard_map(fn, make_mesh(cfg.tp), in_specs, out_specs)


def embed_lookup(embed: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """embed[tokens] ([..., H]) with the vocabulary split over "tp": each device takes the rows
    of its own slice (zeros for tokens it does not hold) and the partial rows are summed, one
    [..., H] all-reduce. Written out because XLA:GPU rewrites a one-token lookup (B = T = 1) into
    a dynamic-slice before its SPMD partitioner runs, and the partitioner then all-gathers the
    whole table to slice it (2 GB per device per step at 9B dims: the tp = 2 AR step took 9.66 ms
    at B = 1 against 4.24 at B = 4; 5.97 ms with this lookup). The table itself when
    it is not split."""
    if shards(cfg, embed.shape[0]) == 1:
        return embed[tokens]
    vocab = embed.shape[0]
    # embed[tokens]'s index rules for any int: negative counts from the end, then clamped
    tokens = jnp.clip(jnp.where(tokens < 0, tokens + vocab, tokens), 0, vocab - 1)

    def local(e, t):
        rows = e.shape[0]
        i = t - jax.lax.axis_index(AXIS) * rows
        mine = (i >= 0) & (i < rows)
        x = jnp.take(e, jnp.clip(i, 0, rows - 1), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), e.dtype)), AXIS)

    return shard_map(local, make_mesh(cfg.tp), (split_at(0), REPLICATED), REPLICATED)(embed, tokens)


def over_experts(fn: Callable, cfg: ModelConfig, num_experts: int) -> Callable:
    """Expert parallelism for the routed experts: fn(p_local, x, top_w, top_e, first) -> [N, H],
    the contribution of experts [first, first + E/tp) (held in p_local), run per device; the
    partial outputs are summed (XLA all-reduce). Returns g(p, x, top_w, top_e) -> [N, H]."""
    s = shards(cfg, num_experts)
    assert s > 1, "over_experts needs experts split over tp"
    local = num_experts // s

    def body(p, x, top_w, top_e):
        first = jax.lax.axis_index(AXIS) * local
        return fn(p, x, top_w, top_e, first)[None]  # [1, N, H]: this shard's partial sum

    ex = split_at(0)
    run = shard_map(body, make_mesh(cfg.tp), ({"w_gate_up": ex, "w_down": ex}, P(), P(), P()), ex)
    return lambda p, x, top_w, top_e: jnp.sum(
        run({"w_gate_up": p["w_gate_up"], "w_down": p["w_down"]}, x, top_w, top_e), axis=0
    )
