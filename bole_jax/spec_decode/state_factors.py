"""Selected-state commit from token-level factors (01-bole-algorithm.md section 3).

Verify never forms per-node states. Once acceptance has picked the last accepted node `sel` of
each request, its state follows exactly from the committed state and the layer's factors:
    S_sel = P_sel S_pre + K^T diag(w) U,  w_j = exp(gamma_sel - gamma_j) on anc*(sel), else 0,
with P_sel = exp(gamma_sel): one gather and one batched matmul per GDN layer. Rejected branches
cost nothing. The conv state is a token-level factor too: the last K-1 pre-conv inputs along the
accepted root path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bole_jax.pallas.tree_gdn import commit_state_pallas
from bole_jax.pallas.tree_utils import TreeFactors, conv_window_indices, resolve_backend

__all__ = ["commit_state", "commit_conv_state", "accepted_path"]


def accepted_path(parents, accepted, length: int):
    """[B, length] int32: node `accepted`, its parent, grandparent, ... (-1 past the root).

    A walk up the parent pointers (fused gathers), so no ancestor mask is needed.
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[1]
    cur = jnp.asarray(accepted, jnp.int32)
    out = []
    for _ in range(length):
        out.append(cur)
        nxt = jnp.take_along_axis(parents, jnp.clip(cur, 0, n - 1)[:, None], axis=1)[:, 0]
        cur = jnp.where(cur >= 0, nxt, -1)
    return jnp.stack(out, axis=1)


def commit_state(state, factors: TreeFactors, parents, accepted, *, max_path: int | None = None,
                 precision: str | None = "highest", backend: str = "auto",
                 interpret: bool | None = None, block_v: int = 64, num_warps: int = 4):
    """New committed GDN state of each request.

    state [B, HV, dk, dv] fp32 (the state verify started from); factors from `tree_gdn_verify`;
    parents [B, N] int32; accepted [B] int32 = last accepted node (-1: nothing accepted, the
    state is kept). Returns [B, HV, dk, dv] fp32.

    max_path: static bound on nodes on any root path (the tree depth bound): only that many
    factor rows are gathered (None = N, always exact).
    backend "reference" (the default off GPU): gathers + one batched einsum; precision: of the
    [dk, path] x [path, dv] matmul ("highest" = fp32; None = backend default, TF32 on GPU).
    backend "pallas" (the default on GPU): `tree_gdn.commit_state_pallas`, the path rows
    gathered per state tile and added in one fp32 dot (precision does not apply), at the
    commit's bytes floor.
    """
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "pallas":
        return commit_state_pallas(state, factors, parents, accepted, block_v=block_v,
                                   num_warps=num_warps, max_path=max_path, interpret=interpret)
    return _commit_state_einsum(state, factors, parents, accepted, max_path=max_path,
                                precision=precision)


@functools.partial(jax.jit, static_argnames=("max_path", "precision"))
def _commit_state_einsum(state, factors: TreeFactors, parents, accepted, *, max_path, precision):
    b, n, hk, dk = factors.k.shape
    hv, dv = factors.u.shape[2:]
    r = hv // hk
    path = accepted_path(parents, accepted, n if max_path is None else min(max_path, n))
    rows = jnp.arange(b)[:, None]
    node = jnp.clip(path, 0, n - 1)  # [B, L]
    gamma_sel = factors.gamma[rows[:, 0], node[:, 0]]  # [B, HV]
    w = jnp.where((path >= 0)[:, :, None],
                  jnp.exp(jnp.minimum(gamma_sel[:, None, :] - factors.gamma[rows, node], 0.0)),
                  0.0)  # [B, L, HV]
    k_path, u_path = factors.k[rows, node], factors.u[rows, node]  # [B, L, Hk, dk], [B, L, HV, dv]
    # GQA without repeating keys: value head h = (key head h // r, member h % r).
    length = path.shape[1]
    prec = jax.lax.Precision.HIGHEST if precision == "highest" else None
    delta = jnp.einsum("bmgd,bmgr,bmgrv->bgrdv", k_path, w.reshape(b, length, hk, r),
                       u_path.reshape(b, length, hk, r, dv), precision=prec)
    s_pre = state.astype(jnp.float32)
    new = jnp.exp(gamma_sel)[:, :, None, None] * s_pre + delta.reshape(b, hv, dk, dv)
    return jnp.where((path[:, 0] >= 0)[:, None, None, None], new, s_pre)


@jax.jit
def commit_conv_state(conv_state, x_nodes, parents, accepted):
    """New conv state [B, K-1, C]: the last K-1 pre-conv inputs along the accepted root path,
    topped up from the old conv state when the path is shorter than K-1.

    conv_state [B, K-1, C] (newest last); x_nodes [B, N, C] pre-conv inputs of the tree nodes;
    parents [B, N]; accepted [B] int32 (-1 keeps the old conv state).
    """
    b, n, _ = x_nodes.shape
    width = conv_state.shape[1] + 1
    accepted = jnp.asarray(accepted, jnp.int32)
    sel = jnp.clip(accepted, 0, n - 1)
    win = conv_window_indices(parents, width)[jnp.arange(b), sel, 1:]  # [B, K-1] rows of src
    src = jnp.concatenate([conv_state, x_nodes.astype(conv_state.dtype)], axis=1)
    new = jnp.take_along_axis(src, win[:, :, None], axis=1)
    return jnp.where((accepted >= 0)[:, None, None], new, conv_state)
