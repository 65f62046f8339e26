"""Device memory of the serving engine: bytes per decode slot, and the split of the usable memory
between decode slots and the prefix cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model import parallel
from bole_jax.model.config import ModelConfig
from bole_jax.spec_decode.drafter import draft_cache_capacity
from bole_jax.spec_decode.step import SpecConfig


def kv_capacity(max_context: int, slack: int = 0) -> int:
    """KV slots per decode slot for requests of up to `max_context` tokens (prompt + completion):
    a power of two (64 at least) with room for the `slack` node rows a tree step writes past the
    committed tokens (`SpecConfig.slack`; 0 for ar) and the next token."""
    return max(64, 1 << (max_context + slack).bit_length())


PER_ROW_SCALARS = 64  # bytes of a slot's per-row scalars (lengths, counters, sampling), rounded up


def slot_bytes(
    cfg: ModelConfig,
    capacity: int,
    out_len: int,
    spec: SpecConfig | None,
    dtype,
    logprobs: int | None = None,
) -> dict[str, int]:
    """Device bytes one decode slot needs, by part (an estimate for admission, not an allocation).

    attention_kv: K and V of every full-attention layer, `capacity` tokens.
    gdn_state:    conv window (K-1 pre-conv inputs) and fp32 recurrent state of every GDN layer,
                  and with the lazy bole commit its pending commit: the step's factors of N
                  nodes (keys in the model dtype, k_scale, u, gamma), its accepted path, node and
                  count (`PendingPath`), or with KernelOptions(lazy_rows="gather") the path's
                  depth + 1 rows (k, u, w), p_sel and the count (`PendingCommit`).
    drafter:      the MTP head's KV cache (capacity + draft slots) and its pending tokens, hidden
                  states and count (`DraftState`).
    output:       the [out_len] int32 output row, with `logprobs` (the server's --max-logprobs K)
                  the [out_len] fp32 log-probabilities and [out_len, K] top ids and log-probs,
                  and the per-row scalars (PER_ROW_SCALARS, rounded up).
    step_transient: what one step allocates per row at its peak (the verify, whose outputs are all
                  alive when the acceptance runs): fp32 logits of the verified nodes (with
                  `logprobs` also the emitted path's rows of them and their log-softmax), and per
                  GDN layer the tree's token-level factors and pre-conv inputs (bole) or one full
                  state and conv window per node (pernode, chain). Activations of the layer being
                  computed and sampling's temporaries are not counted (small next to the states
                  of a real model).
    Parts other than step_transient are what the running decode state holds (its arrays, one row
    per slot). Under tensor parallelism (cfg.tp > 1) these are the bytes on ONE device: KV, GDN
    states, factors and logits are split over the heads / vocabulary they are sharded on
    (replicated groups count whole).
    """
    it = jnp.dtype(dtype).itemsize
    kv_shards, gdn_shards = parallel.shards(cfg, cfg.num_kv_heads), parallel.gdn_shards(cfg)
    vocab = cfg.vocab_size // parallel.shards(cfg, cfg.vocab_size)
    hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    dk, dv = cfg.gdn_key_dim, cfg.gdn_value_dim
    kv_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * it // kv_shards
    gdn_state = hv * dk * dv * 4 // gdn_shards
    conv = (cfg.conv_kernel - 1) * cfg.conv_dim * it // gdn_shards
    # One node's token-level factors: keys as the verify took them (model dtype) with their fp32
    # k_scale, fp32 u and gamma (`TreeFactors`).
    factors_per_node = (hk * (dk * it + 4) + hv * (dv + 1) * 4) // gdn_shards
    pending = 0
    if spec is not None and spec.pending_length:
        if spec.pending_nodes:  # PendingPath: factors, path [L], sel, count
            pending = spec.pending_nodes * factors_per_node + spec.pending_length * 4 + 8
        else:  # PendingCommit: k, u, w [L], p_sel, count
            pending = (spec.pending_length * (hk * dk + hv * (dv + 1)) + hv) * 4 // gdn_shards + 4
    logits = (1 if spec is None else spec.shape.num_nodes) * vocab * 4
    # Log-probabilities: the log-softmax of the emitted tokens' logits (ar: the row's; a tree step
    # gathers the accepted path's rows first).
    lp_rows = 0 if logprobs is None else 1 if spec is None else 2 * spec.shape.path_nodes
    parts = {
        "attention_kv": len(cfg.attention_layers) * capacity * kv_per_token,
        "gdn_state": len(cfg.gdn_layers) * (conv + gdn_state + pending),
        "output": out_len * 4
        + (0 if logprobs is None else out_len * (4 + 8 * logprobs))
        + PER_ROW_SCALARS,
    }
    transient = logits + lp_rows * vocab * 4
    if spec is None:
        parts["step_transient"] = transient
    else:
        n, path = spec.shape.num_nodes, spec.shape.path_nodes
        parts["drafter"] = (
            cfg.mtp_num_layers * draft_cache_capacity(capacity, spec.shape) * kv_per_token
            + path * (cfg.hidden_size * it + 4)
            + 4
        )
        if spec.mode == "bole":
            per_node = factors_per_node + cfg.conv_dim * it // gdn_shards
        else:
            per_node = gdn_state + conv
        parts["step_transient"] = transient + len(cfg.gdn_layers) * n * per_node
    return parts


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the engine's memory is split (bytes).

    num_slots:     decode slots.
    slot_bytes:    one slot (estimate); the running state holds num_slots of them and one more is
                   kept for the batch-1 cache of the request being prefilled.
    prefix_bytes:  the prefix cache's budget (0 = off).
    limit_bytes:   the --memory-gb cap on slots + prefix cache, or None.
    usable_bytes:  what slots + prefix cache may use: min(free device memory * memory_fraction,
                   limit_bytes); None when neither is known (CPU without a cap).
    device_stats:  device.memory_stats() at planning time, when the backend reports it.
    fit_slots:     slots the usable memory holds before the --max-batch cap (one kept back for
                   the prefill), or None when the usable memory is unknown.
    shared_bytes:  bytes held once rather than per slot: with decode groups, the step transient of
                   one group (the groups' steps run one after another; `slot_bytes` is then a
                   slot's share without its step transient). 0 without groups.
    """

    num_slots: int
    slot_bytes: int
    prefix_bytes: int
    limit_bytes: int | None
    usable_bytes: int | None
    device_stats: dict | None
    fit_slots: int | None = None
    shared_bytes: int = 0

    @property
    def planned_bytes(self) -> int:
        return (self.num_slots + 1) * self.slot_bytes + self.shared_bytes + self.prefix_bytes


class SlotDoesNotFit(ValueError):
    """The usable memory cannot hold one decode slot (plus the prefill's)."""


DEFAULT_PREFIX_CACHE_GB = 1.0  # prefix cache budget when the free memory is unknown (CPU)


def plan_memory(
    per_slot: int,
    max_batch: int,
    *,
    memory_gb: float | None = None,
    prefix_cache_gb: float | None = None,
    device=None,
    memory_fraction: float = 0.9,
    shared_bytes: int = 0,
) -> MemoryPlan:
    """Split the usable memory between decode slots and the prefix cache.

    Usable: min(free device memory * memory_fraction, memory_gb); the free memory comes from
    `device.memory_stats()` (after the weights are loaded). Slots: min(max_batch, what fits), one
    slot's worth kept back for the batch-1 cache of the request being prefilled. The prefix cache
    gets `prefix_cache_gb` (taken before the slots), or by default what the slots leave
    (DEFAULT_PREFIX_CACHE_GB when the usable memory is unknown). Backends that report no memory
    (CPU) get max_batch slots unless memory_gb is given. `shared_bytes` are taken once, before
    the slots (decode groups: one group's step transient, `split_transient`).
    """
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    if memory_gb is not None and not memory_gb > 0:
        raise ValueError(f"--memory-gb must be > 0, got {memory_gb}")
    if prefix_cache_gb is not None and not prefix_cache_gb >= 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0 (0 = off), got {prefix_cache_gb}")
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if not stats or "bytes_limit" not in stats:
        stats = None
    usable = None
    if stats is not None:
        usable = int(
            (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))) * memory_fraction
        )
    limit = None if memory_gb is None else int(memory_gb * 2**30)
    if limit is not None:
        usable = limit if usable is None else min(usable, limit)
    prefix = None if prefix_cache_gb is None else int(prefix_cache_gb * 2**30)
    fit = None
    if usable is None:
        slots = max_batch
        if prefix is None:
            prefix = int(DEFAULT_PREFIX_CACHE_GB * 2**30)
    else:
        fit = (usable - (prefix or 0) - shared_bytes) // per_slot - 1
        if fit < 1:
            room = f"{usable / 2**20:.1f} MiB are usable" + (
                f" ({prefix / 2**20:.1f} MiB of them for --prefix-cache-gb)" if prefix else ""
            )
            if shared_bytes:
                room += f", {shared_bytes / 2**20:.1f} MiB for one decode group's step"

            raise SlotDoesNotFit(
                f"not enough device memory for one decode slot: a slot needs {per_slot / 2**20:.1f} MiB "
                f"(plus one more for the prefill), {room}: lower --max-context (or raise --memory-gb, "
                "lower --prefix-cache-gb, use a smaller model / dtype)"
            )
        slots = min(max_batch, fit)
        if prefix is None:
            prefix = usable - (slots + 1) * per_slot - shared_bytes
    return MemoryPlan(
        num_slots=slots,
        slot_bytes=per_slot,
        prefix_bytes=max(prefix, 0),
        limit_bytes=limit,
        usable_bytes=usable,
        device_stats=stats,
        fit_slots=fit,
        shared_bytes=shared_bytes,
    )


