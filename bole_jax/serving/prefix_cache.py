"""Prefix cache for a hybrid model: attention KV per block plus recurrent-state checkpoints.

Design
------
- Blocks. Prompts are cut into blocks of `block_tokens` tokens. An entry holds one block: the KV
  rows of its positions in every attention layer (and in the MTP drafter's cache, in the spec
  modes), and the CHECKPOINT at its end: every GDN layer's conv window and fp32 recurrent state, and
  the hidden state of its last token (the MTP entry of the next position needs it).
- Why checkpoints. KV is per token: the rows of a block serve any continuation. A GDN layer's state
  sums the whole prefix into one matrix and cannot be rewound, so it can only be resumed where it
  was saved. The engine therefore prefills in block-aligned pieces (`take_block` after each full
  block); a request resumes at the deepest checkpoint of its longest cached chain of blocks
  (`resume`) and recomputes the blocks after it; `store` keeps each block it prefills.
- Where checkpoints are kept (`checkpoints`). A checkpoint is far bigger than a block's KV on the
  real models (Qwen3.5-27B dims, 256-token blocks: 147 MiB of GDN state against 16 MiB of KV), so
  by default ("sparse") an entry holds one only where a later request can resume: at the last full
  block of every prompt (the next turn of a conversation extends it) and at a branch point, the end
  of a matched chain that had none (the second prompt that leaves a shared prefix there recomputes
  it from the checkpoint before and stores one; a third resumes there). When a checkpoint is stored,
  the nearest checkpoint above it on the chain is dropped if nothing branches there (that entry has
  one child): a conversation keeps the checkpoint of its latest turn, not one per turn. "every"
  keeps a checkpoint in every entry (no recomputation, the most memory).
- Keys. An entry is found by (parent entry, the block's tokens): a hash chain over token blocks in
  which the dict compares the tokens themselves, so a hit is exact (no collision can alias two
  prefixes).
- Lookup. At most (n - 1) // block_tokens blocks of an n-token prompt are used, so at least one
  token is prefilled: its hidden state gives the first generated token.
- Eviction. LRU under a byte budget. A touch moves the entry and then its ancestors to the recent
  end (leaf first), so a parent is always more recent than its children: the least recent entry is
  a leaf, and a chain never loses an interior block. The chain being extended is pinned.

Entries are batch-1 device arrays owned by the cache; `restore_kv` / `restore_checkpoint` copy them
into a prefill cache (donated), so a later donation of that cache never frees an entry.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from bole_jax.model import parallel
from bole_jax.model.cache import AttnCache, Cache, GDNCache, committed_state, empty_pending_like


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefixBlock:
    """The device content of one entry (batch 1, P = block tokens).

    attn:   per attention layer (k, v), each [1, P, Hkv, D] model dtype.
    mtp:    per MTP layer (k, v) [1, P, Hkv, D], or None (ar).
    conv:   per GDN layer [1, K-1, C] model dtype, the conv window at the block's end.
    state:  per GDN layer [1, HV, dk, dv] fp32, the recurrent state at the block's end.
    h_last: [1, H] final-normed hidden state of the block's last token.
    conv, state and h_last (the checkpoint) are None in an entry that keeps its KV rows only.
    """

    attn: tuple
    mtp: tuple | None
    conv: tuple | None
    state: tuple | None
    h_last: jax.Array | None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))

    @property
    def has_checkpoint(self) -> bool:
        return self.h_last is not None

    def kv_only(self) -> "PrefixBlock":
        return dataclasses.replace(self, conv=None, state=None, h_last=None)

    def with_checkpoint(self, other: "PrefixBlock") -> "PrefixBlock":
        return dataclasses.replace(self, conv=other.conv, state=other.state, h_last=other.h_last)


def block_bytes(cfg, block_tokens: int, dtype, mtp: bool, checkpoint: bool = True) -> int:
    """Bytes of one entry (`PrefixBlock`) for the model `cfg`, with its checkpoint or (checkpoint
    False) its KV rows only, on one device under tensor parallelism (KV and GDN checkpoints split
    over their heads)."""
    it = jnp.dtype(dtype).itemsize
    kv_rows = 2 * block_tokens * cfg.num_kv_heads * cfg.head_dim * it
    kv_rows //= parallel.shards(cfg, cfg.num_kv_heads)
    n = len(cfg.attention_layers) * kv_rows + (cfg.mtp_num_layers * kv_rows if mtp else 0)
    return n + (checkpoint_bytes(cfg, dtype) if checkpoint else 0)


def checkpoint_bytes(cfg, dtype) -> int:
    """Bytes of one checkpoint (every GDN layer's conv window and state, the last hidden state)."""
    it = jnp.dtype(dtype).itemsize
    n = (
        len(cfg.gdn_layers)
        * (
            (cfg.conv_kernel - 1) * cfg.conv_dim * it
            + cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4
        )
        // parallel.gdn_shards(cfg)
    )
    return n + cfg.hidden_size * it


CHECKPOINT_POLICIES = ("sparse", "every")


# ------------------------------------------------------------------ device side (jitted)
@functools.partial(jax.jit, static_argnames=("size", "kv", "checkpoint"))
def take_block(
    cache: Cache,
    draft_kv,
    h_last: jax.Array,
    start: jax.Array,
    *,
    size: int,
    kv: bool = True,
    checkpoint: bool = True,
) -> PrefixBlock:
    """Copy rows [start, start + size) of a batch-1 prefill cache (kv) and its current checkpoint
    (checkpoint); what is not taken is left empty (() or None).

    Call right after the prefill piece that ended at start + size (the checkpoint is the cache's
    committed GDN state now, a pending lazy commit included). h_last [1, H]: that piece's last
    hidden state. Every output is a fresh buffer.
    """
    rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)  # [1, Hkv, S, D]
    attn = tuple((rows(c.k), rows(c.v)) for c in cache.layers if isinstance(c, AttnCache))
    gdn = [c for c in cache.layers if isinstance(c, GDNCache)]
    mtp = None if draft_kv is None else tuple((rows(c.k), rows(c.v)) for c in draft_kv)
    return PrefixBlock(
        attn=attn if kv else (),
        mtp=mtp if kv else None,
        conv=tuple(jnp.copy(c.conv) for c in gdn) if checkpoint else None,
        state=tuple(jnp.copy(committed_state(c)) for c in gdn) if checkpoint else None,
        h_last=jnp.copy(h_last) if checkpoint else None,
    )


