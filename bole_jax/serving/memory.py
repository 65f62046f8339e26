"""Device memory of the serving engine: bytes per decode slot, and the split of the usable memory
between decode slots and the prefix cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bole_jax.model import parallel
from bole_jax.model.config import ModelConfig
from bole_jax.spec_decode.step import SpecConfig


def slot_bytes(
    cfg: ModelConfig, capacity: int, out_len: int, spec: SpecConfig | None, dtype
) -> dict[str, int]:
    """Device bytes one decode slot needs, by part (an estimate for admission, not an allocation).

    attention_kv: K and V of every full-attention layer, `capacity` tokens.
    gdn_state:    conv window (K-1 pre-conv inputs) and fp32 recurrent state of every GDN layer,
                  and with the lazy bole commit its pending commit: the step's factors of N
                  nodes (keys in the model dtype, k_scale, u, gamma) and its accepted path
                  (`PendingPath`), or with KernelOptions(lazy_rows="gather") the path's depth + 1 rows (k, u,
                  w, and p_sel); the count and accepted node are among the per-row scalars.
    drafter:      the MTP head's KV cache (capacity + draft slots) and its pending hidden states.
    output:       the [max_context] int32 output row and per-row scalars.
    step_transient: what one step allocates per row: fp32 logits of the verified nodes, and per GDN
                  layer the tree's token-level factors (bole) or one full state per node (pernode,
                  chain). Activations of the layer being computed are not counted (small).
    Under tensor parallelism (cfg.tp > 1) these are the bytes on ONE device: KV, GDN states,
    factors and logits are split over the heads / vocabulary they are sharded on (replicated
    groups count whole).
    """
    it = jnp.dtype(dtype).itemsize
    kv_shards, gdn_shards = parallel.shards(cfg, cfg.num_kv_heads), parallel.gdn_shards(cfg)
    vocab = cfg.vocab_size // parallel.shards(cfg, cfg.vocab_size)
    kv_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * it // kv_shards
    gdn_state = cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4 // gdn_shards
    conv = (cfg.conv_kernel - 1) * cfg.conv_dim * it // gdn_shards
    pending = 0
    if spec is not None and spec.pending_length:
        hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
        if spec.pending_nodes:
            pending = (
                spec.pending_nodes
                * (hk * (cfg.gdn_key_dim * it + 4) + hv * (cfg.gdn_value_dim + 1) * 4)
                // gdn_shards
                + spec.pending_length * 4
            )
        else:
            pending = (
                (spec.pending_length * (hk * cfg.gdn_key_dim + hv * (cfg.gdn_value_dim + 1)) + hv)
                * 4
                // gdn_shards
            )
    parts = {
        "attention_kv": len(cfg.attention_layers) * capacity * kv_per_token,
        "gdn_state": len(cfg.gdn_layers) * (conv + gdn_state + pending),
        "output": out_len * 4 + 64,
    }
    if spec is None:
        parts["step_transient"] = vocab * 4
    else:
        n, depth = spec.shape.num_nodes, spec.shape.depth
        parts["drafter"] = cfg.mtp_num_layers * (
            capacity + spec.shape.draft_slots + 1
        ) * kv_per_token + (depth + 1) * (cfg.hidden_size * it + 4)
        if spec.mode == "bole":
            per_node = (
                (
                    cfg.gdn_num_key_heads * cfg.gdn_key_dim
                    + cfg.gdn_num_value_heads * (cfg.gdn_value_dim + 1)
                )
                * 4
                + cfg.conv_dim * it
            ) // gdn_shards
        else:
            per_node = gdn_state + conv
        parts["step_transient"] = n * vocab * 4 + len(cfg.gdn_layers) * n * per_node
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
    """

    num_slots: int
    slot_bytes: int
    prefix_bytes: int
    limit_bytes: int | None
    usable_bytes: int | None
    device_stats: dict | None

    @property
    def planned_bytes(self) -> int:
        return (self.num_slots + 1) * self.slot_bytes + self.prefix_bytes


DEFAULT_PREFIX_CACHE_GB = 1.0  # prefix cache budget when the free memory is unknown (CPU)


def plan_memory(
    per_slot: int,
    max_batch: int,
    *,
    memory_gb: float | None = None,
    prefix_cache_gb: float | None = None,
    device=None,
    memory_fraction: float = 0.9,
) -> MemoryPlan:
    """Split the usable memory between decode slots and the prefix cache.

    Usable: min(free device memory * memory_fraction, memory_gb); the free memory comes from
    `device.memory_stats()` (after the weights are loaded). Slots: min(max_batch, what fits), one
    slot's worth kept back for the batch-1 cache of the request being prefilled. The prefix cache
    gets `prefix_cache_gb` (taken before the slots), or by default what the slots leave
    (DEFAULT_PREFIX_CACHE_GB when the usable memory is unknown). Backends that report no memory
    (CPU) get max_batch slots unless memory_gb is given.
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
    if usable is None:
        slots = max_batch
        if prefix is None:
            prefix = int(DEFAULT_PREFIX_CACHE_GB * 2**30)
    else:
        fit = (usable - (prefix or 0)) // per_slot - 1
        if fit < 1:
            room = f"{usable / 2**20:.1f} MiB are usable" + (
                f" ({prefix / 2**20:.1f} MiB of them for --prefix-cache-gb)" if prefix else ""
            )
            raise ValueError(
                f"not enough device memory for one decode slot: a slot needs {per_slot / 2**20:.1f} MiB "
                f"(plus one more for the prefill), {room}: lower --max-context (or raise --memory-gb, "
                "lower --prefix-cache-gb, use a smaller model / dtype)"
            )
        slots = min(max_batch, fit)
        if prefix is None:
            prefix = usable - (slots + 1) * per_slot
    return MemoryPlan(
        num_slots=slots,
        slot_bytes=per_slot,
        prefix_bytes=max(prefix, 0),
        limit_bytes=limit,
        usable_bytes=usable,
        device_stats=stats,
    )


def plan_slots(
    per_slot: int, max_batch: int, device=None, memory_fraction: float = 0.9
) -> tuple[int, dict | None]:
    """Number of decode slots without a prefix cache: (slots, device memory stats or None)."""
    plan = plan_memory(
        per_slot, max_batch, prefix_cache_gb=0, device=device, memory_fraction=memory_fraction
    )
    return plan.num_slots, plan.device_stats
