"""Prefix cache: the host index (chained keys, longest match, LRU of leaves) and the device copies.

The end-to-end checks (greedy outputs with the cache on equal LLM.generate, hit counters, eviction,
chunked prefill interleaved with decoding) are in test_server.py, next to the engine fixtures.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.model import Cache, ModelConfig, init_cache
from bole_jax.model.cache import AttnCache, GDNCache, committed_state
from bole_jax.model.mtp import init_mtp_cache
from bole_jax.pallas.factors import PendingCommit
from bole_jax.serving.prefix_cache import (
    PrefixBlock,
    PrefixCache,
    block_bytes,
    restore_checkpoint,
    restore_kv,
    take_block,
)

P = 4  # block tokens


def _block(nbytes: int = 400) -> PrefixBlock:
    return PrefixBlock(
        attn=(), mtp=None, conv=(), state=(), h_last=jnp.zeros((nbytes // 4,), jnp.float32)
    )


def _store(pc: PrefixCache, tokens: list[int]) -> list:
    """What the engine does while prefilling `tokens`: match, then one entry per new full block."""
    chain = pc.match(tokens)
    parent = chain[-1] if chain else None
    for i in range(len(chain) * P, len(tokens) - P + 1, P):
        blk = tuple(tokens[i : i + P])
        parent = pc.child(parent, blk) or pc.insert(parent, blk, _block())
        if parent is None:
            break
    return chain


def test_longest_chain_leaves_one_token_to_prefill():
    pc = PrefixCache(P, 10_000, "every")
    a = list(range(1, 13))  # 3 full blocks
    assert _store(pc, a) == [] and len(pc) == 3
    assert len(pc.match(a)) == 2  # 12 tokens: the last block would leave nothing to prefill
    assert len(pc.match(a + [99])) == 3
    assert len(pc.match(a[:4] + [0] + a[5:] + [99])) == 1  # diverges inside block 2
    assert pc.match([7] + a) == []  # same tokens, other positions: no match
    assert pc.match(a[:4]) == []


def test_lru_evicts_leaves_and_never_the_chain_being_extended():
    pc = PrefixCache(P, 3 * 400, "every")  # three blocks
    a, b = list(range(1, 14)), list(range(100, 113))
    _store(pc, a)  # a1 a2 a3
    assert len(pc) == 3 and pc.bytes == 1200
    _store(pc, b[:9])  # b1 evicts a3 (the least recent leaf), b2 evicts a2 (a leaf by then)
    assert pc.evicted == 2 and len(pc) == 3
    assert len(pc.match(a)) == 1 and len(pc.match(b[:9])) == 2
    # A chain that does not fit: its own parent is pinned, so the last block is rejected.
    small = PrefixCache(P, 2 * 400, "every")
    _store(small, a)
    assert len(small) == 2 and small.rejected == 1 and len(small.match(a)) == 2
    # Touching a chain protects it: after matching b, a1 is the least recent leaf.
    pc.match(b[:9])
    _store(pc, list(range(200, 205)))
    assert len(pc.match(a)) == 0 and len(pc.match(b[:9])) == 2
    assert pc.bytes == 3 * 400


def test_disabled_and_oversized():
    assert not PrefixCache(P, 0).enabled
    pc = PrefixCache(P, 100)
    assert pc.insert(None, (1, 2, 3, 4), _block(400)) is None and pc.rejected == 1 and len(pc) == 0
    with pytest.raises(ValueError, match="--prefix-block"):
        PrefixCache(0, 100)
    with pytest.raises(ValueError, match="--prefix-checkpoints"):
        PrefixCache(P, 100, "some")


KV, CK = 128, 300  # bytes of a block's KV rows and of a checkpoint in the sparse tests


def _kv_block(checkpoint: bool) -> PrefixBlock:
    h = jnp.zeros((CK // 4,), jnp.float32) if checkpoint else None
    attn = ((jnp.zeros((KV // 8,), jnp.float32), jnp.zeros((KV // 8,), jnp.float32)),)
    return PrefixBlock(attn=attn, mtp=None, conv=None if h is None else (), state=None, h_last=h)


def _prefill(pc: PrefixCache, tokens: list[int]) -> int:
    """The engine's prefill of `tokens` on fake blocks. Returns the tokens resumed."""
    return pc.store_prompt(tokens, lambda kv, checkpoint: _kv_block(checkpoint))