def _replace_layers(layers: tuple, kind: type, values, fn) -> tuple:
    """`layers` with fn(layer, value) in place of each layer of type `kind` (values in order)."""
    values = iter(values)
    return tuple(fn(c, next(values)) if isinstance(c, kind) else c for c in layers)


@functools.partial(jax.jit, donate_argnames=("cache", "draft_kv"))
def restore_kv(cache: Cache, draft_kv, block: PrefixBlock, start: jax.Array):
    """Write a block's KV rows (target and MTP) at [start, start + P) of a batch-1 prefill cache."""
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, start, axis=2)
    put_kv = lambda c, kv: AttnCache(k=put(c.k, kv[0]), v=put(c.v, kv[1]))
    layers = _replace_layers(cache.layers, AttnCache, block.attn, put_kv)
    if draft_kv is not None:
        draft_kv = _replace_layers(draft_kv, AttnCache, block.mtp, put_kv)
    return dataclasses.replace(cache, layers=layers), draft_kv


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore_checkpoint(cache: Cache, block: PrefixBlock, length: jax.Array) -> Cache:
    """Set every GDN layer's conv window and recurrent state to the block's checkpoint, and the
    committed length to `length` (the block's end). The states are copied into the donated cache;
    a pending lazy commit there is dropped (cleared): the checkpoint is the whole committed state."""
    put = lambda big, small: jax.lax.dynamic_update_slice(big, small, (0,) * big.ndim)

    def restore(c: GDNCache, cs) -> GDNCache:
        pending = None if c.pending is None else empty_pending_like(c.pending)
        return GDNCache(conv=put(c.conv, cs[0]), state=put(c.state, cs[1]), pending=pending)

    layers = _replace_layers(cache.layers, GDNCache, zip(block.conv, block.state), restore)
    return Cache(layers=layers, lengths=jnp.full_like(cache.lengths, length))