def split_transient(parts: dict[str, int], group_rows: int | None) -> tuple[int, int]:
    """(bytes per slot, bytes held once) of a slot's `parts`: every part per slot without decode
    groups; with groups of `group_rows` rows the step transient is held for one group only (the
    groups' steps run one after another), so each slot keeps the rest and the plan takes
    group_rows x step_transient once."""
    total = sum(parts.values())
    if group_rows is None:
        return total, 0
    step = parts.get("step_transient", 0)
    return total - step, group_rows * step


def plan_slots(
    per_slot: int, max_batch: int, device=None, memory_fraction: float = 0.9
) -> tuple[int, dict | None]:
    """Number of decode slots without a prefix cache: (slots, device memory stats or None)."""
    plan = plan_memory(
        per_slot, max_batch, prefix_cache_gb=0, device=device, memory_fraction=memory_fraction
    )
    return plan.num_slots, plan.device_stats


MODES = ("ar", "chain", "pernode", "bole")


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """One decode mode's memory plan at the server's max context and memory settings.

    capacity:   KV slots per decode slot (`kv_capacity`: the mode's tree slack included).
    slot_bytes: `slot_bytes` by part.
    plan:       `plan_memory` of their sum, or None when not even one slot fits (`error`).
    """

    mode: str
    capacity: int
    slot_bytes: dict[str, int]
    plan: MemoryPlan | None
    error: str | None = None

    @property
    def per_slot(self) -> int:
        return sum(self.slot_bytes.values())

    @property
    def num_slots(self) -> int:
        """The slots this mode would run: min(--max-batch, what fits); 0 when none fits."""
        return 0 if self.plan is None else self.plan.num_slots

    @property
    def fit_slots(self) -> int | None:
        """The slots the usable memory holds before the --max-batch cap (None: unknown)."""
        return 0 if self.plan is None else self.plan.fit_slots