def _checkpointed(pc: PrefixCache, tokens: list[int]) -> list[bool]:
    return [e.block.has_checkpoint for e in pc.match(tokens + [0])]


def test_sparse_checkpoints_at_prompt_ends_and_branch_points():
    pc = PrefixCache(P, 100_000)
    a = list(range(1, 15))  # 3 full blocks + 2 tokens
    assert _prefill(pc, a) == 0
    assert _checkpointed(pc, a) == [False, False, True]  # the prompt's last full block only
    assert pc.bytes == 3 * KV + CK and pc.checkpointed == 1
    # The next turn extends the prompt: resumes at its end, and the old end's checkpoint goes
    # (nothing branches there).
    a2 = a + list(range(50, 60))  # 6 full blocks
    assert _prefill(pc, a2) == 3 * P
    assert _checkpointed(pc, a2) == [False] * 5 + [True]
    assert pc.bytes == 6 * KV + CK and pc.checkpoints_dropped == 1
    # A prompt leaving the chain after 2 blocks: nothing to resume from; its branch point and its
    # own end get checkpoints, and the branch point stays (two children).
    b = a[:8] + list(range(70, 80))
    assert _prefill(pc, b) == 0
    assert _checkpointed(pc, b) == [False, True, False, True]
    assert _checkpointed(pc, a2) == [False, True, False, False, False, True]
    assert pc.checkpointed == 3 and pc.bytes == 8 * KV + 3 * CK
    # A third prompt through the branch point resumes there.
    c = a[:8] + list(range(90, 95))
    assert _prefill(pc, c) == 2 * P
    assert pc.bytes == len(pc) * KV + pc.checkpointed * CK


def test_every_block_checkpointed_and_eviction_of_sparse_entries():
    every = PrefixCache(P, 100_000, "every")
    a = list(range(1, 15))
    assert _prefill(every, a) == 0 and _checkpointed(every, a) == [True] * 3
    assert _prefill(every, a[:8] + [99] * 5) == 2 * P  # any block boundary resumes
    # Sparse entries under a budget: the bytes held never pass it; leaves go first.
    pc = PrefixCache(P, 4 * KV + CK)
    _prefill(pc, a)  # 3 KV + 1 checkpoint
    _prefill(pc, list(range(200, 210)))  # 2 blocks + checkpoint: a's leaf is evicted
    assert pc.bytes <= pc.budget_bytes and pc.evicted >= 1
    assert pc.bytes == len(pc) * KV + pc.checkpointed * CK