# ------------------------------------------------------------------ host index
@dataclasses.dataclass(eq=False)
class Entry:
    """One cached block: `block` holds tokens [depth * P, (depth + 1) * P) of every prompt whose
    first (depth + 1) * P tokens equal the chain root -> ... -> this entry."""

    id: int
    parent: "Entry | None"
    tokens: tuple[int, ...]
    block: PrefixBlock
    nbytes: int
    depth: int
    children: int = 0


class PrefixCache:
    """Block-chained prefix entries with LRU eviction under `budget_bytes` (host bookkeeping; the
    entries' arrays live on the device). Not thread-safe: the engine thread owns it; `stats()` may
    be read from other threads (it only copies counters)."""

    def __init__(self, block_tokens: int, budget_bytes: int, checkpoints: str = "sparse"):
        if block_tokens < 1:
            raise ValueError(f"--prefix-block must be >= 1 token, got {block_tokens}")
        if checkpoints not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"--prefix-checkpoints must be one of {CHECKPOINT_POLICIES}, got {checkpoints!r}"
            )
        self.block_tokens = block_tokens
        self.checkpoints = checkpoints
        self.budget_bytes = max(int(budget_bytes), 0)
        self.bytes = 0
        self._index: dict[tuple[int, tuple[int, ...]], Entry] = {}  # (parent id or -1, tokens)
        self._lru: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # oldest first
        self._ids = itertools.count()
        self.inserted = 0
        self.evicted = 0
        self.rejected = 0  # blocks not stored: no room even after evicting every unpinned leaf
        self.checkpointed = 0  # entries holding a checkpoint now
        self.checkpoints_dropped = 0  # checkpoints dropped from an entry that stays (sparse)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._lru)

    def blocks_of(self, tokens: Sequence[int], end: int) -> list[tuple[int, ...]]:
        """The full blocks of tokens[:end]."""
        p = self.block_tokens
        return [tuple(tokens[i : i + p]) for i in range(0, end - p + 1, p)]

    def match(self, tokens: Sequence[int]) -> list[Entry]:
        """The longest cached chain for a prompt, leaving at least its last token out (see module
        docstring). Touches the chain (LRU)."""
        chain: list[Entry] = []
        parent = -1
        for blk in self.blocks_of(tokens, len(tokens) - 1):
            e = self._index.get((parent, blk))
            if e is None:
                break
            chain.append(e)
            parent = e.id
        if chain:
            self._touch(chain[-1])
        return chain

    def resume(self, tokens: Sequence[int]) -> tuple[list[Entry], int | None]:
        """Where a prompt resumes: (its chain up to and including the deepest checkpoint on its
        longest cached chain, to restore; the index of that longest chain's last block when it is
        recomputed because it held no checkpoint, else None: `store` gives it one)."""
        chain = self.match(tokens)
        k = max((i for i, e in enumerate(chain) if e.block.has_checkpoint), default=-1)
        return chain[: k + 1], (len(chain) - 1 if k < len(chain) - 1 else None)

    def store(
        self,
        parent: Entry | None,
        tokens: Sequence[int],
        start: int,
        branch: int | None,
        take: Callable[..., PrefixBlock],
    ) -> Entry | None:
        """After prefilling the full block tokens[start : start + P] of a prompt whose chain so
        far ends at `parent`: find or insert its entry, with a checkpoint where the policy keeps
        one (every block; else the prompt's last full block and `branch`, from `resume`).
        take(kv=..., checkpoint=...) copies that much of the block from the prefill cache. Returns
        the entry, or None when it could not be stored (the prompt stores no further block)."""
        p = self.block_tokens
        index = start // p
        want = self.checkpoints == "every" or index in (len(tokens) // p - 1, branch)
        blk = tuple(tokens[start : start + p])
        entry = self.child(parent, blk)
        if entry is None:
            return self.insert(parent, blk, take(kv=True, checkpoint=want))
        if want and not entry.block.has_checkpoint:
            self._add_checkpoint(entry, take(kv=False, checkpoint=True))
        return entry

    def store_prompt(self, tokens: Sequence[int], take: Callable[..., PrefixBlock]) -> int:
        """The index's side of prefilling a whole prompt at once (`resume`, then `store` for every
        full block after the restored chain), for replays without a device; the engine calls them
        piece by piece. Returns the prompt tokens resumed from the cache."""
        p = self.block_tokens
        chain, branch = self.resume(tokens)
        parent = chain[-1] if chain else None
        for start in range(len(chain) * p, len(tokens) - p + 1, p):
            parent = self.store(parent, tokens, start, branch, take)
            if parent is None:
                break
        return len(chain) * p

    def _add_checkpoint(self, entry: Entry, block: PrefixBlock) -> None:
        """Attach the checkpoint of `block` to an entry that keeps its KV rows only, unless it does
        not fit (the entry stays as it was)."""
        new = entry.block.with_checkpoint(block)
        extra = new.nbytes - entry.nbytes
        if not self._make_room(extra, pinned=entry):
            self.rejected += 1
            return
        entry.block, entry.nbytes = new, entry.nbytes + extra
        self.bytes += extra
        self.checkpointed += 1
        self._thin(entry)
        self._touch(entry)

    def _thin(self, entry: Entry) -> None:
        """Sparse: drop the nearest checkpoint above a newly checkpointed entry where nothing
        branches (its entry has one child, so every prompt through it continues towards `entry`)."""
        if self.checkpoints != "sparse":
            return
        a = entry.parent
        while a is not None and not a.block.has_checkpoint:
            a = a.parent
        if a is not None and a.children == 1:
            kv = a.block.kv_only()
            freed = a.nbytes - kv.nbytes
            a.block, a.nbytes = kv, a.nbytes - freed
            self.bytes -= freed
            self.checkpointed -= 1
            self.checkpoints_dropped += 1

    def child(self, parent: Entry | None, tokens: tuple[int, ...]) -> Entry | None:
        """The cached block `tokens` right after `parent` (None: at the start), touched; or None."""
        e = self._index.get((-1 if parent is None else parent.id, tokens))
        if e is not None:
            self._touch(e)
        return e

    def insert(
        self, parent: Entry | None, tokens: tuple[int, ...], block: PrefixBlock
    ) -> Entry | None:
        """Store the block that follows `parent` (None: the first block). Returns the entry (an
        existing one when the block is already cached), or None when it does not fit or the parent
        was evicted meanwhile (the chain cannot continue)."""
        assert len(tokens) == self.block_tokens, (len(tokens), self.block_tokens)
        if parent is not None and self._lru.get(parent.id) is not parent:
            return None
        key = (-1 if parent is None else parent.id, tokens)
        e = self._index.get(key)
        if e is None:
            nbytes = block.nbytes
            if not self._make_room(nbytes, pinned=parent):
                self.rejected += 1
                return None
            e = Entry(
                next(self._ids),
                parent,
                tokens,
                block,
                nbytes,
                0 if parent is None else parent.depth + 1,
            )
            self._index[key] = e
            self._lru[e.id] = e
            self.bytes += nbytes
            self.inserted += 1
            if parent is not None:
                parent.children += 1
            if block.has_checkpoint:
                self.checkpointed += 1
                self._thin(e)
        self._touch(e)
        return e

    def clear(self) -> None:
        self._index.clear()
        self._lru.clear()
        self.bytes = 0
        self.checkpointed = 0

    def _touch(self, e: Entry | None) -> None:
        while e is not None:  # leaf first: every ancestor ends up more recent than its descendants
            self._lru.move_to_end(e.id)
            e = e.parent

    def _make_room(self, nbytes: int, pinned: Entry | None) -> bool:
        if nbytes > self.budget_bytes:
            return False
        while self.bytes + nbytes > self.budget_bytes:
            victim = next(
                (e for e in self._lru.values() if e.children == 0 and e is not pinned), None
            )
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, e: Entry) -> None:
        assert e.children == 0, "only leaves are evicted"
        del self._lru[e.id]
        del self._index[(-1 if e.parent is None else e.parent.id, e.tokens)]
        if e.parent is not None:
            e.parent.children -= 1
        self.bytes -= e.nbytes
        self.evicted += 1
        self.checkpointed -= e.block.has_checkpoint
        e.block = None  # drop the device arrays now
