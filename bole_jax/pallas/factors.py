"""The token-level factors a tree verify returns, and the not-yet-applied commits built from them.

A GDN (or SSD) layer's verify returns `TreeFactors` (k, u, gamma per node) instead of per-node
states; the state after any node follows from them and the committed state (docs/algorithm.md,
token-level factors). The lazy commit keeps the accepted path's part of them for the next verify
to fold in: as gathered rows (`PendingCommit`) or as the factors plus the path (`PendingPath`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeFactors:
    """Token-level factors of one GDN layer's verify (docs/algorithm.md, token-level factors).

    With them, the state after any node `sel` is
    S_sel = exp(gamma_sel) S_pre + sum_{j in anc*(sel)} exp(gamma_sel - gamma_j) k_j u_j^T.
    where k_j are the L2-normalised keys (`keys()`). A GDN verify keeps the keys as it took them
    (`k`, the caller's array: bf16 in a model) with one fp32 factor per row (`k_scale`, the
    rsqrt the verify normalised with), not a normalised fp32 copy: k_j = k_scale_j * k_j
    exactly as the verify formed it. At Qwen3-Next dims a node's factors then take 4 KiB of
    keys (16 key heads, bf16) + 16 KiB of u instead of 8 + 16 KiB (101x smaller than a per-node
    fp32 state, not 85x), and the verify does not write the keys at all.
    Padding nodes have zero u, gamma and k_scale (their k is whatever the caller passed; `keys()`
    zeroes it). An SSD layer (`tree_ssd`) returns the same type with k = Mamba2's B (k_scale
    None: used as it is) and u = v = dt x (no pseudo values).
    """

    k: jax.Array  # [B, N, Hk, dk] the keys as verify took them (k_scale None: the keys used)
    u: jax.Array  # [B, N, HV, dv] fp32, pseudo values U = (I + G)^-1 diag(b) (V - diag(P) K S_pre)
    gamma: jax.Array  # [B, N, HV] fp32, root-path cumulative log gate
    k_scale: jax.Array | None = None  # [B, N, Hk] fp32, rsqrt(sum k^2 + eps); 0 on padding

    def keys(self) -> jax.Array:
        """[B, N, Hk, dk] fp32: the keys the state is built from (k_scale * k, padding 0)."""
        return scaled_keys(self.k, self.k_scale)


def scaled_keys(k, k_scale):
    """k [..., dk] times its per-row k_scale [...] in fp32, rows of scale 0 zeroed (NaN-safe);
    k as fp32 when k_scale is None. `TreeFactors.keys()`, or any gathered rows of it."""
    k = k.astype(jnp.float32)
    if k_scale is None:
        return k
    s = k_scale.astype(jnp.float32)[..., None]
    return jnp.where(s != 0, k * s, 0.0)


def with_keys(k, outs):
    """(o, u, gamma, k_scale[, state]) of a verify launch -> (o, TreeFactors[, state]) with the
    keys k as the factor k. Called outside the launch's jit: a jit that returns one of its
    arguments returns a copy (XLA copies an undonated parameter it outputs), and the keys are
    the caller's already."""
    o, u, gamma, k_scale, *state = outs
    return (o, TreeFactors(k=k, u=u, gamma=gamma, k_scale=k_scale), *state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCommit:
    """A selected-state commit not yet applied to the state (the lazy commit).

    The accepted node's root-path factor rows, gathered, so that the next verify can fold them
    into the state tile it loads anyway (one state read + write per step instead of the commit's
    read + write plus the verify's read):
        S = p_sel S + sum_{m < count} w_m k_m u_m^T   (value head h uses key head h // (HV/Hk)).
    Rows m >= count weigh 0; count 0 with p_sel 1 is "nothing pending" (`empty`).
    """

    k: jax.Array  # [B, L, Hk, dk] fp32, L2-normalised keys of the path nodes (accepted first)
    u: jax.Array  # [B, L, HV, dv] fp32, their pseudo values
    w: jax.Array  # [B, L, HV] fp32, exp(gamma_sel - gamma_j) (0 past count)
    p_sel: jax.Array  # [B, HV] fp32, exp(gamma_sel) (1: nothing accepted)
    count: jax.Array  # [B] int32, real rows

    @staticmethod
    def empty(batch: int, length: int, hk: int, dk: int, hv: int, dv: int) -> "PendingCommit":
        return PendingCommit(
            k=jnp.zeros((batch, length, hk, dk), jnp.float32),
            u=jnp.zeros((batch, length, hv, dv), jnp.float32),
            w=jnp.zeros((batch, length, hv), jnp.float32),
            p_sel=jnp.ones((batch, hv), jnp.float32),
            count=jnp.zeros((batch,), jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingPath:
    """The same not-yet-applied commit as `PendingCommit`, kept as the previous verify's factors
    and its accepted path instead of gathered rows: the next verify reads the path's rows
    straight from the factors, so the lazy commit needs no launch of its own (no gather).
        S = p_sel S + sum_{m < count} w_m k_m u_m^T,   row m = node path[m],
        w_m = exp(gamma_sel - gamma_m), p_sel = exp(gamma_sel), gamma_sel = gamma[sel]
    (`tree_gdn_commit.pending_commit` gathers the same rows). Nothing is pending when sel < 0 or
    count is 0 (then p_sel = 1 and no row is read; `empty`).
    """

    factors: TreeFactors  # the previous verify's: k [B, M, Hk, dk], k_scale [B, M, Hk] fp32,
    #                       u [B, M, HV, dv] fp32, gamma [B, M, HV] fp32 (M = its tree's nodes)
    path: jax.Array  # [B, L] int32 node ids (any order; entries past count are not read)
    sel: jax.Array  # [B] int32, the accepted node (-1: nothing)
    count: jax.Array  # [B] int32, nodes on its root path (0: nothing)

    @staticmethod
    def empty(
        batch: int,
        nodes: int,
        length: int,
        hk: int,
        dk: int,
        hv: int,
        dv: int,
        k_dtype=jnp.bfloat16,
    ) -> "PendingPath":
        """Nothing pending, in the layout a decode loop carries (factors of `nodes` nodes, a path
        of `length` rows)."""
        factors = TreeFactors(
            k=jnp.zeros((batch, nodes, hk, dk), k_dtype),
            u=jnp.zeros((batch, nodes, hv, dv), jnp.float32),
            gamma=jnp.zeros((batch, nodes, hv), jnp.float32),
            k_scale=jnp.zeros((batch, nodes, hk), jnp.float32),
        )
        return PendingPath(
            factors=factors,
            path=jnp.zeros((batch, length), jnp.int32),
            sel=jnp.full((batch,), -1, jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
        )

    def live_count(self) -> jax.Array:
        """[B] int32: the rows to fold (0 where nothing is pending)."""
        return jnp.where(self.sel >= 0, jnp.asarray(self.count, jnp.int32), 0)


def check_pending(pending: PendingCommit, b: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """ValueError unless a pending commit's rows fit a verify of these shapes (any row count)."""
    length = pending.k.shape[1]
    want = dict(
        k=(b, length, hk, dk), u=(b, length, hv, dv), w=(b, length, hv), p_sel=(b, hv), count=(b,)
    )
    got = {name: tuple(jnp.shape(getattr(pending, name))) for name in want}
    if got != want:
        raise ValueError(f"pending rows {got} do not match the verify's shapes: need {want}")


def check_pending_path(pending: PendingPath, b: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """ValueError unless a pending path's factors fit a verify of these shapes (any node count
    M, any path length L)."""
    f = pending.factors
    m, length = f.u.shape[1], jnp.shape(pending.path)[1]
    if f.k_scale is None:
        raise ValueError("a pending path needs GDN factors with k_scale (a verify's)")
    want = dict(k=(b, m, hk, dk), k_scale=(b, m, hk), u=(b, m, hv, dv), gamma=(b, m, hv))
    got = {name: tuple(jnp.shape(getattr(f, name))) for name in want}
    want.update(path=(b, length), sel=(b,), count=(b,))
    got.update(
        {name: tuple(jnp.shape(getattr(pending, name))) for name in ("path", "sel", "count")}
    )
    if got != want:
        raise ValueError(f"pending path {got} does not match the verify's shapes: need {want}")