def test_take_and_restore_round_trip():
    """A block taken from one prefill cache and restored into a fresh one gives the same rows and
    checkpoint, and survives the donation of both caches."""
    cfg = ModelConfig.tiny("qwen3_next", mtp_num_layers=1)
    key = iter(jax.random.split(jax.random.key(0), 64))
    rand = lambda x: (
        jax.random.normal(next(key), x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
    )
    src = jax.tree.map(rand, init_cache(cfg, 1, 64, "float32"))
    src_mtp = jax.tree.map(rand, init_mtp_cache(cfg, 1, 80, "float32"))
    h = jax.random.normal(next(key), (1, cfg.hidden_size))
    blk = take_block(src, src_mtp, h, jnp.int32(8), size=8)
    assert blk.nbytes == block_bytes(cfg, 8, "float32", mtp=True)
    dst, dst_mtp = init_cache(cfg, 1, 64, "float32"), init_mtp_cache(cfg, 1, 80, "float32")
    dst, dst_mtp = restore_kv(dst, dst_mtp, blk, jnp.int32(8))
    dst = restore_checkpoint(dst, blk, jnp.int32(16))
    assert int(dst.lengths[0]) == 16
    for s, d in zip(src.layers, dst.layers):
        if isinstance(s, AttnCache):
            np.testing.assert_array_equal(d.k[:, :, 8:16], s.k[:, :, 8:16])
            np.testing.assert_array_equal(d.v[:, :, :8], 0)
        else:
            assert isinstance(s, GDNCache)
            np.testing.assert_array_equal(d.state, s.state)
            np.testing.assert_array_equal(d.conv, s.conv)
    np.testing.assert_array_equal(dst_mtp[0].k[:, :, 8:16], src_mtp[0].k[:, :, 8:16])
    # Donating the caches (as the next prefill piece does) must leave the entry intact.
    restore_kv(src, src_mtp, blk, jnp.int32(0))
    restore_checkpoint(dst, blk, jnp.int32(16))
    assert all(not x.is_deleted() for x in jax.tree.leaves(blk))
    np.testing.assert_array_equal(blk.h_last, h)


def random_pending(cache, cfg, seed: int, length: int = 3):
    """`cache` with a random lazy commit pending in every GDN layer (count 2 of `length` rows):
    what a bole decode state holds between two steps. numpy-made (no per-shape compiles)."""
    rng = np.random.default_rng(seed)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    layers = []
    for c in cache.layers:
        if isinstance(c, GDNCache):
            b, hv, dk, dv = c.state.shape
            w = np.abs(rng.standard_normal((b, length, hv))) * (
                np.arange(length)[None, :, None] < 2
            )
            c = GDNCache(
                conv=c.conv,
                state=c.state,
                pending=PendingCommit(
                    k=rand(b, length, cfg.gdn_num_key_heads, dk),
                    u=rand(b, length, hv, dv),
                    w=jnp.asarray(w, jnp.float32),
                    p_sel=jnp.full((b, hv), 0.5, jnp.float32),
                    count=jnp.full((b,), 2, jnp.int32),
                ),
            )
        layers.append(c)
    return Cache(layers=tuple(layers), lengths=cache.lengths)


def test_checkpoints_hold_the_committed_state():
    """Lazy bole commit: a checkpoint taken from a cache with rows pending holds the committed
    state apply_pending(state, pending), and restoring it leaves nothing pending."""
    cfg = ModelConfig.tiny("qwen3_next")
    rng = np.random.default_rng(3)
    src = jax.tree.map(
        lambda x: (
            jnp.asarray(rng.standard_normal(x.shape), x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        init_cache(cfg, 1, 16, "float32"),
    )
    src = random_pending(src, cfg, 1)
    blk = take_block(src, None, jnp.zeros((1, cfg.hidden_size)), jnp.int32(0), size=4)
    gdn = [c for c in src.layers if isinstance(c, GDNCache)]
    for c, state in zip(gdn, blk.state):
        assert not np.allclose(committed_state(c), c.state)  # something really was pending
        np.testing.assert_allclose(state, committed_state(c), rtol=1e-6, atol=1e-6)
    dst = random_pending(init_cache(cfg, 1, 16, "float32"), cfg, 2)
    dst = restore_checkpoint(dst, blk, jnp.int32(4))
    for c, state in zip([c for c in dst.layers if isinstance(c, GDNCache)], blk.state):
        np.testing.assert_array_equal(c.pending.count, 0)
        np.testing.assert_array_equal(c.pending.p_sel, 1)
        np.testing.assert_array_equal(committed_state(c), state)


def test_memory_estimates_are_per_device_under_tp():
    """slot_bytes / block_bytes count one device's share of the sharded groups."""
    import dataclasses

    from bole_jax.model import ModelConfig
    from bole_jax.serving.memory import slot_bytes
    from bole_jax.serving.prefix_cache import block_bytes
    from bole_jax.spec_decode.step import SpecConfig

    cfg = ModelConfig.tiny(
        "qwen3_5", num_kv_heads=2, gdn_num_key_heads=2, gdn_num_value_heads=4, vocab_size=512
    )
    spec = SpecConfig.for_mode("bole", num_nodes=8)
    one = slot_bytes(cfg, 128, 64, spec, "float32")
    two = slot_bytes(dataclasses.replace(cfg, tp=2), 128, 64, spec, "float32")
    for part in ("attention_kv", "gdn_state", "step_transient"):
        assert two[part] * 2 == one[part], part
    assert two["output"] == one["output"]
    assert 2 * block_bytes(dataclasses.replace(cfg, tp=2), 16, "float32", True) == pytest.approx(
        block_bytes(cfg, 16, "float32", True) + cfg.hidden_size * 4, rel=0
    )
    # 3 KV heads do not split over 2 devices: replicated, counted whole.
    odd = dataclasses.replace(cfg, num_kv_heads=3, num_heads=6, tp=2)
    assert (
        slot_bytes(odd, 128, 64, None, "float32")["attention_kv"]
        == slot_bytes(dataclasses.replace(odd, tp=1), 128, 64, None, "float32")["attention_kv"]
    )