class FixedStats:
    """A device whose memory_stats() is a reading taken once (every mode plans the same memory)."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def plan_by_mode(
    cfg: ModelConfig,
    max_context: int,
    specs: dict[str, SpecConfig | None],
    dtype,
    max_batch: int,
    *,
    logprobs: int | None = None,
    memory_gb: float | None = None,
    prefix_cache_gb: float | None = None,
    device=None,
    memory_fraction: float = 0.9,
    group_rows: int | None = None,
) -> dict[str, ModePlan]:
    """The memory plan of every mode in `specs` (mode -> its SpecConfig, None for ar) for requests
    of up to `max_context` tokens, in the same usable memory (one device reading for all): per
    mode its KV capacity, slot bytes by part and the slots that fit. Invalid settings raise
    ValueError; a mode of which not even one slot fits gets plan None and the reason in `error`.
    With decode groups of `group_rows` rows (--slot-group) each mode's step transient is counted
    for one group (`split_transient`)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    fixed = FixedStats(stats)
    out = {}
    for mode, spec in specs.items():
        cap = kv_capacity(max_context, spec.slack if spec else 0)
        parts = slot_bytes(cfg, cap, max_context, spec, dtype, logprobs)
        rows = None if group_rows is None else min(group_rows, max_batch)
        per_slot, shared = split_transient(parts, rows)
        try:
            plan, error = (
                plan_memory(
                    per_slot,
                    max_batch,
                    memory_gb=memory_gb,
                    prefix_cache_gb=prefix_cache_gb,
                    device=fixed,
                    memory_fraction=memory_fraction,
                    shared_bytes=shared,
                ),
                None,
            )
        except SlotDoesNotFit as e:
            plan, error = None, str(e)
        out[mode] = ModePlan(mode, cap, parts, plan, error)
    return out


_TABLE_PARTS = (
    ("attention_kv", "kv"),
    ("gdn_state", "gdn_state"),
    ("drafter", "drafter"),
    ("output", "output"),
    ("step_transient", "step"),
)


def format_plan_table(plans: dict[str, ModePlan], running: str) -> str:
    """The per-mode memory plan as a small text table (MiB per slot by part, the slots each mode
    would run and, when the usable memory is known, how many fit it); `running` is marked '*'."""
    usable = next(
        (p.plan.usable_bytes for p in plans.values() if p.plan and p.plan.usable_bytes), None
    )
    head = ["  mode", "kv cap"] + [name for _, name in _TABLE_PARTS] + ["total", "slots"]
    head += [] if usable is None else ["fit"]
    rows = [head]
    for mode, p in plans.items():
        row = [("* " if mode == running else "  ") + mode, str(p.capacity)]
        row += [
            f"{p.slot_bytes[k] / 2**20:.2f}" if k in p.slot_bytes else "-" for k, _ in _TABLE_PARTS
        ]
        row += [f"{p.per_slot / 2**20:.2f}", str(p.num_slots)]
        row += [] if usable is None else [str(p.fit_slots)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    grouped = any(p.plan and p.plan.shared_bytes for p in plans.values())
    where = (
        "usable memory unknown"
        if usable is None
        else f"{usable / 2**30:.2f} GiB usable"
        if usable >= 2**30
        else f"{usable / 2**20:.1f} MiB usable"
    )
    return "\n".join(
        [
            "memory plan per mode (MiB per slot, slots at the same max context; "
            + where
            + ("; step: held for one decode group only" if grouped else "")
            + "):"
        ]
        + lines
    )
